"""The bubblewrap sandbox, for real: state lasts across execs, a failed command is told from a dead sandbox, and
model-written code gets out nowhere. Each escape attempt fails and comes back as a result, not a crash: writing
outside the work directory, connecting to the run's NATS or S3 port on 127.0.0.1, reading the stack's
credentials or the generator's environment, a fork bomb, a memory hog, an endless loop, and a process left
running after the episode (or after the generator is killed with SIGKILL)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from infra.stack import StackState
from pipeline.sandbox import ExecResult, SandboxLimits, SandboxLost, SandboxSpec
from pipeline.sandbox.bwrap import BwrapSandbox
from pipeline.sandbox.supervised import uid_processes

REPO = Path(__file__).resolve().parents[2]
GONE_DEADLINE_S = 120.0
"""How long a test waits for the kernel to take a killed sandbox's processes away (it is normally instant)."""


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def _sandbox(**spec: object) -> BwrapSandbox:
    box = BwrapSandbox(SandboxSpec(label="test", **spec))  # type: ignore[arg-type]
    await box.start()
    return box


def _wait_gone(uid: int) -> list[int]:
    deadline = time.monotonic() + GONE_DEADLINE_S
    while (left := uid_processes(uid)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


def test_files_and_background_processes_last_across_execs_and_a_failed_command_is_a_result() -> None:
    async def go() -> None:
        box = await _sandbox()
        try:
            assert (await box.exec("echo hello > note.txt && pwd", timeout_s=30)).stdout == "/app\n"
            started = await box.exec("sleep 1000 & echo $!", timeout_s=30)  # returns while the job holds the pipe
            assert started.ok
            job = started.stdout.strip()
            later = await box.exec(f"cat note.txt; kill -0 {job} && echo alive", timeout_s=30)
            assert later.stdout == "hello\nalive\n"
            failed = await box.exec("echo oops >&2; exit 3", timeout_s=30)
            assert (failed.exit_code, failed.stderr, failed.ok) == (3, "oops\n", False)
            slow = await box.exec("sleep 1000", timeout_s=0.5)
            assert slow.timed_out and not slow.ok
            await box.write_file("/app/sub/solution.py", "print(6 * 7)\n")
            assert (await box.exec("python3 sub/solution.py", timeout_s=30)).stdout == "42\n"
            assert await box.read_file("/app/note.txt") == b"hello\n"
            with pytest.raises(FileNotFoundError):
                await box.read_file("/app/missing.txt")
            assert box.alive
        finally:
            await box.close()

    _run(go())


def test_a_dead_sandbox_is_sandbox_lost_not_a_failed_command() -> None:
    """Killed by the host, or dead before a command ran: `SandboxLost` (infra). Dead after a command ran is the
    policy's (`SandboxBroken`): tests/sandbox/test_hostile_sandbox.py."""

    async def go() -> None:
        box = await _sandbox()
        try:
            assert box.uid is not None  # the tests run as root: each sandbox has a uid of its own
            await box.kill("killed by the test")
            with pytest.raises(SandboxLost, match="killed by the test"):
                await box.exec("true", timeout_s=30)
            assert not box.alive
        finally:
            await box.close()
        other = await _sandbox()
        try:  # its supervisor dies before any command of the policy ran: nothing the policy did, so infra
            assert other._proc is not None and other.uid is not None
            os.killpg(other._proc.pid, signal.SIGKILL)  # bwrap's outer process: the supervisor follows it
            assert _wait_gone(other.uid) == []
            with pytest.raises(SandboxLost, match="died"):
                await other.write_file("/app/task.txt", "the task")
        finally:
            await other.close()

    _run(go())


def test_writing_outside_the_work_directory_fails_and_touches_nothing(tmp_path: Path) -> None:
    outside = tmp_path / "host-file"
    outside.write_text("host")
    targets = ["/usr/x", "/etc/passwd", "/x", str(outside), str(REPO / "pwned"), "/proc/sys/kernel/hostname"]

    async def go() -> list[tuple[str, int]]:
        box = await _sandbox()
        try:
            results = []
            for target in targets:
                r = await box.exec(f"echo pwned > {target}", timeout_s=30)
                results.append((target, r.exit_code))
            return results
        finally:
            await box.close()

    for target, code in _run(go()):
        assert code != 0, target
    assert outside.read_text() == "host" and not (REPO / "pwned").exists()
    assert "pwned" not in Path("/etc/passwd").read_text()


def test_the_runs_nats_and_s3_ports_on_loopback_are_unreachable(stack: StackState) -> None:
    ports = [urlparse(stack.nats_endpoint).port, urlparse(stack.s3_endpoint).port]
    probe = (
        "import socket, sys\n"
        "for port in map(int, sys.argv[1:]):\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', port), timeout=5).close()\n"
        "        print(port, 'connected')\n"
        "    except OSError as exc:\n"
        "        print(port, 'refused', type(exc).__name__)\n"
    )

    async def go() -> str:
        box = await _sandbox()
        try:
            await box.write_file("/tmp/probe.py", probe)
            return (await box.exec(f"python3 /tmp/probe.py {ports[0]} {ports[1]}", timeout_s=60)).stdout
        finally:
            await box.close()

    out = _run(go())
    assert "connected" not in out and out.count("refused") == 2, out
    # the same probe from the host does connect: the ports are live, the sandbox is what cuts them off
    host = subprocess.run([sys.executable, "-c", probe, *map(str, ports)], capture_output=True, text=True, timeout=60)
    assert host.stdout.count("connected") == 2, host.stdout


def test_the_stacks_credentials_and_the_generators_environment_are_out_of_view(
    stack: StackState, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "leeway-test-secret-0f3c"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("LEEWAY_NATS_TOKEN", secret)
    credentials = Path(stack.dir) / "credentials.json"
    assert credentials.is_file()

    async def go() -> tuple[str, int, str]:
        box = await _sandbox()
        try:
            env = (await box.exec("env", timeout_s=30)).stdout
            read = await box.exec(f"cat {credentials}", timeout_s=30)
            listing = (await box.exec(f"ls {REPO} {Path.home()} 2>&1; ls / ", timeout_s=30)).stdout
            return env, read.exit_code, listing
        finally:
            await box.close()

    env, code, listing = _run(go())
    assert secret not in env and "AWS_" not in env and "NATS" not in env
    assert code != 0
    assert "pyproject.toml" not in listing and "work" not in listing.split()


def test_a_fork_bomb_stops_at_the_process_limit_and_the_sandbox_still_answers() -> None:
    peak = 0
    bombing = threading.Event()

    def watch(uid: int) -> None:  # the sandbox's process count, sampled for as long as the bomb runs
        nonlocal peak
        while not bombing.is_set():
            peak = max(peak, len(uid_processes(uid)))

    async def go() -> tuple[ExecResult, ExecResult]:
        box = await _sandbox(limits=SandboxLimits(max_processes=32))
        assert box.uid is not None
        watcher = threading.Thread(target=watch, args=(box.uid,))
        watcher.start()
        try:
            bomb = await box.exec("bomb() { bomb | bomb & }; bomb; sleep 2; echo done", timeout_s=5)
            after = await box.exec("echo still here", timeout_s=30)
            return bomb, after
        finally:
            bombing.set()
            watcher.join()
            await box.close()

    bomb, after = _run(go())
    assert 10 < peak <= 32 + 2, peak  # it did fork, up to its limit (plus bwrap's own two, outside the limit)
    assert bomb.exit_code in (0, 126) or bomb.timed_out
    # the sandbox answers: the command runs, or, while the bomb still holds every slot, fails as a command
    assert after.stdout == "still here\n" or (
        after.exit_code == 126 and "Resource temporarily unavailable" in after.stderr
    ), after


def test_a_memory_hog_fails_inside_and_an_endless_loop_times_out() -> None:
    async def go() -> tuple[int, str, bool, str]:
        box = await _sandbox(limits=SandboxLimits(memory_mb=256))
        try:
            hog = await box.exec("python3 -c 'x = bytearray(1 << 30); print(len(x))'", timeout_s=60)
            loop = await box.exec("while :; do :; done", timeout_s=1)
            after = await box.exec("echo fine", timeout_s=30)
            return hog.exit_code, hog.stderr, loop.timed_out, after.stdout
        finally:
            await box.close()

    code, stderr, timed_out, after = _run(go())
    assert code != 0 and "MemoryError" in stderr
    assert timed_out and after == "fine\n"


def test_nothing_of_a_sandbox_survives_its_close() -> None:
    async def go() -> tuple[int, list[Path]]:
        box = await _sandbox()
        await box.exec("nohup sleep 1000 >/dev/null 2>&1 & setsid sleep 1001 & disown", timeout_s=30)
        assert box.uid is not None and len(uid_processes(box.uid)) >= 3
        assert box.root is None  # its directories are tmpfs inside it: nothing of it on the host's disk
        dirs = [] if box.cgroup is None else list(box.cgroup.dirs)
        assert all(d.is_dir() for d in dirs)
        await box.close()
        return box.uid, dirs

    uid, cgroup_dirs = _run(go())
    assert uid_processes(uid) == [] and not any(d.exists() for d in cgroup_dirs)


KILLED_OWNER = """
import asyncio, json, sys
from pipeline.sandbox import SandboxSpec
from pipeline.sandbox.bwrap import BwrapSandbox
async def main():
    box = BwrapSandbox(SandboxSpec(label="orphan"))
    await box.start()
    await box.exec("sleep 1000 & setsid sleep 1001 &", timeout_s=30)
    print(json.dumps({"uid": box.uid}), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def test_a_generator_killed_with_sigkill_leaves_no_sandbox_process_behind() -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", KILLED_OWNER], cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert owner.stdout is not None
        uid = json.loads(owner.stdout.readline())["uid"]
        assert len(uid_processes(uid)) >= 3
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=60)
        assert _wait_gone(uid) == []
    finally:
        if owner.poll() is None:
            owner.kill()


FORKING_OWNER = """
import os, signal, subprocess, sys
from pipeline.sandbox.supervised import _enter
enter = _enter(None, 65534 if os.geteuid() == 0 else None)  # root: the child also changes uid, as a sandbox does
owner, pid_file, die_at_fork = os.getpid(), sys.argv[1], sys.argv[2] == "fork"
def preexec():
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    if die_at_fork:  # the owner is SIGKILLed between this fork and the exec
        os.kill(owner, signal.SIGKILL)
        while os.getppid() == owner:
            pass
    enter()
child = subprocess.Popen(["sleep", "1000"], preexec_fn=preexec, start_new_session=True)
print(child.pid, flush=True)
signal.pause()
"""


def _process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return state[state.rindex(")") + 2] in "ZX"


@pytest.mark.parametrize("when", ["fork", "running"])
def test_a_sandbox_process_dies_with_its_owner_killed_at_its_fork_or_while_it_runs(tmp_path: Path, when: str) -> None:
    """The window bwrap's --die-with-parent leaves (an owner killed before bwrap runs), and the death signal kept
    through the uid change of a root host's sandbox."""
    pid_file = tmp_path / "child.pid"
    owner = subprocess.Popen(
        [sys.executable, "-c", FORKING_OWNER, str(pid_file), when],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert owner.stdout is not None
    if when == "running":
        assert int(owner.stdout.readline()) > 0
        owner.send_signal(signal.SIGKILL)
    assert owner.wait(timeout=60) == -signal.SIGKILL
    child = int(pid_file.read_text())
    deadline = time.monotonic() + GONE_DEADLINE_S
    while not _process_gone(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _process_gone(child), f"the sandbox's first process {child} outlived its owner"
