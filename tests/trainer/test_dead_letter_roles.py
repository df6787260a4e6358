"""Dead letters and NATS roles, against the real nats-server of the session stack and a real trainer.

A dead letter returns an admission slot and marks its group handled, so one naming a live group would cancel
it: the group would be acked as a duplicate, never trained. Two fences: the server refuses a generator's
publish on the trainer's dead-letter subject (per-role users, `infra/nats_server.py`), and the trainer's own
check (`actors/trainer/slots.py`) never accepts a dead letter for a group still in flight, whoever wrote it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats.aio.client

from actors.servers import resolve_servers
from actors.trainer.slots import DeadLetterCheck
from infra.stack import StackState
from pipeline.wire.consumer import TrajectoryConsumer, ensure_trainer_consumer
from pipeline.wire.headers import H_DLQ_MSG_ID, H_DLQ_REASON, H_DLQ_SEQ, H_DLQ_STREAM, H_MSG_ID
from pipeline.wire.jetstream import connect, read_dead_letters
from pipeline.wire.names import RunNames
from pipeline.wire.prompt_queue import PromptQueue, ensure_prompt_queue
from pipeline.wire.prompts import Prompt
from pipeline.wire.trajectories import TrajectoryPublisher, ensure_trajectory_streams
from tests.support.builders import make_group, metrics_records, publish_groups, run_trainer, trainer_cfg

EVENT_DEADLINE_S = 60.0
"""Upper bound on waiting for an event that must happen (the test fails, naming it, if it does not)."""


def _forged(names: RunNames, stream: str, seq: int, group_id: str) -> dict[str, str]:
    """The headers of a dead letter naming `stream` seq `seq`, holding `group_id`."""
    return {
        H_MSG_ID: f"{stream}:{seq}:forged",
        H_DLQ_REASON: "decode_error",
        H_DLQ_STREAM: stream,
        H_DLQ_SEQ: str(seq),
        H_DLQ_MSG_ID: group_id,
    }


def test_a_generator_cannot_publish_the_trainers_dead_letters_and_the_group_trains(
    stack: StackState, tmp_path: Path
) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=1")
    names = RunNames.for_run(cfg.run.name)
    asyncio.run(publish_groups(cfg, [make_group("x.0"), make_group("x.1"), make_group("x.2")]))

    async def forge() -> tuple[list[str], int]:
        errors: list[Exception] = []
        refused = asyncio.Event()

        async def on_error(exc: Exception) -> None:
            errors.append(exc)
            refused.set()

        nc = nats.aio.client.Client()
        await nc.connect(resolve_servers(cfg).nats_url_for("generator"), error_cb=on_error, allow_reconnect=False)
        try:  # x.0 is live at trajectory seq 1: a dead letter naming it would cancel it
            headers = _forged(names, names.trajectory_stream, 1, "x.0")
            await nc.publish(names.trajectory_dead_letter_subject, b"", headers=headers)
            await nc.flush()
            await asyncio.wait_for(refused.wait(), EVENT_DEADLINE_S)
            for op in ("RESET", "PAUSE", "UNPIN"):  # moving the trainer's consumer past x.0 would skip it too
                refused.clear()
                await nc.publish(f"$JS.API.CONSUMER.{op}.{names.trajectory_stream}.{names.trainer_consumer}", b"{}")
                await nc.flush()
                await asyncio.wait_for(refused.wait(), EVENT_DEADLINE_S)
            info = await nc.jetstream().stream_info(names.dead_letter_stream)  # reading is allowed
        finally:
            await nc.close()
        return [str(e) for e in errors], info.state.messages

    errors, stored = asyncio.run(forge())
    assert len(errors) == 4 and all("permissions violation" in e.lower() for e in errors), errors
    assert names.trajectory_dead_letter_subject in errors[0], errors
    ops = ("reset", "pause", "unpin")  # (the server writes the subject in lower case)
    assert all(f"consumer.{op}." in e.lower() for op, e in zip(ops, errors[1:], strict=True)), errors
    assert stored == 0
    trainer = asyncio.run(run_trainer(cfg))
    records = metrics_records(cfg.run.run_dir / "metrics.jsonl")
    assert [r["trained_group_ids"] for r in records] == [["x.0", "x.1"]]
    assert trainer.state.dead_lettered_groups == 0


def test_no_dead_letter_cancels_a_group_in_flight_whoever_wrote_it(stack: StackState, tmp_path: Path) -> None:
    """A generator may publish prompt dead letters: one naming the prompt of a group it stored is refused while
    that group is in flight. A trajectory dead letter (written with the operator's rights, as on a server
    without role users) naming a delivered, unacked group is held until the trainer decided that group."""
    cfg = trainer_cfg(stack, tmp_path)
    names = RunNames.for_run(cfg.run.name)
    servers = resolve_servers(cfg)

    async def scenario() -> None:
        operator = await connect(servers.nats_url, name="test-trainer-side")
        generator = await connect(servers.nats_url_for("generator"), name="test-forging-generator")
        try:
            js, gen_js = operator.jetstream(), generator.jetstream()
            await ensure_trajectory_streams(js, names, cfg.stream)
            await ensure_prompt_queue(js, names, cfg.stream)
            await ensure_trainer_consumer(js, names)
            await PromptQueue(js, names, cfg.stream).admit_many(
                [Prompt(prompt_id=f"x.{i}", text="1 2 3", answer="3 2 1", policy_version=0) for i in range(3)]
            )
            # the generator runs x.0 and x.1 honestly: group stored, then its prompt acked; x.2 it gives up on
            queue = PromptQueue(gen_js, names, cfg.stream)
            leases = []
            deadline = time.monotonic() + EVENT_DEADLINE_S
            while len(leases) < 3:
                assert time.monotonic() < deadline, f"only {len(leases)} prompts taken"
                leases += await queue.take(max_prompts=3, timeout_s=0.5)
            prompt_seq = {lease.prompt.prompt_id: lease.msg.metadata.sequence.stream for lease in leases}
            publisher = TrajectoryPublisher(gen_js, names, cfg.stream)
            for lease in leases[:2]:
                await publisher.publish(make_group(lease.prompt.prompt_id))
                await lease.done()
            await leases[2].done()  # taken out of the queue, no group: a genuine dead letter's case
            for group_id in ("x.0", "x.2"):
                headers = _forged(names, names.prompt_stream, prompt_seq[group_id], group_id)
                await gen_js.publish(names.prompt_dead_letter_subject, b"", headers=headers)
            # the trainer's consumer takes x.1 (trajectory seq 2) and holds it unacked: in flight
            consumer = await TrajectoryConsumer.bind(js, names, cfg.stream)
            held = []
            while len(held) < 2:
                assert time.monotonic() < deadline, "groups never delivered"
                held += await consumer.fetch(max_groups=2, timeout_s=0.5)
            by_id = {d.group.group_id: d.seq for d in held}
            await js.publish(
                names.trajectory_dead_letter_subject, b"", headers=_forged(names, names.trajectory_stream, 2, "x.1")
            )

            check = DeadLetterCheck(js, names)
            entries, watermark = await read_dead_letters(js, names, after_seq=0, limit=10)
            assert [e.original_id for e in entries] == ["x.0", "x.2", "x.1"]
            genuine, kept = await check.genuine(entries, watermark)
            # x.0's group is stored: refused (it trains); x.2 has none: its slot comes back; x.1 is in flight: held
            assert [e.original_id for e in genuine] == ["x.2"] and check.forged == 1
            assert kept == entries[2].seq - 1
            # where the server keeps generators off the trainer's dead letters (a trainer connected as its own
            # user), a trajectory letter naming its group's message is a trainer's: trusted without the ack floor
            # (one an earlier trainer process wrote must not hold its slot past a restart)
            trusting = DeadLetterCheck(js, names, trajectory_letters_trusted=True)
            genuine, kept = await trusting.genuine(entries[2:], watermark)
            assert [e.original_id for e in genuine] == ["x.1"] and kept == watermark
            # once the trainer decided x.1 (acked after its step), the held letter is read: the slot logic then
            # finds x.1 handled and returns nothing for it
            assert await consumer.ack([by_id["x.1"]]) == 1
            await consumer.ack([by_id["x.0"]])
            genuine, kept = await check.genuine(entries[2:], watermark)
            assert [e.original_id for e in genuine] == ["x.1"] and kept == watermark
        finally:
            await generator.drain()
            await operator.drain()

    asyncio.run(scenario())
