"""The trainer's part of the fuzz corpus (the transport's is `tests/wire/test_transport.py`): forged dead letters
against a real stream, and prompts files with rows too large for the prompt queue.

Forged dead letters: anyone with the run's NATS token can publish on the dead-letter subjects. Whatever
an entry claims, `DeadLetterCheck` must accept exactly those that name a trajectory-stream message holding
that very group id, and count every other one as forged.

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

from actors.trainer.prompt_feed import PromptFeed
from actors.trainer.slots import DeadLetterCheck
from infra.stack import StackState
from pipeline.config import load_config
from pipeline.tasks import get_task
from pipeline.wire.jetstream import DeadLetterEntry, connect
from pipeline.wire.names import RunNames
from pipeline.wire.trajectories import TrajectoryPublisher, ensure_trajectory_streams
from tests.support.builders import wire_group

GROUPS = ("g.0", "g.1", "g.2")
"""The trajectory stream's messages (seqs 1, 2, 3): what genuine dead letters name."""
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
        publisher = TrajectoryPublisher(js, names, stream)
        for group_id in GROUPS:
            await publisher.publish(wire_group(group_id))
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
    genuine = (
        subject == names.trajectory_dead_letter_subject
        and original_stream == names.trajectory_stream
        and original_seq in (1, 2, 3)
        and original_id == GROUPS[original_seq - 1]
    )
    forged_before = check.forged
    accepted, watermark = loop.run_until_complete(check.genuine([entry], watermark=entry.seq))
    assert accepted == ([entry] if genuine else []), entry
    assert check.forged == forged_before + (0 if genuine else 1), entry
    assert watermark == entry.seq  # decided now: nothing is held back


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
