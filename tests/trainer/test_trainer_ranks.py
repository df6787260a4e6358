"""Trainer ranks (FSDP2 over gloo, real processes): one rank and two take the same step, a sharded publish
is applied bit-exactly by a generator's subscriber, and checkpoints resume exactly or resharded.

Each scenario starts real rank processes (`tests/support/ranks.py`) with the launch environment
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
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from actors.servers import open_run_store
from actors.trainer.checkpoints import (
    MANIFEST_FILE,
    checkpoint_files,
    checkpoint_prefix,
    complete_checkpoints,
    new_attempt,
)
from actors.trainer.distributed import RankEnv, launch_ranks
from actors.trainer.rank_group import decode_batch, encode_batch, owned_tensors
from infra.stack import StackState
from storage.filestore import FileStore
from storage.manifest import Manifest, manifest_key
from tests.support.builders import make_group, metrics_records, publish_groups, spawn_trainer, trainer_cfg
from tests.support.ranks import TOLERANCE, max_diff, pull, rank_batch, run_ranks
from tests.support.runs import DEMO_DEADLINE_S, PLUMBING_STEPS, run_plumbing, shared_stack_config
from tests.support.waits import wait_until

EVENT_DEADLINE_S = 90.0
"""Upper bound on waiting for an event that must happen (a checkpoint, the end of a run)."""


def test_one_and_two_ranks_take_the_same_steps_publish_and_resume_across_world_sizes(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path / "store"))
    one = run_ranks(tmp_path, 1, "one")
    two = run_ranks(tmp_path, 2, "two")
    for a, b in zip(one, two, strict=True):  # loss, grad norm (global, before the clip), entropy: the same
        assert a[:3] == pytest.approx(b[:3], rel=TOLERANCE, abs=TOLERANCE)
        assert a[3] < b[3], "two ranks report the stats of every micro-batch of both (more, smaller ones)"

    # the sharded publish: one manifest naming both ranks' parts, pulled bit-exactly (hashes checked)
    for version, kind in ((1, "full"), (2, "delta")):
        manifest = Manifest.from_json(store.get(manifest_key("two", version)), key="two")
        assert manifest.kind == kind
        assert {p.key.rsplit("/", 1)[1][:9] for p in manifest.parts} == {"part-s000", "part-s001"}
    ref1, ref2 = pull(store, "one", 1), pull(store, "one", 2, after=1)
    two1, two2 = pull(store, "two", 1), pull(store, "two", 2, after=1)
    assert max_diff(ref1, two1) < TOLERANCE and max_diff(ref2, two2) < TOLERANCE
    assert max_diff(ref1, ref2) > 100 * TOLERANCE, "the second step must move the weights measurably"

    # checkpoints: per-rank safetensors + JSON index; same world size resumes bit-exactly, others reshard
    assert complete_checkpoints(store, "two") == [1]
    ckpt = set(checkpoint_files(store, "two", 1))  # names in the manifest (under its attempt)
    assert {"index.json", "trainer_state.json", "rank-00000/model.safetensors"} <= ckpt
    assert "rank-00001/optimizer.safetensors" in ckpt
    _damaged_newer_copy(store, "two", 1, 2, "rank-00001/optimizer.safetensors")
    # every resume below skips the damaged v2 (a file of rank 1's) and loads v1
    same = run_ranks(tmp_path, 2, "two-again", load_run="two")
    assert same[0] == two[1]
    assert max_diff(pull(store, "two-again", 2), two2) == 0.0
    for nproc, source, name in ((1, "two", "two-on-one"), (2, "one", "one-on-two")):
        resumed = run_ranks(tmp_path, nproc, name, load_run=source)
        assert resumed[0][:3] == pytest.approx(one[1][:3], rel=TOLERANCE, abs=TOLERANCE)
        assert max_diff(pull(store, name, 2), ref2) < TOLERANCE


def _damaged_newer_copy(store: FileStore, run: str, version: int, newer: int, damaged: str) -> None:
    """Checkpoint `version` copied as complete checkpoint `newer` (its own attempt, the same hashes), with the
    file `damaged` then corrupted: the newest checkpoint fails its hash check on one rank."""
    manifest = orjson.loads(store.get(checkpoint_prefix(run, version) + MANIFEST_FILE))
    attempt = new_attempt()
    for name, key in checkpoint_files(store, run, version).items():
        store.put(f"{checkpoint_prefix(run, newer)}{attempt}/{name}", store.get(key))
    store.put_if_absent(
        checkpoint_prefix(run, newer) + MANIFEST_FILE, orjson.dumps({**manifest, "version": newer, "attempt": attempt})
    )
    assert complete_checkpoints(store, run)[-1] == newer
    store.put(checkpoint_files(store, run, newer)[damaged], b"bit rot")


def test_batches_cross_ranks_as_safetensors_bytes_and_come_back_equal() -> None:
    batch = rank_batch(3)
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


LISTENERS_SCRIPT = """
import json, sys, torch.distributed as dist
from actors.trainer.distributed import RankEnv, join_rank_group, leave_rank_group
from tests.support.ranks import tcp_listeners
env = RankEnv.from_environ()
join_rank_group(env, "cpu", 60)
dist.barrier()  # every rank is connected: the store is serving
if env.is_leader:
    open(sys.argv[1], "w").write(json.dumps(tcp_listeners(env.master_port)))
