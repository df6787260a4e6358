"""The e2e benchmark's arithmetic: time to a smoothed target, final reward, idle and wait fractions."""

from __future__ import annotations

from actors.tools.bench.e2e import SMOOTH_STEPS, seconds_to_target, steps_to_target, summarize_run


def _records(rewards: list[float], *, idle: float = 0.2, wait_s: float = 0.1) -> list[dict]:
    return [
        {
            "step": i + 1,
            "time_s": float(i + 1) * 2.0,
            "reward/unfiltered_mean": r,
            "time/wait_s": wait_s,
            "time/step_s": 0.5,
            "staleness/mean": 1.0,
            "generators": {"gen-0": {"idle_fraction_total": idle + i * 0.01}},
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
