"""Trajectory groups over JetStream: stream set-up, publisher, trainer consumer, dead letters, replay.

    generator ── TrajectoryPublisher.publish(group) ──► leeway.<run>.traj  (stream LEEWAY_<run>_TRAJ, limits)
                  encode; > max_inline_bytes: body to the object store (create-only, key = run/group/digest),
                  message = pointer (claim check)
                  Nats-Msg-Id = group id; every ack wait bounded; retried with backoff, same id
                                                            │
    trainer ranks ◄── TrajectoryConsumer.fetch() ◄──────────┘  durable pull consumer "trainer", bound by all ranks
                  decode + validate; failure -> leeway.<run>.dlq.traj (stream LEEWAY_<run>_DLQ) + term()
                  claim object unreadable now (store error, timeout) -> nak with backoff; past max_deliver -> dlq
                  ack(seqs) only after the step that used the groups is committed
    replay   ◄── ReplayReader (ephemeral, ack none) from a stream seq / a start time, filtered by min version

Guarantees and their sources:
- No duplicate *stored* message for a retried publish within the duplicate window (`Nats-Msg-Id`);
  delivery is at-least-once (a trainer that dies before acking gets the groups again), so the trainer
  also dedupes by group id.
- No wait on the server is unbounded: publish acks, fetches, dead-letter publishes and acks all carry
  a timeout (a pending publish can stay unresolved after a server kill).
- A message that fails to decode or validate is dead-lettered (original bytes + reason header), then
  terminated, never dropped; if the dead-letter publish itself fails the message is nak'ed and retried.
- A claim pointer is checked before the store is touched: its key must be exactly the one the run and
  the group id imply (no `..`, no other run's prefix), its size must match a HEAD of the object and stay
  under `CLAIM_CHECK_MAX_BYTES`. A store error or timeout is transient (nak with backoff); a delivery past
  the consumer's `max_deliver` is dead-lettered (`max_deliveries`), so nothing loops through every resume.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import hashlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import nats
import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from pipeline.wire.codec import CodecError, decode_group, encode_group
from pipeline.wire.names import RunNames
from pipeline.wire.retry import Backoff, retry_async
from pipeline.wire.trajectory import SCHEMA_VERSION, TrajectoryGroup, TrajectoryValidationError
from storage.objectstore import PreconditionFailed, validate_key

log = logging.getLogger(__name__)

# --- headers ------------------------------------------------------------------------------------------
H_MSG_ID = "Nats-Msg-Id"
H_SCHEMA = "Leeway-Schema-Version"
H_MIN_VERSION = "Leeway-Min-Version"
H_MAX_VERSION = "Leeway-Max-Version"
H_NUM_SAMPLES = "Leeway-Num-Samples"
H_NUM_TOKENS = "Leeway-Num-Tokens"
H_CLAIM_CHECK = "Leeway-Claim-Check"
H_DLQ_REASON = "Leeway-Dead-Letter-Reason"
H_DLQ_DETAIL = "Leeway-Dead-Letter-Detail"
H_DLQ_STREAM = "Leeway-Original-Stream"
H_DLQ_SEQ = "Leeway-Original-Stream-Seq"
H_DLQ_SUBJECT = "Leeway-Original-Subject"
H_DLQ_MSG_ID = "Leeway-Original-Msg-Id"
H_DLQ_BODY_OMITTED = "Leeway-Original-Body-Omitted-Bytes"

# --- named defaults (candidates for config fields) ------------------------------------------------------
DUPLICATE_WINDOW_S = 600.0
"""Dedupe window of the streams: longer than the longest outage a publisher retries through."""
TRAINER_ACK_WAIT_S = 600.0
"""A trainer rank holding a group this long without ack or `in_progress` gets it redelivered elsewhere."""
TRAINER_MAX_ACK_PENDING = 4096
"""Un-acked groups across all trainer ranks (>= global batch + prefetch, or delivery stalls silently)."""
FETCH_TIMEOUT_S = 1.0
"""Default long-poll of one fetch; fetch returns [] after it instead of raising."""
ACK_TIMEOUT_S = 5.0
"""Bound on one synchronous ack or dead-letter publish."""
PUBLISH_BACKOFF_INITIAL_S = 0.05
PUBLISH_BACKOFF_MAX_S = 2.0
PUBLISH_WINDOW = 64
"""Publishes in flight at once in `publish_many` (each awaits its own bounded ack)."""
DEAD_LETTER_MAX_BYTES = 1024**3
"""Size cap of the dead-letter stream (JetStream reserves it up front; dead letters should be rare)."""
DLQ_DETAIL_MAX_CHARS = 500
DLQ_NAK_DELAY_S = 2.0
"""Redelivery delay of a bad message whose dead-letter publish failed (server away)."""
REPLAY_INACTIVE_THRESHOLD_S = 60.0
"""An abandoned replay consumer is deleted by the server after this idle time."""
CONNECT_PENDING_BYTES = 64 * 1024 * 1024
"""Client outbound buffer: publishes made during a reconnect are kept up to this size (default 2 MiB)."""
TRAINER_MAX_DELIVER = 20
"""Deliveries of one group the trainer handles; the next is dead-lettered (`max_deliveries`) instead, so a
group that kills the trainer, or whose claim object stays unreadable, cannot come back on every resume."""
MAX_DELIVER_DEAD_LETTER_TRIES = 3
"""Deliveries the server allows past the handled ones: each tries to store the dead letter (nak'ed if it fails)."""
CLAIM_CHECK_MAX_BYTES = 256 * 1024**2
"""Largest claim-checked body: publishers refuse larger groups, consumers dead-letter pointers to larger ones."""
CLAIM_RETRY_DELAY_INITIAL_S = 0.5
CLAIM_RETRY_DELAY_MAX_S = 60.0
"""A message whose claim object could not be read now (store error, timeout) is nak'ed with delay
initial * 2**(deliveries - 1), capped here: with `TRAINER_MAX_DELIVER` it rides out ~14 min of store outage."""
REPLAY_CLAIM_ATTEMPTS = 3
REPLAY_CLAIM_BACKOFF_S = 0.25
"""Replay (no redelivery) reads an unreadable claim object this many times, backing off from this delay, then
skips the group with the counted reason `claim_check_unavailable`."""
SHA256_HEX_RE = re.compile(r"^[0-9a-f]{64}$")


class StreamSettings(Protocol):
    """The `stream` config section (`pipeline.config.StreamConfig`) fields this module reads."""

    max_age_s: float
    max_bytes: int
    max_inline_bytes: int
    max_msg_bytes: int
    fetch_batch: int
    fetch_max_bytes: int
    publish_ack_timeout_s: float
    publish_retries: int
    replicas: int


class ClaimStore(Protocol):
    """The object-store calls the claim check needs (`storage.objectstore.ObjectStore`)."""

    def put_if_absent(self, key: str, data: bytes) -> str: ...

    def size(self, key: str) -> int: ...

    def get(self, key: str) -> bytes: ...


class PublishError(RuntimeError):
    """A group could not be stored: retries exhausted, or the server refused it for good."""


class DeadLetterError(Exception):
    """A received message that cannot become a trajectory group; `reason` is a short stable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class ClaimUnavailable(Exception):
    """The claim object could not be read now (store error or timeout): transient, the message is retried."""

    def __init__(self, key: str, cause: BaseException) -> None:
        super().__init__(f"object {key!r} unreadable: {type(cause).__name__}: {cause}")
        self.key = key


def claim_retry_delay_s(num_delivered: int) -> float:
    """Nak delay after the `num_delivered`-th delivery found its claim object unreadable (exponential, capped)."""
    return min(CLAIM_RETRY_DELAY_INITIAL_S * 2 ** max(0, min(num_delivered - 1, 30)), CLAIM_RETRY_DELAY_MAX_S)


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


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream, or bring an existing one to `config` (idempotent; safe from every process)."""
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != 10058:  # "stream name already in use with a different configuration"
            raise
        await js.update_stream(config)


async def ensure_trajectory_streams(
    js: JetStreamContext, names: RunNames, stream: StreamSettings, *, duplicate_window_s: float = DUPLICATE_WINDOW_S
) -> None:
    """The trajectory stream (limits retention, file storage) and the run's dead-letter stream."""
    window = min(duplicate_window_s, stream.max_age_s)
    common = dict(
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=stream.max_age_s,
        num_replicas=stream.replicas,
        duplicate_window=window,
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=names.trajectory_stream,
            subjects=[names.trajectory_subject],
            max_bytes=stream.max_bytes,
            max_msg_size=stream.max_msg_bytes,
            **common,
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=names.dead_letter_stream,
            subjects=[names.dead_letter_subjects],
            max_bytes=min(stream.max_bytes, DEAD_LETTER_MAX_BYTES),
            max_msg_size=-1,
            **common,
        ),
    )


