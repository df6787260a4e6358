"""The bubblewrap backend: a sandbox in new user, mount, PID, network, IPC, UTS and cgroup namespaces.

What is inside: the system's directories read-only (``/usr`` and the merged-usr links, a few files of ``/etc``),
a private ``/proc`` and a read-only ``/dev``, size-limited tmpfs for ``/tmp``, ``/dev/shm`` and the spec's
writable directories (``/app``, ``/logs``: empty, private to this sandbox, ``limits.disk_mb`` each; the host
sees none of them on disk: `SupervisedSandbox.export_tree` and `SandboxSpec.imports` move a tree out and in) and
its read-only binds (a task's tests). What is not: the network (a network namespace of its own has only a
loopback that is down, so not even the run's NATS or S3 on 127.0.0.1 is reachable), the generator's environment
(no S3 or NATS credentials), its home, the run's directory and the stack's, any other process. The supervisor is
the PID namespace's init (``--as-pid-1``: no signal from inside reaches it, and its killall is one
``kill(-1)``); it dies with the generator (``--die-with-parent``, so a SIGKILLed generator leaves nothing
running), and runs as a uid of its own and in a cgroup of its own where the host allows (a root generator), under
the spec's limits.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipeline.sandbox.base import SandboxRefused
from pipeline.sandbox.supervised import SupervisedSandbox

SYSTEM_LINKS = ("bin", "lib", "lib64", "lib32", "libx32", "sbin")
"""Top-level directories that merged-usr systems make links into /usr (bound as the same links, or read-only)."""
ETC_FILES = (
    "alternatives",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "passwd",
    "group",
    "nsswitch.conf",
    "bash.bashrc",
    "profile",
    "inputrc",
)
"""What of /etc a shell and an interpreter want; nothing that holds a secret."""


def bwrap_binary() -> str | None:
    return shutil.which("bwrap")


def require_bwrap() -> str:
    found = bwrap_binary()
    if found is None:
        raise SandboxRefused(
            "sandbox.backend = bwrap: bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
        )
    return found


def system_binds() -> list[str]:
    """bwrap arguments for what a shell or an interpreter needs of the system: ``/usr`` and the merged-usr links
    read-only, and the few files of ``/etc`` (`ETC_FILES`); shared by sandboxes and scorer workers."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for name in SYSTEM_LINKS:
        path = Path("/") / name
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), f"/{name}"]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), f"/{name}"]
    for name in ETC_FILES:
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return argv


class BwrapSandbox(SupervisedSandbox):
    backend = "bwrap"

    def _scope(self) -> str:
        return "namespace"

    def _argv(self, supervisor: list[str]) -> list[str]:
        argv = [require_bwrap(), *system_binds()]
        size = str(self.spec.limits.disk_mb << 20)
        argv += ["--proc", "/proc", "--dev", "/dev"]
        for path in ("/dev/shm", "/tmp", *self.spec.writable):
            argv += ["--size", size, "--tmpfs", path]
        for inside, host in self.spec.binds.items():
            argv += ["--ro-bind", str(host), inside]
        # the root itself (bwrap's tmpfs holding the mount points) and /dev's are not writable: unbounded otherwise
        argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
        argv += [
            "--unshare-all",
            "--as-pid-1",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--hostname",
            "sandbox",
            "--clearenv",
        ]
        for key, value in self._env().items():
            argv += ["--setenv", key, value]
        argv += ["--chdir", self.spec.workdir if self.spec.workdir in self.spec.writable else "/tmp", "--"]
        return argv + supervisor
