"""No orphans: how a child Leeway starts is tied to its parent, and what a role does once that parent died.

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
`infra.process.spawn` ties the servers it starts inside `with tied_to_this_process():`; otherwise they
are free. Off Linux only the roles' watchdog exists: a SIGKILLed `leeway run` there leaves its private
servers running until `leeway run --fresh` (or `leeway stack down --dir <run.dir>/stack`) stops them.

This module holds only the rules; `infra.process.spawn_child` applies them to every child it starts
(the death signal, `PARENT_PID_ENV`), so they hold for servers, roles, ranks and fleet roles alike.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

PARENT_PID_ENV = "LEEWAY_PARENT_PID"
"""Set in a role's environment by its launcher: the pid the role must not outlive (see `watch_parent`)."""
PARENT_GRACE_ENV = "LEEWAY_PARENT_GRACE_S"
"""Set beside `PARENT_PID_ENV` when the launcher knows the run's stop grace (`LeewayConfig.stop_grace_s`):
the orphaned role's grace, so a trainer left alone still has its final checkpoint's budget."""

ORPHAN_POLL_S = 0.5
"""How often an orphan watchdog checks that its parent is still its parent."""

ORPHAN_GRACE_S = 150.0
"""How long an orphaned role may take to stop cleanly after SIGTERM before it SIGKILLs itself, unless its
launcher set `PARENT_GRACE_ENV`: the default stop grace (the final checkpoint's default budget + 30 s).
A role whose servers died with the launcher (its private stack) does not wait for it: see `ORPHAN_EXIT_CODE`."""

ORPHAN_PROBE_TIMEOUT_S = 1.0
"""How long the orphan watchdog waits for a TCP connect to one of the role's servers before it counts
that server as gone (a dead server on loopback refuses at once; this bounds a remote one that is silent)."""

ORPHAN_EXIT_CODE = 75
"""Exit status of an orphaned role that abandoned its clean stop because every server it needs is gone
(EX_TEMPFAIL: nothing was lost that a clean stop could have saved; the run resumes from its last checkpoint)."""

_PR_SET_PDEATHSIG = 1
"""`prctl` option from <linux/prctl.h>: the signal the calling process gets when its parent dies."""

_TIED: contextvars.ContextVar[bool] = contextvars.ContextVar("leeway_tied_spawn", default=False)
"""True inside `tied_to_this_process()`: `infra.process.spawn` then ties its servers to this process."""

log = logging.getLogger(__name__)


# --- parent death (Linux) --------------------------------------------------------------------------------------------


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


def server_death_signal() -> signal.Signals | None:
    """The signal a server spawned now gets when this process dies: SIGKILL inside `tied_to_this_process()`."""
    return signal.SIGKILL if _TIED.get() else None


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


# --- the orphan watchdog (every platform) ----------------------------------------------------------------------------

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
    """Say what an orphan gives up, flush the logs (`os._exit` skips that) and exit with `ORPHAN_EXIT_CODE`."""
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
