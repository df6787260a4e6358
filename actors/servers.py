"""Where a role finds its servers (NATS and the object store): the config's URLs, or the embedded stack's state file.

Every process of a run resolves its servers the same way, so `leeway run`, `leeway trainer` and
`leeway generator` launched by hand in separate terminals meet on the same servers. Credentials come
from the environment (AWS_*), the embedded stack's 0600 credentials file (its S3 key, its NATS token: the
operator's, carried in `Servers.nats_url`, and one NATS user per role: `Servers.nats_role_urls`), or
`nats.creds_file`; for an external server a role's password comes from `LEEWAY_NATS_<ROLE>_PASSWORD` or the
0600 file `LEEWAY_NATS_<ROLE>_PASSWORD_FILE` names (user = the role's name, as in `infra/k8s/nats.yaml`). The
trainer and generators connect as their role (`connect_nats`'s `role`), so a generator cannot publish what
is the trainer's (`infra.nats_server.GENERATOR_PUBLISH_DENY`); tools connect as the operator. None of them
is ever logged or written into a config (`Servers.__repr__` masks them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nats.aio.client import Client as NatsClient

from infra.nats_server import ROLE_USERS, redact_url, url_with_user
from infra.orphans import stop_needs_servers
from infra.stack import StackState, load_credentials, load_state, stack_status
from pipeline.config import LeewayConfig
from pipeline.wire.jetstream import connect
from storage.objectstore import ObjectStore
from storage.stores import open_store

NATS_DEFAULT_PORT = 4222
"""The port a NATS URL without one means."""


class ServerError(RuntimeError):
    """No server to talk to: the message says which one and how to start it."""


@dataclass(frozen=True)
class Servers:
    nats_url: str
    store_url: str
    store_options: dict[str, Any]
    nats_role_urls: Mapping[str, str] = field(default_factory=dict)
    """The URL each role with a user of its own connects with (`infra.nats_server.ROLE_USERS`); others use
    `nats_url`."""

    def nats_url_for(self, role: str | None) -> str:
        """The URL `role` connects with: its own user's where it has one, else `nats_url`."""
        return self.nats_role_urls.get(role or "", self.nats_url)

    def __repr__(self) -> str:  # never print the S3 secret or the NATS token
        return f"Servers(nats_url={redact_url(self.nats_url)!r}, store_url={self.store_url!r})"

    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every server these servers name: each NATS URL (comma-separated), and the S3
        endpoint (none for a `file://` store). What an orphaned role probes (`infra.orphans.stop_needs_servers`)."""
        out: list[tuple[str, int]] = []
        for url in self.nats_url.split(","):
            parts = urlsplit(url.strip() if "://" in url else f"nats://{url.strip()}")
            if parts.hostname:
                out.append((parts.hostname, parts.port or NATS_DEFAULT_PORT))
        endpoint = self.store_options.get("endpoint")
        if self.store_url.startswith("s3://") and endpoint:
            parts = urlsplit(str(endpoint))
            if parts.hostname:
                out.append((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)))
        return out


def _embedded_state(cfg: LeewayConfig) -> StackState:
    """The stack recorded in `nats.stack_dir`; none running is an `ServerError` that says how to start one."""
    state = load_state(cfg.nats.stack_dir)
    if state is None or not state.processes:
        raise ServerError(
            f"no embedded stack is running in {cfg.nats.stack_dir}: start one with "
            f"`leeway stack up --dir {cfg.nats.stack_dir}`, or set nats.url and store.endpoint"
        )
    return state


def resolve_servers(cfg: LeewayConfig, *, nats: bool = True) -> Servers:
    """NATS URL and store URL/options for this config (embedded stack where the config names none). With
    ``nats=False`` (a tool that reads only the store) no NATS URL is looked for: a file store then needs no
    stack at all."""
    store = cfg.store
    options: dict[str, Any] = {}
    if store.url.startswith("s3://"):
        options = {
            "endpoint": store.endpoint,
            "region": store.region,
            "max_concurrency": store.max_concurrency,
            "multipart_threshold_bytes": store.multipart_threshold_bytes,
            "part_size_bytes": store.part_size_bytes,
            "max_retries": store.max_retries,
            "connect_timeout_s": store.connect_timeout_s,
            "read_timeout_s": store.read_timeout_s,
        }
    nats_url = cfg.nats.url if nats else ""
    role_urls = _external_role_urls(nats_url) if nats_url else {}
    store_url = store.url
    if nats_url is None or (store.url.startswith("s3://") and store.endpoint is None):
        state = _embedded_state(cfg)
        if nats_url is None:
            nats_url = state.nats_url
            role_urls = {role: state.role_url(role) for role in state.nats_passwords}
        if store.url.startswith("s3://") and store.endpoint is None:
            credentials = load_credentials(state.dir)
            bucket_and_prefix = store.url[len("s3://") :].split("/", 1)
            prefix = bucket_and_prefix[1] if len(bucket_and_prefix) > 1 else ""
            store_url = f"s3://{state.bucket}/{prefix}"
            options.update(
                endpoint=state.s3_endpoint,
                region=state.region,
                access_key_id=credentials.access_key_id,
                secret_access_key=credentials.secret_access_key,
            )
    return Servers(nats_url=nats_url, store_url=store_url, store_options=options, nats_role_urls=role_urls)


def _external_role_urls(nats_url: str) -> dict[str, str]:
    """For a server the config names: each role's URL whose password the environment gives (the variable, or the
    owner-only file it names); a file readable by others is refused, naming it (never its contents)."""
    out: dict[str, str] = {}
    for role in ROLE_USERS:
        var = f"LEEWAY_NATS_{role.upper()}_PASSWORD"
        password = os.environ.get(var, "")
        path = os.environ.get(f"{var}_FILE")
        if not password and path:
            if Path(path).stat().st_mode & 0o077:
                raise ServerError(f"{var}_FILE={path}: readable by others; chmod 600 it")
            password = Path(path).read_text().strip()
        if password:
            out[role] = ",".join(url_with_user(u.strip(), role, password) for u in nats_url.split(","))
    return out


def watch_servers(cfg: LeewayConfig) -> None:
    """Name this role's servers to its orphan watchdog (`infra.orphans.stop_needs_servers`), so a role whose
    `leeway run` died together with its private stack exits at once instead of retrying the dead servers.
    A config whose servers cannot be resolved registers none (the role fails on them later, saying why)."""
    try:
        servers = resolve_servers(cfg).addresses()
    except ServerError:
        return
    stop_needs_servers(servers)


def open_run_store(cfg: LeewayConfig, servers: Servers | None = None) -> ObjectStore:
    """The run's object store (S3 or local files) at the resolved servers, opened the same way by every role."""
    servers = servers or resolve_servers(cfg)
    return open_store(servers.store_url, **servers.store_options)


