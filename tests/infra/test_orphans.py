"""No orphans: what `leeway run` starts dies with it, even when it is SIGKILLed; `leeway stack up` servers do not.

Unit part: a process tied by the parent-death signal (`die_with_parent`, `tied_to_this_process`) or
by its own watchdog on the parent pid (`watch_parent`) is gone once its parent is SIGKILLed, while an
untied server spawned the same way survives. Integration part: SIGKILL of a real `leeway run` on the
demo, with a private stack (roles and servers go) and on a shared stack (roles go, the servers stay).
Every wait is a bounded poll for the event (a pid printed, a step recorded, a process gone).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.orphans import ORPHAN_GRACE_S, PARENT_GRACE_ENV, PARENT_PID_ENV
from infra.process import is_running, spawn_child, start_ticks
from infra.stack import StackState, load_state, stack_status
from tests.support.runs import children_of as _children_of

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
COMMON = ["stream.max_bytes=67108864", "trainer.queue_wait_timeout_s=120", "trainer.max_steps=1000000"]
"""The demo, bounded for 2 CI cores, with no step limit: the test kills the run itself."""

STARTED_DEADLINE_S = 150.0
"""Generous bound on a run (or a helper process) reaching the state a test waits for."""
GONE_DEADLINE_S = ORPHAN_GRACE_S + 60.0
"""Generous bound on orphans disappearing: a role may take up to `ORPHAN_GRACE_S` before its SIGKILL."""
ORPHAN_ABANDON_DEADLINE_S = 10.0
"""Generous bound on roles whose servers died with them being gone: the watchdog notices within
`ORPHAN_POLL_S` and a refused connect is immediate; a stop that retried the dead servers took 13-21 s."""
POLL_S = 0.1


def _alive(pid: int, ticks: int | None) -> bool:
    """Running, not a zombie, and still the process first seen (`ticks`: its kernel start time)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat[stat.rindex(")") + 2 :].split()[0] in ("Z", "X"):
        return False
    return ticks is None or start_ticks(pid) == ticks


def _wait_gone(processes: dict[int, int | None], what: str, within_s: float = GONE_DEADLINE_S) -> None:
    deadline = time.monotonic() + within_s
    while [pid for pid, ticks in processes.items() if _alive(pid, ticks)]:
        assert time.monotonic() < deadline, f"{what} still running {within_s} s after their parent died: " + str(
            [pid for pid, ticks in processes.items() if _alive(pid, ticks)]
        )
        time.sleep(POLL_S)


def _kill_left(processes: dict[int, int | None]) -> None:
    for pid, ticks in processes.items():
        if _alive(pid, ticks):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def leftovers() -> Iterator[dict[int, int | None]]:
    """Processes a test saw (pid -> start ticks); any still alive at the end is SIGKILLed by pid."""
    seen: dict[int, int | None] = {}
    yield seen
    _kill_left(seen)


