"""The embedded stack against the real nats-server and SeaweedFS binaries: start, use, stop, restart, fail."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import stat
from pathlib import Path

import nats
import pytest
from nats.js.api import StreamConfig

from infra.process import ProcessInfo, is_running
from infra.stack import (
    CREDENTIALS_FILE,
    STATE_FILE,
    StackError,
    StackPorts,
    StackState,
    load_credentials,
    load_state,
    s3_client,
    stack_status,
    start_stack,
    stop_stack,
)

STOP_TIMEOUT_S = 2.0
"""SIGTERM grace before SIGKILL; SeaweedFS would take ~17 s to stop by itself."""


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
    assert status["nats"]["endpoint"] == stack.nats_url and status["seaweed"]["endpoint"] == stack.s3_endpoint
    secret = load_credentials(stack.dir).secret_access_key
    assert secret not in json.dumps(status)
    assert secret not in (Path(stack.dir) / STATE_FILE).read_text()
    assert stat.S_IMODE(os.stat(Path(stack.dir) / CREDENTIALS_FILE).st_mode) == 0o600
    assert secret not in repr(load_credentials(stack.dir))


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
    assert stack_status(tmp_path)["nats"]["running"] is False
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


def test_bad_binary_path_is_named_in_the_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-nats-server"
    with pytest.raises(StackError, match=str(missing)):
        start_stack(tmp_path, nats_bin=missing)


def test_unknown_fsync_setting_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fsync='sometimes'"):
        start_stack(tmp_path, fsync="sometimes")
