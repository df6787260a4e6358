"""`leeway purge`: one run's streams, KV bucket and objects go; another run on the same stack keeps all of its own.

Two runs on the session's real stack, named so that one's object prefix is a string prefix of the
other's (`purge-a`, `purge-a2`): purging `purge-a` must leave `purge-a2/...` alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.js.errors
import pytest

from actors.cli import main
from actors.servers import connect_nats, open_run_store
from infra.stack import StackState
from pipeline.config import LeewayConfig, load_config
from pipeline.wire.announce import announce_version, version_bucket, version_kv
from pipeline.wire.lease import RunLease, lease_bucket, lease_kv
from pipeline.wire.names import RunNames
from pipeline.wire.prompt_queue import ensure_prompt_queue
from pipeline.wire.trajectories import ensure_trajectory_streams

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
OBJECTS = ("weights/LATEST", "checkpoints/v00000003/state.safetensors", "trajectories/g-1.arrow")
"""Keys (under `<run>/`) of the kinds of objects a run leaves in the store."""


def _sets(stack: StackState, run: str) -> list[str]:
    return ["--set", f"run.name={run}", "--set", f"nats.stack_dir={stack.dir}"]


def _config(stack: StackState, run: str) -> LeewayConfig:
    return load_config(str(DEMO), [f"run.name={run}", f"nats.stack_dir={stack.dir}"])


async def _populate(cfg: LeewayConfig) -> None:
    """What a run leaves behind: its three streams with a message each, its KV bucket, its objects."""
    names = RunNames.for_run(cfg.run.name)
    nc = await connect_nats(cfg, name="test-purge")
    try:
        js = nc.jetstream()
        await ensure_trajectory_streams(js, names, cfg.stream)
        await ensure_prompt_queue(js, names, cfg.stream)
        for subject in (names.trajectory_subject, names.prompt_subject, names.trajectory_dead_letter_subject):
            await js.publish(subject, b"{}")
        await announce_version(await version_kv(js, names), 3)
        lease = RunLease(await lease_kv(js, names), names.run, ttl_s=1.0)
        await lease.acquire()  # a trainer killed while it held the run
    finally:
        await nc.close()
    with open_run_store(cfg) as store:
        for key in OBJECTS:
            store.put(f"{names.run}/{key}", b"bytes")


async def _left(cfg: LeewayConfig) -> dict[str, object]:
    """What of the run exists on the servers now."""
    names = RunNames.for_run(cfg.run.name)
    nc = await connect_nats(cfg, name="test-purge-check")
    try:
        js = nc.jetstream()
        streams = []
        for stream in (names.trajectory_stream, names.prompt_stream, names.dead_letter_stream):
            try:
                await js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                continue
            streams.append(stream)
        buckets = []
        for bucket in (version_bucket(names), lease_bucket(names)):
            try:
                await js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                continue
            buckets.append(bucket)
        kv = len(buckets) == 2 if buckets else False
        assert not buckets or kv, f"only {buckets} of the run's KV buckets left"
    finally:
        await nc.close()
    with open_run_store(cfg) as store:
        keys = store.list(f"{names.run}/")
    return {"streams": len(streams), "kv": kv, "objects": keys}


FULL = {"streams": 3, "kv": True}


def _full(left: dict[str, object], run: str) -> bool:
    return {k: left[k] for k in FULL} == FULL and left["objects"] == sorted(f"{run}/{key}" for key in OBJECTS)


@pytest.mark.timeout(120)
def test_purge_deletes_one_runs_streams_kv_and_objects_and_nothing_of_another(
    stack: StackState, capsys: pytest.CaptureFixture[str]
) -> None:
    purged, kept = _config(stack, "purge-a"), _config(stack, "purge-a2")
    for cfg in (purged, kept):
        asyncio.run(_populate(cfg))
        assert _full(asyncio.run(_left(cfg)), cfg.run.name)

    # without --yes: the plan, exit 1, nothing deleted
    assert main(["purge", str(DEMO), *_sets(stack, "purge-a")]) == 1
    out = capsys.readouterr()
    for name in ("LEEWAY_purge-a_TRAJ", "LEEWAY_purge-a_PROMPTS", "LEEWAY_purge-a_DLQ", "leeway_purge-a_versions"):
        assert name in out.out
    assert f"{len(OBJECTS)} objects under purge-a/" in out.out
    assert "purge-a2" not in out.out
    assert "--yes" in out.err
    assert _full(asyncio.run(_left(purged)), "purge-a")

    # with --yes: this run is gone, the other is whole
    assert main(["purge", str(DEMO), *_sets(stack, "purge-a"), "--yes"]) == 0
    assert "purged" in capsys.readouterr().out
    assert asyncio.run(_left(purged)) == {"streams": 0, "kv": False, "objects": []}
    assert _full(asyncio.run(_left(kept)), "purge-a2")

    # the name is free again: a second purge finds nothing
    assert main(["purge", str(DEMO), *_sets(stack, "purge-a"), "--yes"]) == 0
    assert "nothing" in capsys.readouterr().out


def test_purge_without_servers_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["purge", str(DEMO), "--set", f"nats.stack_dir={tmp_path / 'none'}", "--yes"]) == 2
    assert "no embedded stack is running" in capsys.readouterr().err
