"""New-version announcements on a NATS KV bucket, and the subject generators report metrics on.

The object store's `LATEST` is the truth; the KV key is a doorbell. A generator that watches it
learns of version V+1 within milliseconds instead of at its next poll; one that only polls the
store still works. The trainer writes the key only after the version's manifest and `LATEST`
are in the store, so a generator woken by it always finds the version there.

    KV bucket  leeway_<run>_versions   key "latest" -> {"version": V, "published_at_s": t}
    subject    leeway.<run>.metrics.generator      generator metric reports (core NATS, JSON), every
                                                   `GENERATOR_REPORT_INTERVAL_S`; any client can publish
                                                   there, so listeners validate what they read
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import nats.js.errors
import orjson
from nats.js import JetStreamContext

from pipeline.wire.jetstream import ensure_key_value
from pipeline.wire.names import RunNames

log = logging.getLogger(__name__)

LATEST_KEY = "latest"
ANNOUNCE_TIMEOUT_S = 5.0
"""Bound on one announcement (`try_announce`): the trainer's publish waits no longer on an optional doorbell."""
GENERATOR_REPORT_INTERVAL_S = 2.0
"""How often a generator reports on `generator_metrics_subject` (listeners expire reports by it)."""


def version_bucket(names: RunNames) -> str:
    return f"leeway_{names.run}_versions"


def generator_metrics_subject(names: RunNames) -> str:
    return f"leeway.{names.run}.metrics.generator"


async def version_kv(js: JetStreamContext, names: RunNames) -> Any:
    """The run's announcement bucket, created on first use by whichever process comes first."""
    return await ensure_key_value(js, version_bucket(names))


async def announce_version(kv: Any, version: int) -> None:
    """Ring the doorbell for `version` (call only after the store's LATEST points at it)."""
    await kv.put(LATEST_KEY, orjson.dumps({"version": int(version), "published_at_s": time.time()}))


async def try_announce(kv: Any, version: int, *, timeout_s: float = ANNOUNCE_TIMEOUT_S) -> bool:
    """One bounded announcement; False (with a WARNING) if NATS did not take it.

    The announcement is only a doorbell: generators also poll the store's LATEST, and the next version's
    announcement supersedes this one. So a NATS outage costs generators up to one poll interval of latency
    and never stops, or even delays by more than `timeout_s`, the trainer that publishes."""
    try:
        await asyncio.wait_for(announce_version(kv, version), timeout_s)
    except (nats.errors.Error, asyncio.TimeoutError, OSError) as exc:
        log.warning(
            "announcing version %d on NATS KV failed (%s: %s); generators learn of it from the store's LATEST",
            version,
            type(exc).__name__,
            exc,
        )
        return False
    return True


def parse_announcement(value: bytes | None) -> tuple[int, float] | None:
    """(version, published_at_s) from a KV value; None for a missing or malformed value (polling covers it)."""
    if not value:
        return None
    try:
        data = orjson.loads(value)
        return int(data["version"]), float(data.get("published_at_s", 0.0))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


async def watch_announcements(kv: Any) -> AsyncIterator[tuple[int, float]]:
    """Yield (version, published_at_s) for each announcement, starting with the current one if any."""
    watcher = await kv.watch(LATEST_KEY)
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=5.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            if entry is None:  # end of the initial values
                continue
            parsed = parse_announcement(entry.value)
            if parsed is not None:
                yield parsed
    finally:
        await watcher.stop()
