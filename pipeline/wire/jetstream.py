"""What every stream of a run shares: the connection, stream set-up, bounded publishes, and dead letters.

The trajectory stream (`pipeline/wire/trajectories.py`, `pipeline/wire/consumer.py`) and the prompt
work queue (`pipeline/wire/prompt_queue.py`) live on the same server and fail the same ways, so they
share one answer to each failure:

- No wait on the server is unbounded. A pending publish can stay unresolved after a server kill,
  so `BoundedPublisher` bounds every ack wait and re-sends with the same `Nats-Msg-Id` (the server
  stores a retried publish once within the stream's duplicate window); acks and dead-letter
  publishes carry `ACK_TIMEOUT_S`.
- A received message is taken the same way from either inbox (`receive`): past the consumer's
  delivery limit it is dead-lettered (`max_deliveries`) instead of run again; one that does not
  decode (`DeadLetterError`) is dead-lettered with its reason. A dead letter is the original bytes
  and headers plus the reason, then the original is terminated; if the copy cannot be stored the
  original is nak'ed (with a delay that grows per failed try) and comes back, so nothing is dropped
  silently (`DeadLetters`). A consumer must leave deliveries for that: the prompt queue's allows
  unlimited ones (its limit is applied here, by `receive`), the trainer's a few past its limit.
- A fetch that finds JetStream unavailable (503, e.g. a full disk made the server disable it) returns
  nothing after a short wait and is logged once per outage (`pull`); the fetch loops simply go on.
- The run's dead-letter stream is readable from a watermark (`read_dead_letters`), which is how the
  trainer gives back the admission slots of what never reached it (`actors/trainer/slots.py`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, PubAck, StorageType, StreamConfig
from nats.js.kv import KeyValue

from pipeline.wire.headers import (
    H_DLQ_BODY_OMITTED,
    H_DLQ_DETAIL,
    H_DLQ_MSG_ID,
    H_DLQ_REASON,
    H_DLQ_SEQ,
    H_DLQ_STREAM,
    H_DLQ_SUBJECT,
    H_MSG_ID,
)
from pipeline.wire.names import RunNames

log = logging.getLogger(__name__)

T = TypeVar("T")

CONNECT_PENDING_BYTES = 64 * 1024 * 1024
"""Client outbound buffer: publishes made during a reconnect are kept up to this size (default 2 MiB)."""
DUPLICATE_WINDOW_S = 600.0
"""Dedupe window of the streams: longer than the longest outage a publisher retries through."""
ACK_TIMEOUT_S = 5.0
"""Bound on one synchronous ack or dead-letter publish."""
PUBLISH_BACKOFF_INITIAL_S = 0.05
"""Wait after a publish's first unacked attempt; doubled per attempt up to `PUBLISH_BACKOFF_MAX_S`."""
PUBLISH_BACKOFF_MAX_S = 2.0
"""Longest wait between two attempts of one publish, and the pause after a fetch found the server away."""
DLQ_DETAIL_MAX_CHARS = 500
"""A dead letter's detail header is cut to this: it is for a reader, and headers share the message's size."""
DLQ_NAK_DELAY_S = 2.0
"""Redelivery delay of a bad message whose first dead-letter publish failed (server away, DLQ full)."""
DLQ_NAK_DELAY_MAX_S = 30.0
"""Longest redelivery delay of a message whose dead letter keeps failing: doubled per failed try up to this, so
an outage of the dead-letter stream costs one publish attempt per message every half minute, not a tight loop."""
DEAD_LETTER_READ_TIMEOUT_S = 2.0
"""Bound on one message-get request to the dead-letter stream (its stream-info has the context's timeout)."""
_STREAM_EXISTS_DIFFERENTLY = 10058
"""JetStream's error code for "stream name already in use with a different configuration"."""

_RETRYABLE = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
)
"""Publish failures that a later attempt with the same id can cure (server away, reconnecting, slow)."""

