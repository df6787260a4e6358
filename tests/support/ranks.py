"""Trainer rank processes for the ranks tests: each rank steps, publishes through the `RankGroup` and
checkpoints, on the torch backend (FSDP2 over gloo) or the megatron one (TP, PP, DP over gloo).

`run_ranks` starts `nproc` real processes of this module (`python -m tests.support.ranks ...`) with the
launch environment `leeway trainer --nproc` uses; they exchange results only through the object store
(safetensors weights, JSON), never pickle. The layout (backend, TP and PP sizes) travels on the command line.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from actors.trainer.distributed import RankEnv, rank_environ
from infra.ports import free_port
from pipeline.config import LeewayConfig
from pipeline.rl.batching import TrainSequence
from storage.filestore import FileStore
from storage.objectstore import ObjectStore
from storage.weights import WeightSubscriber
from tests.support.builders import REPO, Backend
from tests.support.stores import FaultyStore

VOCAB = 32
MODEL = "tiny-gpt2-2x64"
"""The demo's preset: GPT-2 blocks, tied embedding and LM head."""
WORKER_TIMEOUT_S = 180
TOLERANCE = 1e-5
"""1 rank vs 2: the same sums in another order. AdamW divides by sqrt(v) + eps, so a gradient rounding difference
``d`` moves a weight by up to ~lr x d / (|g| + eps): lr x relative rounding for a clear gradient, but up to lr x d / eps
for an element whose gradient is near zero. lr 1e-3 and eps 1e-6 (`ranks_cfg`) keep both well under 1e-5 (with the
default eps 1e-8 one near-zero element of an MLP weight moved 4e-5 between TP=1 and TP=2 once the presets' heads
became 32 wide: rounding, while loss and gradient norm agreed to 1e-5)."""


@dataclass(frozen=True)
class RankLayout:
    """What the ranks run: `trainer.backend`, and megatron's tensor and pipeline parallel sizes (DP: the rest)."""

    backend: Backend = "torch"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def argv(self) -> list[str]:
        return [self.backend, str(self.tensor_parallel_size), str(self.pipeline_parallel_size)]

    @classmethod
    def from_argv(cls, argv: list[str]) -> RankLayout:
        backend, tp, pp = argv
        assert backend in ("torch", "megatron"), backend
        return cls(backend, int(tp), int(pp))  # type: ignore[arg-type]


def ranks_cfg(layout: RankLayout = RankLayout(), run: str = "ranks") -> LeewayConfig:
    """The ranks' config: the demo's GPT-2 preset, 2 minibatches of 48-token micro-batches, tiny weight parts."""
    data: dict[str, Any] = {
        "run": {"name": run, "seed": 0},
        "model": {"name_or_path": MODEL, "dtype": "float32"},
        "trainer": {
            "lr": 1e-3,
            "adam_eps": 1e-6,
            "grad_clip": 0.5,
            "micro_batch_tokens": 48,
            "minibatches": 2,
            "backend": layout.backend,
        },
        "advantages": {"group_size": 2, "loss_norm": "token_mean"},
        "weights": {"full_every": 50, "part_bytes": 8192},
    }
    if layout.backend == "megatron":
        data["megatron"] = {
            "tensor_parallel_size": layout.tensor_parallel_size,
            "pipeline_parallel_size": layout.pipeline_parallel_size,
        }
    return LeewayConfig.model_validate(data)


def rank_batch(seed: int) -> Any:
    """Seven sequences of uneven lengths (the ranks get different micro-batch counts), random advantages."""
    from actors.trainer.backends import TrainBatch

    rng = np.random.default_rng(seed)
    seqs = []
    for n in (9, 17, 5, 12, 30, 7, 4):
        mask = np.zeros(n, np.uint8)
        mask[3:] = 1
        seqs.append(
            TrainSequence(
                tokens=rng.integers(0, VOCAB, n).astype(np.int32),
                loss_mask=mask,
                behaviour_logprobs=np.where(mask == 1, -rng.uniform(2.0, 3.5, n), 0.0).astype(np.float32),
                versions=np.where(mask == 1, 0, -1).astype(np.int32),
                advantage=float(rng.normal()),
                sample_id=f"s{seed}-{n}",
            )
        )
    return TrainBatch(tuple(seqs))


