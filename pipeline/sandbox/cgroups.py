"""A cgroup per sandbox, where the machine lets this process make one: the sandbox's memory (its tmpfs files
included), process count and CPU are then limits on the whole sandbox, not on each of its processes.

cgroup v2 is used when this process's cgroup already delegates the memory and pids controllers to its children
(a systemd ``Delegate=`` unit, a container runtime's); else cgroup v1's memory and pids hierarchies (and cpu when
mounted), nested under this process's own cgroup there (a root generator on a v1 or hybrid host). Neither: None,
and the sandbox has only its rlimits (`pipeline/sandbox/base.py` `SandboxLimits` says what that does not give).
The sandbox's first process joins the cgroup before it execs bwrap (`Cgroup.enter`, in the child between fork and
exec), so nothing of the sandbox ever runs outside it. `Cgroup.remove` deletes it once its processes are gone;
cgroups that a killed generator left behind are removed by the next one that makes a cgroup in the same place.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import time
from pathlib import Path

from pipeline.sandbox.base import SandboxLimits

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
PREFIX = "leeway-sandbox"
EXTRA_PIDS = 2
"""bwrap's outer process and the supervisor count against the pids limit too."""
CFS_PERIOD_US = 100_000
_names = itertools.count()
_swept: set[Path] = set()


class Cgroup:
    """One sandbox's cgroup: a directory per hierarchy (one for v2)."""

    def __init__(self, dirs: list[Path], version: int) -> None:
        self.dirs = dirs
        self.version = version
        self._procs = [os.fsencode(d / "cgroup.procs") for d in dirs]

    def enter(self) -> None:
        """Move the calling process into the cgroup (run in the sandbox's first process, before it execs)."""
        for path in self._procs:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    def memory_peak_bytes(self) -> int | None:
        for d in self.dirs:
            for name in ("memory.max_usage_in_bytes", "memory.peak"):
                with contextlib.suppress(OSError, ValueError):
                    return int((d / name).read_text())
        return None

    def remove(self, timeout_s: float = 10.0) -> None:
        """Delete it (its processes are gone: the kernel may still be releasing them, so a busy one is retried)."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.error("cgroup %s: cannot remove it: %s", d, exc)
                        break
                    time.sleep(0.01)


def create(limits: SandboxLimits) -> Cgroup | None:
    """A new cgroup holding `limits`, or None when no cgroup is writable here."""
    name = f"{PREFIX}-{os.getpid()}-{next(_names)}"
    for make in (_v2, _v1):
        with contextlib.suppress(OSError, ValueError):
            made = make(name, limits)
            if made is not None:
                return made
    return None


def _own_paths() -> dict[str, str]:
    """This process's cgroup in each hierarchy: controller (``""`` for v2) -> path."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _v2(name: str, limits: SandboxLimits) -> Cgroup | None:
    path = _own_paths().get("")
    mount = ROOT if (ROOT / "cgroup.controllers").exists() else ROOT / "unified"
    if path is None or not (mount / "cgroup.controllers").exists():
        return None
    parent = mount / path.lstrip("/")
    if not {"memory", "pids"} <= set((parent / "cgroup.subtree_control").read_text().split()):
        return None
    _sweep(parent)
    group = parent / name
    group.mkdir()
    try:
        (group / "memory.max").write_text(str(limits.memory_mb << 20))
        with contextlib.suppress(OSError):
            (group / "memory.swap.max").write_text("0")
        (group / "pids.max").write_text(str(limits.max_processes + EXTRA_PIDS))
        if limits.cpu_quota > 0 and (group / "cpu.max").exists():
            (group / "cpu.max").write_text(f"{_quota_us(limits.cpu_quota)} {CFS_PERIOD_US}")
    except OSError:
        Cgroup([group], 2).remove()
        raise
    return Cgroup([group], 2)


def _v1(name: str, limits: SandboxLimits) -> Cgroup | None:
    own = _own_paths()
    made: list[Path] = []
    try:
        for controller in ("memory", "pids", "cpu"):
            mount = ROOT / controller
            if not (mount / "cgroup.procs").exists() or controller not in own:
                if controller == "cpu":
                    continue
                return _undo(made)
            parent = mount / own[controller].lstrip("/")
            parent = parent if parent.is_dir() else mount
            if not os.access(parent, os.W_OK):
                if controller == "cpu":
                    continue
                return _undo(made)
            _sweep(parent)
            group = parent / name
            group.mkdir()
            made.append(group)
            _v1_limits(controller, group, limits)
    except OSError:
        _undo(made)
        raise
    return Cgroup(made, 1)


def _v1_limits(controller: str, group: Path, limits: SandboxLimits) -> None:
    if controller == "memory":
        (group / "memory.limit_in_bytes").write_text(str(limits.memory_mb << 20))
        with contextlib.suppress(OSError):  # no swap accounting: memory alone is the limit
            (group / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_mb << 20))
    elif controller == "pids":
        (group / "pids.max").write_text(str(limits.max_processes + EXTRA_PIDS))
    elif limits.cpu_quota > 0:
        (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(_quota_us(limits.cpu_quota)))


def _quota_us(cpus: float) -> int:
    return max(1000, int(cpus * CFS_PERIOD_US))


def _undo(made: list[Path]) -> None:
    Cgroup(made, 1).remove(timeout_s=0.0)
    return None


def _sweep(parent: Path) -> None:
    """Remove the empty cgroups that generators no longer alive left under `parent` (once per parent)."""
    if parent in _swept:
        return
    _swept.add(parent)
    for entry in parent.glob(f"{PREFIX}-*"):
        owner = entry.name[len(PREFIX) + 1 :].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            with contextlib.suppress(OSError):
                entry.rmdir()
