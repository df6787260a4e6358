"""The trainer loop against real NATS and S3 (training, the cap, versions out, acks, resume, replay), the
sessions' server-free parts, and the golden loss."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from actors.models import build_model
from actors.servers import open_run_store, resolve_servers
from actors.trainer.backends import LossFn, StepResult, TrainBatch, TrainingBackend, build_backend
from actors.trainer.checkpoints import RecentIds, TrainerState, complete_checkpoints
from actors.trainer.loop import Trainer
from actors.trainer.objective import CorrectedObjective
from actors.trainer.replay_session import ReplaySession
from actors.trainer.runtime import open_trainer
from actors.trainer.session_protocol import RunLink
from actors.trainer.sessions import LiveSession
from infra.stack import StackState
from pipeline.config import LeewayConfig, load_config
from pipeline.rl.batching import GroupPolicy, prepare_group
from pipeline.wire.announce import version_kv, watch_announcements
from pipeline.wire.jetstream import connect
from pipeline.wire.names import RunNames
from pipeline.wire.prompt_queue import PromptLease, PromptQueue
from pipeline.wire.replay import ReplayReader, ReplaySelection
from pipeline.wire.trajectory import TrajectoryGroup
from storage.filestore import FileStore
from storage.objectstore import ObjectNotFound, ObjectStore
from storage.weights import list_versions
from tests.support.builders import (
    BACKENDS,
    Backend,
    live_trainer,
    make_group,
    make_sample,
    metrics_records,
    publish_groups,
    run_trainer,
    spawn_trainer,
    trainer_cfg,
)
from tests.support.fakes import WrappedBackend

# ---- integration: train, cap, versions out, acks after publish --------------------------------------------


class _RecordingBackend(WrappedBackend):
    """The real backend, noting which samples reach the loss (a loss mask with any 1) on their way in."""

    def __init__(self, inner: TrainingBackend) -> None:
        self.inner = inner
        self.trained_sample_ids: list[str] = []

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, num_minibatches: int = 1) -> StepResult:
        self.trained_sample_ids += [s.sample_id for s in batch.sequences if s.loss_mask.any()]
        return self.inner.train_step(batch, loss_fn, num_minibatches=num_minibatches)


async def _watch_acks(nc: NatsClient, cfg: LeewayConfig, store: ObjectStore, acks: dict[int, int]) -> None:
    """Record, for each trajectory ack the trainer sends, the store's LATEST at the moment it is seen.

    Acks are plain messages on `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...`, so a second
    subscriber sees them; the callback reads the store before the event loop runs anything else.
    """
    names = RunNames.for_run(cfg.run.name)

    async def on_ack(msg: Msg) -> None:
        if msg.data in (b"", b"+ACK"):  # not -NAK / +WPI
            acks[int(msg.subject.split(".")[5])] = _latest(store, cfg.run.name)

    await nc.subscribe(f"$JS.ACK.{names.trajectory_stream}.{names.trainer_consumer}.>", cb=on_ack)


def test_groups_are_trained_stale_ones_dropped_and_versions_published(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(stack, tmp_path, "staleness.max_staleness=1", "trainer.max_steps=3")
    # step 1 at V0: a, b | step 2 at V1: c, d | step 3 at V2: stale (v0, staleness 2 > 1), same (filtered), e, f
    groups = [
        make_group("a"),
        make_group("b"),
        make_group("c"),
        make_group("d", version=1),
        make_group("stale", version=0),
        make_group("same", version=2, rewards=(1.0, 1.0)),
        make_group("e", version=2),
        make_group("f", version=1),
    ]
    step_of_seq = {1: 1, 2: 1, 3: 2, 4: 2, 5: 3, 6: 3, 7: 3, 8: 3}  # stream seq -> the step that consumes it
    store = open_run_store(cfg)
    names = RunNames.for_run(cfg.run.name)

    async def scenario() -> tuple[list[str], list[int], dict[int, int], Any]:
        await publish_groups(cfg, groups)
        nc = await connect(resolve_servers(cfg).nats_url, name="test-watch")
        kv = await version_kv(nc.jetstream(), names)
        announced: list[int] = []
        acks: dict[int, int] = {}

        async def watch() -> None:
            async for version, _ in watch_announcements(kv):
                announced.append(version)

        watcher = asyncio.create_task(watch())
        await _watch_acks(nc, cfg, store, acks)
        trainer = await live_trainer(cfg, wrap_backend=_RecordingBackend)
        await asyncio.wait_for(trainer.run(), timeout=90)
        await nc.flush()
        deadline = time.monotonic() + 5
        while (3 not in announced or len(acks) < len(groups)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        info = await nc.jetstream().consumer_info(names.trajectory_stream, names.trainer_consumer)
        await nc.drain()
        assert isinstance(trainer.backend, _RecordingBackend)
        return trainer.backend.trained_sample_ids, announced, acks, info

    trained_sample_ids, announced, acks, info = asyncio.run(scenario())
    records = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and [r["version"] for r in records] == [1, 2, 3]
    assert [r["trained_group_ids"] for r in records] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert records[2]["dropped_group_ids"] == {"stale": "staleness_cap", "same": "no_disagreement"}
    assert records[2]["samples/dropped_by_cap"] == 2 and records[2]["samples/dropped_by_filter"] == 2
    assert records[2]["staleness/max"] == 2
    assert not any(s.startswith(("stale:", "same:")) for s in trained_sample_ids)
    assert len(trained_sample_ids) == 12
    # every group acked: trainable ones only once the version trained on them was in the store, dropped ones
    # (seqs 5, 6) as soon as they were decided, before the step that consumed them was published
    assert set(acks) == set(step_of_seq)
    dropped_seqs = {5, 6}
    assert all(acks[seq] >= step for seq, step in step_of_seq.items() if seq not in dropped_seqs), acks
    assert all(acks[seq] < step_of_seq[seq] for seq in dropped_seqs), f"LATEST at each ack: {acks}"
    assert info.ack_floor.stream_seq == len(groups) and info.num_ack_pending == 0 and info.num_pending == 0
    assert sorted(set(announced)) == [0, 1, 2, 3]
    assert list_versions(store, cfg.run.name)[-4:] == [0, 1, 2, 3]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
    assert all(r["trainer/skipped_minibatches"] == 0 for r in records)


def test_masked_tokens_policy_keeps_the_fresh_samples(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(
        stack, tmp_path, "staleness.max_staleness=0", "staleness.policy=mask_tokens", "trainer.max_steps=2"
    )
    # step 2 runs at V1 with K=0: "mix" keeps only its fresh sample, so its valid samples cannot disagree
    mix = TrajectoryGroup.from_samples(
        group_id="mix", prompt_id="mix", generator_id="t", samples=[make_sample(1.0, 1, 1), make_sample(0.0, 0, 2)]
    )
    future = make_group("future", version=5)  # newer than any version the trainer published: refused, not fatal
    groups = [make_group("a"), make_group("b"), mix, future, make_group("c", version=1), make_group("d", version=1)]
    asyncio.run(publish_groups(cfg, groups))
    asyncio.run(run_trainer(cfg))
    records = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert [r["trained_group_ids"] for r in records] == [["a", "b"], ["c", "d"]]
    assert records[1]["dropped_group_ids"] == {"mix": "staleness_cap", "future": "invalid"}


def test_filtered_groups_refill_admission_before_the_stream_runs_dry(stack: StackState, tmp_path: Path) -> None:
    """Low water: while groups keep arriving, the slots of filtered ones are refilled, not only once a fetch
    comes back empty (at a saturated reward nearly every group is filtered and the generators ran dry)."""
    cfg = trainer_cfg(stack, tmp_path, "staleness.max_staleness=1", "trainer.max_steps=1")
    # (K + 1) * B = 4 admitted at step 0; three agree (filtered), then two train
    groups = [make_group(f"same{i}", rewards=(1.0, 1.0)) for i in range(3)] + [make_group("a"), make_group("b")]
    fetches: list[tuple[int, int]] = []  # (prompts admitted when the fetch began, groups it returned)

    async def scenario() -> Trainer:
        await publish_groups(cfg, groups)
        trainer = await live_trainer(cfg)
        fetch = trainer.session.fetch

        async def recording_fetch(*, max_groups: int, timeout_s: float) -> Any:
            admitted = trainer.state.admitted
            got = await fetch(max_groups=max_groups, timeout_s=timeout_s)
            fetches.append((admitted, len(got)))
            return got

        trainer.session.fetch = recording_fetch  # type: ignore[method-assign]
        await asyncio.wait_for(trainer.run(), timeout=90)
        return trainer

    trainer = asyncio.run(scenario())
    records = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert [r["trained_group_ids"] for r in records] == [["a", "b"]]
    assert set(records[0]["dropped_group_ids"]) == {"same0", "same1", "same2"}
    assert fetches[0][0] == 4, fetches
    assert trainer.state.admitted == 4 + 3, "every filtered group's slot refilled"
    refilled_mid_stream = [i for i in range(1, len(fetches)) if fetches[i - 1][1] > 0 and fetches[i][0] > 4]
    assert refilled_mid_stream, f"admission waited for an empty fetch: {fetches}"


def test_stop_request_gives_groups_back_and_writes_a_final_checkpoint(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(
        stack, tmp_path, "trainer.max_steps=10", "trainer.checkpoint_every=50", "staleness.max_staleness=1"
    )
    asyncio.run(publish_groups(cfg, [make_group("a"), make_group("b"), make_group("c")]))
    names = RunNames.for_run(cfg.run.name)
    metrics_path = cfg.run.run_dir / "metrics.jsonl"

    async def scenario() -> list[PromptLease]:
        nc = await connect(resolve_servers(cfg).nats_url, name="test-prompts")
        js = nc.jetstream()
        trainer = await open_trainer(cfg)
        session = trainer.session
        assert isinstance(session, LiveSession)
        task = asyncio.create_task(trainer.run())
        # step 1 is written and "c" is held for step 2: held by the session's consumer, not merely delivered
        # (a message still in the client's buffer is not the trainer's yet, and no nak can reach it)
        while not (metrics_path.exists() and metrics_records(metrics_path) and session.consumer.held_seqs):
            assert not task.done(), task
            await asyncio.sleep(0.02)
        trainer.stop.set()
        assert await asyncio.wait_for(task, timeout=30) == 0
        # "c" was given back: the durable consumer hands it out again at once, not after its 600 s ack wait
        sub = await js.pull_subscribe_bind(names.trainer_consumer, stream=names.trajectory_stream)
        try:
            again = await sub.fetch(1, timeout=5)
        except asyncio.TimeoutError:  # nats-py's TimeoutError is one
            again = []
        assert [(m.metadata.sequence.stream, m.metadata.num_delivered) for m in again] == [(3, 2)]
        await sub.unsubscribe()
        queue = PromptQueue(js, names, cfg.stream)
        leases = await queue.take(max_prompts=100, timeout_s=1.0)
        await queue.close()
        await nc.drain()
        return leases

    leases = asyncio.run(scenario())
    assert complete_checkpoints(open_run_store(cfg), cfg.run.name) == [1]
    records = metrics_records(metrics_path)
    assert [r["trained_group_ids"] for r in records] == [["a", "b"]]
    # admission: (K + 1) * batch_groups prompts at version 0, then more once step 1 was published
    versions = [lease.prompt.policy_version for lease in leases]
    assert versions[:4] == [0, 0, 0, 0] and len({lease.prompt.prompt_id for lease in leases}) == len(leases) >= 4


# ---- sessions: the parts that need no server ---------------------------------------------------------------


def _replay_session(tmp_path: Path, *overrides: str) -> ReplaySession:
    """A replay session on a never-connected client and a local store: any I/O it attempted would fail."""
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "staleness.max_staleness=2", *overrides], environ={})
    nc = NatsClient()
    names = RunNames.for_run(cfg.run.name)
    link = RunLink(names, nc, nc.jetstream(), FileStore(str(tmp_path / "store")))
    reader = ReplayReader(link.js, names, cfg.stream, link.store, ReplaySelection(from_seq=1))
    return ReplaySession(cfg, link, reader)


def test_replay_counts_staleness_against_the_newest_version_recorded_so_far(tmp_path: Path) -> None:
    session = _replay_session(tmp_path)
    assert session.current_version(trainer_version=0) == 0
    assert session.cap_version(make_group("a", version=3), trainer_version=0) == 3
    assert session.cap_version(make_group("b", version=1), trainer_version=7) == 3  # the trainer's own is ignored
    assert session.current_version(trainer_version=7) == 3
    assert session.staleness_cap == 2
    assert _replay_session(tmp_path, "staleness.cap_in_replay=false").staleness_cap is None


def test_replay_admits_publishes_acks_and_checkpoints_nothing(tmp_path: Path) -> None:
    session = _replay_session(tmp_path)
    state = TrainerState(step=4, version=0, admitted=3, trained_groups=2)
    before = TrainerState(**vars(state))

    async def one_step_of_session_calls() -> None:
        await session.admit(state, pending_dropped=1)
        await session.publish(state)
        await session.ack([1, 2])
        await session.checkpoint(state, RecentIds(["a"]), final=True)

    asyncio.run(one_step_of_session_calls())
    assert state == before
    assert session.link.store.list(f"{session.link.names.run}/") == []
    assert session.metrics_path.parent.parent == session.cfg.run.run_dir / "replays"


# ---- resume: SIGKILL at random points, then --resume -------------------------------------------------------


def _latest(store: Any, run: str) -> int:
    try:
        return int(orjson.loads(store.get(f"{run}/weights/LATEST"))["version"])
    except ObjectNotFound:  # not yet published
        return -1


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_after_sigkills_trains_every_group_exactly_once(
    stack: StackState, tmp_path: Path, backend: Backend
) -> None:
    """Every trainer process of the run (fresh, then each `--resume`) on `backend`."""
    max_steps, kills = 12, 3
    cfg = trainer_cfg(
        stack,
        tmp_path,
        f"trainer.max_steps={max_steps}",
        "staleness.max_staleness=64",
        "trainer.checkpoint_every=2",
        "weights.full_every=5",
        "logging.level=INFO",
        backend=backend,
    )
    rng = random.Random(7)
    trainable = [f"g{i:03d}" for i in range(max_steps * cfg.trainer.batch_groups)]
    filtered = [f"f{i:03d}" for i in range(6)]
    ids = trainable + filtered
    rng.shuffle(ids)
    asyncio.run(
        publish_groups(cfg, [make_group(g, rewards=(1.0, 1.0) if g.startswith("f") else (1.0, 0.0)) for g in ids])
    )
    config_path = tmp_path / "trainer.yaml"
    config_path.write_text(cfg.to_yaml())
    assert f"backend: {backend}" in config_path.read_text(), "the config every trainer process runs with"
    log_path = tmp_path / "trainer.log"
    store = open_run_store(cfg)
    seen_latest: list[int] = []
    for attempt in range(kills):
        proc = spawn_trainer(config_path, log_path, *(["--resume"] if attempt else []))
        start = _latest(store, cfg.run.name)
        deadline = time.monotonic() + 60
        # wait for the (re)published version and at least one step after it, then kill at a random moment
        while _latest(store, cfg.run.name) < start + 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.4))
        seen_latest.append(_latest(store, cfg.run.name))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc = spawn_trainer(config_path, log_path, "--resume")
    assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    seen_latest.append(_latest(store, cfg.run.name))

    records = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    trained = [g for r in records for g in r["trained_group_ids"]]
    dropped = {g: reason for r in records for g, reason in r["dropped_group_ids"].items()}
    context = f"kills at LATEST {seen_latest}; log tail:\n{log_path.read_text()[-4000:]}"
    assert len(trained) == len(set(trained)), f"a group was trained twice: {trained}; {context}"
    assert set(trained) == set(ids) - set(dropped), context
    assert set(dropped) == set(filtered) and set(dropped.values()) == {"no_disagreement"}
    assert [r["step"] for r in records] == list(range(1, max_steps + 1))
    versions = [r["version"] for r in records]
    assert versions == sorted(set(versions)), f"versions went backward: {versions}"
    assert seen_latest == sorted(seen_latest)


# ---- replay: same range, same seed, same losses -----------------------------------------------------------


def test_two_replays_of_the_same_range_give_the_same_losses(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=100", "staleness.max_staleness=1", "correction.method=tis")
    groups = [make_group(f"r{i}", version=i // 3, rewards=(1.0, 0.0) if i % 4 else (0.0, 1.0)) for i in range(10)]
    asyncio.run(publish_groups(cfg, [*groups[:9], make_group("late", version=0), groups[9]]))

    def replay(until: int | None) -> list[dict[str, Any]]:
        trainer = asyncio.run(run_trainer(cfg, ReplaySelection(from_seq=1, until_seq=until)))
        return metrics_records(trainer.session.metrics_path)

    first, second = replay(None), replay(None)
    assert len(first) == 5
    assert [r["loss"] for r in first] == [r["loss"] for r in second]
    assert [r["trained_group_ids"] for r in first] == [r["trained_group_ids"] for r in second]
    assert first[-1]["dropped_group_ids"] == {"late": "staleness_cap"}  # newest version seen is 2, late is 0
    assert len(replay(4)) == 2  # until seq 4: groups r0..r3


# ---- golden: the loss of a fixed tiny batch ---------------------------------------------------------------


GOLDEN_LOSSES = (0.23289336264133453, 0.4547590911388397)
"""Loss of steps 1 and 2 on the batch of `test_golden_loss` (tiny-llama-1x32: one head of 32, seed 0, tis, constant
norm)."""


def test_golden_loss_of_a_fixed_tiny_batch() -> None:
    torch.set_num_threads(1)
    cfg = LeewayConfig.model_validate(
        {"model": {"name_or_path": "tiny-llama-1x32"}, "trainer": {"lr": 0.01}, "advantages": {"group_size": 2}}
    )
    backend = build_backend(cfg, build_model("tiny-llama-1x32", vocab_size=21, seed=0))
    groups = [make_group("a", version=0), make_group("b", version=1, rewards=(0.25, 1.0))]
    prepared = [prepare_group(g, version=1, policy=GroupPolicy(max_staleness=2)) for g in groups]
    batch = TrainBatch(tuple(s for p in prepared for s in p.samples))  # what batching yields, as the backend takes it
    objective = CorrectedObjective(cfg.correction, cfg.advantages, version=1, constant_tokens=16)
    losses = tuple(backend.train_step(batch, objective).loss for _ in range(2))
    assert losses == pytest.approx(GOLDEN_LOSSES, rel=1e-5, abs=1e-7)
