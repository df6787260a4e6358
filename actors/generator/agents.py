"""Agent episodes: a group's samples from agent-function runs against the generator's own endpoint.

For each prompt the generator runs ``group_size`` agent runs side by side, each with an
`openai.AsyncOpenAI` client pointed at a fresh, trained session (`Conversations.open`) of its endpoint.
When a run ends, its conversation's branches become samples (`Conversation.samples`: loss on sampled tokens only,
shared tokens trained once) that all carry the run's reward, the episode id (the session id) and the
branch index. A run that raised, timed out (``task.agent_timeout_s``) or returned no reward is one
``infra_error`` sample (reward None: masked from loss and baseline) whose ``info["infra_reason"]`` is an
`pipeline.failures.InfraReason`: the exception's own (`InfraFailure.reason`: a sandbox lost, a verifier timed out),
else ``agent_timeout``, ``agent_error``, or ``reward_invalid`` for a reward that is not a finite number; a run whose
session went past its share (``generator.serve.max_session_branches`` or ``max_session_tokens``: a request of it
was refused), or that found every session of the generator held (``max_sessions``), is ``session_limit``
whatever it returned. A sandboxed
run (a Harbor task's) is scored by the task's tests in a sandbox of their own once the agent returns
(`HarborEpisode.verify`), and a sandbox the agent's own commands broke (`SandboxBroken`) is the policy's failure:
reward 0, ``info["error"] = "sandbox_broken"``. A run that
made no request at all leaves a sample of its prompt as rendered for the model (`prompt_token_ids`, the
endpoint's chat template; no loss tokens) so the group keeps one sample per run. Every sample is made by
`pipeline.rl.scoring.build_sample`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import openai

from actors.generator.serve.conversations import BranchSample, SessionFull
from actors.generator.serve.service import EndpointService
from pipeline.failures import InfraFailure, InfraReason
from pipeline.rl.prompt_ids import prompt_token_ids
from pipeline.rl.scoring import build_sample, failure_info
from pipeline.rl.turns import Trajectory, Turn
from pipeline.sandbox.base import SandboxBroken
from pipeline.tasks import reward_problem
from pipeline.tasks.agents import AgentContext, AgentFunction, AgentOutcome
from pipeline.tasks.environment import Hook
from pipeline.wire.prompts import Prompt
from pipeline.wire.trajectory import Sample, Status

log = logging.getLogger(__name__)


class AgentRunner:
    """Runs an agent function per sample on sessions of one endpoint (``base_url`` is its root URL)."""

    def __init__(
        self,
        agent: AgentFunction,
        service: EndpointService,
        *,
        base_url: str,
        api_key: str | None,
        timeout_s: float,
        max_tokens: int,
        sandboxes: Callable[[Prompt], Any] | None = None,
        agent_timeout_is: str = "infra",
    ) -> None:
        self.agent_timeout_is = agent_timeout_is
        """A sandboxed run past its timeout: ``policy`` (reward 0, `rollout.agent_timeout_is`) or ``infra``."""
        self.sandboxes = sandboxes
        """A sandboxed task's episode maker (`HarborTask.environment`): each run gets the episode's sandbox in
        ``ctx.sandbox``, and the episode's tests score it once the agent returns."""
        self.agent = agent
        self.service = service
        self.base_url = base_url
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self._http: httpx2.AsyncClient | None = None

    def http(self) -> httpx2.AsyncClient:
        """One connection pool for every run's client (building one per client costs ~20 ms: an SSL context)."""
        if self._http is None:
            limits = httpx2.Limits(max_connections=None, max_keepalive_connections=256)
            self._http = httpx2.AsyncClient(limits=limits, timeout=self.timeout_s)
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def group(self, prompt: Prompt, group_size: int) -> list[Sample]:
        """Every run's samples, in run order."""
        runs = await asyncio.gather(*(self.episode(prompt, i) for i in range(group_size)))
        return [sample for run in runs for sample in run]

    async def episode(self, prompt: Prompt, index: int) -> list[Sample]:
        session_id = f"{prompt.prompt_id}-{index}-{uuid.uuid4().hex[:8]}"
        try:
            session = self.service.conversations.open(session_id)
        except SessionFull as exc:
            log.warning("agent run %s not started: %s", session_id, exc)
            run = _Run(prompt, session_id, time.time(), 0.0)
            return [self._unscored(run, [], failure_info(exc.reason, str(exc)))]
        base_url = f"{self.base_url}/sessions/{session_id}/v1"
        ctx = AgentContext(session_id, base_url, self.api_key, self.service.model, self.max_tokens, index)
        client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=self.timeout_s,
            http_client=self.http(),
        )
        start_wall, start = time.time(), time.perf_counter()
        sandboxed = self.sandboxes(prompt) if self.sandboxes is not None else None
        try:
            outcome, failure = await self._attempt(prompt, client, ctx, sandboxed)
        finally:
            self.service.conversations.close(session_id)
            if sandboxed is not None:
                await sandboxed.aclose()
        elapsed = time.perf_counter() - start
        branches = await asyncio.to_thread(session.samples)
        run = _Run(prompt, session_id, start_wall, elapsed)
        if session.refused is not None:  # past its share: whatever the agent made of the refusal
            failure = (session.refused.reason, str(session.refused))
        if failure is not None:
            return [self._unscored(run, branches, failure_info(*failure))]
        assert outcome is not None  # `_unusable` refused anything but an AgentOutcome
        if not branches:
            return [self._unscored(run, branches, outcome.info)]
        if outcome.status == "format_error":
            reward, status = 0.0, "format_error"
        else:
            reward, status = float(outcome.reward), "ok"  # type: ignore[arg-type]
        return [run.sample(b, f"{session_id}-b{b.branch}", reward, status, outcome.info, b.branch) for b in branches]

    async def _attempt(
        self, prompt: Prompt, client: openai.AsyncOpenAI, ctx: AgentContext, sandboxed: Any
    ) -> tuple[AgentOutcome | None, tuple[InfraReason, str] | None]:
        """The agent's run (in its sandbox, scored by the sandbox's tests when it has one): its outcome, or why it
        is an ``infra_error``, as (reason, error)."""
        timeout_s = self.timeout_s if sandboxed is None else min(self.timeout_s, sandboxed.dir.agent_timeout_s)
        try:
            if sandboxed is not None:
                await _hook(sandboxed, "opening", sandboxed.opening)
                ctx = dataclasses.replace(ctx, sandbox=sandboxed.box)
            outcome = await asyncio.wait_for(self.agent(prompt, client, ctx), timeout=timeout_s)
            if sandboxed is not None and isinstance(outcome, AgentOutcome) and outcome.status != "format_error":
                # the tests, not the agent, score a sandboxed run, in a sandbox of their own (`HarborEpisode.verify`)
                verdict = await _hook(sandboxed, "final", sandboxed.verify)
                outcome = AgentOutcome(verdict.reward, info={**outcome.info, **verdict.info})
            return outcome, _unusable(outcome)
        except SandboxBroken as exc:  # the agent's own commands broke its sandbox: the policy's failure, reward 0
            verdict = sandboxed.broken(exc)
            return AgentOutcome(verdict.reward, info=verdict.info), None
        except asyncio.TimeoutError:
            if sandboxed is not None and self.agent_timeout_is == "policy":  # the policy's failure: reward 0
                return AgentOutcome(0.0, info={"error": InfraReason.AGENT_TIMEOUT.value}), None
            detail = f"the agent ran past its timeout ({timeout_s:g} s: task.agent_timeout_s, [agent] timeout_sec)"
            return None, (InfraReason.AGENT_TIMEOUT, f"{InfraReason.AGENT_TIMEOUT.value}: {detail}")
        except InfraFailure as exc:  # a sandbox's or verifier's typed failure; its message names the reason
            log.warning("agent run %s failed: %s", ctx.session_id, exc)
            return None, (exc.reason, str(exc))
        except Exception as exc:  # a boundary we own: any agent failure is that episode's infra_error
            log.warning("agent run %s raised", ctx.session_id, exc_info=True)
            return None, (InfraReason.AGENT_ERROR, f"agent raised {type(exc).__name__}: {exc}")

    def _unscored(self, run: _Run, branches: list[BranchSample], info: dict[str, Any]) -> Sample:
        """One ``infra_error`` sample without a reward: the first branch's tokens (mask kept), or, for a run that
        made no request, the prompt as a generator renders it (`prompt_token_ids`: a chat with the endpoint's chat
        template and its generation prompt), without loss tokens."""
        if branches:
            first = branches[0]
            return run.sample(first, run.episode_id, None, "infra_error", info, first.branch)
        ids = prompt_token_ids(run.prompt, self.service.tokenizer, self.service.template)
        info = {**info, "error": info.get("error") or "agent made no request"}
        prompt_only = Trajectory.of([Turn.context("prompt", ids)])
        return run.sample(prompt_only, run.episode_id, None, "infra_error", info, 0)


