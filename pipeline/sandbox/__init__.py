"""Sandboxes for model-written code (`pipeline/sandbox/base.py` says what one is): the bubblewrap backend, the
unisolated local one, and the pool that admits them in waves (`pipeline/sandbox/pool.py`)."""

from pipeline.sandbox.base import (
    ExecResult,
    Sandbox,
    SandboxBroken,
    SandboxError,
    SandboxLimits,
    SandboxLost,
    SandboxRefused,
    SandboxSpec,
    SandboxStartFailed,
    SandboxStartTimeout,
)

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxBroken",
    "SandboxError",
    "SandboxLimits",
    "SandboxLost",
    "SandboxRefused",
    "SandboxSpec",
    "SandboxStartFailed",
    "SandboxStartTimeout",
]
