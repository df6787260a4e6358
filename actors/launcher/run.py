"""`leeway run`: the whole pipeline on one machine, each role its own OS process.

```
  leeway run ──starts──► embedded stack (private, in <run.dir>/stack, unless a healthy stack runs
      │                  at nats.stack_dir or the config names servers)
      ├──spawns──► leeway trainer   ──metrics.jsonl──┐
      ├──spawns──► leeway generator × N              │
      ├──polls───► NATS: prompts and groups waiting  │   (queue_probe.py, once a second)
      └──reads ◄─────────────────────────────────────┘  live view; report at the end
```

The roles talk only through NATS and S3, exactly as when launched by hand. This module holds the run: its
parser and `main`, the private stack, the signals, the trainer's metrics (`MetricsTail`) for the live view, and
the order in which everything it started is stopped (`run_pipeline`). The role processes themselves (spawning,
splitting the cores, stopping them) are `actors/launcher/roles.py`, the run directory's safety rules
`actors/launcher/run_dir.py`, the queue depths `actors/launcher/queue_probe.py`; every child is started and
stopped by `infra/process.py`.

Invariants:
- Every role runs in its own process group (a new session), so a terminal Ctrl-C reaches only this
  process, which then stops the roles in order: generators first (their held prompts go back to the
  queue), then the trainer (it finishes or abandons its step and checkpoints), each with SIGTERM
  and, after the run's stop grace (`run.stop_grace_s`; by default the final checkpoint's budget + 30 s)
  or at once on a second Ctrl-C, SIGKILL to its whole group.
- Nothing outlives this process, even when it is SIGKILLed: the roles get SIGTERM from the kernel when
  it dies (Linux parent-death signal) and also watch its pid themselves (`LEEWAY_PARENT_PID`,
  `infra.orphans.watch_parent`: SIGTERM, then SIGKILL after the same grace, or an immediate exit
  saying what it abandons once the servers its clean stop needs are all gone); the servers of a
  private stack get SIGKILL (`infra.orphans.tied_to_this_process`). Roles and the private stack are
  spawned from the main thread, which lives until everything is stopped.
- A stack started here is stopped here; a stack found running is left running.
- `run.dir` gets a marker file (`RUN_MARKER`) when `leeway run` creates it; `--fresh` deletes only a
  directory holding it, never the working directory, home or `/` (or a parent of them), and stops
  the private stack recorded in it first (`actors/launcher/run_dir.py`).
- The caller's config is never changed: a private stack is recorded in a copy, which every role gets.
- The run ends when the trainer exits, when all of this run's generators have exited while no other
  generator reports (nothing could make progress), or on Ctrl-C / SIGTERM / SIGHUP (`interrupted`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from actors.cli_args import WithConfig, add_config_arguments
from actors.launcher.live_view import LiveView
from actors.launcher.queue_probe import QueueProbe
from actors.launcher.report import FINAL_DIR, NO_PLOTS, can_plot, read_final, write_report
from actors.launcher.roles import RunProcesses, generator_ids, spawn_role, start_roles
from actors.launcher.run_dir import STACK_STOP_TIMEOUT_S, RunDirInUse, prepare_run_dir
from actors.servers import private_stack_dir, stack_bucket
from infra.orphans import tied_to_this_process
from infra.process import StackError, log_tail
from infra.role_logs import STOP_EXIT, stop_reason
from infra.stack import start_stack, stop_stack
from pipeline.config import LeewayConfig

POLL_S = 0.5
"""Refresh interval of the live view."""
EXPORT_THREADS = 2
"""Torch threads of the final export (the roles have stopped: the cores are free)."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Each stops the run cleanly (SIGHUP: the terminal was closed); a second one kills what is left."""


def _say(text: str) -> None:
    """Print to stderr; a closed terminal (SIGHUP) must not interrupt the clean-up."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


def read_metrics(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """New complete lines of metrics.jsonl since `offset` (a half-written last line waits for the next poll)."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as handle:
        handle.seek(offset)
        data = handle.read()
    end = data.rfind(b"\n") + 1
    records = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return records, offset + end


