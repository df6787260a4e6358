"""`leeway bench e2e`: the demo task synchronous vs asynchronous, through the whole pipeline.

Both runs use the same config, seed, model and sample budget (trainer.max_steps x batch x group);
only the staleness cap differs: `max_staleness: 0` (every rollout uses the trainer's current
weights, so generation waits for each new version) against `max_staleness: 2` (the default
correction). Each run gets its own embedded stack and run directory, so they cannot interfere.
The headline is a ratio measured in the same invocation (`speedup`), not an absolute time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_TARGET = 0.8
DEFAULT_MAX_STEPS = 250
"""Enough to pass the target (~200 steps) and see the final reward; past it most groups agree and are filtered."""
SMOOTH_STEPS = 5
"""Reward is a noisy 16-group mean; time to target uses a moving average over this many steps."""
FINAL_STEPS = 10
"""`final_reward` is the mean unfiltered reward of the last this many steps."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/demo.yaml", help="config of both runs (default: the demo)")
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET, help="reward to reach (smoothed)")
    parser.add_argument("--async-staleness", type=int, default=2, help="max_staleness of the async run")
    parser.add_argument("--generators", type=int, default=1, help="generator processes per run")
    parser.add_argument(
        "--max-steps", type=int, default=DEFAULT_MAX_STEPS, help="optimizer steps of each run (the sample budget)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override applied to both runs (repeatable)",
    )
    parser.add_argument("--dir", default=None, help="keep both runs' directories here (default: a temp dir)")


def seconds_to_target(records: list[dict[str, Any]], target: float) -> float | None:
    """Wall-clock seconds (trainer time) at the first step whose smoothed unfiltered reward reaches target."""
    window: list[float] = []
    for record in records:
        reward = record.get("reward/unfiltered_mean")
        if reward is None:
            continue
        window = [*window[-(SMOOTH_STEPS - 1) :], float(reward)]
        if len(window) == SMOOTH_STEPS and sum(window) / SMOOTH_STEPS >= target:
            return float(record["time_s"])
    return None


def steps_to_target(records: list[dict[str, Any]], target: float) -> int | None:
    seconds = seconds_to_target(records, target)
    if seconds is None:
        return None
    return next(int(r["step"]) for r in records if float(r["time_s"]) == seconds)


def summarize_run(records: list[dict[str, Any]], target: float) -> dict[str, Any]:
    rewards = [float(r["reward/unfiltered_mean"]) for r in records if r.get("reward/unfiltered_mean") is not None]
    tail = rewards[-FINAL_STEPS:]
    staleness = [float(r["staleness/mean"]) for r in records if r.get("staleness/mean") is not None]
    to_target = steps_to_target(records, target)
    at_target = next((r for r in records if r["step"] == to_target), None) if to_target else None
    return {
        "steps": int(records[-1]["step"]) if records else 0,
        "seconds": float(records[-1]["time_s"]) if records else None,
        "seconds_to_target": seconds_to_target(records, target),
        "steps_to_target": steps_to_target(records, target),
        "first_reward": rewards[0] if rewards else None,
        "final_reward": sum(tail) / len(tail) if tail else None,
        "trainer_wait_fraction": _wait_fraction(records),
        "trainer_wait_fraction_to_target": _wait_fraction([r for r in records if to_target and r["step"] <= to_target]),
        "generator_idle_fraction": _idle_fraction(records[-1] if records else None),
        "generator_idle_fraction_to_target": _idle_fraction(at_target),
        "mean_staleness": sum(staleness) / len(staleness) if staleness else None,
        "dropped_by_cap": int(records[-1].get("samples/dropped_by_cap_total", 0)) if records else 0,
    }


def _wait_fraction(records: list[dict[str, Any]]) -> float | None:
    wait = sum(float(r.get("time/wait_s") or 0) for r in records)
    total = sum(float(r.get("time/step_s") or 0) for r in records)
    return wait / total if total else None


def _idle_fraction(record: dict[str, Any] | None) -> float | None:
    """Mean over generators of the idle fraction since each started (`idle_fraction_total` of their reports)."""
    reports = (record or {}).get("generators", {}) or {}
    idle = [float(g["idle_fraction_total"]) for g in reports.values() if g.get("idle_fraction_total") is not None]
    return sum(idle) / len(idle) if idle else None


def _run_once(args: argparse.Namespace, root: Path, label: str, staleness: int) -> dict[str, Any]:
    from actors.launcher.run import run_pipeline
    from pipeline.config import load_config

    overrides = [
        *args.overrides,
        f"staleness.max_staleness={staleness}",
        f"trainer.max_steps={args.max_steps}",
        f"run.name=bench-{label}",
        f"run.dir={root / label}",
        f"nats.stack_dir={root / label / 'no-shared-stack'}",
    ]
    cfg = load_config(args.config, overrides)
    print(f"bench e2e: {label} run (max_staleness={staleness}) ...", file=sys.stderr)
    outcome = run_pipeline(cfg, num_generators=args.generators, fresh=True)
    if outcome.trainer_rc != 0:
        raise RuntimeError(
            f"bench e2e: the {label} trainer exited with {outcome.trainer_rc}; see {outcome.trainer_log}"
        )
    summary = summarize_run(outcome.records, args.target)
    print(f"bench e2e: {label}: {summary}", file=sys.stderr)
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="leeway-bench-e2e-") as tmp:
        root = Path(args.dir) if args.dir else Path(tmp)
        sync = _run_once(args, root, "sync", 0)
        asynchronous = _run_once(args, root, "async", args.async_staleness)
    sync_s, async_s = sync["seconds_to_target"], asynchronous["seconds_to_target"]
    result: dict[str, Any] = {"target_reward": args.target}
    result.update({f"sync.{k}": v for k, v in sync.items()})
    result.update({f"async.{k}": v for k, v in asynchronous.items()})
    result["speedup"] = sync_s / async_s if sync_s and async_s else None
    if sync["final_reward"] is not None and asynchronous["final_reward"] is not None:
        result["final_reward_gap"] = asynchronous["final_reward"] - sync["final_reward"]
    return result
