"""`leeway run` and the roles launched separately, through the real nats-server and SeaweedFS.

Unit part (fast): the live view and plain lines against synthetic records, the report (PNG and
summary), metrics tailing, thread split, stopping process groups.

Integration part (real servers, real processes):
- a short demo via `leeway run`: the reward rises, and every token the trainer trained on is within
  the staleness cap, checked against the recorded trajectory stream (not the trainer's own metric);
- the roles by hand in any order: a generator first, then the trainer, a second generator late, the
  first stopped mid-run; the run finishes and every admitted prompt is trained, dropped with a
  reason, or still queued (nothing lost);
- Ctrl-C on `leeway run`: exit 130, no process it started (roles, private stack) is left running.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from actors.launcher.live_view import LiveView, sparkline
from actors.launcher.report import summarize, write_report
from actors.launcher.roles import (
    GeneratorProcessStatus,
    RoleProcess,
    RunStatus,
    spawn_role,
    split_threads,
    stop_roles,
    write_run_config,
)
from actors.launcher.run import read_metrics
from actors.launcher.run_dir import RUN_MARKER, RunDirInUse, RunDirRefused, prepare_run_dir, protected_reason
from infra.process import is_running, start_ticks, stop_processes
from infra.stack import StackState, load_state, start_stack
from pipeline.config import LeewayConfig, load_config
from tests.support.runs import (
    COMMON,
    DEMO,
    DEMO_DEADLINE_S,
    REPO,
    ROLE_STOP_DEADLINE_S,
    alive,
    assert_final_export,
    assert_reward_rises,
    leeway_argv,
    log_tails,
    processes_mentioning,
    queued_prompt_ids,
    recorded_groups,
    run_records,
    run_to_end,
    shared_stack_config,
    unconsumed_from,
)
from tests.support.runs import children_of as _children_of

DEMO_STEPS = 120
"""The demo's reward sits near chance (~0.08) for its first ~60 steps, then climbs (0.15 by step 100)."""
UNBOUNDED_STEPS = 1_000_000
"""trainer.max_steps of a run that a test stops itself, once the events it waits for were seen."""
EVENT_DEADLINE_S = 150.0
"""Generous bound on waiting for one event of a run (a step, a report); the wait ends as soon as it happens."""
GONE_DEADLINE_S = 60.0
"""Generous bound on a SIGKILLed process disappearing."""


# ------------------------------------------------------------------------------------ synthetic


def synthetic_records(steps: int = 30) -> list[dict[str, Any]]:
    out = []
    for step in range(1, steps + 1):
        reward = 0.1 + 0.8 * step / steps
        out.append(
            {
                "step": step,
                "version": step,
                "time_s": 2.0 + 0.5 * step,
                "reward/unfiltered_mean": reward,
                "reward/kept_mean": reward + 0.02,
                "staleness/mean": 1.0 + (step % 3) * 0.3,
                "staleness/max": 2,
                "samples/dropped_by_cap_total": step // 10,
                "time/step_s": 0.5,
                "time/wait_fraction": 0.2,
                "generators/tokens_per_s": 3000.0 + step,
                "trainer/tokens_per_s": 5000.0,
                "queue/trajectories": 7,
                "trained_group_ids": [f"p{step}.{i}" for i in range(3)],
                "dropped_group_ids": {f"d{step}": "no_disagreement"},
                "generators": {
                    "gen-0": {
                        "version": step - 1,
                        "tokens_per_s": 1500.0,
                        "idle_fraction": 0.05,
                        "rollouts_in_flight": 4,
                        "time_s": time.time(),
                        "endpoint": "http://127.0.0.1:40123",
                    },
                    "gen-9": {
                        "version": step - 2,
                        "tokens_per_s": 1500.0,
                        "idle_fraction": 0.1,
                        "rollouts_in_flight": 4,
                        "time_s": time.time() - 3,
                    },
                },
            }
        )
    return out


