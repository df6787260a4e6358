"""Role logs that rotate by size, so a long run's `<run.dir>/logs/` does not fill the disk.

A role started by `leeway run` or a fleet actor gets its log path in `LOG_FILE_ENV` (its stdout and
stderr already go there, appended). `configure_role_logging` then writes the role's log records
through a size-rotating handler on that path (`logging.role_log_max_bytes`, `logging.role_log_backups`:
`trainer.log`, `trainer.log.1`, ...) and points file descriptors 1 and 2 at whichever file is current,
after every rollover too: raw output (a traceback at exit, a C library's warning) lands beside the
records, and nothing is lost at a rollover, since the process that writes is the one that rotates.
Without the variable (a role started by hand) records go to stderr as before. `--nproc` ranks share
their launcher's output and do not rotate it (`actors/trainer/distributed.py` drops the variable).

A role that stops on purpose before its work is done (a task that fails its verifier self-check, no trainable
group for `trainer.queue_wait_timeout_s`) is not a crash: it logs one line, ``<role> stopped: <reason>``
(`log_stop`), no traceback, and exits `STOP_EXIT`; `leeway run` repeats the reason as its own last line
(`stop_reason`).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
from pathlib import Path
from typing import IO, Any

LOG_FILE_ENV = "LEEWAY_LOG_FILE"
STOP_EXIT = 2
"""The exit status of a role that stopped on purpose, for the reason its `log_stop` line gives."""
STOPPED = " stopped: "


class _RoleLogHandler(logging.handlers.RotatingFileHandler):
    """A `RotatingFileHandler` whose current file is also the process's stdout and stderr."""

    def _open(self) -> IO[Any]:
        stream = super()._open()
        for fd in (1, 2):
            os.dup2(stream.fileno(), fd)
        return stream


def configure_role_logging(level: str, fmt: str, *, max_bytes: int, backups: int) -> None:
    """Log at `level` in `fmt`: to the rotating role log named by `LOG_FILE_ENV`, else to stderr."""
    path = os.environ.pop(LOG_FILE_ENV, None)
    if path is None or max_bytes <= 0:
        logging.basicConfig(level=level, format=fmt)
        return
    handler = _RoleLogHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
    handler.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])


def log_stop(log: logging.Logger, role: str, reason: object) -> int:
    """Log that `role` stops on purpose, and why, as its last line; returns `STOP_EXIT` for its exit status."""
    log.error("%s%s%s", role, STOPPED, reason)
    return STOP_EXIT


def stop_reason(path: str | Path | None, role: str) -> str | None:
    """The reason of the last `log_stop` line of `role` in its log at `path`; None without one."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines() if path is not None else []
    except OSError:
        return None
    marker = role + STOPPED
    for line in reversed(lines):
        if marker in line:
            return line.split(marker, 1)[1]
    return None
