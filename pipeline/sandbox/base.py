"""What a sandbox is to the code that uses it: `Sandbox` (start, exec with a timeout, write and read a file, close),
its `ExecResult`, what it is made of (`SandboxSpec`, `SandboxLimits`) and the typed ways it fails.

A sandbox holds model-written code, which is hostile: no network, no credentials, no view of the run's files, and
limits on what it can use, per sandbox (memory, processes, CPU, the size of its writable directories). A command
that fails is an `ExecResult` with its exit code (the policy's business). A sandbox that could not start, or died
of something that was not the policy's doing (the host closed or reaped it, it died before any command of the
policy ran), is a `SandboxError`: a `pipeline.failures.InfraFailure` whose ``reason`` is one of the taxonomy's
`InfraReason`s, so the episode becomes an ``infra_error``, masked and re-run. A sandbox that died or whose channel
to the host was tampered with once a command of the policy had run is `SandboxBroken`: the policy's failure
(``sandbox_broken``, reward 0, trained on), because re-running what a hostile command broke would select for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pipeline.failures import InfraFailure, InfraReason


class SandboxError(InfraFailure):
    """The sandbox, not the command, failed; ``reason`` (an `InfraReason`, one per subclass) is the failure's name
    in the step metrics, and ``detail`` what happened (``str()`` is ``"<reason>: <detail>"``)."""

    reason = InfraReason.SANDBOX_LOST


class SandboxStartFailed(SandboxError):
    reason = InfraReason.SANDBOX_START_FAILED


class SandboxStartTimeout(SandboxError):
    reason = InfraReason.SANDBOX_START_TIMEOUT


class SandboxLost(SandboxError):
    """It died (killed, out of memory, reaped as idle) or stopped answering."""

    reason = InfraReason.SANDBOX_LOST


class SandboxBroken(RuntimeError):
    """The sandbox died, stopped answering or sent the host something that was not the reply to its request, after
    a command of the policy had run in it and without the host causing it: the policy's failure, never a masked
    re-run. ``name`` is its failure name (in `pipeline.failures.POLICY_FAILURES`); the sandbox is killed."""

    name = "sandbox_broken"

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(f"{self.name}: {detail}")


class SandboxRefused(ValueError):
    """The configuration asks for a backend this machine cannot give, or an unisolated one not allowed."""


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    """The command ran past its timeout; its process group was killed."""
    truncated: bool = False
    """More output than the exec's ``max_output`` bytes: the rest was dropped."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox limits. Where a cgroup is writable (`pipeline/sandbox/cgroups.py`: cgroup v2 when delegated,
    else v1's memory, pids and cpu controllers, i.e. a root generator) memory, processes and CPU are the whole
    sandbox's; rlimits on every process inside are always set as the floor. Without a cgroup (an unprivileged
    generator without delegation) only the rlimits hold, and they are per process: two processes may together use
    twice ``memory_mb``, and the CPU quota is gone (``cpu_time_s`` still ends any one process). The sandbox's
    processes run as a uid of their own when the generator is root (`pipeline/sandbox/uids.py`), so the process
    rlimit is the sandbox's alone."""

    memory_mb: int = 1024
    """Memory of the whole sandbox, its tmpfs files included (the cgroup's limit; past it the kernel kills its
    largest process), and the address space of each process (RLIMIT_AS)."""
    max_processes: int = 128
    """Processes and threads of the sandbox (the cgroup's pids limit, and RLIMIT_NPROC of its own uid): a fork
    bomb stops here."""
    max_file_mb: int = 256
    """Largest file a process may write (RLIMIT_FSIZE)."""
    max_open_files: int = 256
    cpu_time_s: int = 600
    """CPU seconds of each process (RLIMIT_CPU): an endless loop left in the background dies here at the latest."""
    cpu_quota: float = 0.0
    """CPUs the whole sandbox may keep busy (a CFS quota through its cgroup); 0: no quota."""
    disk_mb: int = 256
    """Size of each of its writable directories (``/tmp``, ``/dev/shm`` and the spec's ``writable``: tmpfs of
    this size under bwrap, whose pages count as the sandbox's memory too)."""


@dataclass(frozen=True)
class SandboxSpec:
    """What one sandbox is made of: the directory commands start in, host directories bound into it (read-only
    unless listed in ``writable``), fixed environment variables and limits."""

    workdir: str = "/app"
    binds: Mapping[str, Path] = field(default_factory=dict)
    """Sandbox path -> host directory, bound read-only (a task's tests, its oracle solution)."""
    writable: tuple[str, ...] = ("/app", "/logs")
    """Sandbox directories that start empty and writable, private to this sandbox (besides /tmp)."""
    imports: Mapping[str, Path] = field(default_factory=dict)
    """Sandbox directory (one of ``writable``) -> a host tar file that `SupervisedSandbox.export_tree` made: unpacked
    into that empty directory before the sandbox is handed out, safely (members with absolute paths, "..", a path
    through a symlink or a type other than file, directory or symlink are skipped). How a verifier gets only the
    agent's ``/app`` in a fresh sandbox."""
    env: Mapping[str, str] = field(default_factory=dict)
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    label: str = ""
    """Names the sandbox in logs (a task and a trajectory id)."""


class Sandbox(Protocol):
    """One sandbox: started once, any number of execs whose files and background processes last, closed once."""

    @property
    def alive(self) -> bool: ...

    async def start(self) -> None:
        """Start it; `SandboxStartFailed` or `SandboxStartTimeout` when it cannot."""
        ...

    async def exec(
        self, command: str, *, timeout_s: float, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        """Run ``bash -c command``; a failing command is an `ExecResult`, a dead sandbox `SandboxLost` (or
        `SandboxBroken` when the policy's commands broke it)."""
        ...

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None: ...

    async def read_file(self, path: str, *, max_bytes: int = 1 << 24) -> bytes:
        """The file's bytes (`FileNotFoundError` when it is not there)."""
        ...

    async def close(self) -> None:
        """Kill everything inside and delete its files; returns once no process of it is left."""
        ...