def demo_config(tmp_path: Path, *extra: str) -> LeewayConfig:
    return load_config(str(DEMO), [*COMMON, f"run.dir={tmp_path / 'run'}", *extra])


def test_live_view_renders_every_number(tmp_path: Path) -> None:
    cfg = demo_config(tmp_path, "trainer.max_steps=30")
    console = Console(record=True, width=140, force_terminal=True)
    view = LiveView(cfg, 1, console=console)
    assert not view.plain
    status = RunStatus(
        generators=(
            GeneratorProcessStatus("gen-0", 1234, None, tmp_path / "gen-0.log"),
            GeneratorProcessStatus("gen-1", 1235, 1, tmp_path / "gen-1.log"),
        ),
        queues={"prompts_waiting": 35, "prompts_in_generation": 12, "groups_waiting": 4, "groups_in_step": 0},
        evals=(
            {"version": 0, "mean_reward": 0.1, "pass@1": 0.05, "pass@4": 0.2, "samples_per_prompt": 4, "prompts": 50},
            {"version": 20, "mean_reward": 0.4, "pass@1": 0.25, "pass@4": 0.5, "samples_per_prompt": 4, "prompts": 50},
        ),
    )
    records = synthetic_records()
    console.print(view.render(records, status))
    text = console.export_text()
    for expected in (
        "30/30",  # progress over steps
        "unfiltered 0.900",
        "kept 0.920",  # both rewards
        "version 30",
        "staleness mean 1.00 max 2 (cap 2)",
        "prompts 35 waiting, 12 in generation",
        "groups 4 waiting",  # queue depth
        "generated 3,030 tok/s",
        "trained 5,000 tok/s",  # throughput
        "running (pid 1234)",
        "exited 1: gen-1.log",
        "external",  # gen-9 reports but is not ours
        "http://127.0.0.1:40123",  # gen-0's endpoint
        "eval version 20: mean reward 0.400 · pass@1 0.250 · pass@4 0.500 over 50 held-out prompts",
        "Ctrl-C stops everything cleanly",
    ):
        assert expected in text, f"{expected!r} missing from the live view:\n{text}"
    gen_rows = [line for line in text.splitlines() if line.startswith("gen-")]
    assert [row.split()[:2] for row in gen_rows] == [["gen-0", "29"], ["gen-1", "-"], ["gen-9", "28"]]
    console.print(view.render([], None))
    assert "waiting for the first step" in console.export_text()


def test_plain_lines_without_terminal(tmp_path: Path) -> None:
    cfg = demo_config(tmp_path, "trainer.max_steps=30")
    console = Console(record=True, width=60, force_terminal=False)
    records = synthetic_records()
    with LiveView(cfg, 1, console=console) as view:
        assert view.plain
        for n in range(1, len(records) + 1):
            view.update(records[:n], RunStatus(queues={"prompts_waiting": 3}))
        view.update(records, RunStatus(generators=(GeneratorProcessStatus("gen-0", 1, 1, tmp_path / "g.log"),)))
    lines = console.export_text().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/30", "10/30", "20/30", "30/30"]  # first, every 10th; unwrapped
    assert "reward 0.900 (kept 0.920)" in steps[-1] and "queue prompts 3" in steps[-1]
    assert "generators gen-0:v29 gen-9:v28" in steps[-1]
    assert any("gen-0: process exited with 1" in line for line in lines)
    assert lines[0].startswith("run ") and "max staleness 2" in lines[0]


def test_sparkline() -> None:
    assert sparkline([]) == ""
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"


