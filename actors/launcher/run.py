"""`leeway run`: the whole pipeline on one machine, each role its own OS process.

```
  leeway run ──starts──► embedded stack (private, in <run.dir>/stack, unless a healthy stack runs
      │                  at nats.stack_dir or the config names servers)
      ├──spawns──► leeway trainer   ──metrics.jsonl──┐
      ├──spawns──► leeway generator × N              │
      ├──polls───► NATS: prompts and groups waiting  │   (QueueProbe, once a second)
      └──reads ◄─────────────────────────────────────┘  live view; report at the end
```

The roles talk only through NATS and S3, exactly as when launched by hand; this module only starts
them, splits the cores between them, shows the trainer's metrics, and stops everything it started.

Invariants:
- Every role runs in its own process group (a new session), so a terminal Ctrl-C reaches only this
  process, which then stops the roles in order: generators first (their held prompts go back to the
  queue), then the trainer (it finishes or abandons its step and checkpoints), each with SIGTERM
  and, after `STOP_TIMEOUT_S` (or at once on a second Ctrl-C), SIGKILL to its whole group.
- Nothing outlives this process, even when it is SIGKILLed: the roles get SIGTERM from the kernel when
  it dies (Linux parent-death signal) and also watch its pid themselves (`LEEWAY_PARENT_PID`,
  `infra.process.watch_parent`: SIGTERM, then SIGKILL after `ORPHAN_GRACE_S`); the servers of a
  private stack get SIGKILL (`infra.process.tied_to_this_process`). Roles and the private stack are
  spawned from the main thread, which lives until everything is stopped.
- A stack started here is stopped here; a stack found running is left running.
- `run.dir` gets a marker file (`RUN_MARKER`) when this module creates it; `--fresh` deletes only a
  directory holding it, never the working directory, home or `/` (or a parent of them), and stops
  the private stack recorded in it first.
- The run ends when the trainer exits, when all of this run's generators have exited while no other
  generator reports (nothing could make progress), or on Ctrl-C / SIGTERM / SIGHUP (`interrupted`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from actors.endpoints import connect_nats, private_stack_dir, stack_bucket
from actors.launcher.live_view import LiveView
from actors.launcher.report import write_report
from infra.process import PARENT_PID_ENV, StackError, die_with_parent, tied_to_this_process
from infra.stack import start_stack, stop_stack
from pipeline.config import LeewayConfig
from pipeline.wire.names import RunNames

STOP_TIMEOUT_S = 20.0
"""How long a role gets to finish after SIGTERM before its process group is killed."""
STACK_STOP_TIMEOUT_S = 3.0
"""SIGTERM grace of a private stack: SeaweedFS can ignore SIGTERM for ~20 s; a SIGKILL loses nothing written."""
POLL_S = 0.5
"""Refresh interval of the live view."""
QUEUE_POLL_S = 1.0
"""How often the queue depths are read from NATS."""
LOG_TAIL_LINES = 15
"""Lines of a failed role's log printed at the end."""
RUN_MARKER = ".leeway-run"
"""Written into every run directory `leeway run` creates; `--fresh` deletes only a directory holding it."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Each stops the run cleanly (SIGHUP: the terminal was closed); a second one kills what is left."""


def _say(text: str) -> None:
    """Print to stderr; a closed terminal (SIGHUP) must not interrupt the clean-up."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


class RunDirInUse(RuntimeError):
    """run.dir holds an earlier run; `--fresh` deletes it."""


class RunDirRefused(RunDirInUse):
    """`--fresh` will not delete run.dir: it is not a run directory Leeway created, or it is a protected one."""


@dataclass
class RoleProcess:
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


@dataclass
class Fleet:
    """The processes `leeway run` started, so that it stops exactly those."""

    trainer: RoleProcess | None = None
    generators: list[RoleProcess] = field(default_factory=list)
    hurry: threading.Event = field(default_factory=threading.Event)
    """Set by a second Ctrl-C: kill instead of waiting."""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Generators first (all at once), then the trainer; each group is killed if it does not exit in time."""
        stop_roles(self.generators, timeout_s, self.hurry)
        if self.trainer is not None:
            stop_roles([self.trainer], timeout_s, self.hurry)

    def status(self, queues: dict[str, int | None], *, stopping: bool = False, stopped: bool = False) -> RunStatus:
        return RunStatus(
            generators=tuple(
                GeneratorProcessStatus(g.name, g.popen.pid, g.returncode, g.log_path) for g in self.generators
            ),
            trainer_alive=self.trainer is not None and self.trainer.alive,
            queues=dict(queues),
            stopping=stopping,
            stopped=stopped,
        )


