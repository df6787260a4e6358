"""`leeway bench learning`: the reasoning recipe from scratch, SFT then RL, judged on held-out prompts.

    leeway sft CONFIG --fresh          ──►  <dir>/sft/            the SFT checkpoint, eval.json
    run_pipeline(model = <dir>/sft)    ──►  <dir>/async/          max_staleness from the config (asynchronous)
    run_pipeline(model = <dir>/sft)    ──►  <dir>/sync/           max_staleness 0 (synchronous), same sample budget

Both RL runs start from the same checkpoint with the same seed and the same number of optimizer steps; only the
staleness cap differs. Their evaluator (`leeway eval --follow`, ``eval.every_steps``) scores version 0 (the SFT
checkpoint itself) and every ``eval.every_steps``-th version on the task's eval split, with the same sample seeds
every time, so ``sft_eval_pass1`` and ``rl_eval_pass1`` are measured on the same held-out prompts and replies
differ only by the weights. Version 0 of an RL run is the SFT checkpoint, so its pass@1 equals the one
`leeway sft` wrote (``sft_eval_pass1`` is the run's, ``sft_checkpoint_eval_pass1`` the one `leeway sft` wrote).
``sft_seconds`` is the `leeway sft` command's wall time, ``rl_seconds`` the asynchronous trainer's (first step
to last), ``rl_wall_seconds`` the whole run's (servers, start-up, the last evaluation) and ``recipe_seconds`` the
sum of the two wall times: what a user of the recipe waits.

Time to accuracy: the trainer's wall time at the first evaluated version where the held-out curve, smoothed by a
running mean over ``SMOOTH`` evaluations (one evaluation's sampling noise, about 0.01 on the recipe's 476 prompts
x 4 samples, is as large as the gain between two of them), reaches the target: the lower of the two runs' final
smoothed pass@1 unless ``--target`` is given, so both reach it. ``async_vs_sync_time_to_accuracy`` is the
synchronous run's time over the asynchronous one's: the headline ratio, measured in this invocation;
``async_vs_sync_seconds_per_step`` is the same ratio per optimizer step, free of evaluation noise.

The SFT checkpoint is also decoded greedily by plain `transformers` (`actors/tools/transformers_check.py`) and by
Leeway's engine on the same held-out prompts: ``sft_transformers_greedy_pass1`` against ``sft_leeway_greedy_pass1``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from actors.cli_args import add_set_argument
from actors.launcher.report import can_plot

DEFAULT_CONFIG = "configs/reasoning.yaml"
SMOOTH = 3
"""Evaluations in the running mean that time to accuracy reads (see the module docstring)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"the recipe (default: {DEFAULT_CONFIG})")
    parser.add_argument(
        "--rl-steps", type=int, default=None, help="optimizer steps of each RL run (default: trainer.max_steps)"
    )
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT optimizer steps (default: sft.epochs)")
    parser.add_argument("--target", type=float, default=None, help="held-out pass@1 for time to accuracy")
    parser.add_argument("--no-sync", action="store_true", help="skip the synchronous run (no time-to-accuracy ratio)")
    add_set_argument(parser, help="config override applied to every phase (repeatable)")
    parser.add_argument("--dir", default=None, help="keep the checkpoint and both runs here (default: a temp dir)")
    parser.add_argument(
        "--plot", default=None, help="also draw both held-out curves against trainer time into this PNG"
    )
    parser.add_argument(
        "--sft-checkpoint",
        default=None,
        help="start both RL runs from this `leeway sft` result instead of running SFT (no sft_seconds then)",
    )


# ---- summaries (pure: tested on records) ---------------------------------------------------------------


