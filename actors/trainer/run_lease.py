"""The live trainer's run lease (`pipeline/wire/lease.py`): taken before the durable consumer is touched, renewed
in the background, checked before every write that only the run's one trainer may make, released at the end.

The trainer stops writing as soon as it may have lost the lease, before anyone can have taken it over: when a
renewal finds the lease taken over, or when its last successful renewal is older than its fence
(`fence_after_s`: halfway from `trainer.lease_heartbeat_s` to `trainer.lease_ttl_s`, on its monotonic clock),
whether or not NATS answers (a trainer cut off from NATS still reaches the store). Then:
- every write raises `LeaseLost` instead of writing (the session's own writes first try one renewal, and one
  that lands lifts the fence: after a blocked event loop, say, its compare-and-set proves nobody took over; the
  first write refused makes the loss final): publish, checkpoint, ack, nak, in-progress, fetch,
  prompt admission, dead letters (`LeasedSession`), and every write to the object store, checked just before
  each request (`FencedStore`: weight parts, manifests and `LATEST`, checkpoint files, resume counts, claim
  deletes), so a write already under way stops at its next object; `LeaseLost` is never retried;
- its stop event is set: the loop ends, its final checkpoint is refused, and the process exits with status 1
  and an error naming the lease and when it was last renewed. The lease is not released (it may be another's
  by then; the key goes stale by itself). Run it again with `--resume`: it waits for the lease like any other.
A write sent just before the fence may still land after a takeover; the lease epochs catch it
(`actors/trainer/lease_epochs.py`): a resume never loads a checkpoint committed after its writer's epoch ended.
A replay trainer takes no lease: it reads through an `ack none` consumer of its own and publishes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import nats.errors
from nats.js import JetStreamContext

from actors.trainer.checkpoints import RecentIds, TrainerState, committed_attempts
from actors.trainer.lease_epochs import begin_epoch
from actors.trainer.session_protocol import RunLink
from actors.trainer.sessions import LiveSession
from actors.trainer.slots import DeadLetterEntry
from pipeline.config import LeewayConfig
from pipeline.wire.consumer import Delivery
from pipeline.wire.lease import LeaseLost, RunLease, fence_after_s, lease_kv
from pipeline.wire.names import RunNames
from pipeline.wire.retry import outage_backoff, retry_async
from storage.objectstore import ObjectStore

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews `lease` every `heartbeat_s` until closed; calls `on_lost` once if another trainer took it over or
    its fence passed (see the module docstring)."""

    def __init__(
        self,
        lease: RunLease,
        heartbeat_s: float,
        on_lost: Callable[[], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease = lease
        self.heartbeat_s = heartbeat_s
        self.on_lost = on_lost
        self.fence_s = fence_after_s(lease.ttl_s, heartbeat_s)
        """Seconds after the last successful renewal (sent) at which this trainer stops writing."""
        self.clock = clock
        """The same monotonic clock as the lease's `renewed_at`."""
        self.lost: str | None = None
        """Why the lease is gone or may be (set once, never cleared); every write checks it first (`check`)."""
        self.token: dict[str, Any] = lease.token()
        """The holder token written into checkpoints and weight manifests; `begin_epoch` adds the epoch."""
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        """Set by `close`: the heartbeat ends at its next turn even when the cancel of its task is lost (Python
        3.11's `asyncio.wait_for`, which every NATS request goes through, drops a cancel that arrives as the
        reply does)."""

    @classmethod
    async def take(
        cls, cfg: LeewayConfig, js: JetStreamContext, names: RunNames, on_lost: Callable[[], None]
    ) -> LeaseKeeper:
        """Acquire the run's lease (`LeaseHeld` if a live trainer has it) and start renewing it."""
        lease = RunLease(await lease_kv(js, names), names.run, ttl_s=cfg.trainer.lease_ttl_s)
        await lease.acquire()
        log.info("run %s: trainer lease taken (%s)", names.run, lease.me.holder)
        keeper = cls(lease, cfg.trainer.lease_heartbeat_s, on_lost)
        keeper._task = asyncio.create_task(keeper._beat(), name="run-lease")
        return keeper

    async def begin_epoch(self, store: ObjectStore, budget_s: float) -> dict[str, Any]:
        """Record this holder's lease epoch (`actors/trainer/lease_epochs.py`) before anything of the run is read;
        retried for `budget_s`. Returns the holder token with its epoch (also `self.token`)."""
        run, token = self.lease.run, dict(self.token)

        def record() -> dict[str, Any]:
            return begin_epoch(store, run, token, committed_attempts(store, run))

        self.token = await retry_async(
            lambda: asyncio.to_thread(record), what="recording the lease epoch", backoff=outage_backoff(budget_s)
        )
        return self.token

    def fenced(self, link: RunLink) -> RunLink:
        """`link` with its store behind this lease's fence (`FencedStore`)."""
        return dataclasses.replace(link, store=FencedStore(link.store, self.check))

    def check(self) -> None:
        """Raise `LeaseLost` if the lease is lost or this holder is past its fence (from any thread). A write
        refused at the fence makes the loss final: the trainer stops, even if a renewal lands later."""
        if self.lost is None and self.past_fence():
            self.lost = self._fence_message()
        if self.lost is not None:
            raise LeaseLost(self.lost)

    async def ensure(self) -> None:
        """`check` for the session's own writes: past the fence (and not yet refused), one renewal is tried first,
        and one that lands lifts the fence (the event loop was blocked; the compare-and-set proves nobody took
        over). One that does not (NATS away) leaves the write refused."""
        if self.lost is None and self.past_fence():
            try:
                await asyncio.wait_for(self.lease.renew(), self.heartbeat_s)
            except LeaseLost as exc:
                self.lost = str(exc)
            except (nats.errors.Error, asyncio.TimeoutError, OSError) as exc:
                log.warning("renewing the run lease at its fence failed (%s: %s)", type(exc).__name__, exc)
        self.check()

    def past_fence(self) -> bool:
        """True while the last successful renewal is older than the fence: nothing may be written."""
        return self._fence_in() <= 0

    def _fence_in(self) -> float:
        renewed = self.lease.renewed_at
        return float("inf") if renewed is None else renewed + self.fence_s - self.clock()

    def _fence_message(self) -> str:
        age = self.clock() - (self.lease.renewed_at or 0.0)
        return (
            f"run {self.lease.run!r}: the trainer lease was last renewed {age:.1f} s ago, past this trainer's fence "
            f"at {self.fence_s:.1f} s (trainer.lease_ttl_s = {self.lease.ttl_s:g}): another trainer may take the run "
            "over, so this one writes nothing more and stops; start it again with --resume"
        )

    def _lose(self, why: str) -> None:
        self.lost = self.lost or why
        log.error("%s; stopping without writing anything more", self.lost)
        self.on_lost()

    async def _beat(self) -> None:
        """Renew every `heartbeat_s`. Past the fence it keeps trying: a renewal that lands (compare-and-set on our
        revision: nobody took over) lifts the fence if no write was refused meanwhile (say the event loop was
        blocked); once one was (`check`), or a renewal finds the lease taken over, the loss is final."""
        warned = False
        while not self._closing.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.heartbeat_s)
            if self._closing.is_set():
                return
            if self.lost is not None:
                self._lose(self.lost)
                return
            if self.past_fence() and not warned:
                warned = True
                log.warning("%s (unless a renewal lands before the next write)", self._fence_message())
            try:
                await asyncio.wait_for(self.lease.renew(), self.heartbeat_s)
                warned = False
            except LeaseLost as exc:
                self._lose(str(exc))
                return
            except (nats.errors.Error, asyncio.TimeoutError, OSError) as exc:  # renewed at the next beat
                log.warning("renewing the run lease failed (%s: %s); retrying", type(exc).__name__, exc)

    async def close(self) -> None:
        """Stop renewing; release the lease unless it was lost (then it is another trainer's)."""
        if self._task is not None:
            self._closing.set()
            self._task.cancel()
            await asyncio.wait({self._task})  # never raises the task's CancelledError as the caller's own
        if self.lost is None:
            await self.lease.release()


class FencedStore(ObjectStore):
    """`inner`, except that every write (put, delete) first calls `check` (`LeaseKeeper.check`), so a trainer past
    its fence writes no further object, even in the middle of a publish or a checkpoint. Reads pass."""

    def __init__(self, inner: ObjectStore, check: Callable[[], None]) -> None:
        self.inner, self.check, self.url = inner, check, inner.url

    def put(self, key: str, data: bytes) -> str:
        self.check()
        return self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> str:
        self.check()
        return self.inner.put_if_absent(key, data)

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        self.check()
        return self.inner.put_if_match(key, data, etag)

    def delete(self, key: str) -> None:
        self.check()
        self.inner.delete(key)

    def delete_many(self, keys: Iterable[str]) -> None:
        self.check()
        self.inner.delete_many(keys)

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        return self.inner.get_with_etag(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()


class LeasedSession(LiveSession):
    """A `LiveSession` whose every write checks the run lease first, and whose records name their holder."""

    lease: LeaseKeeper | None = None

    async def _check(self) -> None:
        if self.lease is not None:
            await self.lease.ensure()

    async def start(self) -> TrainerState:
        """Record the lease epoch before the run is read (a resume then skips superseded checkpoints), and name
        its holder in every checkpoint and weight manifest from now on."""
        if self.lease is not None:
            token = await self.lease.begin_epoch(self.link.store, self.cfg.outages.checkpoint_s)
            self.holder = self.publisher.holder = token
            if self.ranks is not None:
                self.ranks.holder = token
        return await super().start()

    async def admit(self, state: TrainerState, pending_dropped: int = 0) -> None:
        await self._check()
        await super().admit(state, pending_dropped)

    async def new_dead_letters(self, state: TrainerState) -> list[DeadLetterEntry]:
        await self._check()
        return await super().new_dead_letters(state)

    async def fetch(self, max_groups: int, timeout_s: float) -> list[Delivery]:
        await self._check()
        return await super().fetch(max_groups, timeout_s)

    async def refuse(self, delivery: Delivery, reason: str, detail: str) -> None:
        await self._check()
        await super().refuse(delivery, reason, detail)

    async def keep_alive(self) -> None:
        await self._check()
        await super().keep_alive()

    async def publish(self, state: TrainerState) -> None:
        await self._check()
        await super().publish(state)

    async def ack(self, seqs: Sequence[int]) -> None:
        await self._check()
        await super().ack(seqs)

    async def give_back(self) -> None:
        await self._check()
        await super().give_back()

    async def checkpoint(self, state: TrainerState, handled: RecentIds, *, final: bool) -> None:
        await self._check()
        await super().checkpoint(state, handled, final=final)

    async def close(self) -> None:
        try:
            if self.lease is not None:
                await self.lease.close()
        finally:
            await super().close()