def _fail_first_put_under(prefix: str) -> Any:
    """A `FaultyStore` fault: the first `put` under `prefix` fails (a store blip on one rank)."""
    failed: list[str] = []

    def fault(method: str, key: str) -> BaseException | None:
        if method == "put" and key.startswith(prefix) and not failed:
            failed.append(key)
            return OSError(f"injected failure storing {key}")
        return None

    return fault


def _fail_once_past_the_manifest(run: str) -> Any:
    """A `FaultyStore` fault for rank 0: reading back v1's manifest (after it was written) fails once, and
    the compare-and-swap of LATEST to v2 fails once; either leaves a committed version a retry must adopt."""
    failed: list[str] = []
    manifest_v1 = f"{run}/weights/v00000001/manifest.json"

    def fault(method: str, key: str) -> BaseException | None:
        if key == manifest_v1 and method == "put_if_absent":
            failed.append("manifest written")
        elif key == manifest_v1 and method == "get_with_etag" and failed == ["manifest written"]:
            failed.append(key)
            return ConnectionError(f"injected: reading back {key} failed once")
        elif key == f"{run}/weights/LATEST" and method == "put_if_match" and "LATEST" not in failed:
            failed.append("LATEST")
            return ConnectionError("injected: moving LATEST failed once")
        return None

    return fault


def worker(store_root: str, run: str, load_run: str | None, out: str, layout: RankLayout) -> None:
    """One rank: [load `load_run`'s checkpoint |] step on batch 1, publish v1, checkpoint, step on batch 2, publish v2
    (the caller leaves the rank group, once this frame and its backend are gone).

    When two ranks train from scratch, rank 0's read-back of the v1 manifest fails once (the retry settles the
    commit: every rank adopts its share, so v2 is a delta), rank 1's first store of v2 fails (the round fails
    naming it, leaves no part behind, and a retry publishes v2), and rank 0's move of LATEST to v2 fails once
    (the retry only advances LATEST). Rank 0 writes its losses to `out` as JSON."""
    from actors.models import build_model
    from actors.trainer.backends import build_backend
    from actors.trainer.checkpoints import TrainerState, load_latest_checkpoint, write_checkpoint
    from actors.trainer.distributed import join_rank_group
    from actors.trainer.objective import CorrectedObjective
    from actors.trainer.rank_group import LeaderBackend, RankGroup, RankRoundError, follow
    from actors.trainer.sessions import build_weight_publisher

    torch.set_num_threads(1)
    rank_env = RankEnv.from_environ()
    join_rank_group(rank_env, "cpu", WORKER_TIMEOUT_S)
    cfg = ranks_cfg(layout, run)
    model = build_model(MODEL, vocab_size=VOCAB, seed=0)
    backend = build_backend(cfg, model)
    store: ObjectStore = FileStore(store_root)
    if not load_run and rank_env.distributed:
        fault = _fail_once_past_the_manifest(run) if rank_env.is_leader else None
        store = FaultyStore(store, fault or _fail_first_put_under(f"{run}/weights/v00000002/"))
    publisher = build_weight_publisher(cfg, store, model)  # publishes `run`; the group checkpoints/loads:
    ckpt_cfg = ranks_cfg(layout, load_run or run)
    group = RankGroup(ckpt_cfg, backend, store, publisher) if rank_env.distributed else None
    try:
        if group is not None and not rank_env.is_leader:
            follow(group)
            return
        lead = LeaderBackend(group) if group is not None else backend

        def objective(version: int) -> CorrectedObjective:
            return CorrectedObjective(cfg.correction, cfg.advantages, version, constant_tokens=64)

        def publish(version: int) -> None:
            if group is not None and version == 1 and load_run is None:  # the manifest's read-back fails once
                with pytest.raises(ConnectionError, match="reading back"):
                    group.publish(version)
                group.publish(version)  # the retry settles the commit (SETTLE), then moves LATEST
            elif group is not None and version == 2 and load_run is None:  # rank 1's first store of v2 fails
                with pytest.raises(RankRoundError, match="rank 1 could not store its parts"):
                    group.publish(version)
                left = store.list(f"{run}/weights/v00000002/")
                assert left == [], f"no manifest, every rank's parts deleted: {left}"
                with pytest.raises(ConnectionError, match="moving LATEST"):
                    group.publish(version)  # a retry is a fresh round; its LATEST swap fails once
                group.publish(version)  # the version is committed: this retry only advances LATEST
            elif group is not None:
                group.publish(version)
            else:
                publisher.publish(version, backend.export_weights(torch.float32))

        losses = []
        if load_run is None:
            r1 = lead.train_step(rank_batch(1), objective(0), num_minibatches=2)
            losses.append([r1.loss, r1.grad_norm, r1.entropy_mean, len(r1.micro_stats)])
            publish(1)
            state = TrainerState(step=1, version=1)
            if group is not None:
                group.checkpoint(state)
            else:
                write_checkpoint(store, run, state, backend.state_tensors(), backend.state_meta())
        elif group is not None:
            assert group.load_latest() is not None
        else:
            loaded = load_latest_checkpoint(store, load_run)
            assert loaded is not None
            backend.load_state(loaded[1], loaded[2])
        r2 = lead.train_step(rank_batch(2), objective(1), num_minibatches=2)
        losses.append([r2.loss, r2.grad_norm, r2.entropy_mean, len(r2.micro_stats)])
        publish(2)
        Path(out).write_text(json.dumps(losses))
    finally:
        if group is not None and rank_env.is_leader:
            group.stop()
        publisher.close()


