"""Replay returns exactly the selected range, in order, after the trainer acked it; and exports it to Parquet."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import uuid

import numpy as np
import orjson

from actors.tools import replay as replay_cmd
from infra.ports import free_port
from infra.stack import load_credentials
from pipeline.config import LeewayConfig, StreamConfig
from pipeline.wire.codec import read_parquet
from pipeline.wire.consumer import TrajectoryConsumer, ensure_trainer_consumer
from pipeline.wire.headers import H_CLAIM_CHECK
from pipeline.wire.jetstream import connect
from pipeline.wire.names import RunNames
from pipeline.wire.replay import ReplayReader, ReplaySelection
from pipeline.wire.trajectories import TrajectoryPublisher, ensure_trajectory_streams, group_headers
from pipeline.wire.trajectory import Sample, TrajectoryGroup
from storage.s3 import S3Options, S3Store

NUM_GROUPS = 10


def _group(i: int) -> TrajectoryGroup:
    mask = np.r_[np.zeros(4, np.uint8), np.ones(12, np.uint8)]
    sample = Sample(
        tokens=np.arange(16, dtype=np.int32) + i,
        loss_mask=mask,
        logprobs=np.where(mask == 1, -0.5, 0).astype(np.float32),
        versions=np.where(mask == 1, i, -1).astype(np.int32),
    )
    return TrajectoryGroup.from_samples(group_id=f"g{i}", prompt_id=f"p{i}", generator_id="gen", samples=[sample])


async def _recorded_run(url: str, names: RunNames, stream: StreamConfig) -> list[float]:
    """Publish groups g0..g9 (group i at policy version i), let the trainer consume and ack all of them."""
    nc = await connect(url, name="trainer")
    try:
        js = nc.jetstream(timeout=10)
        await ensure_trajectory_streams(js, names, stream)
        await ensure_trainer_consumer(js, names)
        publisher = TrajectoryPublisher(js, names, stream)
        for i in range(NUM_GROUPS):
            await publisher.publish(_group(i))
        consumer = await TrajectoryConsumer.bind(js, names, stream)
        stamps: dict[int, float] = {}
        while len(stamps) < NUM_GROUPS:
            batch = await consumer.fetch(timeout_s=2)
            stamps.update({d.seq: d.published_at_s for d in batch})
            assert await consumer.ack([d.seq for d in batch]) == len(batch)
        return [stamps[s] for s in sorted(stamps)]
    finally:
        await nc.close()


async def _replay(url: str, names: RunNames, stream: StreamConfig, selection: ReplaySelection) -> list[int]:
    nc = await connect(url, name="replay")
    try:
        reader = await ReplayReader.open(nc.jetstream(timeout=10), names, stream, None, selection)
        return [d.seq async for d in reader]
    finally:
        await nc.close()


def test_replay_returns_exactly_the_selection_in_order_after_the_trainer_acked(stack, tmp_path):
    names, stream = RunNames.for_run(f"r-{uuid.uuid4().hex[:8]}"), StreamConfig(max_bytes=64 * 2**20)

    async def main() -> None:
        stamps = await _recorded_run(stack.nats_url, names, stream)
        at = [dt.datetime.fromtimestamp(s, dt.timezone.utc) for s in stamps]
        cases = [
            (ReplaySelection(from_seq=3, until_seq=7), [3, 4, 5, 6, 7]),
            (ReplaySelection(from_seq=8), [8, 9, 10]),
            (ReplaySelection(min_version=6), [7, 8, 9, 10]),
            (ReplaySelection(min_version=4, until_seq=6), [5, 6]),
            (ReplaySelection(since=at[4] - dt.timedelta(microseconds=1), until=at[6]), [5, 6, 7]),
            (ReplaySelection(from_seq=11), []),
            (ReplaySelection(), list(range(1, 11))),
        ]
        for selection, expected in cases:
            assert await _replay(stack.nats_url, names, stream, selection) == expected, selection

    asyncio.run(main())


def test_replay_command_exports_parquet(stack, tmp_path):
    names = RunNames.for_run(f"r-{uuid.uuid4().hex[:8]}")
    cfg = LeewayConfig(
        run={"name": names.run},
        nats={"url": stack.nats_url},
        store={"url": f"file://{tmp_path / 'store'}"},
        stream={"max_bytes": 64 * 2**20},
    )
    asyncio.run(_recorded_run(stack.nats_url, names, cfg.stream))
    parser = argparse.ArgumentParser()
    replay_cmd.add_arguments(parser)
    out = tmp_path / "export"
    args = parser.parse_args(  # the config file is named, not read: `replay` gets `cfg` itself
        ["unread.yaml", "--from-seq", "2", "--until-seq", "4", "--to-parquet", str(out), "--groups-per-file", "2"]
    )
    summary = asyncio.run(replay_cmd.replay(cfg, args))
    assert summary["groups"] == 3 and summary["first_seq"] == 2 and summary["last_seq"] == 4
    groups = [g for f in sorted(summary["files"]) for g in read_parquet(f)]
    assert [g.group_id for g in groups] == ["g1", "g2", "g3"]
    assert groups[2].versions.max() == 3
    json.dumps(summary)


def test_replay_skips_unreadable_claims_with_a_counted_reason_and_goes_on(stack):
    """A store that refuses connections, or a pointer that escapes its prefix, costs one counted group, not
    the replay; with the store back, the claimed group replays."""
    names, stream = RunNames.for_run(f"r-{uuid.uuid4().hex[:8]}"), StreamConfig(max_bytes=64 * 2**20)
    creds = load_credentials(stack.dir)
    options = dict(region=stack.region, access_key_id=creds.access_key_id, secret_access_key=creds.secret_access_key)
    prefix = f"test-replay/{uuid.uuid4().hex}"
    store = S3Store(stack.bucket, prefix, S3Options(endpoint=stack.s3_endpoint, **options))
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    down = S3Store(stack.bucket, prefix, S3Options(endpoint=nowhere, max_retries=0, connect_timeout_s=2, **options))

    async def main() -> None:
        await _recorded_run(stack.nats_url, names, stream)  # seqs 1..10, inline
        nc = await connect(stack.nats_url, name="replay")
        try:
            js = nc.jetstream(timeout=10)
            claimed = StreamConfig(max_bytes=64 * 2**20, max_inline_bytes=1024)
            mask = np.r_[np.zeros(4, np.uint8), np.ones(1996, np.uint8)]
            tokens = np.random.default_rng(0).integers(0, 151_936, 2000).astype(np.int32)
            sample = Sample(
                tokens,
                mask,
                np.where(mask == 1, -0.5, 0).astype(np.float32),
                np.where(mask == 1, 9, -1).astype(np.int32),
            )
            big = TrajectoryGroup.from_samples(group_id="big", prompt_id="p", generator_id="gen", samples=[sample])
            assert (await TrajectoryPublisher(js, names, claimed, store).publish(big)).claim_check_key  # seq 11
            escaping = _group(12)  # seq 12: a pointer out of the prefix
            body = orjson.dumps({"key": "../x", "bytes": 10, "sha256": hashlib.sha256(b"x").hexdigest()})
            await js.publish(names.trajectory_subject, body, headers={**group_headers(escaping), H_CLAIM_CHECK: "../x"})
            await TrajectoryPublisher(js, names, stream).publish(_group(13))  # seq 13
            selection = ReplaySelection(from_seq=10)
            reader = await ReplayReader.open(js, names, stream, down, selection)
            assert [d.group.group_id async for d in reader] == ["g9", "g13"]
            assert reader.stats.skipped == {"claim_check_unavailable": 1, "claim_check_invalid": 1}
            reader = await ReplayReader.open(js, names, stream, store, selection)
            assert [d.group.group_id async for d in reader] == ["g9", "big", "g13"]
            assert reader.stats.skipped == {"claim_check_invalid": 1}
        finally:
            await nc.close()
            store.close()
            down.close()

    asyncio.run(main())
