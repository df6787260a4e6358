"""Multi-turn episodes: a policy and an `Environment` take turns until the environment is done or a limit cuts
the episode; what comes out is an `EpisodeEnd` (the turns, and who scores them), which
`pipeline.rl.scoring.Scorer.episode` makes a sample.

One episode, as `Episodes.run` drives it::

    opening()  ->  [ generate one reply  ->  step(reply) ]*  ->  done | cut  ->  aclose()
                                                                        |
                                               final() on a cut (a sandbox's tests), else the task's verifier

Each reply is one generate call (its request keeps the engine's prefix cache for the next turn), on a worker thread.
An environment message is appended only when a policy reply follows it. The limits (`EpisodeLimits`): at most
``max_turns`` replies and ``max_total_tokens`` tokens; a reply cut by its length ends the episode (``truncated``,
later turns dropped), and under ``strict_truncation`` scores 0.

Each hook runs under its deadline: the one the environment declares (`Environment.hook_timeout_s`: a Harbor
sandbox's, from its task.toml and the run's sandbox settings), else ``env_timeout_s``. A hook that raises or runs
past it ends the episode as an ``infra_error`` named by `failure_reason`: an `pipeline.failures.InfraFailure`'s
own ``reason`` (a sandbox lost, a verifier timed out), a timeout ``environment_timeout``, any other exception
``environment_error``. So do chat messages the template cannot append (``not_bridged``) and an environment's
reward (a done step's, or a cut episode's ``final`` verdict) that is not a finite number (``reward_invalid``) or
lies outside the task's ``reward_range`` (``reward_out_of_range``): that sample alone, never its group.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pipeline.failures import InfraFailure, InfraReason
from pipeline.rl.engine_records import Generate, GenerateRequest, SamplingParams
from pipeline.rl.env_messages import NotBridged, step_ids
from pipeline.rl.turns import Turn, decode
from pipeline.tasks import Prompt, Task, reward_problem
from pipeline.tasks.environment import Environment, EnvStep, Hook
from pipeline.wire.trajectory import Status

if TYPE_CHECKING:
    from pipeline.chat.template import ChatTemplate
    from pipeline.rl.prompt_ids import Tokenizer

logger = logging.getLogger(__name__)

ENV_TIMEOUT_S = 60.0
"""Limit on one hook call of an `Environment` that declares no deadline of its own (`Environment.hook_timeout_s`);
past it the sample is an ``infra_error``."""
MAX_TURNS = 8
"""Default number of policy replies in a multi-turn episode; an episode still running after it is truncated."""

T = TypeVar("T")

EnvironmentFactory = Callable[[Prompt], Environment]
"""Builds a fresh environment per sample (the samples of a group run side by side)."""


def environment_factory(task: Task) -> EnvironmentFactory | None:
    """A `multi_turn` task's ``environment(prompt) -> Environment``; a single-turn task has none."""
    return task.environment if task.multi_turn else None


@dataclass(frozen=True)
class EpisodeLimits:
    env_timeout_s: float = ENV_TIMEOUT_S
    """Limit on one environment hook call (``opening``, ``step``, ``final``, ``aclose``) of an environment that
    declares none (`Environment.hook_timeout_s`)."""
    max_turns: int = MAX_TURNS
    """Policy replies; an episode still running after them is cut."""
    max_total_tokens: int | None = None
    """Tokens of the whole episode, prompt included; a reply gets at most what is left."""
    strict_truncation: bool = False
    """A reply that fills its token limit scores 0 (`rollout.strict_truncation`)."""
    reward_range: tuple[float, float] | None = None
    """The task's `Task.reward_range`: an environment's reward outside it fails its sample."""


@dataclass(frozen=True)
class EpisodeEnd:
    """How one episode ended: its turns, its generation seconds, and who scores it.

    - ``failure`` set: an ``infra_error`` of that reason; ``info`` is what the environment's last step said.
    - ``status`` set: the environment (or the strict-truncation rule) decided ``reward``, ``status`` and ``info``.
    - neither: the task's verifier scores the completion; ``truncated`` when a limit cut the episode.
    """

    turns: list[Turn]
    gen_s: float
    truncated: bool = False
    reward: float | None = None
    status: Status | None = None
    info: dict[str, Any] = field(default_factory=dict)
    failure: InfraFailure | None = None


def failure_reason(exc: BaseException) -> InfraReason:
    """Why an environment hook failed: a timeout's, an `InfraFailure`'s typed reason, or ``environment_error``."""
    if isinstance(exc, asyncio.TimeoutError):
        return InfraReason.ENVIRONMENT_TIMEOUT
    if isinstance(exc, InfraFailure):
        return exc.reason
    return InfraReason.ENVIRONMENT_ERROR


def _failed(turns: list[Turn], gen_s: float, exc: BaseException) -> EpisodeEnd:
    failure = InfraFailure(f"{type(exc).__name__}: {exc}", reason=failure_reason(exc))
    return EpisodeEnd(turns, gen_s, failure=failure)


