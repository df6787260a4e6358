"""The run report written at the end of `leeway run`, next to the trainer's `metrics.jsonl`.

- `report.png`: three panels over wall-clock time: reward (unfiltered and kept, each step and a
  moving average), staleness (mean and max of the tokens received, with the cap), throughput
  (generated and trained tokens/s); with `eval.every_steps`, the held-out evaluations of `eval.jsonl` on the
  reward panel.
- `summary.md`: a short table of what happened: steps, time, reward at the start and the end,
  staleness, drops, waiting, throughput, and the files to look at next.

The plot needs matplotlib, the `plots` extra (`make` installs it); without it the run ends with its summary and
one line naming the extra (`NO_PLOTS`).
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.config import LeewayConfig

SMOOTH_STEPS = 10
"""Moving-average window of the reward curves (a step's reward is a noisy mean over one batch)."""
EDGE_STEPS = 5
"""The summary's reward "at the start" and "at the end" are means over this many steps."""
NO_PLOTS = "no report.png: plots need matplotlib: pip install 'leeway[plots]'"
FINAL_DIR = "final"
"""Under `run.dir`: the run's final policy as a Hugging Face checkpoint (`leeway export`), written as the run ends."""
EXPORT_INFO = "leeway.json"
"""What `leeway export` writes beside the checkpoint: run, version, step, dtype and hashes."""


def can_plot() -> bool:
    """True when matplotlib (the `plots` extra) is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value)):
            xs.append(float(record.get("time_s", record.get("step", 0))))
            ys.append(float(value))
    return xs, ys


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The evaluator's results (`<run_dir>/eval.jsonl`, `leeway eval --follow`), skipped versions left out."""
    path = run_dir / "eval.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "skipped" not in record and record.get("mean_reward") is not None:
            out.append(record)
    return sorted(out, key=lambda r: r.get("version", 0))


def read_final(run_dir: Path) -> dict[str, Any] | None:
    """`<run_dir>/final/leeway.json` (the run's exported final policy), None when there is none."""
    try:
        info = json.loads((run_dir / FINAL_DIR / EXPORT_INFO).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and "version" in info else None


def plot_run(
    records: list[dict[str, Any]], path: Path, cfg: LeewayConfig | None = None, evals: Sequence[dict[str, Any]] = ()
) -> None:
    """Reward curves, staleness and throughput over wall-clock time, one panel each; held-out evaluations
    (`evals`) as points on the reward panel, at the time their version was published."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    reward_ax, stale_ax, tput_ax = axes
    for key, label, color, style in (
        ("reward/unfiltered_mean", "unfiltered (all valid samples)", "tab:blue", "-"),
        ("reward/kept_mean", "kept (trained groups)", "tab:green", "--"),
    ):
        xs, ys = _series(records, key)
        if xs:
            reward_ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
            reward_ax.plot(
                xs,
                moving_average(ys, SMOOTH_STEPS),
                color=color,
                linestyle=style,
                linewidth=2,
                label=f"{label}, {SMOOTH_STEPS}-step average",
            )
    published = {r.get("version"): r.get("time_s") for r in records if r.get("time_s") is not None}
    published.setdefault(0, 0.0)
    points = [(published[e["version"]], e) for e in evals if e.get("version") in published]
    for key, style, color, size, label in (
        ("mean_reward", "D-", "black", 5, "held-out eval, mean reward"),
        ("pass@1", "s:", "tab:red", 4, "held-out eval, pass@1"),
    ):
        if points:
            ys = [e[key] for _, e in points]
            reward_ax.plot([t for t, _ in points], ys, style, color=color, markersize=size, linewidth=1, label=label)
    reward_ax.set_ylabel("mean reward")
    reward_ax.set_ylim(-0.02, 1.02)
    reward_ax.set_title("Reward (thin: each step)", loc="left", fontsize=10)
    reward_ax.legend(loc="upper left", fontsize=8)

    xs, ys = _series(records, "staleness/mean")
    stale_ax.plot(xs, ys, color="tab:orange", label="mean")
    xs, ys = _series(records, "staleness/max")
    stale_ax.plot(xs, ys, color="tab:red", linestyle="none", marker="o", markersize=3, label="max")
    if cfg is not None:
        stale_ax.axhline(
            cfg.staleness.max_staleness,
            color="grey",
            linestyle=":",
            label=f"cap (max_staleness = {cfg.staleness.max_staleness})",
        )
    stale_ax.set_ylabel("staleness (versions)")
    stale_ax.set_title("Staleness of the tokens received per step (before the cap)", loc="left", fontsize=10)
    top = max([*ys, cfg.staleness.max_staleness if cfg is not None else 0, 1])
    stale_ax.set_ylim(0, top + 0.5)
    stale_ax.legend(loc="upper left", fontsize=8)

    for key, label, color in (
        ("generators/tokens_per_s", "generated (all generators)", "tab:purple"),
        ("trainer/tokens_per_s", "trained (trainer compute)", "tab:brown"),
    ):
        xs, ys = _series(records, key)
        if xs:
            tput_ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
            tput_ax.plot(xs, moving_average(ys, SMOOTH_STEPS), color=color, linewidth=2, label=label)
    tput_ax.set_ylabel("tokens / s")
    tput_ax.set_ylim(bottom=0)
    tput_ax.set_title("Throughput", loc="left", fontsize=10)
    tput_ax.set_xlabel("seconds since the trainer started")
    tput_ax.legend(loc="upper left", fontsize=8)

    for ax in axes:
        ax.grid(alpha=0.3)
    title = "Leeway run" if cfg is None else f"Leeway run {cfg.run.name}: {cfg.task.name}"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else None


def _f(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def summarize(
    records: list[dict[str, Any]],
    cfg: LeewayConfig | None = None,
    evals: Sequence[dict[str, Any]] = (),
    final: dict[str, Any] | None = None,
) -> str:
    """The markdown summary: a title, a table of the numbers that matter, where to look next, and the exported
    final policy (`final`: its `leeway.json`) with the lines that load it."""
    title = "# Leeway run" + ("" if cfg is None else f" `{cfg.run.name}`")
    if not records:
        return f"{title}\n\nNo training step was completed, so there is nothing to report. See `logs/`.\n"
    last = records[-1]
    rewards = [float(r["reward/unfiltered_mean"]) for r in records if r.get("reward/unfiltered_mean") is not None]
    head, tail = rewards[:EDGE_STEPS], rewards[-EDGE_STEPS:]
    max_stale = max((int(r["staleness/max"]) for r in records if r.get("staleness/max") is not None), default=None)
    wait = _mean(records, "time/wait_fraction")
    trained = sum(len(r.get("trained_group_ids") or []) for r in records)
    dropped: dict[str, int] = {}
    for record in records:
        for reason in (record.get("dropped_group_ids") or {}).values():
            dropped[reason] = dropped.get(reason, 0) + 1
    dropped_text = ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items())) or "none"
    rows = [
        ("steps", f"{last.get('step')} (policy version {last.get('version')})"),
        ("wall-clock (trainer)", f"{_f(last.get('time_s'), '.0f')} s"),
        (f"reward, first {len(head)} steps", _f(sum(head) / len(head) if head else None)),
        (f"reward, last {len(tail)} steps", _f(sum(tail) / len(tail) if tail else None)),
        ("kept reward, last step", _f(last.get("reward/kept_mean"))),
        ("staleness (mean over steps, max)", f"{_f(_mean(records, 'staleness/mean'), '.2f')}, {max_stale}"),
        ("samples dropped by the staleness cap", str(last.get("samples/dropped_by_cap_total", 0))),
        ("groups trained / not trained", f"{trained} / {sum(dropped.values())} ({dropped_text})"),
        ("trainer waiting for data", "n/a" if wait is None else f"{wait:.0%} of step time"),
        ("generated tokens/s (mean)", _f(_mean(records, "generators/tokens_per_s"), ",.0f")),
        ("trained tokens/s (mean)", _f(_mean(records, "trainer/tokens_per_s"), ",.0f")),
        (
            "train/sampler mismatch (mean over steps: mean abs Δ log p, k3 KL)",
            f"{_f(_mean(records, 'mismatch/mean_abs_logprob_diff'), '.4f')}, {_f(_mean(records, 'mismatch/k3_kl'), '.2e')}",
        ),
    ]
    if _mean(records, "moe/routing_agreement") is not None:
        rows.append(
            (
                "MoE routing (mean over steps: agreement, unrouted positions, expert load max/mean)",
                f"{_f(_mean(records, 'moe/routing_agreement'))}, {_f(_mean(records, 'moe/unrouted_positions'), '.1f')}, "
                f"{_f(_mean(records, 'moe/expert_load_max_over_mean'), '.2f')}",
            )
        )
    if evals:
        first, final = evals[0], evals[-1]
        rows.append(
            (
                "held-out eval, mean reward / pass@1",
                f"version {first['version']}: {_f(first['mean_reward'])} / {_f(first['pass@1'])}; version "
                f"{final['version']}: {_f(final['mean_reward'])} / {_f(final['pass@1'])} (`eval.jsonl`)",
            )
        )
    if cfg is not None:
        rows.insert(0, ("task, model", f"{cfg.task.name}, {cfg.model.name_or_path}"))
        rows.insert(1, ("max staleness, correction", f"{cfg.staleness.max_staleness}, {cfg.correction.method}"))
    lines = [title, "", "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), ""]
    lines += [
        "Files here: `metrics.jsonl` (one record per step), `report.png` (reward, staleness, throughput over time),",
        "`config.yaml` (the resolved config every process ran with), `logs/` (one log per process).",
    ]
    if final is not None:
        lines += [
            "",
            f"The final policy (version {final.get('version')}, step {final.get('step')}, {final.get('dtype')}) is a "
            f"Hugging Face checkpoint in `{FINAL_DIR}/` (`leeway export`; `{FINAL_DIR}/{EXPORT_INFO}` names the version "
            "and every hash):",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'model = AutoModelForCausalLM.from_pretrained("{FINAL_DIR}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{FINAL_DIR}")',
            "```",
        ]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, records: list[dict[str, Any]], cfg: LeewayConfig | None = None) -> Path:
    """Write report.png (when there is a step to plot and matplotlib to plot it) and summary.md next to
    metrics.jsonl; returns summary.md."""
    evals = read_evals(run_dir)
    if records and can_plot():
        plot_run(records, run_dir / "report.png", cfg, evals)
    summary = run_dir / "summary.md"
    summary.write_text(summarize(records, cfg, evals, read_final(run_dir)))
    return summary