dist.barrier()
leave_rank_group()
"""


def test_the_nproc_rendezvous_listens_on_loopback_only(tmp_path: Path) -> None:
    # torch's own tcp:// store listens on every interface (`*:PORT`), unauthenticated, whatever MASTER_ADDR says
    out = tmp_path / "listeners.json"
    assert launch_ranks([sys.executable, "-c", LISTENERS_SCRIPT, str(out)], 2) == 0
    assert json.loads(out.read_text()) == ["127.0.0.1"]


LEAVE_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from megatron.core import parallel_state as ps
from actors.trainer.distributed import RankEnv, join_rank_group, leave_rank_group
def gloo_threads():
    return sum("gloo" in open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task"))
join_rank_group(RankEnv.from_environ(), "cpu", 60)
ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
dist.all_reduce(torch.ones(4), group=ps.get_tensor_model_parallel_group())
dist.barrier()
before = gloo_threads()
leave_rank_group()
assert not ps.model_parallel_is_initialized(), "megatron's groups outlive the rank group"
assert gloo_threads() < before / 2, (before, gloo_threads())
"""


def test_leaving_the_rank_group_destroys_megatrons_groups_before_the_interpreter_exits() -> None:
    # megatron-core keeps its TP/PP/DP groups in module globals: left alone they are destroyed during
    # interpreter finalization, after the peers' sockets are gone (a rank then dies with SIGABRT)
    assert launch_ranks([sys.executable, "-c", LEAVE_SCRIPT], 2) == 0


# ---- the real trainer: `leeway trainer --nproc 2` on the stack, a rank SIGKILLed, then --resume ------------


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).removeprefix(b"RANK="))


def _wait_for(what: str, check: Any, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Wait for `check()` (an event in the store or the metrics) while the trainer runs; fail fast if it exits."""

    def seen() -> bool:
        if check():
            return True
        assert proc.poll() is None, f"trainer exited ({proc.returncode}) before {what}:\n{log_path.read_text()[-4000:]}"
        return False

    wait_until(seen, what=what, timeout_s=EVENT_DEADLINE_S, detail=lambda: log_path.read_text()[-4000:])


def test_a_killed_rank_stops_every_rank_and_resume_trains_each_group_once(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(
        stack,
        tmp_path,
        "trainer.max_steps=4",
        "trainer.checkpoint_every=2",
        "staleness.max_staleness=64",
        "logging.level=INFO",
    )
    ids = [f"g{i}" for i in range(4 * cfg.trainer.batch_groups)]
    asyncio.run(publish_groups(cfg, [make_group(g) for g in ids[:5]]))  # two steps, and half of the third
    config_path = tmp_path / "trainer.yaml"
    config_path.write_text(cfg.to_yaml())
    log_path = tmp_path / "trainer.log"
    store = open_run_store(cfg)
    metrics = cfg.run.run_dir / "metrics.jsonl"

    proc = spawn_trainer(config_path, log_path, "--nproc", "2")
    _wait_for("the checkpoint of step 2", lambda: complete_checkpoints(store, cfg.run.name), proc, log_path)
    ranks = {_rank_of(pid): pid for pid in _children(proc.pid)}
    assert sorted(ranks) == [0, 1], ranks
    asyncio.run(publish_groups(cfg, [make_group(ids[5])]))  # step 3 can run now: kill rank 1 in it (or right after)
    os.kill(ranks[1], signal.SIGKILL)
    assert proc.wait(timeout=EVENT_DEADLINE_S) == 1
    text = log_path.read_text()
    assert f"trainer rank 1 of 2 (pid {ranks[1]}) was killed by signal SIGKILL" in text, text[-4000:]
    for pid in ranks.values():  # the launcher returns only after reaping every rank
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]

    asyncio.run(publish_groups(cfg, [make_group(g) for g in ids[6:]]))
    proc = spawn_trainer(config_path, log_path, "--resume", "--nproc", "2")
    assert proc.wait(timeout=EVENT_DEADLINE_S * 2) == 0, log_path.read_text()[-4000:]
    records = metrics_records(metrics)
    trained = [g for r in records for g in r["trained_group_ids"]]
    assert sorted(trained) == sorted(ids), f"each group trained exactly once: {trained}"
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "rank1" in log_path.read_text(), "both ranks ran the resumed trainer"


# ---- the demo through `leeway run` with two trainer ranks ------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(DEMO_DEADLINE_S + 60)
def test_the_demo_runs_through_leeway_run_with_two_trainer_ranks(
    tmp_path: Path, stack: StackState, cleanup: list[subprocess.Popen[bytes]]
) -> None:
    """`trainer.nproc: 2` through `leeway run`: the launcher starts two ranks, they take every step, publish each
    version the generators pull, checkpoint and exit 0 (`run_plumbing`). A plumbing run of `PLUMBING_STEPS` steps:
    that two ranks take the steps one rank takes is proven exactly by
    `test_one_and_two_ranks_take_the_same_steps_publish_and_resume_across_world_sizes`, and that one rank learns
    the demo by `tests/launcher/test_run.py::test_short_demo_learns_within_the_cap`."""
    cfg = shared_stack_config(tmp_path, stack, "run-demo-ranks", PLUMBING_STEPS, "trainer.nproc=2")
    run_plumbing(cfg, tmp_path, cleanup)
    trainer_log = (cfg.run.run_dir / "logs" / "trainer.log").read_text()
    assert "rank 1 of 2 following rank 0" in trainer_log, "the trainer ran as two ranks"
