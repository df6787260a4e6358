"""Chaos on the demo: a seeded schedule of SIGKILLs of the trainer and the generators, and one nats-server
restart, for at least `CHAOS_S` seconds; then the run's own records must show exactly-once training.

The schedule is driven by progress, not by the clock alone: each event waits until the trainer has
committed a few more steps since the last one (read from `metrics.jsonl`), so a slow machine gets the
same amount of chaos per step, and a fast one simply goes through more events. At the end, from
`metrics.jsonl` (what the trainer committed) and a Parquet export of the trajectory stream
(`leeway replay --to-parquet`): no group trained twice, every trained group is in the stream, versions
strictly increase, and every process this test started is gone.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pyarrow.parquet as pq
import pytest

from infra import nats_server
from infra.process import is_running
from infra.stack import StackState, load_state
from pipeline.config import load_config
from tests.support.runs import leeway_argv
from tests.support.stacks import running_stack

REPO = Path(__file__).resolve().parents[1]
SEED = 20261130
CHAOS_S = 120.0
"""The schedule keeps killing for at least this long (the issue asks for two minutes)."""
MIN_EVENTS = 8
STEPS_BETWEEN_EVENTS = (2, 6)
"""Each event waits for this many (seeded, inclusive range) newly committed steps since the previous one."""
PROGRESS_TIMEOUT_S = 240.0
"""A generous bound on waiting for steps after an event; only a stuck run gets near it."""
STOP_TIMEOUT_S = 60.0
NUM_GENERATORS = 2
READY_TRAINER = b"trainer ready"
READY_GENERATOR = b"serving version"


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue  # a line torn by a SIGKILL mid-write; the resumed trainer moves it aside
    return out


def _committed_steps(run_dir: Path) -> int:
    records = _records(run_dir)
    return int(records[-1]["step"]) if records else 0


class Roles:
    """The run's processes, each in its own process group so that a kill takes its children too."""

    def __init__(self, config_path: Path, logs: Path) -> None:
        self.config_path = config_path
        self.logs = logs
        self.trainer: subprocess.Popen[bytes] | None = None
        self.generators: dict[str, subprocess.Popen[bytes]] = {}
        self.every: list[subprocess.Popen[bytes]] = []
        self.log_offsets: dict[str, int] = {}
        """Where each role's log stood when its current process started (logs are appended across restarts)."""

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        self.logs.mkdir(parents=True, exist_ok=True)
        path = self.logs / f"{name}.log"
        self.log_offsets[name] = path.stat().st_size if path.exists() else 0
        with open(path, "ab") as log:
            proc = subprocess.Popen(
                leeway_argv(*args),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
        self.every.append(proc)
        return proc

    def start_trainer(self, *, resume: bool) -> None:
        extra = ("--resume",) if resume else ()
        self.trainer = self._spawn("trainer", "trainer", str(self.config_path), *extra)

    def start_generator(self, gen_id: str) -> None:
        self.generators[gen_id] = self._spawn(
            gen_id, "generator", str(self.config_path), "--set", f"generator.id={gen_id}"
        )

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def wait_ready(self) -> None:
        """Until every current process has said it serves (a SIGTERM during start-up, before the role installs
        its handler, would end it with -15 instead of a clean stop)."""
        markers = {"trainer": READY_TRAINER, **dict.fromkeys(self.generators, READY_GENERATOR)}
        deadline = time.monotonic() + PROGRESS_TIMEOUT_S
        for name, marker in markers.items():
            path = self.logs / f"{name}.log"
            while marker not in path.read_bytes()[self.log_offsets[name] :]:
                self.check_alive()
                assert time.monotonic() < deadline, f"{name} never became ready\n{self.tails()}"
                time.sleep(0.2)

    def check_alive(self) -> None:
        procs = {"trainer": self.trainer, **self.generators}
        dead = {name: p.returncode for name, p in procs.items() if p is not None and p.poll() is not None}
        assert not dead, f"roles exited on their own: {dead}\n{self.tails()}"

    def tails(self, lines: int = 25) -> str:
        out = []
        for path in sorted(self.logs.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)


def _wait_for_steps(run_dir: Path, target: int, roles: Roles) -> None:
    deadline = time.monotonic() + PROGRESS_TIMEOUT_S
    while _committed_steps(run_dir) < target:
        roles.check_alive()
        assert time.monotonic() < deadline, f"no progress to step {target}\n{roles.tails()}"
        time.sleep(0.2)


def _restart_nats(stack_dir: Path) -> subprocess.Popen[bytes]:
    """SIGKILL the stack's nats-server and start it again on the same config (same port, same data)."""
    state = load_state(stack_dir)
    assert state is not None
    info = state.process("nats")
    assert info is not None
    os.kill(info.pid, signal.SIGKILL)
    deadline = time.monotonic() + PROGRESS_TIMEOUT_S
    while is_running(info) or not _port_free(_port_of(state.nats_url)):  # its socket closes as it exits
        assert time.monotonic() < deadline, "the killed nats-server kept its port"
        time.sleep(0.1)
    conf = stack_dir / "nats" / "nats.conf"
    log = open(stack_dir / "logs" / "nats-restarted.log", "ab")
    proc = subprocess.Popen(
        nats_server.argv(nats_server.binary_path(), conf),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    deadline = time.monotonic() + PROGRESS_TIMEOUT_S
    while nats_server.probe(state.nats_url) is not None:
        assert proc.poll() is None, "the restarted nats-server exited"
        assert time.monotonic() < deadline, "the restarted nats-server never answered"
        time.sleep(0.2)
    return proc


def _port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nats-server binds: TIME_WAIT is no obstacle
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def chaos_stack(tmp_path: Path) -> Iterator[StackState]:
    """A stack of the chaos test's own: its nats-server is killed and restarted, which others must not see."""
    with running_stack(tmp_path / "stack") as state:
        yield state


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_trains_every_group_at_most_once(tmp_path: Path, chaos_stack: StackState) -> None:
    rng = random.Random(SEED)
    run_dir = tmp_path / "run"
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        [
            "run.name=chaos",
            f"run.dir={run_dir}",
            f"nats.stack_dir={chaos_stack.dir}",
            "trainer.max_steps=100000",
            "trainer.checkpoint_every=5",
            "trainer.queue_wait_timeout_s=600",
            "stream.prompt_ack_wait_s=10",
            "generator.heartbeat_s=3",  # below the ack wait (refused otherwise)
            "stream.max_bytes=268435456",
            "weights.grace_s=5",
            "logging.level=INFO",
        ],
        environ={},
    )
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    roles = Roles(config_path, run_dir / "logs")
    restarted: list[subprocess.Popen[bytes]] = []
    events: list[str] = []
    try:
        _run_chaos(run_dir, roles, Path(chaos_stack.dir), rng, events, restarted)
        _check_records(run_dir, config_path, tmp_path / "export", cfg.trainer.batch_groups, events)
    except BaseException:
        print(f"events: {events}\n{roles.tails()}")
        raise
    finally:
        for proc in [*roles.every, *restarted]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    # no process left: every role, and everything in its process group
    for proc in roles.every:
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)


