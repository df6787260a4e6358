"""What trainer ranks do together: rank 0 leads, the others follow its commands.

Rank 0 alone runs the loop of `actors/trainer/loop.py` (NATS consumer, admission, dedupe, acks,
metrics). Whenever the loop needs every rank, rank 0 broadcasts a command and takes part itself;
the other ranks wait in `follow` and do the same::

    rank 0                                   ranks 1..N-1 (`follow`)
    LeaderBackend.train_step ──TRAIN(batch)──► backend.train_step(same batch, objective rebuilt from config)
    LeaderBackend.logprobs  ──LOGPROBS(batch)► backend.logprobs(same batch)  (rank 0 keeps the result)
    RankGroup.publish       ──PUBLISH(v)─────► each rank stores the parts of the tensors it owns;
                                               rank 0 writes the one manifest, then LATEST
                            ──SETTLE(ours?)──► (a retry after an ambiguous commit) each rank adopts
                                               its held share, or deletes it
    RankGroup.checkpoint    ──CHECKPOINT(v)──► each rank writes its shard files under rank 0's attempt id;
                                               rank 0 the index, the trainer state and the manifest (last)
    RankGroup.load          ──LOAD(v)────────► each rank assembles whole tensors, keeps its rows (a
                                               checkpoint some rank cannot load: LOAD of the one before)
    RankGroup.stop          ──STOP, barrier──► exit 0 (every rank has read STOP before any leaves)

Commands are JSON headers and batches are safetensors bytes (`encode_batch`), broadcast as uint8
tensors: nothing is pickled. Every command is one round in which each rank enters the same
collectives in the same order; a rank that fails locally (a store error) reports it in the round's
all-gather, every rank undoes its share, and rank 0 raises naming the rank, so a retry (the
session retries publishes) starts a fresh round. A rank that dies breaks the collectives of the
others (gloo/NCCL raise), so every rank exits; the launcher (`actors/trainer/distributed.py`) then
stops what is left, and `--resume` continues from the last checkpoint exactly once.

What a backend must do to run here (the torch backend does; any other built from the same config
and seed on every rank can): `train_step`, `logprobs`, `export_weights_owned`, `weight_shapes`,
`state_tensors`, `state_meta` and `load_state` are called on every rank in the same order, so they
may use collectives; `train_step` returns the whole batch's result on every rank; `load_state` gets
whole tensors; `state_meta()["shards"]` lists the tensors that are dim-0 row shards as
``{key: [rows, first row, rows here]}``, and every other state tensor is whole on each rank.
"""

from __future__ import annotations

import json
import logging
import signal
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.numpy import load as np_load
from safetensors.numpy import save as np_save
from torch import Tensor

from actors.trainer.backends import LossFn, StepResult, TrainBatch, TrainingBackend
from actors.trainer.backends.checkpoint import encode_checkpoint
from actors.trainer.backends.data_parallel import all_gather_bytes, broadcast_bytes, max_over_ranks
from actors.trainer.checkpoints import (
    TrainerState,
    commit_sharded_checkpoint,
    load_checkpoint,
    mark_damaged,
    new_attempt,
    refuse_if_all_damaged,
    resumable_checkpoints,
    write_rank_files,
)
from actors.trainer.objective import CorrectedObjective
from pipeline.config import LeewayConfig
from pipeline.rl.batching import ModelLimits, TrainSequence
from storage.manifest import Manifest, PartSpec, TensorSpec
from storage.objectstore import ObjectStore
from storage.publisher import StagedParts
from storage.weights import TORCH_DTYPES, WeightPublisher, WeightStoreError

log = logging.getLogger(__name__)

STOP, TRAIN, LOGPROBS, PUBLISH, CHECKPOINT, LOAD = "stop", "train", "logprobs", "publish", "checkpoint", "load"
SETTLE = "settle"
"""Rank 0 resolved a commit whose outcome was unknown: every rank adopts its held share, or deletes it."""


class RankRoundError(RuntimeError):
    """A rank failed its part of a command round; every rank undid its share (a retry may succeed)."""


class RankGroupBroken(WeightStoreError):
    """A collective failed: a rank is gone, so no retry can succeed (the run ends; `--resume` continues)."""


# ---- batches as bytes ------------------------------------------------------------------------------------