def _parent_printing_pids(tmp_path: Path, body: str) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start a Python parent running `body` (which prints one pid per line, then `ready`); return it and the pids."""
    out = tmp_path / "parent.out"
    script = "import os, signal, subprocess, sys, time\n" + body + "print('ready', flush=True)\ntime.sleep(600)\n"
    with open(out, "wb") as handle:
        parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTED_DEADLINE_S
    while "ready" not in out.read_text():
        assert parent.poll() is None, out.read_text()
        assert time.monotonic() < deadline, out.read_text()
        time.sleep(POLL_S)
    return parent, [int(line) for line in out.read_text().split() if line.isdigit()]


SLEEPER = "[sys.executable, '-c', 'import time; time.sleep(600)']"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_tied_server_dies_with_its_parent_and_an_untied_one_survives(
    tmp_path: Path, leftovers: dict[int, int | None]
) -> None:
    """`spawn` inside `tied_to_this_process()` (the private stack of `leeway run`) vs outside (`stack up`)."""
    body = (
        "from pathlib import Path\n"
        "from infra.orphans import tied_to_this_process\n"
        "from infra.process import spawn\n"
        f"with tied_to_this_process():\n"
        f"    tied, _ = spawn('tied', {SLEEPER}, Path({str(tmp_path)!r}) / 'tied.log', ports={{}})\n"
        f"free, _ = spawn('free', {SLEEPER}, Path({str(tmp_path)!r}) / 'free.log', ports={{}})\n"
        "print(tied.pid, flush=True)\n"
        "print(free.pid, flush=True)\n"
    )
    parent, (tied, free) = _parent_printing_pids(tmp_path, body)
    leftovers.update({tied: start_ticks(tied), free: start_ticks(free)})
    parent.kill()
    parent.wait()
    _wait_gone({tied: leftovers[tied]}, "the tied server")
    assert _alive(free, leftovers[free]), "a server spawned outside tied_to_this_process() must outlive its parent"


@pytest.mark.parametrize("ignores_sigterm", [False, True], ids=["stops-on-sigterm", "ignores-sigterm"])
def test_a_role_watching_its_parent_stops_when_the_parent_is_killed(
    tmp_path: Path, leftovers: dict[int, int | None], ignores_sigterm: bool
) -> None:
    """The portable guard (no parent-death signal): SIGTERM to itself, SIGKILL after the grace period."""
    role = (
        "import os, signal, sys, time\n"
        "from infra.orphans import watch_parent\n"
        f"if {ignores_sigterm}:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "watch_parent(int(sys.argv[1]), grace_s=0.5, poll_s=0.05)\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(600)\n"
    )
    body = (  # the parent passes the pid on only once the child says its watchdog runs
        f"child = subprocess.Popen([sys.executable, '-c', {role!r}, str(os.getpid())], start_new_session=True, "
        "stdout=subprocess.PIPE)\n"
        "print(child.stdout.readline().decode().strip(), flush=True)\n"
    )
    parent, (child,) = _parent_printing_pids(tmp_path, body)
    leftovers[child] = start_ticks(child)
    parent.kill()
    parent.wait()
    _wait_gone({child: leftovers[child]}, "the orphaned role")


ABANDONED = "abandoning the clean stop"
"""What an orphan whose servers are all gone logs (`infra.orphans.watch_parent`)."""


@pytest.mark.parametrize("servers", ["die-with-the-parent", "outlive-the-parent"])
def test_an_orphan_whose_servers_died_with_its_parent_abandons_its_stop_at_once(
    tmp_path: Path, leftovers: dict[int, int | None], servers: str
) -> None:
    """The parent's listening socket plays its private stack (closed by the kernel when it dies); one the
    test holds plays a shared stack. The role's clean stop would retry its servers for 600 s: with them
    gone it must say what it abandons and exit without that wait; with them up it stops cleanly."""
    shared = socket.create_server(("127.0.0.1", 0))
    role = (
        "import logging, os, signal, sys, time\n"
        "from infra.orphans import stop_needs_servers, watch_parent\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "def clean_stop(signum, frame):\n"
        "    print('clean stop', file=sys.stderr, flush=True)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, clean_stop if sys.argv[3] == 'up' else signal.SIG_IGN)\n"
        "stop_needs_servers([('127.0.0.1', int(sys.argv[2]))])\n"
        "watch_parent(int(sys.argv[1]), grace_s=600, poll_s=0.05)\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(600)\n"
    )
    body = (
        "import socket\n"
        "private = socket.create_server(('127.0.0.1', 0))\n"  # closed when this parent dies
        f"port = private.getsockname()[1] if {servers == 'die-with-the-parent'} else {shared.getsockname()[1]}\n"
        f"child = subprocess.Popen([sys.executable, '-c', {role!r}, str(os.getpid()), str(port), "
        f"{'down' if servers == 'die-with-the-parent' else 'up'!r}], start_new_session=True, stdout=subprocess.PIPE)\n"
        "print(child.stdout.readline().decode().strip(), flush=True)\n"
    )
    try:
        parent, (child,) = _parent_printing_pids(tmp_path, body)
        leftovers[child] = start_ticks(child)
        parent.kill()
        parent.wait()
        _wait_gone({child: leftovers[child]}, "the orphaned role")
    finally:
        shared.close()
    out = (tmp_path / "parent.out").read_text()
    if servers == "die-with-the-parent":
        assert ABANDONED in out and "exiting now with status 75" in out, out
    else:
        assert "clean stop" in out and ABANDONED not in out, out


# ---------------------------------------------------------------------------------- integration


def _start_run(tmp_path: Path, name: str, *sets: str) -> tuple[subprocess.Popen[bytes], Path]:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "actors.cli", "run", str(DEMO), "--no-live", "--generators", "2"]
    for item in [*COMMON, f"run.dir={run_dir}", f"run.name={name}", *sets]:
        argv += ["--set", item]
    with open(tmp_path / "leeway-run.out", "wb") as log:  # the child keeps its own handle
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, run_dir


def _wait_first_step(proc: subprocess.Popen[bytes], run_dir: Path, seen: dict[int, int | None]) -> None:
    """Until the trainer recorded a step (every role is up and working), collecting `leeway run`'s children."""
    deadline = time.monotonic() + STARTED_DEADLINE_S
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        seen.update(_children_of(proc.pid))
        assert proc.poll() is None, f"leeway run exited with {proc.returncode}: " + _tail(run_dir)
        assert time.monotonic() < deadline, "no step recorded in time: " + _tail(run_dir)
        time.sleep(POLL_S)
    seen.update(_children_of(proc.pid))


