"""Agent episodes: a group's samples from agent-function runs against the generator's own endpoint.

For each prompt the generator runs ``group_size`` agent runs side by side, each with an
`openai.AsyncOpenAI` client pointed at a fresh, trained session (`Conversations.open`) of its endpoint.
When a run ends, its conversation's branches become samples (`Conversation.samples`: loss on sampled tokens only,
shared tokens trained once) that all carry the run's reward, the episode id (the session id) and the
branch index. A run that raised, timed out (``task.agent_timeout_s``) or returned no reward is one
``infra_error`` sample (reward None: masked from loss and baseline); a run that made no request at all
leaves a sample of its rendered prompt (no loss tokens) so the group keeps one sample per run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx2
import numpy as np
import openai

from actors.generator.serve.conversations import BranchSample
from actors.generator.serve.service import EndpointService
from pipeline.tasks import reward_problem
from pipeline.tasks.agents import AgentContext, AgentFunction, AgentOutcome
from pipeline.wire.prompts import Prompt
from pipeline.wire.trajectory import Sample

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
        self.failures: dict[str, int] = {}
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
        session = self.service.conversations.open(session_id)
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
        outcome: AgentOutcome | None = None
        error = ""
        sandboxed = self.sandboxes(prompt) if self.sandboxes is not None else None
        try:
            if sandboxed is not None:
                await sandboxed.opening()
                ctx = dataclasses.replace(ctx, sandbox=sandboxed.box)
            outcome = await asyncio.wait_for(self.agent(prompt, client, ctx), timeout=self.timeout_s)
            if sandboxed is not None and isinstance(outcome, AgentOutcome) and outcome.status != "format_error":
                verdict = await sandboxed.verify()  # the tests, not the agent, score a sandboxed run
                outcome = AgentOutcome(verdict.reward, info={**outcome.info, **verdict.info})
            if not isinstance(outcome, AgentOutcome):
                error = f"agent returned {type(outcome).__name__}, not an AgentOutcome"
            elif outcome.reward is None and outcome.status != "format_error":
                error = "agent returned no reward"
            elif outcome.status != "format_error" and (problem := reward_problem(outcome.reward)):
                error = f"agent: {problem}"
        except asyncio.TimeoutError:
            if sandboxed is not None and self.agent_timeout_is == "policy":  # the policy's failure: reward 0
                outcome = AgentOutcome(0.0, info={"error": "agent_timeout"})
            else:
                error = f"agent_timeout: the agent ran past task.agent_timeout_s = {self.timeout_s}"
        except Exception as exc:  # a boundary we own: any agent failure is that episode's infra_error
            reason = getattr(exc, "reason", None)  # a sandbox's or verifier's typed failure
            log.warning("agent run %s raised", session_id, exc_info=reason is None)
            error = f"{reason}: {exc}" if reason else f"agent raised {type(exc).__name__}: {exc}"
        finally:
            self.service.conversations.close(session_id)
            if sandboxed is not None:
                await sandboxed.aclose()
        elapsed = time.perf_counter() - start
        if error:
            self.failures[error.split(":")[0]] = self.failures.get(error.split(":")[0], 0) + 1
        branches = session.samples()
        if error or outcome is None:
            reason = error.split(":")[0] if ":" in error and " " not in error.split(":")[0] else "agent_error"
            reward, status, info = None, "infra_error", {"error": error, "infra_reason": reason}
        elif outcome.status == "format_error":
            reward, status, info = 0.0, "format_error", dict(outcome.info)
        else:
            reward, status, info = float(outcome.reward), "ok", dict(outcome.info)  # type: ignore[arg-type]
        if not branches or status == "infra_error":
            return [self._unscored(prompt, session_id, index, branches, info, start_wall, elapsed)]
        return [
            _sample(b, f"{session_id}-b{b.branch}", session_id, reward, status, prompt.tags, info, start_wall, elapsed)
            for b in branches
        ]

    def _unscored(
        self,
        prompt: Prompt,
        session_id: str,
        index: int,
        branches: list[BranchSample],
        info: dict,
        start_wall: float,
        elapsed: float,
    ) -> Sample:
        """One sample without a reward: the first branch's tokens (mask kept), or the bare prompt."""
        if branches:
            b = branches[0]
            return _sample(b, session_id, session_id, None, "infra_error", prompt.tags, info, start_wall, elapsed)
        ids = np.asarray(self.service.tokenizer.encode(prompt.text or "", add_special_tokens=True).ids or [0], np.int32)
        if prompt.token_ids is not None:
            ids = np.asarray(prompt.token_ids, np.int32)
        n = len(ids)
        return Sample(
            tokens=ids,
            loss_mask=np.zeros(n, np.uint8),
            logprobs=np.zeros(n, np.float32),
            versions=np.full(n, -1, np.int32),
            reward=None,
            reward_source="none",
            status="infra_error",
            finish_reason="abort",
            tags=prompt.tags,
            trajectory_id=session_id,
            gen_start_s=start_wall,
            gen_end_s=time.time(),
            gen_s=elapsed,
            info={**info, "error": info.get("error") or "agent made no request"},
            episode_id=session_id,
        )


def _sample(
    b: BranchSample,
    trajectory_id: str,
    episode_id: str,
    reward: float | None,
    status: str,
    tags: tuple[str, ...],
    info: dict,
    start_wall: float,
    elapsed: float,
) -> Sample:
    return Sample(
        tokens=b.tokens,
        loss_mask=b.loss_mask,
        logprobs=b.logprobs,
        versions=b.versions,
        reward=reward,
        reward_source="none" if reward is None else "verifier",
        status=status,  # type: ignore[arg-type]
        finish_reason=b.finish_reason,  # type: ignore[arg-type]
        tags=tags,
        trajectory_id=trajectory_id,
        gen_start_s=start_wall,
        gen_end_s=time.time(),
        num_turns=b.num_turns,
        gen_s=elapsed,
        info=info,
        episode_id=episode_id,
        branch=b.branch,
    )