def encode_batch(batch: TrainBatch) -> bytes:
    """The sequences as one safetensors file of concatenated columns plus lengths (no pickle)."""
    seqs = batch.sequences
    has_prox = [s.proximal_logprobs is not None for s in seqs]
    if any(has_prox) and not all(has_prox):
        raise ValueError("proximal_logprobs must be set on every sequence of a batch or on none")
    columns = {
        "lengths": np.asarray([s.num_tokens for s in seqs], np.int64),
        "tokens": np.concatenate([np.asarray(s.tokens, np.int64) for s in seqs]),
        "loss_mask": np.concatenate([(np.asarray(s.loss_mask) != 0).astype(np.uint8) for s in seqs]),
        "behaviour_logprobs": np.concatenate([np.asarray(s.behaviour_logprobs, np.float32) for s in seqs]),
        "versions": np.concatenate([np.asarray(s.versions, np.int64) for s in seqs]),
        "advantages": np.concatenate([s.advantages_per_token() for s in seqs]).astype(np.float32),
    }
    if all(has_prox):
        columns["proximal_logprobs"] = np.concatenate([np.asarray(s.proximal_logprobs, np.float32) for s in seqs])
    columns.update(_route_columns(seqs))
    return np_save(columns, metadata={"sample_ids": json.dumps([s.sample_id for s in seqs])})


def _route_columns(seqs: Sequence[TrainSequence]) -> dict[str, np.ndarray]:
    """Routes of every sequence when any has some: a sequence without gets zeros and route version -1 (unrouted)."""
    shapes = {np.asarray(s.routes).shape[1:] for s in seqs if s.routes is not None}
    if not shapes:
        return {}
    if len(shapes) > 1:
        raise ValueError(f"routes of one batch differ in [layers, top_k]: {sorted(shapes)}")
    shape = shapes.pop()
    routes, versions = [], []
    for s in seqs:
        known = s.routes is not None and s.route_versions is not None
        routes.append(np.asarray(s.routes, np.int64) if known else np.zeros((s.num_tokens, *shape), np.int64))
        versions.append(np.asarray(s.route_versions, np.int32) if known else np.full(s.num_tokens, -1, np.int32))
    return {"routes": np.concatenate(routes), "route_versions": np.concatenate(versions)}


def decode_batch(data: bytes) -> TrainBatch:
    columns = np_load(data)
    ids = json.loads(_metadata(data).get("sample_ids", "[]"))
    bounds = np.concatenate([[0], np.cumsum(columns["lengths"])])
    prox = columns.get("proximal_logprobs")
    routes, route_versions = columns.get("routes"), columns.get("route_versions")
    return TrainBatch(
        tuple(
            TrainSequence(
                tokens=columns["tokens"][a:b],
                loss_mask=columns["loss_mask"][a:b],
                behaviour_logprobs=columns["behaviour_logprobs"][a:b],
                versions=columns["versions"][a:b],
                advantage=columns["advantages"][a:b],
                proximal_logprobs=None if prox is None else prox[a:b],
                sample_id=ids[i] if i < len(ids) else "",
                routes=None if routes is None else routes[a:b],
                route_versions=None if route_versions is None else route_versions[a:b],
            )
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
        )
    )


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's JSON header."""
    size = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8 : 8 + size]).get("__metadata__", {}))


# ---- the group ----------------------------------------------------------------------------------------------