DISCONNECTED_ERRORS = (
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.NoRespondersError,
    nats.errors.OutboundBufferLimitError,
)
"""Errors of a request made while the server is away: a loop that fetches again later rides them out."""


# --- connection and set-up ------------------------------------------------------------------------------


async def connect(
    url: str, *, creds_file: str | None = None, connect_timeout_s: float = 5.0, name: str = "leeway"
) -> NatsClient:
    """Connect for the long haul: reconnect forever, buffer 64 MiB of publishes while away, log state changes."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats %s: %s: %s", name, type(exc).__name__, exc)

    async def on_disconnect() -> None:
        log.info("nats %s: disconnected", name)

    async def on_reconnect() -> None:
        log.info("nats %s: reconnected", name)

    return await nats.connect(
        url,
        name=name,
        user_credentials=creds_file,
        connect_timeout=max(1, round(connect_timeout_s)),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        ping_interval=20,
        max_outstanding_pings=3,
        pending_size=CONNECT_PENDING_BYTES,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream, or bring an existing one to `config` (idempotent; safe from every process).

    Every process of a run calls this at start, in any order, so none depends on another having set up first.
    A stream that already has every setting of `config` is left alone without a create request: the server
    checks a create's `max_bytes` against its free store even when the stream exists, so a role restarting
    while the store is nearly full (a small `max_file_store`, a filling disk) would be refused for nothing.
    """
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        info = None
    if info is not None:
        if not _has_settings(info.config, config):
            await js.update_stream(config)
        return
    try:  # another process may create it first
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != _STREAM_EXISTS_DIFFERENTLY:
            raise
        await js.update_stream(config)


async def ensure_key_value(js: JetStreamContext, bucket: str) -> KeyValue:
    """A KV bucket of the run (one value per key, file storage), created on first use by whichever process comes
    first; safe when several create it at once."""
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        config = KeyValueConfig(bucket=bucket, history=1, storage=StorageType.FILE)
        try:
            return await js.create_key_value(config)
        except nats.js.errors.BadRequestError:
            return await js.key_value(bucket)  # created concurrently by another process


def _has_settings(current: StreamConfig, wanted: StreamConfig) -> bool:
    """True when `current` holds every field `wanted` sets (None in `wanted`: the server's default, not compared)."""
    for f in dataclasses.fields(wanted):
        value = getattr(wanted, f.name)
        if value is not None and getattr(current, f.name) != value:
            return False
    return True


def handled_deliveries(server_max_deliver: int | None, dead_letter_tries: int) -> int:
    """Deliveries of one message a consumer handles, from the server's `max_deliver`.

    The server is set to allow `dead_letter_tries` deliveries past the handled ones: each of those is not
    run but tries to store the dead letter (`max_deliveries`), nak'ed if that fails. A consumer without
    such room (no limit, or too low) was not made by this package's set-up, and is refused.
    """
    if server_max_deliver is None or server_max_deliver <= dead_letter_tries:
        raise ValueError(
            f"consumer max_deliver={server_max_deliver}: expected more than the {dead_letter_tries} deliveries "
            "kept for dead-lettering (create it with this package's ensure_* function)"
        )
    return server_max_deliver - dead_letter_tries


# --- publishing -----------------------------------------------------------------------------------------


class PublishSettings(Protocol):
    """The `stream` config fields (`pipeline.config.StreamConfig`) a bounded publish reads."""

    publish_ack_timeout_s: float
    publish_retries: int


class PublishError(RuntimeError):
    """A message could not be stored: retries exhausted, or the server refused it for good."""