def _tail(run_dir: Path) -> str:
    out = []
    for log in [run_dir.parent / "leeway-run.out", *sorted((run_dir / "logs").glob("*.log"))]:
        if log.exists():
            out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(out)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the processes through /proc")
@pytest.mark.timeout(300)
def test_sigkill_of_leeway_run_leaves_no_role_and_no_private_server(
    tmp_path: Path, leftovers: dict[int, int | None]
) -> None:
    """The roles lose their servers with the launcher, so they cannot stop cleanly: each one's watchdog sees
    its servers gone, says what it abandons and exits, well before the SIGKILL after `ORPHAN_GRACE_S`
    (which a stop that kept retrying the dead servers would need)."""
    proc, run_dir = _start_run(tmp_path, "orphans-private", f"nats.stack_dir={tmp_path / 'no-stack-here'}")
    try:
        _wait_first_step(proc, run_dir, leftovers)
        state = load_state(run_dir / "stack")
        assert state is not None and len(state.processes) == 3, "a private stack in <run.dir>/stack"
        assert {p.pid for p in state.processes} <= set(leftovers)
        assert len(leftovers) == 6, f"3 server processes + trainer + 2 generators expected, saw {leftovers}"
    finally:
        proc.kill()  # SIGKILL: no clean-up code of `leeway run` runs
        proc.wait()
    roles = {pid: ticks for pid, ticks in leftovers.items() if pid not in {p.pid for p in state.processes}}
    _wait_gone(roles, "roles of the killed `leeway run`", ORPHAN_ABANDON_DEADLINE_S)
    _wait_gone(leftovers, "children of the killed `leeway run`")
    # the trainer's stop writes a final checkpoint, which cannot finish with its store gone: its watchdog
    # abandons it; a generator with nothing left to hand back may finish its own stop first
    logs = {
        log: (run_dir / "logs" / log).read_text(errors="replace") for log in ("trainer.log", "gen-0.log", "gen-1.log")
    }
    assert ABANDONED in logs["trainer.log"], "the trainer must say that it abandoned its stop: " + _tail(run_dir)
    for index in range(2):
        text = logs[f"gen-{index}.log"]
        assert ABANDONED in text or f"generator gen-{index}: stopped" in text, _tail(run_dir)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the processes through /proc")
@pytest.mark.timeout(300)
def test_sigkill_of_leeway_run_on_a_shared_stack_stops_the_roles_and_leaves_the_servers(
    tmp_path: Path, stack: StackState, leftovers: dict[int, int | None]
) -> None:
    proc, run_dir = _start_run(tmp_path, "orphans-shared", f"nats.stack_dir={stack.dir}")
    try:
        _wait_first_step(proc, run_dir, leftovers)
        assert not (run_dir / "stack").exists(), "the running stack at nats.stack_dir must be used"
        assert len(leftovers) == 3, f"trainer + 2 generators expected, saw {leftovers}"
    finally:
        proc.kill()
        proc.wait()
    _wait_gone(leftovers, "roles of the killed `leeway run`")
    assert all(is_running(p) for p in stack.processes), "the shared stack must outlive `leeway run`"
    status = stack_status(stack.dir)
    assert status["nats"]["healthy"] and status["seaweed"]["healthy"], status


def test_a_watched_child_learns_its_parent_and_the_runs_stop_grace(tmp_path: Path) -> None:
    """`leeway run`, fleet roles and `--nproc` ranks pass the run's stop grace (`run.stop_grace_s`) to the orphan
    watchdog: a trainer left alone keeps its final checkpoint's budget instead of a fixed 20 s."""
    out = tmp_path / "env.txt"
    script = f"import os; open({str(out)!r}, 'w').write(os.environ['{PARENT_PID_ENV}'] + ' ' + os.environ['{PARENT_GRACE_ENV}'])"
    child = spawn_child([sys.executable, "-c", script], watchdog=True, watchdog_grace_s=150)
    assert child.wait(timeout=STARTED_DEADLINE_S) == 0
    assert out.read_text() == f"{os.getpid()} 150.0"
    plain = spawn_child([sys.executable, "-c", f"import os, sys; sys.exit('{PARENT_GRACE_ENV}' in os.environ)"])
    assert plain.wait(timeout=STARTED_DEADLINE_S) == 0  # no watchdog, no grace