@dataclass(frozen=True)
class Episodes:
    """What every episode of a rollout shares: the engine call, sampling, tokenizer, chat template and limits."""

    generate: Generate
    sampling: SamplingParams
    tokenizer: Tokenizer
    limits: EpisodeLimits
    template: ChatTemplate | None = None

    async def run(self, environment: Environment, prompt_ids: list[int], trajectory_id: str) -> EpisodeEnd:
        """One episode from `prompt_ids`; `environment` is closed when it ends, however it ends."""
        try:
            return await self._turns(environment, prompt_ids, trajectory_id)
        finally:
            try:
                await self._hook(environment, "aclose", environment.aclose)
            except Exception:  # the sample is already decided; a failed close only costs the environment's slot
                logger.warning("closing the environment of trajectory %s failed", trajectory_id, exc_info=True)

    async def _turns(self, environment: Environment, prompt_ids: list[int], trajectory_id: str) -> EpisodeEnd:
        limits = self.limits
        turns = [Turn.context("prompt", prompt_ids)]
        pending: list[int] = []
        gen_s = 0.0
        try:
            first = await self._hook(environment, "opening", environment.opening)
            pending = [] if first is None else step_ids(first, self.tokenizer, self.template, None)
        except Exception as exc:  # a boundary we own: environment failures are infrastructure failures
            logger.exception("environment failed to open trajectory %s", trajectory_id)
            return _failed(turns, 0.0, exc)
        for _ in range(limits.max_turns):
            context_ids = np.concatenate([t.token_ids for t in turns] + [np.asarray(pending, np.int32)])
            budget = self.sampling.max_new_tokens
            if limits.max_total_tokens is not None:
                budget = min(budget, limits.max_total_tokens - len(context_ids))
            if budget < 1:
                break
            if pending:
                turns.append(Turn.context("env", pending))
            request = GenerateRequest(context_ids, max_new_tokens=budget, request_id=trajectory_id, keep_prefix=True)
            result = (await asyncio.to_thread(self.generate, [request], self.sampling))[0]
            turns.append(Turn.policy(result))
            gen_s += result.gen_s
            if result.finish_reason == "length" and limits.strict_truncation:  # rollout.strict_truncation
                return EpisodeEnd(turns, gen_s, reward=0.0, status="truncated", info={"strict": "length"})
            if result.finish_reason != "stop":  # "length": later turns are dropped; "abort": not scored
                return await self._cut(environment, turns, gen_s, trajectory_id)
            reply_ids = turns[-1].without_stop(self.sampling.stop_token_ids)
            try:
                text = decode(self.tokenizer, reply_ids)
                step = await self._hook(environment, "step", partial(environment.step, text, reply_ids))
            except Exception as exc:  # a boundary we own: environment failures are infrastructure failures
                logger.exception("environment failed in trajectory %s", trajectory_id)
                return _failed(turns, gen_s, exc)
            if step.done:
                return _verdict(step, turns, gen_s, trajectory_id, limits.reward_range, cut=False)
            try:
                pending = step_ids(step, self.tokenizer, self.template, turns[-1].token_ids)
            except NotBridged as exc:
                logger.warning("environment of trajectory %s: %s; infra_error", trajectory_id, exc)
                failure = InfraFailure(str(exc), reason=InfraReason.NOT_BRIDGED)
                return EpisodeEnd(turns, gen_s, info=dict(step.info), failure=failure)
        return await self._cut(environment, turns, gen_s, trajectory_id)

    async def _cut(self, environment: Environment, turns: list[Turn], gen_s: float, trajectory_id: str) -> EpisodeEnd:
        """An episode cut by a limit (a reply's length, the turns, the tokens): ``truncated``, scored by the
        environment's own ``final()`` when it gives a verdict (a sandbox's tests), else by the task's verifier."""
        if turns[-1].finish_reason in ("abort", "prompt_too_long"):
            return EpisodeEnd(turns, gen_s, truncated=True)
        try:
            step = await self._hook(environment, "final", environment.final)
        except Exception as exc:  # a boundary we own, as for step()
            logger.exception("environment failed to judge the cut trajectory %s", trajectory_id)
            return _failed(turns, gen_s, exc)
        if step is None:
            return EpisodeEnd(turns, gen_s, truncated=True)
        return _verdict(step, turns, gen_s, trajectory_id, self.limits.reward_range, cut=True)

    async def _hook(self, environment: Environment, hook: Hook, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` (one of the environment's hooks) under its deadline: the environment's own, else the rollout's;
        a declared deadline that is not finite and above zero is the environment's error."""
        declared = environment.hook_timeout_s(hook)
        if declared is None:
            return await asyncio.wait_for(call(), timeout=self.limits.env_timeout_s)
        if isinstance(declared, bool) or not isinstance(declared, (int, float)) or not 0 < declared < math.inf:
            raise ValueError(f"{type(environment).__name__}.hook_timeout_s({hook!r}) = {declared!r}: not finite > 0")
        return await asyncio.wait_for(call(), timeout=float(declared))


def _verdict(
    step: EnvStep,
    turns: list[Turn],
    gen_s: float,
    trajectory_id: str,
    reward_range: tuple[float, float] | None,
    *,
    cut: bool,
) -> EpisodeEnd:
    """A done step's (``cut``: a cut episode's `Environment.final`) reward and status when it has a reward (a
    format error scores 0), else the task's verifier scores it. A reward that is not a finite number, or outside
    the task's range, fails this sample alone: the group's validation would refuse a NaN for all of them."""
    if step.reward is None:
        return EpisodeEnd(turns, gen_s, truncated=cut)
    if step.status == "format_error":
        return EpisodeEnd(turns, gen_s, reward=0.0, status="format_error", info=dict(step.info))
    problem, reason = reward_problem(step.reward), InfraReason.REWARD_INVALID
    if problem is None and reward_range is not None and not reward_range[0] <= float(step.reward) <= reward_range[1]:
        problem = f"reward {step.reward!r} is outside the task's range [{reward_range[0]}, {reward_range[1]}]"
        reason = InfraReason.REWARD_OUT_OF_RANGE
    if problem is not None:
        logger.warning("environment of trajectory %s: %s; infra_error", trajectory_id, problem)
        failure = InfraFailure(problem, reason=reason)
        return EpisodeEnd(turns, gen_s, info=dict(step.info), failure=failure)
    status: Status = "truncated" if cut else step.status
    return EpisodeEnd(turns, gen_s, reward=float(step.reward), status=status, info=dict(step.info))
