"""Chaos on the demo, over a run of `CHAOS_STEPS` steps: a seeded schedule of SIGKILLs of the trainer and the
generators, and once each: nats-server SIGKILLed and restarted, SeaweedFS SIGKILLed and restarted, SeaweedFS
stopped (SIGSTOP: every request hangs) until a trainer write to it has failed and is retried under the trainer's
outage budget, and JetStream's store made small and filled until it refuses writes. No human steps in: the
trainer ends by itself at max_steps.

The schedule is driven by progress, not by the clock: each event waits until the trainer has committed a
few more steps since the last one (read from `metrics.jsonl`), so a slow machine gets the same chaos per
step. At the end, from the run's own records (`metrics.jsonl`, the final checkpoint's state, the
dead-letter stream, a Parquet export of the trajectory stream): every step committed once, versions
strictly increase, no group trained twice, every admitted prompt trained once, dropped with a reason
(the staleness cap) or dead-lettered with a reason, except the last steps' still in flight; and every
process this test started is gone.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from actors.servers import open_run_store, resolve_servers
from actors.trainer.checkpoints import load_latest_checkpoint
from infra.stack import StackState
from pipeline.config import LeewayConfig, load_config
from pipeline.wire.jetstream import connect, read_dead_letters
from pipeline.wire.names import RunNames
from tests.support.chaos import Servers
from tests.support.runs import leeway_argv
from tests.support.stacks import running_stack
from tests.support.waits import wait_until

REPO = Path(__file__).resolve().parents[1]
SEED = 20261130
CHAOS_STEPS = 250
"""The run's max_steps: it ends by itself there. The task is the demo's with 8 digits, which keeps learning
for this long (6 digits saturate near step 200: every group then agrees, is filtered, and steps starve)."""
TRAINER_KILLS = 4
GENERATOR_KILLS = 4
S3_OVERRIDES = ("store.read_timeout_s=5", "store.max_retries=1")
"""A request to the stopped store times out after 5 s, not 60: a plain one fails after 2 tries (about 10 s), a
conditional one (a manifest, LATEST) after its own 9 (`storage/s3.py`, about 45-65 s with their backoff)."""
OUTAGE_BUDGET_S = 120.0
"""The trainer's store-write budgets (`outages.publish_s`, `outages.checkpoint_s`; 600 s by default): one
failed try of a publish or checkpoint (parts, then a conditional manifest write: at most about 75 s with
`S3_OVERRIDES`) and its retry fit; a budget that ran out would end the run, and fail the test."""
LEASE_OVERRIDES = ("trainer.lease_ttl_s=3", "trainer.lease_heartbeat_s=1")
"""A SIGKILLed trainer's lease is stale after 3 s, not the default 20: its restart takes it over quickly."""
STEPS_BETWEEN_EVENTS = (4, 12)
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

    def wait_ready(self, names: list[str]) -> None:
        """Until each named current process has said it serves (a SIGTERM during start-up, before the role
        installs its handler, would end it with -15 instead of a clean stop)."""
        every = {"trainer": READY_TRAINER, **dict.fromkeys(self.generators, READY_GENERATOR)}
        for name in names:
            path, marker, offset = self.logs / f"{name}.log", every[name], self.log_offsets[name]
            wait_until(
                lambda: marker in path.read_bytes()[offset:] or self.check_alive(),  # noqa: B023 (waited for here)
                what=f"{name} to become ready",
                timeout_s=PROGRESS_TIMEOUT_S,
                detail=self.tails,
            )

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
    wait_until(
        lambda: _committed_steps(run_dir) >= target or roles.check_alive(),
        what=f"progress to step {target}",
        timeout_s=PROGRESS_TIMEOUT_S,
        detail=roles.tails,
        poll_s=0.2,
    )


@pytest.fixture
def chaos_stack(tmp_path: Path) -> Iterator[StackState]:
    """A stack of the chaos test's own: its servers are killed, stopped and restarted, which others must not see."""
    with running_stack(tmp_path / "stack") as state:
        yield state


