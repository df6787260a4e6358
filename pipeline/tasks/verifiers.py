"""Where verifiers run: `VerifierPool`, scorer workers (sandboxed processes) under a deadline, and its defaults.

A verifier reads the policy's output, which is hostile: reasoning-gym scorers ``eval`` or ``sympy.parse_expr`` it,
math-verify can be made to expand a 370-million-digit integer while holding the GIL, environments execute it.
So a task's plain ``verify`` never runs in the caller's process: it runs in a scorer worker
(`pipeline/tasks/scorer_worker.py`), a process in a bubblewrap sandbox with no credentials, no network and no view
of the run's files (`pipeline/sandbox/python_worker.py`), rebuilt from the task's `ScorerRecipe`
(`pipeline/tasks/scorer_recipe.py`). The pool's calls wait on threads of its own, so the event loop keeps running
whatever a scorer does.

What a verification becomes:

- the worker's answer, checked as before: a reward that is not a finite float32 (`reward_problem`) or lies outside
  `Task.reward_range` (reason ``reward_out_of_range``) makes that sample alone an ``infra_error``;
- an exception inside ``verify``: ``infra_error`` (``verifier_crashed``): a broken verifier is not the policy's;
- a worker past the deadline (``timeout_s``, from the request's send, not its wait in line) or dead on the answer:
  it is killed and replaced, and the sample is the **policy's** failure: reward 0, status ``ok``,
  ``info["error"] = "scorer_timeout"`` (`pipeline.failures.POLICY_FAILURES`), counted and trained on; an answer
  that hangs a scorer must never become a masked, re-run ``infra_error`` (re-runs select for success);
- no worker (none could start, the task's scorer cannot be built): ``infra_error`` (``scorer_lost``).

An ``async def verify`` (a task whose verdict comes from elsewhere: an environment server, a sandbox's tests) is a
client, not a scorer: it runs on the event loop under the timeout, as before; so does the verify of a task whose
rewards come from an environment server or a sandbox's tests (`Task.verifies_in_workers` False: OpenEnv's scores a
cut episode 0, Harbor's refuses to judge; neither reads the reply). Environments of a multi-turn task
that reads model output live in the workers too (`open_environment`, `step_environment`; `pipeline/tasks/
skyrl_gym.py`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.failures import InfraReason
from pipeline.sandbox.python_worker import Isolation, PythonWorkerLauncher, WorkerLimits, resolve_isolation
from pipeline.tasks.base import Task, VerifierResult, reward_problem
from pipeline.tasks.scorer_process import ScorerLost, ScorerTimeout, WorkerSlot
from pipeline.tasks.scorer_recipe import ScorerRecipe, attach_recipe, package_dirs, recipe_of, registry_recipe
from pipeline.wire.prompts import Prompt

if TYPE_CHECKING:
    from pipeline.config import LeewayConfig

logger = logging.getLogger(__name__)

VERIFIER_TIMEOUT_S = 30.0
"""Default deadline of one verification in a worker; past it the worker is killed: ``scorer_timeout``."""
VERIFIER_WORKERS = 2
"""Default scorer workers of a pool (processes; each answers one request at a time)."""
LOAD_TIMEOUT_S = 120.0
"""Deadline for building a task's scorer in a worker (imports, a dataset); past it: ``scorer_lost``."""
START_TIMEOUT_S = 60.0
"""Deadline for a worker process to start."""
SCORER_TIMEOUT = "scorer_timeout"
"""The policy failure of a scorer killed at its deadline on an answer (a Harbor task's tests past theirs too)."""
WORKER_MODULE = "pipeline.tasks.scorer_worker"


