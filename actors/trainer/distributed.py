"""Trainer ranks: the standard launch environment, the process group, and `leeway trainer --nproc N`.

One entry point serves every launcher. A rank reads the usual variables::

    RANK  WORLD_SIZE  LOCAL_RANK  MASTER_ADDR  MASTER_PORT      (torchrun, multi-node, a fleet, `--nproc`)

and joins a `torch.distributed` group (gloo on CPU, NCCL on CUDA, each rank on ``cuda:LOCAL_RANK``);
without them (or with ``WORLD_SIZE=1``) the trainer is one plain process. `launch_ranks` is what
`--nproc N` does on one machine: it starts N copies of the same command (``python -m actors.cli
trainer CONFIG ...`` without ``--nproc``) with those variables set (``MASTER_ADDR=127.0.0.1``, a free
port) and watches them:

- the first rank to exit non-zero or by a signal stops the others (SIGTERM, SIGKILL after a grace
  period, to each rank's process group: `infra.process.stop_groups`), and the launcher exits non-zero
  naming that rank; no rank is left waiting in a collective (they also give up after
  ``trainer.dist_timeout_s``);
- SIGINT/SIGTERM to the launcher go to rank 0 only, which finishes or abandons its step, writes the
  final checkpoint with the other ranks and then tells them to stop (`actors/trainer/rank_group.py`);
- ranks die with the launcher (parent-death signal; rank 0 gets SIGTERM so it can checkpoint) and
  watch its pid too (`LEEWAY_PARENT_PID`); each is started by `infra.process.spawn_child`, like every
  child Leeway starts.

Any backend that joins the group from this environment can be launched this way; what rank 0 and
the others do after that is in `actors/trainer/rank_group.py`.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from infra.ports import LOOPBACK, free_port, is_loopback
from infra.process import spawn_child, stop_groups
from infra.role_logs import LOG_FILE_ENV

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0
"""How long the launcher lets the remaining ranks stop after SIGTERM before it kills them."""


@dataclass(frozen=True)
class RankEnv:
    """Where this process stands in the trainer's rank group, from the launch environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = LOOPBACK
    master_port: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RankEnv:
        """Parse RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; bad values raise naming the variable."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return cls()

        def number(name: str, default: str | None = None) -> int:
            raw = env.get(name, default)
            if raw is None:
                raise ValueError(f"{name} must be set when WORLD_SIZE is (torchrun-style launch)")
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer") from None

        world = number("WORLD_SIZE")
        if world < 1:
            raise ValueError(f"WORLD_SIZE={world} must be >= 1")
        if world == 1:
            return cls()
        rank = number("RANK")
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
        port = number("MASTER_PORT")
        return cls(rank, world, number("LOCAL_RANK", str(rank)), env.get("MASTER_ADDR", LOOPBACK), port)


def join_rank_group(rank_env: RankEnv, device: str, timeout_s: float) -> torch.device:
    """Join the process group (no-op for one rank); returns this rank's device (``cuda:LOCAL_RANK`` on CUDA)."""
    target = torch.device(device)
    if not rank_env.distributed:
        return target
    if target.type == "cuda":
        target = torch.device("cuda", rank_env.local_rank)
        torch.cuda.set_device(target)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if target.type == "cuda" else "gloo"
    store = loopback_store(rank_env, timeout)
    if store is not None:
        dist.init_process_group(
            backend, store=store, rank=rank_env.rank, world_size=rank_env.world_size, timeout=timeout
        )
    else:  # a multi-node launcher's MASTER_ADDR: the rendezvous port must be private (docs/design.md)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{rank_env.master_addr}:{rank_env.master_port}",
            rank=rank_env.rank,
            world_size=rank_env.world_size,
            timeout=timeout,
        )
    log.info("rank %d of %d joined (%s, %s)", rank_env.rank, rank_env.world_size, dist.get_backend(), target)
    return target