SERVER_EVENTS = ("nats-server", "s3-kill", "s3-stop", "jetstream-full")
"""Each happens once, at a seeded place among the role kills."""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_chaos_trains_every_admitted_prompt_once_or_says_why(tmp_path: Path, chaos_stack: StackState) -> None:
    rng = random.Random(SEED)
    run_dir = tmp_path / "run"
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        [
            "run.name=chaos",
            f"run.dir={run_dir}",
            f"nats.stack_dir={chaos_stack.dir}",
            f"trainer.max_steps={CHAOS_STEPS}",
            "trainer.checkpoint_every=5",
            "trainer.queue_wait_timeout_s=600",
            "stream.prompt_ack_wait_s=10",
            "generator.heartbeat_s=3",  # below the ack wait (refused otherwise)
            "stream.max_bytes=268435456",  # the whole run stays in the stream (checked against it at the end)
            "task.args.num_digits=8",
            "engine.sampling.max_new_tokens=8",
            "weights.grace_s=5",
            "logging.level=INFO",
            f"outages.publish_s={OUTAGE_BUDGET_S}",
            f"outages.checkpoint_s={OUTAGE_BUDGET_S}",
            *S3_OVERRIDES,
            *LEASE_OVERRIDES,
        ],
        environ={},
    )
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    roles = Roles(config_path, run_dir / "logs")
    servers = Servers(Path(chaos_stack.dir))
    events: list[str] = []
    try:
        _run_chaos(run_dir, roles, servers, rng, events)
        _check_records(cfg, run_dir, config_path, tmp_path / "export", events)
    except BaseException:
        print(f"events: {events}\n{roles.tails()}")
        raise
    finally:
        for proc in roles.every:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        servers.kill_restarted()
    # no process left: every role, and everything in its process group
    for proc in roles.every:
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)


def _schedule(rng: random.Random) -> list[str]:
    """Role kills and the four server events, shuffled; never two server events in a row."""
    kills = ["trainer"] * TRAINER_KILLS + ["generator"] * GENERATOR_KILLS
    rng.shuffle(kills)
    slots = sorted(rng.sample(range(len(kills) + 1), len(SERVER_EVENTS)))
    server_events = list(SERVER_EVENTS)
    rng.shuffle(server_events)
    out: list[str] = []
    for i, kill in enumerate([*kills, None]):
        if i in slots:
            out.append(server_events[slots.index(i)])
        if kill is not None:
            out.append(kill)
    return out


def _run_chaos(run_dir: Path, roles: Roles, servers: Servers, rng: random.Random, events: list[str]) -> None:
    """The schedule, each event after a few more committed steps; then the trainer must reach max_steps by
    itself (exit 0) and the generators stop cleanly on SIGTERM (exit 0)."""
    roles.start_trainer(resume=False)
    for i in range(NUM_GENERATORS):
        roles.start_generator(f"gen-{i}")
    for event in _schedule(rng):
        _wait_for_steps(run_dir, _committed_steps(run_dir) + rng.randint(*STEPS_BETWEEN_EVENTS), roles)
        if event == "trainer":
            assert roles.trainer is not None
            roles.kill(roles.trainer)
            roles.start_trainer(resume=True)
        elif event == "generator":
            gen_id = rng.choice(sorted(roles.generators))
            roles.kill(roles.generators[gen_id])
            roles.start_generator(gen_id)
            event = gen_id
        elif event == "nats-server":
            servers.restart("nats")
        elif event == "s3-kill":
            servers.restart("seaweed")
        elif event == "s3-stop":
            # the outage: a store that takes requests and never answers, until a trainer write has timed out and
            # is retried under its budget (about 10 s; it was a fixed 120 s, which a publish rode out in one try)
            offset = _log_size(roles, "trainer")
            servers.pause("seaweed")
            try:
                _wait_for_log(roles, {"trainer": offset}, f"(try 1, budget {OUTAGE_BUDGET_S:.0f} s:".encode())
            finally:
                servers.resume("seaweed")
        elif event == "jetstream-full":
            servers.limit_jetstream_store()
            offsets = {name: _log_size(roles, name) for name in ["trainer", *roles.generators]}
            servers.fill_jetstream()
            _wait_for_log(roles, offsets, b"insufficient resources")  # the roles met the full store
            servers.drain_jetstream()
        events.append(event)
    assert roles.trainer is not None
    code = roles.trainer.wait(timeout=PROGRESS_TIMEOUT_S * 4)  # max_steps reached: the run ends by itself
    assert code == 0, f"trainer exit {code}\n{roles.tails()}"
    assert _committed_steps(run_dir) == CHAOS_STEPS
    roles.wait_ready(names=list(roles.generators))
    for proc in roles.generators.values():
        os.killpg(proc.pid, signal.SIGTERM)
    codes = {gen_id: proc.wait(timeout=STOP_TIMEOUT_S) for gen_id, proc in roles.generators.items()}
    assert set(codes.values()) == {0}, f"generator exit codes {codes}\n{roles.tails()}"


