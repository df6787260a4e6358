"""The run lease on a real nats-server: one holder at a time, a live holder refused by name, a stale one taken
over by exactly one of two takers, and a holder whose lease was taken over told so at its next renewal."""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import asdict
from typing import Any

import nats.errors
import pytest

from infra.stack import StackState
from pipeline.wire.jetstream import connect
from pipeline.wire.lease import LEASE_KEY, LeaseHeld, LeaseLost, LeaseRecord, RunLease, lease_kv
from pipeline.wire.names import RunNames

TTL_S = 1.0
"""Short, so a stale lease is taken over quickly; a live holder renews every `BEAT_S`, far below it."""
BEAT_S = 0.05


def _names() -> RunNames:
    return RunNames.for_run(f"lease-{uuid.uuid4().hex[:8]}")


async def _beating(lease: RunLease, stop: asyncio.Event) -> None:
    """Renew every `BEAT_S` until `stop` is set. A stop flag, not only a cancel: Python 3.11's `asyncio.wait_for`
    (inside every NATS request) drops a cancel that arrives as the reply does, and a `while True` loop then
    renews forever while its canceller waits (what hung this test in CI for 300 s)."""
    while not stop.is_set():
        await asyncio.sleep(BEAT_S)
        await lease.renew()


def test_a_live_holder_is_refused_by_name_and_a_released_lease_is_taken_at_once(stack: StackState) -> None:
    names = _names()

    async def scenario() -> None:
        nc = await connect(stack.nats_url, name="test-lease")
        try:
            kv = await lease_kv(nc.jetstream(), names)
            first = RunLease(kv, names.run, ttl_s=TTL_S)
            await first.acquire()
            stop = asyncio.Event()
            beat = asyncio.create_task(_beating(first, stop))
            with pytest.raises(LeaseHeld, match=rf"pid {os.getpid()}") as refused:
                await RunLease(kv, names.run, ttl_s=TTL_S).acquire()
            assert refused.value.holder is not None and refused.value.holder.holder == first.me.holder
            assert first.me.beat > 0  # it kept renewing while the second watched
            stop.set()
            beat.cancel()
            await asyncio.wait({beat})
            await first.release()
            second = RunLease(kv, names.run, ttl_s=3600.0)  # no watching: the key is gone
            await asyncio.wait_for(second.acquire(), timeout=30.0)
            assert LeaseRecord.parse((await kv.get(LEASE_KEY)).value) == second.me
        finally:
            await nc.drain()

    asyncio.run(scenario())


def test_a_stale_lease_is_taken_over_by_one_taker_and_its_old_holder_learns_it_lost(stack: StackState) -> None:
    names = _names()

    async def scenario() -> None:
        nc = await connect(stack.nats_url, name="test-lease")
        try:
            kv = await lease_kv(nc.jetstream(), names)
            killed = RunLease(kv, names.run, ttl_s=TTL_S)
            await killed.acquire()  # ... and never renews again: SIGKILLed
            takers = [RunLease(kv, names.run, ttl_s=TTL_S) for _ in range(2)]
            results = await asyncio.gather(*(t.acquire() for t in takers), return_exceptions=True)
            winners = [t for t, r in zip(takers, results, strict=True) if r is None]
            assert len(winners) == 1, results
            assert sum(isinstance(r, LeaseHeld) for r in results) == 1, results
            assert LeaseRecord.parse((await kv.get(LEASE_KEY)).value) == winners[0].me
            with pytest.raises(LeaseLost, match="taken over"):
                await killed.renew()  # it was only frozen after all: told to stop
            await winners[0].renew()  # the winner holds it
        finally:
            await nc.drain()

    asyncio.run(scenario())


def test_a_value_that_is_no_lease_record_is_an_unknown_holder_taken_over_when_stale(stack: StackState) -> None:
    names = _names()

    async def scenario() -> None:
        nc = await connect(stack.nats_url, name="test-lease")
        try:
            kv = await lease_kv(nc.jetstream(), names)
            await kv.put(LEASE_KEY, b"not json")
            taker = RunLease(kv, names.run, ttl_s=TTL_S)
            await taker.acquire()
            assert LeaseRecord.parse((await kv.get(LEASE_KEY)).value) == taker.me
        finally:
            await nc.drain()

    asyncio.run(scenario())


def test_a_renewal_whose_reply_was_lost_is_adopted_not_taken_for_a_takeover(stack: StackState) -> None:
    names = _names()

    async def scenario() -> None:
        nc = await connect(stack.nats_url, name="test-lease")
        try:
            kv = await lease_kv(nc.jetstream(), names)
            lease = RunLease(kv, names.run, ttl_s=TTL_S)
            await lease.acquire()
            landed = LeaseRecord(**{**asdict(lease.me), "beat": lease.me.beat + 1})
            await kv.put(LEASE_KEY, landed.to_bytes())  # the renewal the server stored, whose reply never came
            await lease.renew()  # sees a newer revision, finds its own record there: still the holder
            assert lease.me == landed
            await lease.renew()  # and renews on from the adopted revision
            assert LeaseRecord.parse((await kv.get(LEASE_KEY)).value) == lease.me and lease.me.beat == landed.beat + 1
        finally:
            await nc.drain()

    asyncio.run(scenario())


class _LostDeleteReply:
    """The real bucket, except that the first delete lands on the server and its reply never comes."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.deletes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv, name)

    async def delete(self, key: str, last: int | None = None) -> bool:
        self.deletes += 1
        done = await self.kv.delete(key, last=last)
        if self.deletes == 1:
            raise nats.errors.TimeoutError
        return done


def test_a_release_whose_reply_was_lost_is_sent_again_and_the_lease_is_free(stack: StackState) -> None:
    names = _names()

    async def scenario() -> None:
        nc = await connect(stack.nats_url, name="test-lease")
        try:
            kv = await lease_kv(nc.jetstream(), names)
            lossy = _LostDeleteReply(kv)
            first = RunLease(lossy, names.run, ttl_s=3600.0)
            await first.acquire()
            await first.release()
            assert lossy.deletes == 2 and first.revision is None  # the second delete was refused: already gone
            second = RunLease(kv, names.run, ttl_s=3600.0)  # would watch for an hour if the key were still held
            await asyncio.wait_for(second.acquire(), timeout=30.0)
            assert LeaseRecord.parse((await kv.get(LEASE_KEY)).value) == second.me
        finally:
            await nc.drain()

    asyncio.run(scenario())
