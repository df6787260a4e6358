"""The trainer's door (token ids and lengths the model can take) and the admission slots of dead letters,
against real NATS and S3."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from actors.servers import resolve_servers
from actors.trainer.runtime import open_trainer
from actors.trainer.sessions import LiveSession
from actors.trainer.slots import DeadLetterEntry, slots_to_return
from infra.stack import StackState
from pipeline.config import LeewayConfig
from pipeline.wire.codec import encode_group
from pipeline.wire.headers import H_DLQ_DETAIL, H_DLQ_MSG_ID, H_DLQ_REASON, H_NUM_TOKENS
from pipeline.wire.jetstream import connect
from pipeline.wire.names import RunNames
from pipeline.wire.prompt_queue import PromptLease, PromptQueue
from pipeline.wire.replay import ReplaySelection
from pipeline.wire.trajectories import group_headers
from pipeline.wire.trajectory import Sample, TrajectoryGroup
from tests.support.builders import make_group, make_sample, metrics_records, publish_groups, run_trainer, trainer_cfg

EVENT_DEADLINE_S = 60.0
"""Upper bound on waiting for an event that must happen (the test fails, naming it, if it does not)."""


def _bad_group(group_id: str, tokens: list[int]) -> TrajectoryGroup:
    """A group whose second sample has `tokens` (first two are prompt tokens), the first a normal sample."""
    n = len(tokens)
    bad = Sample(
        tokens=np.array(tokens, np.int32),
        loss_mask=np.r_[np.zeros(2, np.uint8), np.ones(n - 2, np.uint8)],
        logprobs=np.r_[np.zeros(2, np.float32), np.full(n - 2, -2.0, np.float32)],
        versions=np.r_[np.full(2, -1, np.int32), np.zeros(n - 2, np.int32)],
        reward=0.0,
        reward_source="verifier",
        status="ok",
    )
    return TrajectoryGroup.from_samples(
        group_id=group_id, prompt_id=group_id, generator_id="test", samples=[make_sample(1.0, 0, 2), bad]
    )


async def _dead_letters(cfg: LeewayConfig) -> list[dict[str, str]]:
    names = RunNames.for_run(cfg.run.name)
    nc = await connect(resolve_servers(cfg).nats_url, name="test-dlq")
    try:
        js = nc.jetstream()
        info = await js.stream_info(names.dead_letter_stream)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(names.dead_letter_stream, seq)
            out.append({"subject": msg.subject, **(msg.headers or {})})
        return out
    finally:
        await nc.drain()


def test_groups_past_the_vocabulary_or_the_context_are_dead_lettered_and_the_step_goes_on(
    stack: StackState, tmp_path: Path
) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=2", "staleness.max_staleness=1")
    # the char tokenizer has 21 ids and tiny-llama has 128 positions; ids "x.<i>" look admitted (slots!)
    oov = _bad_group("x.0", [1, 5, 6, 999, 7])
    long = _bad_group("x.1", [1, 5, *([6] * 198)])
    asyncio.run(publish_groups(cfg, [oov, make_group("a"), long, make_group("b"), make_group("c"), make_group("d")]))
    trainer = asyncio.run(run_trainer(cfg))

    records = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert [r["trained_group_ids"] for r in records] == [["a", "b"], ["c", "d"]]
    assert records[0]["refused_group_ids"] == {"x.0": "token_out_of_vocab", "x.1": "sample_too_long"}
    assert records[0]["groups/refused/token_out_of_vocab"] == 1 and records[0]["groups/refused"] == 2
    letters = {d[H_DLQ_MSG_ID]: d for d in asyncio.run(_dead_letters(cfg))}
    assert set(letters) == {"x.0", "x.1"}
    assert letters["x.0"][H_DLQ_REASON] == "token_out_of_vocab"
    assert "sample 1" in letters["x.0"][H_DLQ_DETAIL] and "token id 999" in letters["x.0"][H_DLQ_DETAIL]
    assert letters["x.1"][H_DLQ_REASON] == "sample_too_long" and "200 tokens" in letters["x.1"][H_DLQ_DETAIL]
    # their slots came back once: counted by the step, not again when the dead letters were read
    assert trainer.state.discarded_groups == 2 and trainer.state.dead_lettered_groups == 0
    assert trainer.state.dead_letter_seq == 2

    # a replay of the same range skips and counts them, and dead-letters nothing more
    replay = asyncio.run(run_trainer(cfg, ReplaySelection(from_seq=1)))
    replayed = metrics_records(replay.session.metrics_path)
    assert replayed[0]["refused_group_ids"] == {"x.0": "token_out_of_vocab", "x.1": "sample_too_long"}
    assert len(asyncio.run(_dead_letters(cfg))) == 2


def test_a_prompt_dead_lettered_at_max_deliver_gives_its_admission_slot_back(stack: StackState, tmp_path: Path) -> None:
    # capacity at step 0: (0 + K + 1) * B = 2 prompts; nothing is ever trained here
    cfg = trainer_cfg(
        stack, tmp_path, "staleness.max_staleness=0", "stream.prompt_max_deliver=1", "trainer.max_steps=1"
    )
    names = RunNames.for_run(cfg.run.name)

    async def scenario() -> tuple[list[str], int]:
        trainer = await open_trainer(cfg)
        assert isinstance(trainer.session, LiveSession)
        task = asyncio.create_task(trainer.run())
        nc = await connect(resolve_servers(cfg).nats_url, name="test-generator")
        queue = PromptQueue(nc.jetstream(), names, cfg.stream)
        leases: list[PromptLease] = []
        deadline = time.monotonic() + EVENT_DEADLINE_S
        while len(leases) < 2:  # the two admitted prompts, held as a generator holds them
            assert time.monotonic() < deadline and not task.done(), (leases, task)
            leases += await queue.take(max_prompts=2, timeout_s=0.5)
        taken = [lease.prompt.prompt_id for lease in leases]
        # the poison prompt "kills its generator": given back, it is delivered past prompt_max_deliver = 1,
        # and the queue dead-letters it instead of handing it out
        await leases[0].release()
        while not queue.dead_letters.counts["max_deliveries"]:
            assert time.monotonic() < deadline, "the poison prompt was never dead-lettered"
            taken += [lease.prompt.prompt_id for lease in await queue.take(max_prompts=1, timeout_s=0.5)]
        # its slot comes back: the trainer admits a third prompt (the other one is still outstanding)
        while len(set(taken)) < 3:
            assert time.monotonic() < deadline and not task.done(), f"no prompt admitted after {taken}"
            taken += [lease.prompt.prompt_id for lease in await queue.take(max_prompts=2, timeout_s=0.5)]
        trainer.stop.set()
        assert await asyncio.wait_for(task, timeout=EVENT_DEADLINE_S) == 0
        await queue.close()
        await nc.drain()
        return taken, trainer.state.dead_lettered_groups

    taken, returned = asyncio.run(scenario())
    assert len(set(taken)) == 3 and returned == 1


def _entry(original_id: str | None, seq: int = 1) -> DeadLetterEntry:
    return DeadLetterEntry(seq, "leeway.r.dlq.prompts", "max_deliveries", original_id)


def test_only_admitted_unhandled_ids_get_their_slot_back_and_each_once() -> None:
    entries = [_entry("t7.0"), _entry("t7.0", 2), _entry("t9.3"), _entry("t1.9"), _entry(None), _entry("junk")]
    returned = slots_to_return(entries, admitted=5, is_known=lambda g: g == "t9.3")
    assert returned == ["t7.0"]  # t9.3 handled already, t1.9 never admitted (index 9 >= 5), no id, not an id


def test_groups_over_the_sample_or_token_caps_are_dead_lettered_from_their_headers(
    stack: StackState, tmp_path: Path
) -> None:
    """A group of more samples than `rollout.max_group_samples`, and a message whose headers claim 2^27 tokens
    (more than its samples x the model's 128 positions), are dead-lettered `group_too_large` before decoding,
    naming the cap; the groups around them train."""
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=1", "rollout.max_group_samples=4")
    names = RunNames.for_run(cfg.run.name)
    wide = make_group("x.0", rewards=(1.0, 0.0, 1.0, 0.0, 1.0))  # 5 samples > 4

    async def publish_claiming_huge() -> None:
        honest = make_group("x.1")  # a real body: only the claimed size is out of bounds
        nc = await connect(resolve_servers(cfg).nats_url, name="test-inflation")
        try:
            headers = {**group_headers(honest), H_NUM_TOKENS: str(2**27)}
            await nc.jetstream().publish(names.trajectory_subject, encode_group(honest), headers=headers)
        finally:
            await nc.drain()

    asyncio.run(publish_groups(cfg, [wide, make_group("a")]))
    asyncio.run(publish_claiming_huge())
    asyncio.run(publish_groups(cfg, [make_group("b")]))
    asyncio.run(run_trainer(cfg))

    records = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert [r["trained_group_ids"] for r in records] == [["a", "b"]]
    letters = {d[H_DLQ_MSG_ID]: d for d in asyncio.run(_dead_letters(cfg))}
    assert {g: d[H_DLQ_REASON] for g, d in letters.items()} == {"x.0": "group_too_large", "x.1": "group_too_large"}
    assert "5 samples, over the cap of 4 samples per group" in letters["x.0"][H_DLQ_DETAIL]
    detail = letters["x.1"][H_DLQ_DETAIL]
    assert f"{2**27} tokens, over the cap of 256 tokens per group" in detail, detail
    assert "2 samples x the model's context of 128 tokens" in detail and "before decoding" in detail
