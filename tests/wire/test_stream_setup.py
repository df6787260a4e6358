"""Stream set-up on a server whose JetStream store is small: a role restarting while the store is nearly full
(a `max_file_store` limit, a filling disk) still starts, and a changed setting is still applied.

A nats-server of this test's own (a store limit the session stack does not have), on 127.0.0.1 and a port the OS picks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import nats_server
from pipeline.config import load_config
from pipeline.wire.jetstream import connect
from pipeline.wire.names import RunNames
from pipeline.wire.trajectories import ensure_trajectory_streams

STORE_LIMIT = 180 * 1024 * 1024
"""Above the run's two reserving streams (64 MiB each), below what a create of an existing one asks again."""
START_DEADLINE_S = 60.0


@pytest.fixture
def small_store_url(tmp_path: Path) -> Iterator[str]:
    with nats_server.run(tmp_path, max_file_store_bytes=STORE_LIMIT, timeout_s=START_DEADLINE_S) as server:
        yield server.url


def test_a_restart_on_a_nearly_full_store_finds_its_streams_without_asking_for_room_again(
    small_store_url: str,
) -> None:
    names = RunNames.for_run("tight")
    stream = load_config(None, ["stream.max_bytes=67108864"], environ={}).stream

    async def scenario() -> tuple[int, float]:
        nc = await connect(small_store_url, name="test-setup")
        js = nc.jetstream()
        try:
            await ensure_trajectory_streams(js, names, stream)  # first start: creates both
            await js.publish(names.trajectory_subject, b"g" * 1000)
            await ensure_trajectory_streams(js, names, stream)  # a restart: was refused, 10047 insufficient storage
            shorter = stream.model_copy(update={"max_age_s": 3600.0})
            await ensure_trajectory_streams(js, names, shorter)  # a changed setting is still applied
            info = await js.stream_info(names.trajectory_stream)
            return int(info.state.messages), float(info.config.max_age or 0.0)
        finally:
            await nc.drain()

    assert asyncio.run(scenario()) == (1, 3600.0)
