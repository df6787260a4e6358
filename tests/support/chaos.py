"""What the chaos test does to a stack's servers: SIGKILL and restart nats-server or SeaweedFS on the same ports
and data, stop SeaweedFS (SIGSTOP: every request hangs, as on a wedged host) and fill JetStream's store.

The stack's own state file keeps the first pids; each restarted process is returned so that the test kills it
at the end (`chaos_stack` stops only what the stack recorded).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import nats.js.errors
from nats.js.api import StreamConfig

from infra import nats_server
from infra.process import ProcessInfo, is_running
from infra.stack import StackState, load_state
from pipeline.wire.jetstream import connect
from tests.support.waits import wait_until

SERVER_TIMEOUT_S = 240.0
"""A generous bound on a server going away or answering again; only a broken machine gets near it."""
FILLER_STREAM = "CHAOS_FILLER"
FILLER_CHUNK = 1024 * 1024
STORE_HEADROOM = 48 * 1024 * 1024
"""JetStream store limit above what the run's streams hold and reserve when the store is made small."""


class Servers:
    """The stack's nats-server and SeaweedFS (`seaweed`: volume, filer, S3), as the chaos test restarts them."""

    def __init__(self, stack_dir: Path) -> None:
        self.stack_dir = stack_dir
        state = load_state(stack_dir)
        assert state is not None
        self.state: StackState = state
        nats_info, weed_info = state.process("nats"), state.process("seaweed")
        assert nats_info is not None and weed_info is not None
        self.current: dict[str, ProcessInfo | subprocess.Popen[bytes]] = {"nats": nats_info, "seaweed": weed_info}
        self.argv = {"nats": list(nats_info.argv), "seaweed": list(weed_info.argv)}
        master = state.process("seaweed_master")
        master_ports = set(master.ports.values()) if master is not None else set()
        self.ports = {  # the ports each process binds itself (the master, left running, keeps its own)
            "nats": list(nats_info.ports.values()),
            "seaweed": [p for p in weed_info.ports.values() if p not in master_ports],
        }
        self.restarted: list[subprocess.Popen[bytes]] = []

    def _pid(self, name: str) -> int:
        return self.current[name].pid

    def _alive(self, name: str) -> bool:
        proc = self.current[name]
        return proc.poll() is None if isinstance(proc, subprocess.Popen) else is_running(proc)

    def kill(self, name: str) -> None:
        """SIGKILL the server's process group and wait until it and its ports are gone."""
        os.killpg(self._pid(name), signal.SIGKILL)
        ports = self.ports[name]
        wait_until(
            lambda: not self._alive(name) and all(_port_free(p) for p in ports),
            what=f"{name} to go away",
            timeout_s=SERVER_TIMEOUT_S,
        )

    def start(self, name: str) -> None:
        """Start the server again on its argv (same config, ports and data) and wait until it answers."""
        log = open(self.stack_dir / "logs" / f"{name}-restarted.log", "ab")
        proc = subprocess.Popen(
            self.argv[name], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.current[name] = proc
        self.restarted.append(proc)
        probe = self._probe_nats if name == "nats" else self._probe_s3
        wait_until(
            lambda: proc.poll() is None and probe() is None,
            what=f"the restarted {name} to answer",
            timeout_s=SERVER_TIMEOUT_S,
        )

    def restart(self, name: str) -> None:
        self.kill(name)
        self.start(name)

    def pause(self, name: str) -> None:
        """SIGSTOP: the process keeps its sockets, so connects succeed and every request hangs."""
        os.killpg(self._pid(name), signal.SIGSTOP)

    def resume(self, name: str) -> None:
        os.killpg(self._pid(name), signal.SIGCONT)

    def limit_jetstream_store(self) -> int:
        """Restart nats-server with `max_file_store` just above what the run's streams hold and reserve."""
        conf = Path(self.argv["nats"][-1])
        used = asyncio.run(_store_footprint(self.state))
        limit = used + STORE_HEADROOM
        text = conf.read_text()
        assert "max_file_store" not in text
        conf.write_text(text.replace("jetstream {\n", f"jetstream {{\n  max_file_store: {limit}\n", 1))
        self.restart("nats")
        return limit

    def fill_jetstream(self) -> int:
        """Publish to a filler stream until the store refuses (503 insufficient resources); bytes written."""
        return asyncio.run(_fill(self.state))

    def drain_jetstream(self) -> None:
        """Delete the filler stream: the store has room again."""
        asyncio.run(_delete_filler(self.state))

    def _probe_nats(self) -> str | None:
        return nats_server.probe(self.state.nats_url)

    def _probe_s3(self) -> str | None:
        try:
            with socket.create_connection(("127.0.0.1", _port_of(self.state.s3_endpoint)), timeout=1.0):
                return None
        except OSError as exc:
            return str(exc)

    def kill_restarted(self) -> None:
        for proc in self.restarted:
            if proc.poll() is None:
                with_group = proc.pid
                try:
                    os.killpg(with_group, signal.SIGCONT)
                    os.killpg(with_group, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()


async def _store_footprint(state: StackState) -> int:
    """Bytes the server's streams hold, or reserve when they have a `max_bytes`."""
    nc = await connect(state.nats_url, name="chaos-footprint")
    try:
        total = 0
        for info in await nc.jetstream().streams_info():
            reserved = info.config.max_bytes or 0
            total += max(reserved, int(info.state.bytes))
        return total
    finally:
        await nc.drain()


async def _fill(state: StackState) -> int:
    nc = await connect(state.nats_url, name="chaos-filler")
    js = nc.jetstream()
    written = 0
    try:
        await js.add_stream(StreamConfig(name=FILLER_STREAM, subjects=["chaos.filler"]))
        while True:
            try:
                await js.publish("chaos.filler", b"\0" * FILLER_CHUNK, timeout=10.0)
            except nats.js.errors.ServiceUnavailableError:
                return written  # insufficient resources: the store is full
            written += FILLER_CHUNK
            assert written < 1 << 34, "the store never filled"
    finally:
        await nc.drain()


async def _delete_filler(state: StackState) -> None:
    nc = await connect(state.nats_url, name="chaos-filler")
    try:
        await nc.jetstream().delete_stream(FILLER_STREAM)
    finally:
        await nc.drain()


def _port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no obstacle
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
