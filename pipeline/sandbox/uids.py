"""Uids of their own for the sandboxes of a root generator, from a host-wide free set.

A sandbox's processes run as a uid nothing else on the host uses, so its process limit and its teardown (kill
every process of that uid) are its own. Taking one still in use would be worse than none: closing one sandbox
would kill another's processes. So a uid is leased: a lock file per uid in a root-only host directory, held
(``flock``) for the sandbox's life by the process that owns it, across every generator and test on the host (the
kernel drops the lock when that process dies, however it dies). A lease released by its owner once none of the
uid's processes were left marks its file ``free``; one whose owner died holding it does not, and its uid is taken
again only once /proc shows no live process of it (a sandbox of a generator killed with SIGKILL may take a moment
to go). Scanning /proc on every start would cost 10-20 ms on a busy host.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

UID_BASE = 200_000
"""The first sandbox uid."""
UID_COUNT = 100_000
"""Sandbox uids are UID_BASE .. UID_BASE + UID_COUNT - 1."""
BLOCK = 100
"""Each generator process starts its search at a block of its own (by pid), so two rarely contend for a lock."""
LOCK_DIR = Path("/run/leeway-sandbox-uids")
FREE = b"free"


class UidLease:
    """A uid held for one sandbox until `release`."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd: int | None = fd

    def release(self, *, gone: bool = False) -> None:
        """Give the uid back; ``gone``: the owner saw none of its processes left, so the next taker need not look."""
        if self._fd is not None:
            if gone:
                os.pwrite(self._fd, FREE, 0)
            os.close(self._fd)  # closing the only descriptor of the open file drops its flock
            self._fd = None


def allocate_uid(lock_dir: Path = LOCK_DIR) -> UidLease | None:
    """A free uid for the next sandbox when this process may switch to one (root), else None."""
    if os.geteuid() != 0:
        return None
    _lock_dir(lock_dir)
    first = (os.getpid() % (UID_COUNT // BLOCK)) * BLOCK
    for step in range(UID_COUNT):
        uid = UID_BASE + (first + step) % UID_COUNT
        fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another sandbox holds it
            os.close(fd)
            continue
        if os.pread(fd, len(FREE), 0) != FREE and uid_processes(uid):  # its owner died holding it, and it still lives
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"held", 0)
        return UidLease(uid, fd)
    raise OSError(f"no free sandbox uid in {UID_BASE}..{UID_BASE + UID_COUNT - 1}")


def _lock_dir(lock_dir: Path) -> None:
    """Make the lock directory, and refuse one that anyone but root could have planted or can write."""
    lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(lock_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise OSError(
            f"{lock_dir}: the sandbox uid lock directory must be a directory of root's, writable by root only"
        )


def uid_processes(uid: int) -> list[int]:
    """The live processes with `uid` as any of their real, effective, saved or file-system uids (zombies, dead and
    waiting for a parent to reap them, are not counted)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # it ended while we looked
            continue
        uids = {int(u) for u in fields.get("Uid", "-1").split()}
        if uid in uids and not fields.get("State", "").strip().startswith("Z"):
            pids.append(int(entry))
    return pids
