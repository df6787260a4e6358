"""`leeway fleet` on a real local Ray cluster of two simulated nodes (127.0.0.1), real nats-server and SeaweedFS.

Unit part (fast): scale plans, rank environment, resources, the embedded-stack rule, version merging,
the metrics tail, the address order, the config section.

Integration part: `fleet up` runs the demo with a trainer and 2 generators; `fleet status --json` lists
every role with node and version; `fleet scale` to 3, a generator actor SIGKILLed and restarted by Ray,
`fleet scale` to 1, the trainer actor SIGKILLed and restarted with `--resume`; the resumed trainer takes
its steps past the killed one's and is stopped, which stops the generators; every trained group was
trained once and is in the stream, every generator's groups were trained, no prompt was lost; `fleet
down` leaves no process of the run. A second test: `fleet up` without a cluster or stack starts both (and
2 trainer ranks), `down` stops them. Every phase waits for an event (a report, a restart), never a duration.

The fleet runs the processes `leeway run` runs (`leeway trainer`, `leeway generator`) under Ray actors, so
the run is a plumbing run: that the demo learns is proven by
`tests/launcher/test_run.py::test_short_demo_learns_within_the_cap`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.fleet import placement
from actors.fleet.commands import FleetState, resolve_address
from actors.fleet.roles import RoleActor, RoleSpec, last_metrics_record
from actors.launcher.run import read_metrics
from infra.stack import StackState
from pipeline.config import ConfigError, LeewayConfig, load_config
from tests.support.runs import (
    COMMON,
    DEMO,
    REPO,
    processes_mentioning,
    queued_prompt_ids,
    recorded_groups,
    unconsumed_from,
)
from tests.support.waits import wait_until

EVENT_DEADLINE_S = 180.0
"""Generous bound on one event of the run (a report, a restart); each wait ends as soon as it happens."""
RUN_DEADLINE_S = 600.0
"""Generous bound on the whole run through the fleet; each of its waits ends on an event."""
CLI_DEADLINE_S = 240.0
STATUS_POLL_S = 1.0
"""How often the test asks the fleet for its status while it waits for an event."""
FLEET_DEMO_STEPS = 300
"""A `trainer.max_steps` the run does not reach: the test stops the trainer once the resumed one is past the
killed one's steps by `RESUMED_STEPS`."""
RESUMED_STEPS = 5
"""Steps the resumed trainer takes past the killed one's last: more than the groups outstanding at the kill
((max_staleness + 1) x batch_groups, 3 steps' worth), so every generator's groups were decided by then."""


# ------------------------------------------------------------------------------------------- unit


def _cfg(*sets: str) -> LeewayConfig:
    return load_config(None, list(sets), environ={})


def test_scale_plan_adds_after_the_highest_index_and_drains_the_newest() -> None:
    assert placement.plan_scale([], 2).start == ("gen-0", "gen-1")
    running = ["trainer-0", "gen-0", "gen-1"]
    assert placement.plan_scale(running, 3) == placement.ScalePlan(start=("gen-2",), drain=())
    assert placement.plan_scale(["trainer-0", "gen-0", "gen-3"], 4).start == ("gen-4", "gen-5")
    assert placement.plan_scale(["gen-0", "gen-1", "gen-2"], 1) == placement.ScalePlan(
        start=(), drain=("gen-2", "gen-1")
    )
    assert placement.plan_scale(running, 2) == placement.ScalePlan(start=(), drain=())
    with pytest.raises(ValueError, match="--generators"):
        placement.plan_scale(running, -1)


def test_role_names_sort_trainers_first() -> None:
    names = ["gen-10", "trainer-1", "gen-2", "trainer-0"]
    assert sorted(names, key=placement.role_sort_key) == ["trainer-0", "trainer-1", "gen-2", "gen-10"]
    assert placement.generator_index("gen-x") is None and not placement.is_trainer("trainer")


def test_rank_env_is_the_torch_distributed_contract_and_empty_for_one_rank() -> None:
    assert placement.rank_env(0, 1, "10.0.0.1", 29500) == {}
    env = placement.rank_env(1, 4, "10.0.0.1", 29500)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"


