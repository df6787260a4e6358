"""`TaskSettings`: what a task may take from the run's config, built from it in one place (`TaskSettings.from_config`).

A task is built from ``task.name`` and ``task.args`` alone (`pipeline.tasks.registry.get_task`); the few run-wide
settings that change how its episodes play are handed over afterwards, once, through `Task.configure`, as this
small frozen record rather than the whole config: a task sees exactly these, and a test builds them without a
config. Today they are Harbor's (its sandbox pool and command timeout, and two `rollout.*` rules its shell agent
follows); a new one is a field here, read in `from_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline.sandbox import SandboxLimits
from pipeline.sandbox.pool import PoolSettings

if TYPE_CHECKING:
    from pipeline.config import LeewayConfig


@dataclass(frozen=True)
class TaskSettings:
    """The run's settings a task may use; the defaults are a run's without a config (`PoolSettings()` for the pool)."""

    sandbox: PoolSettings = field(default_factory=PoolSettings)
    """The `sandbox.*` section as a sandbox pool needs it (backend, admission, per-sandbox limits)."""
    command_timeout_s: float = 60.0
    """`sandbox.command_timeout_s`: longest one agent command may run (within the task's agent timeout)."""
    agent_timeout_is: Literal["policy", "infra"] = "policy"
    """`rollout.agent_timeout_is`: an agent past its time limit scores 0 (``policy``) or is masked (``infra``)."""
    strict_format: bool = False
    """`rollout.strict_format`: end an episode at its first format error with reward 0."""

    @classmethod
    def from_config(cls, cfg: LeewayConfig) -> TaskSettings:
        s = cfg.sandbox
        pool = PoolSettings(
            backend=s.backend,
            allow_unisolated=s.allow_unisolated,
            max_concurrent=s.max_concurrent,
            starts_per_s=s.starts_per_s,
            cpus=s.cpus,
            memory_mb=s.memory_mb,
            limits=SandboxLimits(
                memory_mb=s.memory_mb,
                max_processes=s.max_processes,
                max_file_mb=s.max_file_mb,
                max_open_files=s.max_open_files,
                cpu_time_s=s.cpu_time_s,
                cpu_quota=s.cpu_quota,
                disk_mb=s.disk_mb,
            ),
            start_timeout_s=s.start_timeout_s,
            admission_timeout_s=s.admission_timeout_s,
            idle_timeout_s=s.idle_timeout_s,
            base_dir=None if s.dir is None else Path(s.dir),
        )
        return cls(
            sandbox=pool,
            command_timeout_s=s.command_timeout_s,
            agent_timeout_is=cfg.rollout.agent_timeout_is,
            strict_format=cfg.rollout.strict_format,
        )