def _signal_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the role's whole process group (it leads its own session); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def _running(popen: subprocess.Popen[bytes]) -> bool:
    """True while the process has not exited; unlike `poll()` this does not reap it, so its pid (and
    process-group id) cannot be reused before the final group SIGKILL."""
    if popen.returncode is not None:
        return False
    try:
        info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return info is None


def stop_roles(roles: list[RoleProcess], timeout_s: float, hurry: threading.Event | None = None) -> None:
    """SIGTERM every live role, wait up to `timeout_s` (less if `hurry` is set), then SIGKILL the groups.

    Each group whose leader was not reaped yet gets a SIGKILL regardless, so that nothing a role
    spawned outlives it.
    """
    unreaped = [r for r in roles if r.popen.returncode is None]
    for role in unreaped:
        if _running(role.popen):
            _signal_group(role.popen, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(_running(r.popen) for r in unreaped) and time.monotonic() < deadline:
        if hurry is not None and hurry.is_set():
            break
        time.sleep(0.05)
    for role in unreaped:
        _signal_group(role.popen, signal.SIGKILL)
        role.popen.wait()


def split_threads(num_generators: int, cores: int | None = None) -> tuple[int, int]:
    """Torch threads for (trainer, each generator) so the roles do not fight over the cores."""
    cores = cores or os.cpu_count() or 2
    trainer = max(1, cores // 2)
    generator = max(1, (cores - trainer) // max(1, num_generators))
    return trainer, generator


def spawn_role(
    role: str, config_path: Path, overrides: list[str], log_path: Path, threads: int, name: str | None = None
) -> RoleProcess:
    """Start `leeway <role> CONFIG` as its own session (process group), its threads pinned by env and config.

    The role dies with this process: SIGTERM from the kernel (Linux), and its own watchdog on our pid.
    Call it from a thread that outlives the role (the parent-death signal fires when that thread exits).
    """
    env = dict(
        os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), **{PARENT_PID_ENV: str(os.getpid())}
    )
    argv = [sys.executable, "-m", "actors.cli", role, str(config_path)]
    for item in overrides:
        argv += ["--set", item]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child keeps its own copy of the handle
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
    return RoleProcess(name or role, popen, log_path)


def prepare_run_dir(cfg: LeewayConfig, fresh: bool) -> Path:
    """The run directory, emptied first with `fresh`; an earlier run is never silently mixed in.

    A directory created here (or found empty) gets `RUN_MARKER`. Raises `RunDirInUse` when it holds an
    earlier run and `fresh` is false, `RunDirRefused` when `fresh` may not delete it.
    """
    run_dir = cfg.run.run_dir
    if fresh and (run_dir.exists() or run_dir.is_symlink()):
        delete_run_dir(run_dir)
    elif (run_dir / "metrics.jsonl").exists():
        raise RunDirInUse(
            f"{run_dir} holds an earlier run (metrics.jsonl); pass --fresh to delete it, or choose "
            f"another directory with --set run.dir=... (and a new run.name if the servers are shared)"
        )
    new = not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir()))
    run_dir.mkdir(parents=True, exist_ok=True)
    if new:
        (run_dir / RUN_MARKER).write_text("created by `leeway run`; `leeway run --fresh` may delete this directory\n")
    return run_dir


def protected_reason(path: Path) -> str | None:
    """Why `path` must never be deleted whole (the working directory, home, `/`, or a parent of them), or None."""
    resolved = path.resolve()
    if resolved == Path(resolved.anchor):
        return "the filesystem root"
    for what, guarded in (("the working directory", Path.cwd()), ("the home directory", Path.home())):
        guarded = guarded.resolve()
        if resolved == guarded:
            return f"{what} ({guarded})"
        if resolved in guarded.parents:
            return f"a parent of {what} ({guarded})"
    return None


