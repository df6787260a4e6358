"""The object store on a local (or shared POSIX) filesystem: `FileStore`, for single-machine runs and tests.

It keeps the contract of `storage/objectstore.py` with filesystem primitives only (see the class
docstring); `storage.stores.open_store` opens it for `file://` URLs and bare paths.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from storage.objectstore import RESERVED_PREFIX, ObjectNotFound, ObjectStore, PreconditionFailed, validate_key

__all__ = ["FileStore", "content_etag"]

_LOCK_DIR = RESERVED_PREFIX + "locks"
"""Per-key lock files of compare-and-swap writes (reserved, so never a key and never listed)."""


def content_etag(data: bytes) -> str:
    """The etag FileStore uses: a content hash, so equal bytes give equal etags on any machine."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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
            tmp = path.parent / f"{RESERVED_PREFIX}tmp-{uuid.uuid4().hex}"
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
    def _key_lock(self, key: str) -> Iterator[None]:
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
            dirnames[:] = [d for d in dirnames if not d.startswith(RESERVED_PREFIX)]
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith(RESERVED_PREFIX):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)
