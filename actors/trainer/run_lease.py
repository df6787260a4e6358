"""The live trainer's run lease (`pipeline/wire/lease.py`): taken before the durable consumer is touched, renewed
in the background, checked before every write that only the run's one trainer may make, released at the end.

A trainer that loses its lease (it was silent past `trainer.lease_ttl_s`, say its host froze, and another
trainer took the run over) stops at once: its stop event is set, and its next publish or checkpoint raises
`LeaseLost` instead of writing, so it ends with status 1 and writes nothing its successor could meet.
A replay trainer takes no lease: it reads through an `ack none` consumer of its own and publishes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats.errors
from nats.js import JetStreamContext

from actors.trainer.checkpoints import RecentIds, TrainerState
from actors.trainer.sessions import LiveSession
from pipeline.config import LeewayConfig
from pipeline.wire.lease import LeaseLost, RunLease, lease_kv
from pipeline.wire.names import RunNames

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews `lease` every `heartbeat_s` until closed; calls `on_lost` once if another trainer took it over."""

    def __init__(self, lease: RunLease, heartbeat_s: float, on_lost: Callable[[], None]) -> None:
        self.lease = lease
        self.heartbeat_s = heartbeat_s
        self.on_lost = on_lost
        self.lost: str | None = None
        """Why the lease is gone (set once); every write the trainer makes checks it first (`check`)."""
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

    def check(self) -> None:
        if self.lost is not None:
            raise LeaseLost(self.lost)

    async def _beat(self) -> None:
        while not self._closing.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.heartbeat_s)
            if self._closing.is_set():
                return
            try:
                await asyncio.wait_for(self.lease.renew(), self.heartbeat_s)
            except LeaseLost as exc:
                self.lost = str(exc)
                log.error("%s; stopping without writing anything more", exc)
                self.on_lost()
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


class LeasedSession(LiveSession):
    """A `LiveSession` whose writes (publish, checkpoint) each check the run lease first."""

    lease: LeaseKeeper | None = None

    async def publish(self, state: TrainerState) -> None:
        if self.lease is not None:
            self.lease.check()
        await super().publish(state)

    async def checkpoint(self, state: TrainerState, handled: RecentIds, *, final: bool) -> None:
        if self.lease is not None:
            self.lease.check()
        await super().checkpoint(state, handled, final=final)

    async def close(self) -> None:
        try:
            if self.lease is not None:
                await self.lease.close()
        finally:
            await super().close()
