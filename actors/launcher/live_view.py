"""The live terminal view of `leeway run`: one progress bar over steps and the few numbers that matter.

```
 run demo · reverse_digits · trainer + 1 generator · max staleness 2
 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 42/300  0:00:31 < 0:03:10  reward 0.41 (kept 0.44)
  reward      unfiltered 0.412  kept 0.438  ▁▁▂▂▃▄▄▅▆▇ (last 40 steps)
  policy      version 42 · staleness mean 1.21 max 2 (cap 2) · dropped by cap 0 samples
  queues      prompts 35 waiting, 12 in generation · groups 4 waiting for the trainer
  throughput  generated 4,502 tok/s · trained 4,688 tok/s · trainer waits 27% of a step
  generator  version  behind  tokens/s  idle  rollouts  process
  gen-0      41       1       4,502     25%   4         running (pid 1234)
 Ctrl-C stops everything cleanly · logs in runs/demo/logs
```

Numbers come from the trainer's metrics records (which carry the generators' latest reports) and
from `RunStatus` (processes, queue depths read from NATS once a second). Without a terminal, or
with `--no-live`, the same numbers are printed as one plain line every `PLAIN_EVERY_STEPS` steps
(and at least every `PLAIN_EVERY_S` seconds while something changes).
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from pipeline.config import LeewayConfig

PLAIN_EVERY_STEPS = 10
PLAIN_EVERY_S = 15.0
SPARK_STEPS = 40
SPARK_CHARS = "▁▂▃▄▅▆▇█"


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def sparkline(values: list[float], lo: float = 0.0, hi: float = 1.0) -> str:
    """One character per value, scaled to [lo, hi] (rewards are in [0, 1] for the built-in tasks)."""
    if not values:
        return ""
    lo, hi = min(lo, *values), max(hi, *values)
    span = (hi - lo) or 1.0
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[max(0, min(top, round((v - lo) / span * top)))] for v in values)


def _status_attr(status: Any, name: str, default: Any) -> Any:
    return getattr(status, name, default) if status is not None else default


class LiveView:
    """A rich Live display, or plain lines with `plain=True` (logs, CI, no TTY). Use as a context manager."""

    def __init__(
        self, cfg: LeewayConfig, num_generators: int, *, plain: bool = False, console: Console | None = None
    ) -> None:
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.plain = plain or not self.console.is_terminal
        self.max_steps = cfg.trainer.max_steps
        self.progress = Progress(
            TextColumn("[bold]steps"),
            BarColumn(bar_width=None),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("<"),
            TimeRemainingColumn(),
            console=self.console,
            expand=True,
        )
        self.task = self.progress.add_task("steps", total=self.max_steps)
        self.num_generators = num_generators
        self.live: Live | None = None
        self.last_plain_step = -1
        self.last_plain_at = 0.0
        self.last_status: Any = None
        self.reported_exits: set[str] = set()
        self.reported_evals = 0

    def __enter__(self) -> LiveView:
        if not self.plain:
            self.live = Live(self.render([], None), console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        else:
            self.console.print(self.header(), markup=False, highlight=False, soft_wrap=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
            self.live = None

    # ------------------------------------------------------------------------------------ updates

    def update(self, records: list[dict[str, Any]], status: Any = None) -> None:
        """Show the newest record and the processes / queues in `status` (an `actors.launcher.roles.RunStatus`)."""
        self.last_status = status
        last = records[-1] if records else {}
        step = int(last.get("step", 0))
        self.progress.update(self.task, completed=min(step, self.max_steps))
        if self.live is not None:
            self.live.update(self.render(records, status))
            return
        shutting_down = _status_attr(status, "stopping", False) or _status_attr(status, "stopped", False)
        for gen in () if shutting_down else _status_attr(status, "generators", ()):
            if gen.returncode is not None and gen.generator_id not in self.reported_exits:
                self.reported_exits.add(gen.generator_id)
                self.console.print(
                    f"{gen.generator_id}: process exited with {gen.returncode} (log: {gen.log_path})",
                    markup=False,
                    soft_wrap=True,
                )
        evals = _status_attr(status, "evals", ())
        for record in evals[self.reported_evals :]:
            self.console.print(eval_line(record), markup=False, highlight=False, soft_wrap=True)
        self.reported_evals = max(self.reported_evals, len(evals))
        now = time.monotonic()
        due = step != self.last_plain_step and (
            step % PLAIN_EVERY_STEPS == 0 or step == self.max_steps or now - self.last_plain_at > PLAIN_EVERY_S
        )
        if last and due:
            self.last_plain_step, self.last_plain_at = step, now
            self.console.print(self.plain_line(last, status), markup=False, highlight=False, soft_wrap=True)

    def final(self, outcome: Any) -> None:
        """After the run: one closing line (the live display itself stays on screen as it was)."""
        records = getattr(outcome, "records", [])
        if self.plain and records and int(records[-1].get("step", 0)) != self.last_plain_step:
            self.console.print(
                self.plain_line(records[-1], self.last_status), markup=False, highlight=False, soft_wrap=True
            )

    # ------------------------------------------------------------------------------------ texts

    def header(self, *, with_dir: bool = True) -> str:
        cfg = self.cfg
        gens = f"{self.num_generators} generator" + ("s" if self.num_generators != 1 else "")
        return (
            f"run {cfg.run.name} · task {cfg.task.name} · trainer + {gens} · "
            f"max staleness {cfg.staleness.max_staleness} · {self.max_steps} steps"
            + (f" · run dir {cfg.run.run_dir}" if with_dir else "")
        )

    def plain_line(self, last: dict[str, Any], status: Any = None) -> str:
        queues = _status_attr(status, "queues", {}) or {}
        gens = last.get("generators", {}) or {}
        versions = " ".join(f"{gid}:v{rep.get('version', '-')}" for gid, rep in sorted(gens.items()))
        return (
            f"step {last.get('step', 0)}/{self.max_steps} "
            f"reward {_fmt(last.get('reward/unfiltered_mean'))} (kept {_fmt(last.get('reward/kept_mean'))}) "
            f"version {last.get('version', '-')} "
            f"staleness {_fmt(last.get('staleness/mean'), '.2f')}/{last.get('staleness/max', '-')} "
            f"queue prompts {_fmt(queues.get('prompts_waiting'), 'd')} groups {_queue_groups(last, queues)} "
            f"tok/s gen {_fmt(last.get('generators/tokens_per_s'), ',.0f')} "
            f"train {_fmt(last.get('trainer/tokens_per_s'), ',.0f')} "
            f"time {_fmt(last.get('time_s'), '.0f')}s" + (f" generators {versions}" if versions else "")
        )

    def render(self, records: list[dict[str, Any]], status: Any) -> RenderableType:
        last = records[-1] if records else {}
        self.progress.update(self.task, completed=min(int(last.get("step", 0)), self.max_steps))
        queues = _status_attr(status, "queues", {}) or {}
        cap = self.cfg.staleness.max_staleness
        rewards = [float(r["reward/unfiltered_mean"]) for r in records if r.get("reward/unfiltered_mean") is not None]

        facts = Table.grid(padding=(0, 2))
        facts.add_column(style="bold cyan", no_wrap=True)
        facts.add_column()
        if not last:
            facts.add_row("status", "starting the trainer and generators; waiting for the first step ...")
        facts.add_row(
            "reward",
            Text.assemble(
                ("unfiltered ", "dim"),
                (_fmt(last.get("reward/unfiltered_mean")), "bold green"),
                ("  kept ", "dim"),
                (_fmt(last.get("reward/kept_mean")), "green"),
                "  ",
                (sparkline(rewards[-SPARK_STEPS:]), "green"),
                (f"  (last {min(len(rewards), SPARK_STEPS)} steps)" if rewards else "", "dim"),
            ),
        )
        facts.add_row(
            "policy",
            f"version {last.get('version', '-')} · staleness mean {_fmt(last.get('staleness/mean'), '.2f')} "
            f"max {last.get('staleness/max', '-')} (cap {cap}) · dropped by cap "
            f"{last.get('samples/dropped_by_cap_total', '-')} samples",
        )
        facts.add_row(
            "queues",
            f"prompts {_fmt(queues.get('prompts_waiting'), 'd')} waiting, "
            f"{_fmt(queues.get('prompts_in_generation'), 'd')} in generation · "
            f"groups {_queue_groups(last, queues)} waiting for the trainer",
        )
        evals = _status_attr(status, "evals", ())
        if evals:
            held_out = [float(e["mean_reward"]) for e in evals]
            facts.add_row(
                "held-out",
                Text.assemble(eval_line(evals[-1]), "  ", (sparkline(held_out[-SPARK_STEPS:]), "magenta")),
            )
        if last.get("mismatch/k3_kl") is not None or last.get("moe/routing_agreement") is not None:
            facts.add_row(
                "train/sampler",
                f"mean |Δ log p| {_fmt(last.get('mismatch/mean_abs_logprob_diff'), '.4f')} · "
                f"k3 KL {_fmt(last.get('mismatch/k3_kl'), '.2e')}"
                + (
                    f" · routing agreement {_fmt(last.get('moe/routing_agreement'), '.3f')} · unrouted "
                    f"{_fmt(last.get('moe/unrouted_positions'), '.0f')} · expert load max/mean "
                    f"{_fmt(last.get('moe/expert_load_max_over_mean'), '.2f')}"
                    if "moe/routing_agreement" in last
                    else ""
                ),
            )
        wait = last.get("time/wait_fraction")
        facts.add_row(
            "throughput",
            f"generated {_fmt(last.get('generators/tokens_per_s'), ',.0f')} tok/s · "
            f"trained {_fmt(last.get('trainer/tokens_per_s'), ',.0f')} tok/s · "
            f"trainer waits {_fmt(None if wait is None else 100 * wait, '.0f')}% of a step · "
            f"step {_fmt(last.get('time/step_s'), '.2f')} s",
        )
        parts: list[RenderableType] = [
            Text(self.header(with_dir=False), style="bold"),
            self.progress,
            facts,
            self._generators(last, status),
        ]
        if _status_attr(status, "stopped", False):
            footer = f"finished: every process this run started has stopped · logs in {self.cfg.run.run_dir / 'logs'}"
        elif _status_attr(status, "stopping", False):
            footer = "stopping: generators first, then the trainer ..."
        else:
            footer = f"Ctrl-C stops everything cleanly · logs in {self.cfg.run.run_dir / 'logs'}"
        parts.append(Text(footer, style="dim"))
        return Group(*parts)

    def _generators(self, last: dict[str, Any], status: Any) -> Table:
        table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 2))
        for column, justify in (
            ("generator", "left"),
            ("version", "right"),
            ("report age", "right"),
            ("tokens/s", "right"),
            ("idle", "right"),
            ("rollouts", "right"),
            ("endpoint", "left"),
            ("process", "left"),
        ):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]
        reports: dict[str, dict[str, Any]] = last.get("generators", {}) or {}
        procs = {g.generator_id: g for g in _status_attr(status, "generators", ())}
        for gen_id in sorted(set(reports) | set(procs)):
            report = reports.get(gen_id, {})
            version = report.get("version")
            sent = report.get("time_s")
            age = max(0.0, time.time() - float(sent)) if isinstance(sent, (int, float)) else None
            idle = report.get("idle_fraction")
            proc = procs.get(gen_id)
            if proc is None:
                process = Text("external", style="dim")
            elif proc.returncode is None:
                process = Text(f"running (pid {proc.pid})", style="green")
            else:
                process = Text(f"exited {proc.returncode}: {proc.log_path.name}", style="red")
            table.add_row(
                gen_id,
                _fmt(version, "d"),
                "-" if age is None else f"{age:.0f} s",
                _fmt(report.get("tokens_per_s"), ",.0f"),
                _fmt(None if idle is None else 100 * idle, ".0f") + ("%" if idle is not None else ""),
                _fmt(report.get("rollouts_in_flight"), "d"),
                str(report.get("endpoint") or "-"),
                process,
            )
        return table


def eval_line(record: dict[str, Any]) -> str:
    """One evaluation (`leeway eval`'s JSON) in a line."""
    k = record.get("samples_per_prompt", 1)
    return (
        f"eval version {record.get('version')}: mean reward {_fmt(record.get('mean_reward'))} · "
        f"pass@1 {_fmt(record.get('pass@1'))} · pass@{k} {_fmt(record.get(f'pass@{k}'))} "
        f"over {record.get('prompts')} held-out prompts"
    )


def _queue_groups(last: dict[str, Any], queues: dict[str, Any]) -> str:
    """Groups waiting for the trainer: live from NATS when known, else the trainer's last record."""
    value = queues.get("groups_waiting")
    if value is None:
        value = last.get("queue/trajectories")
    return _fmt(value, "d")