def _run_chaos(
    run_dir: Path,
    roles: Roles,
    stack_dir: Path,
    rng: random.Random,
    events: list[str],
    restarted: list[subprocess.Popen[bytes]],
) -> None:
    """The schedule: kill and restart roles (and nats-server once) until both `CHAOS_S` and `MIN_EVENTS` are
    reached, then stop every role cleanly (SIGTERM: the trainer writes its final checkpoint, all exit 0)."""
    roles.start_trainer(resume=False)
    for i in range(NUM_GENERATORS):
        roles.start_generator(f"gen-{i}")
    started = time.monotonic()
    while len(events) < MIN_EVENTS or time.monotonic() - started < CHAOS_S:
        _wait_for_steps(run_dir, _committed_steps(run_dir) + rng.randint(*STEPS_BETWEEN_EVENTS), roles)
        if len(events) == MIN_EVENTS // 2 and not restarted:
            restarted.append(_restart_nats(stack_dir))
            events.append("nats-server")
        elif rng.random() < 0.5:
            assert roles.trainer is not None
            roles.kill(roles.trainer)
            roles.start_trainer(resume=True)
            events.append("trainer")
        else:
            gen_id = rng.choice(sorted(roles.generators))
            roles.kill(roles.generators[gen_id])
            roles.start_generator(gen_id)
            events.append(gen_id)
    _wait_for_steps(run_dir, _committed_steps(run_dir) + 2, roles)  # it still trains after the last event
    roles.wait_ready()
    final = [*roles.generators.values(), roles.trainer]
    for proc in final:
        assert proc is not None
        os.killpg(proc.pid, signal.SIGTERM)
    codes = {" ".join(proc.args[3:5]): proc.wait(timeout=STOP_TIMEOUT_S) for proc in final if proc is not None}
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{roles.tails()}"
    assert "trainer" in events and "nats-server" in events and any(e.startswith("gen-") for e in events), events


def _check_records(run_dir: Path, config_path: Path, export: Path, batch_groups: int, events: list[str]) -> None:
    """Exactly once, from the run's own records: metrics.jsonl against a Parquet export of the stream."""
    records = _records(run_dir)
    trained = [g for r in records for g in r["trained_group_ids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(trained) >= len(events) * batch_groups
    versions = [int(r["version"]) for r in records]
    assert all(b > a for a, b in zip(versions, versions[1:], strict=False)), versions
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))

    replay = subprocess.run(
        leeway_argv("replay", str(config_path), "--from-seq", "1", "--to-parquet", str(export)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=STOP_TIMEOUT_S * 4,
    )
    assert replay.returncode == 0, replay.stdout + replay.stderr
    in_stream: set[str] = set()
    for path in export.glob("*.parquet"):
        in_stream.update(pq.read_table(path, columns=["group_id"]).column("group_id").to_pylist())
    assert set(trained) <= in_stream, sorted(set(trained) - in_stream)[:10]
