"""The KV version announcement is a doorbell: one bounded try that only warns when NATS does not take it."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from pipeline.wire.announce import LATEST_KEY, parse_announcement, try_announce, version_bucket, version_kv
from pipeline.wire.jetstream import connect
from pipeline.wire.names import RunNames


def test_a_failed_announcement_only_warns(stack, caplog: pytest.LogCaptureFixture):
    async def main() -> None:
        names = RunNames.for_run(f"a-{uuid.uuid4().hex[:8]}")
        nc = await connect(stack.nats_url, name="trainer")
        js = nc.jetstream(timeout=2)
        try:
            kv = await version_kv(js, names)
            assert await try_announce(kv, 3) is True
            assert parse_announcement((await kv.get(LATEST_KEY)).value)[0] == 3
            await js.delete_key_value(version_bucket(names))  # NATS no longer takes the announcement
            with caplog.at_level(logging.WARNING, logger="pipeline.wire.announce"):
                assert await try_announce(kv, 4) is False  # was: retried for ~27 s, then the trainer ended
            assert "announcing version 4 on NATS KV failed" in caplog.text
        finally:
            await nc.close()

    asyncio.run(main())


def test_an_announcement_that_hangs_is_bounded():
    class HangingKV:
        async def put(self, key: str, value: bytes) -> int:
            await asyncio.Event().wait()  # a server that never answers
            return 0

    assert asyncio.run(try_announce(HangingKV(), 1, timeout_s=0.05)) is False