async def connect_nats(
    cfg: LeewayConfig, servers: Servers | None = None, *, name: str, role: str | None = None
) -> NatsClient:
    """`pipeline.wire.jetstream.connect` (the one connect: reconnect forever, 64 MiB buffer, logged state) to
    this config's server as `role` (`trainer`, `generator`: their own users; None: the operator), with its
    credentials file and connect timeout."""
    servers = servers or resolve_servers(cfg)
    return await connect(
        servers.nats_url_for(role),
        creds_file=cfg.nats.creds_file,
        connect_timeout_s=cfg.nats.connect_timeout_s,
        name=name,
    )


def running_stack_healthy(stack_dir: str | Path) -> bool:
    """True when a stack recorded in `stack_dir` has both servers running and answering."""

    state = load_state(stack_dir)
    if state is None or not state.processes:
        return False
    status = stack_status(stack_dir)
    servers = [v for v in status.values() if isinstance(v, dict) and "healthy" in v]
    return bool(servers) and all(bool(s["healthy"]) for s in servers)


def private_stack_dir(cfg: LeewayConfig, run_dir: Path) -> Path | None:
    """For `leeway run`: where to start a private stack, or None when the run needs none.

    None when the config names both servers, or when a healthy stack runs at `nats.stack_dir`
    (started by `leeway stack up`; it is used and left running). Otherwise `<run_dir>/stack`.
    """
    if not cfg.uses_embedded_stack:
        return None
    if running_stack_healthy(cfg.nats.stack_dir):
        return None
    return (run_dir / "stack").resolve()


def stack_bucket(cfg: LeewayConfig) -> str:
    """The bucket named by `store.url` (s3://BUCKET/prefix), the embedded stack creates it."""
    if cfg.store.url.startswith("s3://"):
        return cfg.store.url[len("s3://") :].split("/", 1)[0] or "leeway"
    return "leeway"
