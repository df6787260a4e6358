"""The trainer's side of the trajectory stream: the durable consumer and `TrajectoryConsumer`.

    generator ── TrajectoryPublisher.publish(group) ──► leeway.<run>.traj  (stream LEEWAY_<run>_TRAJ, limits)
                                                             │
    trainer rank 0 ◄── TrajectoryConsumer.fetch() ◄──────────┘  durable pull consumer "trainer"
                  decode + validate; failure -> leeway.<run>.dlq.traj (stream LEEWAY_<run>_DLQ) + term()
                  claim object unreadable now (store error, timeout) -> nak with backoff; past max_deliver -> dlq
                  ack(seqs) only after the step that used the groups is committed

Rank 0 alone consumes (`actors/trainer/rank_group.py`): it calls `ensure_trainer_consumer` on every
start, then `TrajectoryConsumer.bind`; the other ranks hold no stream position. A trainer that dies
before acking gets the same groups again from the durable consumer after its ack wait, so the trainer
dedupes by group id.

Guarantees:
- A message that fails to decode or validate is dead-lettered (original bytes + reason header), then
  terminated, never dropped; if the dead-letter publish itself fails the message is nak'ed and retried.
- A claim object that cannot be read now (store error or timeout) is transient: nak with backoff; a
  delivery past the consumer's `max_deliver` is dead-lettered (`max_deliveries`), so nothing loops
  through every resume.
- No wait on the server is unbounded: fetches, acks and dead-letter publishes all carry a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from pipeline.wire.claim_check import ClaimStore, ClaimUnavailable, claim_retry_delay_s, fetch_claim, parse_claim_check
from pipeline.wire.group_limits import GroupLimits
from pipeline.wire.headers import H_CLAIM_CHECK
from pipeline.wire.jetstream import (
    ACK_TIMEOUT_S,
    DISCONNECTED_ERRORS,
    PUBLISH_BACKOFF_MAX_S,
    DeadLetters,
    handled_deliveries,
    pull,
    receive,
)
from pipeline.wire.names import RunNames
from pipeline.wire.trajectories import StreamSettings, check_group_limits, decode_payload
from pipeline.wire.trajectory import TrajectoryGroup

log = logging.getLogger(__name__)

TRAINER_ACK_WAIT_S = 600.0
"""A trainer holding a group this long without ack or `in_progress` gets it redelivered (to its successor)."""
TRAINER_MAX_ACK_PENDING = 4096
"""Un-acked groups the trainer may hold (>= global batch + prefetch, or delivery stalls silently)."""
TRAINER_MAX_DELIVER = 20
"""Deliveries of one group the trainer handles; the next is dead-lettered (`max_deliveries`) instead, so a
group that kills the trainer, or whose claim object stays unreadable, cannot come back on every resume."""
MAX_DELIVER_DEAD_LETTER_TRIES = 3
"""Deliveries the server allows past the handled ones: each tries to store the dead letter (nak'ed if it fails)."""
FETCH_TIMEOUT_S = 1.0
"""Default long-poll of one fetch; fetch returns [] after it instead of raising."""


async def ensure_trainer_consumer(
    js: JetStreamContext,
    names: RunNames,
    *,
    ack_wait_s: float = TRAINER_ACK_WAIT_S,
    max_ack_pending: int = TRAINER_MAX_ACK_PENDING,
    max_deliver: int = TRAINER_MAX_DELIVER,
) -> None:
    """Create the durable consumer, or bring an existing one to these settings (idempotent).

    Called by the trainer's rank 0 on every start (`actors/trainer/sessions.py`), before
    `TrajectoryConsumer.bind`. The server allows `max_deliver + MAX_DELIVER_DEAD_LETTER_TRIES` deliveries;
    the consumer handles the first `max_deliver` and dead-letters the later ones. Updating an existing
    consumer (nats-server >= 2.10) keeps its position and pending acks.
    """
    if max_deliver < 1:
        raise ValueError(f"ensure_trainer_consumer: max_deliver={max_deliver} (must be >= 1)")
    config = ConsumerConfig(
        durable_name=names.trainer_consumer,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_ack_pending=max_ack_pending,
        max_deliver=max_deliver + MAX_DELIVER_DEAD_LETTER_TRIES,
        filter_subject=names.trajectory_subject,
    )
    await js.add_consumer(names.trajectory_stream, config)


def fetch_batch_size(stream: StreamSettings, max_groups: int | None = None) -> int:
    """Messages per fetch: `fetch_batch`, lowered so batch x largest message stays under `fetch_max_bytes`.

    The server pushes a whole fetch at once; past its pending limit it cuts the client as a slow consumer.
    """
    by_bytes = max(1, stream.fetch_max_bytes // stream.max_msg_bytes)
    batch = min(stream.fetch_batch, by_bytes)
    return max(1, min(batch, max_groups)) if max_groups else batch


@dataclass(frozen=True, eq=False)
class Delivery:
    """A decoded group with its stream position; `msg` is the handle acks go through (None in a replay)."""

    group: TrajectoryGroup
    seq: int
    msg: Msg | None
    num_delivered: int = 1
    published_at_s: float = 0.0
    """Server time the message was stored (Unix s): gen_end_s .. published_at_s .. trained = time queued."""


def published_at(msg: Msg) -> float:
    """Server time `msg` was stored, in Unix seconds."""
    return msg.metadata.timestamp.timestamp()


class TrajectoryConsumer:
    """The trainer's handle on its durable consumer (rank 0 alone binds it).

    Acks only when told (`ack(seqs)`, after the step that used the groups is committed); a group held
    longer than the consumer's ack wait without `in_progress` is redelivered, to this trainer or to the
    one that resumes after it, so the trainer dedupes by group id. Bad messages are dead-lettered and
    never returned.
    """

    def __init__(
        self,
        js: JetStreamContext,
        sub: JetStreamContext.PullSubscription,
        names: RunNames,
        stream: StreamSettings,
        store: ClaimStore | None,
        *,
        max_deliver: int = TRAINER_MAX_DELIVER,
        limits: GroupLimits | None = None,
    ) -> None:
        self._js = js
        self.limits = limits
        """The largest group taken (the trainer's: its context and group caps); a larger one is dead-lettered
        `group_too_large` from its headers, before its claim object is fetched or its body inflated."""
        self._sub = sub
        self._names = names
        self._stream = stream
        self._store = store
        self._held: dict[int, Msg] = {}
        self.acked_claims: list[tuple[int, str]] = []
        """(stream seq, claim object key) of claim-checked groups acked since the owner last took them
        (`take_acked_claims`): the trainer deletes those objects once replay can no longer reach them."""
        self.max_deliver = max_deliver
        """Deliveries of one message this consumer handles; a later delivery is dead-lettered (`max_deliveries`)."""
        self.dead_letters = DeadLetters(js, names.trajectory_dead_letter_subject)

    @classmethod
    async def bind(
        cls,
        js: JetStreamContext,
        names: RunNames,
        stream: StreamSettings,
        store: ClaimStore | None = None,
        *,
        limits: GroupLimits | None = None,
    ) -> TrajectoryConsumer:
        """Bind to the durable consumer made by `ensure_trainer_consumer`.

        The delivery limit is read from the server's consumer, so a restarted trainer enforces the one set up."""
        sub = await js.pull_subscribe_bind(names.trainer_consumer, stream=names.trajectory_stream)
        info = await sub.consumer_info()
        max_deliver = handled_deliveries(info.config.max_deliver, MAX_DELIVER_DEAD_LETTER_TRIES)
        return cls(js, sub, names, stream, store, max_deliver=max_deliver, limits=limits)

    @property
    def held_seqs(self) -> list[int]:
        """Stream sequences delivered to this consumer and not yet acked, nak'ed or dead-lettered."""
        return sorted(self._held)

    async def fetch(self, max_groups: int | None = None, timeout_s: float = FETCH_TIMEOUT_S) -> list[Delivery]:
        """Up to one fetch worth of good groups; [] when nothing arrived within `timeout_s`."""
        try:
            msgs = await pull(self._sub, fetch_batch_size(self._stream, max_groups), timeout_s)
        except DISCONNECTED_ERRORS as exc:  # server away: the caller's loop simply fetches again
            log.debug("fetch while disconnected: %s", exc)
            await asyncio.sleep(min(timeout_s, PUBLISH_BACKOFF_MAX_S))
            return []
        out = []
        for msg in msgs:
            delivery = await self._handle(msg)
            if delivery is not None:
                out.append(delivery)
        return out

    async def _handle(self, msg: Msg) -> Delivery | None:
        try:
            group = await receive(msg, self.dead_letters, max_deliver=self.max_deliver, decode=self._decode)
        except ClaimUnavailable as exc:
            await self._retry_later(msg, exc)
            return None
        if group is None:
            return None
        seq = msg.metadata.sequence.stream
        self._held[seq] = msg
        return Delivery(group, seq, msg, msg.metadata.num_delivered, published_at(msg))

    async def _decode(self, msg: Msg) -> TrajectoryGroup:
        """The group of `msg`, its claim object read first if it has one (`DeadLetterError`, `ClaimUnavailable`)."""
        headers = msg.headers or {}
        check_group_limits(headers, self.limits)  # before the claim object is fetched
        claim = parse_claim_check(headers, msg.data, self._names)
        data = msg.data
        if claim is not None:
            data = await asyncio.to_thread(fetch_claim, self._store, *claim)
        return decode_payload(headers, data)  # its caps were checked above, from the same headers

    async def _retry_later(self, msg: Msg, exc: ClaimUnavailable) -> None:
        """Transient claim failure: nak with backoff (a lost nak is covered by the ack wait)."""
        delivered = msg.metadata.num_delivered
        delay_s = claim_retry_delay_s(delivered)
        log.warning(
            "seq %d: %s (delivery %d of %d); retrying in %.1fs",
            msg.metadata.sequence.stream,
            exc,
            delivered,
            self.max_deliver,
            delay_s,
            exc_info=exc.__cause__ if delivered == 1 else None,
        )
        try:
            await msg.nak(delay=delay_s)
        except (nats.errors.Error, asyncio.TimeoutError) as nak_exc:
            log.warning(
                "nak of seq %d not sent (%s); it comes back after the ack wait", msg.metadata.sequence.stream, nak_exc
            )

    async def ack(self, seqs: Iterable[int]) -> int:
        """Ack held groups (synchronously, in parallel); returns how many the server confirmed.

        An ack that fails is logged; the group will come back (at-least-once) and be deduped by id.
        """
        msgs = [(s, self._held.pop(s)) for s in seqs if s in self._held]
        results = await asyncio.gather(*(m.ack_sync(timeout=ACK_TIMEOUT_S) for _, m in msgs), return_exceptions=True)
        failed = [s for (s, _), r in zip(msgs, results, strict=True) if isinstance(r, BaseException)]
        for (seq, msg), result in zip(msgs, results, strict=True):
            key = (msg.headers or {}).get(H_CLAIM_CHECK)
            if key is not None and not isinstance(result, BaseException):  # validated when it was delivered
                self.acked_claims.append((seq, key))
        if failed:
            log.warning("acks of %d groups not confirmed (they will be redelivered): seqs %s", len(failed), failed[:8])
        return len(msgs) - len(failed)

    def take_acked_claims(self) -> list[tuple[int, str]]:
        """The claim objects of groups acked since the last call (see `acked_claims`), handed over once."""
        taken, self.acked_claims = self.acked_claims, []
        return taken

    async def dead_letter(self, seq: int, reason: str, detail: str) -> None:
        """Refuse a held group for good: copy it to the dead-letter subject with `reason`, then terminate it
        (a group that decodes but can never be trained, e.g. a token id past the model's vocabulary)."""
        msg = self._held.pop(seq, None)
        if msg is not None:
            await self.dead_letters.dispose(msg, reason, detail)

    async def nak(self, seqs: Iterable[int], delay_s: float | None = None) -> None:
        """Give held groups back for redelivery (e.g. a step that was abandoned)."""
        for s in list(seqs):
            msg = self._held.pop(s, None)
            if msg is not None:
                await msg.nak(delay=delay_s)

    async def in_progress(self, seqs: Iterable[int] | None = None) -> None:
        """Reset the ack-wait timer of held groups (call during steps longer than the ack wait)."""
        for s in list(self._held if seqs is None else seqs):
            if s in self._held:
                await self._held[s].in_progress()

    async def close(self) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()
