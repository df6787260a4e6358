"""The host side of a sandbox whose commands a supervisor process inside it runs (`pipeline/sandbox/supervisor.py`):
starting it, one request at a time over its stdin and stdout, telling a dead sandbox from a failed command and
the host's doing from the policy's, and a teardown that returns only once nothing of the sandbox is left.

Every request carries a fresh random id that its reply must echo. A reply that does not, a line that is not
JSON, a supervisor that dies or stops answering: the host did not cause it (it did not close, kill or reap the
sandbox), so once a command of the policy has run in it that is `SandboxBroken`, the policy's failure; before, it
is `SandboxLost` (infra). A sandbox gets a uid of its own when the host is root (`pipeline/sandbox/uids.py`) and a
cgroup of its own where one is writable (`pipeline/sandbox/cgroups.py`), both released at `close`.

A backend (`pipeline/sandbox/bwrap.py`, `pipeline/sandbox/local.py`) says how the supervisor is started (the argv,
the scope of its killall, and which host paths the sandbox's paths are); everything else is here.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import BinaryIO

from infra.orphans import die_with_parent
from pipeline.sandbox import cgroups
from pipeline.sandbox.base import (
    ExecResult,
    SandboxBroken,
    SandboxLost,
    SandboxSpec,
    SandboxStartFailed,
    SandboxStartTimeout,
)
from pipeline.sandbox.uids import UID_BASE, UidLease, allocate_uid, uid_processes

__all__ = ["UID_BASE", "SupervisedSandbox", "uid_processes"]

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
KILL_S = 30.0
"""How long a killall may take (the supervisor gives up after 10 s) before the sandbox counts as unresponsive."""
TREE_S = 300.0
"""How long an export or an import of a tree may take."""
CHUNK = 1 << 20
RLIMITS = ("memory_mb", "max_processes", "max_file_mb", "max_open_files", "cpu_time_s")


class SupervisedSandbox:
    """A sandbox run by a supervisor process; `_argv`, `_scope` (and `_path`, `_cwd`) come from the backend."""

    backend = "base"

    def __init__(self, spec: SandboxSpec, *, start_timeout_s: float = 60.0, base_dir: Path | None = None) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self._base_dir = base_dir
        self.root: Path | None = None
        """The host directory holding the sandbox's private directories (the local backend's; bwrap's are tmpfs)."""
        self.uid: int | None = None
        """The uid its processes run as (a root host), leased at `start` and released at `close`."""
        self.cgroup: cgroups.Cgroup | None = None
        """Its cgroup where one is writable: memory, processes and CPU are then the whole sandbox's."""
        self._lease: UidLease | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._lost: str | None = None
        """Why the host ended it (closed, killed, reaped): its next request is `SandboxLost`."""
        self._broken: str | None = None
        """Why it broke once the policy's commands had run: its next request is `SandboxBroken`."""
        self._ran = False
        self.last_used = time.monotonic()
        self.started_s: float | None = None
        """Seconds from `start` to the supervisor's first word."""

    # ---------------------------------------------------------------- backend

    def _argv(self, supervisor: list[str]) -> list[str]:
        raise NotImplementedError

    def _scope(self) -> str:
        """What the supervisor's killall may take as the whole sandbox (`pipeline/sandbox/supervisor.py`)."""
        return "uid" if self.uid is not None else "tree"

    def _cwd(self) -> str | None:
        return None

    def _path(self, path: str) -> str:
        """A sandbox path as the supervisor names it."""
        return path

    def _private_dirs(self) -> tuple[str, ...]:
        """Sandbox directories made on the host under `root` (none: the backend mounts its own)."""
        return ()

    # ---------------------------------------------------------------- lifecycle

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and self._lost is None and not self._broken

    @property
    def busy(self) -> bool:
        """A request is in flight (a long command is not idleness)."""
        return self._lock.locked()

    async def start(self) -> None:
        started = time.monotonic()
        for inside in self.spec.imports:
            if inside not in self.spec.writable:
                raise ValueError(f"SandboxSpec.imports: {inside} is not one of its writable directories")
        try:
            self._lease = allocate_uid()
            self.uid = None if self._lease is None else self._lease.uid
            self.cgroup = await asyncio.to_thread(cgroups.create, self.spec.limits)
            self._make_root()
        except OSError as exc:
            await self.close()
            raise SandboxStartFailed(f"{self.backend} sandbox {self.spec.label}: cannot prepare it: {exc}") from exc
        await self._spawn()
        assert self._proc is not None and self._proc.stdout is not None and self._proc.stdin is not None
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
        for inside, tar in self.spec.imports.items():
            await self._import(inside, tar)
        self.started_s = time.monotonic() - started
        self.last_used = time.monotonic()

    def _make_root(self) -> None:
        if not self._private_dirs():
            return
        self.root = Path(tempfile.mkdtemp(prefix="leeway-sandbox-", dir=self._base_dir))
        if self.uid is not None:
            self.root.chmod(0o711)  # its uid may pass through to its own directories, and list nothing
        for name in self._private_dirs():
            (self.root / name).mkdir(mode=0o700, exist_ok=True)
            if self.uid is not None:
                os.chown(self.root / name, self.uid, self.uid)

    async def _spawn(self) -> None:
        limits = {k: v for k, v in asdict(self.spec.limits).items() if k in RLIMITS}
        config = json.dumps({"limits": limits, "scope": self._scope()})
        argv = self._argv(["python3", "-I", "-S", "-c", BOOTSTRAP, config])
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
                **self._identity(),
            )
        except OSError as exc:
            await self.close()
            raise SandboxStartFailed(f"{self.backend} sandbox {self.spec.label}: cannot start: {exc}") from exc

    def _identity(self) -> dict[str, object]:
        """How its first process becomes the sandbox's: into its cgroup (before it execs, so nothing of the
        sandbox ever runs outside it), its uid, and tied to the generator (see `_enter`)."""
        return {"preexec_fn": _enter(self.cgroup, self.uid)}

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
            _killpg(proc.pid)
        if proc is not None:
            await proc.wait()
        gone = True
        if self.uid is not None:
            gone = await asyncio.to_thread(_wait_uid_gone, self.uid, TEARDOWN_S, self.spec.label)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
            self.cgroup = None
        if self._lease is not None:
            self._lease.release(gone=gone)
            self._lease = None
        if self.root is not None:
            await asyncio.to_thread(shutil.rmtree, self.root, True)
            self.root = None

    async def kill(self, why: str) -> None:
        """End it from outside (the idle reaper, a test): the next request raises `SandboxLost` with ``why``."""
        self._lost = why
        if self._proc is not None and self._proc.returncode is None:
            _killpg(self._proc.pid)

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
        request = {
            "op": "exec",
            "command": command,
            "timeout_s": timeout_s,
            "cwd": cwd or self.spec.workdir,
            "env": dict(env or {}),
            "max_output": max_output,
        }
        reply = await self._request(request, timeout_s)
        if not reply.get("ok"):
            raise SandboxLost(f"{self.backend} sandbox {self.spec.label}: exec refused: {reply.get('error')}")
        try:
            return ExecResult(
                exit_code=int(reply["exit_code"]),
                stdout=str(reply["stdout"]),
                stderr=str(reply["stderr"]),
                timed_out=bool(reply["timed_out"]),
                truncated=bool(reply["truncated"]),
                seconds=float(reply["seconds"]),  # type: ignore[arg-type]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise self._failure(f"a malformed exec reply: {exc!r}") from None

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
        return base64.b64decode(str(reply["data"]))

    async def kill_all(self) -> int:
        """Kill every process of the sandbox but its supervisor, as a group (`pipeline/sandbox/supervisor.py`
        `_killall`: ``kill(-1)`` from the PID namespace's init, repeated until /proc shows only it), and return once
        they are gone: nothing the agent left running (a process that keeps changing pid included) can touch a
        file after this. How many processes there were."""
        reply = await self._request({"op": "killall"}, KILL_S)
        if not reply.get("ok"):
            raise SandboxLost(f"{self.backend} sandbox {self.spec.label}: killall failed: {reply.get('error')}")
        return int(reply.get("killed", 0))  # type: ignore[call-overload]

    async def export_tree(self, path: str, dest: Path) -> None:
        """Kill every process of the sandbox (as `kill_all`), then have the supervisor write the tree at sandbox
        directory ``path`` as a tar, which lands in host file ``dest``: regular files, directories and symlinks
        (stored as links, never followed), nothing else. Larger than the sandbox's file-size limit
        (``max_file_mb``) is the policy's doing: `SandboxBroken`. `SandboxSpec.imports` takes the file back."""
        limit = self.spec.limits.max_file_mb << 20
        with open(dest, "wb") as sink:
            try:
                reply = await self._request(
                    {"op": "export", "path": self._path(path), "max_bytes": limit}, TREE_S, download=(sink, limit)
                )
            except BaseException:
                dest.unlink(missing_ok=True)
                raise
        if reply.get("ok"):
            return
        dest.unlink(missing_ok=True)
        error = str(reply.get("error"))
        if error.startswith("TooBig"):
            raise SandboxBroken(f"{self.backend} sandbox {self.spec.label}: {path} is over {limit >> 20} MB as a tar")
        if error.startswith(("FileNotFoundError", "NotADirectoryError")):
            raise FileNotFoundError(f"sandbox {self.spec.label}: {path}: {error}")
        if error.startswith("ProcessesLeft"):
            raise SandboxLost(f"{self.backend} sandbox {self.spec.label}: killall failed: {error}")
        raise OSError(f"sandbox {self.spec.label}: cannot export {path}: {error}")

    async def _import(self, inside: str, tar: Path) -> None:
        reply = await self._request({"op": "import", "path": self._path(inside)}, TREE_S, upload=tar)
        if not reply.get("ok"):
            await self.close()
            raise SandboxStartFailed(
                f"{self.backend} sandbox {self.spec.label}: cannot unpack {tar} into {inside}: {reply.get('error')}"
            )
        if reply.get("skipped"):
            log.warning("sandbox %s: %s members of %s were unsafe and skipped", self.spec.label, reply["skipped"], tar)

    async def _request(
        self,
        request: dict[str, object],
        timeout_s: float = 0.0,
        *,
        upload: Path | None = None,
        download: tuple[BinaryIO, int] | None = None,
    ) -> dict[str, object]:
        async with self._lock:
            proc = self._proc
            if self._broken is not None:
                raise SandboxBroken(f"{self.backend} sandbox {self.spec.label}: {self._broken}")
            if proc is not None and proc.returncode is not None and self._lost is None:
                # it ended on its own between requests (the host neither closed nor killed it): judged like a death
                # in the middle of one, so the policy cannot turn a break into a masked re-run by its timing
                raise await self._fail(f"it died (exit {proc.returncode}) between requests: {await self._stderr()}")
            if proc is None or self._lost is not None:
                raise SandboxLost(f"{self.backend} sandbox {self.spec.label}: {self._lost or 'it is not running'}")
            assert proc.stdin is not None and proc.stdout is not None
            rid = secrets.token_hex(16)
            self._ran = self._ran or request["op"] == "exec"
            try:
                proc.stdin.write((json.dumps({**request, "id": rid}) + "\n").encode())
                if upload is not None:
                    await _upload(proc.stdin, upload)
                await proc.stdin.drain()
                async with asyncio.timeout(timeout_s + REPLY_MARGIN_S):
                    return await self._reply(proc, rid, download)
            except TimeoutError:
                raise await self._fail("it stopped answering") from None
            except (ConnectionError, ValueError) as exc:  # a broken pipe, a line past MAX_LINE, a line not JSON
                raise await self._fail(f"its channel failed: {exc!r}") from exc
            finally:
                self.last_used = time.monotonic()

    async def _reply(
        self, proc: asyncio.subprocess.Process, rid: str, download: tuple[BinaryIO, int] | None
    ) -> dict[str, object]:
        """The reply to request ``rid``, after the chunks that go to ``download`` (a file and its bound)."""
        assert proc.stdout is not None
        received = 0
        while True:
            line = await proc.stdout.readline()
            if not line:
                code = await proc.wait()
                raise await self._fail(f"it died (exit {code}): {await self._stderr()}")
            reply = json.loads(line)
            if not isinstance(reply, dict) or reply.get("id") != rid:
                raise await self._fail(f"a reply that is not the reply to request {rid}: {line[:200]!r}")
            if "chunk" not in reply:
                return reply
            if download is None:
                raise await self._fail("a chunk that no request asked for")
            data = base64.b64decode(str(reply["chunk"]))
            received += len(data)
            if received > download[1]:
                raise await self._fail(f"an export past its bound of {download[1]} bytes")
            await asyncio.to_thread(download[0].write, data)

    async def _fail(self, why: str) -> Exception:
        """The error for a sandbox that failed in a request (it is killed): `SandboxLost` when the host ended it or
        no command of the policy has run yet, else `SandboxBroken`."""
        if self._lost is not None:
            return SandboxLost(f"{self.backend} sandbox {self.spec.label}: {self._lost}")
        if self._ran:
            self._broken = why
            await self.kill(f"broken: {why}")
            self._lost = None
            return SandboxBroken(f"{self.backend} sandbox {self.spec.label}: {why}")
        await self.kill(why)
        return SandboxLost(f"{self.backend} sandbox {self.spec.label}: {why}")

    def _failure(self, why: str) -> SandboxBroken:
        self._broken = why
        if self._proc is not None and self._proc.returncode is None:
            _killpg(self._proc.pid)
        return SandboxBroken(f"{self.backend} sandbox {self.spec.label}: {why}")

    async def _stderr(self) -> str:
        if self._proc is None or self._proc.stderr is None:
            return ""
        try:
            data = await asyncio.wait_for(self._proc.stderr.read(4096), timeout=5.0)
        except asyncio.TimeoutError:
            return ""
        return data.decode(errors="replace").strip()


async def _upload(stdin: asyncio.StreamWriter, tar: Path) -> None:
    """A tar file as the ``{"chunk"}`` lines of an import, then its end."""
    with open(tar, "rb") as f:
        while data := await asyncio.to_thread(f.read, CHUNK):
            stdin.write((json.dumps({"chunk": base64.b64encode(data).decode()}) + "\n").encode())
            await stdin.drain()
    stdin.write(b'{"end": true}\n')


def _enter(group: cgroups.Cgroup | None, uid: int | None) -> Callable[[], None]:
    """The sandbox's first process, between fork and exec: into its cgroup, (root) down to its uid for good, then
    SIGKILL when the generator dies. bwrap's ``--die-with-parent`` alone leaves a window: a generator killed between
    this fork and bwrap's own ``prctl`` left a sandbox running under its uid, reparented to init. The death signal
    is asked for after the uid change (which clears it) and survives the exec; a child whose generator is already
    gone kills itself (`infra.orphans.die_with_parent`)."""
    tie = die_with_parent(signal.SIGKILL)

    def enter() -> None:
        if group is not None:
            group.enter()
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        if tie is not None:
            tie()

    return enter


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_uid_gone(uid: int, timeout_s: float, label: str) -> bool:
    """Kill what is left of a sandbox's uid and wait until the kernel has reaped it all; False if it did not."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = uid_processes(uid)
        if not left:
            return True
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            log.error("sandbox %s: processes %s of uid %d are still there after %g s", label, left, uid, timeout_s)
            return False
        time.sleep(0.01)
