"""`infra.nats_server.run`: a lone nats-server on the port the OS gives it, read back, never picked first.

The benches and the wire tests that stop and restart their own server use it; the embedded stack's server
is tested through the stack (`test_stack.py`).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from infra import nats_server
from infra.process import StackError

TOKEN = "t" * 24


def test_a_lone_server_reports_the_port_it_got_and_comes_back_on_it(tmp_path: Path) -> None:
    with nats_server.run(tmp_path / "nats") as server:
        port = server.port
        assert port > 0 and server.info is not None and dict(server.info.ports) == {"client": port}
        assert nats_server.probe(server.url) is None
        assert nats_server.refuses_anonymous(server.url)
        server.stop()
        assert nats_server.probe(server.url) is not None
        server.start()
        assert server.port == port and nats_server.probe(server.url) is None


def test_a_server_that_dies_during_start_fails_with_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nats-server"
    fake.write_text("#!/bin/sh\necho 'cannot open the store: simulated'\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(nats_server.BINARY_ENV_VAR, str(fake))
    server = nats_server.LocalServer(tmp_path / "nats")
    with pytest.raises(StackError, match="exited with code 3") as failure:
        server.start(timeout_s=10)
    assert "cannot open the store: simulated" in str(failure.value)
    assert server.info is None and server.proc is None


def test_port_zero_asks_the_os_and_a_fixed_config_is_unchanged(tmp_path: Path) -> None:
    fixed = nats_server.render_config(port=4333, store_dir=tmp_path, sync_interval="2m", token=TOKEN)
    assert "listen: 127.0.0.1:4333\n" in fixed and "max_file_store" not in fixed
    assert "listen: 127.0.0.1:-1\n" in nats_server.render_config(
        port=0, store_dir=tmp_path, sync_interval="2m", token=TOKEN
    )
    limited = nats_server.render_config(
        port=0, store_dir=tmp_path, sync_interval="2m", token=TOKEN, max_file_store_bytes=1024
    )
    assert "  max_file_store: 1024\n}" in limited


def test_read_port_reads_only_the_servers_own_complete_ports_file(tmp_path: Path) -> None:
    pid = os.getpid()
    (tmp_path / "nats-server_1.ports").write_text(json.dumps({"nats": ["nats://127.0.0.1:1111"]}))
    assert nats_server.read_port(tmp_path, pid) is None  # another server's
    (tmp_path / f"nats-server_{pid}.ports").write_text('{"nats": ["nats://127.0.0.1:2')
    assert nats_server.read_port(tmp_path, pid) is None  # still being written
    (tmp_path / f"nats-server_{pid}.ports").write_text(json.dumps({"nats": ["nats://127.0.0.1:2222"]}))
    assert nats_server.read_port(tmp_path, pid) == 2222


def test_the_external_servers_config_denies_a_generator_what_the_stack_denies(tmp_path: Path) -> None:
    """`infra/k8s/nats.conf` (compose and Kubernetes) gives the generator user the embedded stack's deny list, and
    nats-server accepts it with the passwords from its environment."""
    shipped = (Path(__file__).parents[2] / "infra" / "k8s" / "nats.conf").read_text()
    deny = re.search(r"deny: \[(.*?)\]", shipped, re.S)
    assert deny is not None
    assert tuple(re.findall(r'"([^"]+)"', deny.group(1))) == nats_server.GENERATOR_PUBLISH_DENY
    env = {"NATS_TOKEN": TOKEN, "NATS_TRAINER_PASSWORD": "r" * 24, "NATS_GENERATOR_PASSWORD": "g" * 24}
    config = tmp_path / "nats.conf"
    config.write_text(shipped.replace('"/data"', f'"{tmp_path}"'))
    checked = subprocess.run(
        [str(nats_server.binary_path()), "-t", "-c", str(config)], env=env, capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stderr
    stack_config = nats_server.render_config(
        port=0,
        store_dir=tmp_path,
        sync_interval="2m",
        token=TOKEN,
        role_passwords={"trainer": "r" * 24, "generator": "g" * 24},
    )
    assert "token:" not in stack_config and '{user: "generator", password: "' + "g" * 24 in stack_config
