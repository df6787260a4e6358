"""Trainer ranks (FSDP2 over gloo, real processes): one rank and two take the same step, a sharded publish
is applied bit-exactly by a generator's subscriber, and checkpoints resume exactly or resharded.

Each scenario starts real rank processes of this file (`_worker`, below) with the launch environment
`leeway trainer --nproc` uses; they exchange results only through the object store (safetensors
weights, JSON), never pickle.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_run
import torch
from test_run import DEMO_DEADLINE_S, ROLE_STOP_DEADLINE_S, run_demo_to_target
from test_run import _shared_stack_config as _demo_config
from test_trainer import _cfg as _stack_cfg
from test_trainer import _group, _publish, _records, _spawn

from actors.endpoints import open_run_store
from actors.trainer.checkpoints import TrainerState, complete_checkpoints
from actors.trainer.distributed import RankEnv, launch_ranks, rank_environ
from actors.trainer.rank_group import decode_batch, encode_batch, owned_tensors
from infra.process import free_port
from infra.stack import StackState
from pipeline.config import LeewayConfig
from pipeline.rl.batching import TrainSequence
from storage.filestore import FileStore
from storage.manifest import Manifest, manifest_key
from storage.weights import WeightSubscriber

cleanup = test_run.cleanup
"""`tests/test_run.py`'s fixture: processes a test started, killed with their groups if it fails half-way."""
REPO = Path(__file__).resolve().parents[1]
VOCAB = 32
MODEL = "tiny-gpt2-2x64"
"""The demo's preset: GPT-2 blocks, tied embedding and LM head."""
WORKER_TIMEOUT_S = 180
EVENT_DEADLINE_S = 90.0
"""Upper bound on waiting for an event that must happen (a checkpoint, the end of a run)."""
TOLERANCE = 1e-5
"""1 rank vs 2: the same sums in another order. AdamW divides by sqrt(v), so a gradient rounding
difference moves a weight by up to ~lr x relative rounding; lr 1e-3 keeps that well under 1e-5."""


def _cfg() -> LeewayConfig:
    return LeewayConfig.model_validate(
        {
            "run": {"name": "ranks", "seed": 0},
            "model": {"name_or_path": MODEL, "dtype": "float32"},
            "trainer": {"lr": 1e-3, "grad_clip": 0.5, "micro_batch_tokens": 48, "minibatches": 2},
            "advantages": {"group_size": 2, "loss_norm": "token_mean"},
            "weights": {"full_every": 50, "part_bytes": 8192},
        }
    )


def _batch(seed: int) -> Any:
    from actors.trainer.backends import TrainBatch

    rng = np.random.default_rng(seed)
    seqs = []
    for n in (9, 17, 5, 12, 30, 7, 4):  # uneven: the ranks get different micro-batch counts
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


