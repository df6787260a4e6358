"""`leeway bench e2e`: the demo task synchronous vs asynchronous, through the whole pipeline.

Both runs use the same config, seed, model and sample budget (trainer.max_steps x batch x group);
only the staleness cap differs: `max_staleness: 0` (every rollout uses the trainer's current
weights, so generation waits for each new version) against `max_staleness: 2` (the default
correction). Each run gets its own embedded stack and run directory, so they cannot interfere.
The headline is a ratio measured in the same invocation (`speedup`), not an absolute time.

Per run it also reports how well the pipeline keeps its slowest role fed: ``bottleneck`` (``trainer`` or
``generators``, whichever is busier) and ``bottleneck_busy_fraction``, that role's busy share of the wall
time over the trainer's steps (`bottleneck_busy_fraction`, from `trainer_busy_fraction` and
`generator_busy_fraction`), and the same up to the step that reached the target (``_to_target``: past it
most groups agree, are filtered, and the trainer waits longer for trainable ones). An asynchronous run
should hold it near 1; a synchronous one cannot.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from actors.cli_args import add_set_argument

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
    add_set_argument(parser, help="config override applied to both runs (repeatable)")
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
    trainer_busy, generator_busy = trainer_busy_fraction(records), generator_busy_fraction(records)
    bottleneck, bottleneck_busy = bottleneck_busy_fraction(trainer_busy, generator_busy)
    until_target = [r for r in records if to_target and r["step"] <= to_target]
    _, bottleneck_busy_to_target = bottleneck_busy_fraction(
        trainer_busy_fraction(until_target), generator_busy_fraction(until_target)
    )
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
        "trainer_busy_fraction": trainer_busy,
        "generator_busy_fraction": generator_busy,
        "bottleneck": bottleneck,
        "bottleneck_busy_fraction": bottleneck_busy,
        "bottleneck_busy_fraction_to_target": bottleneck_busy_to_target,
        "mean_staleness": sum(staleness) / len(staleness) if staleness else None,
        "dropped_by_cap": int(records[-1].get("samples/dropped_by_cap_total", 0)) if records else 0,
    }


def trainer_busy_fraction(records: list[dict[str, Any]]) -> float | None:
    """Share of the trainer's wall time between its first and last step not spent starving for data.

    The window runs from the end of step 1 to the end of the last step (``time_s``), so the first wait,
    which covers start-up (model build, the generators' first batch), is left out. A step's
    ``time/wait_s`` counts as starving unless the queue after the previous step (``queue/trajectories``,
    groups in the stream not yet delivered) already held every group the step consumed
    (``groups/trained + groups/dropped``): then the wait was the trainer fetching and decoding groups
    that were there, which is work. Computing, publishing, acking and bookkeeping count as busy.
    None with fewer than two steps.
    """
    if len(records) < 2:
        return None
    window_s = float(records[-1]["time_s"]) - float(records[0]["time_s"])
    if window_s <= 0:
        return None
    starved_s = sum(
        float(record.get("time/wait_s") or 0)
        for previous, record in zip(records, records[1:], strict=False)
        if not _was_queued(previous, record)
    )
    return _clip01(1.0 - starved_s / window_s)


def _was_queued(previous: dict[str, Any], record: dict[str, Any]) -> bool:
    """Whether every group `record`'s step consumed was already in the stream when the step began."""
    queued = previous.get("queue/trajectories")
    consumed = int(record.get("groups/trained") or 0) + int(record.get("groups/dropped") or 0)
    return queued is not None and consumed > 0 and int(queued) >= consumed


def generator_busy_fraction(records: list[dict[str, Any]]) -> float | None:
    """Share of the generators' wall time spent inside `Engine.generate`, over the trainer's steps.

    Each generator report carries its uptime and its idle fraction since start, hence its busy seconds
    ``(1 - idle_fraction_total) * uptime_s``. Per generator the window runs from its report in the first
    record that holds one to its report in the last; the role's fraction pools all generators (busy
    seconds over window seconds), so start-up before the trainer's first step does not count. None
    when no generator reported twice.
    """
    first: dict[str, dict[str, Any]] = {}
    last: dict[str, dict[str, Any]] = {}
    for record in records:
        for generator_id, report in (record.get("generators") or {}).items():
            if report.get("uptime_s") is None or report.get("idle_fraction_total") is None:
                continue
            first.setdefault(generator_id, report)
            last[generator_id] = report
    busy_s = window_s = 0.0
    for generator_id, start in first.items():
        end = last[generator_id]
        span_s = float(end["uptime_s"]) - float(start["uptime_s"])
        if span_s <= 0:
            continue
        window_s += span_s
        busy_s += _busy_s(end) - _busy_s(start)
    return _clip01(busy_s / window_s) if window_s > 0 else None


def bottleneck_busy_fraction(trainer: float | None, generators: float | None) -> tuple[str | None, float | None]:
    """The slower role and its busy fraction: whether the pipeline keeps its slowest part fed.

    Both roles handle the same stream of samples over the same wall time, so the one that needs more of
    that time (the larger busy fraction) is the slower one; the faster one waits for it. A value near 1
    means the bottleneck never starves; well below 1 means both roles wait (e.g. on each other, as a
    synchronous run does). None when either fraction is unknown.
    """
    if trainer is None or generators is None:
        return None, None
    return ("trainer", trainer) if trainer >= generators else ("generators", generators)


def _busy_s(report: dict[str, Any]) -> float:
    return (1.0 - float(report["idle_fraction_total"])) * float(report["uptime_s"])


def _clip01(value: float) -> float:
    return min(1.0, max(0.0, value))


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
