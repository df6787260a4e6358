"""Outages of minutes: the trainer's publish, checkpoints and admission retry for their budget in `outages.*`
(not a fixed few tries), keep the step's held groups alive meanwhile, and adopt a checkpoint commit whose
response was lost instead of refusing it as another writer's."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from actors.servers import open_run_store
from actors.trainer.checkpoints import (
    MANIFEST_FILE,
    TrainerState,
    checkpoint_prefix,
    complete_checkpoints,
    load_latest_checkpoint,
    write_checkpoint,
)
from actors.trainer.sessions import LiveSession
from infra.stack import StackState
from pipeline.config import ConfigError, load_config
from pipeline.wire.retry import RETRY_ATTEMPTS, Backoff, outage_backoff, retry_async
from storage.manifest import manifest_key
from storage.objectstore import ObjectStore
from tests.support.builders import live_trainer, make_group, metrics_records, publish_groups, trainer_cfg
from tests.support.stores import WRITE_METHODS, Fault, FaultyStore

EVENT_DEADLINE_S = 120.0
"""Upper bound on waiting for an event that must happen."""


class _Clock:
    """Time that passes only when the retry sleeps: a ten-minute outage in no time at all."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay_s: float) -> None:
        self.now += delay_s


def test_an_outage_budget_retries_for_its_time_however_many_tries_and_beats_between_them() -> None:
    clock, calls, beats = _Clock(), [], []
    back_at_s = 540.0  # nine minutes of outage

    async def store_write() -> str:
        calls.append(clock.now)
        if clock.now < back_at_s:
            raise ConnectionError("store away")
        return "written"

    async def heartbeat() -> None:
        beats.append(clock.now)
        if len(beats) == 3:
            raise ConnectionError("NATS blip too")  # a failed keep-alive is logged, never ends the retry

    result = asyncio.run(
        retry_async(
            store_write,
            what="t",
            backoff=outage_backoff(600.0),
            heartbeat=heartbeat,
            rng=random.Random(1),
            sleep=clock.sleep,
            clock=clock,
        )
    )
    assert result == "written" and len(calls) > 10 * RETRY_ATTEMPTS and calls[-1] >= back_at_s
    assert len(beats) == len(calls) - 1  # once before every wait
    assert max(b - a for a, b in zip(calls, calls[1:], strict=False)) <= Backoff().max_s  # never a blind wait

    clock.now, calls[:] = 0.0, []
    with pytest.raises(ConnectionError):
        asyncio.run(
            retry_async(
                store_write,
                what="t",
                backoff=outage_backoff(60.0),
                rng=random.Random(1),
                sleep=clock.sleep,
                clock=clock,
            )
        )
    assert 55.0 <= clock.now <= 60.0  # gave up when the next wait would have passed the budget, not before


def test_a_stop_grace_that_would_kill_the_final_checkpoint_is_refused() -> None:
    cfg = load_config(None, ["outages.final_checkpoint_s=300"], environ={})
    assert cfg.stop_grace_s == 330.0  # the default grace follows the final checkpoint's budget
    assert load_config(None, ["run.stop_grace_s=45", "outages.final_checkpoint_s=30"], environ={}).stop_grace_s == 45
    with pytest.raises(ConfigError, match=r"run\.stop_grace_s.*outages\.final_checkpoint_s"):
        load_config(None, ["run.stop_grace_s=60", "outages.final_checkpoint_s=120"], environ={})


class _LosingStore(FaultyStore):
    """A `FaultyStore` that also loses the response of the first checkpoint-manifest write: the manifest is
    stored, the writer hears an error (what a connection reset after the request looks like)."""

    def __init__(self, inner: ObjectStore, fault: Fault) -> None:
        super().__init__(inner, fault)
        self.lost: list[str] = []

    def put_if_absent(self, key: str, data: bytes) -> str:
        etag = super().put_if_absent(key, data)
        if key.endswith("/" + MANIFEST_FILE) and "/checkpoints/" in key and not self.lost:
            self.lost.append(key)
            raise ConnectionError(f"connection reset after writing {key}")
        return etag


def test_publish_and_checkpoint_ride_out_a_store_outage_past_the_old_five_tries(
    stack: StackState, tmp_path: Path
) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=2", "trainer.checkpoint_every=1")
    run = cfg.run.name
    failures = {manifest_key(run, 1): RETRY_ATTEMPTS + 1, checkpoint_prefix(run, 1) + MANIFEST_FILE: 2}

    def fail(method: str, key: str) -> BaseException | None:
        if method in WRITE_METHODS and failures.get(key, 0) > 0:
            failures[key] -= 1
            return ConnectionError(f"store unreachable writing {key}")
        return None

    stores: list[_LosingStore] = []

    def wrap(store: ObjectStore) -> ObjectStore:
        stores.append(_LosingStore(store, fail))
        return stores[-1]

    asyncio.run(publish_groups(cfg, [make_group(g) for g in "abcd"]))
    beats: list[int] = []

    async def scenario() -> int:
        trainer = await live_trainer(cfg, wrap_store=wrap)
        session = trainer.session
        assert isinstance(session, LiveSession)
        keep_alive = session.keep_alive

        async def counted() -> None:  # the real keep-alive, counted
            beats.append(len(session.consumer.held_seqs))
            await keep_alive()

        session.keep_alive = counted  # type: ignore[method-assign]
        return await asyncio.wait_for(trainer.run(), timeout=EVENT_DEADLINE_S)

    assert asyncio.run(scenario()) == 0
    assert set(failures.values()) == {0}  # every planned failure happened
    assert [r["version"] for r in metrics_records(cfg.run.run_dir / "metrics.jsonl")] == [1, 2]
    assert beats[: RETRY_ATTEMPTS + 1] == [2] * (RETRY_ATTEMPTS + 1)  # the step's two groups, held, kept alive
    store = open_run_store(cfg)
    assert stores[0].lost and complete_checkpoints(store, run) == [1, 2]  # the lost-response commit adopted
    loaded = load_latest_checkpoint(store, run)
    assert loaded is not None and loaded[0].step == 2


def test_a_checkpoint_retry_with_its_own_attempt_adopts_and_anothers_is_refused(
    stack: StackState, tmp_path: Path
) -> None:
    cfg = trainer_cfg(stack, tmp_path)
    store = open_run_store(cfg)
    state = TrainerState(step=1, version=1)
    tensors, meta = {}, {"format": 1}
    prefix = write_checkpoint(store, cfg.run.name, state, tensors, meta, attempt="first")
    assert write_checkpoint(store, cfg.run.name, state, tensors, meta, attempt="first") == prefix
    with pytest.raises(ValueError, match="already has a manifest"):
        write_checkpoint(store, cfg.run.name, state, tensors, meta, attempt="second")
    assert complete_checkpoints(store, cfg.run.name) == [1]
