"""The run lease: one trainer per run, held in a NATS KV bucket.

Two trainers on one run would split the durable consumer's groups between them and publish versions
over each other. So the trainer (rank 0) takes the run's lease before it touches the consumer, renews
it every `heartbeat_s`, and releases it when it stops:

    KV bucket  leeway_<run>_lease   key "trainer" -> {"holder", "host", "pid", "since_s", "beat"}

- Taking: `create` (succeeds only if no holder). If there is one, the taker watches the key for
  `ttl_s`: a renewal (the revision moves) means the holder lives, and the taker refuses with
  `LeaseHeld`, naming host, pid and since when. A key that does not move for `ttl_s` is stale (its
  holder was killed) and is taken over with `update(last=revision)`: compare-and-set, so of two takers
  only one wins and the other gets `LeaseHeld`. Staleness is judged by the revision standing still on
  the taker's own monotonic clock, never by comparing wall clocks of two machines.
- Renewing: `update(last=our revision)`. A failure because the revision moved means another trainer
  took the lease over (we were silent past `ttl_s`): `LeaseLost`, and the trainer must stop writing at
  once; unless the key still holds our own record (an earlier renewal landed but its reply was lost),
  whose revision is then adopted. A NATS error is transient and retried at the next beat.
- Releasing: `delete(last=our revision)`, sent again if its reply is lost, best effort; a lease not released
  goes stale after `ttl_s`.
- Fencing: the holder notes on its own monotonic clock when it *sent* each write that succeeded (`renewed_at`).
  A taker can take over only once the key stood still for `ttl_s` on the taker's clock, counted from a read
  made after that write landed, so no takeover comes before `renewed_at + ttl_s`. The holder stops writing
  at `renewed_at + fence_after_s(ttl_s, heartbeat_s)`, halfway between its heartbeat and the TTL: a margin of
  `(ttl_s - heartbeat_s) / 2` for the clocks' rates and a write in flight (`actors/trainer/run_lease.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import nats.errors
import nats.js.errors
import orjson
from nats.js import JetStreamContext

from pipeline.wire.jetstream import ensure_key_value
from pipeline.wire.names import RunNames
from pipeline.wire.retry import Unretryable

log = logging.getLogger(__name__)

LEASE_KEY = "trainer"
WATCH_POLLS = 10
RELEASE_TRIES = 3
"""Deletes a release sends before it leaves the lease to go stale (each bounded by the JetStream timeout)."""
"""Reads of the key while a taker watches a holder for `ttl_s` (at least one per heartbeat is what counts)."""


class LeaseHeld(RuntimeError):
    """Another trainer holds the run's lease and renews it."""

    def __init__(self, run: str, holder: LeaseRecord | None) -> None:
        self.holder = holder
        who = holder.describe() if holder is not None else "another trainer"
        super().__init__(
            f"run {run!r} already has a trainer: {who} holds its lease and renews it. Stop that trainer first, "
            "or use another run.name; a killed trainer's lease is taken over once it has not been renewed for "
            "trainer.lease_ttl_s"
        )


class LeaseLost(Unretryable, RuntimeError):
    """Another trainer took this trainer's lease over, or may have (the holder is past its fence): it must stop
    writing. No retry mends it: a write that raises it is given up at once."""


def fence_after_s(ttl_s: float, heartbeat_s: float) -> float:
    """How long after its last successful renewal (sent) the holder stops writing: halfway from the heartbeat to
    the TTL, so a healthy holder (renewed every `heartbeat_s`) never fences itself and a partitioned one has
    stopped `(ttl_s - heartbeat_s) / 2` before anyone can take over (see the module docstring)."""
    return (ttl_s + heartbeat_s) / 2


