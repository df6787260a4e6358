"""The generator side of weight sync: learn of new versions, pull them, hand them to the engine.

```
  KV "latest" (doorbell) ──watch──┐
                                  ├─► learn(version) ─► newest_known ──(in_flight)──► catch_up()
  store LATEST ──poll every───────┘                          │                           │
               generator.poll_interval_s                      │ waiters (ensure) wake      │ WeightSubscriber.pull
                                                              ▼                           ▼ (deltas applied in place,
  generator loop ── ensure(min_version) before a batch ── catch_up() between batches     hashes verified)
                                                                                          │
                                                 engine.update_weights(tensors, version) ◄┘ (in a worker thread;
                                                 swaps between two decode steps)
```

- Two sources of news: the KV announcement wakes us within milliseconds; the LATEST poll every
  ``generator.poll_interval_s`` works without it. Either only raises `newest_known`, and only to a version
  the store has: an announcement is a doorbell, checked against a fresh read of LATEST (the trainer writes
  the KV key after LATEST). An announced version past LATEST (a KV bucket left from an earlier run of the
  same name whose store was wiped) is ignored with a WARNING saying so and how to fix it, instead of
  being waited for forever.
- ``update_mode = in_flight``: a version learned while a rollout runs is pulled and applied at once;
  the engine swaps between two decode steps. ``between_rollouts``: the generator calls `catch_up`
  between batches only.
- One pull at a time (`_pull_lock`), and the next pull starts only after `Engine.update_weights` has
  returned, i.e. after the engine copied the tensors: the subscriber, which mutates its tensors in
  place, never changes a tensor the engine has not yet copied.
- `ensure(min_version)` returns once the engine holds at least that version, pulling first and, when
  the version is not yet visible in the store, waiting for it (polling faster while someone waits).
  Versions only move forward (a resumed trainer publishes a new full version after the newest).
- A failed poll or pull is logged with its traceback and retried at the next poll: weights are never
  half-applied (the subscriber verifies every tensor's hash before handing tensors over).
- An engine that copies weights into other processes (vLLM's workers) checks what arrived against the version's
  manifest hashes (`Pulled.hashes`); a refusal (`WeightsRefused`) is counted (``weights_refused``), the local copy is
  dropped and the version is loaded again from a full snapshot (`Engine.load_state`); a refused update never
  serves.
- A version that cannot be pulled at all (another model's manifest, a missing delta, a store away) must
  not hold prompts forever: `ensure` with ``give_up_after_s`` raises `WeightPullTimeout` (with the last
  pull error) after that long, so the generator hands its prompts back (`actors/generator/loop.py`,
  `generator.weight_pull_timeout_s`); the next `ensure` simply tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from actors.generator.engines.base import Engine, NamedTensors, WeightsRefused
from actors.generator.metrics import GeneratorMetrics
from storage.weights import WeightSubscriber

log = logging.getLogger(__name__)

WAITING_POLL_S = 0.2
"""LATEST poll interval while a rollout waits for a version that is not visible yet."""
RETRY_S = 1.0
"""Pause after a failed poll or pull before the next attempt."""
WAIT_LOG_INTERVAL_S = 30.0
"""While waiting for a first version (no trainer yet), log this often; a pull that keeps failing, too."""


class WeightPullTimeout(Exception):
    """`ensure` gave up: the engine did not reach `min_version` within the bound; `last_error` says why."""

    def __init__(self, min_version: int, engine_version: int, waited_s: float, last_error: str | None) -> None:
        why = last_error or "the version did not appear in the store"
        super().__init__(
            f"engine still at version {engine_version} after {waited_s:.0f} s waiting for version {min_version}: {why}"
        )
        self.min_version = min_version
        self.engine_version = engine_version
        self.waited_s = waited_s
        self.last_error = last_error


def unknown_version_message(run_name: str, what: str, version: int, latest: int | None) -> str:
    """The WARNING for a version the NATS side names but the store does not have, with the fix."""
    return (
        f"run {run_name!r}: {what} version {version}, but the weight store's LATEST is "
        f"{'missing' if latest is None else latest}: the store has no such version. The run's NATS streams "
        f"or KV bucket are left from an earlier run with the same name (store wiped, NATS kept), or this "
        f"generator's store.url is not the trainer's. Fix: stop the run's roles and purge its streams and KV "
        f"bucket (`leeway purge CONFIG --yes`), or use a new run.name"
    )


UpdateMode = Literal["in_flight", "between_rollouts"]


@dataclass(frozen=True)
class Pulled:
    """What one pull hands to the engine: the tensors to write (all, or only the changed ones)."""

    version: int
    tensors: NamedTensors
    num_bytes: int
    full: bool
    hashes: Mapping[str, str] | None = None
    """The version's manifest hashes of the tensors (an engine in other processes checks what arrived)."""


