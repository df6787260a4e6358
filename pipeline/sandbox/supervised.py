"""The host side of a sandbox whose commands a supervisor process inside it runs (`pipeline/sandbox/supervisor.py`):
starting it, one request at a time over its stdin and stdout, telling a dead sandbox from a failed command, and a
teardown that returns only once nothing of the sandbox is left.

A backend (`pipeline/sandbox/bwrap.py`, `pipeline/sandbox/local.py`) says how the supervisor is started (the argv,
and which host directories the sandbox's paths are); everything else is here.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from pipeline.sandbox.base import (
    ExecResult,
    SandboxLost,
    SandboxSpec,
    SandboxStartFailed,
    SandboxStartTimeout,
)

log = logging.getLogger(__name__)

SUPERVISOR_SOURCE = Path(__file__).with_name("supervisor.py").read_text()
BOOTSTRAP = "import sys, json; exec(json.loads(sys.stdin.readline()))"
"""What the sandbox's python3 runs: the supervisor's source arrives as the first line on its stdin."""
REPLY_MARGIN_S = 10.0
"""How much longer than a command's own timeout its reply may take before the sandbox counts as unresponsive."""
MAX_LINE = 64 << 20
"""The longest reply line read from a supervisor (a file of 16 MiB, base64-encoded, fits)."""
TEARDOWN_S = 30.0
"""How long `close` waits for the sandbox's processes to be gone before it logs them as left behind."""
UID_BASE = 200_000
"""Sandboxes of a root generator run as uids from here (one per sandbox at a time), so the process limit is theirs."""
_slots = itertools.count()


def sandbox_uid() -> int | None:
    """A uid of its own for the next sandbox when this process may switch to one (root), else None."""
    if os.geteuid() != 0:
        return None
    return UID_BASE + (os.getpid() % 1000) * 100 + next(_slots) % 100


