"""The trainer survives what it can: untrusted generator reports, store and NATS blips (retries), a failure
it cannot handle (final checkpoint), and groups retention removed before a resume (counted, not silent)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import orjson
import pytest

from actors.servers import open_run_store, resolve_servers
from actors.trainer.backends import LossFn, StepResult, TrainBatch, TrainingBackend
from actors.trainer.checkpoints import TrainerState, complete_checkpoints, load_latest_checkpoint
from actors.trainer.generator_reports import REPORT_MAX_AGE_S, GeneratorReports, ReportError, parse_report
from actors.trainer.loop import QueueWaitTimeout, Trainer
from actors.trainer.runtime import open_trainer
from actors.trainer.sessions import LiveSession
from infra.stack import StackState
from pipeline.config import LeewayConfig
from pipeline.failures import FAILURE_NAMES
from pipeline.wire.announce import generator_metrics_subject
from pipeline.wire.headers import H_DLQ_MSG_ID, H_DLQ_REASON, H_DLQ_SEQ, H_DLQ_STREAM, H_MSG_ID
from pipeline.wire.jetstream import connect, read_dead_letters
from pipeline.wire.names import RunNames
from pipeline.wire.retry import Backoff, retry_async
from storage.manifest import manifest_key
from storage.weights import list_versions
from tests.support.builders import live_trainer, make_group, metrics_records, publish_groups, trainer_cfg
from tests.support.fakes import WrappedBackend
from tests.support.stores import WRITE_METHODS, Fault, FaultyStore

EVENT_DEADLINE_S = 60.0
"""Upper bound on waiting for an event that must happen."""


def _report(generator_id: str, **fields: Any) -> bytes:
    return orjson.dumps({"schema": 1, "kind": "generator", "generator_id": generator_id, **fields})


# ---- generator reports: validated, expired ----------------------------------------------------------------


def test_reports_with_bad_fields_are_refused_naming_the_field() -> None:
    assert parse_report(_report("g1", tokens_per_s=12.5, staleness_mean=None))["tokens_per_s"] == 12.5
    for data, field in [
        (_report("g1", tokens_per_s="fast"), "'tokens_per_s'"),
        (_report("g1", tokens_per_s=True), "'tokens_per_s'"),
        (_report("g1", idle_fraction=[1]), "'idle_fraction'"),
        (orjson.dumps({"tokens_per_s": 1.0}), "'generator_id'"),
        (orjson.dumps([1, 2]), "not an object"),
        (b"{not json", "not JSON"),
        (_report("g1", padding=None, **{f"f{i}": 1 for i in range(100)}), "fields"),
        (_report("g1", kind="x" * 100), "'kind'"),
        (_report("g1", blob=None) + b" " * 20_000, "bytes"),
    ]:
        with pytest.raises(ValueError, match=field):
            parse_report(data)


def test_a_report_counting_a_failure_outside_the_taxonomy_is_refused_naming_the_field() -> None:
    known = {"sandbox_lost": 2, "reward_out_of_range": 1, "format_error": 3, "agent_timeout": 1}
    assert parse_report(_report("g1", failure_reasons=known))["failure_reasons"] == known
    assert set(known) <= FAILURE_NAMES
    for counts in ({"sandbox_lost": 1, "sandbox_exploded": 2}, {"Sandbox_Lost": 1}, {"sandbox_lost": -1}):
        with pytest.raises(ReportError, match="'failure_reasons'"):
            parse_report(_report("g1", failure_reasons=counts))
    reports = GeneratorReports()
    assert not reports.receive(_report("g1", failure_reasons={"sandbox_exploded": 1}))
    assert reports.num_rejected == 1 and reports.current() == {}


def test_reports_expire_so_a_silent_generator_leaves_the_metrics() -> None:
    now = [100.0]
    reports = GeneratorReports(clock=lambda: now[0])
    assert reports.receive(_report("old", tokens_per_s=10.0))
    now[0] += REPORT_MAX_AGE_S / 2
    assert reports.receive(_report("new", tokens_per_s=5.0))
    assert not reports.receive(_report("bad", tokens_per_s="NaN-ish"))
    assert set(reports.current()) == {"old", "new"} and reports.tokens_per_s() == 15.0
    now[0] += REPORT_MAX_AGE_S / 2 + 1.0
    assert set(reports.current()) == {"new"} and reports.tokens_per_s() == 5.0
    assert reports.num_rejected == 1


def test_a_malformed_generator_report_is_ignored_and_the_trainer_goes_on(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=1")
    names = RunNames.for_run(cfg.run.name)

    async def scenario() -> int:
        trainer = await open_trainer(cfg)
        assert isinstance(trainer.session, LiveSession)
        reports = trainer.session.generator_reports
        nc = await connect(resolve_servers(cfg).nats_url, name="test-reporter")
        subject = generator_metrics_subject(names)
        for bad in (_report("evil", tokens_per_s="fast"), b"[]", _report("huge", x=None) + b" " * 100_000):
            await nc.publish(subject, bad)
        await nc.publish(subject, _report("good", tokens_per_s=40.0, version=0))
        await nc.flush()
        deadline = asyncio.get_running_loop().time() + EVENT_DEADLINE_S
        while reports.num_rejected < 3 or "good" not in reports.current():  # all four reports were read
            assert asyncio.get_running_loop().time() < deadline, (reports.num_rejected, reports.current())
            await asyncio.sleep(0.02)
        await nc.drain()
        await publish_groups(cfg, [make_group("a"), make_group("b")])
        return await asyncio.wait_for(trainer.run(), timeout=EVENT_DEADLINE_S)

    assert asyncio.run(scenario()) == 0
    [record] = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert set(record["generators"]) == {"good"} and record["generators/tokens_per_s"] == 40.0


# ---- retries with backoff and jitter ---------------------------------------------------------------------


def test_retry_backs_off_with_jitter_and_gives_up_after_the_bound() -> None:
    calls: list[int] = []
    waits: list[float] = []

    async def sleep(delay_s: float) -> None:
        waits.append(delay_s)

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("store away")
        return "done"

    backoff = Backoff(attempts=4, initial_s=1.0, max_s=1.5)
    result = asyncio.run(retry_async(flaky, what="t", backoff=backoff, rng=random.Random(0), sleep=sleep))
    assert result == "done" and len(calls) == 3
    assert 0.5 <= waits[0] <= 1.0 and 0.75 <= waits[1] <= 1.5  # half to all of min(max_s, initial_s * 2^k)

    async def always() -> None:
        calls.append(1)
        raise ConnectionError("down")

    calls.clear()
    with pytest.raises(ConnectionError):
        asyncio.run(retry_async(always, what="t", backoff=backoff, sleep=sleep))
    assert len(calls) == 4

    async def bad_input() -> None:
        calls.append(1)
        raise ValueError("never retried")

    calls.clear()
    with pytest.raises(ValueError):
        asyncio.run(retry_async(bad_input, what="t", backoff=backoff, sleep=sleep))
    assert len(calls) == 1


def _trainer_with_store(cfg: LeewayConfig, fault: Fault) -> Coroutine[Any, Any, Trainer]:
    """A live trainer whose weight publisher writes through a `FaultyStore` asking `fault`."""
    return live_trainer(cfg, wrap_store=lambda store: FaultyStore(store, fault))


def test_weight_publish_is_retried_through_a_store_outage(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=2")
    outages = {manifest_key(cfg.run.name, 1): 2}  # the manifest of version 1 fails twice, then goes through

    def fail(method: str, key: str) -> BaseException | None:
        if method in WRITE_METHODS and outages.get(key, 0) > 0:
            outages[key] -= 1
            return ConnectionError(f"store unreachable writing {key}")
        return None

    asyncio.run(publish_groups(cfg, [make_group(g) for g in "abcd"]))

    async def scenario() -> int:
        trainer = await _trainer_with_store(cfg, fail)
        return await asyncio.wait_for(trainer.run(), timeout=EVENT_DEADLINE_S)

    assert asyncio.run(scenario()) == 0
    assert [r["version"] for r in metrics_records(cfg.run.run_dir / "metrics.jsonl")] == [1, 2]
    assert outages == {manifest_key(cfg.run.name, 1): 0}


# ---- a failure the loop cannot handle: final checkpoint, then the error --------------------------------------


def test_a_failure_while_publishing_writes_a_checkpoint_that_holds_the_step(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(
        stack, tmp_path, "trainer.max_steps=5", "trainer.checkpoint_every=50", "staleness.max_staleness=4"
    )

    def fail(method: str, key: str) -> BaseException | None:  # permanent: not retried
        refused = method in WRITE_METHODS and key == manifest_key(cfg.run.name, 2)
        return ValueError("manifest refused") if refused else None

    asyncio.run(publish_groups(cfg, [make_group(g) for g in "abcdef"]))

    async def scenario() -> None:
        trainer = await _trainer_with_store(cfg, fail)
        await asyncio.wait_for(trainer.run(), timeout=EVENT_DEADLINE_S)

    with pytest.raises(ValueError, match="manifest refused"):
        asyncio.run(scenario())
    store = open_run_store(cfg)
    assert complete_checkpoints(store, cfg.run.name) == [2]
    loaded = load_latest_checkpoint(store, cfg.run.name)
    assert loaded is not None
    state = loaded[0]
    # step 2 was trained: its groups are handled in the checkpoint, so a resume does not train them again
    assert state.step == 2 and state.consumed_seq == 4 and {"c", "d"} <= set(state.handled_group_ids)


def test_giving_up_on_the_queue_still_writes_a_final_checkpoint(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(
        stack, tmp_path, "trainer.max_steps=5", "trainer.checkpoint_every=50", "trainer.queue_wait_timeout_s=1"
    )
    asyncio.run(publish_groups(cfg, [make_group("a"), make_group("b")]))

    async def scenario() -> None:
        trainer = await open_trainer(cfg)
        await asyncio.wait_for(trainer.run(), timeout=EVENT_DEADLINE_S)

    with pytest.raises(QueueWaitTimeout):
        asyncio.run(scenario())
    assert complete_checkpoints(open_run_store(cfg), cfg.run.name) == [1]


# ---- retention: groups removed before a resume read them are counted --------------------------------------


def test_resume_says_how_many_groups_retention_removed(
    stack: StackState, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=1", "staleness.max_staleness=64")
    names = RunNames.for_run(cfg.run.name)
    asyncio.run(publish_groups(cfg, [make_group("a"), make_group("b")]))

    async def run(config: LeewayConfig, *, resume: bool) -> int:
        trainer = await open_trainer(config, resume=resume)
        return await asyncio.wait_for(trainer.run(), timeout=EVENT_DEADLINE_S)

    assert asyncio.run(run(cfg, resume=False)) == 0  # step 1, checkpointed at the end (consumed_seq 2)
    asyncio.run(publish_groups(cfg, [make_group(g) for g in "cdef"]))  # seqs 3..6

    async def purge_below(seq: int) -> None:  # what max_age / max_bytes retention does to the oldest
        nc = await connect(resolve_servers(cfg).nats_url, name="test-retention")
        await nc.jetstream().purge_stream(names.trajectory_stream, seq=seq)
        await nc.drain()

    asyncio.run(purge_below(5))  # c, d (seqs 3, 4) are gone before the resumed trainer reads them
    resumed = LeewayConfig.model_validate({**cfg.model_dump(), "trainer": {**cfg.trainer.model_dump(), "max_steps": 2}})
    with caplog.at_level("WARNING", logger="actors.trainer.sessions"):
        assert asyncio.run(run(resumed, resume=True)) == 0
    records = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert [r["trained_group_ids"] for r in records] == [["a", "b"], ["e", "f"]]
    assert records[-1]["groups/lost_to_retention"] == 2
    assert any("seqs 3..4 (2 groups) were removed by retention" in m for m in caplog.messages)


# ---- a poison group: re-read on every resume, counted across resumes, dead-lettered past the limit ---------


class _PoisonBackend(WrappedBackend):
    """The real backend, except that a step holding a sample of group `poison` raises (and notes that it did):
    what a group that kills the trainer (an OOM, a kernel assert) looks like to the loop."""

    def __init__(self, inner: TrainingBackend, poison: str, hits: list[str]) -> None:
        self.inner, self.poison, self.hits = inner, poison, hits

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, num_minibatches: int = 1) -> StepResult:
        if any(s.sample_id.rpartition(":")[0] == self.poison for s in batch.sequences):
            self.hits.append(self.poison)
            raise RuntimeError(f"poison group {self.poison} killed the step")
        return self.inner.train_step(batch, loss_fn, num_minibatches=num_minibatches)


def test_a_group_that_kills_every_resume_is_dead_lettered_and_later_groups_train(
    stack: StackState, tmp_path: Path
) -> None:
    limit = 2  # the session's re-read limit (the consumer's max_deliver, 20, in a real run): 3 resumes, not 21
    cfg = trainer_cfg(
        stack, tmp_path, "trainer.max_steps=2", "trainer.checkpoint_every=50", "staleness.max_staleness=4"
    )
    names = RunNames.for_run(cfg.run.name)
    # admitted-prompt ids (their dead letters return slots); g.1 shares the poison's batch, so every read too
    poison, mate, rest = "g.0", "g.1", ["g.2", "g.3", "g.4", "g.5"]
    asyncio.run(publish_groups(cfg, [make_group(g) for g in [poison, mate, *rest]]))
    hits: list[str] = []

    async def attempt(*, resume: bool) -> Trainer:
        trainer = await live_trainer(cfg, wrap_backend=lambda b: _PoisonBackend(b, poison, hits), resume=resume)
        assert isinstance(trainer.session, LiveSession)
        trainer.session.resume_read_limit = limit
        await asyncio.wait_for(trainer.run(), timeout=EVENT_DEADLINE_S)
        return trainer

    with pytest.raises(RuntimeError, match="poison"):  # the durable consumer's first delivery
        asyncio.run(attempt(resume=False))
    for resume in range(limit):  # each resume re-reads it (catch-up) and dies of it again
        with pytest.raises(RuntimeError, match="poison"):
            asyncio.run(attempt(resume=True))
        assert len(hits) == resume + 2
    trainer = asyncio.run(attempt(resume=True))  # read once more than the limit: dead-lettered, not trained
    assert hits == [poison] * (limit + 1)
    records = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert [r["trained_group_ids"] for r in records] == [rest[:2], rest[2:]]
    assert trainer.state.dead_lettered_groups == 2 and {poison, mate} <= set(trainer.handled.to_list())  # slots back

    async def dead_letters() -> list[tuple[str | None, str]]:
        nc = await connect(resolve_servers(cfg).nats_url, name="test-dlq")
        entries, _ = await read_dead_letters(nc.jetstream(), names, after_seq=0, limit=10)
        await nc.drain()
        return [(e.original_id, e.reason) for e in entries]

    assert asyncio.run(dead_letters()) == [(poison, "max_deliveries"), (mate, "max_deliveries")]


def test_groups_lost_to_retention_return_their_admission_slots(stack: StackState, tmp_path: Path) -> None:
    """With `max_staleness=0` every slot is taken by the batch in flight; when retention removes exactly those
    groups before a resume, only their slots coming back lets admission (and the run) go on."""
    cfg = trainer_cfg(
        stack,
        tmp_path,
        "trainer.max_steps=2",
        "trainer.checkpoint_every=50",
        "staleness.max_staleness=0",
        "trainer.queue_wait_timeout_s=1",
    )
    names = RunNames.for_run(cfg.run.name)
    asyncio.run(publish_groups(cfg, [make_group("a"), make_group("b")]))

    async def first_run() -> None:  # step 1, then step 2 admits its 2 prompts and waits in vain
        trainer = await open_trainer(cfg)
        await asyncio.wait_for(trainer.run(), timeout=EVENT_DEADLINE_S)

    with pytest.raises(QueueWaitTimeout):
        asyncio.run(first_run())
    state = _latest_state(cfg)
    assert (state.step, state.admitted, state.trained_groups, state.consumed_seq) == (1, 4, 2, 2)
    asyncio.run(publish_groups(cfg, [make_group("c"), make_group("d")]))  # seqs 3, 4: step 2's groups
    asyncio.run(_purge_below(cfg, names, 5))  # ... removed by retention before the resume reads them

    patient = {**cfg.trainer.model_dump(), "queue_wait_timeout_s": EVENT_DEADLINE_S}  # wedged: fails the wait below
    resumed = LeewayConfig.model_validate({**cfg.model_dump(), "trainer": patient})

    async def resumed_run() -> tuple[int, Trainer]:
        trainer = await open_trainer(resumed, resume=True)
        running = asyncio.create_task(trainer.run())
        deadline = asyncio.get_running_loop().time() + EVENT_DEADLINE_S
        while trainer.state.admitted < 6:  # the two lost slots are admitted again
            assert not running.done(), running.exception()
            assert asyncio.get_running_loop().time() < deadline, trainer.state
            await asyncio.sleep(0.02)
        await publish_groups(cfg, [make_group("e", version=2), make_group("f", version=2)])
        return await asyncio.wait_for(running, timeout=EVENT_DEADLINE_S), trainer

    code, trainer = asyncio.run(resumed_run())
    assert code == 0 and trainer.state.lost_to_retention == 2
    records = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert [r["trained_group_ids"] for r in records] == [["a", "b"], ["e", "f"]]
    state = _latest_state(cfg)  # the lost range is behind the watermark: a later resume does not count it again
    assert (state.lost_to_retention, state.consumed_seq) == (2, 6)


def _latest_state(cfg: LeewayConfig) -> TrainerState:
    loaded = load_latest_checkpoint(open_run_store(cfg), cfg.run.name)
    assert loaded is not None
    return loaded[0]


async def _purge_below(cfg: LeewayConfig, names: RunNames, seq: int) -> None:
    """What max_age / max_bytes retention does to the oldest groups of the trajectory stream."""
    nc = await connect(resolve_servers(cfg).nats_url, name="test-retention")
    await nc.jetstream().purge_stream(names.trajectory_stream, seq=seq)
    await nc.drain()


# ---- forged dead letters: only those of messages that exist return a slot ---------------------------------


def test_forged_dead_letters_are_counted_and_cancel_nothing(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=1", "staleness.max_staleness=0")
    names = RunNames.for_run(cfg.run.name)

    async def scenario() -> tuple[Trainer, list[str]]:
        trainer = await open_trainer(cfg)
        assert isinstance(trainer.session, LiveSession)
        running = asyncio.create_task(trainer.run())
        nc = await connect(resolve_servers(cfg).nats_url, name="test-forger")
        js = nc.jetstream()
        deadline = asyncio.get_running_loop().time() + EVENT_DEADLINE_S
        while trainer.state.admitted < 2:  # both prompts of step 1 are queued (no generator takes them)
            assert not running.done() and asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        ids = [(await js.get_msg(names.prompt_stream, seq=s)).headers[H_MSG_ID] for s in (1, 2)]
        await publish_groups(cfg, [make_group("other", rewards=(1.0, 1.0))])  # seq 1 holds "other" (filtered)
        prompts, trajectories = names.prompt_dead_letter_subject, names.trajectory_dead_letter_subject
        forged = [  # each names a real, outstanding prompt id: a dead letter taken at its word cancels its group
            (prompts, {H_DLQ_MSG_ID: ids[1]}),  # no original
            (trajectories, {H_DLQ_MSG_ID: ids[1], H_DLQ_STREAM: names.trajectory_stream, H_DLQ_SEQ: "1"}),
            (trajectories, {H_DLQ_MSG_ID: ids[1], H_DLQ_STREAM: names.trajectory_stream, H_DLQ_SEQ: "99"}),
            (prompts, {H_DLQ_MSG_ID: ids[0], H_DLQ_STREAM: names.prompt_stream, H_DLQ_SEQ: "1"}),  # still queued
        ]
        for subject, headers in forged:
            await js.publish(subject, b"", headers={H_DLQ_REASON: "max_deliveries", **headers})
        while trainer.state.dead_letter_seq < 3:  # the first three were read (and refused)
            assert not running.done() and asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        await nc.drain()
        await publish_groups(cfg, [make_group(ids[0]), make_group(ids[1])])  # the real groups come
        assert await asyncio.wait_for(running, timeout=EVENT_DEADLINE_S) == 0
        return trainer, ids

    trainer, ids = asyncio.run(scenario())
    [record] = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert record["trained_group_ids"] == ids and trainer.state.dead_lettered_groups == 0
    assert isinstance(trainer.session, LiveSession) and trainer.session.dead_letter_check.forged == 3
    assert record["dead_letters/forged_total"] == 3  # in the run's own records, not only the log


# ---- a prompts file with a row that can never be admitted: refused when loaded, before anything is published


def test_a_prompts_file_row_over_the_queue_message_limit_stops_the_trainer_before_it_publishes(
    stack: StackState, tmp_path: Path
) -> None:
    path = tmp_path / "prompts.jsonl"
    huge = "1" * (3 * 1024 * 1024)  # over stream.max_msg_bytes (2 MiB): its admission publish could never succeed
    path.write_text(orjson.dumps({"prompt": "12>"}).decode() + "\n" + orjson.dumps({"prompt": huge}).decode() + "\n")
    cfg = trainer_cfg(stack, tmp_path, f"task.prompts_file={path}")

    async def scenario() -> None:
        trainer = await open_trainer(cfg)
        await asyncio.wait_for(trainer.run(), timeout=EVENT_DEADLINE_S)

    with pytest.raises(ValueError, match=rf"{path}: row 1 .* over stream.max_msg_bytes = 2097152"):
        asyncio.run(scenario())
    assert list_versions(open_run_store(cfg), cfg.run.name) == []  # refused at load: nothing was published
