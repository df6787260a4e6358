"""Scoring: prompts and engine results in, one scored `Sample` per trajectory out, and `build_sample`, the one
place a `Sample` is made (single-turn groups, episodes and the generator's agent runs all call it).

Status of a sample:
- ``ok``: finished normally; reward from the verifier (or from an environment that ends with a reward).
- ``truncated``: a reply hit its length limit (or the turn/token limits ran out): that turn stays, no later
  turn is generated, and the sample is still scored by the verifier.
- ``format_error``: the verifier (or environment) rejected the format: reward 0, trained on.
- ``infra_error``: the verifier or environment raised, timed out, or gave a reward that is not a finite
  number (NaN, inf: `pipeline.tasks.reward_problem`) or lies outside the task's ``reward_range`` (an
  environment's done step and a cut episode's ``final`` verdict alike): reward None, ``reward_source = none``; the trainer masks
  it out of the loss and the group baseline, and the group's other samples are unaffected. Its
  ``info["infra_reason"]`` names why (`pipeline.failures.InfraReason`, `failure_info`).
- ``aborted``: the engine aborted the generation: reward None, never scored.
- A reply the engine refused because its context (prompt, or earlier turns) left no room under the engine's
  maximum length (finish reason ``prompt_too_long``) makes the sample an ``infra_error``: reward None, never
  scored, so the trainer never trains on it; the other samples of the group are unaffected.

Generation and scoring are separate steps: `score_group` turns the results of one prompt's
``group_size`` requests (`group_requests`) into scored samples, so a generator can serve many groups
with one batched engine call and score each afterwards. `run_group` does both for one group: one
generate call (single-turn), or, with an environment, concurrent episodes (`pipeline.rl.episodes`) with one
generate call per turn, an episode that ends as an ``infra_error`` run again up to ``infra_retries`` times.
Generate calls run in a worker thread (generation is synchronous torch); verifiers run on a
`pipeline.tasks.VerifierPool`, threads of their own, so a hung verifier never holds up generation.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.failures import InfraReason
from pipeline.rl.engine_records import Generate, GenerateRequest, GenerateResult, SamplingParams
from pipeline.rl.episodes import (
    ENV_TIMEOUT_S,
    MAX_TURNS,
    EnvironmentFactory,
    EpisodeEnd,
    EpisodeLimits,
    Episodes,
)
from pipeline.rl.prompt_ids import Tokenizer, prompt_token_ids
from pipeline.rl.turns import Trajectory, Turn, decode
from pipeline.tasks import Prompt, Task, VerifierPool, VerifierResult
from pipeline.wire.trajectory import FinishReason, Sample, Status

if TYPE_CHECKING:
    from pipeline.chat.template import ChatTemplate

logger = logging.getLogger(__name__)


def build_sample(
    trajectory: Trajectory,
    *,
    trajectory_id: str,
    reward: float | None,
    status: Status,
    tags: Sequence[str],
    gen_s: float,
    verify_s: float = 0.0,
    info: Mapping[str, Any] | None = None,
    gen_start_s: float = math.nan,
    gen_end_s: float = math.nan,
    episode_id: str = "",
    branch: int = 0,
) -> Sample:
    """A sample of `trajectory`: ``reward_source`` is ``verifier`` when it has a reward, else ``none``.
    ``episode_id`` and ``branch`` place an agent run's branch in its episode (`Sample`)."""
    routes = trajectory.routes
    info = dict(info or {})
    if routes is not None and routes.recomputed:
        info["recomputed_route_positions"] = routes.recomputed
    return Sample(
        routes=None if routes is None else routes.routes,
        route_versions=None if routes is None else routes.versions,
        tokens=trajectory.tokens,
        loss_mask=trajectory.loss_mask,
        logprobs=trajectory.logprobs,
        versions=trajectory.versions,
        reward=reward,
        reward_source="none" if reward is None else "verifier",
        status=status,
        finish_reason=trajectory.finish_reason,
        num_turns=trajectory.num_turns,
        tags=tags,
        trajectory_id=trajectory_id,
        gen_start_s=gen_start_s,
        gen_end_s=gen_end_s,
        gen_s=gen_s,
        verify_s=verify_s,
        info=info,
        episode_id=episode_id,
        branch=branch,
    )


