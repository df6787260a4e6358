"""The role processes of `leeway run`: spawning the trainer, the generators and the evaluator, each as
`leeway <role>` in its own process group, watching them, and stopping exactly those.

```
  start_roles ──writes──► <run.dir>/config.yaml (the resolved config, 0600)
      ├──spawn_role──► leeway trainer [--resume]           logs/trainer.log
      ├──spawn_role──► leeway generator × N (gen-0, ...)   logs/gen-K.log
      └──spawn_role──► leeway eval --follow (eval.every_steps)   logs/eval.log
  RunProcesses.stop ──► generators, then the trainer, then the evaluator: SIGTERM, then SIGKILL to the group
```

Every child is started and stopped by `infra/process.py`; the run around them (stack, signals, metrics, the live
view) is `actors/launcher/run.py`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.launcher.report import read_evals
from infra.files import write_private
from infra.process import spawn_child, stop_groups
from infra.role_logs import LOG_FILE_ENV
from pipeline.config import LeewayConfig


@dataclass
class RoleProcess:
    """One role process `leeway run` started, with the log its output goes to."""

    name: str
    """`trainer` or the generator id (`gen-0`, ...)."""
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()


@dataclass(frozen=True)
class GeneratorProcessStatus:
    generator_id: str
    pid: int
    returncode: int | None
    """None while running."""
    log_path: Path


@dataclass(frozen=True)
class RunStatus:
    """What the live view needs besides the metrics records: processes and queue depths right now."""

    generators: tuple[GeneratorProcessStatus, ...] = ()
    trainer_alive: bool = True
    queues: dict[str, int | None] = field(default_factory=dict)
    """`prompts_waiting`, `prompts_in_generation`, `groups_waiting`, `groups_in_step` (None: unknown yet)."""
    stopping: bool = False
    stopped: bool = False
    """Every process this run started has exited (the last update)."""
    evals: tuple[dict[str, Any], ...] = ()
    """The evaluator's results so far (`eval.jsonl`), oldest first."""


@dataclass
class RunProcesses:
    """The role processes `leeway run` started, so that it stops exactly those (a Ray fleet is `actors/fleet/`)."""

    trainer: RoleProcess | None = None
    generators: list[RoleProcess] = field(default_factory=list)
    evaluator: RoleProcess | None = None
    """`leeway eval --follow`, when ``eval.every_steps`` is set."""
    eval_log: Path | None = None
    """Where the evaluator appends its results."""
    hurry: threading.Event = field(default_factory=threading.Event)
    """Set by a second Ctrl-C: kill instead of waiting."""

    def stop(self, timeout_s: float) -> None:
        """Generators first (all at once), then the trainer, then the evaluator (which first evaluates the versions
        due up to the last one published); each group is killed if it does not exit in time."""
        stop_roles(self.generators, timeout_s, self.hurry)
        if self.trainer is not None:
            stop_roles([self.trainer], timeout_s, self.hurry)
        if self.evaluator is not None:
            stop_roles([self.evaluator], timeout_s, self.hurry)

    def status(self, queues: dict[str, int | None], *, stopping: bool = False, stopped: bool = False) -> RunStatus:
        return RunStatus(
            generators=tuple(
                GeneratorProcessStatus(g.name, g.popen.pid, g.returncode, g.log_path) for g in self.generators
            ),
            trainer_alive=self.trainer is not None and self.trainer.alive,
            queues=dict(queues),
            stopping=stopping,
            stopped=stopped,
            evals=tuple(read_evals(self.eval_log.parent)) if self.eval_log is not None else (),
        )


def stop_roles(roles: list[RoleProcess], timeout_s: float, hurry: threading.Event | None = None) -> None:
    """SIGTERM every live role, wait up to `timeout_s` (less if `hurry` is set), then SIGKILL the groups.

    Each group whose leader was not reaped yet gets a SIGKILL regardless, so that nothing a role
    spawned outlives it; its leader is reaped only after that, so its process-group id is not reused
    before (`infra.process.stop_groups`).
    """
    unreaped = [r.popen for r in roles if r.popen.returncode is None]
    stop_groups([popen.pid for popen in unreaped], timeout_s, hurry=hurry, sweep=True)
    for popen in unreaped:
        popen.wait()


