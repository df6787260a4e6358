"""The embedded stack against the real nats-server and SeaweedFS binaries: start, use, stop, restart, fail."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import ssl
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import nats
import pytest
from nats.js.api import StreamConfig

from actors.servers import resolve_servers
from infra.process import ProcessInfo, is_running
from infra.stack import (
    CREDENTIALS_FILE,
    STATE_FILE,
    StackError,
    StackPorts,
    StackState,
    load_credentials,
    load_nats_token,
    load_state,
    s3_client,
    stack_status,
    start_stack,
    stop_stack,
)

STOP_TIMEOUT_S = 2.0
"""SIGTERM grace before SIGKILL; SeaweedFS would take ~17 s to stop by itself."""

HTTP_TIMEOUT_S = 5.0
"""Timeout of one raw HTTP request to a SeaweedFS port."""

CLI_TIMEOUT_S = 60.0
"""Bound on one `leeway stack` command against a running stack (it only probes)."""

NATS_CONNECT_TIMEOUT_S = 5.0
"""Bound on one refused connect attempt."""


async def _publish(nats_url: str, stream: str, payload: bytes) -> int:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream.lower()}.>"]))
        ack = await js.publish(f"{stream.lower()}.a", payload, timeout=5)
        return ack.seq
    finally:
        await nc.close()


async def _consume_one(nats_url: str, stream: str) -> bytes:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(f"{stream.lower()}.>", durable="reader", stream=stream)
        [msg] = await sub.fetch(1, timeout=5)
        await msg.ack()
        return msg.data
    finally:
        await nc.close()


async def _connect_once(nats_url: str) -> None:
    """One connect attempt, no reconnects; raises what the server answered."""

    async def quiet(_: Exception) -> None:
        """The refusal is raised from connect; no need to print it too."""

    nc = await asyncio.wait_for(
        nats.connect(nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, error_cb=quiet),
        NATS_CONNECT_TIMEOUT_S,
    )
    await nc.close()


def _http(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes, dict[str, str]]:
    """Status, body and headers of one plain (unsigned) HTTP request."""
    request = urllib.request.Request(url, method=method, data=body)
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""The client's HTTP/2 connection preface and an empty SETTINGS frame: what a gRPC client sends first."""


def _grpc_hello(port: int, cert: tuple[Path, Path] | None) -> bytes:
    """Open TLS to a gRPC port (with `cert` as the client certificate, or none) and return the server's first bytes."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the server's certificate is not what is under test
    context.set_alpn_protocols(["h2"])
    if cert is not None:
        context.load_cert_chain(*cert)
    with socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S) as raw:
        with context.wrap_socket(raw) as tls:
            tls.sendall(_HTTP2_PREFACE)
            return tls.recv(64)


def _plain_hello(port: int) -> bytes:
    """Send a gRPC client's first bytes without TLS and return what the server answers (b'' when it hangs up)."""
    with socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S) as raw:
        raw.sendall(_HTTP2_PREFACE)
        return raw.recv(64)


def _leeway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        cwd=Path(__file__).resolve().parents[2],
    )


def _gone(info: ProcessInfo) -> bool:
    return not is_running(info) and not Path(f"/proc/{info.pid}").exists()


