"""The generator against bad input and stuck parts, on the real NATS and S3 (the `stack` fixture).

- a poison prompt fails alone: dead-lettered with a reason when it can never run, nak'ed alone when its
  rollout fails; the other prompts of its batch are published and acked once;
- a verifier that hangs on an answer is killed in its scorer worker at the deadline and replaced: the next batch's
  generate call and a weight pull still run, and the hung sample is the policy's ``scorer_timeout`` (reward 0);
- a version the store does not have (a stale KV announcement, a prompt admitted by an earlier run) is
  not waited for while holding prompts: a WARNING names the run, the version and LATEST;
- a version that cannot be pulled (another model's) is not waited for while holding prompts past a bound:
  they are handed back, an ERROR says why, and the generator takes prompts again once it reaches the version
  (the run's next one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch

from actors.generator.engines.base import GenerateRequest, GenerateResult, SamplingParams
from actors.generator.engines.torch_engine import TorchEngine
from actors.models import MAX_POSITION_EMBEDDINGS, build_model
from pipeline.tasks import Prompt
from pipeline.tasks.char_tokenizer import PAD_ID
from pipeline.wire.announce import announce_version
from pipeline.wire.headers import H_DLQ_MSG_ID, H_DLQ_REASON
from pipeline.wire.prompt_queue import queue_prompt
from storage.weights import WeightPublisher
from tests.support.generators import (
    MODEL,
    TOKENIZER,
    WAIT_S,
    FakeTrainer,
    generator_cfg,
    running_generator,
    unique_run,
)
from tests.support.waits import until

DIGIT_ID = TOKENIZER.token_to_id("1")


async def _prompt_dead_letters(trainer: FakeTrainer) -> dict[str, str]:
    """Prompt id -> dead-letter reason, for every prompt dead-lettered in the trainer's run."""
    info = await trainer.js.stream_info(trainer.names.dead_letter_stream)
    out = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        msg = await trainer.js.get_msg(trainer.names.dead_letter_stream, seq)
        if msg.subject == trainer.names.prompt_dead_letter_subject and msg.headers:
            out[msg.headers[H_DLQ_MSG_ID]] = msg.headers[H_DLQ_REASON]
    return out


def _warnings(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and needle in r.getMessage()]


# ---- poison prompts ------------------------------------------------------------------------------------


def test_prompts_that_can_never_run_are_dead_lettered_alone_and_their_batch_is_published_once(stack) -> None:
    cfg = generator_cfg(stack, unique_run(), "generator.concurrency=4")
    out_of_vocab = Prompt("poison-oov", token_ids=(DIGIT_ID, TOKENIZER.get_vocab_size() + 3), answer="1")
    too_long = Prompt("poison-long", token_ids=(DIGIT_ID,) * MAX_POSITION_EMBEDDINGS, answer="1")

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer:
            await trainer.publish(0)
            good = await trainer.admit(1, policy_version=0)
            for poison in (out_of_vocab, too_long):
                await trainer.queue.admit(queue_prompt(poison, 0))
            good += await trainer.admit(1, policy_version=0)  # one batch: good, poison, poison, good
            async with running_generator(cfg, "poisoned") as rt:
                groups = await trainer.groups(2)
                await until(lambda: rt.generator.metrics.groups_published == 2, what="2 groups published")
                assert sorted(g.group_id for g in groups) == sorted(good)
                dead = await _prompt_dead_letters(trainer)
                assert dead == {"poison-oov": "invalid_token_ids", "poison-long": "prompt_too_long"}
                info = await trainer.prompt_consumer()
                assert info.num_redelivered == 0  # the good prompts were never handed back
                assert info.num_pending == 0 and info.num_ack_pending == 0
            assert await trainer.stored_groups() == 2

    asyncio.run(main())


