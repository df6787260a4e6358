"""One small object-store interface, with a local-filesystem implementation and a URL opener.

Everything Leeway keeps outside its queues (weight versions, `LATEST`, checkpoints, large
trajectory groups) goes through `ObjectStore`. Two implementations are chosen by URL:

    s3://bucket/prefix   -> storage.s3.S3Store   (boto3; SeaweedFS, MinIO or AWS)
    file:///abs/path     -> FileStore            (one machine; atomic renames)

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
import contextlib
import errno
import fcntl
import hashlib
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = [
    "FileStore",
    "ObjectNotFound",
    "ObjectStore",
    "PreconditionFailed",
    "content_etag",
    "open_store",
    "validate_key",
]

# FileStore's own bookkeeping lives under names with this prefix; keys may not use it, and
# `list` never returns it.
_RESERVED_PREFIX = ".lw-"
_LOCK_DIR = ".lw-locks"


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
        if part in ("", ".", "..") or part.startswith(_RESERVED_PREFIX):
            raise ValueError(f"object key {key!r} has an invalid segment {part!r}")
    return key


def content_etag(data: bytes) -> str:
    """The etag FileStore uses: a content hash, so equal bytes give equal etags on any machine."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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


class FileStore(ObjectStore):
    """The object store on a local (or shared POSIX) filesystem, for single-machine runs and tests.

    Atomicity comes from the filesystem: every write goes to a temporary file in the target
    directory, is fsynced, and is then published by `os.replace` (plain put), `os.link` (create-only;
    fails with EEXIST if the key exists, so exactly one of racing writers wins), or `os.replace`
    under an exclusive `flock` on a per-key lock file (compare-and-swap, etag = content hash).
    Readers take no locks: they always see a complete old or new file.
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.as_uri()
        self._fsync = fsync

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _write_temp(self, path: Path, data: bytes) -> Path:
        """Write data to a fresh temp file next to `path`, creating parent dirs; returns the temp path."""
        for _attempt in range(3):  # a concurrent delete may remove an empty parent between mkdir and open
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f"{_RESERVED_PREFIX}tmp-{uuid.uuid4().hex}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                continue
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if self._fsync:
                        f.flush()
                        os.fsync(f.fileno())
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return tmp
        raise OSError(errno.ENOENT, f"could not create a temporary file in {path.parent}")

    def put(self, key: str, data: bytes) -> str:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        os.replace(tmp, path)
        return content_etag(data)

    def put_if_absent(self, key: str, data: bytes) -> str:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise PreconditionFailed(key, "object already exists") from None
        finally:
            tmp.unlink(missing_ok=True)
        return content_etag(data)

    @contextlib.contextmanager
    def _key_lock(self, key: str):
        """Exclusive per-key lock for compare-and-swap (lock files live under .lw-locks/)."""
        lock_dir = self.root / _LOCK_DIR
        lock_dir.mkdir(exist_ok=True)
        lock_path = lock_dir / hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        path = self._path(key)
        with self._key_lock(key):
            try:
                current = content_etag(path.read_bytes())
            except FileNotFoundError:
                raise PreconditionFailed(key, "object does not exist") from None
            if current != etag:
                raise PreconditionFailed(key, f"etag is {current}, expected {etag}")
            tmp = self._write_temp(path, data)
            os.replace(tmp, path)
        return content_etag(data)

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        try:
            data = self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key, self.url) from None
        return data, content_etag(data)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key, self.url) from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end}) for {key!r}")
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(end - start)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key, self.url) from None

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key, self.url) from None
        if not os.path.isfile(path):
            raise ObjectNotFound(key, self.url)
        return st.st_size

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        self._prune_empty_dirs(path.parent)

    def _prune_empty_dirs(self, directory: Path) -> None:
        """Remove now-empty parents so deleted versions leave no directories behind (best effort)."""
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent

    def list(self, prefix: str = "") -> list[str]:
        base = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(_RESERVED_PREFIX)]
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith(_RESERVED_PREFIX):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)


def open_store(url: str, **options: object) -> ObjectStore:
    """Open the store a URL names: `s3://bucket[/prefix]` or `file:///abs/path` (a bare path means file).

    Keyword options go to the implementation: for S3 the fields of `storage.s3.S3Options`
    (endpoint, region, credentials, concurrency, multipart sizes, retries, timeouts); for files
    `fsync`. Unknown options raise `TypeError` naming them, so a typo in config is not ignored.
    """
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        from storage.s3 import S3Options, S3Store  # boto3 is imported only when S3 is used

        if not parsed.netloc:
            raise ValueError(f"store url {url!r} has no bucket (expected s3://bucket/prefix)")
        return S3Store(parsed.netloc, parsed.path.strip("/"), S3Options(**options))  # type: ignore[arg-type]
    if parsed.scheme in ("file", ""):
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ValueError(f"store url {url!r}: file URLs must be file:///absolute/path")
        path = unquote(parsed.path) if parsed.scheme == "file" else url
        if not path:
            raise ValueError(f"store url {url!r} has no path")
        unknown = set(options) - {"fsync"}
        if unknown:
            raise TypeError(f"unknown options for a file store: {sorted(unknown)}")
        return FileStore(path, **options)  # type: ignore[arg-type]
    raise ValueError(f"store url {url!r}: unsupported scheme {parsed.scheme!r} (use s3:// or file://)")
