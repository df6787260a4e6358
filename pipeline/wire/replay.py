"""Reading recorded trajectory groups again: `ReplaySelection`, `ReplayReader`, `ReplayStats`.

    replay ◄── ReplayReader (ephemeral consumer, ack none) from a stream seq / a start time, filtered by min version

The trajectory stream keeps groups by limits (age, bytes), not by acks, so a range the trainer has
already consumed can be read again, by `leeway replay` (`actors/tools/replay.py`), by
`leeway trainer --replay`, and by a resumed trainer catching up from its checkpoint's watermark. The
reader's consumer is its own, ephemeral and `ack none`: it never moves or disturbs the trainer's
durable one, and the server deletes it if the reader goes away.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from pipeline.wire.claim_check import ClaimStore, ClaimUnavailable, fetch_claim, parse_claim_check
from pipeline.wire.consumer import FETCH_TIMEOUT_S, Delivery, fetch_batch_size, published_at
from pipeline.wire.group_limits import GroupLimits
from pipeline.wire.headers import H_MIN_VERSION
from pipeline.wire.jetstream import DeadLetterError
from pipeline.wire.names import RunNames
from pipeline.wire.retry import Backoff, retry_async
from pipeline.wire.trajectories import StreamSettings, check_group_limits, decode_payload, int_header

log = logging.getLogger(__name__)

REPLAY_INACTIVE_THRESHOLD_S = 60.0
"""An abandoned replay consumer is deleted by the server after this idle time."""
REPLAY_CLAIM_ATTEMPTS = 3
"""Reads of an unreadable claim object before the group is skipped (`claim_check_unavailable`): a replay
has no redelivery to wait for, and must not die on one message."""
REPLAY_CLAIM_BACKOFF_S = 0.25
"""First wait between those reads (then doubled, with jitter, capped at 4x this)."""


@dataclass(frozen=True)
class ReplaySelection:
    """Which recorded groups to read again, in stream order.

    Start: `from_seq` (stream sequence, inclusive), or `since` (stored at or after), or the stream's start.
    Filter: `min_version`: only groups whose every loss token is at least that policy version (the
    `Leeway-Min-Version` header, so nothing is decoded to filter). End: `until_seq` (inclusive) or
    `until` (stored at or before), and never past the stream's last message when the replay opened.
    """

    from_seq: int | None = None
    since: dt.datetime | None = None
    min_version: int | None = None
    until_seq: int | None = None
    until: dt.datetime | None = None

    def __post_init__(self) -> None:
        if self.from_seq is not None and self.since is not None:
            raise ValueError("replay: give from_seq or since, not both")
        if self.from_seq is not None and self.from_seq < 1:
            raise ValueError(f"replay: from_seq={self.from_seq} (stream sequences start at 1)")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                raise ValueError(f"replay: {name}={value} needs a timezone")


@dataclass
class ReplayStats:
    """What a replay read: groups returned, groups left out by `min_version`, bad messages per reason."""

    delivered: int = 0
    filtered: int = 0
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)


class ReplayReader:
    """Reads a `ReplaySelection` through an ephemeral `ack none` consumer; `fetch` as the trainer's consumer's.

    Bad messages are counted in `stats.skipped` and logged once per reason (the live consumer already
    dead-lettered them); so is a group whose claim object stays unreadable after `REPLAY_CLAIM_ATTEMPTS`
    reads (`claim_check_unavailable`): a replay never dies on one message. A gap in consumer sequences
    (messages lost to the client) restarts the consumer right after the last message seen, so the output
    is exactly the selection, in order. Nothing is acked: deliveries carry no `msg`.
    """

    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        stream: StreamSettings,
        store: ClaimStore | None,
        selection: ReplaySelection,
    ) -> None:
        self._js = js
        self._names = names
        self._stream = stream
        self._store = store
        self.selection = selection
        self.stats = ReplayStats()
        self._sub: JetStreamContext.PullSubscription | None = None
        self._consumer: str | None = None
        self._last_seq = 0
        self._last_consumer_seq = 0
        self._end_seq = 0
        self.done = False
        self._logged: set[str] = set()
        self.limits: GroupLimits | None = None
        """The largest group read (a trainer's, set by it); a larger one is skipped as `group_too_large` from its
        headers, before its claim object is fetched or its body inflated."""

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        names: RunNames,
        stream: StreamSettings,
        store: ClaimStore | None,
        selection: ReplaySelection,
    ) -> ReplayReader:
        """A reader positioned at the selection's start, its end fixed at the stream's last message now."""
        reader = cls(js, names, stream, store, selection)
        info = await js.stream_info(names.trajectory_stream)
        last = info.state.last_seq
        reader._end_seq = last if selection.until_seq is None else min(last, selection.until_seq)
        if reader._end_seq < max(1, selection.from_seq or 1) or info.state.messages == 0:
            reader.done = True
            return reader
        await reader._start(from_seq=selection.from_seq, since=selection.since)
        return reader

    async def _start(self, *, from_seq: int | None, since: dt.datetime | None) -> None:
        await self._delete_consumer()
        config = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            filter_subject=self._names.trajectory_subject,
            inactive_threshold=REPLAY_INACTIVE_THRESHOLD_S,
            mem_storage=True,
        )
        if from_seq is not None:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, from_seq
        elif since is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = since
        else:
            config.deliver_policy = DeliverPolicy.ALL
        config.name = f"replay-{uuid.uuid4().hex}"
        await self._js.add_consumer(self._names.trajectory_stream, config)
        self._consumer = config.name
        self._last_consumer_seq = 0
        self._sub = await self._js.pull_subscribe_bind(config.name, stream=self._names.trajectory_stream)

    async def _delete_consumer(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        if self._consumer is not None:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await self._js.delete_consumer(self._names.trajectory_stream, self._consumer)
        self._sub, self._consumer = None, None

    async def fetch(self, max_groups: int | None = None, timeout_s: float = FETCH_TIMEOUT_S) -> list[Delivery]:
        """Next groups of the selection in stream order; [] with `done` set at the end."""
        if self.done:
            return []
        assert self._sub is not None
        try:
            msgs = await self._sub.fetch(fetch_batch_size(self._stream, max_groups), timeout=timeout_s)
        except asyncio.TimeoutError:  # nats-py raises both its own and the plain asyncio one
            info = await self._sub.consumer_info()
            if info.num_pending == 0:
                await self._finish()
            return []
        out: list[Delivery] = []
        for msg in msgs:
            meta = msg.metadata
            if meta.sequence.consumer != self._last_consumer_seq + 1:
                log.warning(
                    "replay: consumer sequence gap (%d -> %d); restarting after stream seq %d",
                    self._last_consumer_seq,
                    meta.sequence.consumer,
                    self._last_seq,
                )
                await self._start(from_seq=self._last_seq + 1, since=None)
                return out
            self._last_consumer_seq = meta.sequence.consumer
            if self._past_end(msg):
                await self._finish()
                return out
            self._last_seq = meta.sequence.stream
            delivery = await self._select(msg)
            if delivery is not None:
                out.append(delivery)
            if self._last_seq >= self._end_seq or meta.num_pending == 0:
                await self._finish()
                return out
        return out

    def _past_end(self, msg: Msg) -> bool:
        if msg.metadata.sequence.stream > self._end_seq:
            return True
        return self.selection.until is not None and msg.metadata.timestamp > self.selection.until

    async def _select(self, msg: Msg) -> Delivery | None:
        headers = msg.headers or {}
        try:
            if self.selection.min_version is not None:
                if int_header(headers, H_MIN_VERSION) < self.selection.min_version:
                    self.stats.filtered += 1
                    return None
            check_group_limits(headers, self.limits)
            claim = parse_claim_check(headers, msg.data, self._names)
            data = msg.data if claim is None else await self._fetch_claim(*claim)
            group = decode_payload(headers, data)  # its caps were checked above, from the same headers
        except DeadLetterError as exc:
            self.stats.skipped[exc.reason] += 1
            if exc.reason not in self._logged:
                self._logged.add(exc.reason)
                log.warning("replay: skipping seq %d: %s", msg.metadata.sequence.stream, exc)
            return None
        self.stats.delivered += 1
        return Delivery(group, msg.metadata.sequence.stream, None, msg.metadata.num_delivered, published_at(msg))

    async def _fetch_claim(self, key: str, size: int, sha256: str) -> bytes:
        """`fetch_claim` with a few backed-off retries (no redelivery here); then a counted skip."""
        backoff = Backoff(
            attempts=REPLAY_CLAIM_ATTEMPTS, initial_s=REPLAY_CLAIM_BACKOFF_S, max_s=REPLAY_CLAIM_BACKOFF_S * 4
        )
        try:
            return await retry_async(
                lambda: asyncio.to_thread(fetch_claim, self._store, key, size, sha256),
                what=f"replay: reading claim object {key!r}",
                backoff=backoff,
                permanent=(DeadLetterError,),
            )
        except ClaimUnavailable as exc:
            raise DeadLetterError("claim_check_unavailable", f"{exc} ({REPLAY_CLAIM_ATTEMPTS} attempts)") from exc

    async def _finish(self) -> None:
        self.done = True
        await self._delete_consumer()

    async def __aiter__(self) -> AsyncIterator[Delivery]:
        while not self.done:
            for delivery in await self.fetch():
                yield delivery

    async def close(self) -> None:
        await self._finish()
