"""What both sides of the weight store share: errors, tensor hashing, dtypes, the `LATEST` pointer, and
`RunWeights`, the base of the publisher and the subscriber (store, run, thread pool, close, `LATEST`).

Users import these from the facade `storage.weights`; `storage.publisher` and `storage.subscriber`
import them from here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from storage.delta_codec import tensor_bits
from storage.manifest import ManifestError, latest_key, validate_run
from storage.objectstore import ObjectNotFound, ObjectStore, PreconditionFailed
from storage.retention import scan_versions

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

MiB = 1024 * 1024
LATEST_CAS_ATTEMPTS = 50
"""Compare-and-swap attempts on `LATEST` before giving up (each loss means someone else moved it)."""
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class WeightStoreError(RuntimeError):
    """Base of the weight store's own errors."""


class VersionConflict(WeightStoreError):
    """Another publisher already published this version of the run; ours was discarded."""


class NoVersionError(WeightStoreError):
    """The run has no published version yet (no `LATEST`, no manifest)."""


class WeightPullError(WeightStoreError):
    """A pull failed after its retry and the full-snapshot fallback; the tensors are unchanged."""

    def __init__(self, message: str, *, version: int, part: str, tensor: str) -> None:
        super().__init__(message)
        self.version, self.part, self.tensor = version, part, tensor


class RunWeights:
    """What `WeightPublisher` and `WeightSubscriber` have alike: one run of one store, a thread pool for
    parallel transfers and hashing (released by `close` or the end of a ``with`` block), and the run's
    `LATEST`. Written once so that the two sides cannot drift apart in how they close or read it."""

    def __init__(self, store: ObjectStore, run: str, *, parallelism: int, thread_name_prefix: str) -> None:
        self.store, self.run = store, validate_run(run)
        self._pool = ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix=thread_name_prefix)

    def close(self) -> None:
        """Wait for the pool's running tasks and release its threads; the object is not used afterwards."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def latest_version(self) -> int | None:
        """The run's `LATEST` (None if nothing was published yet), e.g. the next version on resume is one past it."""
        return read_latest(self.store, self.run)


def tensor_hash(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's raw bits (the manifest's `hash`; hashlib releases the GIL while hashing)."""
    return hashlib.sha256(tensor_bits(tensor).data).hexdigest()


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """Flat zero-copy `uint8` view of a contiguous CPU tensor's bytes (any dtype `tensor_bits` accepts)."""
    return tensor_bits(tensor).view(np.uint8)


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"weights dtype {dtype} not supported; use one of {sorted(DTYPE_NAMES.values())}")
    return DTYPE_NAMES[dtype]


def read_latest(store: ObjectStore, run: str) -> int | None:
    try:
        data = store.get(latest_key(run))
    except ObjectNotFound:
        return None
    return parse_latest(data, latest_key(run))


def parse_latest(data: bytes, key: str) -> int:
    try:
        version = json.loads(data)["version"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"{key}: invalid LATEST pointer ({type(exc).__name__}: {exc})") from None
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ManifestError(f"{key}: invalid LATEST version {version!r}")
    return version


def advance_latest(store: ObjectStore, run: str, version: int, publish_id: str) -> None:
    """Move LATEST to `version` by compare-and-swap, unless it already points at or past it."""
    key = latest_key(run)
    body = json.dumps({"version": version, "publish_id": publish_id}).encode()
    for _ in range(LATEST_CAS_ATTEMPTS):
        try:
            data, etag = store.get_with_etag(key)
        except ObjectNotFound:
            data, etag = None, None
        if data is not None:
            try:
                if parse_latest(data, key) >= version:
                    return
            except ManifestError:
                log.warning("%s is unreadable; replacing it with version %d", key, version)
        try:
            if etag is None:
                store.put_if_absent(key, body)
            else:
                store.put_if_match(key, body, etag)
            return
        except PreconditionFailed:
            continue
    raise WeightStoreError(f"{key}: could not move to version {version} in {LATEST_CAS_ATTEMPTS} attempts")


def list_versions(store: ObjectStore, run: str) -> list[int]:
    """Versions of the run that exist (have a valid manifest), oldest first."""
    manifests, _ = scan_versions(store, validate_run(run), {})
    return sorted(manifests)