class _FailsOnMarker(TorchEngine):
    """A real engine that raises on any call holding a request whose prompt starts with `marker` (a prompt
    that passes every check yet breaks the engine)."""

    def __init__(self, marker: Sequence[int]) -> None:
        model = build_model(MODEL, vocab_size=TOKENIZER.get_vocab_size(), seed=123, dtype=torch.float32)
        super().__init__(model, pad_token_id=PAD_ID, seed=7, version=-1)
        self.marker = list(marker)

    def submit(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[Future[GenerateResult]]:
        if any(list(r.input_ids[: len(self.marker)]) == self.marker for r in requests):
            raise RuntimeError("engine broke on the marked prompt")
        return super().submit(requests, params)


def test_a_prompt_whose_rollout_fails_is_naked_alone_while_the_rest_of_its_batch_is_published(stack) -> None:
    cfg = generator_cfg(stack, unique_run(), "generator.concurrency=3", "stream.prompt_max_deliver=2")
    marker = (DIGIT_ID, DIGIT_ID, DIGIT_ID)
    breaker = Prompt("breaker", token_ids=marker, answer="111")

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer:
            await trainer.publish(0)
            good = await trainer.admit(1, policy_version=0)
            await trainer.queue.admit(queue_prompt(breaker, 0))
            good += await trainer.admit(1, policy_version=0)
            async with running_generator(cfg, "breaks", _FailsOnMarker(marker)):
                groups = await trainer.groups(2)
                assert sorted(g.group_id for g in groups) == sorted(good)

                async def breaker_dead() -> bool:
                    return (await _prompt_dead_letters(trainer)).get("breaker") == "max_deliveries"

                # nak'ed alone each time, until the queue's delivery limit
                await until(breaker_dead, what="the breaking prompt dead-lettered at max_deliveries")
            assert await trainer.stored_groups() == 2

    asyncio.run(main())


# ---- hung verifiers ------------------------------------------------------------------------------------


def test_a_hung_verifier_is_killed_and_blocks_neither_the_next_generate_call_nor_a_weight_pull(stack) -> None:
    cfg = generator_cfg(
        stack,
        unique_run(),
        "task.name=tests.support.tasks:hanging_reverse_digits",
        "advantages.group_size=2",
        "generator.concurrency=1",
        "generator.verifier_timeout_s=0.3",
    )

    async def main() -> None:
        # the event loop's default executor (generate calls, weight pulls) as small as on a 2-core machine: two
        # verifications held on it would stop both
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
        async with FakeTrainer(cfg) as trainer:
            await trainer.publish(0)
            first, second = await trainer.admit(2, policy_version=0)  # one prompt per batch
            async with running_generator(cfg, "hung-verifier") as rt:
                (group,) = await asyncio.wait_for(trainer.groups(1), WAIT_S)
                assert group.group_id == first
                _assert_scorer_timeouts(group)
                await asyncio.wait_for(trainer.publish(1), WAIT_S)
                await until(lambda: rt.weights.engine_version == 1, what="a weight pull")
                (group,) = await asyncio.wait_for(trainer.groups(1), WAIT_S)  # so did the next generate
                assert group.group_id == second
                _assert_scorer_timeouts(group)
                assert rt.generator.verifiers.kills >= 4  # each hung worker killed, a fresh one took its place
                assert rt.generator.metrics.failure_reasons.get("scorer_timeout", 0) >= 4  # counted by name

    asyncio.run(main())


def _assert_scorer_timeouts(group: Any) -> None:
    """Both samples scored 0 by the rule for a hung scorer: the policy's, never a masked infra_error."""
    assert set(group.status) <= {"ok", "truncated"} and list(group.reward_source) == ["verifier"] * 2
    assert [float(r) for r in group.reward] == [0.0, 0.0]


# ---- versions the store does not have ------------------------------------------------------------------


def test_a_stale_kv_announcement_is_reported_and_never_waited_for(stack, caplog) -> None:
    cfg = generator_cfg(stack, unique_run())
    caplog.set_level(logging.WARNING, logger="actors.generator.weight_sync")

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer:
            await announce_version(trainer.kv, 7)  # left from an earlier run: the store has no version at all
            async with running_generator(cfg, "stale-kv") as rt:
                await until(
                    lambda: bool(_warnings(caplog, "KV announces version 7")), what="the warning about version 7"
                )
                (message,) = _warnings(caplog, "KV announces version 7")
                assert repr(cfg.run.name) in message and "LATEST is missing" in message
                assert "purge" in message and "new run.name" in message
                assert rt.weights.newest_known == -1
                await trainer.publish(0)  # the new run's trainer starts
                prompt_ids = await trainer.admit(2, policy_version=0)
                groups = await trainer.groups(2)
                assert sorted(g.group_id for g in groups) == sorted(prompt_ids)
                assert rt.weights.engine_version == 0

    asyncio.run(main())


def test_a_prompt_admitted_at_a_version_the_store_lacks_is_released_with_a_warning(stack, caplog) -> None:
    cfg = generator_cfg(stack, unique_run(), "stream.prompt_max_deliver=2", "staleness.max_staleness=2")
    caplog.set_level(logging.WARNING, logger="actors.generator.loop")
    stale = Prompt("from-an-earlier-run", text="1234>", answer="4321", policy_version=9)

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer:
            await trainer.publish(0)
            async with running_generator(cfg, "stale-prompt") as rt:
                rt.generator.unknown_version_nak_delay_s = 0.0
                await trainer.queue.admit(stale)
                (good,) = await trainer.admit(1, policy_version=0)
                (group,) = await trainer.groups(1)
                assert group.group_id == good
                await until(
                    lambda: bool(_warnings(caplog, "prompts admitted at version 9")), what="the warning about version 9"
                )
                message = _warnings(caplog, "prompts admitted at version 9")[0]
                assert repr(cfg.run.name) in message and "LATEST is 0" in message and "from-an-earlier-run" in message

                async def stale_dead() -> bool:
                    return (await _prompt_dead_letters(trainer)).get(stale.prompt_id) == "max_deliveries"

                # released each time, never held: the queue's limit ends it
                await until(stale_dead, what="the stale prompt dead-lettered at max_deliveries")
                assert (await trainer.prompt_consumer()).num_ack_pending == 0
            assert await trainer.stored_groups() == 1

    asyncio.run(main())


# ---- a version that cannot be pulled -------------------------------------------------------------------


def test_a_generator_that_cannot_pull_its_prompts_version_hands_them_back_and_says_why(stack, caplog) -> None:
    cfg = generator_cfg(
        stack,
        unique_run(),
        "generator.concurrency=1",
        "staleness.max_staleness=0",
        "generator.weight_pull_timeout_s=0.5",
    )

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer:
            await trainer.publish(0)
            async with running_generator(cfg, "cannot-pull") as rt:
                await until(lambda: rt.weights.engine_version == 0, what="the engine at version 0")
                assert rt.generator.weight_pull_timeout_s == 0.5  # from the config
                await _publish_another_models_version(trainer, 1)  # every pull of version 1 is refused
                (prompt_id,) = await trainer.admit(1, policy_version=1)  # needs version 1 (max_staleness 0)
                await until(
                    lambda: rt.generator.metrics.weight_pull_timeouts == 1, what="a weight pull timeout"
                )  # was: held forever
                assert rt.generator.metrics.weights_stuck == 1
                for _ in range(100):  # handed back: another generator (here the test's own queue) takes it
                    leases = await trainer.queue.take(timeout_s=0.2)
                    if leases:
                        break
                assert [(x.prompt.prompt_id, x.num_delivered) for x in leases] == [(prompt_id, 2)]
                await leases[0].release()  # ... and gives it back unrun
                assert any("another model" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
                await trainer.publish(2)  # fixed: the generator gets the run's version 2, then takes prompts again
                (group,) = await trainer.groups(1)
                assert group.group_id == prompt_id and rt.weights.engine_version == 2
                assert rt.generator.metrics.weights_stuck == 0

    asyncio.run(main())


async def _publish_another_models_version(trainer: FakeTrainer, version: int) -> None:
    """Publish `version` of another model into the run's store (a second trainer with another
    `model.name_or_path`): its manifest carries another model-config hash, which subscribers refuse."""
    other = WeightPublisher(trainer.store, trainer.cfg.run.name, model_config_hash="another", dtype=torch.float32)
    try:
        tensors = {name: t.clone() for name, t in trainer.versions[0].items()}
        await asyncio.to_thread(other.publish, version, tensors)
        await announce_version(trainer.kv, version)
    finally:
        other.close()


def test_background_loops_stop_even_when_a_cancel_arrives_with_a_reply() -> None:
    """Python 3.11's `asyncio.wait_for` (inside every NATS request) drops a cancel that arrives in the same turn as
    the reply; the generator's shutdown cancels its background loops again until they end."""
    from actors.generator.runtime import cancel_until_done

    async def main() -> None:
        replies: list[asyncio.Future[None]] = []

        async def loop_forever() -> None:
            while True:
                replies.append(asyncio.get_running_loop().create_future())
                await asyncio.wait_for(replies[-1], 5.0)

        task = asyncio.create_task(loop_forever())
        while not replies:
            await asyncio.sleep(0.001)
        replies[-1].set_result(None)  # the reply lands in the cancel's turn: the first cancel is dropped
        stopping = asyncio.create_task(cancel_until_done([task]))
        done, _ = await asyncio.wait({stopping}, timeout=30.0)  # a bound, never reached when it works
        assert stopping in done and task.cancelled() and len(replies) >= 2

    asyncio.run(main())