class WeightSource(Protocol):
    """What weight sync needs from the weight store (`storage.weights.WeightSubscriber`, adapted)."""

    def latest(self) -> int | None:
        """The version LATEST points at, or None before version 0 exists."""
        ...

    def pull(self, version: int) -> Pulled:
        """Bring the local copy to `version` (deltas or a full snapshot, whichever is fewer bytes)."""
        ...

    def forget(self) -> None:
        """Drop the local copy's version, so the next pull is a full snapshot."""
        ...


class StoreWeightSource:
    """`WeightSource` over the weight store's `WeightSubscriber` (which owns its own tensor copies)."""

    def __init__(self, subscriber: WeightSubscriber) -> None:
        self._subscriber = subscriber

    def latest(self) -> int | None:
        return self._subscriber.latest_version()

    def pull(self, version: int) -> Pulled:
        have = self._subscriber.version
        try:
            plan = self._subscriber.plan(have, version)
            num_bytes, full = plan.num_bytes, plan.from_full
        except Exception:  # the pull below raises the real error with its context
            num_bytes, full = 0, have is None
        self._subscriber.pull(version)
        hashes = {t.name: t.hash for t in self._subscriber.manifest(version).tensors}
        return Pulled(version=version, tensors=self._subscriber.tensors, num_bytes=num_bytes, full=full, hashes=hashes)

    def forget(self) -> None:
        self._subscriber.forget()


