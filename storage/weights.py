"""The weight version store: the trainer publishes every policy version, generators pull on their own schedule.

    trainer: publish(v, tensors)                              generator: pull(want)
      1. parts in parallel: safetensors shards (full)           1. plan: delta chain from `have`, or the
         or codec blobs vs v-1 (delta), keys carry publish_id      newest full snapshot + deltas after it,
      2. manifest.json, create-only  <- the version exists         whichever downloads fewer bytes
      3. LATEST by compare-and-swap, only ever forward          2. parts in parallel, each hash-checked
      4. retention (storage.retention)                          3. apply in place (undo log), verify every
                                                                   tensor's hash; commit or roll back

Failure behaviour:
- A publish killed before its manifest leaves only unreferenced parts: the version does not exist.
- Two publishers racing for one version: the create-only manifest write lets exactly one win; the
  other gets `VersionConflict` and deletes its own parts (its part keys differ by `publish_id`, so
  it never touched the winner's). The winner reads its manifest back and checks its `publish_id`,
  so even a store whose create-only write were not atomic could not hand both a success silently.
- Pull: a missing or corrupted part is fetched again once; a tensor whose hash is wrong after
  applying makes the whole version be fetched and applied again once; then the subscriber falls
  back to the newest full snapshot; then it raises `WeightPullError` naming version, part and tensor.
  In every failure the subscriber's tensors are left exactly as they were (in-place changes are
  rolled back from an undo log of the changed elements only, so memory stays O(changes)).
- Manifests of another run or model config, or that are truncated or invalid: `ManifestError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import safetensors.torch
import torch

from storage.delta_codec import apply_delta, encode_delta, tensor_bits
from storage.manifest import (
    DELTA_CODEC,
    FULL_CODEC,
    Manifest,
    ManifestError,
    PartSpec,
    TensorSpec,
    latest_key,
    manifest_key,
    part_key,
    validate_run,
)
from storage.objectstore import ObjectNotFound, ObjectStore, PreconditionFailed
from storage.retention import prune_versions, scan_versions

__all__ = [
    "NoVersionError",
    "PullPlan",
    "VersionConflict",
    "WeightPublisher",
    "WeightPullError",
    "WeightStoreError",
    "WeightSubscriber",
    "tensor_hash",
]

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

MiB = 1024 * 1024
SEGMENT_ELEMS = 1 << 24
"""Largest tensor slice coded as one delta blob: bounds per-thread scratch (32 MiB of bf16) and lets
one huge tensor (an embedding) spread over parts and threads."""
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


class _StepFailure(Exception):
    """One version could not be applied; `retry` says whether fetching it again could help."""

    def __init__(self, version: int, part: str, tensor: str, reason: str, *, retry: bool) -> None:
        super().__init__(f"version {version}, part {part!r}, tensor {tensor!r}: {reason}")
        self.version, self.part, self.tensor, self.retry = version, part, tensor, retry


def tensor_hash(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's raw bits (hardware-accelerated on current CPUs, ~1.5 GB/s a core)."""
    return hashlib.sha256(tensor_bits(tensor).data).hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"weights dtype {dtype} not supported; use one of {sorted(DTYPE_NAMES.values())}")
    return DTYPE_NAMES[dtype]