def eval_curve(evals: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(version, trainer seconds, pass@1) of each evaluated version, oldest first; version 0 is at 0 s. A version
    is published after the trainer step of the same number, whose record gives its time."""
    times = {int(r["step"]): float(r["time_s"]) for r in records if "step" in r and "time_s" in r}
    curve = []
    for record in sorted((e for e in evals if "pass@1" in e), key=lambda e: int(e["version"])):
        version = int(record["version"])
        seconds = 0.0 if version == 0 else times.get(version)
        if seconds is not None:
            curve.append({"version": version, "seconds": seconds, "pass@1": float(record["pass@1"])})
    return curve


def smoothed(curve: list[dict[str, Any]], window: int = SMOOTH) -> list[float]:
    """The running mean of pass@1 over the last ``window`` evaluations (fewer at the start)."""
    values = [point["pass@1"] for point in curve]
    windows = [values[max(0, i + 1 - window) : i + 1] for i in range(len(values))]
    return [sum(w) / len(w) for w in windows]


def seconds_to_accuracy(curve: list[dict[str, Any]], target: float, window: int = SMOOTH) -> float | None:
    """Trainer seconds at the first evaluated version whose smoothed pass@1 is at or above `target` (None: never)."""
    means = smoothed(curve, window)
    return next((point["seconds"] for point, mean in zip(curve, means, strict=True) if mean >= target), None)


def _seconds_per_step(run: dict[str, Any]) -> float | None:
    steps = run["curve"][-1]["version"] if run["curve"] else 0
    return run["seconds"] / steps if steps else None


def summarize_learning(
    sft: dict[str, Any], asynchronous: dict[str, Any], sync: dict[str, Any] | None, target: float | None
) -> dict[str, Any]:
    """The bench's JSON from each phase's results: ``sft`` (``pass1``, ``seconds``), and per RL run ``curve``
    (`eval_curve`), ``seconds`` (trainer wall time), ``mean_staleness``."""
    curve = asynchronous["curve"]
    rl_pass1 = curve[-1]["pass@1"] if curve else None
    version0 = curve[0]["pass@1"] if curve and curve[0]["version"] == 0 else None
    # version 0 of the run is the SFT checkpoint, evaluated with the run's eval settings: the same number `leeway sft`
    # wrote when both used the same ones, and the comparable one when not (an --sft-checkpoint made earlier)
    sft_pass1 = version0 if version0 is not None else sft["pass1"]
    result: dict[str, Any] = {
        "sft_eval_pass1": sft_pass1,
        "rl_eval_pass1": rl_pass1,
        "gain": None if rl_pass1 is None or sft_pass1 is None else rl_pass1 - sft_pass1,
        "sft_seconds": sft["seconds"],
        "rl_seconds": asynchronous["seconds"],
        "rl_wall_seconds": asynchronous.get("wall_seconds"),
        "recipe_seconds": sft["seconds"] + asynchronous.get("wall_seconds", asynchronous["seconds"]),
        "mean_staleness": asynchronous["mean_staleness"],
        "sft_checkpoint_eval_pass1": sft["pass1"],
        "rl_final_version": curve[-1]["version"] if curve else None,
        "async_curve": curve,
    }
    for key in ("transformers_greedy_pass1", "leeway_greedy_pass1"):
        if key in sft:
            result[f"sft_{key}"] = sft[key]
    if sync is None:
        return result
    sync_curve = sync["curve"]
    sync_final = sync_curve[-1]["pass@1"] if sync_curve else None
    finals = [smoothed(c)[-1] for c in (curve, sync_curve) if c]
    goal = target if target is not None else (min(finals) if len(finals) == 2 else None)
    async_s = seconds_to_accuracy(curve, goal) if goal is not None else None
    sync_s = seconds_to_accuracy(sync_curve, goal) if goal is not None else None
    per_step = (_seconds_per_step(asynchronous), _seconds_per_step(sync))
    result.update(
        {
            "sync_eval_pass1": sync_final,
            "final_accuracy_gap": None if sync_final is None or rl_pass1 is None else rl_pass1 - sync_final,
            "sync_seconds": sync["seconds"],
            "sync_version0_pass1": sync_curve[0]["pass@1"] if sync_curve and sync_curve[0]["version"] == 0 else None,
            "target_pass1": goal,
            "async_seconds_to_accuracy": async_s,
            "sync_seconds_to_accuracy": sync_s,
            "async_vs_sync_time_to_accuracy": sync_s / async_s if sync_s and async_s else None,
            "async_vs_sync_seconds_per_step": per_step[1] / per_step[0] if per_step[0] and per_step[1] else None,
            "sync_mean_staleness": sync["mean_staleness"],
            "sync_curve": sync_curve,
        }
    )
    return result


def plot_curves(result: dict[str, Any], path: Path) -> None:
    """Held-out pass@1 of both RL runs against trainer seconds, the SFT checkpoint's as a line and the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
    runs = (("async_curve", "asynchronous", "C0"), ("sync_curve", "synchronous (max_staleness 0)", "C1"))
    for key, label, color in runs:
        curve = result.get(key) or []
        if curve:
            seconds = [p["seconds"] for p in curve]
            ax.plot(seconds, [p["pass@1"] for p in curve], "o", alpha=0.35, color=color)
            ax.plot(seconds, smoothed(curve), "-", label=label, color=color)
    if result.get("sft_eval_pass1") is not None:
        ax.axhline(result["sft_eval_pass1"], color="grey", linestyle="--", label="SFT checkpoint")
    if result.get("target_pass1") is not None:
        ax.axhline(result["target_pass1"], color="grey", linestyle=":", label="time-to-accuracy target")
    ax.set_xlabel("trainer seconds")
    ax.set_ylabel("held-out pass@1 (points; line: mean of 3)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- phases --------------------------------------------------------------------------------------------


def _sft(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "actors.cli", "sft", args.config, "--fresh"]
    for override in [*args.overrides, f"sft.output_dir={out}"]:
        command += ["--set", override]
    if args.sft_steps is not None:
        command += ["--set", f"sft.max_steps={args.sft_steps}"]
    print(f"bench learning: SFT into {out} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # its progress goes to our stderr
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"bench learning: leeway sft exited with {proc.returncode}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    pass1 = (summary.get("eval") or {}).get("pass@1")
    print(f"bench learning: SFT done in {seconds:.0f} s, held-out pass@1 {pass1}", file=sys.stderr, flush=True)
    return {"pass1": pass1, "seconds": seconds}


def _greedy_checks(args: argparse.Namespace, checkpoint: Path) -> dict[str, float]:
    """The SFT checkpoint decoded greedily on the held-out prompts by plain transformers and by Leeway's engine."""
    from actors.tools.evaluate import evaluate_checkpoint
    from actors.tools.transformers_check import transformers_greedy_pass1
    from pipeline.config import load_config
    from pipeline.tasks import task_for

    cfg = load_config(args.config, [*args.overrides, "eval.temperature=0", "eval.samples_per_prompt=1"])
    task = task_for(cfg)
    prompts = task.eval_prompts()[: cfg.eval.prompts]
    leeway = evaluate_checkpoint(cfg, checkpoint, task=task, prompts=prompts)
    hf = transformers_greedy_pass1(
        checkpoint, task, prompts, max_new_tokens=cfg.engine.sampling.max_new_tokens, threads=cfg.engine.torch_threads
    )
    print(
        f"bench learning: greedy held-out pass@1 of the SFT checkpoint: transformers {hf['pass@1']:.4f}, "
        f"leeway {leeway['pass@1']:.4f} ({hf['prompts']} prompts)",
        file=sys.stderr,
        flush=True,
    )
    return {"transformers_greedy_pass1": hf["pass@1"], "leeway_greedy_pass1": leeway["pass@1"]}


def _existing_sft(checkpoint: Path) -> dict[str, Any]:
    """An SFT result made earlier: its pass@1 from the eval.json `leeway sft` wrote, no SFT time."""
    from actors.tools.evaluate import EVAL_FILE

    path = checkpoint / EVAL_FILE
    if not path.is_file():
        raise SystemExit(f"bench learning: --sft-checkpoint {checkpoint}: no {EVAL_FILE} (not a `leeway sft` result)")
    return {"pass1": json.loads(path.read_text()).get("pass@1"), "seconds": 0.0}


def _rl(args: argparse.Namespace, root: Path, checkpoint: Path, label: str, staleness: int | None) -> dict[str, Any]:
    from actors.launcher.run import run_pipeline
    from actors.tools.bench.e2e import summarize_run
    from pipeline.config import load_config

    overrides = [
        *args.overrides,
        f"model.name_or_path={checkpoint}",
        f"run.name=bench-learning-{label}",
        f"run.dir={root / label}",
        f"nats.stack_dir={root / label / 'no-shared-stack'}",
    ]
    if staleness is not None:
        overrides.append(f"staleness.max_staleness={staleness}")
    if args.rl_steps is not None:
        overrides.append(f"trainer.max_steps={args.rl_steps}")
    cfg = load_config(args.config, overrides)
    if cfg.eval.every_steps < 1:
        raise SystemExit(f"bench learning: {args.config} must set eval.every_steps (the held-out curve)")
    print(f"bench learning: {label} RL run (max_staleness={cfg.staleness.max_staleness}) ...", file=sys.stderr)
    started = time.perf_counter()
    outcome = run_pipeline(cfg, num_generators=1, fresh=True)
    wall = time.perf_counter() - started
    if outcome.interrupted:
        raise SystemExit(f"bench learning: interrupted during the {label} run (its files are in {cfg.run.run_dir})")
    logs = cfg.run.run_dir / "logs"
    if outcome.trainer_rc != 0 or outcome.error is not None:
        raise RuntimeError(
            f"bench learning: the {label} run failed (trainer exit {outcome.trainer_rc}"
            f"{', ' + outcome.error if outcome.error else ''}); see {logs}"
        )
    evals = [json.loads(line) for line in (cfg.run.run_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
    curve = eval_curve(evals, outcome.records)
    if not curve or curve[-1]["version"] != cfg.trainer.max_steps:
        raise RuntimeError(
            f"bench learning: the {label} run's evaluator (exit {outcome.evaluator_rc}) did not evaluate the last "
            f"version {cfg.trainer.max_steps} (evaluated: {[p['version'] for p in curve]}); see {logs}"
        )
    run = summarize_run(outcome.records, target=1.0)
    print(f"bench learning: {label}: {curve}", file=sys.stderr, flush=True)
    return {"curve": curve, "seconds": run["seconds"], "wall_seconds": wall, "mean_staleness": run["mean_staleness"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.plot and not can_plot():  # said before the 13 minutes, not after
        raise SystemExit("bench learning: --plot needs matplotlib: pip install 'leeway[plots]'")
    with tempfile.TemporaryDirectory(prefix="leeway-bench-learning-") as tmp:
        root = Path(args.dir).resolve() if args.dir else Path(tmp)
        if args.sft_checkpoint is not None:
            checkpoint = Path(args.sft_checkpoint).resolve()
            sft = _existing_sft(checkpoint)
        else:
            checkpoint = root / "sft"
            sft = _sft(args, checkpoint)
        sft.update(_greedy_checks(args, checkpoint))
        asynchronous = _rl(args, root, checkpoint, "async", None)
        sync = None if args.no_sync else _rl(args, root, checkpoint, "sync", 0)
    result = summarize_learning(sft, asynchronous, sync, args.target)
    if args.plot:
        plot_curves(result, Path(args.plot))
    return result
