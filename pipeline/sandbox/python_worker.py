"""A Python program that reads hostile input (a scorer parsing the policy's answer) started where it reaches nothing.

`PythonWorkerLauncher.spawn` runs ``python -s -B -c BOOT`` that sets its rlimits, puts the given package
directories first on its path and runs one module as ``__main__``; its stdin and stdout are the caller's pipes. Its
environment is `WORKER_ENV` alone, hash seed included (``PYTHONHASHSEED=0``, so not ``-I``, which would ignore it):
every worker, and every replacement, iterates sets in the same order, so a dataset whose items depend on that order
(reasoning-gym's ``polynomial_multiplication`` picks from a set of monomials) is rebuilt the same in each one, and
the same as in a trainer or generator run with ``PYTHONHASHSEED=0``.

With bubblewrap (``isolation="bwrap"``): new user, mount, PID, network, IPC, UTS and cgroup namespaces
(``--unshare-all``: no network at all), an empty environment (``--clearenv``), ``--die-with-parent``, and in its
mount namespace only, read-only: the system directories a dynamic interpreter needs (`system_binds`
of `pipeline.sandbox.bwrap`), the interpreter's prefixes (the venv and its base interpreter) and the package
directories asked for, each bound alone under ``/leeway/src`` (never the repo root or the cwd, where the run's
files live; no ``/home``, no ``/root``, no run directory); a private ``/proc``, ``/dev`` and a small ``/tmp``.

When the host is root the worker runs as a uid of its own, leased for its life (released at `PythonWorker.kill`)
from the same host-wide free set as the sandboxes (`pipeline.sandbox.uids`: never one still in use by any
generator, sandbox or worker on the host). Such a uid cannot walk ``/root`` (mode 0700: the venv's base interpreter
lives under ``/root/.pyenv`` here) and bwrap resolves even ``--ro-bind-fd`` sources to their path and checks it as
its own uid ("Can't find source path /proc/self/fd/4: Permission denied"), so a root host runs bwrap as root
*without* a user namespace (the other namespaces are root's to make), keeping only CAP_SETUID/CAP_SETGID; `BOOT`
drops to the worker's uid (all three ids, no groups, which clears every capability) before it imports anything of
ours or reads a line. bwrap sets no_new_privs and mounts binds nosuid, so nothing inside gets a privilege back.

Without bubblewrap (``isolation="process"``, only with ``sandbox.allow_unisolated``; `resolve_isolation`): the same
program as a plain child with an empty environment, ``/`` as its cwd and the same rlimits: no namespaces.

The rlimits (`WorkerLimits`) bound memory (``RLIMIT_AS``), processes, file size and open files; the wall clock is the
caller's (it kills the process group at its deadline). `kill` takes the whole sandbox down: bwrap's session is
SIGKILLed, and its PID namespace dies with its first process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from infra.orphans import die_with_parent
from pipeline.sandbox.base import SandboxRefused
from pipeline.sandbox.bwrap import bwrap_binary, system_binds
from pipeline.sandbox.uids import UidLease, allocate_uid, uid_processes

log = logging.getLogger(__name__)

Isolation = Literal["bwrap", "process"]
SRC = "/leeway/src"
"""Where the package directories appear inside a bubblewrap worker (its first ``sys.path`` entry)."""
TMP_BYTES = 16 << 20
"""Size of a bubblewrap worker's private ``/tmp``."""
WORKER_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/tmp",
    "MPLCONFIGDIR": "/tmp/matplotlib",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
}
"""The whole environment of a worker: no credential, no proxy, no path of the run; a fixed hash seed."""
BOOT = (
    "import sys\n"
    "sys.path[:] = [p for p in sys.path if p]\n"
    "import json, resource\n"
    "cfg = json.loads(sys.argv[1])\n"
    "for name, value in cfg['rlimits'].items():\n"
    "    resource.setrlimit(getattr(resource, name), (value, value))\n"
    "uid = cfg['uid']\n"
    "if uid is not None:\n"
    "    import os\n"
    "    os.setgroups([])\n"
    "    os.setresgid(uid, uid, uid)\n"
    "    os.setresuid(uid, uid, uid)\n"
    "    assert os.getresuid() == (uid, uid, uid) and not os.getgroups()\n"
    "sys.path[:0] = cfg['path']\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
    "import runpy\n"
    "runpy.run_module(cfg['module'], run_name='__main__', alter_sys=True)\n"
)
"""Runs first in the worker, before any import of ours: the cwd off the path (``-c`` puts it first; ``-I``
would have left it off), limits on, its own uid (root host), then the module. An
editable install's finder (which maps our packages to the checkout, unreachable here) is dropped: the packages
come from ``/leeway/src``."""


@dataclass(frozen=True)
class WorkerLimits:
    """Per-worker rlimits (a worker's threads and children share them; its own uid when the host is root)."""

    memory_mb: int = 2048
    """Address space (``RLIMIT_AS``): a scorer expanding a huge number fails with MemoryError, not the host."""
    max_processes: int = 64
    """``RLIMIT_NPROC`` (threads count); with a uid of its own (leased: no other process has it), for it alone."""
    file_mb: int = 16
    """Largest file it may write (``RLIMIT_FSIZE``), its stderr log included."""
    open_files: int = 256

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_AS": self.memory_mb << 20,
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_FSIZE": self.file_mb << 20,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_CORE": 0,
        }