def _pack(items: list[tuple[str, int]], part_bytes: int) -> list[list[int]]:
    """Greedy, order-keeping grouping of sized items into parts of about `part_bytes`."""
    groups: list[list[int]] = []
    size = part_bytes
    for i, (_, nbytes) in enumerate(items):
        if size + nbytes > part_bytes and (not groups or groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return [g for g in groups if g]


class WeightPublisher:
    """Trainer side. Keeps the previous version (CPU, served dtype) to compute exact deltas.

    A publisher started fresh (or after a resume) has no previous version in memory, so its first
    publish is a full snapshot whose `parent_version` is the run's current `LATEST`.
    """

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        *,
        model_config_hash: str,
        dtype: torch.dtype = torch.bfloat16,
        full_every: int = 50,
        keep_versions: int = 10,
        grace_s: float = 120.0,
        part_bytes: int = 16 * MiB,
        parallelism: int = 4,
        prune: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if full_every < 1 or keep_versions < 1 or part_bytes < 1 or parallelism < 1 or grace_s < 0:
            raise ValueError("full_every, keep_versions, part_bytes and parallelism must be >= 1, grace_s >= 0")
        self.store, self.run = store, validate_run(run)
        self.model_config_hash, self.dtype = model_config_hash, dtype
        self.dtype_name = _dtype_name(dtype)
        self.full_every, self.keep_versions, self.grace_s = full_every, keep_versions, grace_s
        self.part_bytes, self.prune_after_publish, self.clock = part_bytes, prune, clock
        self._pool = ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="weights-pub")
        self._prev: dict[str, torch.Tensor] | None = None
        self._prev_version: int | None = None
        self._manifests: dict[int, Manifest] = {}

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def latest_version(self) -> int | None:
        """The run's `LATEST` (None if nothing was published), e.g. to choose the next version on resume."""
        return _read_latest(self.store, self.run)

    def publish(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> Manifest:
        """Publish `version`; returns its manifest once it exists and `LATEST` is at least `version`.

        Raises `VersionConflict` if the version already exists (another publisher, or a resumed
        trainer reusing a number: pick `latest_version() + 1` instead).
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        tensors = {
            name: t.detach().to(device="cpu", dtype=self.dtype, copy=True).contiguous()
            for name, t in named_tensors.items()
        }
        hashes = dict(zip(tensors, self._pool.map(tensor_hash, tensors.values()), strict=True))
        publish_id = uuid.uuid4().hex
        full = self._needs_full(version, tensors)
        parent = self._prev_version if self._prev_version is not None else self.latest_version()
        write = self._write_full if full else self._write_delta
        parts = write(version, tensors, publish_id)
        manifest = Manifest(
            run=self.run,
            version=version,
            kind="full" if full else "delta",
            base_version=None if full else self._prev_version,
            parent_version=parent if parent is not None and parent < version else None,
            anchor_version=version if full else self._manifests[self._prev_version].anchor_version,  # type: ignore[index]
            model_config_hash=self.model_config_hash,
            publish_id=publish_id,
            published_at=self.clock(),
            tensors=tuple(
                TensorSpec(name, self.dtype_name, tuple(t.shape), hashes[name]) for name, t in tensors.items()
            ),
            parts=tuple(parts),
            codec=FULL_CODEC if full else DELTA_CODEC,
        )
        self._commit_manifest(manifest)
        self._manifests[version] = manifest
        self._prev, self._prev_version = tensors, version
        _advance_latest(self.store, self.run, version, publish_id)
        if self.prune_after_publish:
            self._prune_quietly()
        return manifest

    def prune(self) -> list[int]:
        """Apply retention now (see `storage.retention`); returns the deleted versions."""
        latest = self.latest_version()
        if latest is None:
            return []
        deleted = prune_versions(
            self.store, self.run, latest=latest, keep_versions=self.keep_versions, grace_s=self.grace_s,
            now=self.clock(), known=self._manifests,
        )
        for version in deleted:
            self._manifests.pop(version, None)
        return deleted

    def _prune_quietly(self) -> None:
        try:
            self.prune()
        except Exception:  # a boundary we own: retention must not fail a publish that already happened
            log.exception("weights retention for run %s failed; will retry after the next publish", self.run)

    def _needs_full(self, version: int, tensors: dict[str, torch.Tensor]) -> bool:
        if version == 0 or version % self.full_every == 0 or self._prev is None:
            return True
        if self._prev_version != version - 1 or self._prev.keys() != tensors.keys():
            return True
        return any(self._prev[n].shape != t.shape for n, t in tensors.items())

    def _upload(self, keyed: list[tuple[str, bytes]]) -> None:
        """Upload parts in parallel; on failure delete what went up (best effort) and re-raise."""
        try:
            list(self._pool.map(lambda kv: self.store.put(*kv), keyed))
        except BaseException:
            self._discard([k for k, _ in keyed])
            raise

    def _discard(self, keys: list[str]) -> None:
        try:
            self.store.delete_many(keys)
        except Exception:  # the parts are unreferenced garbage; retention removes them later
            log.warning("could not delete %d unreferenced weight parts", len(keys), exc_info=True)

    def _write_full(self, version: int, tensors: dict[str, torch.Tensor], publish_id: str) -> list[PartSpec]:
        names = list(tensors)
        groups = _pack([(n, tensors[n].numel() * tensors[n].element_size()) for n in names], self.part_bytes)
        meta = {"run": self.run, "version": str(version), "publish_id": publish_id}

        def shard(index_group: tuple[int, list[int]]) -> tuple[PartSpec, bytes]:
            index, group = index_group
            data = safetensors.torch.save({names[i]: tensors[names[i]] for i in group}, metadata=meta)
            key = part_key(self.run, version, index, publish_id, "safetensors")
            spec = PartSpec(key, len(data), hashlib.sha256(data).hexdigest(), tuple(names[i] for i in group))
            return spec, data

        built = list(self._pool.map(shard, enumerate(groups)))
        self._upload([(spec.key, data) for spec, data in built])
        return [spec for spec, _ in built]

    def _write_delta(self, version: int, tensors: dict[str, torch.Tensor], publish_id: str) -> list[PartSpec]:
        assert self._prev is not None
        segments = [
            (name, start, min(start + SEGMENT_ELEMS, t.numel()))
            for name, t in tensors.items()
            for start in range(0, t.numel(), SEGMENT_ELEMS)
        ]

        def encode(segment: tuple[str, int, int]) -> bytes:
            name, start, end = segment
            old = tensor_bits(self._prev[name])[start:end]  # type: ignore[index]
            return encode_delta(old, tensor_bits(tensors[name])[start:end])

        blobs = list(self._pool.map(encode, segments))
        parts: list[PartSpec] = []
        keyed: list[tuple[str, bytes]] = []
        for index, group in enumerate(_pack([(s[0], len(b)) for s, b in zip(segments, blobs, strict=True)],
                                            self.part_bytes)):
            entries, offset = [], 0
            for i in group:
                name, start, end = segments[i]
                entries.append((name, start, end, offset, len(blobs[i])))
                offset += len(blobs[i])
            data = b"".join(blobs[i] for i in group)
            key = part_key(self.run, version, index, publish_id, "lwd")
            names = tuple(dict.fromkeys(e[0] for e in entries))
            parts.append(PartSpec(key, len(data), hashlib.sha256(data).hexdigest(), names, tuple(entries)))
            keyed.append((key, data))
        self._upload(keyed)
        return parts

    def _commit_manifest(self, manifest: Manifest) -> None:
        """Create-only manifest write, then read it back: our publish_id there means we won."""
        key = manifest_key(self.run, manifest.version)
        body = manifest.to_json()
        part_keys = [p.key for p in manifest.parts]
        try:
            self.store.put_if_absent(key, body)
            won = self.store.get(key) == body
        except PreconditionFailed:
            won = False
        except BaseException:
            self._discard(part_keys)
            raise
        if not won:
            self._discard(part_keys)
            raise VersionConflict(
                f"version {manifest.version} of run {self.run!r} was already published by another publisher "
                f"(our publish_id {manifest.publish_id} lost; its parts were deleted)"
            )


def _read_latest(store: ObjectStore, run: str) -> int | None:
    try:
        data = store.get(latest_key(run))
    except ObjectNotFound:
        return None
    return _parse_latest(data, latest_key(run))


def _parse_latest(data: bytes, key: str) -> int:
    try:
        version = json.loads(data)["version"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"{key}: invalid LATEST pointer ({type(exc).__name__}: {exc})") from None
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ManifestError(f"{key}: invalid LATEST version {version!r}")
    return version


def _advance_latest(store: ObjectStore, run: str, version: int, publish_id: str) -> None:
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
                if _parse_latest(data, key) >= version:
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


@dataclass(frozen=True)
class PullPlan:
    """Versions to apply, in order, to go from `have` to `want`; the first is a full snapshot if `from_full`."""

    have: int | None
    want: int
    versions: tuple[int, ...]
    from_full: bool
    num_bytes: int


_Undo = list[tuple[str, int, np.ndarray, np.ndarray]]  # tensor, segment start, changed positions, old bits


class WeightSubscriber:
    """Generator side. Holds `tensors` (CPU, served dtype) at `version` and pulls newer versions into them.

    `pull` changes the tensors in place (the dict and its tensor objects stay the same), so callers
    must not read them while a pull runs; a generator pulls between decode steps or rollouts.
    `model_config_hash` None pins the hash of the first manifest read.
    """

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        *,
        model_config_hash: str | None = None,
        parallelism: int = 4,
        tensors: dict[str, torch.Tensor] | None = None,
        version: int | None = None,
    ) -> None:
        if (tensors is None) != (version is None):
            raise ValueError("give both tensors and the version they hold, or neither")
        self.store, self.run = store, validate_run(run)
        self.model_config_hash = model_config_hash
        self.tensors: dict[str, torch.Tensor] = tensors if tensors is not None else {}
        self.version = version
        self._hashes: dict[str, str] | None = None  # verified hashes of `tensors`, None until checked
        self._manifests: dict[int, Manifest] = {}
        self._pool = ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="weights-sub")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def latest(self) -> int | None:
        """The run's newest published version per `LATEST`, or None if nothing was published."""
        return _read_latest(self.store, self.run)

    def manifest(self, version: int) -> Manifest:
        """The checked manifest of `version`; `ManifestError` if missing, invalid, or of another run/model."""
        if version in self._manifests:
            return self._manifests[version]
        key = manifest_key(self.run, version)
        try:
            data = self.store.get(key)
        except ObjectNotFound:
            raise ManifestError(f"{key}: version {version} of run {self.run!r} does not exist") from None
        m = Manifest.from_json(data, key=key)
        if m.run != self.run or m.version != version:
            raise ManifestError(f"{key}: manifest is for run {m.run!r} version {m.version}, not {self.run!r} {version}")
        if self.model_config_hash is None:
            self.model_config_hash = m.model_config_hash
        if m.model_config_hash != self.model_config_hash:
            raise ManifestError(
                f"{key}: model config hash {m.model_config_hash[:12]}... differs from ours "
                f"{self.model_config_hash[:12]}...; refusing another model's weights"
            )
        self._manifests[version] = m
        return m

    def plan(self, have: int | None, want: int) -> PullPlan:
        """The delta chain from `have`, or the newest full snapshot at or below `want` plus the deltas after
        it, whichever downloads fewer bytes. Follows `base_version` links back from `want`."""
        chain: list[Manifest] = [self.manifest(want)]
        delta_path: PullPlan | None = None
        while True:
            m = chain[-1]
            if have is not None and m.version == have:
                versions = tuple(c.version for c in reversed(chain[:-1]))
                delta_path = PullPlan(have, want, versions, False, sum(c.num_bytes for c in chain[:-1]))
            if m.kind == "full":
                break
            chain.append(self.manifest(m.base_version))  # type: ignore[arg-type]
        full_path = PullPlan(have, want, tuple(c.version for c in reversed(chain)), True, sum(c.num_bytes for c in chain))
        if delta_path is not None and delta_path.num_bytes <= full_path.num_bytes:
            return delta_path
        return full_path

    def pull(self, want: int | None = None) -> int:
        """Bring `tensors` to `want` (default: LATEST); returns the version now held. See the module docstring."""
        if want is None:
            want = self.latest()
            if want is None:
                raise NoVersionError(f"run {self.run!r} has no published weights version")
        if want == self.version:
            return want
        have = self.version if self._held_tensors_verified() else None
        plan = self.plan(have, want)
        try:
            self._execute(plan)
        except _StepFailure as first:
            if plan.from_full:
                raise self._pull_error(want, first, None) from None
            log.warning("pull of version %d failed (%s); falling back to the newest full snapshot", want, first)
            try:
                self._execute(self.plan(None, want))
            except _StepFailure as second:
                raise self._pull_error(want, second, first) from None
        self.version = want
        return want

    def _pull_error(self, want: int, failure: _StepFailure, earlier: _StepFailure | None) -> WeightPullError:
        before = f" (the delta chain failed first: {earlier})" if earlier else ""
        held = f"version {self.version}" if self.version is not None else "no version"
        return WeightPullError(
            f"run {self.run!r}: pulling version {want} failed at {failure}{before}; tensors unchanged, still {held}",
            version=failure.version, part=failure.part, tensor=failure.tensor,
        )

    def _held_tensors_verified(self) -> bool:
        """Tensors handed in at construction are hashed once against their version's manifest."""
        if self.version is None:
            return False
        if self._hashes is None:
            expected = {t.name: t.hash for t in self.manifest(self.version).tensors}
            hashes = dict(zip(self.tensors, self._pool.map(tensor_hash, self.tensors.values()), strict=True))
            if hashes != expected:
                log.warning("held tensors do not match version %d's hashes; pulling a full snapshot", self.version)
                return False
            self._hashes = hashes
        return True

    def _execute(self, plan: PullPlan) -> None:
        manifests = [self.manifest(v) for v in plan.versions]
        if plan.from_full:
            staged, hashes = self._load_full(manifests[0])
            for m in manifests[1:]:
                self._apply_version(m, staged, hashes, None)
            self._commit_full(staged)
            self._hashes = hashes
            return
        undo: _Undo = []
        hashes = dict(self._hashes or {})
        try:
            for m in manifests:
                self._apply_version(m, self.tensors, hashes, undo)
        except BaseException:
            _rollback(self.tensors, undo)
            raise
        self._hashes = hashes

    def _commit_full(self, staged: dict[str, torch.Tensor]) -> None:
        """Copy into the held tensors when names, shapes and dtypes match (engines keep their references)."""
        same = staged.keys() == self.tensors.keys() and all(
            self.tensors[n].shape == t.shape and self.tensors[n].dtype == t.dtype for n, t in staged.items()
        )
        if same:
            for name, tensor in staged.items():
                self.tensors[name].copy_(tensor)
        else:
            self.tensors.clear()
            self.tensors.update(staged)

    def _fetch_part(self, m: Manifest, part: PartSpec) -> bytes:
        """The part's bytes, checked against the manifest's size and hash; fetched again once if wrong."""
        reason = ""
        for _ in range(2):
            try:
                data = self.store.get(part.key)
            except ObjectNotFound:
                reason = "part is missing"
                continue
            if len(data) == part.num_bytes and hashlib.sha256(data).hexdigest() == part.hash:
                return data
            reason = f"part hash mismatch ({len(data)} bytes, manifest says {part.num_bytes})"
        raise _StepFailure(m.version, part.key, part.tensors[0] if part.tensors else "", reason, retry=False)

    def _load_full(self, m: Manifest) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        specs = m.tensor_map()

        def load(part: PartSpec) -> dict[str, torch.Tensor]:
            data = self._fetch_part(m, part)
            try:
                loaded = safetensors.torch.load(data)
            except Exception as exc:  # safetensors raises its own error type for any malformed shard
                raise _StepFailure(m.version, part.key, part.tensors[0], f"bad safetensors: {exc}", retry=False) from exc
            if set(loaded) != set(part.tensors):
                raise _StepFailure(m.version, part.key, part.tensors[0], "shard tensors differ from manifest", retry=False)
            for name, t in loaded.items():
                spec = specs[name]
                if tuple(t.shape) != spec.shape or DTYPE_NAMES.get(t.dtype) != spec.dtype:
                    raise _StepFailure(m.version, part.key, name, "shape or dtype differs from manifest", retry=False)
            return loaded

        staged: dict[str, torch.Tensor] = {}
        for loaded in self._pool.map(load, m.parts):
            staged.update(loaded)
        staged = {t.name: staged[t.name] for t in m.tensors}  # manifest order
        hashes = dict(zip(staged, self._pool.map(tensor_hash, staged.values()), strict=True))
        part_of = {n: p.key for p in m.parts for n in p.tensors}
        for name, spec in specs.items():
            if hashes[name] != spec.hash:
                raise _StepFailure(m.version, part_of[name], name, "tensor hash mismatch", retry=False)
        return staged, hashes

    def _apply_version(
        self, m: Manifest, tensors: dict[str, torch.Tensor], hashes: dict[str, str], undo: _Undo | None
    ) -> None:
        """Apply one delta version (fetched again once if a tensor hash is wrong afterwards)."""
        specs = m.tensor_map()
        for name, spec in specs.items():
            t = tensors.get(name)
            if t is None or tuple(t.shape) != spec.shape or DTYPE_NAMES.get(t.dtype) != spec.dtype:
                raise _StepFailure(m.version, "", name, "held tensor missing or of another shape/dtype", retry=False)
        if tensors.keys() != specs.keys():
            extra = sorted(tensors.keys() - specs.keys())[0]
            raise _StepFailure(m.version, "", extra, "held tensor not in this version", retry=False)
        for attempt in range(2):
            mine: _Undo = []
            try:
                self._apply_parts(m, tensors, hashes, mine)
            except _StepFailure as failure:
                _rollback(tensors, mine)
                if not failure.retry or attempt == 1:
                    raise
                log.warning("version %d: %s; fetching it again", m.version, failure)
                continue
            if undo is not None:
                undo.extend(mine)
            return

    def _apply_parts(self, m: Manifest, tensors: dict[str, torch.Tensor], hashes: dict[str, str], undo: _Undo) -> None:
        blobs = list(self._pool.map(lambda p: self._fetch_part(m, p), m.parts))
        jobs = [(p.key, e, blob) for p, blob in zip(m.parts, blobs, strict=True) for e in p.entries]

        def apply(job: tuple[str, tuple[str, int, int, int, int], bytes]) -> tuple[str, int, np.ndarray, np.ndarray]:
            key, (name, start, end, offset, length), blob = job
            target = tensor_bits(tensors[name])[start:end]
            before = target.copy()
            try:
                apply_delta(target, memoryview(blob)[offset : offset + length])
            except ValueError as exc:
                raise _StepFailure(m.version, key, name, f"delta rejected: {exc}", retry=False) from None
            changed = np.flatnonzero(target != before)
            return name, start, changed, before[changed]

        futures = [self._pool.submit(apply, job) for job in jobs]
        failure: _StepFailure | None = None
        for future in futures:  # collect every undo record, even after a failure, before raising
            try:
                undo.append(future.result())
            except _StepFailure as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        touched = list(dict.fromkeys(name for _, (name, *_), _ in jobs))
        for name, digest in zip(touched, self._pool.map(lambda n: tensor_hash(tensors[n]), touched), strict=True):
            hashes[name] = digest
        part_of = {name: key for key, (name, *_), _ in jobs}
        for spec in m.tensors:
            if hashes.get(spec.name) != spec.hash:
                part = part_of.get(spec.name, "")
                raise _StepFailure(m.version, part, spec.name, "tensor hash mismatch after applying", retry=True)


def _rollback(tensors: dict[str, torch.Tensor], undo: _Undo) -> None:
    """Restore the changed elements, newest change first."""
    while undo:
        name, start, changed, old = undo.pop()
        tensor_bits(tensors[name])[start + changed] = old


def list_versions(store: ObjectStore, run: str) -> list[int]:
    """Versions of the run that exist (have a valid manifest), oldest first."""
    manifests, _ = scan_versions(store, validate_run(run), {})
    return sorted(manifests)
