"""`leeway bench learning`'s summary: the held-out curve against trainer time, and the time-to-accuracy ratio."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.tools.bench.learning import eval_curve, seconds_to_accuracy, smoothed, summarize_learning


def _records(seconds_per_step: float, steps: int) -> list[dict]:
    return [{"step": s, "time_s": s * seconds_per_step, "staleness/mean": 1.0} for s in range(1, steps + 1)]


def _evals(points: dict[int, float]) -> list[dict]:
    return [{"version": v, "pass@1": p} for v, p in points.items()]


def test_the_curve_puts_each_evaluated_version_at_its_trainer_step_time_and_version_0_at_zero() -> None:
    evals = [*_evals({20: 0.5, 0: 0.3, 10: 0.4}), {"version": 30, "skipped": "pruned"}]
    curve = eval_curve(evals, _records(2.0, 30))
    assert curve == [
        {"version": 0, "seconds": 0.0, "pass@1": 0.3},
        {"version": 10, "seconds": 20.0, "pass@1": 0.4},
        {"version": 20, "seconds": 40.0, "pass@1": 0.5},
    ]


def test_time_to_accuracy_reads_the_running_mean_so_one_lucky_evaluation_does_not_count() -> None:
    curve = eval_curve(_evals({0: 0.3, 10: 0.45, 20: 0.41, 30: 0.5}), _records(1.0, 30))
    assert smoothed(curve) == pytest.approx([0.3, 0.375, 0.38666667, 0.45333333])
    assert seconds_to_accuracy(curve, 0.45) == 30.0  # the spike at version 10 alone does not reach it
    assert seconds_to_accuracy(curve, 0.45, window=1) == 10.0
    assert seconds_to_accuracy(curve, 0.46) is None


def test_the_ratio_is_sync_over_async_time_to_the_lower_final_accuracy() -> None:
    sft = {"pass1": 0.31, "seconds": 40.0, "transformers_greedy_pass1": 0.6, "leeway_greedy_pass1": 0.6}
    asynchronous = {
        "curve": eval_curve(_evals({0: 0.3, 10: 0.4, 20: 0.5, 30: 0.54}), _records(1.0, 30)),
        "seconds": 30.0,
        "mean_staleness": 1.2,
    }
    sync = {
        "curve": eval_curve(_evals({0: 0.3, 10: 0.38, 20: 0.46, 30: 0.52}), _records(2.0, 30)),
        "seconds": 60.0,
        "mean_staleness": 0.0,
    }
    result = summarize_learning(sft, asynchronous, sync, target=None)
    # the run's own version-0 evaluation is the SFT checkpoint's, with the run's eval settings
    assert result["sft_eval_pass1"] == 0.3 and result["sft_checkpoint_eval_pass1"] == 0.31
    assert result["rl_eval_pass1"] == 0.54 and result["gain"] == pytest.approx(0.24)
    assert result["recipe_seconds"] == 70.0 and result["mean_staleness"] == 1.2
    assert result["sft_transformers_greedy_pass1"] == result["sft_leeway_greedy_pass1"] == 0.6
    assert result["target_pass1"] == pytest.approx((0.38 + 0.46 + 0.52) / 3)  # the lower smoothed final
    assert result["async_seconds_to_accuracy"] == 30.0 and result["sync_seconds_to_accuracy"] == 60.0
    assert result["async_vs_sync_time_to_accuracy"] == 2.0
    assert result["async_vs_sync_seconds_per_step"] == 2.0
    assert result["final_accuracy_gap"] == pytest.approx(0.02)
    assert result["sync_version0_pass1"] == 0.3
    # a target one run never reaches gives no ratio rather than a made-up one
    assert summarize_learning(sft, asynchronous, sync, target=0.49)["async_vs_sync_time_to_accuracy"] is None


def test_without_a_sync_run_there_is_no_ratio_key() -> None:
    asynchronous = {"curve": eval_curve(_evals({0: 0.3, 10: 0.2}), _records(1.0, 10)), "seconds": 10.0}
    result = summarize_learning({"pass1": 0.3, "seconds": 5.0}, {**asynchronous, "mean_staleness": None}, None, None)
    assert result["gain"] == pytest.approx(-0.1) and "async_vs_sync_time_to_accuracy" not in result


def test_the_plot_draws_both_curves_into_a_png(tmp_path: Path) -> None:
    from actors.tools.bench.learning import plot_curves

    run = {"curve": eval_curve(_evals({0: 0.3, 10: 0.4, 20: 0.5}), _records(1.0, 20)), "seconds": 20.0}
    result = summarize_learning(
        {"pass1": 0.3, "seconds": 5.0}, {**run, "mean_staleness": 1.0}, {**run, "mean_staleness": 0.0}, None
    )
    plot_curves(result, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
