"""`leeway run`: the whole pipeline on one machine, each role its own OS process.

```
  leeway run ──starts──► embedded stack (private, in <run.dir>/stack, unless a healthy stack runs
      │                  at nats.stack_dir or the config names servers)
      ├──spawns──► leeway trainer   ──metrics.jsonl──┐
      ├──spawns──► leeway generator × N              │
      ├──polls───► NATS: prompts and groups waiting  │   (queue_probe.py, once a second)
      └──reads ◄─────────────────────────────────────┘  live view; report at the end
```

The roles talk only through NATS and S3, exactly as when launched by hand; this module only starts
them, splits the cores between them, shows the trainer's metrics, and stops everything it started.
The run directory's safety rules are in `actors/launcher/run_dir.py`, the queue depths in
`actors/launcher/queue_probe.py`; every child is started and stopped by `infra/process.py`.

Invariants:
- Every role runs in its own process group (a new session), so a terminal Ctrl-C reaches only this
  process, which then stops the roles in order: generators first (their held prompts go back to the
  queue), then the trainer (it finishes or abandons its step and checkpoints), each with SIGTERM
  and, after the run's stop grace (`run.stop_grace_s`; by default the final checkpoint's budget + 30 s)
  or at once on a second Ctrl-C, SIGKILL to its whole group.
- Nothing outlives this process, even when it is SIGKILLed: the roles get SIGTERM from the kernel when
  it dies (Linux parent-death signal) and also watch its pid themselves (`LEEWAY_PARENT_PID`,
  `infra.process.watch_parent`: SIGTERM, then SIGKILL after the same grace, or an immediate exit
  saying what it abandons once the servers its clean stop needs are all gone); the servers of a
  private stack get SIGKILL (`infra.process.tied_to_this_process`). Roles and the private stack are
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
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from actors.launcher.live_view import LiveView
from actors.launcher.queue_probe import QueueProbe
from actors.launcher.report import NO_PLOTS, can_plot, read_evals, write_report
from actors.launcher.run_dir import STACK_STOP_TIMEOUT_S, RunDirInUse, prepare_run_dir
from actors.servers import private_stack_dir, stack_bucket
from infra.files import write_private
from infra.process import StackError, log_tail, spawn_child, stop_groups, tied_to_this_process
from infra.role_logs import LOG_FILE_ENV, STOP_EXIT, stop_reason
from infra.stack import start_stack, stop_stack
from pipeline.config import LeewayConfig

POLL_S = 0.5
"""Refresh interval of the live view."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Each stops the run cleanly (SIGHUP: the terminal was closed); a second one kills what is left."""


def _say(text: str) -> None:
    """Print to stderr; a closed terminal (SIGHUP) must not interrupt the clean-up."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


@dataclass
class RoleProcess:
    """One role process `leeway run` started, with the log its output goes to."""

    name: str
    """`trainer` or the generator id (`gen-0`, ...)."""
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()


@dataclass(frozen=True)
class GeneratorProcessStatus:
    generator_id: str
    pid: int
    returncode: int | None
    """None while running."""
    log_path: Path


@dataclass(frozen=True)
class RunStatus:
    """What the live view needs besides the metrics records: processes and queue depths right now."""

    generators: tuple[GeneratorProcessStatus, ...] = ()
    trainer_alive: bool = True
    queues: dict[str, int | None] = field(default_factory=dict)
    """`prompts_waiting`, `prompts_in_generation`, `groups_waiting`, `groups_in_step` (None: unknown yet)."""
    stopping: bool = False
    stopped: bool = False
    """Every process this run started has exited (the last update)."""
    evals: tuple[dict[str, Any], ...] = ()
    """The evaluator's results so far (`eval.jsonl`), oldest first."""


@dataclass
class RunProcesses:
    """The role processes `leeway run` started, so that it stops exactly those (a Ray fleet is `actors/fleet/`)."""

    trainer: RoleProcess | None = None
    generators: list[RoleProcess] = field(default_factory=list)
    evaluator: RoleProcess | None = None
    """`leeway eval --follow`, when ``eval.every_steps`` is set."""
    eval_log: Path | None = None
    """Where the evaluator appends its results."""
    hurry: threading.Event = field(default_factory=threading.Event)
    """Set by a second Ctrl-C: kill instead of waiting."""

    def stop(self, timeout_s: float) -> None:
        """Generators first (all at once), then the trainer, then the evaluator (which first evaluates the versions
        due up to the last one published); each group is killed if it does not exit in time."""
        stop_roles(self.generators, timeout_s, self.hurry)
        if self.trainer is not None:
            stop_roles([self.trainer], timeout_s, self.hurry)
        if self.evaluator is not None:
            stop_roles([self.evaluator], timeout_s, self.hurry)

    def status(self, queues: dict[str, int | None], *, stopping: bool = False, stopped: bool = False) -> RunStatus:
        return RunStatus(
            generators=tuple(
                GeneratorProcessStatus(g.name, g.popen.pid, g.returncode, g.log_path) for g in self.generators
            ),
            trainer_alive=self.trainer is not None and self.trainer.alive,
            queues=dict(queues),
            stopping=stopping,
            stopped=stopped,
            evals=tuple(read_evals(self.eval_log.parent)) if self.eval_log is not None else (),
        )


def stop_roles(roles: list[RoleProcess], timeout_s: float, hurry: threading.Event | None = None) -> None:
    """SIGTERM every live role, wait up to `timeout_s` (less if `hurry` is set), then SIGKILL the groups.

    Each group whose leader was not reaped yet gets a SIGKILL regardless, so that nothing a role
    spawned outlives it; its leader is reaped only after that, so its process-group id is not reused
    before (`infra.process.stop_groups`).
    """
    unreaped = [r.popen for r in roles if r.popen.returncode is None]
    stop_groups([popen.pid for popen in unreaped], timeout_s, hurry=hurry, sweep=True)
    for popen in unreaped:
        popen.wait()


