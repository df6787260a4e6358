"""Bounded retries with exponential backoff and jitter, for writes a role must not die of on the first blip.

A write to the object store or to NATS can fail for a moment (a server restarting, a connection
being re-established) and succeed a second later. `retry_async` runs such a write again, waiting
``initial_s · 2^attempt`` capped at ``max_s``, each wait drawn between half and all of that (jitter,
so that processes that failed together do not retry together), at most ``attempts`` times in all;
then it raises the last error. A `Backoff` with a `budget_s` instead retries for that long, however many
tries it takes: an outage of minutes (an object store restarting, a NATS server whose disk filled) is
ridden out by the trainer's publish, checkpoint and admission (`outages.*` in the config), while a
`heartbeat` keeps what the caller holds alive between tries (in-progress acks of held groups). Only idempotent operations belong here (a weight publish of the same
version, a prompt admission deduplicated by its id, a KV put of the same value). Errors listed as
`permanent` (bad input, a version conflict) are raised at once: retrying cannot change them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_ATTEMPTS = 5
"""Tries in all (the first one included) before the last error is raised."""
RETRY_INITIAL_S = 0.2
"""Wait after the first failure (before jitter)."""
RETRY_MAX_S = 5.0
"""Longest single wait: five tries span about 0.2 + 0.4 + 0.8 + 1.6 s, well under a minute."""


class Unretryable(Exception):
    """An error no retry mends (the trainer lost its run lease): raised at once by every retry that keeps the
    default `PERMANENT_ERRORS` or extends them."""


PERMANENT_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, AssertionError, Unretryable)
"""Raised at once by default: bad input does not get better by asking again, nor a lost lease."""


@dataclass(frozen=True)
class Backoff:
    """How often and how long to retry; see the module docstring."""

    attempts: int = RETRY_ATTEMPTS
    initial_s: float = RETRY_INITIAL_S
    max_s: float = RETRY_MAX_S
    budget_s: float | None = None
    """Retry for this long (seconds from the first try) instead of `attempts` times: the outage budget."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"Backoff.attempts={self.attempts} must be >= 1")
        if self.budget_s is not None and self.budget_s < 0:
            raise ValueError(f"Backoff.budget_s={self.budget_s} must be >= 0")
        if self.initial_s < 0 or self.max_s < self.initial_s:
            raise ValueError(f"Backoff: need 0 <= initial_s ({self.initial_s}) <= max_s ({self.max_s})")

    def delay_s(self, failures: int, rng: random.Random) -> float:
        """The wait after the `failures`-th failure (1-based): half the capped exponential, plus up to as much."""
        cap = min(self.max_s, self.initial_s * 2 ** (failures - 1))
        return cap / 2 + rng.uniform(0.0, cap / 2)

    def gives_up(self, failures: int, elapsed_s: float, next_delay_s: float) -> bool:
        """True when the `failures`-th failure is the last: tries used up, or the budget would run out waiting."""
        if self.budget_s is None:
            return failures >= self.attempts
        return elapsed_s + next_delay_s > self.budget_s

    def describe(self, failures: int) -> str:
        return f"try {failures}" + (
            f" of {self.attempts}" if self.budget_s is None else f", budget {self.budget_s:.0f} s"
        )


def outage_backoff(budget_s: float) -> Backoff:
    """Retries for `budget_s` seconds, waits capped at `RETRY_MAX_S`: an outage budget from the config."""
    return Backoff(budget_s=budget_s)


async def retry_async(
    operation: Callable[[], Awaitable[T]],
    *,
    what: str,
    backoff: Backoff | None = None,
    permanent: tuple[type[BaseException], ...] = PERMANENT_ERRORS,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    heartbeat: Callable[[], Awaitable[None]] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Await `operation()` until it returns, retrying `Exception`s that are not `permanent`.

    `what` names the operation in the log (one WARNING per failed try, with the error). Cancellation
    and other `BaseException`s pass through at once. `backoff` defaults to `Backoff()`. `heartbeat`
    runs before each wait (its own failure is logged, never raised: it only keeps the caller's holds alive).
    """
    backoff = backoff or Backoff()
    rng = rng or random.Random()
    started = clock()
    failures = 0
    while True:
        try:
            return await operation()
        except permanent:
            raise
        except Exception as exc:
            failures += 1
            delay = backoff.delay_s(failures, rng)
            elapsed = clock() - started
            if backoff.gives_up(failures, elapsed, delay):
                log.error(
                    "%s failed %d times in %.1f s; giving up: %s: %s", what, failures, elapsed, type(exc).__name__, exc
                )
                raise
            log.warning(
                "%s failed (%s: %s: %s); retrying in %.2f s",
                what,
                backoff.describe(failures),
                type(exc).__name__,
                exc,
                delay,
            )
            if heartbeat is not None:
                try:
                    await heartbeat()
                except Exception as beat_exc:  # the holds lapse at worst: redelivered, deduped by id
                    log.warning("%s: keep-alive failed while waiting: %s: %s", what, type(beat_exc).__name__, beat_exc)
            await sleep(delay)