class VerifierPool:
    """``workers`` scorer workers and a deadline; see the module docstring. ``isolation``: ``bwrap`` (the default
    where bubblewrap is installed), or ``process`` (a plain child with an empty environment, only with
    ``allow_unisolated``; `resolve_isolation`). Workers start on first use; ``close()`` (or leaving ``with``)
    kills them all."""

    def __init__(
        self,
        *,
        timeout_s: float = VERIFIER_TIMEOUT_S,
        workers: int = VERIFIER_WORKERS,
        backend: str = "auto",
        allow_unisolated: bool = False,
        limits: WorkerLimits | None = None,
        load_timeout_s: float = LOAD_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        for name, value in (("timeout_s", timeout_s), ("load_timeout_s", load_timeout_s)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"VerifierPool: {name} must be a finite number > 0, got {value!r}")
        if workers < 1:
            raise ValueError(f"VerifierPool: workers must be >= 1, got {workers}")
        self.timeout_s = float(timeout_s)
        self.load_timeout_s = max(float(load_timeout_s), self.timeout_s)
        self.start_timeout_s = start_timeout_s
        self.num_workers = workers
        self.isolation: Isolation = resolve_isolation(backend, allow_unisolated)
        self.limits = limits or WorkerLimits()
        self._packages: list[Path] = []
        self._slots: list[WorkerSlot] = []
        self._next = 0
        self._executor = ThreadPoolExecutor(max_workers=4 * workers + 4, thread_name_prefix="leeway-verifier")
        self._closed = False
        self._setup = threading.Lock()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def slots(self) -> list[WorkerSlot]:
        return list(self._slots)

    @property
    def kills(self) -> int:
        """Workers killed (deadline, death) since the pool started."""
        return sum(slot.kills for slot in self._slots)

    def close(self) -> None:
        with self._setup:
            self._closed = True
        for slot in self._slots:
            slot.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- workers -------------------------------------------------------------------------------

    def _ensure_workers(self, recipe: ScorerRecipe) -> None:
        """Start the workers (first use), able to import `recipe`'s packages; a recipe needing a package they
        were not started with restarts them (idle ones only matter: a task's recipe is the same every call)."""
        with self._setup:
            if self._closed:
                raise ScorerLost("the verifier pool is closed")
            wanted = [p.resolve() for p in package_dirs(recipe)]
            if not self._slots or any(p not in self._packages for p in wanted):
                self._start_workers(wanted)

    def _start_workers(self, wanted: list[Path]) -> None:
        self._packages = list(dict.fromkeys([*self._packages, *wanted]))
        launcher = PythonWorkerLauncher(WORKER_MODULE, self._packages, isolation=self.isolation, limits=self.limits)
        for slot in self._slots:
            slot.close()
        self._slots = [
            WorkerSlot(launcher, start_timeout_s=self.start_timeout_s, index=i) for i in range(self.num_workers)
        ]
        for slot in self._slots:
            slot.start()

    def _pick(self) -> WorkerSlot:
        """A free worker if there is one, else the next in turn (the request waits for it)."""
        for slot in self._slots:
            if not slot.lock.locked():
                return slot
        self._next = (self._next + 1) % len(self._slots)
        return self._slots[self._next]

    def _load(self, slot: WorkerSlot, recipe: ScorerRecipe) -> None:
        """Build `recipe`'s scorer in `slot`'s worker under the load deadline (held lock): a slow build never
        counts against the policy's answer."""
        if recipe.key in slot.loaded:
            return
        try:
            reply = slot.call({"op": "load", "recipe": recipe.to_json()}, self.load_timeout_s)
        except ScorerTimeout as exc:
            raise ScorerLost(f"building the scorer {recipe.factory}: {exc}") from None
        if "error" in reply:
            raise ScorerLost(f"building the scorer {recipe.factory} failed: {reply['error']}")
        slot.loaded.add(recipe.key)

    def request(
        self,
        recipe: ScorerRecipe,
        request: dict[str, Any],
        *,
        slot: WorkerSlot | None = None,
        generation: int | None = None,
    ) -> tuple[WorkerSlot, int, dict[str, Any]]:
        """Blocking: `request` to a worker (`slot`, or a free one) with `recipe` built; the slot, the worker's
        generation and the reply. `ScorerTimeout` / `ScorerLost` as `WorkerSlot.call`; `ScorerLost` too when
        `slot`'s worker is no longer the `generation` the caller's state (an environment) lives in."""
        self._ensure_workers(recipe)
        chosen = slot or self._pick()
        with chosen.lock:
            if generation is not None and chosen.generation != generation:
                raise ScorerLost("the scorer worker holding this episode's environment was killed (another episode)")
            self._load(chosen, recipe)
            current = chosen.generation
            return chosen, current, chosen.call(request, self.timeout_s)

    def attach(self, task: Task, recipe: ScorerRecipe | None = None) -> None:
        """Make `task` scorable here: `recipe` (the run's task name and args: `registry_recipe`) unless the task
        has its own, and its environments in these workers when it has any (``use_scorers``)."""
        if recipe is not None:
            attach_recipe(task, recipe)
        task.use_scorers(self)

    async def run(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """`call` on the pool's threads (never the loop's default executor)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(call, *args, **kwargs))

    # ---- verification --------------------------------------------------------------------------

    async def verify(
        self,
        task: Task,
        prompt: Prompt,
        completion_text: str,
        completion_ids: Sequence[int],
        *,
        probe: str | None = None,
    ) -> VerifierResult:
        """The task's verdict on one completion; see the module docstring. `probe`: a marker the worker watches
        compiles for (the self-check's code-execution probe); ``info["evaluated_probe"]`` says it saw one."""
        if inspect.iscoroutinefunction(task.verify) or not task.verifies_in_workers:
            return await self._in_loop(task, prompt, completion_text, completion_ids)
        try:
            recipe = recipe_of(task)
        except ValueError as exc:
            logger.error("%s", exc)
            return _infra(InfraReason.SCORER_LOST, str(exc))
        request = {
            "op": "verify",
            "recipe": recipe.to_json(),
            "prompt": prompt.to_json().decode(),
            "text": completion_text,
            "ids": [int(i) for i in completion_ids],
            "probe": probe,
        }
        try:
            _, _, reply = await self.run(self.request, recipe, request)
        except ScorerTimeout as exc:
            logger.warning("scorer of task %s on prompt %s: %s", task.name, prompt.prompt_id, exc)
            return VerifierResult(0.0, "ok", {"error": SCORER_TIMEOUT, "detail": str(exc)})
        except ScorerLost as exc:
            logger.error("scorer of task %s on prompt %s: %s", task.name, prompt.prompt_id, exc)
            return _infra(InfraReason.SCORER_LOST, str(exc))
        if "error" in reply:
            logger.error("verifier of task %s raised on prompt %s: %s", task.name, prompt.prompt_id, reply["error"])
            return _infra(InfraReason.VERIFIER_CRASHED, str(reply["error"]))
        try:
            result = VerifierResult(reply["reward"], reply["status"], dict(reply.get("info") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            return _infra(InfraReason.VERIFIER_CRASHED, f"verifier returned no VerifierResult: {exc}")
        if reply.get("probed"):
            result = VerifierResult(result.reward, result.status, {**result.info, "evaluated_probe": True})
        return checked(task, prompt, result)

    async def _in_loop(
        self, task: Task, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]
    ) -> VerifierResult:
        try:
            verdict = task.verify(prompt, completion_text, completion_ids)
            result = (
                await asyncio.wait_for(verdict, timeout=self.timeout_s) if inspect.isawaitable(verdict) else verdict
            )
        except asyncio.TimeoutError:
            logger.warning(
                "verifier of task %s timed out after %.1f s on prompt %s", task.name, self.timeout_s, prompt.prompt_id
            )
            return _infra(InfraReason.VERIFIER_TIMEOUT, f"verifier timed out after {self.timeout_s} s")
        except Exception as exc:  # a boundary we own: any verifier failure is an infrastructure failure
            logger.exception("verifier of task %s raised on prompt %s", task.name, prompt.prompt_id)
            return _infra(InfraReason.VERIFIER_CRASHED, f"{type(exc).__name__}: {exc}")
        if not isinstance(result, VerifierResult):
            return _infra(InfraReason.VERIFIER_CRASHED, f"verifier returned {type(result).__name__}")
        return checked(task, prompt, result)


def verifier_pool_for(cfg: LeewayConfig, task: Task) -> VerifierPool:
    """The run's scorer workers (`generator.verifier_*`, isolation as `sandbox.backend` allows), with `task`
    attached: rebuilt in them from `task.name` and `task.args` unless it carries its own recipe."""
    pool = VerifierPool(
        timeout_s=cfg.generator.verifier_timeout_s,
        workers=cfg.generator.verifier_workers,
        backend=cfg.sandbox.backend,
        allow_unisolated=cfg.sandbox.allow_unisolated,
        limits=WorkerLimits(memory_mb=cfg.generator.verifier_memory_mb),
    )
    pool.attach(task, registry_recipe(cfg.task.name, cfg.task.args))
    return pool


def checked(task: Task, prompt: Prompt, result: VerifierResult) -> VerifierResult:
    """`result`, or an ``infra_error`` when its reward is not finite or is outside the task's range."""
    problem = None if result.reward is None else reward_problem(result.reward)
    reason = InfraReason.REWARD_INVALID
    if problem is None and result.reward is not None and task.reward_range is not None:
        low, high = task.reward_range
        if not low <= result.reward <= high:
            problem = f"reward {result.reward!r} is outside the task's range [{low}, {high}]"
            reason = InfraReason.REWARD_OUT_OF_RANGE
    if problem is None:
        return result
    logger.warning("verifier of task %s on prompt %s: %s; infra_error", task.name, prompt.prompt_id, problem)
    return VerifierResult(None, "infra_error", {**result.info, "error": f"verifier: {problem}", "reason": reason.value})


def _infra(reason: InfraReason, error: str) -> VerifierResult:
    return VerifierResult(None, "infra_error", {"error": error, "infra_reason": reason.value})