def _processes_using(stack_dir: Path) -> list[int]:
    """Pids whose command line mentions `stack_dir` (a check that nothing was left behind, never a kill list)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(stack_dir).encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def test_s3_put_then_get_returns_the_bytes(stack: StackState) -> None:
    s3 = s3_client(stack)
    s3.put_object(Bucket=stack.bucket, Key="t/put-get", Body=b"hello leeway")
    assert s3.get_object(Bucket=stack.bucket, Key="t/put-get")["Body"].read() == b"hello leeway"


def test_jetstream_publish_then_consume(stack: StackState) -> None:
    seq = asyncio.run(_publish(stack.nats_url, "PUBCON", b"group-0"))
    assert seq == 1
    assert asyncio.run(_consume_one(stack.nats_url, "PUBCON")) == b"group-0"


def test_status_is_healthy_and_holds_no_secret(stack: StackState) -> None:
    status = stack_status(stack.dir)
    assert status["nats"]["healthy"] and status["seaweed"]["healthy"]
    assert status["nats"]["endpoint"] == stack.nats_endpoint and status["seaweed"]["endpoint"] == stack.s3_endpoint
    secret = load_credentials(stack.dir).secret_access_key
    token = load_nats_token(stack.dir)
    assert token in stack.nats_url  # the URL clients connect with carries it...
    state_text = (Path(stack.dir) / STATE_FILE).read_text()
    for shown in (
        json.dumps(status),
        state_text,
        repr(stack),
        repr(load_state(stack.dir)),
        repr(load_credentials(stack.dir)),
    ):
        assert secret not in shown and token not in shown  # ...nothing printed or recorded does
    assert token not in Path(stack.process("nats").log_path).read_text()  # type: ignore[union-attr]


def test_stack_files_and_dirs_are_private(stack: StackState) -> None:
    root = Path(stack.dir)
    mode = lambda path: stat.S_IMODE(os.stat(root / path).st_mode)  # noqa: E731
    assert mode(".") == 0o700
    for private in (CREDENTIALS_FILE, "nats/nats.conf", "seaweed/s3.json", "seaweed/config/security.toml"):
        assert mode(private) == 0o600, private
    assert load_nats_token(stack.dir) in (root / "nats/nats.conf").read_text()
    assert "[jwt.filer_signing]" in (root / "seaweed/config/security.toml").read_text()
    argv = " ".join(arg for info in stack.processes for arg in info.argv)
    assert load_nats_token(stack.dir) not in argv  # secrets live in files, never on a command line


def test_nats_refuses_a_client_without_the_token(stack: StackState) -> None:
    assert stack.nats_endpoint != stack.nats_url
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        asyncio.run(_connect_once(stack.nats_endpoint))
    wrong = stack.nats_url.replace(load_nats_token(stack.dir), "0" * 48)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        asyncio.run(_connect_once(wrong))
    asyncio.run(_connect_once(stack.nats_url))


def test_roles_resolve_the_token_from_the_stack_and_never_print_it(stack: StackState) -> None:
    from pipeline.config import LeewayConfig

    cfg = LeewayConfig(nats={"stack_dir": stack.dir}, store={"url": f"s3://{stack.bucket}/t"})
    endpoints = resolve_servers(cfg)
    assert endpoints.nats_url == stack.nats_url
    asyncio.run(_connect_once(endpoints.nats_url))
    assert load_nats_token(stack.dir) not in repr(endpoints) and "***@127.0.0.1" in repr(endpoints)


def test_stack_commands_print_no_token(stack: StackState) -> None:
    token, secret = load_nats_token(stack.dir), load_credentials(stack.dir).secret_access_key
    up = _leeway("stack", "up", "--dir", stack.dir)
    status = _leeway("stack", "status", "--dir", stack.dir)
    assert up.returncode == 0 and status.returncode == 0, up.stderr + status.stderr
    assert stack.nats_endpoint in up.stdout and json.loads(status.stdout)["nats"]["healthy"] is True
    for output in (up.stdout, up.stderr, status.stdout, status.stderr):
        assert token not in output and secret not in output


def test_seaweed_ports_refuse_unsigned_writes_while_s3_works(stack: StackState) -> None:
    s3_client(stack).put_object(Bucket=stack.bucket, Key="t/signed", Body=b"via the S3 gateway")
    ports = stack.process("seaweed").ports  # type: ignore[union-attr]
    filer, volume = f"http://127.0.0.1:{ports['filer']}", f"http://127.0.0.1:{ports['volume']}"

    # The filer's HTTP port: no write, delete or read of the bucket without the S3 gateway's signature.
    assert _http(f"{filer}/buckets/{stack.bucket}/t/forged", "PUT", b"forged")[0] == 401
    assert _http(f"{filer}/buckets/{stack.bucket}/t/signed", "DELETE")[0] == 401
    assert _http(f"{filer}/buckets/{stack.bucket}/t/signed")[0] == 401
    # The volume server: no upload or delete on an existing volume without the master's signed token.
    code, body, _ = _http(f"{volume}/status")
    assert code == 200, body
    vid = json.loads(body)["Volumes"][0]["Id"]
    assert _http(f"{volume}/{vid},01637037d6", "PUT", b"forged")[0] == 401
    assert _http(f"{volume}/{vid},01637037d6", "DELETE")[0] == 401
    assert s3_client(stack).get_object(Bucket=stack.bucket, Key="t/signed")["Body"].read() == b"via the S3 gateway"


def test_seaweed_master_http_refuses_tokens_and_admin_calls_while_s3_works(stack: StackState) -> None:
    s3_client(stack).put_object(Bucket=stack.bucket, Key="t/kept", Body=b"still here")
    master = stack.process("seaweed_master")
    assert master is not None and master.pid != stack.process("seaweed").pid  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{master.ports['master']}"

    # No signed write token for anyone, no topology, and none of the admin calls that can wipe data.
    for path in (
        "/dir/assign",
        "/dir/status",
        "/vol/status",
        "/vol/grow?count=1",
        "/vol/vacuum",
        f"/col/delete?collection={stack.bucket}",
    ):
        code, body, _ = _http(url + path)
        assert code == 401, (path, code, body)
    code, body, _ = _http(f"{url}/col/delete?collection={stack.bucket}", "POST")
    assert code == 401, body

    s3 = s3_client(stack)
    assert s3.get_object(Bucket=stack.bucket, Key="t/kept")["Body"].read() == b"still here"
    s3.put_object(Bucket=stack.bucket, Key="t/after", Body=b"uploads still work")
    assert s3.get_object(Bucket=stack.bucket, Key="t/after")["Body"].read() == b"uploads still work"
    assert stack_status(stack.dir)["seaweed_master"]["healthy"] is True


def test_seaweed_grpc_ports_refuse_clients_without_the_stack_certificate(stack: StackState) -> None:
    tls = Path(stack.dir) / "seaweed/config/tls"
    client_cert = (tls / "client.crt", tls / "client.key")
    security = (Path(stack.dir) / "seaweed/config/security.toml").read_text()
    assert "[grpc.client]" in security and str(tls / "ca.crt") in security
    ports = stack.process("seaweed").ports  # type: ignore[union-attr]
    for name in ("master_grpc", "volume_grpc", "filer_grpc", "s3_grpc"):
        with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED"):
            _grpc_hello(ports[name], cert=None)
        assert _plain_hello(ports[name]) == b"", name  # no plaintext gRPC either
        hello = _grpc_hello(ports[name], cert=client_cert)  # the stack's own certificate is let in
        assert hello[3:4] == b"\x04", (name, hello)  # an HTTP/2 SETTINGS frame: gRPC answers
    for path in tls.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert not any("PRIVATE KEY" in path.read_text() for path in tls.glob("ca*"))  # the CA key is never kept
    s3_client(stack).put_object(Bucket=stack.bucket, Key="t/tls", Body=b"over mutual TLS")
    assert s3_client(stack).get_object(Bucket=stack.bucket, Key="t/tls")["Body"].read() == b"over mutual TLS"


def test_up_on_a_healthy_stack_returns_it_instead_of_starting_another(stack: StackState) -> None:
    assert start_stack(stack.dir) == stack
    assert load_state(stack.dir) == stack


def test_restart_keeps_objects_and_messages_and_stop_leaves_no_process(stack: StackState, tmp_path: Path) -> None:
    first = start_stack(tmp_path)
    assert {first.nats_url, first.s3_endpoint}.isdisjoint({stack.nats_url, stack.s3_endpoint})  # two stacks at once
    s3_client(first).put_object(Bucket=first.bucket, Key="kept", Body=b"before restart")
    asyncio.run(_publish(first.nats_url, "KEPT", b"message before restart"))

    stop_stack(tmp_path, timeout_s=STOP_TIMEOUT_S)
    assert all(_gone(info) for info in first.processes)
    assert load_state(tmp_path).processes == ()  # type: ignore[union-attr]
    assert not any(stack_status(tmp_path)[name]["running"] for name in ("nats", "seaweed_master", "seaweed"))
    stop_stack(tmp_path)  # idempotent

    second = start_stack(tmp_path)
    try:
        assert s3_client(second).get_object(Bucket=second.bucket, Key="kept")["Body"].read() == b"before restart"
        assert asyncio.run(_consume_one(second.nats_url, "KEPT")) == b"message before restart"
    finally:
        stop_stack(tmp_path, timeout_s=STOP_TIMEOUT_S)
    assert all(_gone(info) for info in second.processes)


def test_taken_port_fails_with_the_server_log(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = dataclasses.replace(StackPorts.free(), nats=taken.getsockname()[1])
        with pytest.raises(StackError, match="address already in use") as raised:
            start_stack(tmp_path, ports=ports, timeout_s=20)
    assert "nats" in str(raised.value) and "nats.log" in str(raised.value)
    assert _processes_using(tmp_path) == []
    assert stack_status(tmp_path)["seaweed"]["running"] is False
    assert stack_status(tmp_path)["seaweed_master"]["running"] is False


def test_bad_binary_path_is_named_in_the_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-nats-server"
    with pytest.raises(StackError, match=str(missing)):
        start_stack(tmp_path, nats_bin=missing)


def test_unknown_fsync_setting_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fsync='sometimes'"):
        start_stack(tmp_path, fsync="sometimes")
