"""Where verifiers run: `VerifierPool` (its own bounded threads and a timeout) and its defaults.

The caller never invokes `Task.verify` directly but through a `VerifierPool`, which runs it on the pool's own
bounded threads (never the event loop's default executor, which generation and weight pulls use) under a timeout,
and turns an exception or a timeout into ``infra_error`` with reward None: an infrastructure failure is never scored
as a policy failure, so it stays out of the loss and out of the group baseline. A reward that is not a finite number
(NaN, inf, or past float32, the wire's reward type; `pipeline.tasks.base.reward_problem`) is a broken verifier too:
that sample alone becomes ``infra_error``, where it would otherwise fail the whole group's validation; so is one
outside the task's `Task.reward_range` (reason ``reward_out_of_range``). A verifier that hangs holds one pool thread
and nothing else.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from pipeline.failures import InfraReason
from pipeline.tasks.base import Task, VerifierResult, reward_problem
from pipeline.wire.prompts import Prompt

logger = logging.getLogger(__name__)

VERIFIER_TIMEOUT_S = 30.0
"""Default limit on one `Task.verify` call (time queued for a pool thread included); past it: ``infra_error``."""
VERIFIER_THREADS = 4
"""Threads of a `VerifierPool`. A verifier hung past its timeout keeps its thread; once all are held, every
later verification waits in the pool's queue and times out (``infra_error``) until one returns."""


class VerifierPool:
    """Where verifiers run: a dedicated, bounded `ThreadPoolExecutor` and a timeout.

    Plain ``verify`` methods run on this pool's ``num_threads`` threads, never on the event loop's default
    executor (``asyncio.to_thread``), so a verifier that hangs cannot take a thread from generation or a
    weight pull. A thread cannot be killed: a verifier past its timeout keeps running in the background and
    its result is ignored; `stuck` counts such calls, and the pool logs when they hold every thread.
    ``close()`` (or leaving ``with``) drops queued calls and does not wait for running ones.
    """

    def __init__(self, *, timeout_s: float = VERIFIER_TIMEOUT_S, num_threads: int = VERIFIER_THREADS) -> None:
        if timeout_s <= 0 or num_threads < 1:
            raise ValueError(
                f"VerifierPool: timeout_s must be > 0 and num_threads >= 1, got {timeout_s}, {num_threads}"
            )
        self.timeout_s = timeout_s
        self.num_threads = num_threads
        self.stuck = 0
        self._stuck_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="leeway-verifier")

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def verify(
        self, task: Task, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]
    ) -> VerifierResult:
        """``task.verify`` under the timeout; an exception or a timeout becomes ``infra_error`` with reward None."""
        try:
            if inspect.iscoroutinefunction(task.verify):
                result = await asyncio.wait_for(
                    task.verify(prompt, completion_text, completion_ids), timeout=self.timeout_s
                )
            else:
                result = await self._in_thread(task, prompt, completion_text, completion_ids)
        except asyncio.TimeoutError:
            logger.warning(
                "verifier of task %s timed out after %.1f s on prompt %s", task.name, self.timeout_s, prompt.prompt_id
            )
            return VerifierResult(None, "infra_error", {"error": f"verifier timed out after {self.timeout_s} s"})
        except Exception as exc:  # a boundary we own: any verifier failure is an infrastructure failure
            logger.exception("verifier of task %s raised on prompt %s", task.name, prompt.prompt_id)
            return VerifierResult(None, "infra_error", {"error": f"{type(exc).__name__}: {exc}"})
        if not isinstance(result, VerifierResult):
            return VerifierResult(None, "infra_error", {"error": f"verifier returned {type(result).__name__}"})
        problem = None if result.reward is None else reward_problem(result.reward)
        if problem is None and result.reward is not None and task.reward_range is not None:
            low, high = task.reward_range
            if not low <= result.reward <= high:
                problem = f"reward {result.reward!r} is outside the task's range [{low}, {high}]"
                logger.warning(
                    "verifier of task %s on prompt %s: %s; infra_error", task.name, prompt.prompt_id, problem
                )
                return VerifierResult(
                    None,
                    "infra_error",
                    {**result.info, "error": f"verifier: {problem}", "reason": InfraReason.REWARD_OUT_OF_RANGE.value},
                )
        if problem is not None:
            logger.warning("verifier of task %s on prompt %s: %s; infra_error", task.name, prompt.prompt_id, problem)
            return VerifierResult(None, "infra_error", {**result.info, "error": f"verifier: {problem}"})
        return result

    async def _in_thread(
        self, task: Task, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]
    ) -> VerifierResult:
        """A plain verify on a pool thread; past the timeout a running call is left running, counted in `stuck`."""
        call = self._executor.submit(task.verify, prompt, completion_text, completion_ids)
        waiter = asyncio.wrap_future(call)
        try:
            done, _ = await asyncio.wait({waiter}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            call.cancel()
            raise
        if waiter in done:
            return waiter.result()
        waiter.add_done_callback(_ignore_result)
        if call.cancel():  # still queued behind stuck verifiers: it never runs
            raise asyncio.TimeoutError
        with self._stuck_lock:
            self.stuck += 1
            all_stuck = self.stuck >= self.num_threads
        call.add_done_callback(self._unstuck)
        if all_stuck:
            logger.error(
                "all %d verifier threads are held by verifiers past their %.1f s timeout (task %s): every sample is "
                "an infra_error until one returns",
                self.num_threads,
                self.timeout_s,
                task.name,
            )
        raise asyncio.TimeoutError

    def _unstuck(self, _: object) -> None:
        with self._stuck_lock:
            self.stuck -= 1


def _ignore_result(future: asyncio.Future[VerifierResult]) -> None:
    """A verifier's result after its timeout is ignored; retrieving it keeps asyncio from reporting it."""
    if not future.cancelled():
        future.exception()
