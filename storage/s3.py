"""The object store on S3 (AWS, SeaweedFS, MinIO) through boto3.

- Small objects: one PUT / one GET. Objects of at least `multipart_threshold_bytes` upload as a
  multipart upload whose parts go up in parallel, and download as parallel ranged GETs pinned to
  the first response's etag (`If-Match`), so an object replaced mid-download fails instead of
  returning a mix of two versions.
- Retries: botocore's "standard" mode retries 5xx, throttling, connection errors and timeouts with
  exponential backoff, `max_retries` times.
- Conditional writes use S3's own preconditions: `If-None-Match: *` (create-only) and
  `If-Match: <etag>` (compare-and-swap), answered 412 when they fail. They are retried by our own
  loop, not botocore's, because a retried conditional PUT whose first attempt did land (only the
  response was lost) also gets 412. So a 412 after an ambiguous attempt (timeout, dropped
  connection, 5xx) makes the store read the object back: if it holds exactly our bytes, the write is
  reported as done, not as a lost race. A 412 with no ambiguous attempt before it is a lost race.
  A 409 `ConditionalRequestConflict` (AWS: another conditional write to the key is in flight) and
  429/5xx are retried with backoff. Conditional writes are single PUTs (manifests, `LATEST`).
- Credentials come from the options or the standard AWS chain (environment, profile, instance role);
  they are never logged and are excluded from `repr`.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from storage.objectstore import ObjectNotFound, ObjectStore, PreconditionFailed, validate_key

__all__ = ["S3Options", "S3Store"]

log = logging.getLogger(__name__)

MiB = 1024 * 1024
_S3_MIN_PART_BYTES = 5 * MiB  # S3 rejects smaller non-final multipart parts
_CONFLICT_RETRIES = 8
"""Conditional writes are tried at least this many times more on 409 ConditionalRequestConflict."""
_BACKOFF_S = 0.05
"""First backoff of our own conditional-write retries, doubled each attempt, with jitter."""
_MAX_BACKOFF_S = 5.0
# Failures where the request never reached the server, and where it may have (the response was lost).
_NEVER_SENT = (EndpointConnectionError, ConnectTimeoutError)
_AMBIGUOUS = (ReadTimeoutError, ConnectionClosedError, BotoConnectionError)
_DELETE_BATCH = 1000  # S3 DeleteObjects limit


@dataclass(frozen=True)
class S3Options:
    """How to reach the bucket. Field names match `pipeline.config.StoreConfig` one to one.

    None for endpoint, region or credentials means "from the standard AWS environment"
    (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, ~/.aws, instance role).
    """

    endpoint: str | None = None
    """S3 endpoint URL (SeaweedFS/MinIO); a custom endpoint also switches to path-style addressing."""
    region: str | None = None
    max_concurrency: int = 8
    """Parallel part uploads / ranged GETs of one large object (and the HTTP connection pool)."""
    multipart_threshold_bytes: int = 64 * MiB
    part_size_bytes: int = 16 * MiB
    max_retries: int = 5
    """Retries with backoff on 5xx, throttling, connection errors and timeouts (botocore standard mode)."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"S3Options.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.part_size_bytes < _S3_MIN_PART_BYTES:
            raise ValueError(f"S3Options.part_size_bytes must be >= 5 MiB, got {self.part_size_bytes}")
        if self.multipart_threshold_bytes < self.part_size_bytes:
            raise ValueError("S3Options.multipart_threshold_bytes must be >= part_size_bytes")
        if self.max_retries < 0:
            raise ValueError(f"S3Options.max_retries must be >= 0, got {self.max_retries}")


def _error_code(exc: ClientError) -> tuple[str, int]:
    err = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(err.get("Code", "")), int(status or 0)


def _is_not_found(exc: ClientError) -> bool:
    code, status = _error_code(exc)
    return status == 404 or code in ("NoSuchKey", "404", "NotFound")