def test_cuda_roles_ask_ray_for_gpus() -> None:
    cpu = _cfg()
    assert placement.trainer_bundles(cpu, 2) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert placement.generator_resources(cpu)["num_gpus"] == 0.0
    gpu = _cfg("trainer.device=cuda", "engine.device=cuda:0")
    assert placement.trainer_bundles(gpu, 1) == [{"CPU": 1.0, "GPU": 1.0}]
    assert placement.trainer_bundles(gpu, 2) == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert placement.generator_resources(gpu)["num_gpus"] == 1.0
    # one rank actor running `leeway trainer` with trainer.nproc local ranks needs all their GPUs
    assert placement.trainer_bundles(_cfg("trainer.device=cuda", "trainer.nproc=4"), 1) == [{"CPU": 1.0, "GPU": 4.0}]


def test_a_resumed_trainer_is_one_rank_actor() -> None:
    assert placement.trainer_layout_refusal(_cfg(), 2) is None
    assert placement.trainer_layout_refusal(_cfg("fleet.trainer_restart=resume"), 1) is None
    refusal = placement.trainer_layout_refusal(_cfg("fleet.trainer_restart=resume"), 2)
    assert refusal is not None and "trainer.nproc" in refusal
    assert "at least 1" in str(placement.trainer_layout_refusal(_cfg(), 0))


def test_embedded_stack_only_where_every_node_reaches_it() -> None:
    embedded = _cfg()
    assert placement.embedded_stack_refusal(embedded, ["127.0.0.1", "127.0.0.1"]) is None  # simulated nodes
    assert placement.embedded_stack_refusal(embedded, ["10.0.0.5"]) is None  # a one-node cluster
    refusal = placement.embedded_stack_refusal(embedded, ["10.0.0.5", "10.0.0.6"])
    assert refusal is not None and "nats.url" in refusal and "10.0.0.6" in refusal
    external = _cfg("nats.url=nats://nats:4222", "store.endpoint=http://s3:8333")
    assert placement.embedded_stack_refusal(external, ["10.0.0.5", "10.0.0.6"]) is None


def test_versions_come_from_the_trainer_record() -> None:
    roles = [{"name": "gen-1"}, {"name": "trainer-0"}, {"name": "gen-0"}]
    record = {"step": 7, "version": 7, "time_s": 3.0, "generators": {"gen-0": {"version": 6, "time_s": 1.0}}}
    merged = {r["name"]: r for r in placement.merge_versions(roles, record)}
    assert [r["name"] for r in placement.merge_versions(roles, record)] == ["trainer-0", "gen-0", "gen-1"]
    assert merged["trainer-0"]["version"] == 7 and merged["trainer-0"]["last_report"]["step"] == 7
    assert merged["gen-0"]["version"] == 6 and merged["gen-1"]["version"] is None


def test_last_metrics_record_skips_a_half_written_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert last_metrics_record(path) is None
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "ver')
    assert last_metrics_record(path) == {"step": 2}


def test_role_spec_round_trips_through_json() -> None:
    spec = RoleSpec("gen-0", "generator", "run: {}\n", "/runs/x", sets=("generator.id=gen-0",), env={"A": "1"})
    assert RoleSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


class _QuickRole(RoleActor):
    """A `RoleActor` without Ray whose role process is a Python that exits at once: `_spawn` as the actor runs it."""

    def __init__(self, spec: RoleSpec) -> None:  # no ray.get_runtime_context(): the fields `_spawn` reads
        self.role, self.restarted, self.node_id, self.env = spec, False, "node-0123456789", {}

    def _argv(self, config_path: Path) -> list[str]:
        return [sys.executable, "-c", "pass"]


def test_a_fleet_role_writes_its_config_and_pid_files_for_its_owner_only(tmp_path: Path) -> None:
    old = tmp_path / "fleet" / "gen-0.yaml"
    old.parent.mkdir()
    old.write_text("left by an older version\n")
    old.chmod(0o644)
    popen = _QuickRole(RoleSpec("gen-0", "generator", "run: {name: x}\n", str(tmp_path)))._spawn()
    assert popen.wait(timeout=60) == 0
    for name in ("gen-0.yaml", "gen-0.pid"):
        assert (tmp_path / "fleet" / name).stat().st_mode & 0o777 == 0o600, name
    assert old.read_text() == "run: {name: x}\n"


