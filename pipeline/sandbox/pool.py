"""Admission of sandboxes: at most ``max_concurrent`` at once, started in waves of at most ``starts_per_s`` a second,
each reserving its ``cpus`` and ``memory_mb`` out of what the machine has, an idle reaper, and a teardown of
every sandbox when its episode ends (`SandboxPool.sandbox` is a context manager) and when the pool closes.

At scale the sandbox fleet is what breaks first (cold starts, neighbours starving each other, thousands of
starts at once): a generator that admits its episodes all at once would start every sandbox in the same second.
Here an episode waits for its slot, its reservation and its turn in the wave, and only then starts; a wait for the
slot and the reservation past ``admission_timeout_s`` is `SandboxStartTimeout`, so no episode waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from pipeline.sandbox.base import SandboxLimits, SandboxRefused, SandboxSpec, SandboxStartTimeout
from pipeline.sandbox.bwrap import BwrapSandbox, bwrap_binary
from pipeline.sandbox.local import LocalSandbox
from pipeline.sandbox.supervised import SupervisedSandbox

log = logging.getLogger(__name__)

Backend = Literal["auto", "bwrap", "local"]


@dataclass(frozen=True)
class PoolSettings:
    """The `sandbox.*` config section, as the pool needs it (`pipeline/config_sections.py` documents each)."""

    backend: Backend = "auto"
    allow_unisolated: bool = False
    max_concurrent: int = 8
    starts_per_s: float = 4.0
    cpus: float = 1.0
    memory_mb: int = 1024
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    start_timeout_s: float = 60.0
    admission_timeout_s: float = 1800.0
    """Longest an episode waits for its slot and reservation: past it, `SandboxStartTimeout` (it never waits forever)."""
    idle_timeout_s: float = 600.0
    base_dir: Path | None = None


def resolve_backend(settings: PoolSettings) -> Literal["bwrap", "local"]:
    """The backend this machine gives for `settings.backend` (auto: bwrap when installed), or `SandboxRefused`."""
    if settings.backend in ("auto", "bwrap") and bwrap_binary() is not None:
        return "bwrap"
    if settings.backend == "bwrap":
        raise SandboxRefused(
            "sandbox.backend = bwrap: bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
        )
    if not settings.allow_unisolated:
        found = "sandbox.backend = local" if settings.backend == "local" else "bubblewrap is not installed"
        raise SandboxRefused(
            f"{found}: model-written code would run without isolation; install bubblewrap "
            "(apt-get install bubblewrap), or set sandbox.allow_unisolated: true to accept that"
        )
    log.warning("sandboxes run WITHOUT isolation (sandbox.backend = local, sandbox.allow_unisolated = true)")
    return "local"


@dataclass
class PoolStats:
    started: int = 0
    start_failed: int = 0
    reaped: int = 0
    start_s: list[float] = field(default_factory=list)
    """Seconds from the start call to a ready sandbox, of every start (the bench's latencies)."""
    admitted_s: list[float] = field(default_factory=list)
    """Monotonic times at which each start began (the waves)."""


class SandboxPool:
    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self.backend = resolve_backend(settings)
        self._slots = asyncio.Semaphore(settings.max_concurrent)
        self._room = asyncio.Condition()
        self._cpus_free = float(os.cpu_count() or 1)
        self._memory_free = float(_memory_mb())
        self._next_start = 0.0
        self._wave = asyncio.Lock()
        self._live: set[SupervisedSandbox] = set()
        self._reaper: asyncio.Task[None] | None = None
        self.stats = PoolStats()
        if settings.cpus > self._cpus_free or settings.memory_mb > self._memory_free:
            raise SandboxRefused(
                f"sandbox.cpus = {settings.cpus:g} / sandbox.memory_mb = {settings.memory_mb}: more than this machine "
                f"has ({self._cpus_free:g} cpus, {self._memory_free:.0f} MB)"
            )

    def _new(self, spec: SandboxSpec) -> SupervisedSandbox:
        kind = BwrapSandbox if self.backend == "bwrap" else LocalSandbox
        limits = spec.limits if spec.limits != SandboxLimits() else self.settings.limits
        return kind(
            replace(spec, limits=limits), start_timeout_s=self.settings.start_timeout_s, base_dir=self.settings.base_dir
        )

    @contextlib.asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[SupervisedSandbox]:
        """A started sandbox for the ``async with`` block, torn down when it ends, however it ends."""
        await self._admit()
        try:
            box = self._new(spec)
            await self._wave_turn()
            self._live.add(box)
            self._ensure_reaper()
            try:
                try:
                    await box.start()
                except Exception:
                    self.stats.start_failed += 1
                    raise
                self.stats.started += 1
                self.stats.start_s.append(box.started_s or 0.0)
                yield box
            finally:
                self._live.discard(box)
                await asyncio.shield(box.close())
        finally:
            await self._release()

    async def _admit(self) -> None:
        """Take a slot and the reservation, or `SandboxStartTimeout` after ``admission_timeout_s``."""
        waited = time.monotonic()
        try:
            async with asyncio.timeout(self.settings.admission_timeout_s):
                await self._slots.acquire()
                try:
                    await self._reserve()
                except BaseException:
                    self._slots.release()
                    raise
        except TimeoutError:
            raise SandboxStartTimeout(
                f"waited {time.monotonic() - waited:.0f} s for a sandbox slot and its reservation "
                f"(sandbox.admission_timeout_s = {self.settings.admission_timeout_s:g}; {self.live} live)"
            ) from None

    async def _reserve(self) -> None:
        async with self._room:
            await self._room.wait_for(
                lambda: self._cpus_free >= self.settings.cpus and self._memory_free >= self.settings.memory_mb
            )
            self._cpus_free -= self.settings.cpus
            self._memory_free -= self.settings.memory_mb

    async def _release(self) -> None:
        self._slots.release()
        async with self._room:
            self._cpus_free += self.settings.cpus
            self._memory_free += self.settings.memory_mb
            self._room.notify_all()

    async def _wave_turn(self) -> None:
        """Wait for this start's turn: starts are spaced 1/starts_per_s apart (0: no spacing)."""
        if self.settings.starts_per_s <= 0:
            self.stats.admitted_s.append(time.monotonic())
            return
        async with self._wave:
            now = time.monotonic()
            if self._next_start > now:
                await asyncio.sleep(self._next_start - now)
            now = time.monotonic()
            self._next_start = max(now, self._next_start) + 1.0 / self.settings.starts_per_s
            self.stats.admitted_s.append(now)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        """Kill sandboxes no request has used for ``idle_timeout_s`` (an episode that hung between commands); a sandbox
        still starting (a slow start on a loaded machine) is not idle."""
        idle = self.settings.idle_timeout_s
        while self._live:
            await asyncio.sleep(min(idle / 4, 30.0))
            now = time.monotonic()
            for box in list(self._live):
                if box.started_s is not None and box.alive and now - box.last_used > idle and not box.busy:
                    log.warning("sandbox %s: idle for %.0f s, reaped", box.spec.label, now - box.last_used)
                    self.stats.reaped += 1
                    await box.kill(f"reaped after {idle:g} s idle")

    @property
    def live(self) -> int:
        return len(self._live)

    async def close(self) -> None:
        """Tear down every sandbox still up (the generator stops)."""
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(box.close() for box in list(self._live)), return_exceptions=True)


def _memory_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 20))
    except (ValueError, OSError):
        return 1 << 20