def resolve_isolation(backend: str, allow_unisolated: bool) -> Isolation:
    """How workers run for `sandbox.backend` (auto: bwrap when installed), or `SandboxRefused`; the same rule as
    `pipeline.sandbox.pool.resolve_backend`, so a run never scores model output unisolated without saying so."""
    if backend in ("auto", "bwrap") and bwrap_binary() is not None:
        return "bwrap"
    if backend == "bwrap":
        raise SandboxRefused(
            "sandbox.backend = bwrap: bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
        )
    if not allow_unisolated:
        found = "sandbox.backend = local" if backend == "local" else "bubblewrap is not installed"
        raise SandboxRefused(
            f"{found}: scorers would read model output without isolation; install bubblewrap "
            "(apt-get install bubblewrap), or set sandbox.allow_unisolated: true to accept that"
        )
    log.warning("scorer workers run WITHOUT isolation (plain processes; sandbox.allow_unisolated = true)")
    return "process"


@dataclass
class PythonWorker:
    """A started worker: its process (pipes to the caller), its uid's lease (root host) and its stderr log (read
    with `stderr_tail`)."""

    proc: subprocess.Popen[bytes]
    lease: UidLease | None
    stderr: IO[bytes]
    _killing: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def uid(self) -> int | None:
        """The uid the worker runs as (None: the host's own, not root; or after `kill`)."""
        return None if self.lease is None else self.lease.uid

    def stderr_tail(self, limit: int = 2000) -> str:
        try:
            self.stderr.seek(0)
            return self.stderr.read().decode(errors="replace")[-limit:]
        except (OSError, ValueError):
            return ""

    def kill(self) -> None:
        """SIGKILL the worker's session (bwrap, the sandbox in its PID namespace), reap it, give its uid back. Safe
        to call from two threads (a slot closing while its start fails): the lease is given back once."""
        with self._killing:
            if self.proc.returncode is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("scorer worker %d did not die within 10 s of SIGKILL", self.proc.pid)
                return  # its uid stays leased: a process of it may still run
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self.stderr.close()
            lease, self.lease = self.lease, None
            if lease is not None:  # its PID namespace died with bwrap; one still being torn down: the next taker looks
                lease.release(gone=not uid_processes(lease.uid))


class PythonWorkerLauncher:
    """Starts workers running `module`, importing from `packages` (package directories: ``.../pipeline``)."""

    def __init__(
        self, module: str, packages: Sequence[Path], *, isolation: Isolation, limits: WorkerLimits | None = None
    ) -> None:
        self.module = module
        self.packages = list(dict.fromkeys(Path(p).resolve() for p in packages))
        names = [p.name for p in self.packages]
        if len(set(names)) != len(names):
            raise ValueError(f"scorer workers: two package directories share a name: {self.packages}")
        self.isolation = isolation
        self.limits = limits or WorkerLimits()

    def spawn(self) -> PythonWorker:
        lease = self._lease_uid() if self.isolation == "bwrap" else None
        uid = None if lease is None else lease.uid
        try:
            stderr = tempfile.TemporaryFile(prefix="leeway-scorer-")
        except BaseException:
            if lease is not None:
                lease.release(gone=True)
            raise
        try:
            if self.isolation == "bwrap":
                argv = self._bwrap_argv(as_root=uid is not None)
                path = [SRC]
            else:
                argv = []
                path = [str(p) for p in dict.fromkeys(pkg.parent for pkg in self.packages)]
            boot = {"rlimits": self.limits.rlimits(), "path": path, "module": self.module, "uid": uid}
            argv += [sys.executable, "-s", "-B", "-c", BOOT, json.dumps(boot)]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=dict(WORKER_ENV),
                cwd="/",
                start_new_session=True,
                # bwrap's --die-with-parent comes only once bwrap runs: a caller killed right after the fork
                # would leave the worker running under its leased uid
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        except BaseException:
            if lease is not None:
                lease.release(gone=True)  # nothing ran as it
            stderr.close()
            raise
        return PythonWorker(proc, lease, stderr)

    @staticmethod
    def _lease_uid() -> UidLease | None:
        """A uid of the host-wide free set (None when the host is not root), or `SandboxRefused` naming why not."""
        try:
            return allocate_uid()
        except OSError as exc:
            raise SandboxRefused(f"scorer workers: no uid to run as: {exc}") from exc

    def _bwrap_argv(self, *, as_root: bool) -> list[str]:
        """bwrap's arguments; `as_root`: no user namespace, only the capabilities `BOOT` needs to drop its uid."""
        bwrap = bwrap_binary()
        if bwrap is None:
            raise SandboxRefused("scorer workers: bubblewrap is not installed (apt-get install bubblewrap)")
        argv = [bwrap, *system_binds()]
        binds = {Path(sys.base_prefix).resolve(): sys.base_prefix, Path(sys.prefix).resolve(): sys.prefix}
        binds.update({pkg: f"{SRC}/{pkg.name}" for pkg in self.packages})
        parents = sorted({str(p) for inside in binds.values() for p in Path(inside).parents if str(p) != "/"})
        for parent in parents:  # bwrap would make them 0700: the worker's uid could not walk to its binds
            argv += ["--perms", "0755", "--dir", parent]
        for host, inside in binds.items():
            argv += ["--ro-bind", str(host), inside]
        argv += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--perms",
            "1777",
            "--size",
            str(TMP_BYTES),
            "--tmpfs",
            "/tmp",
            "--remount-ro",
            "/",
        ]
        if as_root:
            argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
            argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            argv += ["--unshare-all", "--cap-drop", "ALL"]
        argv += ["--die-with-parent", "--hostname", "scorer", "--clearenv"]
        for key, value in WORKER_ENV.items():
            argv += ["--setenv", key, value]
        return [*argv, "--chdir", "/", "--"]
