"""`leeway bench sandbox`: what a bubblewrap sandbox costs an episode, against the same work without one, in one run.

    start, one after another (--starts, interleaved, each closed after):
      BwrapSandbox.start ─► bwrap (namespaces, binds, a uid of its own) ─► python3 supervisor ─► "ready"
                                                                  (bwrap_start_p50_ms / _p99_ms)
      LocalSandbox.start ─► the same supervisor, no namespaces     (local_start_*, bwrap_vs_local_start)
      python3 -I -S -c pass, until it exits                        (subprocess_start_*, bwrap_vs_subprocess_start)
    exec round trip, on one started sandbox (--execs, interleaved):
      box.exec("true") ─► JSON line ─► supervisor ─► bash -c true ─► JSON reply  (exec_p50_ms / _p99_ms)
      create_subprocess_exec("bash", "-c", "true"), pipes read to EOF           (subprocess_exec_*, exec_vs_subprocess)
    the pool, --pool-starts episodes at once (asyncio.gather), each start + one exec + close:
      SandboxPool(max_concurrent=--concurrency, starts_per_s=--wave-rate)  (starts_per_s_waves,
                                                                           max_admitted_in_any_1s_window)
      the same pool, starts_per_s=0                                        (starts_per_s_no_waves, waves_vs_no_waves)

Why: every agentic episode starts a sandbox and runs tens of commands in it, so the start latency and the exec
round trip are paid per episode and per tool call; the local and subprocess baselines say how much of that is
the isolation (namespaces, mounts, a uid of its own) and how much the supervisor or plain process creation.
The pool runs say what the waves cost in throughput (a generator admitting a batch of episodes at once) and that
they hold: no 1 s window admits more than ``--wave-rate`` starts (+1 for a start on the window's edge). The
``starts_per_s_*`` are episodes over the wall time of the whole gather, so the last episode's exec and close
count too. Each pool sandbox reserves ``cpus / concurrency`` of the machine, so the slots and the waves, not
the CPU reservation, bound the admission being measured. Ratios are p50 over p50: above 1 is slower.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from actors.cli_args import positive_int
from pipeline.sandbox.base import SandboxRefused, SandboxSpec
from pipeline.sandbox.bwrap import BwrapSandbox, require_bwrap
from pipeline.sandbox.local import LocalSandbox
from pipeline.sandbox.pool import PoolSettings, SandboxPool
from pipeline.sandbox.supervised import SupervisedSandbox

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
"""The PATH the supervisor gets (`SupervisedSandbox._env`): the baselines resolve python3 and bash on it too, so all
three run the same interpreter (not, say, a pyenv shim that is a shell script)."""
EXEC_TIMEOUT_S = 30.0
POOL_MEMORY_MB = 64
"""Each pool sandbox's memory reservation: small, so the reservation never binds before the slots do."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--starts", type=positive_int, default=40, help="sequential starts of each kind")
    parser.add_argument("--execs", type=positive_int, default=200, help="exec('true') round trips on one sandbox")
    parser.add_argument("--pool-starts", type=positive_int, default=40, help="episodes through the pool, each run")
    parser.add_argument("--wave-rate", type=float, default=20.0, help="the pool's starts_per_s in the waves run")
    parser.add_argument("--concurrency", type=positive_int, default=8, help="the pool's max_concurrent")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.wave_rate <= 0:
        raise SystemExit(f"leeway bench sandbox: --wave-rate {args.wave_rate:g} must be > 0")
    try:
        require_bwrap()
    except SandboxRefused as exc:
        raise SystemExit(f"leeway bench sandbox: {exc}") from None
    result: dict[str, Any] = {
        "backend": "bwrap",
        "starts": args.starts,
        "execs": args.execs,
        "pool_starts": args.pool_starts,
        "wave_rate": args.wave_rate,
        "concurrency": args.concurrency,
    }
    result.update(asyncio.run(_bench(args)))
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    python3, bash = _on_sandbox_path("python3"), _on_sandbox_path("bash")
    starts = await _interleaved(
        {
            "bwrap": lambda: _sandbox_start(BwrapSandbox),
            "local": lambda: _sandbox_start(LocalSandbox),
            "subprocess": lambda: _process(python3, "-I", "-S", "-c", "pass"),
        },
        args.starts,
    )
    for kind, seconds in starts.items():
        out.update(_percentiles(f"{kind}_start", seconds))
    out["bwrap_vs_local_start"] = out["bwrap_start_p50_ms"] / out["local_start_p50_ms"]
    out["bwrap_vs_subprocess_start"] = out["bwrap_start_p50_ms"] / out["subprocess_start_p50_ms"]

    box = BwrapSandbox(SandboxSpec(label="bench-exec"))
    await box.start()
    try:
        execs = await _interleaved(
            {"exec": lambda: _exec_true(box), "subprocess_exec": lambda: _process(bash, "-c", "true")}, args.execs
        )
    finally:
        await box.close()
    for kind, seconds in execs.items():
        out.update(_percentiles(kind, seconds))
    out["exec_vs_subprocess"] = out["exec_p50_ms"] / out["subprocess_exec_p50_ms"]

    waves, admitted = await _pool_run(args.wave_rate, args.concurrency, args.pool_starts)
    no_waves, _ = await _pool_run(0.0, args.concurrency, args.pool_starts)
    out["starts_per_s_waves"] = waves
    out["starts_per_s_no_waves"] = no_waves
    out["waves_vs_no_waves"] = waves / no_waves
    out["max_admitted_in_any_1s_window"] = max_in_window(admitted, 1.0)
    return out


