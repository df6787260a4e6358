"""`WeightSync` (`actors/generator/weight_sync.py`) against a `FakeWeightSource` and a `FakeEngine`: which version
is pulled and when, the order of pull and apply, a failed pull, a wait for a version not yet stored, and an
announcement the store cannot back. Milliseconds, no servers; `events` is shared by the two fakes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch

from actors.generator import weight_sync
from actors.generator.metrics import GeneratorMetrics
from actors.generator.weight_sync import UpdateMode, WeightSync
from tests.support.fakes import Event, FakeEngine, FakeWeightSource, version_tensors

EVENT_DEADLINE_S = 10.0
"""Upper bound on waiting for something that must happen (an apply); the wait ends when it does."""


def _sync(
    update_mode: UpdateMode = "between_rollouts",
) -> tuple[WeightSync, FakeWeightSource, FakeEngine, GeneratorMetrics]:
    events: list[Event] = []
    source, engine, metrics = FakeWeightSource(events), FakeEngine(events), GeneratorMetrics("g")
    # a poll interval no test reaches: versions are learned from `poll_once` and `announced`, when the test says
    sync = WeightSync(source, engine, metrics, poll_interval_s=3600.0, update_mode=update_mode)
    return sync, source, engine, metrics


def _pulls_and_applies(events: list[Event]) -> list[Event]:
    return [e for e in events if e[0] in ("pull", "load_state", "update_weights")]


def test_catch_up_pulls_the_newest_known_version_and_applies_it_after_the_pull() -> None:
    sync, source, engine, metrics = _sync()

    async def scenario() -> None:
        source.publish(0)
        assert await sync.poll_once() == 0 and sync.newest_known == 0
        assert await sync.catch_up() == 0
        for version in (1, 2, 3):
            source.publish(version)
        await sync.poll_once()
        assert await sync.catch_up() == 3
        assert await sync.catch_up() == 3  # nothing newer: no pull

    asyncio.run(scenario())
    # the first pull is a full snapshot loaded whole; then the newest known, 3, as a delta (1 and 2 skipped)
    assert _pulls_and_applies(source.events) == [("pull", 0), ("load_state", 0), ("pull", 3), ("update_weights", 3)]
    assert engine.version == 3 and torch.equal(engine.tensors["w"], version_tensors(3)["w"])
    assert sync.last_pull is not None and sync.last_pull.version == 3 and not sync.last_pull.full
    assert metrics.weight_pulls == 2 and metrics.versions_behind_at_pull.max == 3  # from version 0 to 3


def test_in_flight_mode_pulls_a_learned_version_at_once() -> None:
    sync, source, engine, _ = _sync("in_flight")

    async def scenario() -> None:
        source.publish(0)
        await sync.poll_once()  # known at once: `ensure` would otherwise wait a LATEST poll for it
        await sync.ensure(0)
        source.publish(1)
        sync.learn(1)  # the KV doorbell or a poll: in_flight pulls now, not at the next batch boundary
        assert await asyncio.to_thread(engine.wait_for_version, 1, EVENT_DEADLINE_S), source.events

    asyncio.run(scenario())
    assert _pulls_and_applies(source.events)[-2:] == [("pull", 1), ("update_weights", 1)]


def test_a_failed_pull_leaves_the_engine_as_it_was_and_a_later_attempt_applies_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weight_sync, "RETRY_S", 0.0)  # `ensure` pauses this long between attempts
    sync, source, engine, metrics = _sync()

    async def scenario() -> None:
        source.publish(0)
        await sync.poll_once()  # known at once: `ensure` would otherwise wait a LATEST poll for it
        await sync.ensure(0)
        source.publish(1)
        source.fail_pulls[1] = 1
        await sync.poll_once()
        with pytest.raises(ConnectionError):
            await sync.catch_up()
        assert engine.version == 0 and metrics.weight_pulls == 1, "nothing of version 1 reached the engine"
        assert await sync.catch_up() == 1
        source.publish(2)
        source.fail_pulls[2] = 2
        await sync.poll_once()
        assert await sync.ensure(2) == 2  # retried through two failures

    asyncio.run(scenario())
    assert _pulls_and_applies(source.events)[2:] == [
        ("pull", 1),  # failed
        ("pull", 1),
        ("update_weights", 1),
        ("pull", 2),  # failed
        ("pull", 2),  # failed
        ("pull", 2),
        ("update_weights", 2),
    ]
    assert metrics.weight_pulls == 3 and engine.version == 2


def test_ensure_waits_for_a_version_the_store_does_not_have_and_pulls_it_once_announced() -> None:
    sync, source, engine, _ = _sync()

    async def scenario() -> None:
        source.publish(0)
        await sync.poll_once()  # known at once: `ensure` would otherwise wait a LATEST poll for it
        await sync.ensure(0)
        waiting = asyncio.Event()
        waits: list[float] = []

        def on_wait(waited_s: float) -> None:
            waits.append(waited_s)
            waiting.set()

        task = asyncio.create_task(sync.ensure(1, on_wait=on_wait))
        await asyncio.wait_for(waiting.wait(), EVENT_DEADLINE_S)  # ensure found nothing to pull: it waits
        assert not task.done() and engine.version == 0
        source.publish(1)
        await sync.announced(1)  # the doorbell: LATEST now says 1
        assert await asyncio.wait_for(task, EVENT_DEADLINE_S) == 1
        assert waits[0] == pytest.approx(0.0, abs=1.0), "the first on_wait call comes as the wait starts"

    asyncio.run(scenario())
    published, pulled, applied = (
        source.events.index(("published", 1)),
        source.events.index(("pull", 1)),
        source.events.index(("update_weights", 1)),
    )
    assert published < pulled < applied
    assert engine.version == 1


def test_an_announced_version_past_latest_is_ignored_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    sync, source, engine, _ = _sync()
    caplog.set_level(logging.WARNING, logger=weight_sync.__name__)

    async def scenario() -> None:
        source.publish(0)
        await sync.announced(5)  # a KV key left by an earlier run of the same name
        await sync.announced(5)
        assert sync.newest_known == 0, "only what LATEST shows is learned"
        assert await sync.catch_up() == 0

    asyncio.run(scenario())
    warnings: list[Any] = [r.getMessage() for r in caplog.records if "KV announces version 5" in r.getMessage()]
    assert len(warnings) == 1 and "LATEST is 0" in warnings[0]
    assert ("pull", 5) not in source.events and engine.version == 0


def test_a_version_that_can_never_be_pulled_times_out_with_why_and_a_later_ensure_tries_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weight_sync, "RETRY_S", 0.01)
    sync, source, engine, metrics = _sync()

    async def scenario() -> None:
        source.publish(0)
        await sync.poll_once()
        await sync.ensure(0)
        source.publish(1)
        await sync.poll_once()
        source.fail_pulls[1] = 10**9  # every pull of version 1 fails (another model's manifest, a lost delta)
        with pytest.raises(weight_sync.WeightPullTimeout) as timeout:
            await sync.ensure(1, give_up_after_s=0.2)  # was: retried forever, holding the caller's prompts
        assert timeout.value.min_version == 1 and timeout.value.engine_version == 0
        assert "store unreachable pulling version 1" in str(timeout.value)
        assert metrics.weight_pull_failures >= 2 and engine.version == 0
        source.fail_pulls[1] = 0  # the store is fixed: the next ensure gets there
        assert await sync.ensure(1, give_up_after_s=5.0) == 1
        assert sync.last_pull_error is None

    asyncio.run(scenario())


def test_a_refused_update_keeps_the_previous_version_is_counted_and_reloads_from_a_full_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weight_sync, "RETRY_S", 0.01)
    sync, source, engine, metrics = _sync()
    engine.refuse.add(1)

    async def scenario() -> None:
        source.publish(0)
        await sync.poll_once()
        await sync.ensure(0)
        source.publish(1)
        await sync.poll_once()
        with pytest.raises(weight_sync.WeightsRefused):
            await sync.catch_up()
        assert engine.version == 0 and torch.equal(engine.tensors["w"], version_tensors(0)["w"])
        assert metrics.weights_refused == 1 and "refused by the engine" in (sync.last_pull_error or "")
        assert await sync.ensure(1, give_up_after_s=5.0) == 1

    asyncio.run(scenario())
    # the refused delta update; then the local copy is dropped and version 1 is loaded whole from a full snapshot
    assert _pulls_and_applies(source.events)[2:] == [("pull", 1), ("pull", 1), ("load_state", 1)]
    assert ("forget",) in source.events and ("refused", 1) in source.events
    assert source.events.index(("forget",)) > source.events.index(("refused", 1))