def test_address_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    state = FleetState("127.0.0.1:1", "leeway-demo")
    assert resolve_address(None, _cfg(), None) is None
    assert resolve_address(None, _cfg(), state) == "127.0.0.1:1"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:2")
    assert resolve_address(None, _cfg(), state) == "127.0.0.1:2"
    assert resolve_address(None, _cfg("fleet.address=10.0.0.1:6379"), state) == "10.0.0.1:6379"
    assert resolve_address("h:3", _cfg("fleet.address=10.0.0.1:6379"), state) == "h:3"


def test_fleet_config_rejects_an_unknown_restart_policy() -> None:
    assert _cfg().fleet.trainer_restart == "stop"
    with pytest.raises(ConfigError, match="fleet.trainer_restart"):
        _cfg("fleet.trainer_restart=sometimes")


# ------------------------------------------------------------------------------------ integration


@pytest.fixture
def ray_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Two simulated nodes on 127.0.0.1, token authentication on (a token of this test, not ~/.ray)."""
    token = tmp_path / "ray-token"
    token.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from ray._raylet import Config
    from ray.cluster_utils import Cluster

    Config.initialize("")  # Ray reads RAY_AUTH_MODE once per process: make it see the token mode set above

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=4)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def _fleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", "fleet", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CLI_DEADLINE_S,
    )


def _wait_status(
    what: str,
    predicate: Callable[[dict[str, dict[str, Any]]], bool],
    run_dir: Path,
    timeout_s: float = EVENT_DEADLINE_S,
) -> dict[str, Any]:
    """Poll the fleet's status (this process is a driver of the cluster) until `predicate` holds."""
    from actors.fleet.commands import collect_status

    roles: dict[str, dict[str, Any]] = {}

    def holds() -> bool:
        nonlocal roles
        roles = {r["name"]: r for r in collect_status()}
        return predicate(roles)

    wait_until(
        holds, what=what, timeout_s=timeout_s, detail=lambda: f"{roles}\n{_log_tails(run_dir)}", poll_s=STATUS_POLL_S
    )
    return roles


def _log_tails(run_dir: Path) -> str:
    logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:]) for p in logs)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The trainer's records so far (complete lines only: the trainer may be writing one)."""
    return read_metrics(run_dir / "metrics.jsonl", 0)[0]


def _last_step(records: list[dict[str, Any]]) -> int:
    return int(records[-1]["step"]) if records else 0


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _running_with_version(roles: dict[str, dict[str, Any]], *names: str) -> bool:
    return all(roles.get(n, {}).get("state") == "running" and roles[n].get("version") is not None for n in names)


