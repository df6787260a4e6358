"""Generator side of the weight store: `WeightSubscriber` (see `storage.weights` for the protocol).

A delta version is applied one tensor per task, in one pass over each tensor: segment by segment
the held bits are copied to a per-thread scratch buffer, the codec blob is applied in place, the
changed 8-byte words are found by comparing with the scratch copy (their old contents go to the undo
log) and the segment is fed to the tensor's sha256, all while the segment is still in cache. The
undo log holds only changed words, so memory stays O(changes); a tensor no entry touches keeps its
verified hash.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load as load_safetensors_bytes

from storage.delta_codec import apply_delta, tensor_bits
from storage.manifest import Manifest, ManifestError, PartSpec, manifest_key
from storage.objectstore import ObjectNotFound, ObjectStore
from storage.weights_base import DTYPE_NAMES, NoVersionError, RunWeights, WeightPullError, byte_view, tensor_hash

__all__ = ["PullPlan", "WeightSubscriber"]

log = logging.getLogger(__name__)

_WORD = np.dtype("<u8")


@dataclass(frozen=True)
class PullPlan:
    """Versions to apply, in order, to go from `have` to `want`; the first is a full snapshot if `from_full`."""

    have: int | None
    want: int
    versions: tuple[int, ...]
    from_full: bool
    num_bytes: int


class _StepFailure(Exception):
    """One version could not be applied; `retry` says whether fetching it again could help."""

    def __init__(self, version: int, part: str, tensor: str, reason: str, *, retry: bool) -> None:
        super().__init__(f"version {version}, part {part!r}, tensor {tensor!r}: {reason}")
        self.version, self.part, self.tensor, self.retry = version, part, tensor, retry


class _Change(NamedTuple):
    """Old contents of the changed bytes of one segment: 8-byte words, then the bytes after the last word."""

    tensor: str
    offset: int  # byte offset of the segment in the tensor
    words: int  # whole 8-byte words the segment holds
    word_positions: np.ndarray
    old_words: np.ndarray
    tail_positions: np.ndarray
    old_tail: np.ndarray


_Undo = list[_Change]
_Job = tuple[str, int, int, memoryview]  # part key, start element, end element, codec blob


def _change(name: str, offset: int, now: np.ndarray, before: np.ndarray) -> _Change:
    """Where `now` differs from `before` (both uint8, same size), in words plus a byte tail."""
    words = now.size // 8
    now_w, before_w = now[: words * 8].view(_WORD), before[: words * 8].view(_WORD)
    positions = np.flatnonzero(now_w != before_w)
    tail_positions = np.flatnonzero(now[words * 8 :] != before[words * 8 :])
    return _Change(
        name, offset, words, positions, before_w[positions], tail_positions, before[words * 8 :][tail_positions]
    )


def _rollback(tensors: dict[str, torch.Tensor], undo: _Undo) -> None:
    """Restore the changed bytes, newest change first."""
    while undo:
        c = undo.pop()
        raw = byte_view(tensors[c.tensor])[c.offset :]
        raw[: c.words * 8].view(_WORD)[c.word_positions] = c.old_words
        raw[c.words * 8 :][c.tail_positions] = c.old_tail


class WeightSubscriber(RunWeights):
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
        super().__init__(store, run, parallelism=parallelism, thread_name_prefix="weights-sub")
        self.model_config_hash = model_config_hash
        self.tensors: dict[str, torch.Tensor] = tensors if tensors is not None else {}
        self.version = version
        self._hashes: dict[str, str] | None = None  # verified hashes of `tensors`, None until checked
        self._manifests: dict[int, Manifest] = {}
        self._scratch = threading.local()  # per-thread buffer for one segment's old bytes, reused

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
        full_path = PullPlan(
            have, want, tuple(c.version for c in reversed(chain)), True, sum(c.num_bytes for c in chain)
        )
        if delta_path is not None and delta_path.num_bytes <= full_path.num_bytes:
            return delta_path
        return full_path

    def pull(self, want: int | None = None) -> int:
        """Bring `tensors` to `want` (default: LATEST); returns the version now held. See `storage.weights`."""
        if want is None:
            want = self.latest_version()
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

    def forget(self) -> None:
        """Drop the held version: the next pull loads a full snapshot (an engine refused what it was handed)."""
        self.version = None
        self._hashes = None

    def _pull_error(self, want: int, failure: _StepFailure, earlier: _StepFailure | None) -> WeightPullError:
        before = f" (the delta chain failed first: {earlier})" if earlier else ""
        held = f"version {self.version}" if self.version is not None else "no version"
        return WeightPullError(
            f"run {self.run!r}: pulling version {want} failed at {failure}{before}; tensors unchanged, still {held}",
            version=failure.version,
            part=failure.part,
            tensor=failure.tensor,
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
                loaded = load_safetensors_bytes(data)  # safetensors format: no pickle
            except Exception as exc:  # safetensors raises its own error type for any malformed shard
                raise _StepFailure(
                    m.version, part.key, part.tensors[0], f"bad safetensors: {exc}", retry=False
                ) from exc
            if set(loaded) != set(part.tensors):
                raise _StepFailure(
                    m.version, part.key, part.tensors[0], "shard tensors differ from manifest", retry=False
                )
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
            except BaseException:
                _rollback(tensors, mine)
                raise
            if undo is not None:
                undo.extend(mine)
            return

    def _apply_parts(self, m: Manifest, tensors: dict[str, torch.Tensor], hashes: dict[str, str], undo: _Undo) -> None:
        """Fetch every part, then apply, log and hash one tensor per task; on failure `undo` holds every change."""
        blobs = list(self._pool.map(lambda p: self._fetch_part(m, p), m.parts))
        jobs: dict[str, list[_Job]] = {}
        for part, blob in zip(m.parts, blobs, strict=True):
            for name, start, end, offset, length in part.entries:
                jobs.setdefault(name, []).append((part.key, start, end, memoryview(blob)[offset : offset + length]))
        logs: dict[str, _Undo] = {name: [] for name in jobs}
        futures = {
            name: self._pool.submit(self._apply_tensor, m, name, tensors[name], todo, logs[name])
            for name, todo in jobs.items()
        }
        failure: Exception | None = None
        for name, future in futures.items():  # wait for every task and keep every undo record before raising
            try:
                hashes[name] = future.result()
            except Exception as exc:  # a _StepFailure, or a bug: either way roll back, then raise it
                failure = failure or exc
        for name in jobs:
            undo.extend(logs[name])
        if failure is not None:
            raise failure
        for spec in m.tensors:
            if hashes.get(spec.name) != spec.hash:
                part = jobs[spec.name][-1][0] if spec.name in jobs else ""
                raise _StepFailure(m.version, part, spec.name, "tensor hash mismatch after applying", retry=True)

    def _apply_tensor(self, m: Manifest, name: str, tensor: torch.Tensor, todo: list[_Job], log_: _Undo) -> str:
        """Apply `todo` to one tensor in element order, logging changes to `log_`; returns its new sha256."""
        bits, raw = tensor_bits(tensor), byte_view(tensor)
        width = tensor.element_size()
        digest = hashlib.sha256()
        done = 0
        for key, start, end, blob in sorted(todo, key=lambda job: job[1]):
            lo, hi = start * width, end * width
            digest.update(raw[done * width : lo].data)  # elements no entry covers (normally none)
            before = self._scratch_bytes(hi - lo)
            before[:] = raw[lo:hi]
            try:
                apply_delta(bits[start:end], blob)
            except ValueError as exc:
                raise _StepFailure(m.version, key, name, f"delta rejected: {exc}", retry=False) from None
            finally:  # a blob can fail after writing some chunks: log whatever did change
                log_.append(_change(name, lo, raw[lo:hi], before))
            digest.update(raw[lo:hi].data)
            done = end
        digest.update(raw[done * width :].data)
        return digest.hexdigest()

    def _scratch_bytes(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.size < nbytes:
            buf = self._scratch.buf = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes]