class MetricsTail:
    """metrics.jsonl as `leeway run` follows it: the new complete lines at each poll, into `records`. A resumed
    trainer rolls back the records of steps its checkpoint lost by replacing the file (`roll_back_metrics`);
    then (a new inode, or a file shorter than what was read) `records` starts again from the new file."""

    def __init__(self, path: Path, records: list[dict[str, Any]]) -> None:
        self.path = path
        self.records = records
        self.offset = 0
        self._inode: int | None = None

    def poll(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        if self._inode is not None and (stat.st_ino != self._inode or stat.st_size < self.offset):
            self.records.clear()
            self.offset = 0
        self._inode = stat.st_ino
        new, self.offset = read_metrics(self.path, self.offset)
        self.records.extend(new)


# ------------------------------------------------------------------------------------------- run


@dataclass
class RunOutcome:
    """How a `run_pipeline` ended: what `main` reports, the e2e bench measures, and tests check."""

    run_dir: Path
    records: list[dict[str, Any]]
    trainer_rc: int | None
    interrupted: bool
    trainer_log: Path | None
    error: str | None = None
    """Why the run stopped early (besides Ctrl-C), e.g. every generator exited."""
    generator_rcs: dict[str, int | None] = field(default_factory=dict)
    stack_dir: Path | None = None
    """The private stack this run started (stopped again at the end), or None."""
    evaluator_rc: int | None = None
    """The exit status of the run's evaluator (`eval.every_steps`), None without one."""
    final_dir: Path | None = None
    """`<run.dir>/final/`: the final version as a Hugging Face checkpoint, once `leeway export` wrote it."""
    final_error: str | None = None
    """Why the final export failed (the end of its log), None when it was written or not attempted."""

    @property
    def ok(self) -> bool:
        return not self.interrupted and self.error is None and self.trainer_rc == 0


class _Interrupt(KeyboardInterrupt):
    """SIGTERM or SIGHUP (terminal closed) to `leeway run` is handled like Ctrl-C."""


class _Signals:
    """SIGINT, SIGTERM and SIGHUP while running raise `KeyboardInterrupt`; once stopping, they only hurry the
    clean-up (kill instead of waiting), so a second Ctrl-C never leaves processes behind.

    One handler for the whole run, switched by `stopping`, so there is no moment without it.
    Installed only in the main thread (signal handlers can be set nowhere else).
    """

    def __init__(self, processes: RunProcesses) -> None:
        self.processes = processes
        self.stopping = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.stopping:
            self.stopping = True
            raise _Interrupt
        processes = self.processes
        if not processes.hurry.is_set():
            _say("leeway run: killing the remaining processes now")
        processes.hurry.set()


def _external_generators_reporting(records: list[dict[str, Any]], ours: set[str]) -> bool:
    """True if a generator this run did not start reports to the trainer (the run can go on without ours)."""
    reports = records[-1].get("generators", {}) if records else {}
    return any(gen_id not in ours for gen_id in (reports or {}))


def _show(
    view: Any, records: list[dict[str, Any]], processes: RunProcesses, probe: QueueProbe | None, **flags: bool
) -> None:
    """A view update during the clean-up: it must never stop the clean-up (e.g. the terminal is gone)."""
    if view is None:
        return
    with contextlib.suppress(Exception):
        view.update(records, processes.status(probe.values() if probe is not None else {}, **flags))


def run_pipeline(
    cfg: LeewayConfig, *, num_generators: int, view: Any = None, fresh: bool = False, resume: bool = False
) -> RunOutcome:
    """Start the stack (if needed), the trainer and the generators; follow metrics until the trainer exits.

    `view`: anything with `update(records, status: RunStatus)`. Everything started here is stopped here,
    also on Ctrl-C or SIGTERM (which set `interrupted`). `records` holds every metrics record written.
    `cfg` is left as it is: a private stack started here goes into a copy, which the roles and the queue
    probe run with. Raises `RunDirInUse` when run.dir holds an earlier run and neither `fresh` nor `resume`
    is set. With `resume` the private stack starts again on the data in `<run.dir>/stack` and the trainer
    continues from its newest checkpoint (`leeway trainer --resume`); metrics.jsonl goes on where it was.
    """
    run_dir = prepare_run_dir(cfg, fresh, resume=resume)
    processes = RunProcesses()
    records: list[dict[str, Any]] = []
    tail = MetricsTail(run_dir / "metrics.jsonl", records)
    interrupted = False
    error: str | None = None
    stack_started: Path | None = None
    probe: QueueProbe | None = None
    final_dir: Path | None = None
    final_error: str | None = None
    ours = set(generator_ids(num_generators))
    with _Signals(processes) as signals:
        try:
            stack_started = private_stack_dir(cfg, run_dir)
            if stack_started is not None:  # set first: an interrupted start is stopped too
                with tied_to_this_process():  # the servers die with this process, even on SIGKILL
                    start_stack(stack_started, bucket=stack_bucket(cfg))
                cfg = _with_stack_dir(cfg, stack_started)
            start_roles(cfg, run_dir, num_generators, [], processes, resume=resume)
            probe = QueueProbe(cfg).start()
            assert processes.trainer is not None
            while True:
                done = not processes.trainer.alive
                tail.poll()
                if view is not None:
                    view.update(records, processes.status(probe.values()))
                if done:
                    break
                if processes.generators and not any(g.alive for g in processes.generators):
                    if not _external_generators_reporting(records, ours):
                        codes = ", ".join(f"{g.name}: {g.returncode}" for g in processes.generators)
                        error = f"every generator process exited ({codes}); nothing can produce trajectories"
                        break
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            signals.stopping = True
            if interrupted:
                _say("\nleeway run: stopping generators, then the trainer ...")
            _show(view, records, processes, probe, stopping=True)
            if probe is not None:
                probe.close()
            try:
                processes.stop(cfg.stop_grace_s)
                tail.poll()
                _show(view, records, processes, None, stopped=True)
                trainer_done = processes.trainer is not None and processes.trainer.returncode == 0
                if trainer_done and not interrupted and error is None:
                    final_dir, final_error = export_final(run_dir, processes)
            finally:
                if stack_started is not None:
                    stop_stack(stack_started, timeout_s=0.0 if processes.hurry.is_set() else STACK_STOP_TIMEOUT_S)
    trainer = processes.trainer
    return RunOutcome(
        run_dir,
        records,
        trainer.returncode if trainer else None,
        interrupted,
        trainer.log_path if trainer else None,
        error=error,
        generator_rcs={g.name: g.returncode for g in processes.generators},
        evaluator_rc=processes.evaluator.returncode if processes.evaluator else None,
        stack_dir=stack_started,
        final_dir=final_dir,
        final_error=final_error,
    )


def export_final(run_dir: Path, processes: RunProcesses) -> tuple[Path | None, str | None]:
    """`leeway export` of the newest version into `<run_dir>/final/` (replacing an earlier run's), as a role
    process logging to `logs/export.log`, while the run's servers are still up; (directory, None) or (None, why).
    A second Ctrl-C (`processes.hurry`) stops it; then nothing is left in `final/`."""
    final = run_dir / FINAL_DIR
    _say(f"leeway run: exporting the final policy into {final} ...")
    log_path = run_dir / "logs" / "export.log"
    role = spawn_role("export", run_dir / "config.yaml", [], log_path, EXPORT_THREADS, flags=("--to", str(final)))
    while role.popen.poll() is None:
        if processes.hurry.is_set():
            role.popen.terminate()
        time.sleep(POLL_S)
    if role.popen.returncode != 0:
        return None, f"leeway export exited {role.popen.returncode}; the end of {log_path}:\n{log_tail(log_path)}"
    return final, None


def final_line(outcome: RunOutcome) -> str:
    """What `final/leeway.json` says: the version and step, and how to load it."""
    info = read_final(outcome.run_dir)
    if info is None:
        return "no leeway.json"
    return (
        f"version {info['version']}, step {info['step']}, {info['dtype']}; "
        f"AutoModelForCausalLM.from_pretrained({str(outcome.final_dir)!r})"
    )


def _with_stack_dir(cfg: LeewayConfig, stack_dir: Path) -> LeewayConfig:
    """A copy of `cfg` whose processes find their servers in `stack_dir`; the caller's `cfg` stays as it was."""
    return cfg.model_copy(update={"nats": cfg.nats.model_copy(update={"stack_dir": str(stack_dir)})})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`leeway run`'s description, flags and handler."""
    parser.description = (
        "Starts the embedded stack unless the config names servers, then the trainer "
        "and N generator processes; shows a live view; writes a report into run.dir at the end."
    )
    add_config_arguments(parser)
    parser.add_argument("--generators", type=int, default=None, help="generator processes (default: 1 on 2 cores)")
    parser.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="delete an earlier run's directory (run.dir) first, after stopping its private stack; only a "
        "directory `leeway run` created (it holds .leeway-run), never the working directory, home or /; "
        "a run that trained steps also needs --discard-checkpoints (its stack holds its checkpoints)",
    )
    parser.add_argument(
        "--discard-checkpoints",
        action="store_true",
        help="with --fresh: delete an earlier run even though it trained steps (its checkpoints and weights go too)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in run.dir: its private stack starts again on the same data, the trainer from its "
        "newest checkpoint (raise trainer.max_steps with --set to train past a finished run)",
    )
    parser.set_defaults(handler=WithConfig(main))


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    """`leeway run CONFIG [--generators N] [--no-live] [--fresh [--discard-checkpoints] | --resume]`: the run, its
    report, and an exit status (0 done, 1 a role or the servers failed, 2 bad arguments, run.dir in use, nothing
    to resume, or the trainer stopped the run on purpose, its reason the last line: a task that fails its verifier
    self-check, no trainable group for `trainer.queue_wait_timeout_s`; 130 interrupted)."""
    num_generators = args.generators or 1
    if num_generators < 1:
        print("leeway run: --generators must be at least 1", file=sys.stderr)
        return 2
    try:
        prepare_run_dir(cfg, fresh=args.fresh, resume=args.resume, discard_checkpoints=args.discard_checkpoints)
    except RunDirInUse as exc:
        print(f"leeway run: {exc}", file=sys.stderr)
        return 2
    except StackError as exc:
        print(f"leeway run: --fresh could not stop the earlier run's stack: {exc}", file=sys.stderr)
        return 1
    view = LiveView(cfg, num_generators, plain=args.no_live)
    try:
        with view:
            outcome = run_pipeline(cfg, num_generators=num_generators, view=view, resume=args.resume)
    except StackError as exc:
        print(f"leeway run: the embedded servers did not start: {exc}", file=sys.stderr)
        return 1
    report = write_report(outcome.run_dir, outcome.records, cfg)
    view.final(outcome)
    plot = outcome.run_dir / "report.png"
    print(
        f"leeway run: metrics {outcome.run_dir / 'metrics.jsonl'}, summary {report}"
        + (f", plot {plot}" if plot.exists() else "")
    )
    if outcome.final_dir is not None:
        print(
            f"leeway run: the final policy is a Hugging Face checkpoint in {outcome.final_dir} ({final_line(outcome)})"
        )
    elif outcome.final_error is not None:
        print(f"leeway run: the final policy was not exported: {outcome.final_error}", file=sys.stderr)
    if outcome.records and not can_plot():
        print(f"leeway run: {NO_PLOTS}")
    if outcome.interrupted:
        print("leeway run: interrupted; every process it started has stopped", file=sys.stderr)
        return 130
    if outcome.error is not None:
        print(f"leeway run: {outcome.error}", file=sys.stderr)
        for name, rc in outcome.generator_rcs.items():
            if rc not in (0, None):
                print(f"--- {name} log ({outcome.run_dir / 'logs' / (name + '.log')}):", file=sys.stderr)
                print(log_tail(outcome.run_dir / "logs" / f"{name}.log"), file=sys.stderr)
        return 1
    reason = stop_reason(outcome.trainer_log, "trainer") if outcome.trainer_rc == STOP_EXIT else None
    if reason is not None:  # an expected stop (a refused task, no learning signal): why, as the last line
        print(f"leeway run: the trainer stopped the run: {reason}", file=sys.stderr)
        return 2
    if outcome.final_error is not None:
        return 1
    if outcome.trainer_rc != 0:
        print(
            f"leeway run: the trainer exited with {outcome.trainer_rc}; the end of {outcome.trainer_log}:",
            file=sys.stderr,
        )
        print(log_tail(outcome.trainer_log), file=sys.stderr)
        return 1
    return 0