class SupervisedSandbox:
    """A sandbox run by a supervisor process; `_argv` (and `_host_path`) come from the backend."""

    backend = "base"

    def __init__(self, spec: SandboxSpec, *, start_timeout_s: float = 60.0, base_dir: Path | None = None) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self._base_dir = base_dir
        self.root: Path | None = None
        """The host directory holding the sandbox's private writable directories."""
        self.uid = sandbox_uid()
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._lost: str | None = None
        self.last_used = time.monotonic()
        self.started_s: float | None = None
        """Seconds from `start` to the supervisor's first word."""

    # ---------------------------------------------------------------- backend

    def _argv(self, supervisor: list[str]) -> list[str]:
        raise NotImplementedError

    def _cwd(self) -> str | None:
        return None

    # ---------------------------------------------------------------- lifecycle

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and self._lost is None

    @property
    def busy(self) -> bool:
        """A request is in flight (a long command is not idleness)."""
        return self._lock.locked()

    async def start(self) -> None:
        started = time.monotonic()
        self.root = Path(tempfile.mkdtemp(prefix="leeway-sandbox-", dir=self._base_dir))
        if self.uid is not None:
            self.root.chmod(0o711)  # its uid may pass through to its own directories, and list nothing
        for name in ("tmp", *(p.strip("/").replace("/", "_") for p in self.spec.writable)):
            (self.root / name).mkdir(mode=0o700, exist_ok=True)
            if self.uid is not None:
                os.chown(self.root / name, self.uid, self.uid)
        limits = json.dumps(asdict(self.spec.limits))
        argv = self._argv(["python3", "-I", "-S", "-c", BOOTSTRAP, limits])
        ids = {} if self.uid is None else {"user": self.uid, "group": self.uid, "extra_groups": []}
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self._cwd(),
                env=self._env(),
                start_new_session=True,
                limit=MAX_LINE,
                **ids,
            )
        except OSError as exc:
            await self.close()
            raise SandboxStartFailed(f"{self.backend} sandbox {self.spec.label}: cannot start: {exc}") from exc
        assert self._proc.stdout is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write((json.dumps(SUPERVISOR_SOURCE) + "\n").encode())
            await self._proc.stdin.drain()
            ready = await asyncio.wait_for(self._proc.stdout.readline(), timeout=self.start_timeout_s)
        except ConnectionError:
            ready = b""
        except asyncio.TimeoutError:
            await self.close()
            raise SandboxStartTimeout(
                f"{self.backend} sandbox {self.spec.label}: not up within {self.start_timeout_s:g} s"
            ) from None
        if not ready:
            why = await self._stderr()
            await self.close()
            raise SandboxStartFailed(f"{self.backend} sandbox {self.spec.label}: it exited at start: {why}")
        self.started_s = time.monotonic() - started
        self.last_used = time.monotonic()

    def _env(self) -> dict[str, str]:
        """The supervisor's environment: nothing of the generator's (no S3 or NATS credentials), a PATH and a home."""
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            **self.spec.env,
        }

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if self._lost is None:
            self._lost = "closed"
        if proc is not None and proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc is not None:
            await proc.wait()
        if self.uid is not None:
            await asyncio.to_thread(_wait_uid_gone, self.uid, TEARDOWN_S, self.spec.label)
        if self.root is not None:
            await asyncio.to_thread(shutil.rmtree, self.root, True)
            self.root = None

    async def kill(self, why: str) -> None:
        """End it from outside (the idle reaper, a test): the next request raises `SandboxLost` with ``why``."""
        self._lost = why
        if self._proc is not None and self._proc.returncode is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ---------------------------------------------------------------- requests

    async def exec(
        self,
        command: str,
        *,
        timeout_s: float,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output: int = 65536,
    ) -> ExecResult:
        reply = await self._request(
            {
                "op": "exec",
                "command": command,
                "timeout_s": timeout_s,
                "cwd": cwd or self.spec.workdir,
                "env": dict(env or {}),
                "max_output": max_output,
            },
            timeout_s,
        )
        if not reply.get("ok"):
            raise SandboxLost(f"{self.backend} sandbox {self.spec.label}: exec refused: {reply.get('error')}")
        return ExecResult(
            exit_code=int(reply["exit_code"]),
            stdout=reply["stdout"],
            stderr=reply["stderr"],
            timed_out=bool(reply["timed_out"]),
            truncated=bool(reply["truncated"]),
            seconds=float(reply["seconds"]),
        )

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        raw = data.encode() if isinstance(data, str) else data
        reply = await self._request({"op": "write", "path": path, "data": base64.b64encode(raw).decode(), "mode": mode})
        if not reply.get("ok"):
            raise OSError(f"sandbox {self.spec.label}: cannot write {path}: {reply.get('error')}")

    async def read_file(self, path: str, *, max_bytes: int = 1 << 24) -> bytes:
        reply = await self._request({"op": "read", "path": path, "max_bytes": max_bytes})
        if not reply.get("ok"):
            error = str(reply.get("error"))
            if error.startswith(("FileNotFoundError", "IsADirectoryError", "NotADirectoryError")):
                raise FileNotFoundError(f"sandbox {self.spec.label}: {path}: {error}")
            raise OSError(f"sandbox {self.spec.label}: cannot read {path}: {error}")
        return base64.b64decode(reply["data"])

    async def kill_processes(self) -> int:
        """Kill every process inside but the supervisor (background jobs, a tmux server); how many there were."""
        reply = await self._request({"op": "killall"})
        return int(reply.get("killed", 0))  # type: ignore[call-overload]

    async def _request(self, request: dict[str, object], timeout_s: float = 0.0) -> dict[str, object]:
        async with self._lock:
            proc = self._proc
            if proc is None or proc.returncode is not None or self._lost is not None:
                raise SandboxLost(f"{self.backend} sandbox {self.spec.label}: {self._lost or 'it is not running'}")
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write((json.dumps(request) + "\n").encode())
                await proc.stdin.drain()
                line = await asyncio.wait_for(proc.stdout.readline(), timeout=timeout_s + REPLY_MARGIN_S)
            except asyncio.TimeoutError:
                await self.kill("it stopped answering")
                raise SandboxLost(f"{self.backend} sandbox {self.spec.label}: it stopped answering") from None
            except (ConnectionError, ValueError) as exc:  # a broken pipe, or a reply line past MAX_LINE
                await self.kill(f"its supervisor failed: {exc}")
                raise SandboxLost(f"{self.backend} sandbox {self.spec.label}: {exc}") from exc
            self.last_used = time.monotonic()
            if not line:
                why = self._lost or f"it died (exit {await proc.wait()}): {await self._stderr()}"
                self._lost = why
                raise SandboxLost(f"{self.backend} sandbox {self.spec.label}: {why}")
            return json.loads(line)

    async def _stderr(self) -> str:
        if self._proc is None or self._proc.stderr is None:
            return ""
        try:
            data = await asyncio.wait_for(self._proc.stderr.read(4096), timeout=5.0)
        except asyncio.TimeoutError:
            return ""
        return data.decode(errors="replace").strip()


def uid_processes(uid: int) -> list[int]:
    """The live processes of `uid` (zombies, dead and waiting for a parent to reap them, are not counted)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # it ended while we looked
            continue
        if int(fields.get("Uid", "-1 0").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            pids.append(int(entry))
    return pids


def _wait_uid_gone(uid: int, timeout_s: float, label: str) -> None:
    """Kill what is left of a sandbox's uid and wait until the kernel has reaped it all."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = uid_processes(uid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            log.error("sandbox %s: processes %s of uid %d are still there after %g s", label, left, uid, timeout_s)
            return
        time.sleep(0.01)