def _is_precondition(exc: ClientError) -> bool:
    code, status = _error_code(exc)
    return status == 412 or code == "PreconditionFailed"


def _is_conflict(exc: ClientError) -> bool:
    code, status = _error_code(exc)
    return status == 409 and code in ("ConditionalRequestConflict", "OperationAborted", "409")


class S3Store(ObjectStore):
    """`ObjectStore` over one bucket and key prefix. Thread-safe (boto3 clients are)."""

    def __init__(self, bucket: str, prefix: str = "", options: S3Options | None = None) -> None:
        self.options = options or S3Options()
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        opts = self.options
        session = boto3.session.Session(
            aws_access_key_id=opts.access_key_id,
            aws_secret_access_key=opts.secret_access_key,
            aws_session_token=opts.session_token,
            region_name=opts.region,
        )
        config = Config(
            retries={"max_attempts": opts.max_retries + 1, "mode": "standard"},
            connect_timeout=opts.connect_timeout_s,
            read_timeout=opts.read_timeout_s,
            max_pool_connections=max(10, 2 * opts.max_concurrency),
            s3={"addressing_style": "path" if opts.endpoint else "auto"},
            # Checksums only when an operation requires them: SeaweedFS and older gateways reject
            # the aws-chunked trailers newer botocore sends by default.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client = session.client("s3", endpoint_url=opts.endpoint, config=config)
        # Conditional writes retry in `_conditional_put`, which must see every failed attempt: one attempt in
        # all (botocore's `max_attempts` counts retries, so `max_attempts: 1` would retry once out of our sight).
        once = config.merge(Config(retries={"total_max_attempts": 1, "mode": "standard"}))
        self._once_client = session.client("s3", endpoint_url=opts.endpoint, config=once)
        self._pool = ThreadPoolExecutor(max_workers=opts.max_concurrency, thread_name_prefix="s3-transfer")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()
        self._once_client.close()

    def _key(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # ---- writes -------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> str:
        full = self._key(key)
        if len(data) >= self.options.multipart_threshold_bytes:
            return self._put_multipart(full, data)
        return self._client.put_object(Bucket=self.bucket, Key=full, Body=data)["ETag"]

    def _put_multipart(self, full_key: str, data: bytes) -> str:
        """Upload parts in parallel; abort the upload on any failure so no parts are left billed."""
        part = self.options.part_size_bytes
        upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=full_key)["UploadId"]
        view = memoryview(data)

        def upload(index: int) -> dict[str, Any]:
            body = view[index * part : (index + 1) * part].tobytes()
            resp = self._client.upload_part(
                Bucket=self.bucket, Key=full_key, UploadId=upload_id, PartNumber=index + 1, Body=body
            )
            return {"PartNumber": index + 1, "ETag": resp["ETag"]}

        num_parts = (len(data) + part - 1) // part
        try:
            parts = list(self._pool.map(upload, range(num_parts)))
            resp = self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=full_key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=full_key, UploadId=upload_id)
            except ClientError:
                log.warning("could not abort multipart upload of %s", full_key, exc_info=True)
            raise
        return resp["ETag"]

    def _conditional_put(self, key: str, data: bytes, **condition: str) -> str:
        """A conditional PUT with our own retries (the client for it has botocore's turned off).

        We must know whether an earlier attempt may have landed: only then does a 412 get the
        read-back check; a 412 on a first attempt, or after attempts that certainly did not reach
        the server, is always a lost race.
        """
        full = self._key(key)
        delay = _BACKOFF_S
        maybe_landed = False
        attempts = max(self.options.max_retries, _CONFLICT_RETRIES) + 1
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                return self._once_client.put_object(Bucket=self.bucket, Key=full, Body=data, **condition)["ETag"]
            except ClientError as exc:
                if _is_precondition(exc) or (_is_not_found(exc) and "IfMatch" in condition):
                    landed = self._already_holds(key, data) if maybe_landed else None
                    if landed is not None:
                        return landed
                    reason = "object already exists" if "IfNoneMatch" in condition else "etag changed or object missing"
                    raise PreconditionFailed(key, reason) from None
                _, status = _error_code(exc)
                if last or not (_is_conflict(exc) or status == 429 or status >= 500):
                    raise
                maybe_landed = maybe_landed or status >= 500
            except _NEVER_SENT as exc:
                if last:
                    raise
                log.debug("conditional PUT of %s could not connect (%s); retrying", full, type(exc).__name__)
            except _AMBIGUOUS as exc:
                if last:
                    raise
                maybe_landed = True
                log.debug("conditional PUT of %s failed ambiguously (%s); retrying", full, type(exc).__name__)
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, _MAX_BACKOFF_S)
        raise AssertionError("unreachable")

    def _already_holds(self, key: str, data: bytes) -> str | None:
        """The etag if the object now holds exactly `data` (our retried write had landed), else None."""
        try:
            current, etag = self.get_with_etag(key)
        except ObjectNotFound:
            return None
        return etag if current == data else None

    def put_if_absent(self, key: str, data: bytes) -> str:
        return self._conditional_put(key, data, IfNoneMatch="*")

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        return self._conditional_put(key, data, IfMatch=etag)

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_many(self, keys: Any) -> None:
        full = [self._key(k) for k in keys]
        for i in range(0, len(full), _DELETE_BATCH):
            batch = [{"Key": k} for k in full[i : i + _DELETE_BATCH]]
            resp = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise OSError(f"S3 delete of {len(errors)} keys failed, first {first.get('Key')}: {first.get('Code')}")

    # ---- reads --------------------------------------------------------------------------------

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """First chunk by a ranged GET; if the object is larger, the rest by parallel ranged GETs."""
        full = self._key(key)
        chunk = self.options.part_size_bytes
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes=0-{chunk - 1}")
        except ClientError as exc:
            if _is_not_found(exc):
                raise ObjectNotFound(key, self.url) from None
            code, status = _error_code(exc)
            if status == 416 or code == "InvalidRange":  # empty object: no byte 0 to range over
                return self._get_whole(key, full)
            raise
        etag = resp["ETag"]
        first = resp["Body"].read()
        total = _total_size(resp.get("ContentRange"), len(first))
        if total <= len(first):
            return first, etag
        starts = range(len(first), total, chunk)
        rest = self._pool.map(lambda s: self._range(key, full, s, min(s + chunk, total), etag), starts)
        return b"".join([first, *rest]), etag

    def _get_whole(self, key: str, full: str) -> tuple[bytes, str]:
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
        except ClientError as exc:
            if _is_not_found(exc):
                raise ObjectNotFound(key, self.url) from None
            raise
        return resp["Body"].read(), resp["ETag"]

    def _range(self, key: str, full: str, start: int, end: int, etag: str | None = None) -> bytes:
        extra = {"IfMatch": etag} if etag else {}
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end - 1}", **extra)
        except ClientError as exc:
            if _is_not_found(exc):
                raise ObjectNotFound(key, self.url) from None
            if _is_precondition(exc):
                raise PreconditionFailed(key, "object was replaced during a ranged download") from None
            code, status = _error_code(exc)
            if status == 416 or code == "InvalidRange":
                return b""
            raise
        return resp["Body"].read()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end}) for {key!r}")
        if end == start:
            self.size(key)  # still raise ObjectNotFound for a missing key
            return b""
        return self._range(key, self._key(key), start, end)

    def size(self, key: str) -> int:
        try:
            return int(self._client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except ClientError as exc:
            if _is_not_found(exc):
                raise ObjectNotFound(key, self.url) from None
            raise

    def list(self, prefix: str = "") -> list[str]:
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full_prefix):
            keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
        return sorted(keys)


def _total_size(content_range: str | None, fallback: int) -> int:
    """Total object size from a `Content-Range: bytes 0-99/1234` header (fallback: what we read)."""
    if not content_range or "/" not in content_range:
        return fallback
    total = content_range.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else fallback