class WeightSync:
    """Keeps one engine's weights within reach of the newest version; see the module docstring."""

    def __init__(
        self,
        source: WeightSource,
        engine: Engine,
        metrics: GeneratorMetrics,
        *,
        poll_interval_s: float,
        update_mode: UpdateMode,
        announcements: Callable[[], AsyncIterator[tuple[int, float]]] | None = None,
        run_name: str = "",
    ) -> None:
        self._source = source
        self._engine = engine
        self._metrics = metrics
        self._poll_interval_s = poll_interval_s
        self._update_mode = update_mode
        self._announcements = announcements
        self._run_name = run_name
        self._unknown_announced: set[int] = set()
        self.newest_known = -1
        self._learned_at_s: dict[int, float] = {}
        self._news = asyncio.Event()
        self._pull_lock = asyncio.Lock()
        self._catch_up_task: asyncio.Task[None] | None = None
        self._reload_full = False
        self.last_pull: Pulled | None = None
        """The most recent pull (tests and logs: full snapshot or delta chain, bytes)."""
        self.last_pull_error: str | None = None
        """The error of the most recent pull if it failed (None once a pull succeeds): what a timeout reports."""

    @property
    def engine_version(self) -> int:
        return self._engine.version

    # ---- learning of versions --------------------------------------------------------------------

    def learn(self, version: int, announced_at_s: float | None = None) -> None:
        """Note that `version` exists (from KV or a poll); in in_flight mode start pulling it at once."""
        if version <= self.newest_known:
            return
        self.newest_known = version
        self._learned_at_s[version] = announced_at_s if announced_at_s else time.time()
        self._news.set()
        if self._update_mode == "in_flight" and self.engine_version >= 0:
            self._schedule_catch_up()

    async def poll_once(self) -> int | None:
        latest = await asyncio.to_thread(self._source.latest)
        if latest is not None:
            self.learn(latest)
        return latest

    async def run(self) -> None:
        """Background task: the LATEST poll loop, plus the KV watch when there is one. Runs until cancelled."""
        watch = asyncio.create_task(self._watch()) if self._announcements is not None else None
        try:
            while True:
                try:
                    await self.poll_once()
                except Exception:  # a background loop we own: log, retry at the next poll
                    log.exception("polling LATEST failed; retrying in %.1f s", self._poll_interval_s)
                await asyncio.sleep(self._poll_interval_s)
        finally:
            for task in (watch, self._catch_up_task):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task

    async def _watch(self) -> None:
        assert self._announcements is not None
        while True:
            try:
                async for version, published_at_s in self._announcements():
                    await self.announced(version, published_at_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # the doorbell is an optimisation: polling still works
                log.exception("watching version announcements failed; retrying in %.1f s", RETRY_S)
            await asyncio.sleep(RETRY_S)

    async def announced(self, version: int, published_at_s: float | None = None) -> None:
        """A KV announcement: learn it once a fresh LATEST shows the store has it; else warn (once per version).

        A failed LATEST read leaves the version to the poll loop."""
        if version <= self.newest_known:
            return
        try:
            latest = await asyncio.to_thread(self._source.latest)
        except Exception:
            log.warning("reading LATEST after announcement of version %d failed; the poll retries", version)
            return
        if latest is not None and latest >= version:
            self.learn(latest, published_at_s if latest == version else None)
            return
        if latest is not None:
            self.learn(latest)
        if version not in self._unknown_announced:
            self._unknown_announced.add(version)
            log.warning(
                "%s; ignoring the announcement",
                unknown_version_message(self._run_name, "KV announces", version, latest),
            )

    # ---- applying versions -----------------------------------------------------------------------

    def _schedule_catch_up(self) -> None:
        if self._catch_up_task is None or self._catch_up_task.done():
            self._catch_up_task = asyncio.create_task(self._background_catch_up())

    async def _background_catch_up(self) -> None:
        while self.engine_version < self.newest_known:
            try:
                await self.catch_up()
            except Exception:  # a background loop we own: the next poll or rollout retries
                log.exception("pulling version %d failed; retrying in %.1f s", self.newest_known, RETRY_S)
                await asyncio.sleep(RETRY_S)

    async def catch_up(self) -> int:
        """Pull and apply the newest known version if the engine is behind it; returns the engine version."""
        async with self._pull_lock:
            target = self.newest_known
            if target <= self.engine_version:
                return self.engine_version
            behind = target - self.engine_version if self.engine_version >= 0 else target + 1
            start = time.perf_counter()
            try:
                pulled = await asyncio.to_thread(self._source.pull, target)
            except Exception as exc:
                self.last_pull_error = f"pulling version {target} failed: {type(exc).__name__}: {exc}"
                self._metrics.weight_pull_failures += 1
                raise
            pull_s = time.perf_counter() - start
            self.last_pull_error = None
            full = pulled.full or self.engine_version < 0 or self._reload_full
            apply = self._engine.load_state if full else self._engine.update_weights
            try:  # returns after the engine copied them
                await asyncio.to_thread(apply, pulled.tensors, pulled.version, pulled.hashes)
            except WeightsRefused as exc:
                self._metrics.weights_refused += 1
                self._reload_full = True
                self._source.forget()
                self.last_pull_error = str(exc)
                log.error(
                    "%s; %s; loading it again from a full snapshot",
                    exc,
                    "the engine serves nothing until then" if exc.applied else "the previous version keeps serving",
                )
                raise
            self._reload_full = False
            self.last_pull = pulled
            learned = self._learned_at_s.pop(pulled.version, None)
            for old in [v for v in self._learned_at_s if v <= pulled.version]:
                del self._learned_at_s[old]
            self._metrics.pull_finished(
                num_bytes=pulled.num_bytes,
                pull_s=pull_s,
                versions_behind=behind,
                announce_to_applied_s=None if learned is None else time.time() - learned,
            )
            log.info(
                "applied weights version %d (%s, %.1f KiB, pulled in %.2f s, %d behind)",
                pulled.version,
                "full" if pulled.full else "delta",
                pulled.num_bytes / 1024,
                pull_s,
                behind,
            )
            return self.engine_version

    async def ensure(
        self,
        min_version: int,
        *,
        on_wait: Callable[[float], None] | None = None,
        give_up_after_s: float | None = None,
    ) -> int:
        """Return once the engine holds a version >= `min_version` (pulling, or waiting for it to appear).

        `on_wait(waited_s)` is called about every `WAIT_LOG_INTERVAL_S` while waiting (first call at 0).
        With `give_up_after_s`, raises `WeightPullTimeout` once that long has passed without the engine
        getting there (a caller holding prompts hands them back); without it, waits until cancelled (shutdown).
        A pull failure is logged with its traceback the first time, then once per `WAIT_LOG_INTERVAL_S`.
        """
        waited_from = time.monotonic()
        next_log = 0.0
        next_failure_log = 0.0
        while self.engine_version < min_version:
            waited = time.monotonic() - waited_from
            if give_up_after_s is not None and waited >= give_up_after_s:
                raise WeightPullTimeout(min_version, self.engine_version, waited, self.last_pull_error)
            if self.newest_known >= min_version:
                try:
                    await self.catch_up()
                except Exception:
                    if waited >= next_failure_log:
                        next_failure_log = waited + WAIT_LOG_INTERVAL_S
                        log.warning(
                            "pulling version %d failed (%.0f s so far); retrying every %.1f s",
                            self.newest_known,
                            waited,
                            RETRY_S,
                            exc_info=True,
                        )
                    await asyncio.sleep(RETRY_S)
                continue
            if on_wait is not None and waited >= next_log:
                on_wait(waited)
                next_log = waited + WAIT_LOG_INTERVAL_S
            self._news.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._news.wait(), timeout=WAITING_POLL_S)
            if self.newest_known < min_version:
                with contextlib.suppress(Exception):  # the background poll logs failures
                    await self.poll_once()
        return self.engine_version
