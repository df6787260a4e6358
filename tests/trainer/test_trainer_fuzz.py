"""The trainer's part of the fuzz corpus (the transport's is `tests/wire/test_transport.py`): forged dead letters
against a real stream, and prompts files with rows too large for the prompt queue.

Forged dead letters: anyone with the run's NATS token can publish on the dead-letter subjects. Whatever
an entry claims, `DeadLetterCheck` must accept exactly those that name a trajectory-stream message holding
that very group id and already decided by the trainer's consumer (acked or terminated), hold one naming a
group still in flight (never accepting it while it is), and count every other one as forged.

Oversized groups and honest-header inflation: whatever sizes a message's headers claim, a trainer's
`GroupLimits` refuses it as `group_too_large` (naming the cap) exactly when the claim is past the caps, from
the headers alone (the body is never read: a garbage body would otherwise be a `decode_error`); and a
generator turns a group it assembled past the caps into its prompt's `GroupTooLarge` instead of publishing it.

Oversized prompt rows: a prompts file is refused when it is loaded if any row can never be admitted,
and the error names the file and the first such row; a file whose rows all fit loads whole.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterator

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.generator.rollouts import GroupTooLarge, capped
from actors.trainer.prompt_feed import PromptFeed
from actors.trainer.slots import DeadLetterCheck
from infra.stack import StackState
from pipeline.config import load_config
from pipeline.tasks import get_task
from pipeline.wire.consumer import TrajectoryConsumer, ensure_trainer_consumer
from pipeline.wire.group_limits import GROUP_SAMPLES_PER_GROUP_SIZE, GROUP_TOO_LARGE, GroupLimits
from pipeline.wire.headers import H_MAX_VERSION, H_MIN_VERSION, H_MSG_ID, H_NUM_SAMPLES, H_NUM_TOKENS, H_SCHEMA
from pipeline.wire.jetstream import DeadLetterEntry, DeadLetterError, connect
from pipeline.wire.names import RunNames
from pipeline.wire.prompts import Prompt
from pipeline.wire.trajectories import TrajectoryPublisher, decode_payload, ensure_trajectory_streams
from tests.support.builders import wire_group

GROUPS = ("g.0", "g.1", "g.2")
"""The trajectory stream's messages (seqs 1, 2, 3), acked by the trainer's consumer: what genuine dead letters
name."""
LIVE = "g.3"
"""Seq 4: delivered to the trainer's consumer, not acked (in flight): a dead letter naming it is held."""
MAX_MSG_BYTES = 4096
"""`stream.max_msg_bytes` of the prompt-file examples: rows are drawn well below or well above it."""


@pytest.fixture(scope="module")
def dead_letter_env(stack: StackState) -> Iterator[tuple[asyncio.AbstractEventLoop, DeadLetterCheck, RunNames]]:
    """One loop, connection and run with `GROUPS` in its trajectory stream, for every example."""
    loop = asyncio.new_event_loop()
    names = RunNames.for_run(f"dl-{uuid.uuid4().hex[:10]}")
    stream = load_config(None, ["stream.max_bytes=67108864"], environ={}).stream

    async def setup() -> tuple[object, DeadLetterCheck]:
        nc = await connect(stack.nats_url, name="test-dead-letters")
        js = nc.jetstream()
        await ensure_trajectory_streams(js, names, stream)
        await ensure_trainer_consumer(js, names)
        consumer = await TrajectoryConsumer.bind(js, names, stream)
        publisher = TrajectoryPublisher(js, names, stream)
        for group_id in (*GROUPS, LIVE):
            await publisher.publish(wire_group(group_id))
        held: list[int] = []
        while len(held) < len(GROUPS) + 1:
            held += [d.seq for d in await consumer.fetch(max_groups=4, timeout_s=1.0)]
        assert await consumer.ack(held[: len(GROUPS)]) == len(GROUPS)  # LIVE stays in flight
        return nc, DeadLetterCheck(js, names)

    nc, check = loop.run_until_complete(setup())
    yield loop, check, names
    loop.run_until_complete(nc.drain())  # type: ignore[attr-defined]
    loop.close()


