"""`leeway tasks check` and the shipped coding tasks' verifier: every task's oracle scores 1 and every known reward
hack (`actors/tools/task_hacks.py`) scores less, in real bubblewrap sandboxes; a copy of the set whose tests run
the solution in-process, as the old TOKEN-style tests did, is refused with the hacks that paid named; every task
holds the same copy of the generic verifier (`configs/data/coding/_harness/`); and a verifier without bubblewrap
never runs the solution (reward 0, with the reason)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from actors.tools.task_hacks import HACKS
from pipeline.sandbox.bwrap import bwrap_binary
from tests.support.runs import REPO, leeway_argv

CODING = REPO / "configs" / "data" / "coding"
HARNESS = CODING / "_harness"
HARNESS_FILES = ("test.sh", "checker.py", "child.py")
needs_bwrap = pytest.mark.skipif(bwrap_binary() is None, reason="bubblewrap is not installed")

OLD_TEST_SH = """#!/usr/bin/env bash
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
token="passed-$RANDOM$RANDOM$RANDOM"
out=$(printf '%s\\n' "$token" | timeout 10 python3 /tests/test_solution.py 2>&1)
status=$?
printf '%s\\n' "$out"
if [ "$status" -eq 0 ] && [ "$(printf '%s\\n' "$out" | tail -n 1)" = "$token" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
"""The shipped tasks' verifier before the checker: a per-run token on stdin, echoed after the last check, and the
solution imported into the process that holds both the token and the expected values."""


def _tasks_check(root: Path) -> tuple[int, list[dict[str, object]], str]:
    done = subprocess.run(
        leeway_argv("tasks", "check", str(root), "--set", "sandbox.starts_per_s=0"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, lines, done.stdout + done.stderr


def test_every_task_holds_the_same_copy_of_the_generic_verifier() -> None:
    tasks = sorted(p for p in CODING.iterdir() if (p / "task.toml").is_file())
    assert len(tasks) == 32
    differ = [
        f"{task.name}/tests/{name}"
        for task in tasks
        for name in HARNESS_FILES
        if not (task / "tests" / name).is_file()
        or (task / "tests" / name).read_bytes() != (HARNESS / name).read_bytes()
    ]
    assert not differ, f"copies that differ from {HARNESS} (run python3 {HARNESS / 'sync.py'}): {differ}"
    assert all(sorted(p.name for p in (t / "tests").iterdir()) == ["cases.py", *sorted(HARNESS_FILES)] for t in tasks)


@needs_bwrap
def test_tasks_check_passes_the_shipped_set_and_no_hack_pays() -> None:
    code, lines, output = _tasks_check(CODING)
    assert code == 0, output
    *tasks, summary = lines
    assert summary == {"tasks": 32, "passed": 32, "failed": []}
    for task in tasks:
        assert (task["oracle_reward"], task["nothing_reward"]) == (1.0, 0.0), task
        assert task["hacks"] == {hack.name: 0.0 for hack in HACKS}, task


@needs_bwrap
def test_tasks_check_refuses_a_set_whose_tests_run_the_solution_in_process(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    for name in ("reverse-words", "two-sum"):
        shutil.copytree(CODING / name, root / name)
    old = root / "reverse-words" / "tests"
    cases = (old / "cases.py").read_text()
    (old / "test_solution.py").write_text(
        "import sys\nTOKEN = sys.stdin.readline().strip()\nsys.path.insert(0, '/app')\n" + cases + "print(TOKEN)\n"
    )
    (old / "test.sh").write_text(OLD_TEST_SH)
    for name in ("cases.py", "checker.py", "child.py"):
        (old / name).unlink()
    code, lines, output = _tasks_check(root)
    assert code == 1, output
    by_task = {line.get("task"): line for line in lines}
    assert by_task["two-sum"]["passed"] is True, output
    hacked = by_task["reverse-words"]
    assert hacked["oracle_reward"] == 1.0 and hacked["nothing_reward"] == 0.0, output
    paid = {name for name, reward in hacked["hacks"].items() if reward == 1.0}
    # the token from the runner's memory, the tests read and answered, the runner's checks patched; what the agent
    # wrote or left running in its own sandbox never reaches the fresh one the tests run in, whatever the tests
    assert {"runner-memory", "read-tests", "patch-runner-globals"} <= paid, hacked
    assert not paid & {"reward-from-agent", "daemon-from-agent", "pid-hopper-from-agent"}, hacked
    for name in paid:
        assert f"hack {name} scores 1: the tests pay a reward hack" in hacked["problems"]
    assert lines[-1] == {"tasks": 2, "passed": 1, "failed": ["reverse-words"]}


def _verifier_box(app: Path, logs: Path, tests: Path, *, without_bwrap: bool) -> list[str]:
    """A bubblewrap sandbox like the verifier's (the system read-only, /app, /logs, /tests), optionally with
    /usr/bin/bwrap replaced by a file that is not executable."""
    argv = [str(bwrap_binary()), "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for name in ("bin", "lib", "lib64", "sbin"):
        link = Path("/") / name
        if link.is_symlink():
            argv += ["--symlink", str(link.readlink()), str(link)]
        elif link.is_dir():
            argv += ["--ro-bind", str(link), str(link)]
    argv += ["--bind", str(app), "/app", "--bind", str(logs), "/logs", "--ro-bind", str(tests), "/tests"]
    if without_bwrap:
        argv += ["--ro-bind", "/dev/null", str(bwrap_binary())]
    return [*argv, "--unshare-all", "--die-with-parent", "--chdir", "/app", "--"]


@needs_bwrap
def test_without_bubblewrap_the_verifier_never_runs_the_solution_and_scores_0(tmp_path: Path) -> None:
    """The verifier where bwrap cannot be run (as under a backend without bubblewrap): the oracle's solution is
    never run, reward 0, and the output says why; with bwrap the same solution scores 1."""
    task = CODING / "reverse-words"
    app, logs = tmp_path / "app", tmp_path / "logs"
    app.mkdir()
    logs.mkdir()
    solve = _verifier_box(app, logs, task / "solution", without_bwrap=False)
    subprocess.run([*solve, "bash", "/tests/solve.sh"], check=True, timeout=60)
    outcome = {}
    for without_bwrap in (False, True):
        argv = _verifier_box(app, logs, task / "tests", without_bwrap=without_bwrap)
        ran = subprocess.run([*argv, "bash", "/tests/test.sh"], capture_output=True, text=True, timeout=60)
        outcome[without_bwrap] = ((logs / "verifier" / "reward.txt").read_text().strip(), ran.stdout + ran.stderr)
    assert outcome[False][0] == "1", outcome[False][1]
    assert outcome[True][0] == "0", outcome[True][1]
    assert "checker: FAIL: bubblewrap (bwrap) is not installed where the tests run" in outcome[True][1]
