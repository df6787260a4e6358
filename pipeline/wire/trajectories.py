"""The trajectory streams and their messages: set-up, `TrajectoryPublisher`, and decoding a received body.

One message is one group: the Arrow body (`pipeline/wire/codec.py`) or, above `stream.max_inline_bytes`,
a claim-check pointer to it (`pipeline/wire/claim_check.py`), with `Nats-Msg-Id` = group id and the
headers of `group_headers`. Every group of a run goes to `leeway.<run>.traj` (stream `LEEWAY_<run>_TRAJ`,
limits retention: replayable); what cannot be decoded goes to `leeway.<run>.dlq.traj` (stream
`LEEWAY_<run>_DLQ`).

Guarantees:
- No duplicate *stored* message for a retried publish within the duplicate window (`Nats-Msg-Id`);
  delivery is at-least-once, so the trainer also dedupes by group id.
- Every publish's ack wait is bounded and retried with backoff under the same id
  (`pipeline.wire.jetstream.BoundedPublisher`); a group that cannot be stored raises `PublishError`.
- A received body is checked against its headers (`decode_payload`), because replay filters on the
  headers without decoding; any disagreement is a `DeadLetterError` with its reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from pipeline.wire.claim_check import CLAIM_CHECK_MAX_BYTES, ClaimStore, store_claim
from pipeline.wire.codec import MAX_DECODED_BYTES, CodecError, decode_group, encode_group
from pipeline.wire.group_limits import GROUP_TOO_LARGE, GroupLimits
from pipeline.wire.headers import (
    H_CLAIM_CHECK,
    H_MAX_VERSION,
    H_MIN_VERSION,
    H_MSG_ID,
    H_NUM_SAMPLES,
    H_NUM_TOKENS,
    H_ROUTE_BYTES,
    H_SCHEMA,
)
from pipeline.wire.jetstream import (
    DUPLICATE_WINDOW_S,
    BoundedPublisher,
    DeadLetterError,
    PublishError,
    ensure_stream,
)
from pipeline.wire.names import RunNames
from pipeline.wire.trajectory import (
    MAX_ROUTE_BYTES_PER_TOKEN,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    TrajectoryGroup,
    TrajectoryValidationError,
)

PUBLISH_WINDOW = 64
"""Publishes in flight at once in `publish_many` (each awaits its own bounded ack)."""
DEAD_LETTER_MAX_BYTES = 1024**3
"""Size cap of the dead-letter stream (JetStream reserves it up front; dead letters should be rare)."""


class StreamSettings(Protocol):
    """The `stream` config section (`pipeline.config.StreamConfig`) fields the trajectory modules read."""

    max_age_s: float
    max_bytes: int
    max_inline_bytes: int
    max_msg_bytes: int
    fetch_batch: int
    fetch_max_bytes: int
    publish_ack_timeout_s: float
    publish_retries: int
    replicas: int


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
    await ensure_stream(
        js,
        StreamConfig(
            name=names.trajectory_stream,
            subjects=[names.trajectory_subject],
            max_bytes=stream.max_bytes,
            max_msg_size=stream.max_msg_bytes,
            **common,
        ),
    )
    await ensure_stream(
        js,
        StreamConfig(
            name=names.dead_letter_stream,
            subjects=[names.dead_letter_subjects],
            max_bytes=min(stream.max_bytes, DEAD_LETTER_MAX_BYTES),
            max_msg_size=-1,
            **common,
        ),
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
        **({} if group.routes is None else {H_ROUTE_BYTES: str(route_bytes_per_token(group))}),
    }


def route_bytes_per_token(group: TrajectoryGroup) -> int:
    """Bytes of one position's routes on the wire (0 for a dense group)."""
    if group.routes is None:
        return 0
    _, layers, top_k = group.routes.shape
    return layers * top_k * group.routes.dtype.itemsize


@dataclass(frozen=True)
class PublishResult:
    group_id: str
    seq: int
    duplicate: bool
    """True when the stream already held this group id (an earlier attempt was stored)."""
    payload_bytes: int
    claim_check_key: str | None
    attempts: int


