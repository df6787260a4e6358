"""Bounded retries with exponential backoff and jitter, for writes a role must not die of on the first blip.

A write to the object store or to NATS can fail for a moment (a server restarting, a connection
being re-established) and succeed a second later. `retry_async` runs such a write again, waiting
``initial_s · 2^attempt`` capped at ``max_s``, each wait drawn between half and all of that (jitter,
so that processes that failed together do not retry together), at most ``attempts`` times in all;
then it raises the last error. Only idempotent operations belong here (a weight publish of the same
version, a prompt admission deduplicated by its id, a KV put of the same value). Errors listed as
`permanent` (bad input, a version conflict) are raised at once: retrying cannot change them.
"""

from __future__ import annotations

import asyncio
import logging
import random
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
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, AssertionError)
"""Raised at once by default: bad input does not get better by asking again."""


@dataclass(frozen=True)
class Backoff:
    """How often and how long to retry; see the module docstring."""

    attempts: int = RETRY_ATTEMPTS
    initial_s: float = RETRY_INITIAL_S
    max_s: float = RETRY_MAX_S

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"Backoff.attempts={self.attempts} must be >= 1")
        if self.initial_s < 0 or self.max_s < self.initial_s:
            raise ValueError(f"Backoff: need 0 <= initial_s ({self.initial_s}) <= max_s ({self.max_s})")

    def delay_s(self, failures: int, rng: random.Random) -> float:
        """The wait after the `failures`-th failure (1-based): half the capped exponential, plus up to as much."""
        cap = min(self.max_s, self.initial_s * 2 ** (failures - 1))
        return cap / 2 + rng.uniform(0.0, cap / 2)


async def retry_async(
    operation: Callable[[], Awaitable[T]],
    *,
    what: str,
    backoff: Backoff | None = None,
    permanent: tuple[type[BaseException], ...] = PERMANENT_ERRORS,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """Await `operation()` until it returns, retrying `Exception`s that are not `permanent`.

    `what` names the operation in the log (one WARNING per failed try, with the error). Cancellation
    and other `BaseException`s pass through at once. `backoff` defaults to `Backoff()`.
    """
    backoff = backoff or Backoff()
    rng = rng or random.Random()
    for attempt in range(1, backoff.attempts + 1):
        try:
            return await operation()
        except permanent:
            raise
        except Exception as exc:
            if attempt == backoff.attempts:
                log.error("%s failed %d times; giving up: %s: %s", what, attempt, type(exc).__name__, exc)
                raise
            delay = backoff.delay_s(attempt, rng)
            log.warning(
                "%s failed (try %d of %d: %s: %s); retrying in %.2f s",
                what,
                attempt,
                backoff.attempts,
                type(exc).__name__,
                exc,
                delay,
            )
            await sleep(delay)
    raise AssertionError("unreachable")