_CONSUMER_EXISTS = (10013, 10148)  # "consumer name already in use", "consumer already exists"


async def ensure_trainer_consumer(
    js: JetStreamContext,
    names: RunNames,
    *,
    ack_wait_s: float = TRAINER_ACK_WAIT_S,
    max_ack_pending: int = TRAINER_MAX_ACK_PENDING,
    max_deliver: int = TRAINER_MAX_DELIVER,
) -> None:
    """Create the durable consumer, or bring an existing one (e.g. made before it had a `max_deliver`) up to date.

    Called by rank 0 or the launcher on every start; ranks then `TrajectoryConsumer.bind`. The server allows
    `max_deliver + MAX_DELIVER_DEAD_LETTER_TRIES` deliveries; the consumer handles the first `max_deliver` and
    dead-letters the later ones. Updating keeps the consumer's position and pending acks.
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
    try:
        await js.add_consumer(names.trajectory_stream, config)  # nats-server >= 2.10 updates an existing one
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code not in _CONSUMER_EXISTS:
            raise
        # An older server refuses to change a durable; keep it: bound consumers still enforce the limit.
        log.warning(
            "trainer consumer exists with other settings and was kept (%s); max_deliver enforced client-side", exc
        )


def handled_deliveries(server_max_deliver: int | None) -> int:
    """Deliveries a bound consumer handles, from the server's `max_deliver` (unlimited: `TRAINER_MAX_DELIVER`)."""
    if server_max_deliver is None or server_max_deliver <= 0:
        return TRAINER_MAX_DELIVER
    return max(1, server_max_deliver - MAX_DELIVER_DEAD_LETTER_TRIES)