_entry_seqs = itertools.count(1)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_only_dead_letters_of_messages_that_exist_are_genuine(
    dead_letter_env: tuple[asyncio.AbstractEventLoop, DeadLetterCheck, RunNames], data: st.DataObject
) -> None:
    loop, check, names = dead_letter_env
    subject = data.draw(
        st.sampled_from([names.trajectory_dead_letter_subject, f"leeway.other-{names.run}.dlq.trajectories", "x.y", ""])
    )
    original_stream = data.draw(st.sampled_from([names.trajectory_stream, names.prompt_stream, "OTHER", None]))
    original_seq = data.draw(st.one_of(st.none(), st.integers(-3, 6), st.integers(7, 2**62)))
    original_id = data.draw(st.one_of(st.none(), st.sampled_from(GROUPS), st.text(max_size=12)))
    entry = DeadLetterEntry(
        seq=next(_entry_seqs),
        subject=subject,
        reason=data.draw(st.sampled_from(["max_deliveries", "decode_error", "", "forged"])),
        original_id=original_id,
        original_stream=original_stream,
        original_seq=original_seq,
    )
    names_a_message = subject == names.trajectory_dead_letter_subject and original_stream == names.trajectory_stream
    genuine = names_a_message and original_seq in (1, 2, 3) and original_id == GROUPS[original_seq - 1]
    in_flight = names_a_message and original_seq == 4 and original_id == LIVE
    forged_before = check.forged
    accepted, watermark = loop.run_until_complete(check.genuine([entry], watermark=entry.seq))
    assert accepted == ([entry] if genuine else []), entry
    assert check.forged == forged_before + (0 if genuine or in_flight else 1), entry
    assert watermark == (entry.seq - 1 if in_flight else entry.seq)  # only a live group's letter is held back


@settings(max_examples=200, deadline=None)
@given(
    num_samples=st.one_of(st.integers(-2, 40), st.integers(10**4, 10**5), st.just(2**62)),
    num_tokens=st.one_of(st.integers(0, 5000), st.sampled_from([2**27, 2**31, 2**63 - 1])),
    max_tokens=st.one_of(st.none(), st.integers(1, 4096)),
    body=st.binary(max_size=64),
)
def test_a_group_claiming_too_much_is_refused_from_its_headers_before_anything_inflates(
    num_samples: int, num_tokens: int, max_tokens: int | None, body: bytes
) -> None:
    limits = GroupLimits(max_samples=16, max_sample_tokens=128, max_tokens=max_tokens)
    headers = {
        H_MSG_ID: "g.0",
        H_SCHEMA: "3",
        H_MIN_VERSION: "0",
        H_MAX_VERSION: "0",
        H_NUM_SAMPLES: str(num_samples),
        H_NUM_TOKENS: str(num_tokens),
    }
    caps = [max(0, num_samples) * 128, *([max_tokens] if max_tokens is not None else [])]
    too_large = num_samples > 16 or num_tokens > min(caps)
    with pytest.raises(DeadLetterError) as refused:
        decode_payload(headers, body, limits)  # the body is garbage: only a refusal from the headers names a cap
    if too_large:
        assert refused.value.reason == GROUP_TOO_LARGE, refused.value
        assert "over the cap of" in refused.value.detail and "before decoding" in refused.value.detail
    else:
        assert refused.value.reason != GROUP_TOO_LARGE, refused.value


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.sampled_from(["small", "big"]), min_size=1, max_size=6), fmt=st.sampled_from(["jsonl", "parquet"])
)
def test_a_prompts_file_is_refused_at_load_naming_its_first_row_too_big_for_the_queue(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[str], fmt: str
) -> None:
    rows = [{"prompt": "7" * (MAX_MSG_BYTES // 4 if size == "small" else MAX_MSG_BYTES + 1)} for size in sizes]
    path = tmp_path_factory.mktemp("prompts") / f"prompts.{fmt}"
    if fmt == "jsonl":
        path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = load_config(None, [f"task.prompts_file={path}", f"stream.max_msg_bytes={MAX_MSG_BYTES}"], environ={})
    task = get_task(cfg.task.name, **cfg.task.args)
    if "big" not in sizes:
        feed = PromptFeed(cfg, task, start=0)
        assert [p.text for p in feed.take(len(rows))] == [r["prompt"] for r in rows]  # loaded whole, in order
        return
    first_big = sizes.index("big")
    with pytest.raises(ValueError, match=rf"{path}: row {first_big} .* over stream.max_msg_bytes = {MAX_MSG_BYTES}"):
        PromptFeed(cfg, task, start=0)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    max_samples=st.one_of(st.none(), st.integers(2, 30)),
    max_tokens=st.one_of(st.none(), st.integers(1, 400)),
)
def test_a_generator_never_publishes_a_group_past_the_caps(
    sizes: list[int], max_samples: int | None, max_tokens: int | None
) -> None:
    """The generator's side of the caps: an assembled group past them becomes its prompt's `GroupTooLarge`."""
    limits = GroupLimits.for_run(group_size=2, max_sample_tokens=None, max_samples=max_samples, max_tokens=max_tokens)
    samples = [wire_group("g.0", num_samples=1, num_tokens=8 + n).sample(0) for n in sizes]
    prompt = Prompt(prompt_id="g.0", text="x")
    [outcome] = capped([prompt], [samples], limits)
    tokens = sum(8 + n for n in sizes)
    too_large = len(sizes) > (max_samples or 2 * GROUP_SAMPLES_PER_GROUP_SIZE) or (
        max_tokens is not None and tokens > max_tokens
    )
    if too_large:
        assert isinstance(outcome, GroupTooLarge) and outcome.reason == GROUP_TOO_LARGE, outcome
        assert "over the cap of" in str(outcome)
    else:
        assert outcome is samples