def delete_run_dir(run_dir: Path) -> None:
    """`--fresh`: stop the private stack recorded in `run_dir`, then delete the directory.

    Only a real directory holding `RUN_MARKER` is deleted, and never a protected one (`protected_reason`);
    an empty directory without the marker is kept (there is nothing to delete). Raises `RunDirRefused`.
    """
    reason = protected_reason(run_dir)
    if reason is not None:
        raise RunDirRefused(
            f"--fresh refuses to delete {run_dir}: it is {reason}; set run.dir to a directory of its own"
        )
    if run_dir.is_symlink() or not run_dir.is_dir():
        raise RunDirRefused(f"--fresh refuses to delete {run_dir}: not a directory (a link or a file)")
    if not (run_dir / RUN_MARKER).is_file():
        if not any(run_dir.iterdir()):
            return
        raise RunDirRefused(
            f"--fresh deletes only a run directory `leeway run` created (it holds {RUN_MARKER}); {run_dir} "
            f"has none: delete it yourself, or choose another directory with --set run.dir=..."
        )
    stop_stack(run_dir / "stack", timeout_s=STACK_STOP_TIMEOUT_S)  # e.g. left running by a killed run
    shutil.rmtree(run_dir)


def generator_ids(num_generators: int) -> list[str]:
    return [f"gen-{index}" for index in range(num_generators)]


def start_fleet(
    cfg: LeewayConfig, run_dir: Path, num_generators: int, extra: list[str], fleet: Fleet | None = None
) -> Fleet:
    """Write the resolved config to `<run_dir>/config.yaml`; spawn the trainer, then the generators.

    Each process is recorded in `fleet` as soon as it exists, so an interrupted start is stopped too.
    """
    config_path = run_dir / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    trainer_threads, generator_threads = split_threads(num_generators)
    fleet = fleet if fleet is not None else Fleet()
    logs = run_dir / "logs"
    trainer_sets = [*extra, f"trainer.torch_threads={trainer_threads}"]
    fleet.trainer = spawn_role("trainer", config_path, trainer_sets, logs / "trainer.log", trainer_threads)
    for gen_id in generator_ids(num_generators):
        sets = [*extra, f"engine.torch_threads={generator_threads}", f"generator.id={gen_id}"]
        fleet.generators.append(
            spawn_role("generator", config_path, sets, logs / f"{gen_id}.log", generator_threads, name=gen_id)
        )
    return fleet


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


# ------------------------------------------------------------------------------------------ queues


class QueueProbe:
    """Reads the queue depths from NATS once a second in a daemon thread (its own event loop).

    - `prompts_waiting`: admitted prompts no generator has taken yet (generators' consumer num_pending);
    - `prompts_in_generation`: taken, not yet done (num_ack_pending);
    - `groups_waiting`: published groups the trainer has not fetched (trainer consumer num_pending);
    - `groups_in_step`: fetched into the trainer's current step, not yet acked.
    A stream or consumer that does not exist yet reads as None. Never raises into the caller.
    """

    def __init__(self, cfg: LeewayConfig) -> None:

        self.cfg = cfg
        self.names = RunNames.for_run(cfg.run.name)
        self._values: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="leeway-queue-probe", daemon=True)

    def start(self) -> QueueProbe:
        self._thread.start()
        return self

    def values(self) -> dict[str, int | None]:
        with self._lock:
            return dict(self._values)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3.0)

    def _main(self) -> None:
        with contextlib.suppress(Exception):  # a probe is a nicety: the run goes on without it
            asyncio.run(self._loop())

    async def _loop(self) -> None:

        nc = await connect_nats(self.cfg, name="leeway-run-probe")
        try:
            js = nc.jetstream()
            while not self._stop.is_set():
                values = {
                    **await self._consumer(js, self.names.prompt_stream, self.names.generator_consumer, "prompts"),
                    **await self._consumer(js, self.names.trajectory_stream, self.names.trainer_consumer, "groups"),
                }
                with self._lock:
                    self._values = values
                await asyncio.to_thread(self._stop.wait, QUEUE_POLL_S)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)

    @staticmethod
    async def _consumer(js: Any, stream: str, consumer: str, what: str) -> dict[str, int | None]:
        waiting, held = f"{what}_waiting", f"{what}_in_generation" if what == "prompts" else f"{what}_in_step"
        try:
            info = await asyncio.wait_for(js.consumer_info(stream, consumer), 2.0)
        except Exception:  # not created yet, or the server is away for a moment
            return {waiting: None, held: None}
        return {waiting: int(info.num_pending), held: int(info.num_ack_pending)}


# ------------------------------------------------------------------------------------------- run


@dataclass
class RunOutcome:
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

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
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
        fleet = self.fleet
        if not fleet.hurry.is_set():
            _say("leeway run: killing the remaining processes now")
        fleet.hurry.set()