def owned_tensors(shapes: Mapping[str, tuple[int, ...]], world_size: int) -> list[set[str]]:
    """Which rank publishes which tensor: largest first to the rank with the fewest elements so far.

    Deterministic from the shapes alone, so every rank computes the same split by itself."""
    sizes = {n: int(np.prod(s)) if s else 1 for n, s in shapes.items()}
    loads, owned = [0] * world_size, [set[str]() for _ in range(world_size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owned[rank].add(name)
        loads[rank] += sizes[name]
    return owned


class RankGroup:
    """One rank's side of every command round (rank 0 sends the commands, see the module docstring)."""

    def __init__(
        self, cfg: LeewayConfig, backend: TrainingBackend, store: ObjectStore, publisher: WeightPublisher | None
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.store = store
        self.publisher = publisher
        self.run = cfg.run.name
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.stopped = False
        self._owned: set[str] | None = None
        self.holder: dict[str, Any] | None = None
        """Rank 0: the run lease's holder token, written into every checkpoint manifest."""

    # ---- rank 0: commands

    def send(self, command: str, payload: bytes | None = None, **fields: Any) -> None:
        if self.stopped:
            raise RuntimeError(f"rank group stopped; cannot send {command!r}")
        broadcast_bytes(json.dumps({"command": command, "payload": payload is not None, **fields}).encode())
        if payload is not None:
            broadcast_bytes(payload)

    def stop(self) -> None:
        """Tell the other ranks to exit and wait until all have read it (once; a failure is logged: they
        exit when rank 0 does). The barrier after STOP: the root of a broadcast returns before its
        receivers have read it, so without it rank 0 could tear its group down under a rank still
        reading (`distributed.leave_rank_group`)."""
        if self.stopped:
            return
        try:
            self.send(STOP)
            dist.barrier()
        except Exception as exc:  # a rank is gone: the others end when this process exits (launcher, gloo)
            log.warning("could not tell the other trainer ranks to stop: %s", str(exc).splitlines()[0][:300])
        self.stopped = True

    def publish(self, version: int) -> Manifest:
        """Every rank stores its parts of `version`; rank 0 commits manifest and LATEST after all are stored.

        A retry is idempotent, as `WeightPublisher.publish`: a version rank 0 committed is only advanced
        (every rank adopted it in its round); a commit whose outcome was unknown (every rank held its
        parts) is resolved by rank 0 first and SETTLE tells each rank to adopt or delete its share."""
        publisher = self.publisher
        assert publisher is not None, "a live trainer rank needs a weight publisher"
        manifest = publisher.unadvanced(version)
        if manifest is None and publisher.held is not None:
            landed = publisher.resolve_held()  # a store error raises here, before any rank is told
            try:
                self.send(SETTLE, committed=landed is not None)
            except Exception as exc:  # only collectives raise here: the group is broken
                raise RankGroupBroken(f"trainer ranks lost each other settling version {version}: {exc}") from exc
            manifest = landed if landed is not None and landed.version == version else None
        if manifest is None:
            publish_id = uuid.uuid4().hex
            try:
                self.send(PUBLISH, version=version, publish_id=publish_id)
                manifest, failure = self._publish_round(version, publish_id)
            except Exception as exc:  # only collectives raise here: the group is broken
                raise RankGroupBroken(f"trainer ranks lost each other publishing version {version}: {exc}") from exc
            if failure is not None:
                raise failure
        assert manifest is not None
        publisher.advance(manifest)  # LATEST, after every rank adopted the version
        return manifest

    def checkpoint(self, state: TrainerState) -> str:
        attempt = new_attempt()  # every rank writes under it: a refused writer touches no complete checkpoint
        self.send(CHECKPOINT, version=state.version, attempt=attempt)
        prefix = self._checkpoint_round(state.version, state, attempt)
        assert prefix is not None
        return prefix

    def load_latest(self) -> TrainerState | None:
        """Load the newest complete checkpoint every rank can load, on every rank (resharded if the world
        size changed); a newer one that some rank cannot load is skipped with a WARNING naming what was
        wrong, as `load_latest_checkpoint` does. ValueError if none loads."""
        failures: list[str] = []
        for version in reversed(resumable_checkpoints(self.store, self.run)):
            self.send(LOAD, version=version)
            state, failure = self._load_round(version)
            if failure is None:
                if failures:
                    log.warning(
                        "resuming run %s from checkpoint v%d, older than the damaged %s", self.run, version, failures
                    )
                return state
            failures.append(f"v{version}: {failure}")
            mark_damaged(self.store, self.run, version, failure)
            log.warning(
                "checkpoint v%d of run %s cannot be loaded (%s); trying the one before", version, self.run, failure
            )
        if failures:
            raise RankRoundError(f"run {self.run}: no complete checkpoint loads on every rank: {'; '.join(failures)}")
        refuse_if_all_damaged(self.store, self.run)
        return None

    # ---- every rank: the rounds

    def owned(self) -> set[str]:
        if self._owned is None:
            self._owned = owned_tensors(self.backend.weight_shapes(), self.world_size)[self.rank]
        return self._owned

    def _publish_round(self, version: int, publish_id: str) -> tuple[Manifest | None, Exception | None]:
        """Returns rank 0's manifest, or the failure of a rank's store or of the commit (every rank has
        then deleted its parts); collectives that fail raise."""
        publisher = self.publisher
        assert publisher is not None, "a live trainer rank needs a weight publisher"
        dtype = TORCH_DTYPES[self.cfg.model.dtype]
        tensors = self.backend.export_weights_owned(dtype, self.owned())  # collective
        wants_full = publisher.needs_full(version, {n: tuple(t.shape) for n, t in tensors.items()})
        full = max_over_ranks(int(wants_full)) == 1
        staged: StagedParts | None = None
        report: dict[str, Any]
        try:
            staged = publisher.write_parts(version, tensors, publish_id=publish_id, full=full, shard=self.rank)
            report = {"tensors": [asdict(t) for t in staged.tensors], "parts": [asdict(p) for p in staged.parts]}
        except Exception as exc:  # reported to every rank below, so all undo the round together
            log.exception("rank %d could not store its parts of version %d", self.rank, version)
            report = {"error": f"{type(exc).__name__}: {exc}"}
        reports = [json.loads(r) for r in all_gather_bytes(json.dumps(report).encode())]
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if "error" in rep]
        manifest: Manifest | None = None
        failure: Exception | None = None
        if failed:
            failure = RankRoundError(
                f"version {version}: rank {failed[0][0]} could not store its parts: {failed[0][1]}"
            )
        elif self.rank == 0:
            assert staged is not None
            every = [staged if r == 0 else _staged_from_report(rep, staged) for r, rep in enumerate(reports)]
            try:
                manifest = publisher.commit(staged, every)
            except Exception as exc:  # told to the other ranks below, then returned
                failure = exc
        uncertain = False
        if not failed:  # rank 0 says whether the commit worked: b"" yes, b"!..." no, b"?..." unknown
            said = b""
            if failure is not None:
                said = (b"?" if publisher.held is not None else b"!") + f"{type(failure).__name__}: {failure}".encode()
            said = broadcast_bytes(said)
            uncertain = said[:1] == b"?"
            if said and failure is None:
                failure = RankRoundError(f"version {version}: rank 0 could not commit: {said[1:].decode()}")
        if failure is not None:
            if staged is not None and uncertain:
                if self.rank != 0:  # (rank 0's commit holds its share itself)
                    publisher.hold(staged)  # the manifest may exist: keep the parts until SETTLE
            elif staged is not None:
                publisher.discard(staged)
            return None, failure
        assert staged is not None
        publisher.adopt(staged)
        return manifest, None

    def _checkpoint_round(self, version: int, state: TrainerState | None, attempt: str) -> str | None:
        report: dict[str, Any]
        try:
            meta = self.backend.state_meta()
            files = encode_checkpoint(self.backend.state_tensors(), meta)
            digests = write_rank_files(self.store, self.run, version, self.rank, files, attempt)
            report = {"files": digests, "shards": meta.get("shards", {})}
        except Exception as exc:  # reported to every rank below
            log.exception("rank %d could not write its checkpoint files at version %d", self.rank, version)
            report = {"error": f"{type(exc).__name__}: {exc}"}
        reports = [json.loads(r) for r in all_gather_bytes(json.dumps(report).encode())]
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if "error" in rep]
        if self.rank != 0:
            return None
        if failed:
            raise RankRoundError(f"checkpoint v{version}: rank {failed[0][0]} failed: {failed[0][1]}")
        assert state is not None
        return commit_sharded_checkpoint(
            self.store,
            self.run,
            state,
            [r["files"] for r in reports],
            [r["shards"] for r in reports],
            attempt,
            holder=self.holder,
        )

    def _load_round(self, version: int) -> tuple[TrainerState | None, str | None]:
        """Every rank loads checkpoint `version`; returns (rank 0's state, None), or (None, the first rank's
        failure) if the checkpoint is damaged (a ValueError: missing file, hash mismatch), the same answer
        on every rank, so rank 0 can try an older one with all of them. Any other failure (the store is
        down) raises `RankRoundError` on every rank: an outage must not make a resume go back further."""
        report: dict[str, Any] = {}
        state: TrainerState | None = None
        try:
            state, tensors, meta = load_checkpoint(self.store, self.run, version, rank=self.rank)
            self.backend.load_state(tensors, meta)
        except Exception as exc:  # reported to every rank below
            log.exception("rank %d could not load checkpoint v%d", self.rank, version)
            report = {"error": f"{type(exc).__name__}: {exc}", "damaged": isinstance(exc, ValueError)}
        reports = [json.loads(r) for r in all_gather_bytes(json.dumps(report).encode())]
        failed = [(r, rep["error"], rep["damaged"]) for r, rep in enumerate(reports) if "error" in rep]
        if any(not damaged for _, _, damaged in failed):
            rank, error, _ = next(f for f in failed if not f[2])
            raise RankRoundError(f"checkpoint v{version}: rank {rank} could not load it: {error}")
        if failed:
            return None, f"rank {failed[0][0]} could not load it: {failed[0][1]}"
        return state, None


def _staged_from_report(report: Mapping[str, Any], like: StagedParts) -> StagedParts:
    """Another rank's share, as far as the manifest needs it (no buffers: they stay on that rank)."""
    tensors = tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), t["hash"]) for t in report["tensors"])
    parts = tuple(
        PartSpec(p["key"], p["num_bytes"], p["hash"], tuple(p["tensors"]), tuple(tuple(e) for e in p["entries"]))
        for p in report["parts"]
    )
    return StagedParts(like.version, like.publish_id, like.full, tensors, parts, {})