class TrajectoryPublisher:
    """Publishes groups with dedupe ids, bounded ack waits, retries with backoff, and the claim check."""

    def __init__(
        self, js: JetStreamContext, names: RunNames, stream: StreamSettings, store: ClaimStore | None = None
    ) -> None:
        self._names = names
        self._stream = stream
        self._store = store
        self._publisher = BoundedPublisher(js, stream)

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
            key, data = await asyncio.to_thread(store_claim, self._store, self._names, group.group_id, data)
            headers[H_CLAIM_CHECK] = key
        ack, attempts = await self._publisher.publish(
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
        out: list[PublishResult] = []
        for r in results:
            if isinstance(r, BaseException):
                raise r
            out.append(r)
        return out


def int_header(headers: Mapping[str, str], name: str) -> int:
    """The integer header `name`; `DeadLetterError` (`bad_headers`) when missing or not an integer."""
    try:
        return int(headers[name])
    except (KeyError, ValueError, TypeError) as exc:
        raise DeadLetterError(
            "bad_headers", f"header {name!r} missing or not an integer: {headers.get(name)!r}"
        ) from exc


DECODED_BYTES_PER_TOKEN = 13
"""tokens (int32) + loss_mask (uint8) + logprobs (float32) + versions (int32)."""
DECODED_BYTES_PER_SAMPLE = 64 * 1024
"""Generous room for one row's ids, tags, scalars and offsets; a row with more is refused as `too_large`."""
DECODED_BYTES_PER_GROUP = 1024 * 1024
"""Schema-independent slack: buffer padding and validity bitmaps."""


def decoded_bytes_bound(num_samples: int, num_tokens: int, route_bytes: int = 0) -> int:
    """The most a group of this many samples and tokens can inflate to: the decoder's cap for its message.

    Derived from the headers, so a body that would inflate past what its headers announce is refused
    before decompression (a decompression bomb), and never more than the codec's absolute cap.
    """
    if num_samples < 0 or num_tokens < 0 or not 0 <= route_bytes <= MAX_ROUTE_BYTES_PER_TOKEN:
        raise DeadLetterError(
            "bad_headers",
            f"sizes in headers out of range: {num_samples} samples, {num_tokens} tokens, {route_bytes} route bytes",
        )
    per_token = DECODED_BYTES_PER_TOKEN + (route_bytes + 4 if route_bytes else 0)  # + the route versions (int32)
    bound = DECODED_BYTES_PER_GROUP + num_samples * DECODED_BYTES_PER_SAMPLE + num_tokens * per_token
    return min(bound, MAX_DECODED_BYTES)


def check_group_limits(headers: Mapping[str, str] | None, limits: GroupLimits | None) -> None:
    """`DeadLetterError` (`group_too_large`, naming the cap) when a message's headers claim a group past `limits`:
    called before its claim object is fetched or its body inflated (`pipeline.wire.group_limits`)."""
    why = limits.header_refusal(headers or {}) if limits is not None else None
    if why is not None:
        raise DeadLetterError(GROUP_TOO_LARGE, f"the headers claim {why}; refused before decoding")


def decode_payload(
    headers: Mapping[str, str] | None, data: bytes, limits: GroupLimits | None = None
) -> TrajectoryGroup:
    """Decode an inline body and check it against its headers; raise `DeadLetterError` with the reason.

    Header/body agreement is enforced because replay filters on headers without decoding. With `limits` (the
    trainer's), a group whose headers claim more samples or tokens than they allow is refused before a byte is
    inflated (`group_too_large`); the body must then agree with those headers.
    """
    headers = headers or {}
    check_group_limits(headers, limits)
    version = headers.get(H_SCHEMA)
    if version not in {str(v) for v in READABLE_SCHEMA_VERSIONS}:
        raise DeadLetterError(
            "schema_mismatch", f"header {H_SCHEMA}={version!r}, expected one of {list(READABLE_SCHEMA_VERSIONS)}"
        )
    min_v, max_v = int_header(headers, H_MIN_VERSION), int_header(headers, H_MAX_VERSION)
    num_samples, num_tokens = int_header(headers, H_NUM_SAMPLES), int_header(headers, H_NUM_TOKENS)
    route_bytes = int_header(headers, H_ROUTE_BYTES) if H_ROUTE_BYTES in headers else 0
    try:
        group = decode_group(data, max_decoded_bytes=decoded_bytes_bound(num_samples, num_tokens, route_bytes))
    except CodecError as exc:
        raise DeadLetterError(exc.reason, str(exc)) from exc
    except TrajectoryValidationError as exc:
        raise DeadLetterError("validation_error", str(exc)) from exc
    checks = (
        (H_MSG_ID, headers.get(H_MSG_ID), group.group_id),
        (H_MIN_VERSION, min_v, group.group_min_version),
        (H_MAX_VERSION, max_v, group.group_max_version),
        (H_NUM_SAMPLES, num_samples, group.num_samples),
        (H_NUM_TOKENS, num_tokens, group.num_tokens),
        (H_ROUTE_BYTES, route_bytes, route_bytes_per_token(group)),
    )
    for name, said, actual in checks:
        if said != actual:
            raise DeadLetterError("header_mismatch", f"header {name}={said!r} but the group has {actual!r}")
    return group