def run_ranks(
    tmp_path: Path, nproc: int, run: str, load_run: str | None = None, layout: RankLayout = RankLayout()
) -> list[list[float]]:
    """Start `nproc` ranks of `worker` on the store in `tmp_path/store`, wait for all; rank 0's losses."""
    out = tmp_path / f"{run}.json"
    port = free_port()
    # faulthandler: a rank that aborts natively (SIGABRT from C++) still shows its Python stack
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONFAULTHANDLER="1")
    argv = [sys.executable, "-m", __name__, str(tmp_path / "store"), run, load_run or "-", str(out), *layout.argv()]
    procs = []
    for rank in range(nproc):
        env = rank_environ(base, rank, nproc, port) if nproc > 1 else base
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=WORKER_TIMEOUT_S)[0].decode(errors="replace") for p in procs]
    for rank, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} of {run}:\n{text[-4000:]}"
    return json.loads(out.read_text())


def tcp_listeners(port: int) -> list[str]:
    """The local addresses this machine listens on at TCP `port` (`/proc/net/tcp` and `tcp6`), e.g.
    ``["127.0.0.1"]``; ``"0.0.0.0"`` or ``"::"`` mean every interface."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr_hex)
            # the kernel prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(str(ipaddress.ip_address(words)))
    return found


def pull(store: FileStore, run: str, version: int, *, after: int | None = None) -> dict[str, torch.Tensor]:
    """What a generator holds after pulling `version` (from `after`, so a delta applies; every tensor's
    hash is checked by the subscriber)."""
    with WeightSubscriber(store, run) as sub:
        if after is not None:
            sub.pull(after)
            assert sub.version == after
        sub.pull(version)
        assert sub.version == version
        return {n: t.clone() for n, t in sub.tensors.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


if __name__ == "__main__":  # one rank of `run_ranks`
    store_root, run, load_run, out, *layout_argv = sys.argv[1:]
    try:
        worker(store_root, run, None if load_run == "-" else load_run, out, RankLayout.from_argv(layout_argv))
    finally:  # once the worker's frame (its backend, which holds the groups) is gone
        from actors.trainer.distributed import leave_rank_group

        leave_rank_group()
