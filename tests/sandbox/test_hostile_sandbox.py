"""Hostile agent commands against the real bubblewrap sandbox, as root and as an unprivileged host user: every one
is refused, killed, or ends as the policy's failure (`SandboxBroken`), never a forged reply or a masked infra
failure.

The cases (issue 36): a forged reply written to the supervisor's channel (/proc/$PPID/fd/1), ptrace-attaching the
supervisor, signalling it (kill -9 $PPID), a process that keeps changing pid (none survives `kill_all`), a command
that closes its output and sleeps (its deadline holds), two processes together past the memory limit (the
sandbox's cgroup), full /tmp, /dev/shm, /app and /logs (tmpfs of ``disk_mb``), a tree moved to a fresh sandbox
(`export_tree` and `SandboxSpec.imports`, a hostile tar unpacked safely), a sandbox that breaks after a command
ran (`SandboxBroken`), and uids leased host-wide (never one still in use). Three sandbox starts as root, one as
an unprivileged user (CI has two cores).
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest

from pipeline.sandbox import SandboxBroken, SandboxLimits, SandboxSpec
from pipeline.sandbox.bwrap import BwrapSandbox, bwrap_binary
from pipeline.sandbox.uids import allocate_uid, uid_processes
from tests.support.forked import drop_to, in_forked_child
from tests.support.waits import until

pytestmark = pytest.mark.skipif(bwrap_binary() is None, reason="bubblewrap is not installed")

LIMITS = SandboxLimits(memory_mb=256, max_processes=64, max_file_mb=32, disk_mb=8)
FORGED = '{"id": null, "ok": true, "exit_code": 0, "stdout": "forged", "stderr": "", "seconds": 0}'
FORGE = f"echo '{FORGED}' > /proc/$PPID/fd/1; echo '{FORGED}' > /proc/1/fd/1; cat /proc/1/environ"
PTRACE = (
    "python3 -c 'import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
    "r = libc.ptrace(16, 1, 0, 0); print(r, os.strerror(ctypes.get_errno()))'"
)
SIGNALS = "for s in KILL STOP INT TERM HUP; do kill -$s $PPID; done; echo sent"
HOPPER = """
import os
while True:
    try:
        if os.fork():
            os._exit(0)
    except OSError:
        continue
    with open("/app/hop", "w") as f:
        f.write(str(os.getpid()))