def _worker(store_root: str, run: str, load_run: str | None, out: str) -> None:
    """One rank: [load `load_run`'s checkpoint |] step on batch 1, publish v1, checkpoint, step on batch 2, publish v2."""
    from actors.models import build_model
    from actors.trainer.backends import build_backend
    from actors.trainer.checkpoints import load_latest_checkpoint, write_checkpoint
    from actors.trainer.distributed import join_rank_group, leave_rank_group
    from actors.trainer.objective import CorrectedObjective
    from actors.trainer.rank_group import LeaderBackend, RankGroup, RankRoundError, follow
    from actors.trainer.sessions import build_weight_publisher

    torch.set_num_threads(1)
    rank_env = RankEnv.from_environ()
    join_rank_group(rank_env, "cpu", WORKER_TIMEOUT_S)
    base = _cfg()
    cfg = base.model_copy(update={"run": base.run.model_copy(update={"name": run})})
    model = build_model(MODEL, vocab_size=VOCAB, seed=0)
    backend = build_backend(cfg, model)
    store = (
        FileStore(store_root) if load_run or rank_env.rank == 0 else _FailOnce(store_root, f"{run}/weights/v00000002/")
    )
    publisher = build_weight_publisher(cfg, store, model)  # publishes `run`; the group checkpoints/loads:
    ckpt_cfg = base.model_copy(update={"run": base.run.model_copy(update={"name": load_run or run})})
    group = RankGroup(ckpt_cfg, backend, store, publisher) if rank_env.distributed else None
    try:
        if group is not None and not rank_env.is_leader:
            follow(group)
            return
        lead = LeaderBackend(group) if group is not None else backend

        def objective(version: int) -> CorrectedObjective:
            return CorrectedObjective(cfg.correction, cfg.advantages, version, constant_tokens=64)

        def publish(version: int) -> None:
            if group is not None and version == 2 and load_run is None:  # rank 1's first store of v2 fails
                with pytest.raises(RankRoundError, match="rank 1 could not store its parts"):
                    group.publish(version)
                left = store.list(f"{run}/weights/v00000002/")
                assert left == [], f"no manifest, every rank's parts deleted: {left}"
                group.publish(version)  # a retry is a fresh round
            elif group is not None:
                group.publish(version)
            else:
                publisher.publish(version, backend.export_weights(torch.float32))

        losses = []
        if load_run is None:
            r1 = lead.train_step(_batch(1), objective(0), num_minibatches=2)
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
        r2 = lead.train_step(_batch(2), objective(1), num_minibatches=2)
        losses.append([r2.loss, r2.grad_norm, r2.entropy_mean, len(r2.micro_stats)])
        publish(2)
        Path(out).write_text(json.dumps(losses))
    finally:
        if group is not None and rank_env.is_leader:
            group.stop()
        publisher.close()
        leave_rank_group()


class _FailOnce(FileStore):
    """A store whose first write under `prefix` fails (a store blip on one rank)."""

    def __init__(self, root: str, prefix: str) -> None:
        super().__init__(root)
        self.prefix, self.failed = prefix, False

    def put(self, key: str, data: bytes) -> str:
        if key.startswith(self.prefix) and not self.failed:
            self.failed = True
            raise OSError(f"injected failure storing {key}")
        return super().put(key, data)


def _run_ranks(tmp_path: Path, nproc: int, run: str, load_run: str | None = None) -> list[list[float]]:
    """Start `nproc` ranks of `_worker`, wait for all; rank 0's losses."""
    out = tmp_path / f"{run}.json"
    port = free_port()
    # faulthandler: a rank that aborts natively (SIGABRT from C++) still shows its Python stack
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONFAULTHANDLER="1")
    procs = []
    for rank in range(nproc):
        env = rank_environ(base, rank, nproc, port) if nproc > 1 else base
        argv = [sys.executable, __file__, str(tmp_path / "store"), run, load_run or "-", str(out)]
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=WORKER_TIMEOUT_S)[0].decode(errors="replace") for p in procs]
    for rank, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} of {run}:\n{text[-4000:]}"
    return json.loads(out.read_text())


