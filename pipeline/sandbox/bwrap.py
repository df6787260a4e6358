"""The bubblewrap backend: a sandbox in new user, mount, PID, network, IPC, UTS and cgroup namespaces.

What is inside: the system's directories read-only (``/usr`` and the merged-usr links, a few files of ``/etc``),
a private ``/proc``, ``/dev`` and ``/tmp``, the spec's writable directories (``/app``, ``/logs``: empty, private
to this sandbox) and its read-only binds (a task's tests). What is not: the network (a network namespace of its
own has only a loopback that is down, so not even the run's NATS or S3 on 127.0.0.1 is reachable), the
generator's environment (no S3 or NATS credentials), its home, the run's directory and the stack's, any other
process. It dies with the generator (``--die-with-parent``, so a SIGKILLed generator leaves nothing running),
and runs as a uid of its own when the generator is root, under the spec's rlimits.
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


class BwrapSandbox(SupervisedSandbox):
    backend = "bwrap"

    def _argv(self, supervisor: list[str]) -> list[str]:
        assert self.root is not None
        argv = [require_bwrap(), "--ro-bind", "/usr", "/usr"]
        for name in SYSTEM_LINKS:
            path = Path("/") / name
            if path.is_symlink():
                argv += ["--symlink", os.readlink(path), f"/{name}"]
            elif path.is_dir():
                argv += ["--ro-bind", str(path), f"/{name}"]
        for name in ETC_FILES:
            argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--bind", str(self.root / "tmp"), "/tmp"]
        for path in self.spec.writable:
            argv += ["--bind", str(self.root / path.strip("/").replace("/", "_")), path]
        for inside, host in self.spec.binds.items():
            argv += ["--ro-bind", str(host), inside]
        argv += ["--remount-ro", "/"]  # the root itself (bwrap's tmpfs holding the mount points) is not writable
        argv += [
            "--unshare-all",
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
