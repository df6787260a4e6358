"""Running part of a test as an unprivileged host user: `in_forked_child` runs a function in a forked child (which
may drop to another uid with `drop_to`) and brings back what it returned, or its traceback, as JSON.

A fork, not a new interpreter: everything is imported already, so the child never reads the venv (whose base
interpreter may sit under a directory the unprivileged uid cannot enter)."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

NOBODY = 65534


def drop_to(uid: int = NOBODY) -> None:
    """Become `uid` for good (ids and groups): the host side of a generator that is not root."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def in_forked_child(work: Callable[[], Any]) -> Any:
    """`work()` in a forked child (it never returns into pytest); its JSON-able result, or its error as an
    assertion in the parent."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            result: dict[str, Any] = {"seen": work()}
            code = 0
        except BaseException as exc:  # everything goes back to the parent as text
            result = {"error": "".join(traceback.format_exception(exc))}
        os.write(write, json.dumps(result, default=str).encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        report = json.loads(f.read() or '{"error": "no report"}')
    os.waitpid(pid, 0)
    assert "error" not in report, report["error"]
    return report["seen"]