@dataclass(frozen=True)
class LeaseRecord:
    """What the key holds: who holds the lease, since when (wall clock, for people), and a beat counter."""

    holder: str
    host: str
    pid: int
    since_s: float
    beat: int = 0

    @classmethod
    def mine(cls) -> LeaseRecord:
        host = socket.gethostname()
        return cls(
            holder=f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}", host=host, pid=os.getpid(), since_s=time.time()
        )

    def to_bytes(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def parse(cls, data: bytes | None) -> LeaseRecord | None:
        """The record, or None for anything else (a foreign or torn value is treated as an unknown holder)."""
        try:
            raw = orjson.loads(data or b"")
            return cls(str(raw["holder"]), str(raw["host"]), int(raw["pid"]), float(raw["since_s"]), int(raw["beat"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since_s))
        return f"the trainer on host {self.host!r} (pid {self.pid}, since {since})"


def lease_bucket(names: RunNames) -> str:
    return f"leeway_{names.run}_lease"


async def lease_kv(js: JetStreamContext, names: RunNames) -> Any:
    """The run's lease bucket, created on first use by whichever trainer comes first."""
    return await ensure_key_value(js, lease_bucket(names))


class RunLease:
    """One trainer's hold on its run (see the module docstring)."""

    def __init__(
        self,
        kv: Any,
        run: str,
        *,
        ttl_s: float,
        me: LeaseRecord | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.kv = kv
        self.run = run
        self.ttl_s = ttl_s
        self.me = me or LeaseRecord.mine()
        self.revision: int | None = None
        """The key's revision our last write made; None while not held."""
        self.acquired_revision: int | None = None
        """The key's revision when this trainer took the lease (part of its holder token)."""
        self.renewed_at: float | None = None
        """When (our monotonic clock) the last write of the key that succeeded was sent; the fence counts from it."""
        self._clock = clock
        self._sleep = sleep

    async def acquire(self) -> None:
        """Hold the lease, taking over a stale one; `LeaseHeld` if a live trainer holds it."""
        while True:
            sent = self._clock()
            try:
                self.revision = self.acquired_revision = await self.kv.create(LEASE_KEY, self.me.to_bytes())
                self.renewed_at = sent
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            try:
                entry = await self.kv.get(LEASE_KEY)
            except nats.js.errors.KeyNotFoundError:
                continue  # released meanwhile: create again
            holder = LeaseRecord.parse(entry.value)
            who = holder.describe() if holder is not None else "an unknown holder"
            log.info("run %s: lease held by %s; watching it for %.0f s", self.run, who, self.ttl_s)
            if not await self._stands_still(entry.revision):
                current = await self._current_holder()
                raise LeaseHeld(self.run, current or holder)
            sent = self._clock()
            try:
                self.revision = await self.kv.update(LEASE_KEY, self.me.to_bytes(), last=entry.revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                raise LeaseHeld(self.run, await self._current_holder()) from None
            self.acquired_revision, self.renewed_at = self.revision, sent
            log.warning(
                "run %s: took over the lease of %s, not renewed for %.0f s (a killed trainer)",
                self.run,
                who,
                self.ttl_s,
            )
            return

    async def _stands_still(self, revision: int) -> bool:
        """True when the key keeps `revision` for `ttl_s`; False as soon as it moves (or is deleted)."""
        deadline = self._clock() + self.ttl_s
        while (left := deadline - self._clock()) > 0:
            await self._sleep(min(left, self.ttl_s / WATCH_POLLS))
            try:
                entry = await self.kv.get(LEASE_KEY)
            except nats.js.errors.KeyNotFoundError:
                return False
            if entry.revision != revision:
                return False
        return True

    async def _current_holder(self) -> LeaseRecord | None:
        try:
            return LeaseRecord.parse((await self.kv.get(LEASE_KEY)).value)
        except nats.js.errors.KeyNotFoundError:
            return None

    async def renew(self) -> None:
        """One beat. `LeaseLost` if another trainer took the lease over; NATS errors are the caller's to retry."""
        assert self.revision is not None, "renew before acquire"
        beat = replace(self.me, beat=self.me.beat + 1)
        sent = self._clock()
        try:
            self.revision = await self.kv.update(LEASE_KEY, beat.to_bytes(), last=self.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            try:
                entry = await self.kv.get(LEASE_KEY)
            except nats.js.errors.KeyNotFoundError:
                entry = None
            holder = LeaseRecord.parse(entry.value) if entry is not None else None
            if entry is not None and holder is not None and holder.holder == self.me.holder:
                # Our renewal landed, its reply was lost; when it was sent is unknown, so the fence keeps its time.
                self.revision, self.me = entry.revision, holder
                return
            who = holder.describe() if holder is not None else "another trainer"
            raise LeaseLost(f"run {self.run!r}: the trainer lease was taken over by {who}") from None
        self.me, self.renewed_at = beat, sent

    def token(self) -> dict[str, Any]:
        """Who holds the lease, for the records this holder writes (checkpoints, weight manifests): host, pid,
        start time, the random holder id and the key's revision when it was taken."""
        return {
            "holder": self.me.holder,
            "host": self.me.host,
            "pid": self.me.pid,
            "since_s": self.me.since_s,
            "lease_revision": self.acquired_revision,
        }

    async def release(self) -> None:
        """Give the lease up (best effort: a lease left behind goes stale after `ttl_s`).

        A delete whose reply is lost is sent again: if the first one landed, the key no longer has our revision
        and the second is refused, which means the same thing (no longer ours), so a lost reply never leaves
        the next trainer waiting `ttl_s` for a lease nobody holds."""
        if self.revision is None:
            return
        for attempt in range(1, RELEASE_TRIES + 1):
            try:
                await self.kv.delete(LEASE_KEY, last=self.revision)
                break
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                if _wrong_last_sequence(exc):
                    break  # our earlier delete landed, or another trainer took the lease over: not ours either way
                if attempt == RELEASE_TRIES:
                    log.warning(
                        "run %s: lease not released (%s); it goes stale after %.0f s", self.run, exc, self.ttl_s
                    )
        self.revision = None


WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code for a write whose expected last sequence is not the key's (`delete(last=...)` raises it
as a plain `APIError`, `update` as `KeyWrongLastSequenceError`)."""


def _wrong_last_sequence(exc: BaseException) -> bool:
    return isinstance(exc, nats.js.errors.KeyWrongLastSequenceError) or (
        isinstance(exc, nats.js.errors.APIError) and exc.err_code == WRONG_LAST_SEQUENCE
    )
