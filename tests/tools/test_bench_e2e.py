"""The e2e benchmark's arithmetic: time to a smoothed target, final reward, idle, wait and busy fractions."""

from __future__ import annotations

from typing import Any

import pytest

from actors.tools.bench.e2e import (
    SMOOTH_STEPS,
    bottleneck_busy_fraction,
    generator_busy_fraction,
    seconds_to_target,
    steps_to_target,
    summarize_run,
    trainer_busy_fraction,
)


def _records(rewards: list[float], *, idle: float = 0.2, wait_s: float = 0.1) -> list[dict]:
    return [
        {
            "step": i + 1,
            "time_s": float(i + 1) * 2.0,
            "reward/unfiltered_mean": r,
            "time/wait_s": wait_s,
            "time/step_s": 0.5,
            "staleness/mean": 1.0,
            "generators": {"gen-0": {"idle_fraction_total": idle + i * 0.01, "uptime_s": 10.0 + 2.0 * i}},
        }
        for i, r in enumerate(rewards)
    ]


def test_one_lucky_step_does_not_reach_the_target() -> None:
    records = _records([0.1, 0.95, 0.1, 0.1, 0.1, 0.1])
    assert seconds_to_target(records, 0.8) is None


def test_target_is_reached_when_the_moving_average_is() -> None:
    rewards = [0.1] * 5 + [0.9] * 10
    records = _records(rewards)
    step = steps_to_target(records, 0.8)
    # the window of SMOOTH_STEPS values first averages >= 0.8 once 0.9*k + 0.1*(5-k) >= 4.0, i.e. k = 5
    assert step == 5 + SMOOTH_STEPS
    assert seconds_to_target(records, 0.8) == 2.0 * step


def test_summary_reports_final_reward_and_fractions() -> None:
    records = _records([0.1] * 5 + [0.9] * 15, idle=0.2, wait_s=0.1)
    summary = summarize_run(records, 0.8)
    assert abs(summary["final_reward"] - 0.9) < 1e-12
    assert summary["first_reward"] == 0.1
    assert abs(summary["trainer_wait_fraction"] - 0.1 / 0.5) < 1e-12
    assert abs(summary["generator_idle_fraction"] - (0.2 + 19 * 0.01)) < 1e-12
    assert abs(summary["generator_idle_fraction_to_target"] - (0.2 + 9 * 0.01)) < 1e-12
    assert summary["mean_staleness"] == 1.0
    assert summary["bottleneck"] in ("trainer", "generators")
    assert 0.0 <= summary["bottleneck_busy_fraction"] <= 1.0
    assert summary["bottleneck_busy_fraction"] == max(
        summary["trainer_busy_fraction"], summary["generator_busy_fraction"]
    )
    assert 0.0 <= summary["bottleneck_busy_fraction_to_target"] <= 1.0


def _step(step: int, time_s: float, wait_s: float, generators: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """A trainer record; `generators`: id -> (busy seconds since start, uptime seconds)."""
    return {
        "step": step,
        "time_s": time_s,
        "time/wait_s": wait_s,
        "generators": {
            gid: {"idle_fraction_total": 1.0 - busy_s / uptime_s, "uptime_s": uptime_s}
            for gid, (busy_s, uptime_s) in generators.items()
        },
    }


def test_trainer_busy_fraction_leaves_out_the_start_up_wait() -> None:
    # step 1 waited 30 s for the first batch (start-up); steps 2..5 span 8 s and waited 2 s of it
    records = [_step(1, 31.0, 30.0, {})] + [_step(n, 31.0 + 2.0 * (n - 1), 0.5, {}) for n in range(2, 6)]
    assert trainer_busy_fraction(records) == pytest.approx(1.0 - 2.0 / 8.0)
    assert trainer_busy_fraction(records[:1]) is None


def test_generator_busy_fraction_pools_generators_over_their_reported_windows() -> None:
    # gen-a: 10 s of start-up idle, then busy 9 of the next 10 s; gen-b: busy 5 of 10 s, reporting only later
    records = [
        _step(1, 1.0, 0.0, {"gen-a": (0.0, 10.0)}),
        _step(2, 2.0, 0.0, {"gen-a": (4.0, 14.0), "gen-b": (1.0, 3.0)}),
        _step(3, 3.0, 0.0, {"gen-a": (9.0, 20.0), "gen-b": (6.0, 13.0)}),
    ]
    assert generator_busy_fraction(records) == pytest.approx((9.0 + 5.0) / (10.0 + 10.0))
    assert generator_busy_fraction(records[:1]) is None
    assert generator_busy_fraction([_step(1, 1.0, 0.0, {})]) is None


def test_the_busier_role_is_the_bottleneck() -> None:
    assert bottleneck_busy_fraction(0.4, 0.97) == ("generators", 0.97)
    assert bottleneck_busy_fraction(0.95, 0.6) == ("trainer", 0.95)
    assert bottleneck_busy_fraction(None, 0.6) == (None, None)
    assert bottleneck_busy_fraction(0.5, None) == (None, None)


def test_a_starved_pipeline_has_a_low_bottleneck_fraction() -> None:
    # the lock-step shape of a synchronous run: the trainer waits half of each step, the generator is
    # busy only while the trainer waits
    records = [_step(n, 2.0 * n, 1.0, {"gen-0": (1.0 * n, 2.0 * n)}) for n in range(1, 11)]
    summary = summarize_run(records, 0.8)
    assert summary["trainer_busy_fraction"] == pytest.approx(0.5)
    assert summary["generator_busy_fraction"] == pytest.approx(0.5)
    assert summary["bottleneck_busy_fraction"] == pytest.approx(0.5)


def test_bottleneck_to_target_counts_only_the_steps_until_the_target() -> None:
    # reward 0.9 from the start: the smoothed target is reached at step SMOOTH_STEPS; the trainer never
    # waits until then and waits 1.5 of every 2 s afterwards (the filtered tail of a run)
    records = [
        {
            **_step(n, 2.0 * n, 0.0 if n <= SMOOTH_STEPS else 1.5, {"gen-0": (1.0 * n, 2.0 * n)}),
            "reward/unfiltered_mean": 0.9,
        }
        for n in range(1, 2 * SMOOTH_STEPS + 1)
    ]
    summary = summarize_run(records, 0.8)
    assert summary["steps_to_target"] == SMOOTH_STEPS
    assert summary["bottleneck_busy_fraction_to_target"] == pytest.approx(1.0)
    window_s = 2.0 * (2 * SMOOTH_STEPS - 1)
    assert summary["trainer_busy_fraction"] == pytest.approx(1.0 - 1.5 * SMOOTH_STEPS / window_s)
    assert summary["bottleneck_busy_fraction"] == pytest.approx(max(0.5, 1.0 - 1.5 * SMOOTH_STEPS / window_s))


def test_a_wait_for_groups_already_queued_is_work_not_starvation() -> None:
    # steps 2..5 each wait 0.5 s of 2 s; before steps 2 and 3 the queue held the 17 groups they consumed
    records = [
        {**_step(n, 2.0 * n, 0.5, {}), "groups/trained": 16, "groups/dropped": 1, "queue/trajectories": queued}
        for n, queued in zip(range(1, 6), [17, 40, 3, None, 0], strict=True)
    ]
    # steps 4 and 5 follow a queue of 3 and an unknown one: their 1.0 s of waiting is starvation
    assert trainer_busy_fraction(records) == pytest.approx(1.0 - 1.0 / 8.0)
