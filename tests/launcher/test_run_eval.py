"""Periodic held-out evaluation in `leeway run` (`eval.every_steps`): the run's evaluator evaluates version 0 and
every N-th version on the task's eval split, never on a prompt the run trains on, each at exactly its version
(the same result as `leeway eval --version V` on that version afterwards), into eval.jsonl, TensorBoard, metrics.jsonl,
the summary and the plot."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import numpy as np

from infra.stack import StackState
from pipeline.config import load_config
from tests.support.runs import COMMON, REPO, leeway_argv, run_records, run_to_end

STEPS, EVERY = 6, 3


def test_a_run_evaluates_every_n_versions_on_held_out_prompts_at_exactly_those_versions(
    tmp_path: Path, stack: StackState, cleanup: list[subprocess.Popen[bytes]]
) -> None:
    sets = [
        *COMMON,
        f"run.name=eval-{uuid.uuid4().hex[:8]}",
        f"run.dir={tmp_path / 'run'}",
        f"nats.stack_dir={stack.dir}",
        f"trainer.max_steps={STEPS}",
        f"eval.every_steps={EVERY}",
        "eval.samples_per_prompt=2",
        "task.args.size=300",
        "task.args.eval_size=20",
        "weights.keep_versions=20",
        "logging.tensorboard=true",
    ]
    cfg = load_config(str(REPO / "configs" / "reasoning-gym.yaml"), sets)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    run_dir = cfg.run.run_dir
    text = run_to_end(config_path, run_dir, cleanup)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == list(range(0, STEPS + 1, EVERY)), evals
    for record in evals:
        assert set(record["by_tag"]) == {"chain_sum", "eval"}  # the eval split only
        assert sum(record["statuses"].values()) == 2 * record["prompts"] > 0
    trained = [gid for r in run_records(run_dir) for gid in r.get("trained_group_ids") or []]
    assert trained and all("-train-" in gid and "-eval-" not in gid for gid in trained)
    # each result belongs to its version: evaluating that version again, alone, gives the same result
    middle = evals[1]
    again = subprocess.run(
        leeway_argv("eval", str(config_path), "--version", str(middle["version"])),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    alone = json.loads(again.stdout.strip().splitlines()[-1])
    assert {k: v for k, v in alone.items() if k != "seconds"} == {k: v for k, v in middle.items() if k != "seconds"}
    # the same curve in TensorBoard (the evaluator's own writer, at step = version) and in metrics.jsonl (each step
    # carries the newest result the trainer saw; how many it saw depends on who was faster, what it saw must match)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tb" / "eval"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("eval/mean_reward")] == [
        (e["version"], float(np.float32(e["mean_reward"])))
        for e in evals  # TensorBoard keeps float32
    ]
    by_version = {e["version"]: e for e in evals}
    folded = [r for r in run_records(run_dir) if "eval/version" in r]
    for record in folded:
        assert record["eval/pass@1"] == by_version[record["eval/version"]]["pass@1"]
    assert [r["eval/version"] for r in folded] == sorted({r["eval/version"] for r in folded})
    assert "held-out eval, mean reward / pass@1" in (run_dir / "summary.md").read_text()
    shown = [line for line in text.splitlines() if line.startswith("eval version ")]  # the live view, plain
    assert [line.split(":")[0] for line in shown] == [f"eval version {e['version']}" for e in evals], text