def _pull(store: FileStore, run: str, version: int, *, after: int | None = None) -> dict[str, torch.Tensor]:
    """What a generator holds after pulling `version` (from `after`, so a delta applies; every tensor's
    hash is checked by the subscriber)."""
    with WeightSubscriber(store, run) as sub:
        if after is not None:
            sub.pull(after)
            assert sub.version == after
        sub.pull(version)
        assert sub.version == version
        return {n: t.clone() for n, t in sub.tensors.items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_one_and_two_ranks_take_the_same_steps_publish_and_resume_across_world_sizes(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path / "store"))
    one = _run_ranks(tmp_path, 1, "one")
    two = _run_ranks(tmp_path, 2, "two")
    for a, b in zip(one, two, strict=True):  # loss, grad norm (global, before the clip), entropy: the same
        assert a[:3] == pytest.approx(b[:3], rel=TOLERANCE, abs=TOLERANCE)
        assert a[3] < b[3], "two ranks report the stats of every micro-batch of both (more, smaller ones)"

    # the sharded publish: one manifest naming both ranks' parts, pulled bit-exactly (hashes checked)
    for version, kind in ((1, "full"), (2, "delta")):
        manifest = Manifest.from_json(store.get(manifest_key("two", version)), key="two")
        assert manifest.kind == kind
        assert {p.key.rsplit("/", 1)[1][:9] for p in manifest.parts} == {"part-s000", "part-s001"}
    ref1, ref2 = _pull(store, "one", 1), _pull(store, "one", 2, after=1)
    two1, two2 = _pull(store, "two", 1), _pull(store, "two", 2, after=1)
    assert _max_diff(ref1, two1) < TOLERANCE and _max_diff(ref2, two2) < TOLERANCE
    assert _max_diff(ref1, ref2) > 100 * TOLERANCE, "the second step must move the weights measurably"

    # checkpoints: per-rank safetensors + JSON index; same world size resumes bit-exactly, others reshard
    assert complete_checkpoints(store, "two") == [1]
    ckpt = {k.rsplit("checkpoints/v00000001/", 1)[1] for k in store.list("two/checkpoints/")}
    assert {"index.json", "manifest.json", "trainer_state.json", "rank-00000/model.safetensors"} <= ckpt
    assert "rank-00001/optimizer.safetensors" in ckpt
    same = _run_ranks(tmp_path, 2, "two-again", load_run="two")
    assert same[0] == two[1]
    assert _max_diff(_pull(store, "two-again", 2), two2) == 0.0
    for nproc, source, name in ((1, "two", "two-on-one"), (2, "one", "one-on-two")):
        resumed = _run_ranks(tmp_path, nproc, name, load_run=source)
        assert resumed[0][:3] == pytest.approx(one[1][:3], rel=TOLERANCE, abs=TOLERANCE)
        assert _max_diff(_pull(store, name, 2), ref2) < TOLERANCE


def test_batches_cross_ranks_as_safetensors_bytes_and_come_back_equal() -> None:
    batch = _batch(3)
    again = decode_batch(encode_batch(batch))
    assert len(again.sequences) == len(batch.sequences)
    for a, b in zip(batch.sequences, again.sequences, strict=True):
        assert a.sample_id == b.sample_id
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(np.asarray(a.loss_mask) != 0, b.loss_mask != 0)
        np.testing.assert_array_equal(a.behaviour_logprobs, b.behaviour_logprobs)
        np.testing.assert_array_equal(a.versions, b.versions)
        np.testing.assert_array_equal(a.advantages_per_token(), b.advantages_per_token())


def test_each_tensor_is_published_by_exactly_one_rank_balanced_by_size() -> None:
    shapes = {"a": (100, 10), "b": (60, 10), "c": (50, 10), "d": (10,), "e": (3, 3)}
    owned = owned_tensors(shapes, 2)
    assert owned[0] | owned[1] == set(shapes) and not owned[0] & owned[1]
    assert owned == owned_tensors(dict(reversed(shapes.items())), 2), "the split depends on the shapes only"
    assert owned_tensors(shapes, 1) == [set(shapes)]


def test_the_launch_environment_is_read_with_clear_errors() -> None:
    assert not RankEnv.from_environ({}).distributed
    env = RankEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (1, 2, 1, 29500) and not env.is_leader
    with pytest.raises(ValueError, match="RANK"):
        RankEnv.from_environ({"WORLD_SIZE": "2", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="MASTER_PORT='x'"):
        RankEnv.from_environ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "x"})
    with pytest.raises(ValueError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        RankEnv.from_environ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_PORT": "1"})


def test_the_launcher_stops_the_other_ranks_when_one_fails_and_names_it(capfd: pytest.CaptureFixture[str]) -> None:
    # rank 1 fails at once; rank 0 would wait forever (as a rank left in a collective) until stopped
    script = "import os, signal, sys\nif os.environ['RANK'] == '1': sys.exit(3)\nsignal.pause()"
    assert launch_ranks([sys.executable, "-c", script], 2) == 1
    err = capfd.readouterr().err
    assert "trainer rank 1 of 2 (pid " in err and ") exited with status 3; stopping the other ranks" in err
    assert launch_ranks([sys.executable, "-c", "import os; assert os.environ['MASTER_ADDR'] == '127.0.0.1'"], 2) == 0


# ---- the real trainer: `leeway trainer --nproc 2` on the stack, a rank SIGKILLed, then --resume ------------


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).removeprefix(b"RANK="))