def loopback_store(rank_env: RankEnv, timeout: datetime.timedelta) -> dist.TCPStore | None:
    """The rendezvous store of a single-host group (`MASTER_ADDR` on loopback), rank 0's bound to 127.0.0.1 alone.

    Why not `init_method=tcp://127.0.0.1:PORT`: torch's store server listens on every interface
    whatever host it is given (`*:PORT`), and it has no authentication, so anyone on the network
    could join or poison the group's keys. Here rank 0 binds and listens on a socket itself and hands
    the store its descriptor (`master_listen_fd`), which torch then serves as is; the other ranks are
    plain clients of 127.0.0.1. None when `MASTER_ADDR` is another host (a multi-node launcher), or
    when torchrun's agent already hosts the store (`TORCHELASTIC_USE_AGENT_STORE`): those keep torch's
    own rendezvous.
    """
    if not is_loopback(rank_env.master_addr) or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    if not rank_env.is_leader:
        return dist.TCPStore(LOOPBACK, rank_env.master_port, rank_env.world_size, False, timeout, multi_tenant=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, rank_env.master_port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    # the store owns the descriptor from here: a Python socket object would close it under the server
    fd = sock.detach()
    return dist.TCPStore(
        LOOPBACK,
        rank_env.master_port,
        rank_env.world_size,
        True,
        timeout,
        multi_tenant=True,
        master_listen_fd=fd,
    )


def leave_rank_group() -> None:
    """Destroy this rank's process groups now, while the interpreter is whole (no-op when none was joined).

    Why: a gloo group left to interpreter exit is destroyed during finalization (its worker threads
    release tensors, which needs the GIL) and after the peers' sockets are gone, and the rank can die
    with SIGABRT. `destroy_process_group` alone does not free the groups: megatron-core keeps its
    TP/PP/DP groups in module globals and FSDP2's device mesh holds the default one in reference
    cycles. So every group is destroyed, megatron's globals are dropped and the cycles collected, and
    each group's destructor (which joins its threads) runs here. Callers drop their own references to
    the backend first, and end their collectives together before (`RankGroup.stop` waits in a barrier
    until every rank has read STOP).
    """
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    parallel_state = sys.modules.get("megatron.core.parallel_state")  # imported only by the megatron backend
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    gc.collect()


def rank_environ(base: Mapping[str, str], rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of rank `rank` started by `launch_ranks` on this machine (`spawn_child` adds the
    launcher's pid, `LEEWAY_PARENT_PID`)."""
    return {
        **{k: v for k, v in base.items() if k != LOG_FILE_ENV},  # ranks share the launcher's output, unrotated
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
    }


def launch_ranks(argv: Sequence[str], nproc: int, *, grace_s: float = STOP_GRACE_S) -> int:
    """Start `argv` as `nproc` ranks, wait for them; 0 only if every rank exited 0 (see the module docstring).
    `grace_s`: the ranks' SIGTERM-to-SIGKILL grace (the run's `stop_grace_s`: rank 0's final checkpoint).

    Each rank is its own session, so a terminal's Ctrl-C reaches the launcher alone, which hands it
    to rank 0. Waiting is `os.wait` (woken by each child's exit), never a poll; only stopping the
    other ranks after a failure polls, for at most `grace_s`.
    """
    if nproc < 1:
        raise ValueError(f"--nproc {nproc} must be >= 1")
    port = free_port()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    for rank in range(nproc):
        procs[rank] = spawn_child(
            argv,
            env=rank_environ(os.environ, rank, nproc, port),
            death_signal=signal.SIGTERM if rank == 0 else signal.SIGKILL,
            watchdog=True,
            watchdog_grace_s=grace_s,
        )
    log.info(
        "started %d trainer ranks (pids %s), rendezvous %s:%d", nproc, [p.pid for p in procs.values()], LOOPBACK, port
    )
    by_pid = {p.pid: rank for rank, p in procs.items()}
    remaining = set(procs)

    def forward(signum: int, frame: FrameType | None) -> None:
        if 0 in remaining:
            os.kill(procs[0].pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    failure: str | None = None
    try:
        while remaining:
            pid, status = _wait_any()
            rank = by_pid.get(pid)
            if rank is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            procs[rank].returncode = code
            remaining.discard(rank)
            if code != 0 and failure is None:
                how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                failure = f"trainer rank {rank} of {nproc} (pid {pid}) {how}; stopping the other ranks"
                log.error("%s", failure)
                print(f"leeway trainer: {failure}", file=sys.stderr, flush=True)
                # not reaped meanwhile (this thread is the one that waits), so each pid is still that rank
                stop_groups([procs[other].pid for other in sorted(remaining)], grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if failure is None else 1


def _wait_any() -> tuple[int, int]:
    """`os.wait`, retried when a signal handler interrupted it."""
    while True:
        try:
            return os.wait()
        except InterruptedError:
            continue
