"""One small object-store interface: the `ObjectStore` contract, its errors and its key rules.

Everything Leeway keeps outside its queues (weight versions, `LATEST`, checkpoints, large
trajectory groups) goes through `ObjectStore`. This module knows no implementation; they live
next to it and `storage.stores.open_store` picks one by URL:

    s3://bucket/prefix   -> storage.s3.S3Store          (boto3; SeaweedFS, MinIO or AWS)
    file:///abs/path     -> storage.filestore.FileStore (one machine; atomic renames)

Code that only uses a store imports this module, which imports neither boto3 nor the filesystem
implementation.

Keys are relative, '/'-separated and scoped to the store's prefix (`run/weights/v00000001/...`).
Semantics every implementation keeps (tests run the same cases against both):

- `put` replaces the whole object atomically: a reader sees the old bytes or the new ones, never
  a mix or a prefix.
- `put_if_absent` is create-only (S3 `If-None-Match: *`): of several concurrent writers exactly one
  succeeds, the others get `PreconditionFailed`.
- `put_if_match` is compare-and-swap against the etag returned by `put`/`get_with_etag`
  (S3 `If-Match`); a missing object also fails the precondition.
- A conditional write is retried only after an ambiguous failure (timeout, 5xx, dropped
  connection), and then its first attempt may have landed with only the response lost. If the
  retry fails its precondition, the store reads the object back: holding exactly the bytes being
  written means the earlier attempt won, and the call succeeds. Writers that must tell themselves
  apart from another writer of identical bytes put a nonce in the data (the manifest's
  `publish_id`). A precondition failure with no ambiguous attempt before it is always reported.
- `get` of a missing key raises `ObjectNotFound` (a `KeyError`) naming the key; `delete` of a
  missing key is a no-op, so deletion can be retried.
- Etags are opaque strings; compare them only with etags from the same store.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

__all__ = [
    "RESERVED_PREFIX",
    "ObjectNotFound",
    "ObjectStore",
    "PreconditionFailed",
    "validate_key",
]

RESERVED_PREFIX = ".lw-"
"""No key segment may start with this: `FileStore` keeps its own bookkeeping (temporary files, lock
files) under such names, and its `list` never returns them."""


class ObjectNotFound(KeyError):
    """The key does not exist in the store. `key` names it (relative to the store's prefix)."""

    def __init__(self, key: str, store: str = "") -> None:
        super().__init__(key)
        self.key = key
        self.store = store

    def __str__(self) -> str:
        where = f" in {self.store}" if self.store else ""
        return f"object {self.key!r} not found{where}"


class PreconditionFailed(Exception):
    """A create-only or compare-and-swap write lost: the object exists, or its etag changed."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"precondition failed for {key!r}: {reason}")
        self.key = key
        self.reason = reason


def validate_key(key: str) -> str:
    """Reject keys that could escape the prefix or collide with bookkeeping files.

    Why: FileStore maps keys onto paths, so '..', absolute paths and empty segments would write
    outside the root; S3 would accept them but then the two stores would disagree.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or key.endswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"object key {key!r} must be relative, '/'-separated, without a trailing '/'")
    for part in key.split("/"):
        if part in ("", ".", "..") or part.startswith(RESERVED_PREFIX):
            raise ValueError(f"object key {key!r} has an invalid segment {part!r}")
    return key


class ObjectStore(abc.ABC):
    """Byte objects by key. Implementations are thread-safe; callers may share one instance."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> str:
        """Write `data` at `key`, replacing any object atomically; returns the new etag."""

    @abc.abstractmethod
    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and the etag of exactly those bytes (input to `put_if_match`)."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes `[start, end)` of the object, clamped to its size (b"" past the end)."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes; `ObjectNotFound` if missing."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing key is not an error (so retries and races are safe)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with the string `prefix` (not only a directory; 'v0' matches 'v01/x')."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> str:
        """Create-only write; `PreconditionFailed` if the key already exists. Returns the etag."""

    @abc.abstractmethod
    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        """Replace the object only if its etag is still `etag`; else, or if it is missing, `PreconditionFailed`."""

    def get(self, key: str) -> bytes:
        """The object's bytes; `ObjectNotFound` naming the key if it does not exist."""
        return self.get_with_etag(key)[0]

    def exists(self, key: str) -> bool:
        """Whether the key exists now (a later read may still miss it if someone deletes it)."""
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete several keys; implementations may batch. Missing keys are ignored."""
        for key in keys:
            self.delete(key)

    def close(self) -> None:
        """Release thread pools and connections. The store must not be used afterwards."""
        return None

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