@pytest.mark.slow
@pytest.mark.timeout(RUN_DEADLINE_S + 120)
def test_fleet_runs_the_demo_scales_restarts_and_leaves_nothing(
    tmp_path: Path, stack: StackState, ray_cluster: Any
) -> None:
    import ray

    from actors.fleet.commands import connect

    run_dir = tmp_path / "run"
    cfg = load_config(
        str(DEMO),
        [
            *COMMON,
            "run.name=fleet-demo",
            f"run.dir={run_dir}",
            f"nats.stack_dir={stack.dir}",
            f"trainer.max_steps={FLEET_DEMO_STEPS}",
            "fleet.trainer_restart=resume",
            "trainer.lease_ttl_s=3",  # the SIGKILLed trainer's lease is taken over by its restart within seconds
            "trainer.lease_heartbeat_s=1",
            "trainer.checkpoint_every=5",  # the resumed trainer redoes at most 4 steps of the killed one's
        ],
        environ={},
    )
    config_path = tmp_path / "fleet-demo.yaml"
    config_path.write_text(cfg.to_yaml())
    address = ray_cluster.address
    started = time.monotonic()
    up = _fleet("up", str(config_path), "--address", address, "--generators", "2")
    assert up.returncode == 0, up.stdout + up.stderr + _log_tails(run_dir)
    seen_pids: set[int] = set()
    connect(address, cfg)
    try:
        roles = _wait_status(
            "reports of both generators", lambda r: _running_with_version(r, "gen-0", "gen-1"), run_dir
        )
        status = _fleet("status", str(config_path), "--address", address, "--json")
        assert status.returncode == 0, status.stderr
        listed = {r["name"]: r for r in json.loads(status.stdout)["roles"]}
        assert set(listed) == {"trainer-0", "gen-0", "gen-1"}
        for role in listed.values():
            assert role["node_id"] and role["version"] is not None, role
        assert len({r["node_id"] for r in listed.values() if r["kind"] == "generator"}) == 2, "generators not spread"
        seen_pids |= {int(r["pid"]) for r in roles.values()} | {int(r["actor_pid"]) for r in roles.values()}

        scaled = _fleet("scale", str(config_path), "--address", address, "--generators", "3")
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr
        roles = _wait_status("a report of gen-2", lambda r: _running_with_version(r, "gen-2"), run_dir)
        seen_pids |= {int(roles["gen-2"]["pid"]), int(roles["gen-2"]["actor_pid"])}

        victim = roles["gen-0"]
        os.kill(int(victim["actor_pid"]), signal.SIGKILL)
        roles = _wait_status(
            "gen-0 restarted by Ray",
            lambda r: (
                r.get("gen-0", {}).get("restarts") == 1
                and r["gen-0"].get("state") == "running"
                and r["gen-0"].get("actor_pid") != victim["actor_pid"]
            ),
            run_dir,
        )
        seen_pids |= {int(roles["gen-0"]["pid"]), int(roles["gen-0"]["actor_pid"])}
        wait_until(
            lambda: _gone(int(victim["pid"])),
            what="the killed actor's generator to drain (parent-death SIGTERM)",
            timeout_s=EVENT_DEADLINE_S,
        )

        shrunk = _fleet("scale", str(config_path), "--address", address, "--generators", "1")
        assert shrunk.returncode == 0, shrunk.stdout + shrunk.stderr
        assert "gen-2 stopped (exit 0)" in shrunk.stdout and "gen-1 stopped (exit 0)" in shrunk.stdout, shrunk.stdout

        trainer = roles["trainer-0"]  # fleet.trainer_restart: resume
        killed_at_step = _last_step(_metrics(run_dir))
        os.kill(int(trainer["actor_pid"]), signal.SIGKILL)
        roles = _wait_status(
            "the trainer restarted by Ray",
            lambda r: r.get("trainer-0", {}).get("restarts") == 1 and r["trainer-0"].get("state") == "running",
            run_dir,
        )
        assert _gone(int(trainer["pid"])), "the new trainer started before the old one exited"
        seen_pids |= {int(roles["trainer-0"]["pid"]), int(roles["trainer-0"]["actor_pid"])}

        def past_the_killed_or_ended(r: dict[str, dict[str, Any]]) -> bool:
            ended = r.get("trainer-0", {}).get("state") != "running"
            return ended or _last_step(_metrics(run_dir)) >= killed_at_step + RESUMED_STEPS

        # then the trainer is stopped cleanly (SIGTERM: it finishes or abandons its step, checkpoints and ends)
        roles = _wait_status(
            f"step {killed_at_step + RESUMED_STEPS} of the resumed trainer",
            past_the_killed_or_ended,
            run_dir,
            RUN_DEADLINE_S,
        )
        if roles["trainer-0"]["state"] == "running":
            os.kill(int(roles["trainer-0"]["pid"]), signal.SIGTERM)
        roles = _wait_status(
            "the trainer's end", lambda r: r.get("trainer-0", {}).get("state") == "exited", run_dir, RUN_DEADLINE_S
        )
        assert set(roles) == {"trainer-0", "gen-0"}
        assert roles["gen-0"]["state"] == "stopped", "the trainer's end stops the generators"
        assert "trainer ready: resumed step" in (run_dir / "logs" / "trainer-0.log").read_text()
    finally:
        ray.shutdown()
        down = _fleet("down", str(config_path), "--address", address)
    elapsed = time.monotonic() - started
    assert down.returncode == 0, down.stdout + down.stderr
    assert not processes_mentioning(str(run_dir)), processes_mentioning(str(run_dir))
    assert all(_gone(pid) for pid in seen_pids), [pid for pid in seen_pids if not _gone(pid)]

    records = _metrics(run_dir)
    steps = len(records)
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and steps <= cfg.trainer.max_steps
    trained = [g for r in records for g in r["trained_group_ids"]]
    dropped = [g for r in records for g in r["dropped_group_ids"]]
    assert len(trained) == len(set(trained)) == steps * cfg.trainer.batch_groups, "a group trained twice"
    recorded = {g.group_id: g for g in asyncio.run(recorded_groups(cfg))}
    assert set(trained) <= set(recorded), "a trained group is not in the stream"
    assert {recorded[g].generator_id for g in trained} >= {"gen-0", "gen-1", "gen-2"}

    admitted_count, queued = asyncio.run(queued_prompt_ids(cfg))
    unconsumed = {g.group_id for g in asyncio.run(recorded_groups(cfg, unconsumed_from(cfg)))}
    from actors.trainer.prompt_feed import PromptFeed
    from pipeline.tasks import get_task

    admitted = {p.prompt_id for p in PromptFeed(cfg, get_task(cfg.task.name, **cfg.task.args), 0).take(admitted_count)}
    lost = admitted - (set(trained) | set(dropped) | queued | unconsumed)
    assert not lost, f"{len(lost)} of {len(admitted)} admitted prompts lost: {sorted(lost)[:10]}"

    print(f"fleet demo: {elapsed:.0f} s, {steps} steps, the trainer killed at step {killed_at_step}")