class BoundedPublisher:
    """Publishes to any stream until acked: each ack wait bounded, re-sent with the same id, backing off."""

    def __init__(self, js: JetStreamContext, settings: PublishSettings) -> None:
        self._js = js
        self._settings = settings

    async def publish(
        self, subject: str, data: bytes, headers: Mapping[str, str], *, stream_name: str | None = None
    ) -> tuple[PubAck, int]:
        """(the server's ack, attempts made); raises `PublishError` after `publish_retries` retries.

        `headers` should carry `Nats-Msg-Id`, so that an attempt stored but not acked is not stored twice.
        `stream_name` (if given) must be the stream that stores `subject`, else the server refuses.
        """
        retries = self._settings.publish_retries
        for attempt in range(retries + 1):
            try:
                ack = await self._js.publish(
                    subject,
                    data,
                    timeout=self._settings.publish_ack_timeout_s,
                    stream=stream_name,
                    headers=dict(headers),
                )
                return ack, attempt + 1
            except _RETRYABLE as exc:
                if attempt == retries:
                    raise PublishError(
                        f"{headers.get(H_MSG_ID)!r} not acked after {retries + 1} attempts: {type(exc).__name__}: {exc}"
                    ) from exc
                delay = min(PUBLISH_BACKOFF_INITIAL_S * 2**attempt, PUBLISH_BACKOFF_MAX_S)
                log.debug(
                    "publish %s attempt %d failed (%s); retrying in %.2fs",
                    headers.get(H_MSG_ID),
                    attempt + 1,
                    type(exc).__name__,
                    delay,
                )
                await asyncio.sleep(delay)
            except (nats.js.errors.APIError, nats.errors.MaxPayloadError, nats.errors.ConnectionClosedError) as exc:
                raise PublishError(f"{headers.get(H_MSG_ID)!r} refused: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")


# --- receiving ------------------------------------------------------------------------------------------