def failure_info(reason: InfraReason, error: str, info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``info`` of an ``infra_error`` sample: ``info`` with the ``error`` and the ``infra_reason`` (the
    reason's value, what the generator's ``failure_reasons`` counts)."""
    return {**(info or {}), "error": error, "infra_reason": InfraReason(reason).value}


def sample_status(finish_reason: FinishReason, truncated: bool, verdict: VerifierResult | None) -> Status:
    """Precedence: aborted > infra_error > format_error > truncated > ok."""
    if finish_reason == "abort":
        return "aborted"
    if verdict is not None and verdict.status != "ok":
        return verdict.status
    return "truncated" if truncated else "ok"


@dataclass
class Scorer:
    """What every sample of a group shares: builds a sample and scores it with the task's verifier."""

    task: Task
    prompt: Prompt
    sampling: SamplingParams
    tokenizer: Tokenizer
    verifiers: VerifierPool
    group_id: str

    def sample(
        self,
        index: int,
        turns: list[Turn],
        *,
        reward: float | None,
        status: Status,
        gen_s: float,
        verify_s: float = 0.0,
        info: Mapping[str, Any] | None = None,
    ) -> Sample:
        return build_sample(
            Trajectory.of(turns),
            trajectory_id=f"{self.group_id}-{index}",
            reward=reward,
            status=status,
            tags=self.prompt.tags,
            gen_s=gen_s,
            verify_s=verify_s,
            info=info,
        )

    async def finish(self, index: int, turns: list[Turn], gen_s: float, truncated: bool) -> Sample:
        """Score the completion (everything after the prompt) with the task's verifier and build the sample."""
        finish_reason = turns[-1].finish_reason or "abort"
        if finish_reason == "abort":
            return self.sample(index, turns, reward=None, status="aborted", gen_s=gen_s)
        if finish_reason == "prompt_too_long":
            info = {"error": "prompt_too_long: the context left no room for a reply under the engine's max_len"}
            return self.sample(index, turns, reward=None, status="infra_error", gen_s=gen_s, info=info)
        stops = self.sampling.stop_token_ids
        completion = [t.without_stop(stops) for t in turns if t.kind != "prompt"]
        text = "".join(decode(self.tokenizer, ids) for ids in completion)
        start = time.perf_counter()
        verdict = await self.verifiers.verify(self.task, self.prompt, text, np.concatenate(completion))
        return self.sample(
            index,
            turns,
            reward=verdict.reward,
            status=sample_status(finish_reason, truncated, verdict),
            gen_s=gen_s,
            verify_s=time.perf_counter() - start,
            info=verdict.info,
        )

    async def episode(self, index: int, end: EpisodeEnd) -> Sample:
        """The sample of a multi-turn episode, scored as `EpisodeEnd` says: an environment failure is an
        ``infra_error`` of its typed reason, an environment's verdict stands, anything else goes to the verifier."""
        if end.failure is not None:
            error = f"environment: {end.failure.detail}"
            info = failure_info(end.failure.reason, error, end.info)
            return self.sample(index, end.turns, reward=None, status="infra_error", gen_s=end.gen_s, info=info)
        if end.status is not None:
            return self.sample(index, end.turns, reward=end.reward, status=end.status, gen_s=end.gen_s, info=end.info)
        return await self.finish(index, end.turns, end.gen_s, end.truncated)


def group_requests(prompt_ids: Sequence[int], group_size: int, group_id: str) -> list[GenerateRequest]:
    """The ``group_size`` requests of one single-turn group; request ``i`` becomes trajectory ``<group_id>-<i>``."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return [GenerateRequest(prompt_ids, request_id=f"{group_id}-{i}") for i in range(group_size)]


async def score_group(
    task: Task,
    prompt: Prompt,
    prompt_ids: Sequence[int],
    results: Sequence[GenerateResult],
    sampling: SamplingParams,
    *,
    tokenizer: Tokenizer,
    group_id: str,
    verifiers: VerifierPool,
) -> list[Sample]:
    """One sample per single-turn result, in order, each scored by the task's verifier on `verifiers`.

    ``results`` answer `group_requests` of ``prompt_ids`` (however many engine calls produced them);
    every sample comes back, whatever its status (an aborted one unscored).
    """
    scorer = Scorer(task, prompt, sampling, tokenizer, verifiers, group_id)
    return list(
        await asyncio.gather(
            *(
                scorer.finish(
                    i, [Turn.context("prompt", prompt_ids), Turn.policy(r)], r.gen_s, r.finish_reason == "length"
                )
                for i, r in enumerate(results)
            )
        )
    )


async def run_group(
    generate: Generate,
    task: Task,
    prompt: Prompt,
    group_size: int,
    sampling: SamplingParams,
    env: EnvironmentFactory | None = None,
    *,
    tokenizer: Tokenizer,
    verifiers: VerifierPool,
    env_timeout_s: float = ENV_TIMEOUT_S,
    max_turns: int = MAX_TURNS,
    max_total_tokens: int | None = None,
    group_id: str | None = None,
    template: ChatTemplate | None = None,
    infra_retries: int = 0,
    strict_truncation: bool = False,
) -> list[Sample]:
    """Roll out ``group_size`` samples of one prompt; every sample comes back, whatever its status.

    Without ``env``: one generate call, then `score_group`. With ``env``: each sample alternates policy
    replies and environment messages for at most ``max_turns`` replies and ``max_total_tokens`` tokens.
    `template` renders a chat prompt and an environment's chat ``messages``. An episode that ends as an
    ``infra_error`` is run again, with a fresh environment, up to ``infra_retries`` times; ``strict_truncation``
    gives reward 0 to an episode one of whose replies filled its token limit.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    group_id = group_id or uuid.uuid4().hex
    prompt_ids = prompt_token_ids(prompt, tokenizer, template)
    if max_total_tokens is not None and len(prompt_ids) >= max_total_tokens:
        raise ValueError(
            f"prompt {prompt.prompt_id!r} has {len(prompt_ids)} tokens, no room under "
            f"max_total_tokens={max_total_tokens}"
        )
    if env is None:
        results = await asyncio.to_thread(generate, group_requests(prompt_ids, group_size, group_id), sampling)
        scoring = {"tokenizer": tokenizer, "group_id": group_id, "verifiers": verifiers}
        return await score_group(task, prompt, prompt_ids, results, sampling, **scoring)  # type: ignore[arg-type]
    scorer = Scorer(task, prompt, sampling, tokenizer, verifiers, group_id)
    limits = EpisodeLimits(env_timeout_s, max_turns, max_total_tokens, strict_truncation, task.reward_range)
    episodes = Episodes(generate, sampling, tokenizer, limits, template)

    async def episode(i: int) -> Sample:
        for attempt in range(infra_retries + 1):
            sample = await scorer.episode(i, await episodes.run(env(prompt), prompt_ids, f"{group_id}-{i}"))
            if sample.status != "infra_error":
                break
            logger.warning("trajectory %s-%d: %s (try %d)", group_id, i, sample.info.get("error"), attempt + 1)
        return replace(sample, info={**sample.info, "attempts": attempt + 1})

    return list(await asyncio.gather(*(episode(i) for i in range(group_size))))
