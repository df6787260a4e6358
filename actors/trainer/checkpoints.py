"""Trainer checkpoints in the object store: backend tensors as safetensors, the loop's state as JSON.

    <run>/checkpoints/v00000040/<attempt>/model.safetensors, optimizer.safetensors, rng.safetensors, meta.json
    <run>/checkpoints/v00000040/<attempt>/trainer_state.json   step, version, stream watermark, recent group ids
    <run>/checkpoints/v00000040/manifest.json                  written last (create-only): the checkpoint exists;
                                                               names its attempt and every file's hash

Each write is one *attempt* with a fresh random id, and writes its files only under its own attempt
directory: a second writer at the same version (a reused number, a second trainer) cannot touch the
files of the checkpoint whose manifest won, and is refused by the create-only manifest (then deletes
its own files). Readers follow the manifest to its attempt. (A manifest without `attempt`, written
before attempts existed, names files directly under the version directory.)

Several trainer ranks (`actors/trainer/rank_group.py`) write one directory per rank in the same
attempt (rank 0 chooses its id and sends it with the command) and a JSON index::

    <run>/checkpoints/v00000040/<attempt>/rank-00001/model.safetensors, optimizer.safetensors,
                                          rng.safetensors, meta.json   this rank's rows of every sharded tensor
    <run>/checkpoints/v00000040/<attempt>/index.json   world_size; per sharded tensor: rows, [rank, first row, rows]
    <run>/checkpoints/v00000040/<attempt>/trainer_state.json, then ../manifest.json   (rank 0, after every rank's files)

`load_checkpoint` assembles whole tensors from either layout, so a checkpoint of any world size
loads into any other (each rank then keeps its rows; `TorchBackend.load_state`). Tensors that are
not sharded (RNG states, AdamW's step) and the meta come from the same rank when it existed, else
from rank 0.

Invariants and failure behaviour:
- A checkpoint counts only once its manifest is written; files without a manifest are ignored.
- Older checkpoints are pruned only after the new manifest is written, so a trainer killed mid-write
  resumes from the one before. Pruning deletes a checkpoint's manifest first, so a half-deleted
  checkpoint is never taken for a complete one; leftovers of interrupted writes older than the
  newest complete checkpoint are deleted with it.
- Every file's hash is in the manifest and checked on load; a mismatch raises ValueError naming the
  file. `load_latest_checkpoint` (and `RankGroup.load_latest`) then fall back to the newest complete
  checkpoint that does load, with a WARNING naming what was wrong with each newer one, and mark each
  newer one damaged (`damaged.json` beside its manifest, with the reason): a damaged checkpoint no
  longer counts as complete, so it is never loaded again and never takes the place of an intact one in
  pruning (which would otherwise delete the very checkpoint the run resumed from once the next one is
  written). Damaged checkpoints are kept for a person to inspect. Nothing is pickled.
- Every manifest names its writer (`holder`: the run lease's holder token, with its lease epoch). A checkpoint
  committed after its writer's lease had passed to another trainer is *superseded* (`actors/trainer/lease_epochs.py`):
  `resumable_checkpoints` skips it with a WARNING naming both holders and marks it (`superseded.json`); like a
  damaged one it no longer counts as complete, is never loaded and is kept for a person to inspect.
- The directory is named by the policy version the checkpoint holds. Versions only move forward
  across trainer sessions (a resume publishes LATEST+1), so the highest version is the newest.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson
import torch
from torch import Tensor

from actors.trainer.backends.checkpoint import decode_checkpoint, encode_checkpoint
from actors.trainer.lease_epochs import describe_holder, holder_epoch, read_epochs, superseded_by
from storage.objectstore import ObjectNotFound, ObjectStore, PreconditionFailed, validate_key

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
DAMAGED_FILE = "damaged.json"
"""Beside the manifest of a checkpoint that failed to load: it no longer counts as complete."""
SUPERSEDED_FILE = "superseded.json"
"""Beside the manifest of a checkpoint written by a trainer that had lost the run lease: not complete either."""
SET_ASIDE_FILES = (DAMAGED_FILE, SUPERSEDED_FILE)
KEEP_CHECKPOINTS = 2
"""Complete checkpoints kept; the newest is what `--resume` loads."""
STATE_FORMAT = 1
"""Version of `trainer_state.json`; `TrainerState.from_json` refuses others."""
RECENT_GROUP_IDS_KEPT = 50_000
"""Group ids remembered for deduplication (and persisted); far more than one checkpoint interval holds."""


class CheckpointFormatError(RuntimeError):
    """A checkpoint another Leeway wrote: not damage (never marked or skipped), a reason to stop and say so."""


@dataclass
class TrainerState:
    """What the trainer loop needs, besides the backend's tensors, to continue exactly.

    `consumed_seq` is the highest trajectory-stream sequence whose group was handled (trained or
    dropped) in a committed step; at a step boundary nothing delivered is left unhandled, so a
    resumed trainer re-reads from `consumed_seq + 1`. `handled_group_ids` are the most recent
    handled group ids (a superset of those handled since the previous checkpoint), so that a
    group delivered twice, or stored twice in the stream, is trained once.

    Admission slots (`pipeline/rl/staleness.py`): `admitted - trained_groups - discarded_groups -
    dead_lettered_groups - lost_to_retention` groups are outstanding. `discarded_groups` counts the
    groups the trainer dropped or refused itself; `dead_lettered_groups` the prompts and groups dead-lettered before
    they reached it, read from the dead-letter stream up to `dead_letter_seq`
    (`actors/trainer/slots.py`). `lost_to_retention` counts trajectory-stream sequences that
    retention removed before the trainer read them (a resume past the stream's first sequence); they
    never arrive, so their slots are free, and `consumed_seq` moves past them when they are counted.
    """

    step: int = 0
    version: int = 0
    admitted: int = 0
    trained_groups: int = 0
    discarded_groups: int = 0
    consumed_seq: int = 0
    handled_group_ids: list[str] = field(default_factory=list)
    dropped_by_cap_total: int = 0
    dead_letter_seq: int = 0
    dead_lettered_groups: int = 0
    lost_to_retention: int = 0
    claim_objects: list[tuple[int, str]] = field(default_factory=list)
    """(stream seq, key) of claim objects of acked groups not yet deleted (`actors/trainer/claim_gc.py`)."""
    state_format: int = STATE_FORMAT

    @property
    def decided_groups(self) -> int:
        """Admitted groups whose slot is free: trained, discarded, dead-lettered or lost to retention."""
        return self.trained_groups + self.discarded_groups + self.dead_lettered_groups + self.lost_to_retention

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes, where: str) -> TrainerState:
        """ValueError for a state that is damaged; `CheckpointFormatError` for one another Leeway wrote (another
        `state_format`, or fields this trainer does not know): that is no damage, and no reason to fall back."""
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{where}: unreadable trainer state: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: unreadable trainer state: not an object")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if raw.get("state_format", STATE_FORMAT) != STATE_FORMAT or unknown:
            raise CheckpointFormatError(
                f"{where}: written by another Leeway (state_format={raw.get('state_format')!r}, this trainer reads "
                f"{STATE_FORMAT}; fields it does not know: {unknown}); resume with the Leeway that wrote it"
            )
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ValueError(f"{where}: unreadable trainer state: {exc}") from exc


class RecentIds:
    """An insertion-ordered set that forgets its oldest ids past `limit` (the trainer's dedupe record)."""

    def __init__(self, ids: Iterable[str] = (), limit: int = RECENT_GROUP_IDS_KEPT) -> None:
        self.limit = limit
        self._order: deque[str] = deque()
        self._set: set[str] = set()
        self.add_all(ids)

    def __contains__(self, item: object) -> bool:
        return item in self._set

    def __len__(self) -> int:
        return len(self._order)

    def add_all(self, ids: Iterable[str]) -> None:
        for item in ids:
            if item not in self._set:
                self._order.append(item)
                self._set.add(item)
        while len(self._order) > self.limit:
            self._set.discard(self._order.popleft())

    def to_list(self) -> list[str]:
        return list(self._order)


def checkpoint_prefix(run: str, version: int) -> str:
    return f"{run}/checkpoints/v{version:08d}/"


def _version_dir(run: str, key: str) -> int | None:
    """`<run>/checkpoints/v00000040/...` -> 40; None for anything else."""
    parts = key[len(f"{run}/checkpoints/") :].split("/", 1)
    name = parts[0]
    return int(name[1:]) if len(parts) == 2 and name.startswith("v") and name[1:].isdigit() else None


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


INDEX_FILE = "index.json"
INDEX_FORMAT = 1


def rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}/"


def new_attempt() -> str:
    """A fresh attempt id: the directory one checkpoint write's files go to (no other writer's)."""
    return uuid.uuid4().hex


def attempt_prefix(run: str, version: int, attempt: str) -> str:
    """Where attempt `attempt` of checkpoint `version` writes its files."""
    validate_key(attempt)
    if "/" in attempt:
        raise ValueError(f"checkpoint attempt id {attempt!r} must be one path segment")
    return f"{checkpoint_prefix(run, version)}{attempt}/"


def write_checkpoint(
    store: ObjectStore,
    run: str,
    state: TrainerState,
    tensors: Mapping[str, Tensor],
    meta: Mapping[str, Any],
    *,
    attempt: str | None = None,
    holder: Mapping[str, Any] | None = None,
) -> str:
    """Write every file under `attempt` (default: a fresh one), then the manifest (create-only), then prune
    older checkpoints.

    Returns the version's prefix (where its manifest is). A retry passes the same `attempt`: a manifest
    already naming it is this writer's own earlier commit (its response was lost) and is adopted. A
    version whose manifest names another attempt raises ValueError after deleting this attempt's files;
    the existing checkpoint is untouched. `holder`: the writer's lease token, recorded in the manifest."""
    attempt = attempt or new_attempt()
    base = attempt_prefix(run, state.version, attempt)
    files = encode_checkpoint(tensors, meta)
    files[STATE_FILE] = state.to_json()
    for name, data in files.items():
        store.put(base + name, data)
    manifest = {
        "run": run,
        "version": state.version,
        "step": state.step,
        "attempt": attempt,
        "files": {name: _digest(data) for name, data in files.items()},
        **({"holder": dict(holder)} if holder is not None else {}),
    }
    return _commit(store, run, checkpoint_prefix(run, state.version), manifest)


def _commit(store: ObjectStore, run: str, prefix: str, manifest: dict[str, Any]) -> str:
    """Write the manifest last (it makes the checkpoint complete, once per version), then prune old ones.

    A refused attempt deletes its own files (best effort: they are garbage, pruned with the version)."""
    try:
        store.put_if_absent(prefix + MANIFEST_FILE, orjson.dumps(manifest))
    except PreconditionFailed:
        if _committed_attempt(store, prefix) == manifest["attempt"]:  # our own commit, its response lost
            log.info("checkpoint %s: the manifest of this attempt was already committed; adopted", prefix)
            prune_checkpoints(store, run, keep=KEEP_CHECKPOINTS)
            return prefix
        own = prefix + manifest["attempt"] + "/"
        try:
            store.delete_many(store.list(own))
        except Exception:  # unreferenced files; the version's pruning removes them later
            log.warning("could not delete the files of the refused checkpoint attempt %s", own, exc_info=True)
        raise ValueError(
            f"checkpoint {prefix} already has a manifest; versions must not be reused "
            f"(this attempt's files under {own} were deleted, the existing checkpoint is untouched)"
        ) from None
    prune_checkpoints(store, run, keep=KEEP_CHECKPOINTS)
    return prefix


def _committed_attempt(store: ObjectStore, prefix: str) -> str | None:
    """The attempt named by the manifest under `prefix`, or None when it cannot be read as one."""
    try:
        committed = orjson.loads(store.get(prefix + MANIFEST_FILE))
    except (ObjectNotFound, orjson.JSONDecodeError):
        return None
    attempt = committed.get("attempt") if isinstance(committed, dict) else None
    return attempt if isinstance(attempt, str) else None


def _scan(store: ObjectStore, run: str) -> dict[int, list[str]]:
    """Every checkpoint directory's keys, by version (complete or not)."""
    dirs: dict[int, list[str]] = {}
    for key in store.list(f"{run}/checkpoints/"):
        version = _version_dir(run, key)
        if version is not None:
            dirs.setdefault(version, []).append(key)
    return dirs


def _complete(run: str, dirs: Mapping[int, list[str]]) -> list[int]:
    """Versions with a manifest and no damage or superseded mark, oldest first."""
    return sorted(
        v
        for v, keys in dirs.items()
        if checkpoint_prefix(run, v) + MANIFEST_FILE in keys
        and not any(checkpoint_prefix(run, v) + mark in keys for mark in SET_ASIDE_FILES)
    )


def _damaged(run: str, dirs: Mapping[int, list[str]]) -> set[int]:
    return {v for v, keys in dirs.items() if checkpoint_prefix(run, v) + DAMAGED_FILE in keys}


def _set_aside(run: str, dirs: Mapping[int, list[str]]) -> set[int]:
    """Versions marked damaged or superseded: kept for a person, never counted as complete."""
    return {v for v, keys in dirs.items() if any(checkpoint_prefix(run, v) + m in keys for m in SET_ASIDE_FILES)}


def mark_damaged(store: ObjectStore, run: str, version: int, reason: str, *, mark: str = DAMAGED_FILE) -> None:
    """Mark checkpoint `version` damaged (or `mark`: superseded); best effort: unmarked, it is only tried and
    skipped again."""
    try:
        store.put(checkpoint_prefix(run, version) + mark, orjson.dumps({"version": version, "reason": reason}))
    except Exception:  # a boundary: the fallback goes on; the warning already names the damage
        log.warning("could not mark checkpoint v%d of run %s (%s)", version, run, mark, exc_info=True)


def complete_checkpoints(store: ObjectStore, run: str) -> list[int]:
    """Versions whose manifest exists and that are not marked damaged, oldest first."""
    return _complete(run, _scan(store, run))


def committed_attempts(store: ObjectStore, run: str) -> dict[int, str | None]:
    """Version -> attempt of every complete checkpoint (what a new lease epoch records as existing before it)."""
    found: dict[int, str | None] = {}
    for version in complete_checkpoints(store, run):
        try:
            found[version] = _read_manifest(store, checkpoint_prefix(run, version)).get("attempt")
        except ValueError:  # unreadable or gone: damage for the loader to find; it was no one's valid checkpoint
            continue
    return found


def resumable_checkpoints(store: ObjectStore, run: str) -> list[int]:
    """`complete_checkpoints` less the superseded ones (written after their writer lost the run lease, see
    `actors/trainer/lease_epochs.py`): each is skipped with a WARNING naming why, and marked, oldest first."""
    versions = complete_checkpoints(store, run)
    records = read_epochs(store, run) if versions else []
    if not records:
        return versions
    kept = []
    for version in versions:
        try:
            manifest = _read_manifest(store, checkpoint_prefix(run, version))
        except ValueError:
            kept.append(version)  # damage: the loader reports and marks it
            continue
        holder, attempt = manifest.get("holder"), manifest.get("attempt")
        epoch = holder_epoch(holder)
        after = None if epoch is None else superseded_by(records, epoch, version, attempt)
        if after is None:
            kept.append(version)
            continue
        reason = (
            f"written by {describe_holder(holder)} after the run lease had passed to {describe_holder(after.holder)}: "  # type: ignore[arg-type]
            "its writer had lost the lease"
        )
        log.warning("checkpoint v%d of run %s is not resumed: %s", version, run, reason)
        mark_damaged(store, run, version, reason, mark=SUPERSEDED_FILE)
    return kept


def refuse_if_all_damaged(store: ObjectStore, run: str) -> None:
    """ValueError when the run has checkpoints but every one is marked damaged: a person must look, the run must
    not start again from its initial weights as if it had never trained."""
    damaged = sorted(_damaged(run, _scan(store, run)))
    if damaged:
        raise ValueError(
            f"run {run}: every checkpoint is marked damaged ({', '.join(f'v{v}' for v in damaged)}; the reason is in "
            f"each one's {DAMAGED_FILE}); restore one, or delete the marks to try them again"
        )


def prune_checkpoints(store: ObjectStore, run: str, keep: int = KEEP_CHECKPOINTS) -> list[int]:
    """Keep the newest `keep` complete checkpoints; delete older ones and older incomplete leftovers. Damaged
    and superseded ones (`mark_damaged`, `resumable_checkpoints`) are neither counted nor deleted."""
    dirs = _scan(store, run)
    complete = _complete(run, dirs)
    if not complete:
        return []
    kept = (set(complete[-keep:]) if keep > 0 else set()) | _set_aside(run, dirs)
    doomed = [v for v in dirs if v not in kept and v < complete[-1]]
    for version in sorted(doomed):
        # The manifest goes first, so a half-deleted checkpoint is never taken for a complete one.
        manifest = checkpoint_prefix(run, version) + MANIFEST_FILE
        for key in sorted(dirs[version], key=lambda k: k != manifest):
            store.delete(key)
    return sorted(doomed)


def write_rank_files(
    store: ObjectStore, run: str, version: int, rank: int, files: Mapping[str, bytes], attempt: str
) -> dict[str, str]:
    """One rank's encoded files (`encode_checkpoint`) under its directory of `attempt` (rank 0's id for this
    checkpoint round); returns {path in the attempt: digest} for the manifest."""
    prefix = attempt_prefix(run, version, attempt) + rank_dir(rank)
    for name, data in files.items():
        store.put(prefix + name, data)
    return {rank_dir(rank) + name: _digest(data) for name, data in files.items()}


def commit_sharded_checkpoint(
    store: ObjectStore,
    run: str,
    state: TrainerState,
    rank_files: list[Mapping[str, str]],
    rank_shards: list[Mapping[str, list[int]]],
    attempt: str,
    holder: Mapping[str, Any] | None = None,
) -> str:
    """After every rank wrote its files of `attempt`: the index, the trainer state, then the manifest
    (create-only), then prune.

    `rank_shards[r]` is rank r's ``{tensor key: [rows, first row, rows here]}`` (`TorchBackend.state_meta`)."""
    prefix = checkpoint_prefix(run, state.version)
    base = attempt_prefix(run, state.version, attempt)
    tensors: dict[str, dict[str, Any]] = {}
    for rank, shards in enumerate(rank_shards):
        for key, (rows, start, count) in shards.items():
            tensors.setdefault(key, {"rows": rows, "shards": []})["shards"].append([rank, start, count])
    index = orjson.dumps({"index_format": INDEX_FORMAT, "world_size": len(rank_files), "tensors": tensors})
    files = {name: digest for digests in rank_files for name, digest in digests.items()}
    for name, data in ((INDEX_FILE, index), (STATE_FILE, state.to_json())):
        store.put(base + name, data)
        files[name] = _digest(data)
    manifest = {
        "run": run,
        "version": state.version,
        "step": state.step,
        "world_size": len(rank_files),
        "attempt": attempt,
        "files": files,
        **({"holder": dict(holder)} if holder is not None else {}),
    }
    return _commit(store, run, prefix, manifest)


def checkpoint_files(store: ObjectStore, run: str, version: int) -> dict[str, str]:
    """The files of complete checkpoint `version`: {name in the manifest: key in the store}."""
    prefix = checkpoint_prefix(run, version)
    manifest = _read_manifest(store, prefix)
    base = _files_base(prefix, manifest)
    return {name: base + name for name in manifest["files"]}


def _read_manifest(store: ObjectStore, prefix: str) -> dict[str, Any]:
    try:
        manifest = orjson.loads(store.get(prefix + MANIFEST_FILE))
        if not isinstance(manifest, dict) or not isinstance(manifest["files"], dict):
            raise TypeError("not an object with a 'files' object")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        if isinstance(exc, ObjectNotFound):
            raise ValueError(f"checkpoint {prefix}: its manifest is gone") from exc
        raise ValueError(f"checkpoint {prefix}{MANIFEST_FILE}: unreadable manifest: {exc}") from exc
    return manifest


def _files_base(prefix: str, manifest: Mapping[str, Any]) -> str:
    """Where the manifest's files are: its attempt's directory (or the version's, before attempts existed)."""
    attempt = manifest.get("attempt")
    if attempt is None:
        return prefix
    if not isinstance(attempt, str) or not attempt or "/" in attempt:
        raise ValueError(f"checkpoint {prefix}{MANIFEST_FILE}: invalid attempt {attempt!r}")
    return f"{prefix}{attempt}/"


def load_latest_checkpoint(
    store: ObjectStore, run: str, rank: int = 0
) -> tuple[TrainerState, dict[str, Tensor], dict[str, Any]] | None:
    """The newest complete checkpoint that loads (state, tensors, meta), verified against its manifest;
    None if there is none.

    A newer complete checkpoint that fails to load (a file missing or not matching its hash, an
    unreadable manifest) is skipped with a WARNING naming it and what was wrong; the older one is
    loaded. If every complete checkpoint fails, ValueError names each failure: a run whose checkpoints
    are all damaged needs a person, not a silent fresh start. Store errors (an outage) raise as they are."""
    failures: list[str] = []
    for version in reversed(resumable_checkpoints(store, run)):
        try:
            loaded = load_checkpoint(store, run, version, rank=rank)
        except ValueError as exc:
            failures.append(f"v{version}: {exc}")
            log.warning("checkpoint v%d of run %s cannot be loaded (%s); trying the one before", version, run, exc)
            mark_damaged(store, run, version, str(exc))
            continue
        if failures:
            log.warning("resuming run %s from checkpoint v%d, older than the damaged %s", run, version, failures)
        return loaded
    if failures:
        raise ValueError(f"run {run}: no complete checkpoint loads: {'; '.join(failures)}")
    refuse_if_all_damaged(store, run)
    return None


def load_checkpoint(
    store: ObjectStore, run: str, version: int, *, rank: int = 0
) -> tuple[TrainerState, dict[str, Tensor], dict[str, Any]]:
    """Checkpoint `version` as (state, whole tensors, meta) for trainer rank `rank`, of either layout
    (see the module docstring); every file is checked against the manifest's hash (ValueError naming it)."""
    prefix = checkpoint_prefix(run, version)
    manifest = _read_manifest(store, prefix)
    base = _files_base(prefix, manifest)
    files: dict[str, bytes] = {}
    for name, digest in manifest["files"].items():
        try:
            data = store.get(base + name)
        except ObjectNotFound as exc:
            raise ValueError(f"checkpoint {prefix}: file {base + name} named in its manifest is missing") from exc
        if _digest(data) != digest:
            raise ValueError(f"checkpoint {prefix}: file {base + name} does not match its manifest hash")
        files[name] = data
    if STATE_FILE not in files:
        raise ValueError(f"checkpoint {prefix}: its manifest names no {STATE_FILE}")
    state = TrainerState.from_json(files.pop(STATE_FILE), base + STATE_FILE)
    if INDEX_FILE not in files:
        tensors, meta = decode_checkpoint(files)
        return state, tensors, meta
    return state, *_assemble(prefix, files, rank)


def _assemble(prefix: str, files: Mapping[str, bytes], rank: int) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Whole tensors from every rank's rows (`index.json`); the rest from rank `rank` if it existed, else 0."""
    try:
        index = orjson.loads(files[INDEX_FILE])
        world = int(index["world_size"])
        sharded: dict[str, Any] = index["tensors"]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint {prefix}{INDEX_FILE}: unreadable index: {exc}") from exc
    decoded = []
    for r in range(world):
        named = {k.removeprefix(rank_dir(r)): v for k, v in files.items() if k.startswith(rank_dir(r))}
        if not named:
            raise ValueError(f"checkpoint {prefix}: no files of rank {r} (index says world_size {world})")
        decoded.append(decode_checkpoint(named))
    own = rank if rank < world else 0
    tensors, meta = dict(decoded[own][0]), decoded[own][1]
    for key, entry in sharded.items():
        pieces = sorted(entry["shards"], key=lambda s: s[1])
        parts = [decoded[r][0][key] for r, _, count in pieces if count > 0]
        whole = torch.cat(parts, dim=0) if parts else decoded[own][0][key]
        if whole.shape[0] != entry["rows"]:
            raise ValueError(
                f"checkpoint {prefix}: {key} assembles to {whole.shape[0]} rows, index says {entry['rows']}"
            )
        tensors[key] = whole
    return tensors, meta