class DeadLetterError(Exception):
    """A received message that cannot become a record; `reason` is a short stable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_UNAVAILABLE: weakref.WeakSet[JetStreamContext.PullSubscription] = weakref.WeakSet()
"""Subscriptions whose last fetch met JetStream unavailable: logged once when it starts and once when it ends."""
_SURPLUS: weakref.WeakKeyDictionary[JetStreamContext.PullSubscription, list[Msg]] = weakref.WeakKeyDictionary()
"""Messages a fetch brought beyond the batch asked for, per subscription: the next pulls hand them over first."""


async def pull(sub: JetStreamContext.PullSubscription, batch: int, timeout_s: float) -> list[Msg]:
    """Up to `batch` messages; [] when none arrived within `timeout_s` (nats-py raises a timeout instead).

    JetStream "service unavailable" (503: nats-server disabled JetStream, e.g. its store's disk is full, or the
    consumer's leader is away) is transient: it is logged once per outage, the call waits a little (bounded by
    `timeout_s`) and returns [], so every fetch loop rides it out as it rides out a disconnect.

    Never more than `batch`: nats-py's fetch first hands over every message already delivered to the subscription,
    for earlier pull requests that timed out here but were still answered by the server, however many that is (a
    trainer that waited through empty fetches got more groups than its step asks for). What goes beyond `batch` is
    kept, unhandled, for the next pulls of that subscription (a message not acked in time comes back anyway).
    """
    waiting = _SURPLUS.pop(sub, None)
    if waiting:
        if len(waiting) > batch:
            _SURPLUS[sub] = waiting[batch:]
        return waiting[:batch]
    try:
        msgs = await sub.fetch(batch, timeout=timeout_s)
    except asyncio.TimeoutError:  # nats-py raises both its own and the plain asyncio one
        msgs = []
    except nats.js.errors.ServiceUnavailableError as exc:
        if sub not in _UNAVAILABLE:
            _UNAVAILABLE.add(sub)
            log.warning("JetStream unavailable for fetches (%s); retrying until it is back", exc)
        await asyncio.sleep(min(timeout_s, PUBLISH_BACKOFF_MAX_S))
        return []
    if sub in _UNAVAILABLE:
        _UNAVAILABLE.discard(sub)
        log.info("JetStream available again for fetches")
    if len(msgs) > batch:
        _SURPLUS[sub] = msgs[batch:]
    return msgs[:batch]


async def receive(
    msg: Msg, dead_letters: DeadLetters, *, max_deliver: int, decode: Callable[[Msg], Awaitable[T]]
) -> T | None:
    """The record `decode` makes of `msg`, or None once `msg` is dead-lettered.

    A delivery past `max_deliver` is dead-lettered (`max_deliveries`) without being decoded: a message that
    kills whoever takes it then ends up inspectable instead of looping. A `DeadLetterError` from `decode` is
    dead-lettered with its reason. Any other error of `decode` is the caller's (e.g. a transient one).
    """
    delivered = msg.metadata.num_delivered
    if delivered > max_deliver:
        detail = f"delivered {delivered} times without an ack (limit {max_deliver})"
        await dead_letters.dispose(msg, "max_deliveries", detail, attempt=delivered - max_deliver)
        return None
    try:
        return await decode(msg)
    except DeadLetterError as exc:
        await dead_letters.dispose(msg, exc.reason, exc.detail)
        return None


# --- dead letters ---------------------------------------------------------------------------------------


def _header_safe(text: str) -> str:
    return " ".join(text.split())[:DLQ_DETAIL_MAX_CHARS]


def dead_letter_headers(
    original: Mapping[str, str] | None, reason: str, detail: str, *, stream: str, seq: int, subject: str
) -> dict[str, str]:
    """The headers of a dead-letter copy of stream message `seq`: the original's own (but `Nats-*`), the
    reason and where it came from, and `Nats-Msg-Id` = `<stream>:<seq>`, so that dead-lettering the same
    message again (after a crash, or by a resuming trainer) stores it once."""
    original = original or {}
    headers = {k: v for k, v in original.items() if not k.startswith("Nats-")}
    headers.update(
        {
            H_DLQ_REASON: reason,
            H_DLQ_DETAIL: _header_safe(detail),
            H_DLQ_STREAM: stream,
            H_DLQ_SEQ: str(seq),
            H_DLQ_SUBJECT: subject,
            H_MSG_ID: f"{stream}:{seq}",
        }
    )
    if H_MSG_ID in original:
        headers[H_DLQ_MSG_ID] = _header_safe(original[H_MSG_ID])
    return headers


TERMINATED_KEPT = 65536
"""Seqs a `DeadLetters` remembers having terminated (a flood of bad messages cannot grow it without bound)."""


class DeadLetters:
    """Copies bad messages (original bytes, original headers, reason) to a dead-letter subject.

    Counted per reason in `counts` (stored) and `failures` (copies not stored, the original nak'ed); each
    reason is logged once at WARNING (then at DEBUG) so a flood of one failure neither hides in silence nor
    drowns the log.
    """

    def __init__(
        self,
        js: JetStreamContext,
        subject: str,
        *,
        timeout_s: float = ACK_TIMEOUT_S,
        retry_delay_s: float = DLQ_NAK_DELAY_S,
        retry_delay_max_s: float = DLQ_NAK_DELAY_MAX_S,
    ) -> None:
        self._js = js
        self._subject = subject
        self._timeout_s = timeout_s
        self.retry_delay_s = retry_delay_s
        """Redelivery delay after a first failed copy; doubled per further try up to `retry_delay_max_s`."""
        self.retry_delay_max_s = retry_delay_max_s
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self._logged: set[str] = set()
        self.terminated: dict[int, None] = {}
        """Stream seqs this process dead-lettered and terminated (the newest `TERMINATED_KEPT`, oldest dropped
        first): the trainer trusts its own trajectory dead letters at once (`actors/trainer/slots.py`)."""

    async def send(self, msg: Msg, reason: str, detail: str) -> bool:
        """Publish the copy; True once stored (then the caller may `term()` the original)."""
        meta = msg.metadata
        headers = dead_letter_headers(
            msg.headers, reason, detail, stream=meta.stream, seq=meta.sequence.stream, subject=msg.subject
        )
        body = msg.data
        try:
            try:
                await self._js.publish(self._subject, body, timeout=self._timeout_s, headers=dict(headers))
            except (nats.errors.MaxPayloadError, nats.js.errors.BadRequestError):
                headers[H_DLQ_BODY_OMITTED] = str(len(body))
                await self._js.publish(self._subject, b"", timeout=self._timeout_s, headers=headers)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("dead letter for %s seq %d (%s) not stored: %s", meta.stream, meta.sequence.stream, reason, exc)
            return False
        self.counts[reason] += 1
        level = logging.DEBUG if reason in self._logged else logging.WARNING
        self._logged.add(reason)
        log.log(
            level,
            "dead-lettered %s seq %d: %s: %s (further %r failures logged at DEBUG)",
            meta.stream,
            meta.sequence.stream,
            reason,
            _header_safe(detail),
            reason,
        )
        return True

    async def dispose(self, msg: Msg, reason: str, detail: str, *, attempt: int = 1) -> None:
        """Dead-letter then terminate; if the copy could not be stored, nak so the message comes back later.

        The original is terminated only once its copy is stored, so a dead-letter stream that is away or full
        never loses a message: it comes back after `retry_delay_s`, doubled per `attempt` (the how-many-th
        try for this message, e.g. deliveries past the limit) up to `retry_delay_max_s`. That needs a consumer
        that still has a delivery to give (see the module docstring).
        """
        if await self.send(msg, reason, detail):
            await msg.term()
            self.terminated[msg.metadata.sequence.stream] = None
            if len(self.terminated) > TERMINATED_KEPT:
                del self.terminated[next(iter(self.terminated))]
            return
        self.failures[reason] += 1
        delay_s = min(self.retry_delay_s * 2 ** max(0, min(attempt - 1, 30)), self.retry_delay_max_s)
        await msg.nak(delay=delay_s)


@dataclass(frozen=True)
class DeadLetterEntry:
    """One message of the run's dead-letter stream, by its headers (the body is not read)."""

    seq: int
    subject: str
    reason: str
    original_id: str | None
    """The dead-lettered message's `Nats-Msg-Id` (a prompt's or a group's id); None if it had none."""
    original_stream: str | None = None
    """The stream it says the original was delivered from (`Leeway-Original-Stream`); None if unsaid."""
    original_seq: int | None = None
    """Its sequence there (`Leeway-Original-Stream-Seq`); None if unsaid or not a number."""


async def read_dead_letters(
    js: JetStreamContext, names: RunNames, *, after_seq: int, limit: int
) -> tuple[list[DeadLetterEntry], int]:
    """Dead letters of the run stored after stream sequence `after_seq` (at most `limit`), and the new watermark.

    Entries removed by the stream's retention before they were read are logged (the watermark moves past
    them). Every request is bounded; a NATS error or timeout is raised, and the caller reads again from the
    same watermark later.
    """
    info = await js.stream_info(names.dead_letter_stream)
    first, last = int(info.state.first_seq), int(info.state.last_seq)
    if last <= after_seq:
        return [], after_seq
    if first > after_seq + 1:
        log.warning(
            "dead-letter stream: seqs %d..%d were removed by retention before they were read",
            after_seq + 1,
            first - 1,
        )
    entries: list[DeadLetterEntry] = []
    watermark = max(after_seq, first - 1)
    seq = watermark + 1
    while seq <= last and len(entries) < limit:
        try:
            raw = await asyncio.wait_for(
                js.get_msg(names.dead_letter_stream, seq=seq, subject=names.dead_letter_subjects, next=True),
                DEAD_LETTER_READ_TIMEOUT_S,
            )
        except nats.js.errors.NotFoundError:
            watermark = last
            break
        headers = raw.headers or {}
        original_seq = headers.get(H_DLQ_SEQ, "")
        entries.append(
            DeadLetterEntry(
                int(raw.seq),
                str(raw.subject),
                headers.get(H_DLQ_REASON, ""),
                headers.get(H_DLQ_MSG_ID),
                headers.get(H_DLQ_STREAM),
                int(original_seq) if original_seq.isdigit() and len(original_seq) < 19 else None,
            )
        )
        watermark = int(raw.seq)
        seq = watermark + 1
    return entries, watermark