def fetch_batch_size(stream: StreamSettings, max_groups: int | None = None) -> int:
    """Messages per fetch: `fetch_batch`, lowered so batch x largest message stays under `fetch_max_bytes`.

    The server pushes a whole fetch at once; past its pending limit it cuts the client as a slow consumer.
    """
    by_bytes = max(1, stream.fetch_max_bytes // stream.max_msg_bytes)
    batch = min(stream.fetch_batch, by_bytes)
    return max(1, min(batch, max_groups)) if max_groups else batch


# --- publishing -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishResult:
    group_id: str
    seq: int
    duplicate: bool
    """True when the stream already held this group id (an earlier attempt was stored)."""
    payload_bytes: int
    claim_check_key: str | None
    attempts: int


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


_TRANSIENT = (
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.NoRespondersError,
    nats.errors.OutboundBufferLimitError,
)


def group_headers(group: TrajectoryGroup) -> dict[str, str]:
    """Headers that let consumers filter (by policy version) and sanity-check without decoding."""
    return {
        H_MSG_ID: group.group_id,
        H_SCHEMA: str(SCHEMA_VERSION),
        H_MIN_VERSION: str(group.group_min_version),
        H_MAX_VERSION: str(group.group_max_version),
        H_NUM_SAMPLES: str(group.num_samples),
        H_NUM_TOKENS: str(group.num_tokens),
    }


class TrajectoryPublisher:
    """Publishes groups with dedupe ids, bounded ack waits, retries with backoff, and the claim check."""

    def __init__(
        self, js: JetStreamContext, names: RunNames, stream: StreamSettings, store: ClaimStore | None = None
    ) -> None:
        self._js = js
        self._names = names
        self._stream = stream
        self._store = store

    async def publish(self, group: TrajectoryGroup) -> PublishResult:
        """Store one group exactly once in the stream; raises `PublishError` after `publish_retries` retries."""
        data = encode_group(group)
        headers = group_headers(group)
        key = None
        if len(data) > self._stream.max_inline_bytes:
            if self._store is None:
                raise PublishError(
                    f"group {group.group_id!r} is {len(data)} bytes > max_inline_bytes "
                    f"{self._stream.max_inline_bytes} and no object store is configured"
                )
            if len(data) > CLAIM_CHECK_MAX_BYTES:
                raise PublishError(
                    f"group {group.group_id!r} is {len(data)} bytes > CLAIM_CHECK_MAX_BYTES {CLAIM_CHECK_MAX_BYTES}"
                )
            digest = hashlib.sha256(data).hexdigest()
            key = self._names.trajectory_key(group.group_id, digest)
            await asyncio.to_thread(_store_claim, self._store, key, data)
            headers[H_CLAIM_CHECK] = key
            data = orjson.dumps({"key": key, "bytes": len(data), "sha256": digest})
        ack, attempts = await self.publish_raw(
            self._names.trajectory_subject, data, headers, stream_name=self._names.trajectory_stream
        )
        return PublishResult(group.group_id, ack.seq, bool(ack.duplicate), len(data), key, attempts)

    async def publish_many(
        self, groups: Iterable[TrajectoryGroup], *, window: int = PUBLISH_WINDOW
    ) -> list[PublishResult]:
        """Publish with up to `window` acks outstanding; all are attempted, the first failure is raised."""
        gate = asyncio.Semaphore(window)

        async def one(group: TrajectoryGroup) -> PublishResult:
            async with gate:
                return await self.publish(group)

        results = await asyncio.gather(*(one(g) for g in groups), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results  # type: ignore[return-value]

    async def publish_raw(
        self, subject: str, data: bytes, headers: Mapping[str, str], *, stream_name: str | None = None
    ) -> tuple[Any, int]:
        """Publish until acked: each ack wait bounded by `publish_ack_timeout_s`, re-sent with the same id.

        `stream_name` (if given) must be the stream that stores `subject`, else the server refuses.
        """
        retries = self._stream.publish_retries
        for attempt in range(retries + 1):
            try:
                ack = await self._js.publish(
                    subject, data, timeout=self._stream.publish_ack_timeout_s, stream=stream_name, headers=dict(headers)
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


def _store_claim(store: ClaimStore, key: str, data: bytes) -> None:
    """Create-only write of a claim body: an object already at `key` (which names the digest) holds these bytes,
    written by an earlier attempt of the same publish, so it is left as it is and never overwritten."""
    with contextlib.suppress(PreconditionFailed):
        store.put_if_absent(key, data)


# --- decoding received messages (pure, except the claim-check fetch) -----------------------------------------


def _int_header(headers: Mapping[str, str], name: str) -> int:
    try:
        return int(headers[name])
    except (KeyError, ValueError, TypeError) as exc:
        raise DeadLetterError(
            "bad_headers", f"header {name!r} missing or not an integer: {headers.get(name)!r}"
        ) from exc


def parse_claim_check(
    headers: Mapping[str, str], data: bytes, names: RunNames, *, max_bytes: int = CLAIM_CHECK_MAX_BYTES
) -> tuple[str, int, str] | None:
    """(key, size, sha256) when the message is a claim-check pointer, else None; bad pointers dead-letter.

    The key must be exactly what `names` and the message's group id (`Nats-Msg-Id`) imply, with the
    pointer's digest (or the legacy key without it): `claim_check_invalid` for a malformed pointer or key
    (`../x`, `/a`, a size over `max_bytes`), `claim_check_foreign` for a well-formed key of another run or
    group. Nothing here touches the store.
    """
    key = headers.get(H_CLAIM_CHECK)
    if key is None:
        return None
    try:
        pointer = orjson.loads(data)
        if not isinstance(pointer, dict):
            raise TypeError(f"pointer is a {type(pointer).__name__}, not an object")
        size, digest = pointer["bytes"], pointer["sha256"]
        if pointer["key"] != key:
            raise ValueError(f"body key {pointer['key']!r} != header key {key!r}")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= max_bytes:
            raise ValueError(f"bytes={size!r} is not an integer in [0, {max_bytes}]")
        if not isinstance(digest, str) or not SHA256_HEX_RE.match(digest):
            raise ValueError(f"sha256={digest!r} is not 64 lowercase hex digits")
        validate_key(key)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise DeadLetterError("claim_check_invalid", f"bad pointer: {exc}") from exc
    group_id = headers.get(H_MSG_ID)
    if not isinstance(group_id, str) or key not in names.claim_keys(group_id, digest):
        raise DeadLetterError(
            "claim_check_foreign",
            f"key {key!r} is not run {names.run!r}'s key for group {group_id!r} "
            f"({names.trajectory_key(str(group_id), digest)!r})",
        )
    return key, size, digest


def fetch_claim(store: ClaimStore | None, key: str, size: int, sha256: str) -> bytes:
    """Load and verify a claim-checked body: HEAD (size must equal the pointer's), then GET and hash.

    A missing object (`claim_check_missing`), a size or digest other than the pointer's (`claim_check_mismatch`)
    or a key the store refuses (`claim_check_invalid`) is permanent: `DeadLetterError`. Any other store error
    (connection, timeout, S3 5xx or throttling) is transient: `ClaimUnavailable`, and the caller retries later.
    """
    if store is None:
        raise DeadLetterError("claim_check_invalid", f"pointer to {key!r} but no object store is configured")
    try:
        stored = store.size(key)
        if stored != size:
            raise DeadLetterError("claim_check_mismatch", f"object {key!r} is {stored} bytes, the pointer says {size}")
        data = store.get(key)
    except DeadLetterError:
        raise
    except KeyError as exc:  # storage.objectstore.ObjectNotFound is a KeyError
        raise DeadLetterError("claim_check_missing", f"object {key!r} not found") from exc
    except ValueError as exc:  # storage.objectstore.validate_key
        raise DeadLetterError("claim_check_invalid", f"object key {key!r} refused by the store: {exc}") from exc
    except Exception as exc:  # a store we do not own: every other failure is treated as transient
        raise ClaimUnavailable(key, exc) from exc
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        raise DeadLetterError(
            "claim_check_mismatch",
            f"object {key!r} is {len(data)} bytes / other digest than the pointer's {size} bytes",
        )
    return data


def decode_payload(headers: Mapping[str, str] | None, data: bytes) -> TrajectoryGroup:
    """Decode an inline body and check it against its headers; raise `DeadLetterError` with the reason.

    Header/body agreement is enforced because replay filters on headers without decoding.
    """
    headers = headers or {}
    version = headers.get(H_SCHEMA)
    if version != str(SCHEMA_VERSION):
        raise DeadLetterError("schema_mismatch", f"header {H_SCHEMA}={version!r}, expected {SCHEMA_VERSION}")
    min_v, max_v = _int_header(headers, H_MIN_VERSION), _int_header(headers, H_MAX_VERSION)
    num_samples = _int_header(headers, H_NUM_SAMPLES)
    try:
        group = decode_group(data)
    except CodecError as exc:
        raise DeadLetterError(exc.reason, str(exc)) from exc
    except TrajectoryValidationError as exc:
        raise DeadLetterError("validation_error", str(exc)) from exc
    checks = (
        (H_MSG_ID, headers.get(H_MSG_ID), group.group_id),
        (H_MIN_VERSION, min_v, group.group_min_version),
        (H_MAX_VERSION, max_v, group.group_max_version),
        (H_NUM_SAMPLES, num_samples, group.num_samples),
    )
    for name, said, actual in checks:
        if said != actual:
            raise DeadLetterError("header_mismatch", f"header {name}={said!r} but the group has {actual!r}")
    return group


# --- dead letters -----------------------------------------------------------------------------------------


def _header_safe(text: str) -> str:
    return " ".join(text.split())[:DLQ_DETAIL_MAX_CHARS]


class DeadLetters:
    """Copies bad messages (original bytes, original headers, reason) to a dead-letter subject.

    Counted per reason in `counts`; each reason is logged once at WARNING (then at DEBUG) so a flood of
    one failure neither hides in silence nor drowns the log.
    """

    def __init__(self, js: JetStreamContext, subject: str, *, timeout_s: float = ACK_TIMEOUT_S) -> None:
        self._js = js
        self._subject = subject
        self._timeout_s = timeout_s
        self.counts: collections.Counter[str] = collections.Counter()
        self._logged: set[str] = set()

    async def send(self, msg: Msg, reason: str, detail: str) -> bool:
        """Publish the copy; True once stored (then the caller may `term()` the original)."""
        meta = msg.metadata
        headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
        headers.update(
            {
                H_DLQ_REASON: reason,
                H_DLQ_DETAIL: _header_safe(detail),
                H_DLQ_STREAM: meta.stream,
                H_DLQ_SEQ: str(meta.sequence.stream),
                H_DLQ_SUBJECT: msg.subject,
                H_MSG_ID: f"{meta.stream}:{meta.sequence.stream}",  # re-dead-lettering after a crash dedupes
            }
        )
        if msg.headers and H_MSG_ID in msg.headers:
            headers[H_DLQ_MSG_ID] = _header_safe(msg.headers[H_MSG_ID])
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

    async def dispose(self, msg: Msg, reason: str, detail: str) -> None:
        """Dead-letter then terminate; if the copy could not be stored, nak so the message comes back later."""
        if await self.send(msg, reason, detail):
            await msg.term()
        else:
            await msg.nak(delay=DLQ_NAK_DELAY_S)


# --- the trainer's consumer ------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Delivery:
    """A decoded group with its stream position; `msg` is the handle acks go through."""

    group: TrajectoryGroup
    seq: int
    msg: Msg | None
    num_delivered: int = 1
    published_at_s: float = 0.0
    """Server time the message was stored (Unix s): gen_end_s .. published_at_s .. trained = time queued."""


def _published_at(msg: Msg) -> float:
    return msg.metadata.timestamp.timestamp()


class TrajectoryConsumer:
    """One trainer rank's handle on the shared durable consumer.

    Acks only when told (`ack(seqs)`, after the step that used the groups is committed); a group held
    longer than the consumer's ack wait without `in_progress` is redelivered, possibly to another rank,
    so the trainer dedupes by group id. Bad messages are dead-lettered and never returned.
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
    ) -> None:
        self._js = js
        self._sub = sub
        self._names = names
        self._stream = stream
        self._store = store
        self._held: dict[int, Msg] = {}
        self.max_deliver = max_deliver
        """Deliveries of one message this consumer handles; a later delivery is dead-lettered (`max_deliveries`)."""
        self.dead_letters = DeadLetters(js, names.trajectory_dead_letter_subject)

    @classmethod
    async def bind(
        cls, js: JetStreamContext, names: RunNames, stream: StreamSettings, store: ClaimStore | None = None
    ) -> TrajectoryConsumer:
        """Bind to the durable consumer made by `ensure_trainer_consumer` (any number of ranks may).

        The delivery limit is read from the server's consumer, so every rank enforces the same one."""
        sub = await js.pull_subscribe_bind(names.trainer_consumer, stream=names.trajectory_stream)
        info = await sub.consumer_info()
        return cls(js, sub, names, stream, store, max_deliver=handled_deliveries(info.config.max_deliver))

    @property
    def held_seqs(self) -> list[int]:
        """Stream sequences delivered to this rank and not yet acked, nak'ed or dead-lettered."""
        return sorted(self._held)

    async def fetch(self, max_groups: int | None = None, timeout_s: float = FETCH_TIMEOUT_S) -> list[Delivery]:
        """Up to one fetch worth of good groups; [] when nothing arrived within `timeout_s`."""
        try:
            msgs = await self._sub.fetch(fetch_batch_size(self._stream, max_groups), timeout=timeout_s)
        except asyncio.TimeoutError:  # nats-py raises both its own and the plain asyncio one
            return []
        except _TRANSIENT as exc:  # server away: the caller's loop simply fetches again
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
        seq, delivered = msg.metadata.sequence.stream, msg.metadata.num_delivered
        if delivered > self.max_deliver:
            detail = f"delivered {delivered} times without an ack (limit {self.max_deliver})"
            await self.dead_letters.dispose(msg, "max_deliveries", detail)
            return None
        try:
            headers = msg.headers or {}
            claim = parse_claim_check(headers, msg.data, self._names)
            data = msg.data
            if claim is not None:
                data = await asyncio.to_thread(fetch_claim, self._store, *claim)
            group = decode_payload(headers, data)
        except DeadLetterError as exc:
            await self.dead_letters.dispose(msg, exc.reason, exc.detail)
            return None
        except ClaimUnavailable as exc:
            await self._retry_later(msg, exc)
            return None
        self._held[seq] = msg
        return Delivery(group, seq, msg, msg.metadata.num_delivered, _published_at(msg))

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
        if failed:
            log.warning("acks of %d groups not confirmed (they will be redelivered): seqs %s", len(failed), failed[:8])
        return len(msgs) - len(failed)

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


# --- replay ---------------------------------------------------------------------------------------------------


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
    delivered: int = 0
    filtered: int = 0
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)


class ReplayReader:
    """Reads a `ReplaySelection` through an ephemeral `ack none` consumer; same `fetch`/`ack` as the trainer's.

    Bad messages are counted in `stats.skipped` and logged once per reason (the live consumer already
    dead-lettered them); so is a group whose claim object stays unreadable after `REPLAY_CLAIM_ATTEMPTS`
    reads (`claim_check_unavailable`): a replay never dies on one message. A gap in consumer sequences
    (messages lost to the client) restarts the consumer right after the last message seen, so the output
    is exactly the selection, in order.
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

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        names: RunNames,
        stream: StreamSettings,
        store: ClaimStore | None,
        selection: ReplaySelection,
    ) -> ReplayReader:
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
                if _int_header(headers, H_MIN_VERSION) < self.selection.min_version:
                    self.stats.filtered += 1
                    return None
            claim = parse_claim_check(headers, msg.data, self._names)
            data = msg.data if claim is None else await self._fetch_claim(*claim)
            group = decode_payload(headers, data)
        except DeadLetterError as exc:
            self.stats.skipped[exc.reason] += 1
            if exc.reason not in self._logged:
                self._logged.add(exc.reason)
                log.warning("replay: skipping seq %d: %s", msg.metadata.sequence.stream, exc)
            return None
        self.stats.delivered += 1
        return Delivery(group, msg.metadata.sequence.stream, None, msg.metadata.num_delivered, _published_at(msg))

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

    async def ack(self, seqs: Iterable[int]) -> int:
        """Replay never acks (its consumer is `ack none`); present so a trainer can read either source."""
        return len(list(seqs))

    async def __aiter__(self) -> AsyncIterator[Delivery]:
        while not self.done:
            for delivery in await self.fetch():
                yield delivery

    async def close(self) -> None:
        await self._finish()