def _external_generators_reporting(records: list[dict[str, Any]], ours: set[str]) -> bool:
    reports = records[-1].get("generators", {}) if records else {}
    return any(gen_id not in ours for gen_id in (reports or {}))


def _show(view: Any, records: list[dict[str, Any]], fleet: Fleet, probe: QueueProbe | None, **flags: bool) -> None:
    """A view update during the clean-up: it must never stop the clean-up (e.g. the terminal is gone)."""
    if view is None:
        return
    with contextlib.suppress(Exception):
        view.update(records, fleet.status(probe.values() if probe is not None else {}, **flags))


def run_pipeline(cfg: LeewayConfig, *, num_generators: int, view: Any = None, fresh: bool = False) -> RunOutcome:
    """Start the stack (if needed), the trainer and the generators; follow metrics until the trainer exits.

    `view`: anything with `update(records, status: RunStatus)`. Everything started here is stopped here,
    also on Ctrl-C or SIGTERM (which set `interrupted`). `records` holds every metrics record written.
    Raises `RunDirInUse` when run.dir holds an earlier run and `fresh` is false.
    """

    run_dir = prepare_run_dir(cfg, fresh)
    fleet = Fleet()
    records: list[dict[str, Any]] = []
    offset = 0
    metrics_path = run_dir / "metrics.jsonl"
    interrupted = False
    error: str | None = None
    stack_started: Path | None = None
    probe: QueueProbe | None = None
    ours = set(generator_ids(num_generators))
    with _Signals(fleet) as signals:
        try:
            stack_started = private_stack_dir(cfg, run_dir)
            if stack_started is not None:  # set first: an interrupted start is stopped too
                with tied_to_this_process():  # the servers die with this process, even on SIGKILL
                    start_stack(stack_started, bucket=stack_bucket(cfg))
                cfg.nats.stack_dir = str(stack_started)
            start_fleet(cfg, run_dir, num_generators, [], fleet)
            probe = QueueProbe(cfg).start()
            assert fleet.trainer is not None
            while True:
                done = not fleet.trainer.alive
                new, offset = read_metrics(metrics_path, offset)
                records.extend(new)
                if view is not None:
                    view.update(records, fleet.status(probe.values()))
                if done:
                    break
                if fleet.generators and not any(g.alive for g in fleet.generators):
                    if not _external_generators_reporting(records, ours):
                        codes = ", ".join(f"{g.name}: {g.returncode}" for g in fleet.generators)
                        error = f"every generator process exited ({codes}); nothing can produce trajectories"
                        break
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            signals.stopping = True
            if interrupted:
                _say("\nleeway run: stopping generators, then the trainer ...")
            _show(view, records, fleet, probe, stopping=True)
            if probe is not None:
                probe.close()
            try:
                fleet.stop()
                new, offset = read_metrics(metrics_path, offset)
                records.extend(new)
                _show(view, records, fleet, None, stopped=True)
            finally:
                if stack_started is not None:
                    stop_stack(stack_started, timeout_s=0.0 if fleet.hurry.is_set() else STACK_STOP_TIMEOUT_S)
    trainer = fleet.trainer
    return RunOutcome(
        run_dir,
        records,
        trainer.returncode if trainer else None,
        interrupted,
        trainer.log_path if trainer else None,
        error=error,
        generator_rcs={g.name: g.returncode for g in fleet.generators},
        stack_dir=stack_started,
    )


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:

    num_generators = args.generators or 1
    if num_generators < 1:
        print("leeway run: --generators must be at least 1", file=sys.stderr)
        return 2
    try:
        prepare_run_dir(cfg, fresh=getattr(args, "fresh", False))
    except RunDirInUse as exc:
        print(f"leeway run: {exc}", file=sys.stderr)
        return 2
    except StackError as exc:
        print(f"leeway run: --fresh could not stop the earlier run's stack: {exc}", file=sys.stderr)
        return 1
    view = LiveView(cfg, num_generators, plain=getattr(args, "no_live", False))
    try:
        with view:
            outcome = run_pipeline(cfg, num_generators=num_generators, view=view)
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
    if outcome.trainer_rc != 0:
        print(
            f"leeway run: the trainer exited with {outcome.trainer_rc}; the end of {outcome.trainer_log}:",
            file=sys.stderr,
        )
        print(log_tail(outcome.trainer_log), file=sys.stderr)
        return 1
    return 0
