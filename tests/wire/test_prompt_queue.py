"""Prompt work queue on a real nats-server: done once, redelivered when a generator dies, dead-lettered at the limit."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import orjson
import pytest

from pipeline.config import StreamConfig
from pipeline.wire.headers import H_DLQ_DETAIL, H_DLQ_REASON
from pipeline.wire.jetstream import connect
from pipeline.wire.names import RunNames
from pipeline.wire.prompt_queue import Prompt, PromptError, PromptQueue, ensure_prompt_queue
from pipeline.wire.prompts import PROMPT_SCHEMA_VERSION
from pipeline.wire.trajectories import ensure_trajectory_streams


def _stream(**overrides) -> StreamConfig:
    return StreamConfig(**{"max_bytes": 64 * 2**20, "prompt_ack_wait_s": 1.0, **overrides})


async def _queue(url: str, names: RunNames, stream: StreamConfig, name: str):
    nc = await connect(url, name=name)
    js = nc.jetstream(timeout=10)
    await ensure_trajectory_streams(js, names, stream)  # the run's dead-letter stream
    await ensure_prompt_queue(js, names, stream)
    return nc, js, PromptQueue(js, names, stream)


def test_prompt_json_round_trip_and_validation():
    p = Prompt("p-1", text="2+2?", answer="4", tags=("math",), metadata={"level": 1}, policy_version=3)
    assert Prompt.from_json(p.to_json()) == p
    assert Prompt.from_json(Prompt("p-2", token_ids=(1, 2, 3)).to_json()).token_ids == (1, 2, 3)
    for bad, field in (
        (b"nope", "not JSON"),
        (b"[]", "JSON object"),
        (b'{"schema_version": 1, "prompt_id": "p"}', "text"),
        (b'{"schema_version": 1, "prompt_id": "a/b", "text": "x"}', "prompt_id"),
        (b'{"schema_version": 1, "prompt_id": "p", "text": "x", "token_ids": [1]}', "text"),
        (b'{"schema_version": 1, "prompt_id": "p", "token_ids": [-1]}', "token_ids"),
        (b'{"schema_version": 1, "prompt_id": "p", "text": "x", "answer": 4}', "answer"),
        (b'{"schema_version": 1, "prompt_id": "p", "text": "x", "tags": [1]}', "tags"),
        (b'{"schema_version": 1, "prompt_id": "p", "text": "x", "policy_version": "7"}', "policy_version"),
        (b'{"schema_version": 1, "prompt_id": "p", "text": "x", "extra": 1}', "extra"),
    ):
        with pytest.raises(PromptError, match=field):
            Prompt.from_json(bad)


def test_a_prompt_without_this_builds_schema_version_is_refused_naming_the_field():
    """No format is guessed from the fields: a record says its version, and a reader refuses one it does not know."""
    assert orjson.loads(Prompt("p-1", text="x").to_json())["schema_version"] == 1  # what every earlier build reads
    chat = Prompt("p-1", messages=[{"role": "user", "content": "x"}])
    assert orjson.loads(chat.to_json())["schema_version"] == PROMPT_SCHEMA_VERSION == 2
    first_format = b'{"prompt_id": "p-1", "text": "12>", "metadata": {"answer": "21", "policy_version": 4}}'
    for bad, said in (
        (first_format, "schema_version missing"),
        (b'{"schema_version": 3, "prompt_id": "p-1", "text": "x"}', "schema_version 3 unknown"),
        (b'{"schema_version": 1, "prompt_id": "p-1", "messages": []}', "unknown prompt fields"),  # 1 had no chats
        (b'{"schema_version": "1", "prompt_id": "p-1", "text": "x"}', "schema_version '1' unknown"),
        (b'{"schema_version": true, "prompt_id": "p-1", "text": "x"}', "schema_version True unknown"),
    ):
        with pytest.raises(PromptError, match=said):
            Prompt.from_json(bad)


def test_prompts_are_done_once_and_deduped(stack):
    async def main() -> None:
        names, stream = RunNames.for_run(f"q-{uuid.uuid4().hex[:8]}"), _stream()
        nc, js, queue = await _queue(stack.nats_url, names, stream, "trainer")
        try:
            assert await queue.admit_many([Prompt(f"p{i}", text=str(i)) for i in range(3)]) == 3
            assert await queue.admit(Prompt("p1", text="1")) is False
            leases = await queue.take(max_prompts=5)
            assert [lease.prompt.prompt_id for lease in leases] == ["p0", "p1", "p2"]
            for lease in leases:
                await lease.in_progress()
                await lease.done()
            assert await queue.take(timeout_s=0.3) == []
            assert (await js.stream_info(names.prompt_stream)).state.messages == 0  # work queue: acked = gone
        finally:
            await nc.close()

    asyncio.run(main())


def test_prompt_of_a_dead_generator_goes_to_another_then_dead_letters_at_the_limit(stack):
    async def main() -> None:
        names, stream = RunNames.for_run(f"q-{uuid.uuid4().hex[:8]}"), _stream(prompt_max_deliver=2)
        nc, js, trainer = await _queue(stack.nats_url, names, stream, "trainer")
        try:
            await trainer.admit(Prompt("hard", text="?"))
            gen_a, _, queue_a = await _queue(stack.nats_url, names, stream, "gen-a")
            (lease,) = await queue_a.take()
            assert lease.num_delivered == 1
            await gen_a.close()  # generator A dies mid-rollout, without ack or heartbeat
            gen_b, _, queue_b = await _queue(stack.nats_url, names, stream, "gen-b")
            leases = []
            for _ in range(10):
                leases = await queue_b.take(timeout_s=0.5)
                if leases:
                    break
            assert [(x.prompt.prompt_id, x.num_delivered) for x in leases] == [("hard", 2)]
            # B dies too; the third delivery is over the limit of 2: dead-lettered, not run
            for _ in range(10):
                if await queue_b.take(timeout_s=0.5) == [] and queue_b.dead_letters.counts["max_deliveries"]:
                    break
            assert queue_b.dead_letters.counts["max_deliveries"] == 1
            last = await js.get_last_msg(names.dead_letter_stream, names.prompt_dead_letter_subject)
            assert last.headers[H_DLQ_REASON] == "max_deliveries" and Prompt.from_json(last.data).prompt_id == "hard"
            await gen_b.close()
        finally:
            await nc.close()

    asyncio.run(main())


def test_malformed_prompt_is_dead_lettered(stack):
    async def main() -> None:
        names, stream = RunNames.for_run(f"q-{uuid.uuid4().hex[:8]}"), _stream()
        nc, js, queue = await _queue(stack.nats_url, names, stream, "gen")
        try:
            await js.publish(names.prompt_subject, b'{"schema_version": 1, "prompt_id": 5}')
            await js.publish(names.prompt_subject, b'{"schema_version": 99, "prompt_id": "later", "text": "x"}')
            await queue.admit(Prompt("fine", text="x"))
            got = []
            for _ in range(5):
                got += await queue.take(max_prompts=3, timeout_s=0.5)
                if got:
                    break
            assert [x.prompt.prompt_id for x in got] == ["fine"]
            assert queue.dead_letters.counts == {"bad_prompt": 2}
            last = await js.get_last_msg(names.dead_letter_stream, names.prompt_dead_letter_subject)
            assert last.headers[H_DLQ_REASON] == "bad_prompt" and "schema_version 99" in last.headers[H_DLQ_DETAIL]
        finally:
            await nc.close()

    asyncio.run(main())


async def _take_until(queue: PromptQueue, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Keep taking (each take handles what the server delivers) until `done()`; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "condition not reached in time"
        for lease in await queue.take(timeout_s=0.2):
            await lease.release()


def test_a_prompt_whose_dead_letter_fails_past_its_last_delivery_is_dead_lettered_once_the_dlq_is_back(stack):
    """The dead-letter stream is away for more tries than any fixed headroom: the prompt keeps coming back (its
    dead letter retried with backoff), and is dead-lettered, not stranded in the work queue, once it is back."""

    async def main() -> None:
        names, stream = RunNames.for_run(f"q-{uuid.uuid4().hex[:8]}"), _stream(prompt_max_deliver=1)
        nc, js, queue = await _queue(stack.nats_url, names, stream, "gen")
        queue.dead_letters.retry_delay_s, queue.dead_letters.retry_delay_max_s = 0.05, 0.2
        try:
            await queue.admit(Prompt("doomed", text="?"))
            (lease,) = await queue.take()
            await js.delete_stream(names.dead_letter_stream)  # the DLQ is away (deleted, full, ...)
            await lease.release()  # the generator "died": the next delivery is past the limit of 1
            await _take_until(queue, lambda: queue.dead_letters.failures["max_deliveries"] >= 5)
            assert queue.dead_letters.counts["max_deliveries"] == 0
            assert (await js.stream_info(names.prompt_stream)).state.messages == 1  # still there, still delivered
            await ensure_trajectory_streams(js, names, stream)  # the DLQ is back
            await _take_until(queue, lambda: queue.dead_letters.counts["max_deliveries"] == 1)
            last = await js.get_last_msg(names.dead_letter_stream, names.prompt_dead_letter_subject)
            assert last.headers[H_DLQ_REASON] == "max_deliveries" and Prompt.from_json(last.data).prompt_id == "doomed"
            assert (await js.stream_info(names.prompt_stream)).state.messages == 0  # terminated only once stored
        finally:
            await nc.close()

    asyncio.run(main())


def test_chat_prompts_round_trip_and_bad_messages_are_refused_naming_the_message():
    chat = Prompt(
        "c-1", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], answer="4"
    )
    back = Prompt.from_json(chat.to_json())
    assert back == chat and back.messages is not None and back.messages[1]["content"] == "2+2?"
    assert Prompt.from_json(Prompt("t-1", text="x").to_json()).messages is None
    for messages, said in (
        ([], "non-empty list"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\].role 'robot'"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": 7}], r"messages\[1\].content"),
        ("hello", "non-empty list"),
    ):
        with pytest.raises(PromptError, match=said):
            Prompt("c-2", messages=messages)
    with pytest.raises(PromptError, match="exactly one of text, token_ids and messages"):
        Prompt("c-3", text="x", messages=[{"role": "user", "content": "x"}])
