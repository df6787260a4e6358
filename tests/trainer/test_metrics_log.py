"""The trainer's metrics log: each step record carries the newest held-out evaluation the evaluator wrote since
the step before (eval.jsonl, another process, possibly mid-line), and TensorBoard gets the steps' scalars."""

from __future__ import annotations

import json
from pathlib import Path

from actors.trainer.metrics_log import EVAL_LOG, MetricsLog, eval_scalars
from pipeline.config import LeewayConfig
from tests.support.builders import metrics_records


def _eval(version: int, pass1: float) -> dict[str, object]:
    return {
        "version": version,
        "prompts": 4,
        "samples_per_prompt": 2,
        "temperature": 1.0,
        "mean_reward": pass1 / 2,
        "pass@1": pass1,
        "pass@2": pass1,
        "by_tag": {"chain_sum": pass1},
        "statuses": {"ok": 8},
        "unrunnable": {},
        "seconds": 0.5,
    }


def test_eval_scalars_flatten_a_result_and_a_skipped_version_has_none() -> None:
    flat = eval_scalars(_eval(3, 0.25))
    assert flat["eval/version"] == 3 and flat["eval/pass@1"] == 0.25 and flat["eval/pass@2"] == 0.25
    assert flat["eval/by_tag/chain_sum"] == 0.25 and flat["eval/status/ok"] == 8
    assert "eval/temperature" not in flat and "eval/samples_per_prompt" not in flat
    assert eval_scalars({"version": 4, "skipped": "pruned"}) == {}


def test_each_step_carries_the_newest_evaluation_since_the_step_before(tmp_path: Path) -> None:
    eval_path = tmp_path / EVAL_LOG
    log = MetricsLog(LeewayConfig(), tmp_path / "metrics.jsonl", eval_path=eval_path)
    log.write({"step": 1, "loss": 0.5})  # no eval.jsonl yet
    with eval_path.open("a") as f:
        f.write(json.dumps(_eval(0, 0.1)) + "\n" + json.dumps(_eval(2, 0.3)) + "\n")
        f.write(json.dumps(_eval(4, 0.9))[:20])  # the evaluator is mid-line
    log.write({"step": 2, "loss": 0.4})
    log.write({"step": 3, "loss": 0.3})  # nothing new
    with eval_path.open("a") as f:
        f.write(json.dumps(_eval(4, 0.9))[20:] + "\n" + json.dumps({"version": 6, "skipped": "pruned"}) + "\n")
    log.write({"step": 4, "loss": 0.2})
    log.close()
    records = metrics_records(tmp_path / "metrics.jsonl")
    assert [r.get("eval/version") for r in records] == [None, 2, None, 4]
    assert records[1]["eval/pass@1"] == 0.3 and records[3]["eval/pass@1"] == 0.9
    assert records[3]["loss"] == 0.2


def test_tensorboard_gets_the_step_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LeewayConfig.model_validate({"logging": {"tensorboard": True}})
    log = MetricsLog(cfg, tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step, "note": "text is left out"})
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("loss")] == [(1, 1.0), (2, 0.5), (3, 0.3333)]