def test_report_png_and_summary(tmp_path: Path) -> None:
    cfg = demo_config(tmp_path)
    records = synthetic_records()
    summary = write_report(tmp_path, records, cfg)
    png = (tmp_path / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    text = summary.read_text()
    assert "| reward, first 5 steps | 0.180 |" in text
    assert "| reward, last 5 steps | 0.847 |" in text
    assert "| groups trained / not trained | 90 / 30 (30 no_disagreement) |" in text
    assert "reverse_digits" in text
    assert "nothing to report" in summarize([], cfg)
    write_report(tmp_path / "", [], cfg)  # no step: a summary, no plot, no error


def test_read_metrics_waits_for_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path, 0) == ([], 0)
    path.write_bytes(b'{"step": 1}\n{"step": 2')
    records, offset = read_metrics(path, 0)
    assert records == [{"step": 1}] and offset == len(b'{"step": 1}\n')
    with open(path, "ab") as handle:
        handle.write(b"}\n")
    records, offset = read_metrics(path, offset)
    assert records == [{"step": 2}] and offset == path.stat().st_size


def test_the_run_config_is_written_for_its_owner_only(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("left by an older version\n")
    (tmp_path / "config.yaml").chmod(0o644)
    cfg = load_config(None, ["nats.url=nats://secret-token@127.0.0.1:4222"], environ={})
    path = write_run_config(cfg, tmp_path)
    assert path == tmp_path / "config.yaml" and path.stat().st_mode & 0o777 == 0o600
    assert load_config(path, environ={}).nats.url == "nats://secret-token@127.0.0.1:4222"


def test_split_threads() -> None:
    assert split_threads(1, cores=2) == (1, 1)
    assert split_threads(3, cores=2) == (1, 1)
    assert split_threads(2, cores=16) == (8, 4)


def test_run_dir_is_never_mixed_with_an_earlier_run(tmp_path: Path) -> None:
    cfg = demo_config(tmp_path)
    run_dir = prepare_run_dir(cfg, fresh=False)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirInUse, match="--resume.*--fresh"):
        prepare_run_dir(cfg, fresh=False)
    with pytest.raises(RunDirInUse, match="1 trained steps.*--fresh --discard-checkpoints"):
        prepare_run_dir(cfg, fresh=True)  # its checkpoints are not deleted on --fresh alone
    assert (run_dir / "metrics.jsonl").exists()
    assert not (prepare_run_dir(cfg, fresh=True, discard_checkpoints=True) / "metrics.jsonl").exists()


def test_fresh_deletes_only_a_directory_leeway_created(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    (foreign / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirRefused, match=RUN_MARKER):
        prepare_run_dir(demo_config(tmp_path, f"run.dir={foreign}"), fresh=True, discard_checkpoints=True)
    assert (foreign / "thesis.tex").read_text() == "years of work"

    cfg = demo_config(tmp_path)
    created = prepare_run_dir(cfg, fresh=False)
    assert (created / RUN_MARKER).is_file()
    (created / "metrics.jsonl").write_text('{"step": 1}\n')
    again = prepare_run_dir(cfg, fresh=True, discard_checkpoints=True)
    assert (again / RUN_MARKER).is_file() and not (again / "metrics.jsonl").exists()


def test_fresh_never_deletes_the_working_directory_home_or_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    work = home / "work"
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    for run_dir in (".", str(work), str(home), str(tmp_path)):  # cwd (relative, absolute), home, a parent of both
        for path in (work, home, tmp_path):  # each looks like an earlier run, marker included
            (path / RUN_MARKER).write_text("")
            (path / "metrics.jsonl").write_text('{"step": 1}\n')
        with pytest.raises(RunDirRefused, match="refuses to delete"):
            prepare_run_dir(demo_config(tmp_path, f"run.dir={run_dir}"), fresh=True, discard_checkpoints=True)
        assert (work / "metrics.jsonl").exists() and (home / "metrics.jsonl").exists(), run_dir
    assert protected_reason(Path("/")) == "the filesystem root"
    assert protected_reason(work / "runs" / "demo") is None


@pytest.mark.timeout(120)
def test_fresh_stops_the_private_stack_of_the_earlier_run(tmp_path: Path) -> None:
    cfg = demo_config(tmp_path)
    run_dir = prepare_run_dir(cfg, fresh=False)
    state = start_stack(run_dir / "stack")  # as left running by a `leeway run` that was killed
    try:
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        prepare_run_dir(cfg, fresh=True, discard_checkpoints=True)
        assert not [p.name for p in state.processes if is_running(p)], "the earlier run's stack is still running"
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "stack").exists()
    finally:
        stop_processes([p for p in state.processes if is_running(p)], timeout_s=1.0)


