"""The engine-facing part of a batch: a batch's prompts become groups of scored samples.

Agent tasks (`task.agent`) run an agent function per sample against the generator's own endpoint
(`actors/generator/agents.py`). Single-turn tasks send every group's requests to the engine at once and score each group as soon as its
samples are done (`Rollouts.stream_groups`); multi-turn tasks (an environment,
`pipeline.rl.episodes.environment_factory`) run `run_group` per prompt, calling the engine once per turn.
A prompt whose rollout fails gets its exception in place of its samples, so it fails alone; the
generator's loop (`actors/generator/loop.py`) decides what to publish, nak or dead-letter. A group past the run's
caps (`rollout.max_group_samples`, `rollout.max_group_tokens`: `pipeline.wire.group_limits`) is never published:
it fails as `GroupTooLarge`, which the trainer's door would refuse anyway (`group_too_large`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Future

from tokenizers import Tokenizer

from actors.generator.agents import AgentRunner
from actors.generator.engines.base import GenerateResult, SamplingParams
from actors.generator.metrics import Submit
from pipeline.chat.template import ChatTemplate
from pipeline.config_sections import RolloutConfig
from pipeline.rl.engine_records import Generate
from pipeline.rl.episodes import environment_factory
from pipeline.rl.scoring import group_requests, run_group, score_group
from pipeline.tasks import Task, VerifierPool
from pipeline.wire.group_limits import GROUP_TOO_LARGE, GroupLimits
from pipeline.wire.prompts import Prompt
from pipeline.wire.trajectory import Sample

log = logging.getLogger(__name__)

Outcome = list[Sample] | BaseException
"""What a batch's rollout yields per prompt: its group's samples, or the exception that failed it alone."""


class GroupTooLarge(Exception):
    """A group past the run's caps (samples or tokens): not published; `reason` is the trainer's dead-letter code."""

    reason = GROUP_TOO_LARGE

    def __init__(self, group_id: str, why: str) -> None:
        super().__init__(f"group {group_id!r} not published: {why}")
        self.group_id = group_id


def capped(prompts: Sequence[Prompt], outcomes: Sequence[Outcome], limits: GroupLimits) -> list[Outcome]:
    """`outcomes` with every group past `limits` replaced by its `GroupTooLarge` (a typed failure of that prompt)."""
    out: list[Outcome] = []
    for prompt, outcome in zip(prompts, outcomes, strict=True):
        if not isinstance(outcome, BaseException):
            why = limits.refusal(len(outcome), sum(int(s.tokens.size) for s in outcome))
            if why is not None:
                log.error("group %s is too large to publish: %s", prompt.prompt_id, why)
                outcome = GroupTooLarge(prompt.prompt_id, why)
        out.append(outcome)
    return out


class Rollouts:
    """Generates and scores a batch's groups with one engine (its metered `generate` and `submit`)."""

    def __init__(
        self,
        *,
        generate: Generate,
        submit: Submit,
        task: Task,
        sampling: SamplingParams,
        tokenizer: Tokenizer,
        verifiers: VerifierPool,
        group_size: int,
        agents: AgentRunner | None = None,
        template: ChatTemplate | None = None,
        rollout: RolloutConfig | None = None,
    ) -> None:
        self.rollout = rollout or RolloutConfig()
        self.agents = agents
        self.template = template
        self.generate = generate
        self.submit = submit
        self.task = task
        self.sampling = sampling
        self.tokenizer = tokenizer
        self.verifiers = verifiers
        self.group_size = group_size
        self.environment = environment_factory(task)
        self.limits = GroupLimits.for_run(
            group_size=group_size,
            max_sample_tokens=None,  # the engine bounds each sample by its own context
            max_samples=self.rollout.max_group_samples,
            max_tokens=self.rollout.max_group_tokens,
        )

    async def run(self, prompts: list[Prompt], prompt_ids: Sequence[list[int]]) -> list[Outcome]:
        """Every prompt's group: agent runs for an agent task, episodes for a multi-turn task, else one streamed
        engine call; a group past the caps fails as `GroupTooLarge`."""
        outcomes: list[Outcome]
        if self.agents is not None:
            runs = (self.agents.group(prompt, self.group_size) for prompt in prompts)
            outcomes = list(await asyncio.gather(*runs, return_exceptions=True))
        elif self.environment is not None:
            outcomes = await self.episodes(prompts)
        else:
            outcomes = await self.stream_groups(prompts, list(prompt_ids))
        return capped(prompts, outcomes, self.limits)

    async def stream_groups(self, prompts: list[Prompt], prompt_ids: list[list[int]]) -> list[Outcome]:
        """All groups' requests (concurrency x group_size) go to the engine at once; each group is scored as
        soon as its G samples are done, while the engine still decodes the others.

        If the engine refuses or fails a group's requests, that group is generated again alone (one at a
        time), so one prompt that breaks the engine fails alone.
        """
        group_size = self.group_size
        requests = [
            request
            for prompt, ids in zip(prompts, prompt_ids, strict=True)
            for request in group_requests(ids, group_size, group_id=prompt.prompt_id)
        ]
        futures: list[Future[GenerateResult]] | None
        try:
            futures = self.submit(requests, self.sampling)
        except Exception as exc:
            if len(prompts) == 1:
                return [exc]
            log.warning("engine refused a batch of %d prompts; generating each alone", len(prompts), exc_info=True)
            futures = None
        alone = asyncio.Lock()

        async def group(k: int) -> list[Sample]:
            prompt, ids = prompts[k], prompt_ids[k]
            results: list[GenerateResult] | BaseException
            if futures is None:
                results = await self.generate_alone(alone, prompt, ids)
            else:
                try:
                    own = futures[k * group_size : (k + 1) * group_size]
                    results = list(await asyncio.gather(*(asyncio.wrap_future(f) for f in own)))
                except Exception as exc:
                    if len(prompts) == 1:
                        raise
                    log.warning("engine failed group %s; generating it alone", prompt.prompt_id, exc_info=exc)
                    results = await self.generate_alone(alone, prompt, ids)
            if isinstance(results, BaseException):
                raise results
            return await score_group(
                self.task,
                prompt,
                ids,
                results,
                self.sampling,
                tokenizer=self.tokenizer,
                group_id=prompt.prompt_id,
                verifiers=self.verifiers,
            )

        return list(await asyncio.gather(*(group(k) for k in range(len(prompts))), return_exceptions=True))

    async def generate_alone(
        self, alone: asyncio.Lock, prompt: Prompt, prompt_ids: list[int]
    ) -> list[GenerateResult] | BaseException:
        """One group in an engine call of its own (one such call at a time: `alone`)."""
        requests = group_requests(prompt_ids, self.group_size, group_id=prompt.prompt_id)
        async with alone:
            try:
                return await asyncio.to_thread(self.generate, requests, self.sampling)
            except Exception as exc:
                return exc

    async def episodes(self, prompts: list[Prompt]) -> list[Outcome]:
        """Multi-turn groups: `run_group` per prompt, its episodes calling the engine once per turn."""
        assert self.environment is not None
        groups = (
            run_group(
                self.generate,
                self.task,
                prompt,
                self.group_size,
                self.sampling,
                self.environment,
                tokenizer=self.tokenizer,
                verifiers=self.verifiers,
                group_id=prompt.prompt_id,
                template=self.template,
                infra_retries=self.rollout.infra_retries,
                strict_truncation=self.rollout.strict_truncation,
            )
            for prompt in prompts
        )
        return list(await asyncio.gather(*groups, return_exceptions=True))