@dataclasses.dataclass(frozen=True)
class _Run:
    """One agent run, as its samples carry it: the episode id is the session id."""

    prompt: Prompt
    episode_id: str
    start_wall: float
    elapsed: float

    def sample(
        self,
        trajectory: Trajectory,
        trajectory_id: str,
        reward: float | None,
        status: Status,
        info: dict[str, Any],
        branch: int,
    ) -> Sample:
        return build_sample(
            trajectory,
            trajectory_id=trajectory_id,
            reward=reward,
            status=status,
            tags=self.prompt.tags,
            gen_s=self.elapsed,
            info=info,
            gen_start_s=self.start_wall,
            gen_end_s=time.time(),
            episode_id=self.episode_id,
            branch=branch,
        )


async def _hook(sandboxed: Any, hook: Hook, call: Callable[[], Awaitable[Any]]) -> Any:
    """A sandboxed episode's `opening` or `verify` under the deadline the episode declares for it (its task's
    timeouts: `HarborEpisode.hook_timeout_s`); past it, an ``environment_timeout``, never the agent's timeout."""
    try:
        return await asyncio.wait_for(call(), timeout=sandboxed.hook_timeout_s(hook))
    except asyncio.TimeoutError:
        detail = f"the sandbox's {hook} ran past its deadline"
        raise InfraFailure(detail, reason=InfraReason.ENVIRONMENT_TIMEOUT) from None


def _unusable(outcome: object) -> tuple[InfraReason, str] | None:
    """Why what an agent returned cannot score its run, as (reason, error); None: it can."""
    if not isinstance(outcome, AgentOutcome):
        return InfraReason.AGENT_ERROR, f"agent returned {type(outcome).__name__}, not an AgentOutcome"
    if outcome.status == "format_error":
        return None
    if outcome.reward is None:
        return InfraReason.AGENT_ERROR, "agent returned no reward"
    if problem := reward_problem(outcome.reward):
        return InfraReason.REWARD_INVALID, f"agent: {problem}"
    return None
