"""Forged input on the trajectory subject (anyone with the run's NATS token can publish there): a group that
claims a policy version the run's store never had cannot raise a replay's version past every genuine group
(which would drop them all over the staleness cap); it is dropped as invalid and counted in the metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.servers import open_run_store
from actors.trainer.loop import DROP_INVALID
from infra.stack import StackState
from pipeline.config import LeewayConfig
from pipeline.wire.replay import ReplaySelection
from storage.weights import list_versions
from tests.support.builders import make_group, metrics_records, publish_groups, run_trainer, trainer_cfg

FORGED_VERSION = 1_000_000


def test_a_forged_max_version_cannot_poison_a_replays_staleness_cap(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=2", "staleness.max_staleness=1")
    asyncio.run(publish_groups(cfg, [make_group(g) for g in "abcd"]))
    asyncio.run(run_trainer(cfg))  # the live run: versions 0, 1, 2 in the store
    assert list_versions(open_run_store(cfg), cfg.run.name)[-1] == 2
    asyncio.run(
        publish_groups(
            cfg, [make_group("forged", version=FORGED_VERSION), make_group("e", version=2), make_group("g", version=2)]
        )
    )

    replay_cfg = LeewayConfig.model_validate(
        {**cfg.model_dump(), "trainer": {**cfg.trainer.model_dump(), "max_steps": 100}}
    )
    trainer = asyncio.run(run_trainer(replay_cfg, ReplaySelection(from_seq=1)))
    records = metrics_records(trainer.session.metrics_path)
    trained = [g for r in records for g in r["trained_group_ids"]]
    dropped = {g: why for r in records for g, why in r["dropped_group_ids"].items()}
    assert trained == ["a", "b", "c", "d", "e", "g"]  # the genuine groups after the forged one still train
    assert dropped == {"forged": DROP_INVALID}
    assert records[-1]["groups/forged_versions_total"] == 1
    assert max(int(r["version"]) for r in records) == 2  # the replay's version never took the forged claim
