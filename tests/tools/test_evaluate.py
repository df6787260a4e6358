"""`leeway eval`: a published version, pulled bit-exact from the store, evaluated on the task's held-out prompts
through the real command; fixed seeds (the same JSON twice), pass@k over the samples, and the version asked
for is the version evaluated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from actors.models import build_policy_model, eos_token_id, load_tokenizer
from actors.trainer.sessions import build_weight_publisher
from pipeline.config import load_config
from pipeline.tasks import get_task
from storage.filestore import FileStore
from tests.support.builders import REPO

CONFIG = REPO / "configs" / "reasoning-gym.yaml"
EVAL_PROMPTS = 12


def _overrides(store: Path) -> list[str]:
    return [
        f"store.url=file://{store}",
        "run.name=eval-test",
        "task.args.size=50",
        f"task.args.eval_size={EVAL_PROMPTS}",
        "eval.samples_per_prompt=4",
    ]


def _publish_two_versions(store_dir: Path) -> int:
    """Version 0: the run's initial weights. Version 1: the same with <eos> made certain, so every reply is empty.
    Returns the size of the eval split (one-digit sums repeat: eval items that are train questions are left out)."""
    cfg = load_config(CONFIG, _overrides(store_dir))
    task = get_task(cfg.task.name, **cfg.task.args)
    tokenizer = load_tokenizer(cfg, task)
    torch.manual_seed(cfg.run.seed)
    model = build_policy_model(cfg, tokenizer)
    with FileStore(store_dir) as store:
        publisher = build_weight_publisher(cfg, store, model)
        tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
        publisher.publish(0, tensors)
        eos = eos_token_id(tokenizer)
        tensors = {k: v.clone() for k, v in tensors.items()}
        tensors["lm_head.weight"][eos] *= 10  # the final hidden state points along <eos>'s output row
        tensors["transformer.ln_f.weight"].zero_()
        tensors["transformer.ln_f.bias"].copy_(tensors["lm_head.weight"][eos] * 1e2)
        publisher.publish(1, tensors)
        publisher.close()
    held_out = task.eval_prompts() or []
    assert 0 < len(held_out) <= EVAL_PROMPTS
    return len(held_out)


def _eval(store_dir: Path, *extra: str) -> tuple[int, str]:
    sets = [a for o in _overrides(store_dir) for a in ("--set", o)]
    proc = subprocess.run(
        [sys.executable, "-m", "actors.cli", "eval", str(CONFIG), *sets, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_leeway_eval_scores_the_version_asked_for_on_held_out_prompts_with_fixed_seeds(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    held_out = _publish_two_versions(store_dir)
    rc, out = _eval(store_dir, "--version", "0")
    assert rc == 0, out
    first = json.loads(out.strip().splitlines()[-1])
    assert first["version"] == 0 and first["prompts"] == held_out and first["samples_per_prompt"] == 4
    assert sum(first["statuses"].values()) == 4 * held_out and first["unrunnable"] == {}
    assert 0.0 <= first["pass@1"] <= first["pass@4"] <= 1.0
    assert set(first["by_tag"]) == {"chain_sum", "eval"}  # only the eval split: no "train" tag
    again = json.loads(_eval(store_dir, "--version", "0")[1].strip().splitlines()[-1])
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in first.items() if k != "seconds"}
    # the latest version (1) writes <eos> at once: every reply is empty and scores 0
    rc, out = _eval(store_dir)
    latest = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and latest["version"] == 1
    assert latest["mean_reward"] == 0.0 and latest["pass@4"] == 0.0
    # a version never published is refused, saying which
    rc, out = _eval(store_dir, "--version", "7")
    assert rc == 2 and "version 7" in out


def test_leeway_eval_refuses_a_task_without_an_eval_split(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "actors.cli",
            "eval",
            str(REPO / "configs" / "demo.yaml"),
            "--set",
            f"store.url=file://{tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "has no eval split" in proc.stdout + proc.stderr
