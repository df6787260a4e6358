"""Open the object store a URL names: the one place that knows every `ObjectStore` implementation.

    s3://bucket[/prefix]   -> storage.s3.S3Store          (imported on first use: boto3 is heavy)
    file:///abs/path       -> storage.filestore.FileStore (a bare path means a file store too)

The interface (`storage/objectstore.py`) names no implementation, so that code using a store never
imports boto3 or the filesystem store.
"""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from storage.filestore import FileStore
from storage.objectstore import ObjectStore

__all__ = ["open_store"]


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