@pytest.mark.slow
@pytest.mark.timeout(RUN_DEADLINE_S)
def test_fleet_up_starts_a_local_cluster_and_stack_with_two_trainer_ranks_and_down_stops_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --address and no stack: `up` starts a private local cluster and the embedded stack, places two trainer
    ranks (the RANK/WORLD_SIZE/MASTER_* contract) and a generator, `--wait` returns when the trainer ends; `down`
    stops the roles, the cluster and the stack, and nothing else (the session's stack stays up)."""
    token = tmp_path / "ray-token"
    token.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run_dir = tmp_path / "run"
    sets = [
        *COMMON,
        "run.name=fleet-local",
        f"run.dir={run_dir}",
        f"nats.stack_dir={tmp_path / 'no-stack-here'}",
        "trainer.max_steps=3",
    ]
    config_path = tmp_path / "fleet-local.yaml"
    config_path.write_text(load_config(str(DEMO), sets, environ={}).to_yaml())
    up = _fleet("up", str(config_path), "--generators", "1", "--trainer-ranks", "2", "--wait")
    try:
        assert up.returncode == 0, up.stdout + up.stderr + _log_tails(run_dir)
        assert "started a local Ray cluster at 127.0.0.1:" in up.stdout and "the trainer exited (0)" in up.stdout
        state = FleetState.load(run_dir)
        assert state is not None and state.local_cluster and state.stack_dir == str(run_dir / "stack")
        status = _fleet("status", str(config_path), "--json")
        assert status.returncode == 0, status.stderr
        roles = {r["name"]: r for r in json.loads(status.stdout)["roles"]}
        assert set(roles) == {"trainer-0", "trainer-1", "gen-0"}
        assert roles["trainer-0"]["version"] == 3 and roles["trainer-1"]["state"] == "exited"
        assert roles["trainer-0"]["rendezvous"]["MASTER_ADDR"] == "127.0.0.1"
        rank_log = (run_dir / "logs" / "trainer-1.log").read_text()
        assert "rank1" in rank_log or "rank 1" in rank_log, rank_log[-2000:]
        assert roles["gen-0"]["state"] == "stopped", "the trainer's end stops the generators"
        pids = [int(r[k]) for r in roles.values() for k in ("pid", "actor_pid")] + [state.local_cluster["pid"]]
    finally:
        down = _fleet("down", str(config_path))
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped the local Ray cluster" in down.stdout and "stopped the embedded stack" in down.stdout
    assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid)]
    assert not processes_mentioning(str(run_dir)), processes_mentioning(str(run_dir))
    assert not (run_dir / "fleet.json").exists()
