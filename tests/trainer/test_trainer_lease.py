"""One trainer per run: a second live trainer on the same run refuses to start, naming the holder; a replay
trainer needs no lease; a trainer whose lease another took over stops without writing anything more."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from actors.servers import open_run_store, resolve_servers
from actors.trainer.checkpoints import complete_checkpoints
from actors.trainer.run_lease import LeaseKeeper
from actors.trainer.runtime import open_trainer
from infra.stack import StackState
from pipeline.wire.jetstream import connect
from pipeline.wire.lease import LEASE_KEY, LeaseHeld, LeaseLost, LeaseRecord, lease_kv
from pipeline.wire.names import RunNames
from pipeline.wire.replay import ReplaySelection
from tests.support.builders import make_group, metrics_records, publish_groups, trainer_cfg

LEASE = ("trainer.lease_ttl_s=2", "trainer.lease_heartbeat_s=0.1")
EVENT_DEADLINE_S = 120.0


def test_a_second_trainer_on_the_run_refuses_naming_the_first_and_starts_once_it_is_gone(
    stack: StackState, tmp_path: Path
) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=1", *LEASE)

    async def scenario() -> int:
        first = await open_trainer(cfg)
        try:
            with pytest.raises(LeaseHeld, match=rf"pid {os.getpid()}"):
                await open_trainer(cfg)
            replay = await open_trainer(cfg, replay=ReplaySelection(from_seq=1))  # reads only: no lease needed
            await replay.close()
        finally:
            await first.close()  # releases the lease
        await publish_groups(cfg, [make_group("a"), make_group("b")])
        second = await asyncio.wait_for(open_trainer(cfg), timeout=EVENT_DEADLINE_S)
        return await asyncio.wait_for(second.run(), timeout=EVENT_DEADLINE_S)

    assert asyncio.run(scenario()) == 0
    assert [r["trained_group_ids"] for r in metrics_records(cfg.run.run_dir / "metrics.jsonl")] == [["a", "b"]]


def test_a_trainer_whose_lease_was_taken_over_stops_and_writes_nothing_more(stack: StackState, tmp_path: Path) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.max_steps=50", "trainer.checkpoint_every=50", *LEASE)
    names = RunNames.for_run(cfg.run.name)
    asyncio.run(publish_groups(cfg, [make_group("a"), make_group("b")]))

    async def scenario() -> None:
        trainer = await open_trainer(cfg)
        running = asyncio.create_task(trainer.run())
        deadline = asyncio.get_running_loop().time() + EVENT_DEADLINE_S
        metrics = cfg.run.run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics_records(metrics)):  # step 1 committed: the trainer holds the run
            assert asyncio.get_running_loop().time() < deadline and not running.done()
            await asyncio.sleep(0.05)
        nc = await connect(resolve_servers(cfg).nats_url, name="test-usurper")
        kv = await lease_kv(nc.jetstream(), names)
        usurper = LeaseRecord("usurper", "elsewhere", 4242, 0.0)
        await kv.put(LEASE_KEY, usurper.to_bytes())  # what a takeover after a long freeze looks like
        await nc.drain()
        with pytest.raises(LeaseLost, match="elsewhere"):
            await asyncio.wait_for(running, timeout=EVENT_DEADLINE_S)

    asyncio.run(scenario())
    assert len(metrics_records(cfg.run.run_dir / "metrics.jsonl")) == 1  # no step after the loss
    assert complete_checkpoints(open_run_store(cfg), cfg.run.name) == []  # and no final checkpoint either


class _ReplyLease:
    """A lease whose renewal waits for its reply through `asyncio.wait_for`, as every NATS request does."""

    run, ttl_s, renewed_at = "r", 60.0, None  # never renewed here: no fence

    def __init__(self) -> None:
        self.reply: asyncio.Future[None] | None = None
        self.renewals = 0
        self.released = False

    def token(self) -> dict[str, object]:
        return {"holder": "reply-lease"}

    async def renew(self) -> None:
        self.reply = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(self.reply, 5.0)
        self.renewals += 1

    async def release(self) -> None:
        self.released = True


def test_closing_the_keeper_ends_its_heartbeat_even_when_the_cancel_arrives_with_the_reply() -> None:
    async def main() -> None:
        lease = _ReplyLease()
        keeper = LeaseKeeper(lease, heartbeat_s=0.01, on_lost=lambda: None)  # type: ignore[arg-type]
        keeper._task = asyncio.create_task(keeper._beat())
        while lease.reply is None:  # the first renewal is waiting for its reply
            await asyncio.sleep(0.001)
        lease.reply.set_result(None)  # the reply arrives in the same turn as the cancel: wait_for drops the cancel
        closing = asyncio.create_task(keeper.close())
        done, _ = await asyncio.wait({closing}, timeout=30.0)  # a bound, never reached when it works
        assert closing in done, "close() hangs: the heartbeat renews on after its cancel was lost"
        assert keeper._task is not None and keeper._task.done()
        assert lease.released and lease.renewals == 1

    asyncio.run(main())
