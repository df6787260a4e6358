"""One role of a fleet: a Ray actor that runs `leeway trainer` or `leeway generator` in its own process.

```
  Ray: restarts the actor when its process dies (up to fleet.max_restarts)
    └─► RoleActor `gen-3` (named, detached, namespace leeway-<run>)
          └─ keeper thread ──spawns──► leeway generator <run.dir>/fleet/gen-3.yaml --set generator.id=gen-3
                           ◄──waits──  exit: asked to stop -> "stopped"; trainer done -> stops the generators;
                                       otherwise the actor process exits, so Ray restarts it
```

Ray is only the placement and restart layer: an actor receives its `RoleSpec` (the config as YAML
text, a few `--set` items and environment variables) and answers small JSON-able status dicts. The
role talks to the others through NATS and S3 exactly as when started by hand.

Invariants:
- The role process dies with its actor: the keeper thread that spawned it lives until it exits, so
  the parent-death signal (SIGTERM, Linux) fires only when the actor process dies; the role also
  watches the actor's pid itself (`LEEWAY_PARENT_PID`, `infra.orphans.watch_parent`). SIGTERM is the
  roles' clean stop: a generator finishes or aborts its rollouts and naks their prompts, so a killed
  or drained generator loses no prompt; the trainer finishes or abandons its step and checkpoints.
- `stop` sends SIGTERM to the role's process group and SIGKILL after `timeout_s`; nothing the role
  started outlives it.
- A generator process that exits without being asked to ends its actor process (`os._exit`), which
  Ray restarts; the restarted actor starts the same generator id again. The trainer does the same
  with `fleet.trainer_restart: resume` (and then starts with `--resume`); with `stop` (and whenever
  it ends normally) rank 0 stops every generator of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from actors.fleet.placement import generator_index
from infra.files import write_private
from infra.ports import free_port
from infra.process import (
    ProcessInfo,
    is_running,
    spawn_child,
    start_ticks,
    stop_groups,
    stop_processes,
)
from infra.role_logs import LOG_FILE_ENV

STOP_TIMEOUT_S = 150.0
"""Default grace of a role after SIGTERM before its process group is killed; a spec carries the run's
(`LeewayConfig.stop_grace_s`, as `leeway run` gives it)."""
PREDECESSOR_POLL_S = 0.1
"""How often a restarted actor checks whether its predecessor's role process has exited."""
METRICS_TAIL_BYTES = 256 * 1024
"""How much of the end of metrics.jsonl is read to find the newest record (one record is a few KiB)."""
AUTO = "auto"
"""MASTER_ADDR/MASTER_PORT of rank 0 chosen by the rank-0 actor itself: its node's address and a free port."""


@dataclass(frozen=True)
class RoleSpec:
    """Everything an actor needs to start its role; small and JSON-able (it crosses Ray)."""

    name: str
    """Actor name: `trainer-<rank>` or `gen-<index>` (also the generator id)."""
    kind: str
    """`trainer` or `generator`: the `leeway` subcommand."""
    config_yaml: str
    """The resolved config (no credentials: those come from each node's environment or credential files)."""
    run_dir: str
    """Absolute run directory: config copies, logs and (trainer) metrics.jsonl go there."""
    sets: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    restart_on_failure: bool = True
    """An unexpected exit ends the actor process so that Ray restarts it."""
    resume_on_restart: bool = False
    """A restarted trainer starts with `--resume`."""
    stops_fleet: bool = False
    """Trainer rank 0: when it ends (and is not restarted) every generator of the run is stopped."""
    stop_grace_s: float = STOP_TIMEOUT_S
    """SIGTERM-to-SIGKILL grace of the role (`run.stop_grace_s`: the trainer's final checkpoint needs it)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoleSpec:
        return cls(**{**data, "sets": tuple(data.get("sets", ())), "env": dict(data.get("env", {}))})


def last_metrics_record(path: Path) -> dict[str, Any] | None:
    """The newest complete record of a metrics.jsonl (a half-written last line is skipped), or None."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - METRICS_TAIL_BYTES))
            data = handle.read()
    except FileNotFoundError:
        return None
    for line in reversed(data[: data.rfind(b"\n") + 1].splitlines()):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                return record
    return None