def split_threads(num_generators: int, cores: int | None = None) -> tuple[int, int]:
    """Torch threads for (trainer, each generator) so the roles do not fight over the cores."""
    cores = cores or os.cpu_count() or 2
    trainer = max(1, cores // 2)
    generator = max(1, (cores - trainer) // max(1, num_generators))
    return trainer, generator


def spawn_role(
    role: str,
    config_path: Path,
    overrides: list[str],
    log_path: Path,
    threads: int,
    name: str | None = None,
    grace_s: float | None = None,
    flags: tuple[str, ...] = (),
) -> RoleProcess:
    """Start `leeway <role> CONFIG` as its own session (process group), its threads pinned by env and config.

    The role dies with this process: SIGTERM from the kernel (Linux), and its own watchdog on our pid.
    Call it from a thread that outlives the role (the parent-death signal fires when that thread exits).
    """
    argv = [sys.executable, "-m", "actors.cli", role, str(config_path), *flags]
    for item in overrides:
        argv += ["--set", item]
    popen = spawn_child(
        argv,
        log_path=log_path,
        env=dict(
            os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), **{LOG_FILE_ENV: str(log_path)}
        ),
        death_signal=signal.SIGTERM,
        watchdog=True,
        watchdog_grace_s=grace_s,
    )
    return RoleProcess(name or role, popen, log_path)


def generator_ids(num_generators: int) -> list[str]:
    """The ids `leeway run` gives its own generators; a report under another id comes from a generator
    started elsewhere, which keeps the run going when ours have exited."""
    return [f"gen-{index}" for index in range(num_generators)]


def write_run_config(cfg: LeewayConfig, run_dir: Path) -> Path:
    """`<run_dir>/config.yaml`, the resolved config every role loads, written 0600: it may carry a NATS URL
    with its token or credential paths (`infra.files.write_private`)."""
    config_path = run_dir / "config.yaml"
    write_private(config_path, cfg.to_yaml())
    return config_path


def start_roles(
    cfg: LeewayConfig,
    run_dir: Path,
    num_generators: int,
    extra: list[str],
    processes: RunProcesses | None = None,
    *,
    resume: bool = False,
) -> RunProcesses:
    """Write the resolved config to `<run_dir>/config.yaml`; spawn the trainer (`--resume` with `resume`),
    then the generators.

    Each process is recorded in `processes` as soon as it exists, so an interrupted start is stopped too.
    """
    config_path = write_run_config(cfg, run_dir)
    trainer_threads, generator_threads = split_threads(num_generators)
    processes = processes if processes is not None else RunProcesses()
    logs = run_dir / "logs"
    trainer_sets = [*extra, f"trainer.torch_threads={trainer_threads}"]
    grace_s = cfg.stop_grace_s
    processes.trainer = spawn_role(
        "trainer",
        config_path,
        trainer_sets,
        logs / "trainer.log",
        trainer_threads,
        grace_s=grace_s,
        flags=("--resume",) if resume else (),
    )
    for gen_id in generator_ids(num_generators):
        sets = [*extra, f"engine.torch_threads={generator_threads}", f"generator.id={gen_id}"]
        processes.generators.append(
            spawn_role(
                "generator", config_path, sets, logs / f"{gen_id}.log", generator_threads, name=gen_id, grace_s=grace_s
            )
        )
    if cfg.eval.every_steps:
        sets = [*extra, "engine.torch_threads=1"]
        processes.evaluator = spawn_role(
            "eval", config_path, sets, logs / "eval.log", 1, name="evaluator", grace_s=grace_s, flags=("--follow",)
        )
        processes.eval_log = run_dir / "eval.jsonl"
    return processes


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
    )


def _with_stack_dir(cfg: LeewayConfig, stack_dir: Path) -> LeewayConfig:
    """A copy of `cfg` whose processes find their servers in `stack_dir`; the caller's `cfg` stays as it was."""
    return cfg.model_copy(update={"nats": cfg.nats.model_copy(update={"stack_dir": str(stack_dir)})})


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    """`leeway run CONFIG [--generators N] [--no-live] [--fresh [--discard-checkpoints] | --resume]`: the run, its
    report, and an exit status (0 done, 1 a role or the servers failed, 2 bad arguments, run.dir in use, nothing
    to resume, or the trainer stopped the run on purpose, its reason the last line: a task that fails its verifier
    self-check, no trainable group for `trainer.queue_wait_timeout_s`; 130 interrupted)."""
    num_generators = args.generators or 1
    if num_generators < 1:
        print("leeway run: --generators must be at least 1", file=sys.stderr)
        return 2
    resume = getattr(args, "resume", False)
    try:
        prepare_run_dir(
            cfg,
            fresh=getattr(args, "fresh", False),
            resume=resume,
            discard_checkpoints=getattr(args, "discard_checkpoints", False),
        )
    except RunDirInUse as exc:
        print(f"leeway run: {exc}", file=sys.stderr)
        return 2
    except StackError as exc:
        print(f"leeway run: --fresh could not stop the earlier run's stack: {exc}", file=sys.stderr)
        return 1
    view = LiveView(cfg, num_generators, plain=getattr(args, "no_live", False))
    try:
        with view:
            outcome = run_pipeline(cfg, num_generators=num_generators, view=view, resume=resume)
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
    if outcome.trainer_rc != 0:
        print(
            f"leeway run: the trainer exited with {outcome.trainer_rc}; the end of {outcome.trainer_log}:",
            file=sys.stderr,
        )
        print(log_tail(outcome.trainer_log), file=sys.stderr)
        return 1
    return 0
