"""Claim checks: a group too large for a message goes to the object store, the message carries a pointer.

    publisher: body > stream.max_inline_bytes -> `store_claim` writes <run>/trajectories/<group>.<sha256>.arrow
               create-only; the message is {"key", "bytes", "sha256"} with header `Leeway-Claim-Check`
    consumer:  `parse_claim_check` checks the pointer without touching the store, `fetch_claim` HEADs, GETs
               and verifies it; a store error or timeout is transient (`ClaimUnavailable`)

Guarantees:
- The key holds the body's digest, so a regenerated group with the same id gets its own object and never
  overwrites the one an earlier message points to; a retried publish finds its own object and leaves it.
- A pointer is checked before the store is touched: its key must be exactly the one the run, the group id
  and the digest imply (no `..`, no other run's prefix), its size must match a HEAD of the object and stay
  under `CLAIM_CHECK_MAX_BYTES`, and the bytes read must hash to the pointer's digest.
- A permanent failure (`claim_check_*` reasons) is a `DeadLetterError`; a transient one is retried later
  with `claim_retry_delay_s`, and the consumer's delivery limit ends it (`pipeline/wire/consumer.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Mapping
from typing import Protocol

import orjson

from pipeline.wire.headers import H_CLAIM_CHECK, H_MSG_ID
from pipeline.wire.jetstream import DeadLetterError
from pipeline.wire.names import RunNames
from storage.objectstore import PreconditionFailed, validate_key

CLAIM_CHECK_MAX_BYTES = 256 * 1024**2
"""Largest claim-checked body: publishers refuse larger groups, consumers dead-letter pointers to larger ones."""
CLAIM_RETRY_DELAY_INITIAL_S = 0.5
"""Nak delay after the first delivery found its claim object unreadable; doubled per delivery."""
CLAIM_RETRY_DELAY_MAX_S = 60.0
"""Cap of that delay: with the trainer's delivery limit (`TRAINER_MAX_DELIVER`) it rides out ~14 min of
store outage before the group is dead-lettered."""
SHA256_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
"""A pointer's digest: 64 lowercase hex digits, as `hashlib.sha256().hexdigest()` writes it."""


class ClaimStore(Protocol):
    """The object-store calls the claim check needs (`storage.objectstore.ObjectStore`)."""

    def put_if_absent(self, key: str, data: bytes) -> str: ...

    def size(self, key: str) -> int: ...

    def get(self, key: str) -> bytes: ...


class ClaimUnavailable(Exception):
    """The claim object could not be read now (store error or timeout): transient, the message is retried."""

    def __init__(self, key: str, cause: BaseException) -> None:
        super().__init__(f"object {key!r} unreadable: {type(cause).__name__}: {cause}")
        self.key = key


def claim_retry_delay_s(num_delivered: int) -> float:
    """Nak delay after the `num_delivered`-th delivery found its claim object unreadable (exponential, capped)."""
    return min(CLAIM_RETRY_DELAY_INITIAL_S * 2 ** max(0, min(num_delivered - 1, 30)), CLAIM_RETRY_DELAY_MAX_S)


def store_claim(store: ClaimStore, names: RunNames, group_id: str, data: bytes) -> tuple[str, bytes]:
    """Write `data` as `group_id`'s claim object; returns (key, the pointer that is the message body).

    Create-only: an object already at the key (which names the digest) holds these bytes, written by an
    earlier attempt of the same publish, so it is left as it is and never overwritten. Blocking (store I/O).
    """
    digest = hashlib.sha256(data).hexdigest()
    key = names.trajectory_key(group_id, digest)
    with contextlib.suppress(PreconditionFailed):
        store.put_if_absent(key, data)
    return key, orjson.dumps({"key": key, "bytes": len(data), "sha256": digest})


def parse_claim_check(
    headers: Mapping[str, str], data: bytes, names: RunNames, *, max_bytes: int = CLAIM_CHECK_MAX_BYTES
) -> tuple[str, int, str] | None:
    """(key, size, sha256) when the message is a claim-check pointer, else None; bad pointers dead-letter.

    The key must be exactly what `names`, the message's group id (`Nats-Msg-Id`) and the pointer's digest
    imply: `claim_check_invalid` for a malformed pointer or key (`../x`, `/a`, a size over `max_bytes`),
    `claim_check_foreign` for a well-formed key of another run, group or digest. Nothing here touches the store.
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
    expected = names.trajectory_key(str(group_id), digest)
    if not isinstance(group_id, str) or key != expected:
        raise DeadLetterError(
            "claim_check_foreign", f"key {key!r} is not run {names.run!r}'s key for group {group_id!r} ({expected!r})"
        )
    return key, size, digest


def fetch_claim(store: ClaimStore | None, key: str, size: int, sha256: str) -> bytes:
    """Load and verify a claim-checked body: HEAD (size must equal the pointer's), then GET and hash.

    A missing object (`claim_check_missing`), a size or digest other than the pointer's (`claim_check_mismatch`)
    or a key the store refuses (`claim_check_invalid`) is permanent: `DeadLetterError`. Any other store error
    (connection, timeout, S3 5xx or throttling) is transient: `ClaimUnavailable`, and the caller retries later.
    Blocking (store I/O).
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
