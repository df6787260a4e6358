"""The embedded stack (nats-server + SeaweedFS S3) as tests start it: the same `infra.stack` helpers that back
`leeway stack up`, on free ports, ready when they answer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from infra.stack import StackState, start_stack, stop_stack

TEST_STOP_TIMEOUT_S = 2.0
"""SIGTERM grace for test stacks: SeaweedFS would otherwise take ~17 s; a SIGKILL loses nothing written."""


@contextlib.contextmanager
def running_stack(stack_dir: Path) -> Iterator[StackState]:
    """A stack of its own in `stack_dir`, stopped on exit."""
    state = start_stack(stack_dir)
    try:
        yield state
    finally:
        stop_stack(stack_dir, timeout_s=TEST_STOP_TIMEOUT_S)