def status_record(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The part of a trainer metrics record `fleet status` shows: step, version, reward, generator reports."""
    if record is None:
        return None
    keys = ("step", "version", "time_s", "reward/unfiltered_mean", "generators")
    return {k: record[k] for k in keys if k in record}


class RoleActor:
    """See the module docstring. Created through `role_actor_class()` with Ray options per role."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import ray

        self.role = RoleSpec.from_json(spec)
        context = ray.get_runtime_context()
        self.restarted = bool(context.was_current_actor_reconstructed)
        self.node_id = context.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.env = {k: self._resolve(k, v) for k, v in self.role.env.items()}
        self.popen: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.state = "starting"
        self._stop_requested = threading.Event()
        self._spawned = threading.Event()
        self._spawn_error: str | None = None
        self._keeper = threading.Thread(target=self._keep, name=f"leeway-fleet-{self.role.name}", daemon=True)
        self._keeper.start()
        self._spawned.wait()
        if self._spawn_error is not None:
            raise RuntimeError(f"{self.role.name}: the role did not start: {self._spawn_error}")

    # ------------------------------------------------------------------------------ the role process

    def _resolve(self, key: str, value: str) -> str:
        if value != AUTO:
            return value
        if key == "MASTER_ADDR":
            return self.node_ip
        if key == "MASTER_PORT":
            return str(free_port(host=""))  # free on every interface: the other ranks dial the node's address
        return value

    @property
    def run_dir(self) -> Path:
        return Path(self.role.run_dir)

    def _argv(self, config_path: Path) -> list[str]:
        argv = [sys.executable, "-m", "actors.cli", self.role.kind, str(config_path)]
        for item in self.role.sets:
            argv += ["--set", item]
        if self.restarted and self.role.resume_on_restart:
            argv.append("--resume")
        return argv

    def _await_predecessor(self, pid_path: Path) -> None:
        """A restarted actor's old role got SIGTERM when the old actor died and may still be finishing (a
        trainer writes its checkpoint): wait for it, SIGKILL its group after the grace, then start anew.
        Two trainers of one run must never overlap; Ray restarts an actor in its placement-group bundle,
        so on the same node, where the pid file is."""
        try:
            info = ProcessInfo.from_json(json.loads(pid_path.read_text()))
        except (FileNotFoundError, ValueError, KeyError):
            return
        deadline = time.monotonic() + self.role.stop_grace_s
        while is_running(info) and time.monotonic() < deadline:
            time.sleep(PREDECESSOR_POLL_S)
        if is_running(info):
            stop_processes([info], timeout_s=0.0)

    def _spawn(self) -> subprocess.Popen[bytes]:
        config_path = self.run_dir / "fleet" / f"{self.role.name}.yaml"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        write_private(config_path, self.role.config_yaml)  # 0600: a config may name servers and credentials
        pid_path = config_path.with_suffix(".pid")
        self._await_predecessor(pid_path)
        popen = self._start(config_path)
        info = ProcessInfo(self.role.name, popen.pid, start_ticks(popen.pid), "", tuple(self._argv(config_path)))
        write_private(pid_path, json.dumps(info.to_json()))  # its argv holds the config's path and the --set flags
        return popen

    def _start(self, config_path: Path) -> subprocess.Popen[bytes]:
        log_path = self.run_dir / "logs" / f"{self.role.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(
                f"--- leeway fleet: {self.role.name} on node {self.node_id[:12]} (restarted: {self.restarted})\n".encode()
            )
        return spawn_child(
            self._argv(config_path),
            log_path=log_path,
            env={**os.environ, **self.env, LOG_FILE_ENV: str(log_path)},
            cwd=self.run_dir,
            death_signal=signal.SIGTERM,
            watchdog=True,
            watchdog_grace_s=self.role.stop_grace_s,
        )

    def _keep(self) -> None:
        """Spawn the role and wait for it; this thread must outlive the role (parent-death signal)."""
        try:
            self.popen = self._spawn()
        except Exception as exc:  # reported by __init__, which raises it to the creator
            self._spawn_error = repr(exc)
            self._spawned.set()
            return
        self.state = "running"
        self._spawned.set()
        self.returncode = self.popen.wait()
        if self._stop_requested.is_set():
            self.state = "stopped"
            return
        failed = self.returncode != 0 or self.role.kind == "generator"
        if failed and self.role.restart_on_failure:
            print(f"{self.role.name}: exited with {self.returncode}; ending the actor so Ray restarts it", flush=True)
            os._exit(1)
        if self.role.stops_fleet:
            self.state = "draining"  # `fleet up --wait` returns once the generators are stopped too
            self._stop_generators()
        self.state = "exited" if self.returncode == 0 else "failed"

    def _stop_generators(self) -> None:
        """The trainer ended for good: drain every generator of the run (their prompts go back)."""
        import ray

        names = [n for n in ray.util.list_named_actors() if generator_index(n) is not None]
        handles = []
        for name in names:
            with contextlib.suppress(ValueError):
                handles.append(ray.get_actor(name))
        with contextlib.suppress(Exception):
            ray.get([h.stop.remote() for h in handles], timeout=self.role.stop_grace_s * 2)

    # ------------------------------------------------------------------------------------ methods

    def status(self) -> dict[str, Any]:
        popen = self.popen
        out: dict[str, Any] = {
            "name": self.role.name,
            "kind": self.role.kind,
            "state": self.state,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "actor_pid": os.getpid(),
            "pid": popen.pid if popen is not None else None,
            "returncode": self.returncode,
            "restarted": self.restarted,
            "log": str(self.run_dir / "logs" / f"{self.role.name}.log"),
        }
        if self.role.kind == "trainer":
            out["rendezvous"] = {k: self.env[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in self.env}
            out["metrics"] = status_record(last_metrics_record(self.run_dir / "metrics.jsonl"))
        return out

    def spec(self) -> dict[str, Any]:
        """The spec this role was started with: `fleet scale` starts new generators from the same config."""
        return self.role.to_json()

    def stop(self, timeout_s: float | None = None) -> dict[str, Any]:
        """SIGTERM the role's group, SIGKILL it after `timeout_s` (default: the spec's grace); the final status."""
        timeout_s = self.role.stop_grace_s if timeout_s is None else timeout_s
        self._stop_requested.set()
        popen = self.popen
        if popen is not None and self.returncode is None:
            self.state = "stopping"
            # the keeper reaps the role; sweep: whatever the role started is killed, even after a clean exit
            stop_groups([popen.pid], timeout_s, alive=lambda _pid: self._keeper.is_alive(), sweep=True)
            self._keeper.join()
        self.state = "stopped" if self.state in ("running", "stopping", "starting") else self.state
        return self.status()


def role_actor_class() -> Any:
    """The Ray actor class (threaded, so `status` answers while `stop` waits for a role to drain)."""
    import ray

    return ray.remote(max_concurrency=4)(RoleActor)


def wait_started(handles: list[Any], timeout_s: float) -> list[dict[str, Any]]:
    """Block until every actor ran its `__init__` (its role process exists); their statuses."""
    import ray

    deadline = time.monotonic() + timeout_s
    return ray.get([h.status.remote() for h in handles], timeout=max(1.0, deadline - time.monotonic()))