def test_stop_roles_kills_the_whole_group_of_a_role_ignoring_sigterm(tmp_path: Path) -> None:
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    log = tmp_path / "role.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen([sys.executable, "-c", script], stdout=out, start_new_session=True)
    role = RoleProcess("stubborn", popen, log)
    deadline = time.monotonic() + EVENT_DEADLINE_S
    while not log.read_text().strip():
        assert time.monotonic() < deadline and popen.poll() is None, log.read_text()
        time.sleep(0.05)
    grandchild = int(log.read_text().split()[0])
    started = time.monotonic()
    stop_roles([role], timeout_s=0.5)
    assert time.monotonic() - started < 60, "stop_roles waited for the role instead of killing it"
    assert popen.returncode == -signal.SIGKILL
    _wait_gone([grandchild])


# ------------------------------------------------------------------------------------ helpers


def _wait_gone(pids: list[int], timeout_s: float = GONE_DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "processes left running"


def _last_step(records: list[dict[str, Any]]) -> int:
    return int(records[-1]["step"]) if records else 0


def _reporters(records: list[dict[str, Any]]) -> set[str]:
    """Every generator whose report the trainer recorded in some step."""
    return set().union(*(set(r.get("generators") or {}) for r in records))


def _wait_for_records(
    run_dir: Path,
    what: str,
    predicate: Callable[[list[dict[str, Any]]], bool],
    procs: list[subprocess.Popen[bytes]],
    timeout_s: float = EVENT_DEADLINE_S,
) -> list[dict[str, Any]]:
    """Poll metrics.jsonl until `predicate(records)` holds; fail at once if one of `procs` exits first."""
    deadline = time.monotonic() + timeout_s
    path = run_dir / "metrics.jsonl"
    while True:
        records = read_metrics(path, 0)[0]
        if predicate(records):
            return records
        for proc in procs:
            assert proc.poll() is None, f"{proc.args} exited with {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s (last step {_last_step(records)})"
        time.sleep(0.2)


# ---------------------------------------------------------------------------------- integration


@pytest.mark.slow
@pytest.mark.timeout(DEMO_DEADLINE_S + 60)
def test_short_demo_learns_within_the_cap(
    tmp_path: Path, stack: StackState, cleanup: list[subprocess.Popen[bytes]]
) -> None:
    """`leeway run` on the demo task, fewer steps, on a running stack (found at nats.stack_dir and left up)."""
    cfg = shared_stack_config(tmp_path, stack, "run-demo", DEMO_STEPS)
    assert cfg.staleness.policy == "drop_trajectory"
    run_dir = cfg.run.run_dir
    config_path = tmp_path / "demo.yaml"
    config_path.write_text(cfg.to_yaml())
    text = run_to_end(config_path, run_dir, cleanup)
    assert f"step {DEMO_STEPS}/{DEMO_STEPS} reward" in text

    # the report, and the final policy exported into final/ (said in the last line and summary.md)
    assert (run_dir / "report.png").read_bytes().startswith(b"\x89PNG")
    assert f"| steps | {DEMO_STEPS} " in (run_dir / "summary.md").read_text()
    final = run_dir / "final"
    assert f"the final policy is a Hugging Face checkpoint in {final}" in text.strip().splitlines()[-1]
    assert f"The final policy (version {DEMO_STEPS}, step {DEMO_STEPS}" in (run_dir / "summary.md").read_text()
    assert json.loads((final / "leeway.json").read_text())["run"] == "run-demo"
    assert_final_export(run_dir, DEMO_STEPS)
    assert not (run_dir / "stack").exists(), "a healthy stack at nats.stack_dir must be used, not a private one"
    assert load_state(stack.dir) is not None and load_state(stack.dir).processes  # type: ignore[union-attr]

    # the reward rises: last steps against first steps, by a margin well above the step-to-step noise
    records = run_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, DEMO_STEPS + 1))
    assert_reward_rises(records)

    # every trained token is within the cap: checked on the recorded groups, not the trainer's metric
    groups = {g.group_id: g for g in asyncio.run(recorded_groups(cfg))}
    cap = cfg.staleness.max_staleness
    checked = 0
    for record in records:
        trainer_version = int(record["version"]) - 1  # the weights the step was computed with
        for group_id in record["trained_group_ids"]:
            group = groups[group_id]
            loss_versions = group.versions[group.loss_mask.astype(bool)]
            assert loss_versions.size > 0
            assert int(loss_versions.min()) >= trainer_version - cap, (group_id, record["step"])
            assert int(loss_versions.max()) <= trainer_version, (group_id, record["step"])
            checked += int(loss_versions.size)
    assert checked > 0
    assert max(int(r["staleness/max"]) for r in records) >= 1, "the run was not asynchronous at all"