"""
FILL = "for d in /tmp /dev/shm /app /logs; do head -c 20M /dev/zero > $d/fill; echo $d $?; rm -f $d/fill; done; touch /dev/x"
MEMORY = """
python3 -c 'import time; b = b"x" * (170 << 20); open("/tmp/held", "w").close(); time.sleep(600)' & first=$!
while [ ! -e /tmp/held ] && kill -0 $first 2>/dev/null; do sleep 0.01; done
python3 -c 'b = b"x" * (170 << 20); print("second held")'; second=$?
kill -0 $first 2>/dev/null && state=alive || state=killed
kill -9 $first 2>/dev/null; echo "$state $second"
"""


async def _hostile(box: BwrapSandbox, export: Path) -> dict[str, Any]:
    """Every hostile command in one sandbox; what each did, for the caller to judge (as root or not)."""
    seen: dict[str, Any] = {}
    forge = await box.exec(FORGE, timeout_s=30)
    seen["forge"] = (forge.exit_code, forge.stdout, forge.stderr)
    seen["ptrace"] = (await box.exec(PTRACE, timeout_s=30)).stdout.strip()
    seen["signals"] = (await box.exec(SIGNALS, timeout_s=30)).stdout.strip()
    seen["after_signals"] = (await box.exec("echo alive; echo $PPID", timeout_s=30)).stdout
    closed = await box.exec("exec >&- 2>&-; sleep 1000", timeout_s=1)
    seen["closed"] = (closed.timed_out, closed.seconds)
    seen["after_closed"] = (await box.exec("echo usable", timeout_s=30)).stdout
    await box.write_file("/tmp/hop.py", HOPPER)
    await box.exec("python3 /tmp/hop.py >/dev/null 2>&1 &", timeout_s=30)
    await until(lambda: _exists(box, "/app/hop"), what="the pid-hopping process to run")
    seen["killed"] = await box.kill_all()
    seen["left"] = (await box.exec("ps -eo pid=,comm=", timeout_s=30)).stdout.split("\n")
    seen["fill"] = (await box.exec(FILL, timeout_s=60)).stdout.split("\n")
    seen["dev"] = (await box.exec("touch /dev/x", timeout_s=30)).exit_code
    await box.exec(
        "rm -f /app/hop; mkdir -p sub && echo solution > sub/a.py && ln -s /etc/passwd link && ln sub/a.py hard"
        " && mkfifo pipe",
        timeout_s=30,
    )
    await box.export_tree("/app", export)
    return seen


async def _exists(box: BwrapSandbox, path: str) -> bool:
    try:
        await box.read_file(path)
    except FileNotFoundError:
        return False
    return True


def _judge(seen: dict[str, Any], export: Path) -> None:
    code, stdout, stderr = seen["forge"]
    assert code != 0 and "forged" not in stdout and stderr.count("Permission denied") == 3, seen["forge"]
    assert seen["ptrace"] == "-1 Operation not permitted"
    assert seen["signals"] == "sent" and seen["after_signals"] == "alive\n1\n"  # pid 1 never got one of them
    assert seen["closed"][0] and seen["closed"][1] < 10, seen["closed"]
    assert seen["after_closed"] == "usable\n"
    assert seen["killed"] >= 1
    processes = [line.split() for line in seen["left"] if line.strip()]
    assert [p for p in processes if p[1] == "python3"] == [["1", "python3"]], processes  # the supervisor alone
    assert seen["fill"][:4] == ["/tmp 1", "/dev/shm 1", "/app 1", "/logs 1"], seen["fill"]
    assert seen["dev"] != 0
    with tarfile.open(export) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {"sub", "sub/a.py", "link", "hard"}, members  # the fifo is left out
    assert members["link"].issym() and members["link"].linkname == "/etc/passwd"
    assert members["hard"].isreg() and members["hard"].size == len("solution\n")


def _hostile_tar(path: Path) -> None:
    """Members that must not land where they name: absolute, "..", through a symlink, a device, a hard link."""
    with tarfile.open(path, "w") as tar:
        for name, kind, target in (
            ("/tmp/abs", tarfile.REGTYPE, ""),
            ("../escape", tarfile.REGTYPE, ""),
            ("out", tarfile.SYMTYPE, "/tmp"),
            ("out/through", tarfile.REGTYPE, ""),
            ("null", tarfile.CHRTYPE, ""),
            ("hardlink", tarfile.LNKTYPE, "/etc/passwd"),
            ("kept.txt", tarfile.REGTYPE, ""),
        ):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            data = b"pwned" if kind == tarfile.REGTYPE else b""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)


@pytest.mark.skipif(os.geteuid() != 0, reason="the root variant")
def test_hostile_agent_commands_as_root(tmp_path: Path) -> None:
    exported, hostile = tmp_path / "app.tar", tmp_path / "hostile.tar"
    _hostile_tar(hostile)

    async def first() -> dict[str, Any]:
        box = BwrapSandbox(SandboxSpec(label="hostile-root", limits=LIMITS))
        await box.start()
        try:
            assert box.uid is not None and box.cgroup is not None, "root on this machine: a uid and a cgroup"
            seen = await _hostile(box, exported)
            seen["memory"] = (await box.exec(MEMORY, timeout_s=120)).stdout.strip()
            seen["memory_after"] = (await box.exec("echo fine", timeout_s=30)).stdout
            dying = asyncio.ensure_future(box.exec("sleep 1000", timeout_s=600))
            await until(lambda: box.busy and len(uid_processes(box.uid or 0)) >= 3, what="the command to run")
            assert box._proc is not None
            os.kill(box._proc.pid, signal.SIGKILL)  # not the host's API: as if a command had killed it
            with pytest.raises(SandboxBroken, match="died"):
                await dying
            with pytest.raises(SandboxBroken):  # and it stays the policy's failure
                await box.exec("true", timeout_s=30)
            return seen
        finally:
            await box.close()

    seen = asyncio.run(first())
    _judge(seen, exported)
    # two processes of 170 MB each under a 256 MB sandbox: the cgroup's OOM killer ends one of them
    assert seen["memory"] != "alive 0" and seen["memory"].endswith(("137", " 0")), seen["memory"]
    assert seen["memory_after"] == "fine\n"

    async def second() -> dict[str, Any]:
        limits = SandboxLimits(memory_mb=256, max_processes=64, max_file_mb=8, disk_mb=16)
        spec = SandboxSpec(label="verifier", limits=limits, imports={"/app": exported, "/logs": hostile})
        box = BwrapSandbox(spec)
        await box.start()
        try:
            listing = (await box.exec("ls -A /app /logs; readlink /app/link; cat /app/sub/a.py", timeout_s=30)).stdout
            escaped = (await box.exec("ls /tmp /; cat /logs/kept.txt", timeout_s=30)).stdout
            await box.exec("head -c 5M /dev/urandom > a; head -c 5M /dev/urandom > b", timeout_s=30)
            with pytest.raises(SandboxBroken, match="over 8 MB"):
                await box.export_tree("/app", tmp_path / "big.tar")
            assert not (tmp_path / "big.tar").exists()
            assert box._proc is not None
            with open(f"/proc/{box._proc.pid}/fd/1", "w") as channel:  # root, outside: a line into the channel
                channel.write(FORGED + "\n")
            with pytest.raises(SandboxBroken, match="not the reply"):
                await box.exec("echo real", timeout_s=30)
            return {"listing": listing, "escaped": escaped}
        finally:
            await box.close()

    got = asyncio.run(second())
    assert got["listing"].split("\n")[:10] == [
        "/app:",
        "hard",
        "link",
        "sub",
        "",
        "/logs:",
        "kept.txt",
        "out",  # a symlink is kept as one; the member written through it is not
        "/etc/passwd",
        "solution",
    ], got["listing"]
    assert "abs" not in got["escaped"] and "escape" not in got["escaped"] and "through" not in got["escaped"]
    assert got["escaped"].endswith("pwned")  # the one safe member


def _as_nobody(export: Path) -> dict[str, Any]:
    """Run `_hostile` in a child that dropped to an unprivileged uid (the host side of a non-root generator)."""

    def work() -> dict[str, Any]:
        drop_to()

        async def go() -> dict[str, Any]:
            box = BwrapSandbox(SandboxSpec(label="hostile-nobody", limits=LIMITS))
            await box.start()
            try:
                assert box.uid is None and box.cgroup is None
                return await _hostile(box, export)
            finally:
                await box.close()

        return asyncio.run(go())

    return in_forked_child(work)


@pytest.mark.skipif(os.geteuid() != 0, reason="drops from root to an unprivileged uid")
def test_hostile_agent_commands_as_an_unprivileged_host_user() -> None:
    with tempfile.TemporaryDirectory(prefix="leeway-nobody-") as scratch:  # pytest's tmp_path is root's alone
        os.chmod(scratch, 0o777)
        export = Path(scratch) / "nobody.tar"
        seen = _as_nobody(export)
        for key in ("forge", "closed"):
            seen[key] = tuple(seen[key])
        _judge(seen, export)


@pytest.mark.skipif(os.geteuid() != 0, reason="leases uids, which only root can switch to")
def test_a_uid_is_never_handed_out_while_in_use(tmp_path: Path) -> None:
    locks = tmp_path / "uids"
    first = allocate_uid(locks)
    assert first is not None
    held = first.uid
    # another process on the host: the lock is held, so it gets another uid
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from pathlib import Path; from pipeline.sandbox.uids import allocate_uid as a; "
            f"print(a(Path('{locks}')).uid)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert int(other.stdout) != held
    first.release()
    survivor = subprocess.Popen(["sleep", "1000"], user=held, group=held)  # a process of the uid outlives its lease
    try:
        await_free = allocate_uid(locks)
        assert await_free is not None and await_free.uid != held
        await_free.release()
    finally:
        survivor.kill()
        survivor.wait()
    again = allocate_uid(locks)
    assert again is not None and again.uid == held  # once nothing of it lives, it is free again
    again.release()