def split_threads(num_generators: int, cores: int | None = None) -> tuple[int, int]:
    """Torch threads for (trainer, each generator) so the roles do not fight over the cores."""
    cores = cores or os.cpu_count() or 2
    trainer = max(1, cores // 2)
    generator = max(1, (cores - trainer) // max(1, num_generators))
    return trainer, generator


def spawn_role(
    role: str,
    config_path: Path,
    overrides: list[str],
    log_path: Path,
    threads: int,
    name: str | None = None,
    grace_s: float | None = None,
    flags: tuple[str, ...] = (),
) -> RoleProcess:
    """Start `leeway <role> CONFIG` as its own session (process group), its threads pinned by env and config.

    The role dies with this process: SIGTERM from the kernel (Linux), and its own watchdog on our pid.
    Call it from a thread that outlives the role (the parent-death signal fires when that thread exits).
    """
    argv = [sys.executable, "-m", "actors.cli", role, str(config_path), *flags]
    for item in overrides:
        argv += ["--set", item]
    popen = spawn_child(
        argv,
        log_path=log_path,
        env=dict(
            os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), **{LOG_FILE_ENV: str(log_path)}
        ),
        death_signal=signal.SIGTERM,
        watchdog=True,
        watchdog_grace_s=grace_s,
    )
    return RoleProcess(name or role, popen, log_path)


def generator_ids(num_generators: int) -> list[str]:
    """The ids `leeway run` gives its own generators; a report under another id comes from a generator
    started elsewhere, which keeps the run going when ours have exited."""
    return [f"gen-{index}" for index in range(num_generators)]


def write_run_config(cfg: LeewayConfig, run_dir: Path) -> Path:
    """`<run_dir>/config.yaml`, the resolved config every role loads, written 0600: it may carry a NATS URL
    with its token or credential paths (`infra.files.write_private`)."""
    config_path = run_dir / "config.yaml"
    write_private(config_path, cfg.to_yaml())
    return config_path


def start_roles(
    cfg: LeewayConfig,
    run_dir: Path,
    num_generators: int,
    extra: list[str],
    processes: RunProcesses | None = None,
    *,
    resume: bool = False,
) -> RunProcesses:
    """Write the resolved config to `<run_dir>/config.yaml`; spawn the trainer (`--resume` with `resume`),
    then the generators.

    Each process is recorded in `processes` as soon as it exists, so an interrupted start is stopped too.
    """
    config_path = write_run_config(cfg, run_dir)
    trainer_threads, generator_threads = split_threads(num_generators)
    processes = processes if processes is not None else RunProcesses()
    logs = run_dir / "logs"
    trainer_sets = [*extra, f"trainer.torch_threads={trainer_threads}"]
    grace_s = cfg.stop_grace_s
    processes.trainer = spawn_role(
        "trainer",
        config_path,
        trainer_sets,
        logs / "trainer.log",
        trainer_threads,
        grace_s=grace_s,
        flags=("--resume",) if resume else (),
    )
    for gen_id in generator_ids(num_generators):
        sets = [*extra, f"engine.torch_threads={generator_threads}", f"generator.id={gen_id}"]
        processes.generators.append(
            spawn_role(
                "generator", config_path, sets, logs / f"{gen_id}.log", generator_threads, name=gen_id, grace_s=grace_s
            )
        )
    if cfg.eval.every_steps:
        sets = [*extra, "engine.torch_threads=1"]
        processes.evaluator = spawn_role(
            "eval", config_path, sets, logs / "eval.log", 1, name="evaluator", grace_s=grace_s, flags=("--follow",)
        )
        processes.eval_log = run_dir / "eval.jsonl"
    return processes
