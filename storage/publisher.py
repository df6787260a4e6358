"""Trainer side of the weight store: `WeightPublisher` (see `storage.weights` for the protocol).

One publish reads the trainer's tensors once, in one pass per tensor that, segment by segment,
encodes the delta against the previous version, feeds the tensor's sha256 and copies the segment
into the buffer that becomes the next publish's base. Buffers are reused between publishes (the
previous version's, and a spare that held the one before), so a delta publish allocates nothing
large and touches no fresh pages; tensors the publisher had to convert (another device or dtype,
not contiguous) are already private copies and are kept as they are.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch

from storage.delta_codec import CHUNK_ELEMS, encode_delta, tensor_bits
from storage.manifest import (
    DELTA_CODEC,
    FULL_CODEC,
    Manifest,
    PartSpec,
    TensorSpec,
    manifest_key,
    part_key,
)
from storage.objectstore import ObjectStore, PreconditionFailed
from storage.retention import prune_versions
from storage.weights_base import MiB, RunWeights, VersionConflict, advance_latest, byte_view, dtype_name

__all__ = ["SEGMENT_ELEMS", "StagedParts", "WeightPublisher"]

log = logging.getLogger(__name__)

SEGMENT_ELEMS = CHUNK_ELEMS
"""Largest tensor slice coded as one delta blob (one codec chunk, 8 MiB of bf16): the slice is encoded,
hashed and copied while it is still in cache, and one huge tensor spreads over several parts."""


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


def _segments(numel: int) -> list[tuple[int, int]]:
    return [(start, min(start + SEGMENT_ELEMS, numel)) for start in range(0, numel, SEGMENT_ELEMS)]


def _stage_tensor(src: torch.Tensor, dst: torch.Tensor, base: torch.Tensor | None) -> tuple[str, list[bytes]]:
    """One pass over `src`: per segment, the delta blob against `base` (if given), then sha256 and the
    copy into `dst` (skipped when `dst` is `src`). Returns the tensor's sha256 and the blobs."""
    src_bits, dst_bits = tensor_bits(src), tensor_bits(dst)
    src_bytes = byte_view(src)
    width = src.element_size()
    digest = hashlib.sha256()
    blobs: list[bytes] = []
    for start, end in _segments(src_bits.size):
        if base is not None:
            blobs.append(encode_delta(tensor_bits(base)[start:end], src_bits[start:end]))
        digest.update(src_bytes[start * width : end * width].data)
        if dst is not src:
            dst_bits[start:end] = src_bits[start:end]
    return digest.hexdigest(), blobs


@dataclass(frozen=True)
class StagedParts:
    """One publisher's stored, uncommitted share of a version: its tensors' specs and parts.

    In a sharded publish every trainer rank writes the tensors it owns; rank 0 commits one manifest
    naming every rank's parts (`WeightPublisher.commit`), then each rank `adopt`s its share (the base
    of its next delta), or `discard`s it if the commit failed.
    """

    version: int
    publish_id: str
    full: bool
    tensors: tuple[TensorSpec, ...]
    parts: tuple[PartSpec, ...]
    buffers: Mapping[str, torch.Tensor]