class LeaderBackend(TrainingBackend):
    """Rank 0's backend: each call that needs every rank first sends them the command (`RankGroup`)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.inner = group.backend

    def logprobs(self, batch: TrainBatch) -> list[np.ndarray]:
        self.group.send(LOGPROBS, encode_batch(batch))
        return self.inner.logprobs(batch)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, num_minibatches: int = 1) -> StepResult:
        if not isinstance(loss_fn, CorrectedObjective):
            raise TypeError(
                f"several trainer ranks need a CorrectedObjective loss_fn (the others rebuild it from the config), "
                f"got {type(loss_fn).__name__}"
            )
        self.group.send(
            TRAIN,
            encode_batch(batch),
            version=loss_fn.version,
            constant_tokens=loss_fn.constant_tokens,
            num_minibatches=num_minibatches,
        )
        return self.inner.train_step(batch, loss_fn, num_minibatches=num_minibatches)

    def export_weights(self, dtype: torch.dtype) -> dict[str, Tensor]:
        raise RuntimeError("several trainer ranks publish together: use RankGroup.publish")

    def export_weights_owned(self, dtype: torch.dtype, names: Collection[str] | None) -> dict[str, Tensor]:
        raise RuntimeError("several trainer ranks publish together: use RankGroup.publish")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.inner.weight_shapes()

    def state_tensors(self) -> dict[str, Tensor]:
        raise RuntimeError("several trainer ranks checkpoint together: use RankGroup.checkpoint")

    def state_meta(self) -> dict[str, Any]:
        raise RuntimeError("several trainer ranks checkpoint together: use RankGroup.checkpoint")

    def load_state(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        raise RuntimeError("several trainer ranks load together: use RankGroup.load_latest")

    def model_limits(self) -> ModelLimits:
        return self.inner.model_limits()

    def close(self) -> None:
        self.group.stop()


def follow(group: RankGroup) -> int:
    """Ranks 1..N-1: run rank 0's commands until STOP (returns 0); a failure raises (the rank exits non-zero).

    SIGINT is ignored: a terminal's Ctrl-C reaches every rank under torchrun, and rank 0 decides
    how the step ends, then sends STOP."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = group.cfg
    log.info("rank %d of %d following rank 0", group.rank, group.world_size)
    while True:
        header = json.loads(broadcast_bytes(None))
        payload = broadcast_bytes(None) if header["payload"] else b""
        command = header["command"]
        if command == STOP:
            log.info("rank %d: stop", group.rank)
            dist.barrier()  # rank 0's STOP barrier: every rank has left every collective
            return 0
        if command == TRAIN:
            objective = CorrectedObjective(cfg.correction, cfg.advantages, header["version"], header["constant_tokens"])
            group.backend.train_step(decode_batch(payload), objective, num_minibatches=header["num_minibatches"])
        elif command == LOGPROBS:
            group.backend.logprobs(decode_batch(payload))
        elif command == PUBLISH:
            group._publish_round(header["version"], header["publish_id"])
        elif command == SETTLE:
            assert group.publisher is not None
            group.publisher.settle(bool(header["committed"]))
        elif command == CHECKPOINT:
            group._checkpoint_round(header["version"], None, header["attempt"])
        elif command == LOAD:
            group._load_round(header["version"])
        else:
            raise RuntimeError(f"rank {group.rank}: unknown command {command!r} from rank 0")