def _wait_for(what: str, check: Any, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Wait for `check()` (an event in the store or the metrics) while the trainer runs; fail fast if it exits."""
    deadline = time.monotonic() + EVENT_DEADLINE_S
    while not check():
        assert proc.poll() is None, f"trainer exited ({proc.returncode}) before {what}:\n{log_path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {EVENT_DEADLINE_S} s:\n{log_path.read_text()[-4000:]}"
        time.sleep(0.05)


def test_a_killed_rank_stops_every_rank_and_resume_trains_each_group_once(stack: StackState, tmp_path: Path) -> None:
    cfg = _stack_cfg(
        stack,
        tmp_path,
        "trainer.max_steps=4",
        "trainer.checkpoint_every=2",
        "staleness.max_staleness=1000",
        "logging.level=INFO",
    )
    ids = [f"g{i}" for i in range(4 * cfg.trainer.batch_groups)]
    asyncio.run(_publish(cfg, [_group(g) for g in ids[:5]]))  # two steps, and half of the third
    config_path = tmp_path / "trainer.yaml"
    config_path.write_text(cfg.to_yaml())
    log_path = tmp_path / "trainer.log"
    store = open_run_store(cfg)
    metrics = cfg.run.run_dir / "metrics.jsonl"

    proc = _spawn(config_path, log_path, "--nproc", "2")
    _wait_for("the checkpoint of step 2", lambda: complete_checkpoints(store, cfg.run.name), proc, log_path)
    ranks = {_rank_of(pid): pid for pid in _children(proc.pid)}
    assert sorted(ranks) == [0, 1], ranks
    asyncio.run(_publish(cfg, [_group(ids[5])]))  # step 3 can run now: kill rank 1 in it (or right after)
    os.kill(ranks[1], signal.SIGKILL)
    assert proc.wait(timeout=EVENT_DEADLINE_S) == 1
    text = log_path.read_text()
    assert f"trainer rank 1 of 2 (pid {ranks[1]}) was killed by signal SIGKILL" in text, text[-4000:]
    for pid in ranks.values():  # the launcher returns only after reaping every rank
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]

    asyncio.run(_publish(cfg, [_group(g) for g in ids[6:]]))
    proc = _spawn(config_path, log_path, "--resume", "--nproc", "2")
    assert proc.wait(timeout=EVENT_DEADLINE_S * 2) == 0, log_path.read_text()[-4000:]
    records = _records(metrics)
    trained = [g for r in records for g in r["trained_group_ids"]]
    assert sorted(trained) == sorted(ids), f"each group trained exactly once: {trained}"
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "rank1" in log_path.read_text(), "both ranks ran the resumed trainer"


# ---- the demo through `leeway run` with two trainer ranks ------------------------------------------------


DEMO_STEPS_FULL = 300
"""`configs/demo.yaml`'s 250 steps plus a margin; one rank crosses 0.8 after ~160-210 steps. The run is
stopped once it has (`run_demo_to_target`), so the margin costs nothing when it is not needed."""
DEMO_TARGET = 0.8
"""The demo's mean reward over WINDOW steps must reach this within the demo's steps (as one rank does)."""
WINDOW = 10


@pytest.mark.slow
@pytest.mark.timeout(DEMO_DEADLINE_S + ROLE_STOP_DEADLINE_S + 60)
def test_the_demo_learns_with_two_trainer_ranks(
    tmp_path: Path, stack: StackState, cleanup: list[subprocess.Popen[bytes]]
) -> None:
    cfg = _demo_config(tmp_path, stack, "run-demo-ranks", DEMO_STEPS_FULL, "trainer.nproc=2")
    run_demo_to_target(cfg, tmp_path, cleanup, DEMO_TARGET, WINDOW)
    trainer_log = (cfg.run.run_dir / "logs" / "trainer.log").read_text()
    assert "rank 1 of 2 following rank 0" in trainer_log, "the trainer ran as two ranks"


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], None if sys.argv[3] == "-" else sys.argv[3], sys.argv[4])
