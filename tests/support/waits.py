"""Waiting for an event: poll a predicate until it holds, or fail with a message naming what was awaited.

Tests wait for events, never for durations. A wait ends as soon as its predicate holds; its `timeout_s` is a
generous bound that only a stuck test reaches, so the suite passes on a machine ten times faster or slower.
A predicate may raise to end the wait early (a role that died: `assert proc.poll() is None`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

WAIT_S = 30.0
"""Default bound on one wait; waits end when the event happens."""
POLL_S = 0.05
"""How often a predicate is tried again."""


def _timed_out(timeout_s: float, what: str, detail: Callable[[], str] | None) -> AssertionError:
    return AssertionError(f"waited {timeout_s:g} s for {what}" + (f"\n{detail()}" if detail is not None else ""))


def wait_until(
    predicate: Callable[[], object],
    *,
    what: str,
    timeout_s: float = WAIT_S,
    detail: Callable[[], str] | None = None,
    poll_s: float = POLL_S,
) -> None:
    """Return once `predicate()` is true; fail after `timeout_s` naming `what` (and `detail()`, e.g. log tails)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, what, detail)
        time.sleep(poll_s)


async def until(
    predicate: Callable[[], object | Awaitable[object]],
    *,
    what: str,
    timeout_s: float = WAIT_S,
    detail: Callable[[], str] | None = None,
    poll_s: float = POLL_S,
) -> None:
    """`wait_until` for a coroutine: the event loop runs between tries, and `predicate` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while not await _holds(predicate):
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, what, detail)
        await asyncio.sleep(poll_s)


async def _holds(predicate: Callable[[], object | Awaitable[object]]) -> bool:
    result = predicate()
    return bool(await result if inspect.isawaitable(result) else result)