def _on_sandbox_path(name: str) -> str:
    found = shutil.which(name, path=SANDBOX_PATH)
    if found is None:
        raise SystemExit(f"leeway bench sandbox: no {name} on {SANDBOX_PATH}")
    return found


async def _interleaved(kinds: dict[str, Callable[[], Awaitable[float]]], rounds: int) -> dict[str, list[float]]:
    """Each kind once untimed (page cache, first imports), then `rounds` rounds of one of each in turn, so a
    machine that slows down or speeds up during the run moves every kind alike and the ratios stay fair."""
    for measure in kinds.values():
        await measure()
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind, measure in kinds.items():
            seconds[kind].append(await measure())
    return seconds


async def _sandbox_start(kind: type[SupervisedSandbox]) -> float:
    """Seconds from `start` until the supervisor said ready (the close, not timed, waits for the uid's teardown)."""
    box = kind(SandboxSpec(label=f"bench-start-{kind.backend}"))
    began = time.perf_counter()
    try:
        await box.start()
        return time.perf_counter() - began
    finally:
        await box.close()


async def _exec_true(box: SupervisedSandbox) -> float:
    began = time.perf_counter()
    result = await box.exec("true", timeout_s=EXEC_TIMEOUT_S)
    seconds = time.perf_counter() - began
    if not result.ok:
        raise RuntimeError(f"exec('true') in the sandbox failed: exit {result.exit_code}: {result.stderr.strip()}")
    return seconds


async def _process(*argv: str) -> float:
    """Seconds to start `argv` with its output piped, as the supervisor pipes a command's, until it has exited."""
    began = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await proc.communicate()
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {stderr.decode(errors='replace').strip()}")
    return seconds


async def _pool_run(starts_per_s: float, concurrency: int, episodes: int) -> tuple[float, list[float]]:
    """Episodes per second of wall time through a bwrap pool, and the monotonic time each start was admitted."""
    settings = PoolSettings(
        backend="bwrap",
        max_concurrent=concurrency,
        starts_per_s=starts_per_s,
        cpus=(os.cpu_count() or 1) / concurrency,
        memory_mb=POOL_MEMORY_MB,
    )
    pool = SandboxPool(settings)

    async def episode(index: int) -> None:
        async with pool.sandbox(SandboxSpec(label=f"bench-pool-{index}")) as box:
            await _exec_true(box)

    began = time.perf_counter()
    try:
        await asyncio.gather(*(episode(i) for i in range(episodes)))
    finally:
        await pool.close()
    wall = time.perf_counter() - began
    return episodes / wall, list(pool.stats.admitted_s)


def max_in_window(times: Sequence[float], window_s: float) -> int:
    """The most of `times` inside any half-open window ``[t, t + window_s)`` (one starting at each time is enough)."""
    ordered = sorted(times)
    most, first = 0, 0
    for last, t in enumerate(ordered):
        while t - ordered[first] >= window_s:
            first += 1
        most = max(most, last - first + 1)
    return most


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100), linear between closest ranks (numpy's default); one value is every percentile."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _percentiles(name: str, seconds: Sequence[float]) -> dict[str, float]:
    return {f"{name}_p50_ms": percentile(seconds, 50) * 1e3, f"{name}_p99_ms": percentile(seconds, 99) * 1e3}