class WeightPublisher(RunWeights):
    """Trainer side. Keeps the previous version (CPU, served dtype) to compute exact deltas.

    A publisher started fresh (or after a resume) has no previous version in memory, so its first
    publish is a full snapshot whose `parent_version` is the run's current `LATEST`.
    Memory: two CPU copies of the weights in the served dtype (the previous version and a spare
    buffer reused for the next one), the same peak as copying each version afresh.
    `publish` reads the given tensors without copying them first, so the caller must not change them
    until it returns (a trainer publishes between optimizer steps).
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
        super().__init__(store, run, parallelism=parallelism, thread_name_prefix="weights-pub")
        self.model_config_hash, self.dtype = model_config_hash, dtype
        self.dtype_name = dtype_name(dtype)
        self.full_every, self.keep_versions, self.grace_s = full_every, keep_versions, grace_s
        self.part_bytes, self.prune_after_publish, self.clock = part_bytes, prune, clock
        # Retention lists and deletes a few objects; every keep_versions/2 versions keeps at most 1.5x
        # keep_versions stored at half the requests (it was a third of a tiny model's publish time).
        self.prune_every = max(1, keep_versions // 2)
        self._prev: dict[str, torch.Tensor] | None = None
        self._spare: dict[str, torch.Tensor] = {}
        self._prev_version: int | None = None
        self._manifests: dict[int, Manifest] = {}
        # A share whose manifest write (or its read-back) failed ambiguously, with the manifest it tried:
        # that manifest may exist, so its parts are kept until `resolve_held`/`settle` knows.
        self._held: tuple[StagedParts, Manifest | None] | None = None
        # The version this publisher committed whose `LATEST` advance has not succeeded yet.
        self._unadvanced: Manifest | None = None
        self.holder: dict[str, Any] | None = None
        """Who publishes (the trainer's run lease holder token, `actors/trainer/run_lease.py`): every manifest
        this publisher commits names it (`Manifest.holder`)."""

    def publish(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> Manifest:
        """Publish `version`; returns its manifest once it exists and `LATEST` is at least `version`.

        Raises `VersionConflict` if the version already exists (another publisher, or a resumed
        trainer reusing a number: pick `latest_version() + 1` instead). On any failure the publisher
        still holds the previous version, so publishing again can send a delta.

        Retrying a failed publish of the same version (with the same tensors) is idempotent: a version
        this publisher already committed is not written again, only its `LATEST` advance is retried; a
        commit whose outcome is unknown (the manifest write or its read-back failed) is resolved first
        with the same manifest and parts (`resolve_held`), so the retry never loses to its own
        manifest and never deletes parts a committed manifest names.
        """
        done = self.unadvanced(version)
        if done is None and self._held is not None:
            landed = self.resolve_held()
            done = landed if landed is not None and landed.version == version else None
        if done is None:
            full = self.needs_full(version, {n: tuple(t.shape) for n, t in named_tensors.items()})
            staged = self.write_parts(version, named_tensors, publish_id=uuid.uuid4().hex, full=full)
            done = self.commit(staged, [staged])
            self.adopt(staged)
        self.advance(done)
        return done

    # ---- the steps of a publish, also driven one by one by a sharded publish (one publisher per rank)

    def needs_full(self, version: int, shapes: Mapping[str, tuple[int, ...]]) -> bool:
        """Whether `version` of these tensors must be a full snapshot (ranks of a sharded publish OR theirs)."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if version == 0 or version % self.full_every == 0 or self._prev is None:
            return True
        if self._prev_version != version - 1 or self._prev.keys() != shapes.keys():
            return True
        return any(tuple(self._prev[n].shape) != shape for n, shape in shapes.items())

    def write_parts(
        self,
        version: int,
        named_tensors: Mapping[str, torch.Tensor],
        *,
        publish_id: str,
        full: bool,
        shard: int | None = None,
    ) -> StagedParts:
        """Encode and store the parts of these tensors (all of them, or one rank's share); nothing is
        committed. `adopt` the result after the manifest is committed, or `discard` it."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if not full and self._prev is None:
            raise ValueError(f"version {version}: a delta needs a previous version in this publisher")
        sources = {name: self._source(t) for name, t in named_tensors.items()}
        staged = {name: src if owned else self._buffer(name, src) for name, (src, owned) in sources.items()}
        base = None if full else self._prev
        names = list(sources)

        def stage(name: str) -> tuple[str, list[bytes]]:
            return _stage_tensor(sources[name][0], staged[name], None if base is None else base[name])

        results = dict(zip(names, self._pool.map(stage, names), strict=True))
        if full:
            parts = self._write_full(version, staged, publish_id, shard)
        else:
            parts = self._write_delta(version, staged, {n: r[1] for n, r in results.items()}, publish_id, shard)
        specs = tuple(TensorSpec(name, self.dtype_name, tuple(t.shape), results[name][0]) for name, t in staged.items())
        return StagedParts(version, publish_id, full, specs, tuple(parts), staged)

    def commit(self, mine: StagedParts, every: Sequence[StagedParts]) -> Manifest:
        """Write the one manifest naming the parts of `every` rank (create-only); `mine` is this
        publisher's share, whose bookkeeping (base, anchor) the manifest takes. Raises `VersionConflict`."""
        version, full = mine.version, mine.full
        parent = self._prev_version if self._prev_version is not None else self.latest_version()
        if not full and self._prev_version not in self._manifests:
            raise ValueError(f"version {version}: a delta's base {self._prev_version} was not committed here")
        manifest = Manifest(
            run=self.run,
            version=version,
            kind="full" if full else "delta",
            base_version=None if full else self._prev_version,
            parent_version=parent if parent is not None and parent < version else None,
            anchor_version=version if full else self._manifests[self._prev_version].anchor_version,  # type: ignore[index]
            model_config_hash=self.model_config_hash,
            publish_id=mine.publish_id,
            published_at=self.clock(),
            holder=self.holder,
            tensors=tuple(t for s in every for t in s.tensors),
            parts=tuple(p for s in every for p in s.parts),
            codec=FULL_CODEC if full else DELTA_CODEC,
        )
        try:
            self._commit_manifest(manifest)
        except VersionConflict:
            raise
        except BaseException:
            self._held = (mine, manifest)  # it may have landed: keep every part until resolved
            raise
        self._committed(manifest)
        return manifest

    def unadvanced(self, version: int) -> Manifest | None:
        """`version`'s manifest if this publisher committed it and `LATEST` has not been advanced to it yet."""
        pending = self._unadvanced
        return pending if pending is not None and pending.version == version else None

    @property
    def held(self) -> StagedParts | None:
        """This publisher's share of a version whose commit outcome is unknown (parts kept), if any."""
        return None if self._held is None else self._held[0]

    def hold(self, staged: StagedParts) -> None:
        """Another rank's commit of this share failed ambiguously: keep its parts until `settle`."""
        self._held = (staged, None)

    def resolve_held(self) -> Manifest | None:
        """Finish the commit of the held share (the committing publisher: alone, or rank 0).

        Writes the same manifest create-only again and reads it back: the identical bytes there mean the
        version is ours (the earlier attempt or this one landed), so the share is adopted and the
        manifest returned; another publisher's manifest there means the version is not ours, so the
        share's parts are deleted and None returned. Raises (still holding) if the store fails again."""
        assert self._held is not None and self._held[1] is not None, "resolve_held needs a held commit"
        staged, manifest = self._held
        key, body = manifest_key(self.run, manifest.version), manifest.to_json()
        try:
            self.store.put_if_absent(key, body)
        except PreconditionFailed:
            pass  # a manifest is there; whose it is, the read-back says
        ours = self.store.get(key) == body
        log.info(
            "version %d of run %s: the commit whose outcome was unknown %s",
            manifest.version,
            self.run,
            "is ours; adopting it" if ours else "lost to another publisher; deleting our parts",
        )
        self.settle(ours, [p.key for p in manifest.parts])
        if not ours:
            return None
        self._committed(manifest)
        return manifest

    def settle(self, committed: bool, part_keys: Sequence[str] | None = None) -> None:
        """The held share's commit is decided: adopt it, or delete its parts (`part_keys`, default its own)."""
        if self._held is None:  # (a rank whose share failed to store holds nothing: its parts are gone)
            return
        staged, _ = self._held
        self._held = None
        if committed:
            self.adopt(staged)
        else:
            self._discard(list(part_keys) if part_keys is not None else [p.key for p in staged.parts])

    def _committed(self, manifest: Manifest) -> None:
        self._manifests[manifest.version] = manifest
        self._unadvanced = manifest

    def adopt(self, staged: StagedParts) -> None:
        """The version is committed: its tensors become the base of the next delta."""
        self._spare, self._prev, self._prev_version = self._prev or {}, dict(staged.buffers), staged.version

    def discard(self, staged: StagedParts) -> None:
        """The version was not committed: delete this share's parts (best effort)."""
        self._discard([p.key for p in staged.parts])

    def advance(self, manifest: Manifest) -> None:
        """Move `LATEST` to the committed version, then apply retention every few versions."""
        advance_latest(self.store, self.run, manifest.version, manifest.publish_id)
        if self._unadvanced is not None and self._unadvanced.version <= manifest.version:
            self._unadvanced = None
        if self.prune_after_publish and manifest.version % self.prune_every == 0:
            self._prune_quietly()

    def _source(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The tensor as a contiguous CPU tensor of the served dtype, and whether that is a private copy."""
        tensor = tensor.detach()
        if tensor.device.type == "cpu" and tensor.dtype == self.dtype and tensor.is_contiguous():
            return tensor, False
        return tensor.to(device="cpu", dtype=self.dtype).contiguous(), True

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The spare buffer for `name` if it fits (its pages are already mapped), else a new one."""
        spare = self._spare.get(name)
        if spare is not None and spare.shape == like.shape and spare.dtype == like.dtype:
            return spare
        return torch.empty_like(like, memory_format=torch.contiguous_format)

    def prune(self) -> list[int]:
        """Apply retention now (see `storage.retention`); returns the deleted versions."""
        latest = self.latest_version()
        if latest is None:
            return []
        deleted = prune_versions(
            self.store,
            self.run,
            latest=latest,
            keep_versions=self.keep_versions,
            grace_s=self.grace_s,
            now=self.clock(),
            known=self._manifests,
        )
        for version in deleted:
            self._manifests.pop(version, None)
        return deleted

    def _prune_quietly(self) -> None:
        try:
            self.prune()
        except Exception:  # a boundary we own: retention must not fail a publish that already happened
            log.exception("weights retention for run %s failed; will retry after the next publish", self.run)

    def _upload(self, keyed: list[tuple[str, bytes]]) -> None:
        """Upload parts in parallel; on failure delete what went up (best effort) and re-raise.

        Every upload is waited for before deleting, so none lands after the delete (an orphan a
        sharded publish would otherwise leave next to a failed round)."""
        futures = [self._pool.submit(self.store.put, key, data) for key, data in keyed]
        wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            self._discard([k for k, _ in keyed])
            raise errors[0]  # type: ignore[misc]

    def _discard(self, keys: list[str]) -> None:
        try:
            self.store.delete_many(keys)
        except Exception:  # the parts are unreferenced garbage; retention removes them later
            log.warning("could not delete %d unreferenced weight parts", len(keys), exc_info=True)

    def _write_full(
        self, version: int, tensors: dict[str, torch.Tensor], publish_id: str, shard: int | None
    ) -> list[PartSpec]:
        names = list(tensors)
        groups = _pack([(n, tensors[n].numel() * tensors[n].element_size()) for n in names], self.part_bytes)
        meta = {"run": self.run, "version": str(version), "publish_id": publish_id}

        def encode_part(index_group: tuple[int, list[int]]) -> tuple[PartSpec, bytes]:
            index, group = index_group
            data = safetensors.torch.save({names[i]: tensors[names[i]] for i in group}, metadata=meta)
            key = part_key(self.run, version, index, publish_id, "safetensors", shard)
            spec = PartSpec(key, len(data), hashlib.sha256(data).hexdigest(), tuple(names[i] for i in group))
            return spec, data

        built = list(self._pool.map(encode_part, enumerate(groups)))
        self._upload([(spec.key, data) for spec, data in built])
        return [spec for spec, _ in built]

    def _write_delta(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        blobs_of: dict[str, list[bytes]],
        publish_id: str,
        shard: int | None,
    ) -> list[PartSpec]:
        segments = [(name, start, end) for name, t in tensors.items() for start, end in _segments(t.numel())]
        blobs = [blob for name in tensors for blob in blobs_of[name]]
        parts: list[PartSpec] = []
        keyed: list[tuple[str, bytes]] = []
        for index, group in enumerate(
            _pack([(s[0], len(b)) for s, b in zip(segments, blobs, strict=True)], self.part_bytes)
        ):
            entries, offset = [], 0
            for i in group:
                name, start, end = segments[i]
                entries.append((name, start, end, offset, len(blobs[i])))
                offset += len(blobs[i])
            data = b"".join(blobs[i] for i in group)
            key = part_key(self.run, version, index, publish_id, "lwd", shard)
            names = tuple(dict.fromkeys(e[0] for e in entries))
            parts.append(PartSpec(key, len(data), hashlib.sha256(data).hexdigest(), names, tuple(entries)))
            keyed.append((key, data))
        self._upload(keyed)
        return parts

    def _commit_manifest(self, manifest: Manifest) -> None:
        """Create-only manifest write, then read it back: our publish_id there means we won.

        Losing (the manifest exists and is another's) deletes our parts and raises `VersionConflict`.
        Any other failure leaves the parts alone: the write may have landed, and a committed manifest's
        parts are never deleted (the caller holds the share and resolves it on the retry)."""
        key = manifest_key(self.run, manifest.version)
        body = manifest.to_json()
        try:
            self.store.put_if_absent(key, body)
            won = self.store.get(key) == body
        except PreconditionFailed:
            won = False
        if not won:
            self._discard([p.key for p in manifest.parts])
            raise VersionConflict(
                f"version {manifest.version} of run {self.run!r} was already published by another publisher "
                f"(our publish_id {manifest.publish_id} lost; its parts were deleted)"
            )
