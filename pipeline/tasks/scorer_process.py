"""One scorer worker as the host sees it: `WorkerSlot`, a worker process behind a lock, its deadline and its
replacement.

A request goes out as a JSON line and its reply must come back, bound to the request's id, before the deadline.
Past it the worker is SIGKILLed (`ScorerTimeout`); a worker that dies or answers out of turn is killed too
(`ScorerLost`). Either way a new process is started at once on a thread of its own, off the caller's path (the thread then
stays until its process ends: bwrap's ``--die-with-parent`` follows the starting thread, not the process), and
the next request waits for it (under the start timeout). What the dead process held (built scorers, environments)
is gone: `generation` counts processes, so an environment opened on an older one is known to be lost. The calls here
block; `pipeline.tasks.verifiers.VerifierPool` runs them on its own threads so the event loop never waits on one.
"""

from __future__ import annotations

import json
import logging
import os
import select
import threading
import time
from typing import Any

from pipeline.failures import InfraFailure, InfraReason
from pipeline.sandbox.python_worker import PythonWorker, PythonWorkerLauncher

log = logging.getLogger(__name__)

MAX_REPLY = 16 << 20
"""The longest reply line a worker may send; a longer one is a broken worker (killed)."""


class ScorerTimeout(Exception):
    """The worker ran past the request's deadline (or died on it) and was killed: the request's own doing."""


class ScorerLost(InfraFailure):
    """The worker could not be started, or what a request needed from it (an environment) died with it."""

    reason = InfraReason.SCORER_LOST


class WorkerSlot:
    """A place for one worker process; see the module docstring."""

    def __init__(self, launcher: PythonWorkerLauncher, *, start_timeout_s: float, index: int = 0) -> None:
        self.launcher = launcher
        self.start_timeout_s = start_timeout_s
        self.index = index
        self.lock = threading.Lock()
        """Held for a whole request (callers take it; a worker answers one request at a time)."""
        self.generation = 0
        self.loaded: set[str] = set()
        """Recipe keys built by the current process."""
        self.started_s: list[float] = []
        """Seconds from spawn to the worker's ready line, of every start."""
        self.kills = 0
        self._worker: PythonWorker | None = None
        self._ready = threading.Event()
        self._start_error: str | None = None
        self._closed = False
        self._ids = 0
        self._buf = b""
        self._starting: threading.Thread | None = None

    def start(self) -> None:
        """Start the first process in the background (a request waits for it)."""
        self._respawn()

    def _respawn(self) -> None:
        self._ready.clear()
        self.generation += 1
        self.loaded = set()
        self._buf = b""
        self._starting = threading.Thread(target=self._spawn, name=f"leeway-scorer-start-{self.index}", daemon=True)
        self._starting.start()

    def _spawn(self) -> None:
        began = time.monotonic()
        worker: PythonWorker | None = None
        try:
            worker = self.launcher.spawn()
            self._worker = worker
            line = self._read_line(worker, began + self.start_timeout_s)
            if not json.loads(line).get("ready"):
                raise ValueError(f"not a ready line: {line[:200]!r}")
            self._start_error = None
            self.started_s.append(time.monotonic() - began)
        except Exception as exc:
            why = worker.stderr_tail() if worker is not None else ""
            self._start_error = f"scorer worker did not start: {type(exc).__name__}: {exc} {why}".strip()
            log.error("%s", self._start_error)
            if worker is not None:
                worker.kill()
            self._worker = None
        finally:
            self._ready.set()
            if self._closed and self._worker is not None:
                self._worker.kill()
        if worker is not None and self._start_error is None:
            # bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread* that started it ends:
            # this thread lives as long as its worker
            worker.proc.wait()

    def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send `request` and return its reply (the caller holds `lock`). `ScorerTimeout` past `timeout_s` (the
        worker killed and replaced), `ScorerLost` when no worker could be started or it broke."""
        worker = self._live_worker()
        self._ids += 1
        request = {**request, "id": self._ids}
        try:
            assert worker.proc.stdin is not None
            worker.proc.stdin.write((json.dumps(request) + "\n").encode())
            worker.proc.stdin.flush()
            line = self._read_line(worker, time.monotonic() + timeout_s)
        except _Deadline:
            self._replace(f"past its {timeout_s:g} s deadline on a {request.get('op')} request")
            raise ScorerTimeout(f"scorer worker killed after {timeout_s:g} s") from None
        except (OSError, ValueError, _Broken) as exc:
            tail = worker.stderr_tail()
            self._replace(f"broken on a {request.get('op')} request ({exc})")
            raise ScorerTimeout(f"scorer worker died on the request ({exc}): {tail[-500:]}") from None
        reply = json.loads(line)
        if not isinstance(reply, dict) or reply.get("id") != self._ids:
            self._replace("answered out of turn")
            raise ScorerLost(f"scorer worker answered out of turn: {line[:200]!r}")
        return reply

    def _live_worker(self) -> PythonWorker:
        if self._closed:
            raise ScorerLost("the verifier pool is closed")
        if self._worker is None and self._ready.is_set():  # the last start failed: try again now
            self._respawn()
        if not self._ready.wait(self.start_timeout_s + 5):
            raise ScorerLost(f"no scorer worker ready within {self.start_timeout_s:g} s")
        worker = self._worker
        if worker is None:
            raise ScorerLost(self._start_error or "scorer worker did not start")
        if worker.proc.poll() is not None:
            self._replace(f"exited with {worker.proc.returncode} while idle")
            return self._live_worker()
        return worker

    def _read_line(self, worker: PythonWorker, deadline: float) -> bytes:
        assert worker.proc.stdout is not None
        fd = worker.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Deadline
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _Broken(f"exited with {worker.proc.wait()}")
            self._buf += chunk
            if len(self._buf) > MAX_REPLY:
                raise _Broken(f"a reply over {MAX_REPLY} bytes")
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _replace(self, why: str) -> None:
        """Kill the current process and start another one in the background."""
        worker, self._worker = self._worker, None
        if worker is not None:
            log.warning("scorer worker %d (pid %d): %s; killed and replaced", self.index, worker.proc.pid, why)
            self.kills += 1
            worker.kill()
        if not self._closed:
            self._respawn()

    def close(self) -> None:
        """Kill the process (a start under way kills its own when it ends)."""
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.kill()
        if self._starting is not None:
            self._starting.join(timeout=self.start_timeout_s + 5)


class _Deadline(Exception):
    pass


class _Broken(Exception):
    pass
