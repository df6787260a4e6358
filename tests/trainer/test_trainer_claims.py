"""Claim-check objects are deleted once the run no longer needs them (`actors/trainer/claim_gc.py`): right after
the ack and a written checkpoint (`stream.claim_gc=after_ack`), or once retention removed their messages
(`after_retention`, the default; the records survive a resume in the checkpoint)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.servers import open_run_store, resolve_servers
from actors.trainer.checkpoints import load_latest_checkpoint
from actors.trainer.runtime import open_trainer
from infra.stack import StackState
from pipeline.config import LeewayConfig
from pipeline.wire.jetstream import connect
from pipeline.wire.names import RunNames
from tests.support.builders import make_group, metrics_records, publish_groups, trainer_cfg

EVENT_DEADLINE_S = 120.0
CLAIMED = ("stream.max_inline_bytes=1024", "trainer.checkpoint_every=1")
"""Every test group (~3.7 KB encoded) goes to the object store; a checkpoint after every step."""


def _claim_objects(cfg: LeewayConfig) -> list[str]:
    return open_run_store(cfg).list(f"{cfg.run.name}/trajectories/")


async def _run(cfg: LeewayConfig, *, resume: bool = False) -> int:
    trainer = await open_trainer(cfg, resume=resume)
    return await asyncio.wait_for(trainer.run(), timeout=EVENT_DEADLINE_S)


def test_after_ack_the_objects_of_trained_groups_are_deleted(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(stack, tmp_path, *CLAIMED, "stream.claim_gc=after_ack", "trainer.max_steps=2")
    asyncio.run(publish_groups(cfg, [make_group(g) for g in "abcd"]))
    assert len(_claim_objects(cfg)) == 4
    assert asyncio.run(_run(cfg)) == 0
    assert [r["trained_group_ids"] for r in metrics_records(cfg.run.run_dir / "metrics.jsonl")] == [
        ["a", "b"],
        ["c", "d"],
    ]
    assert _claim_objects(cfg) == []


def test_after_retention_objects_stay_while_replay_can_reach_them_and_go_after_a_resume(
    stack: StackState, tmp_path: Path
) -> None:
    cfg = trainer_cfg(stack, tmp_path, *CLAIMED, "trainer.max_steps=2", "staleness.max_staleness=4")
    names = RunNames.for_run(cfg.run.name)
    asyncio.run(publish_groups(cfg, [make_group(g) for g in "abcd"]))
    assert asyncio.run(_run(cfg)) == 0
    kept = _claim_objects(cfg)
    assert len(kept) == 4  # still in the stream: replayable
    loaded = load_latest_checkpoint(open_run_store(cfg), cfg.run.name)
    assert loaded is not None and sorted(seq for seq, _ in loaded[0].claim_objects) == [1, 2, 3, 4]

    async def retention_removes_the_first_four() -> None:
        nc = await connect(resolve_servers(cfg).nats_url, name="test-retention")
        await nc.jetstream().purge_stream(names.trajectory_stream, seq=5)
        await nc.drain()

    asyncio.run(publish_groups(cfg, [make_group("e"), make_group("f")]))  # seqs 5, 6
    asyncio.run(retention_removes_the_first_four())
    more = LeewayConfig.model_validate({**cfg.model_dump(), "trainer": {**cfg.trainer.model_dump(), "max_steps": 3}})
    assert asyncio.run(_run(more, resume=True)) == 0
    left = _claim_objects(cfg)
    assert len(left) == 2 and not set(left) & set(kept)  # the removed messages' objects are gone, e and f stay
