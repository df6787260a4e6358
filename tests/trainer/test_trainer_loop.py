"""The trainer loop (`Trainer` in `actors/trainer/loop.py`) against a `FakeSession`: filling a batch (dedupe of
redelivered groups, low-water refill of admission, refused groups) and the ack-after-publish order of a step.
Milliseconds, no servers; the real torch backend on tiny-llama (the char tokenizer's 21 ids, 128 positions)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from actors.models import build_model
from actors.trainer.backends import build_backend
from actors.trainer.loop import Batch, Trainer
from pipeline.config import LeewayConfig, load_config
from pipeline.rl.batching import REFUSE_VOCAB
from pipeline.wire.consumer import Delivery
from pipeline.wire.trajectory import Sample, TrajectoryGroup
from tests.support.builders import PROMPT, make_group, make_sample, metrics_records
from tests.support.fakes import FakeSession, event_index

VOCAB = 21
"""The char tokenizer's ids: what `make_group`'s tokens are drawn from."""


def _cfg(tmp_path: Path, *overrides: str) -> LeewayConfig:
    return load_config(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            "model.name_or_path=tiny-llama-1x32",
            "model.dtype=float32",
            "advantages.group_size=2",
            "trainer.batch_groups=2",
            "trainer.max_steps=1",
            "trainer.lr=0.01",
            "engine.sampling.max_new_tokens=4",
            "staleness.max_staleness=1",
            *overrides,
        ],
        environ={},
    )


def _trainer(cfg: LeewayConfig, session: FakeSession) -> Trainer:
    backend = build_backend(cfg, build_model(cfg.model.name_or_path, vocab_size=VOCAB, seed=0))
    return Trainer(cfg, backend, session)


def _session(cfg: LeewayConfig, **kwargs: object) -> FakeSession:
    return FakeSession(cfg, cfg.run.run_dir / "metrics.jsonl", **kwargs)  # type: ignore[arg-type]


def _filtered(group_id: str) -> TrajectoryGroup:
    """Both samples rewarded alike: the disagreement filter drops the group."""
    return make_group(group_id, rewards=(1.0, 1.0))


def _out_of_vocab(group_id: str) -> TrajectoryGroup:
    """A group whose second sample holds a token id past the vocabulary: refused at the door."""
    tokens = [*PROMPT, 7, VOCAB + 978, 9]
    n, p = len(tokens), len(PROMPT)
    bad = Sample(
        tokens=np.array(tokens, np.int32),
        loss_mask=np.r_[np.zeros(p, np.uint8), np.ones(n - p, np.uint8)],
        logprobs=np.r_[np.zeros(p, np.float32), np.full(n - p, -2.0, np.float32)],
        versions=np.r_[np.full(p, -1, np.int32), np.zeros(n - p, np.int32)],
        reward=0.0,
        reward_source="verifier",
        status="ok",
    )
    return TrajectoryGroup.from_samples(
        group_id=group_id, prompt_id=group_id, generator_id="test", samples=[make_sample(1.0, 0, 2), bad]
    )


def _collect(trainer: Trainer) -> Batch:
    batch = asyncio.run(trainer.collect_batch())
    assert batch is not None
    return batch


def _ids(batch: Batch) -> list[str]:
    return [p.group_id for p in batch.trainable]


def test_a_group_redelivered_while_its_batch_fills_trains_once_and_a_later_copy_is_acked_as_handled(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    session = _session(cfg, per_fetch=1)
    trainer = _trainer(cfg, session)
    a = session.deliver(make_group("a"))  # seq 1
    same = session.deliver(_filtered("same"))  # seq 2
    session.redeliver(a)  # redelivered while the batch fills (another rank gave it back, an ack wait ran out)
    session.redeliver(same)
    session.deliver(make_group("b"))  # seq 3

    batch = _collect(trainer)
    assert _ids(batch) == ["a", "b"] and batch.duplicates == 2
    assert [p.group_id for p in batch.consumed] == ["a", "same", "b"], "each group decided once"
    # the filtered group is acked at once, each copy; the trainable one only with its step
    assert session.acked() == [2, 2]
    asyncio.run(trainer.commit(batch))
    assert session.acked() == [2, 2, 1, 2, 1, 2, 3]
    assert trainer.state.trained_groups == 2 and trainer.state.discarded_groups == 1
    assert trainer.state.consumed_seq == 3

    # delivered again after its step committed: acked at once as handled, never trained again
    session.redeliver(a)
    session.deliver(make_group("c"))
    session.deliver(make_group("d"))
    batch = _collect(trainer)
    assert _ids(batch) == ["c", "d"] and batch.duplicates == 1
    assert session.acked()[-1] == 1


def test_low_water_refills_admission_while_groups_keep_arriving(tmp_path: Path) -> None:
    """(K + 1) * B = 4 prompts are admitted at step 0; the first three come back filtered. Their slots are
    refilled as soon as fewer than a batch of admitted groups is still to come, not once the stream runs dry."""
    cfg = _cfg(tmp_path, "staleness.max_staleness=1")

    def generate(prompt_ids: list[str]) -> None:  # a generator answering each admitted prompt with its group
        for prompt_id in prompt_ids:
            index = int(prompt_id.rsplit(".", 1)[1])
            session.deliver(_filtered(prompt_id) if index < 3 else make_group(prompt_id))

    session = _session(cfg, per_fetch=1, on_admit=generate)
    trainer = _trainer(cfg, session)
    asyncio.run(trainer.admit())
    assert session.admitted_ids == [f"t.{i}" for i in range(4)]

    batch = _collect(trainer)
    assert _ids(batch) == ["t.3", "t.4"] and batch.num_dropped == 3
    assert session.admitted_ids == [f"t.{i}" for i in range(7)], "every filtered group's slot refilled"
    fetches = session.of_kind("fetch")
    assert all(returned for _, returned in fetches), f"admission waited for an empty fetch: {fetches}"
    refill = event_index(session.events, lambda e: e[0] == "admit" and "t.4" in e[1])
    third_filtered = event_index(session.events, lambda e: e[0] == "fetch" and e[1] == [("t.2", 3)])
    assert refill > third_filtered, "the refill came when the third filtered group left fewer than a batch to come"


def test_a_refused_group_redelivered_while_its_batch_fills_is_refused_again_and_acked_only_with_the_step(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    session = _session(cfg, per_fetch=1)
    trainer = _trainer(cfg, session)
    bad = session.deliver(_out_of_vocab("bad"))  # seq 1
    session.redeliver(bad)  # the dead letter did not stop this delivery: refused again, not trained
    session.deliver(make_group("a"))
    session.deliver(make_group("b"))

    batch = _collect(trainer)
    assert _ids(batch) == ["a", "b"] and batch.duplicates == 1
    assert session.of_kind("refuse") == [("refuse", "bad", 1, REFUSE_VOCAB)] * 2
    assert set(batch.refused) == {"bad"} and batch.refused["bad"][0] == REFUSE_VOCAB
    assert batch.num_dropped == 1 and batch.consumed == batch.trainable, "a refused group is not consumed"
    assert session.acked() == [], "a refused group is dead-lettered, not acked early"
    asyncio.run(trainer.commit(batch))
    assert session.acked() == [1, 1, 2, 3] and "bad" in trainer.handled


def test_a_replay_that_runs_out_ends_with_a_short_batch_or_none(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    session = _session(cfg, ends=True)
    session.deliver(make_group("a"))
    session.deliver(_filtered("same"))
    batch = _collect(_trainer(cfg, session))
    assert _ids(batch) == ["a"], "the last, short batch of a replayed range still trains"
    session = _session(cfg, ends=True)
    session.deliver(_filtered("only"))
    assert asyncio.run(_trainer(cfg, session).collect_batch()) is None


def test_a_step_acks_its_trainable_groups_only_after_publishing_and_checkpoints_at_the_end(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "trainer.checkpoint_every=50")
    session = _session(cfg, per_fetch=1)
    session.deliver(make_group("a"))  # seq 1
    session.deliver(_filtered("same"))  # seq 2
    session.deliver(make_group("b"))  # seq 3
    trainer = _trainer(cfg, session)

    assert asyncio.run(trainer.run()) == 0
    events = session.events
    published = event_index(events, lambda e: e == ("publish", 1))
    assert event_index(events, lambda e: e == ("ack", [2])) < published, "a dropped group is acked when decided"
    assert event_index(events, lambda e: e[0] == "ack" and 1 in e[1]) > published, "trainable: after publish"
    assert session.acked() == [2, 1, 2, 3]
    assert events[-2:] == [("checkpoint", 1, True), ("close",)]
    assert trainer.state.step == 1 and trainer.state.version == 1 and trainer.state.trained_groups == 2
    (record,) = metrics_records(session.metrics_path)
    assert record["trained_group_ids"] == ["a", "b"] and record["dropped_group_ids"] == {"same": "no_disagreement"}


def test_a_stop_request_while_the_batch_fills_abandons_it_and_gives_its_groups_back(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    trainer: Trainer | None = None

    def stop_when_nothing_came(deliveries: list[Delivery]) -> None:  # SIGTERM while waiting for the second group
        if not deliveries and trainer is not None:
            trainer.stop.set()

    session = _session(cfg, on_fetch=stop_when_nothing_came)
    session.deliver(make_group("a"))
    trainer = _trainer(cfg, session)
    assert asyncio.run(trainer.run()) == 0
    assert session.of_kind("give_back") == [("give_back",)] and session.of_kind("publish") == []
    assert session.acked() == [] and trainer.state.step == 0
    assert session.events[-3:] == [("give_back",), ("checkpoint", 0, True), ("close",)], "given back, then the end"