@pytest.mark.slow
@pytest.mark.timeout(4 * EVENT_DEADLINE_S + 3 * ROLE_STOP_DEADLINE_S)
def test_roles_launched_separately_late_and_stopped_generators_lose_no_prompt(
    tmp_path: Path, stack: StackState, cleanup: list[subprocess.Popen[bytes]]
) -> None:
    """Generator first, trainer next, a second generator late, the first stopped mid-run.

    Each phase ends on an event seen in the trainer's records (a generator's report, a trained group of
    gen-b, progress after gen-a left), never on a duration: generators report every few seconds, and
    on a fast machine a fixed number of steps ends before any report arrives. So the trainer runs
    without a step limit and is stopped (SIGTERM: it finishes or abandons its step and checkpoints)
    once everything was seen.
    """
    cfg = shared_stack_config(tmp_path, stack, "run-roles", UNBOUNDED_STEPS)
    run_dir = cfg.run.run_dir
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    logs = run_dir / "logs"

    def role(kind: str, name: str, *sets: str) -> RoleProcess:
        started = spawn_role(kind, config_path, list(sets), logs / f"{name}.log", threads=1, name=name)
        cleanup.append(started.popen)
        return started

    def trained_from(generator_id: str, records: list[dict[str, Any]]) -> bool:
        trained = {g for r in records for g in r["trained_group_ids"]}
        return bool(trained) and any(
            g.generator_id == generator_id and g.group_id in trained for g in asyncio.run(recorded_groups(cfg))
        )

    gen_a = role("generator", "gen-a", "generator.id=gen-a")
    trainer = role("trainer", "trainer")
    try:
        _wait_for_records(
            run_dir,
            "step 6 and a report of gen-a",
            lambda records: _last_step(records) >= 6 and "gen-a" in _reporters(records),
            [gen_a.popen, trainer.popen],
        )
        gen_b = role("generator", "gen-b", "generator.id=gen-b")
        _wait_for_records(
            run_dir,
            "a report of gen-b and a trained group of gen-b",
            lambda records: "gen-b" in _reporters(records) and trained_from("gen-b", records),
            [gen_a.popen, gen_b.popen, trainer.popen],
        )
        stop_roles([gen_a], timeout_s=ROLE_STOP_DEADLINE_S)
        assert gen_a.popen.returncode == 0, log_tails(run_dir)
        left_at = _last_step(run_records(run_dir))
        _wait_for_records(
            run_dir,
            f"3 steps after step {left_at}, when gen-a left",
            lambda records: _last_step(records) >= left_at + 3,
            [gen_b.popen, trainer.popen],
        )
        stop_roles([trainer], timeout_s=ROLE_STOP_DEADLINE_S)
        assert trainer.popen.returncode == 0, log_tails(run_dir)
        stop_roles([gen_b], timeout_s=ROLE_STOP_DEADLINE_S)
        assert gen_b.popen.returncode == 0, log_tails(run_dir)
    except BaseException:
        print(log_tails(run_dir))
        raise

    records = run_records(run_dir)
    steps = len(records)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert _reporters(records) == {"gen-a", "gen-b"}

    # every admitted prompt is trained, dropped with a reason, or still waiting (queue or stream)
    trained = [g for r in records for g in r["trained_group_ids"]]
    dropped = [g for r in records for g in r["dropped_group_ids"]]
    assert len(trained) == len(set(trained)) == steps * cfg.trainer.batch_groups
    assert not set(trained) & set(dropped)
    admitted_count, queued = asyncio.run(queued_prompt_ids(cfg))
    unconsumed = {g.group_id for g in asyncio.run(recorded_groups(cfg, unconsumed_from(cfg)))}
    from actors.trainer.prompt_feed import PromptFeed
    from pipeline.tasks import get_task

    admitted = {p.prompt_id for p in PromptFeed(cfg, get_task(cfg.task.name, **cfg.task.args), 0).take(admitted_count)}
    accounted = set(trained) | set(dropped) | queued | unconsumed
    lost = admitted - accounted
    assert not lost, f"{len(lost)} of {len(admitted)} admitted prompts lost: {sorted(lost)[:10]}"
    assert accounted <= admitted, "a group that was never admitted"

    # both generators produced trained groups: the late one joined, the stopped one counted until it left
    by_generator = {g.group_id: g.generator_id for g in asyncio.run(recorded_groups(cfg))}
    assert {by_generator[g] for g in trained} == {"gen-a", "gen-b"}