def _log_size(roles: Roles, name: str) -> int:
    path = roles.logs / f"{name}.log"
    return path.stat().st_size if path.exists() else 0


def _wait_for_log(roles: Roles, offsets: dict[str, int], marker: bytes) -> None:
    """Until one of the roles' logs (from its offset) holds `marker`."""
    wait_until(
        lambda: (
            any(marker in (roles.logs / f"{n}.log").read_bytes()[o:] for n, o in offsets.items()) or roles.check_alive()
        ),
        what=f"a role to log {marker!r}",
        timeout_s=PROGRESS_TIMEOUT_S,
        detail=roles.tails,
        poll_s=0.2,
    )


def _check_records(cfg: LeewayConfig, run_dir: Path, config_path: Path, export: Path, events: list[str]) -> None:
    """Exactly once, from the run's own records: metrics.jsonl, the final checkpoint's state, the dead-letter
    stream and a Parquet export of the trajectory stream."""
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, CHAOS_STEPS + 1))
    versions = [int(r["version"]) for r in records]
    assert all(b > a for a, b in zip(versions, versions[1:], strict=False)), versions
    trained = [g for r in records for g in r["trained_group_ids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(trained) == CHAOS_STEPS * cfg.trainer.batch_groups
    dropped = {g: why for r in records for g, why in r["dropped_group_ids"].items()}
    assert not set(dropped) & set(trained), "a group was both dropped and trained"
    assert all(dropped.values()), "a group was dropped without a reason"

    store = open_run_store(cfg)
    loaded = load_latest_checkpoint(store, cfg.run.name)
    assert loaded is not None
    state = loaded[0]
    assert state.step == CHAOS_STEPS
    dead = asyncio.run(_dead_letters(cfg))
    assert all(reason for _, reason in dead), dead
    dead_ids = {group_id for group_id, _ in dead if group_id is not None}
    admitted = {_admission_index(g) for g in [*trained, *dropped, *dead_ids]}
    assert max(admitted) < state.admitted, "a group the trainer never admitted"
    undecided = set(range(state.admitted)) - admitted
    window = (cfg.staleness.max_staleness + 2) * cfg.trainer.batch_groups
    assert len(undecided) <= window, (len(undecided), sorted(undecided)[:20])  # only the last steps' still in flight
    assert not set(trained) & dead_ids, "a dead-lettered group was trained"

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
    assert {"trainer", "nats-server", "s3-kill", "s3-stop", "jetstream-full"} <= set(events), events


def _admission_index(group_id: str) -> int:
    """`<task prompt id>.<i>`: the admission index the trainer gave the prompt."""
    return int(group_id.rpartition(".")[2])


async def _dead_letters(cfg: LeewayConfig) -> list[tuple[str | None, str]]:
    names = RunNames.for_run(cfg.run.name)
    nc = await connect(resolve_servers(cfg).nats_url, name="chaos-dlq")
    try:
        out: list[tuple[str | None, str]] = []
        seq = 0
        while True:
            entries, seq_next = await read_dead_letters(nc.jetstream(), names, after_seq=seq, limit=256)
            out += [(e.original_id, e.reason) for e in entries]
            if seq_next == seq:
                return out
            seq = seq_next
    finally:
        await nc.drain()