@pytest.mark.timeout(EVENT_DEADLINE_S + ROLE_STOP_DEADLINE_S + 60)
def test_ctrl_c_stops_everything(tmp_path: Path, cleanup: list[subprocess.Popen[bytes]]) -> None:
    """SIGINT after the first steps: exit 130, every role and the private stack are gone, a report is written."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        leeway_argv(
            "run",
            str(DEMO),
            "--no-live",
            "--generators",
            "2",
            *(
                f"--set={item}"
                for item in [
                    *COMMON,
                    f"run.dir={run_dir}",
                    "run.name=run-sigint",
                    f"nats.stack_dir={tmp_path / 'no-stack-here'}",
                ]
            ),
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    cleanup.append(proc)
    seen: dict[int, int | None] = {}
    deadline = time.monotonic() + EVENT_DEADLINE_S
    while time.monotonic() < deadline:
        seen.update(_children_of(proc.pid))
        records, _ = read_metrics(run_dir / "metrics.jsonl", 0)
        if len(records) >= 2 or proc.poll() is not None:
            break
        time.sleep(0.2)
    assert proc.poll() is None, (proc.stdout.read() if proc.stdout else b"").decode() + log_tails(run_dir)
    seen.update(_children_of(proc.pid))
    state = load_state(run_dir / "stack")
    assert state is not None and len(state.processes) == 3, "a private stack in <run.dir>/stack"
    stack_pids = {p.pid: start_ticks(p.pid) for p in state.processes}
    roles = set(seen) - set(stack_pids)
    assert set(stack_pids) <= set(seen) and len(roles) == 3, f"stack + trainer + 2 generators expected, saw {seen}"

    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C delivers (roles run in their own sessions)
    out, _ = proc.communicate(timeout=ROLE_STOP_DEADLINE_S)
    text = out.decode(errors="replace")
    assert proc.returncode == 130, text
    assert "interrupted" in text
    left = [pid for pid, ticks in {**seen, **stack_pids}.items() if alive(pid, ticks)]
    assert not left, f"left running: {left}"
    assert not processes_mentioning(str(run_dir)), processes_mentioning(str(run_dir))
    assert (run_dir / "summary.md").exists() and (run_dir / "report.png").exists()
    assert not load_state(run_dir / "stack").processes  # type: ignore[union-attr]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "checkpoint written" in trainer_log  # the trainer stopped cleanly, not killed
