"""Rollouts: prompts and engine results in, one `Sample` per trajectory out. Tokens in, tokens out.

A trajectory is the token ids the sampler saw and produced, in order, as turns::

    turn      prompt            policy reply          env message     policy reply
    tokens    <bos> 3 1 4 >     4 1 3 <eos>           | n o |         4 1 3 <eos>
    loss_mask 0     0 0 0 0     1 1 1 1               0 0 0 0         1 1 1 1
    versions  -1   -1 -1 -1 -1  7 7 8 8               -1 -1 -1 -1     8 8 8 8
    logprobs  0     0 0 0 0     behaviour log-probs   0 0 0 0         behaviour log-probs

Policy tokens carry the engine's per-token version and behaviour log-prob (the version may change inside
a reply: in-flight weight update). Prompt and environment tokens carry loss mask 0, version -1, log-prob 0.
Nothing is re-tokenized: the environment sees decoded text, but the trajectory keeps the sampled ids,
and an environment message given as text is tokenized once, on its own, without special tokens.

Status of a sample:
- ``ok``: finished normally; reward from the verifier (or from an environment that ends with a reward).
- ``truncated``: a reply hit its length limit (or the turn/token limits ran out): that turn stays, no later
  turn is generated, and the sample is still scored by the verifier.
- ``format_error``: the verifier (or environment) rejected the format: reward 0, trained on.
- ``infra_error``: the verifier or environment raised, timed out, or gave a reward that is not a finite
  number (NaN, inf: `pipeline.tasks.reward_problem`): reward None, ``reward_source = none``; the trainer masks
  it out of the loss and the group baseline, and the group's other samples are unaffected.
- ``aborted``: the engine aborted the generation: reward None, never scored.
- A reply the engine refused because its context (prompt, or earlier turns) left no room under the engine's
  maximum length (finish reason ``prompt_too_long``) makes the sample an ``infra_error``: reward None, never
  scored, so the trainer never trains on it; the other samples of the group are unaffected.

The engine records (`SamplingParams`, `GenerateRequest`, `GenerateResult`) are defined here, at the
rollout's edge, so that ``pipeline/`` needs no import from ``actors/``; the engine itself
(`actors/generator/engines/base.py`) re-exports them, and a rollout only needs its `Generate` callable.

Generation and scoring are separate steps: `score_group` turns the results of one prompt's
``group_size`` requests (`group_requests`) into scored samples, so a generator can serve many groups
with one batched engine call and score each afterwards. `run_group` does both for one group: one
generate call (single-turn), or, with an environment, concurrent episodes with one generate call per
turn. Generate calls run in a worker thread (generation is synchronous torch); verifiers run on a
`pipeline.tasks.VerifierPool`, threads of their own, so a hung verifier never holds up generation.

`checked_prompt_ids` decides, before any engine call, whether a prompt can ever be rolled out (ids inside
the vocabulary, room for one new token in the context): a prompt that cannot raises `UnrunnablePrompt`
with a dead-letter reason, so a generator refuses it alone instead of failing the engine call of a batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from pipeline.rl.env_messages import NotBridged, encode, step_ids
from pipeline.tasks import Prompt, Task, VerifierPool, VerifierResult, reward_problem
from pipeline.tasks.environment import Environment
from pipeline.wire.trajectory import FinishReason, Sample, Status

if TYPE_CHECKING:
    from pipeline.chat.template import ChatTemplate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How to draw tokens. ``temperature == 0`` means greedy decoding (each token's log-prob is then 0:
    it was drawn from a point mass). ``top_k == 0`` and ``top_p == 1.0`` switch those filters off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True)
class GenerateRequest:
    """One sequence to continue. ``seed`` fixes this request's sampling stream independently of the
    rest of the batch (None: drawn from the engine's generator); ``max_new_tokens`` overrides the
    sampling params' budget for this request (a later turn of a multi-turn episode has less room);
    ``keep_prefix`` asks the engine to keep the finished sequence's KV cache for a next turn that extends it
    (multi-turn episodes; a single-turn rollout has no next turn)."""

    input_ids: Sequence[int] | np.ndarray
    seed: int | None = None
    max_new_tokens: int | None = None
    request_id: str = ""
    keep_prefix: bool = False

    def __post_init__(self) -> None:
        if len(self.input_ids) == 0:
            raise ValueError(f"GenerateRequest {self.request_id!r}: input_ids is empty")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(
                f"GenerateRequest {self.request_id!r}: max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )


@dataclass
class GenerateResult:
    """The continuation of one request; the three arrays have one entry per generated token.

    Example (prompt ``[1, 5, 6]``, stop token 2, a weight swap before the second decode step)::

        token_ids = [7, 9, 2]          # int32, the stop token included
        logprobs  = [-0.3, -1.2, -0.1] # float32, behaviour log-probs
        versions  = [0, 1, 1]          # int32
        finish_reason = "stop"
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason
    request_id: str = ""
    gen_s: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert len(self.logprobs) == n and len(self.versions) == n, "per-token arrays must align"


Generate = Callable[[Sequence[GenerateRequest], SamplingParams], list[GenerateResult]]
"""A blocking generate call: results in request order (`Engine.generate`, or a wrapper that meters it)."""


ENV_TIMEOUT_S = 60.0
"""Default limit on one `Environment.step` call; past it the sample is an ``infra_error``."""
MAX_TURNS = 8
"""Default number of policy replies in a multi-turn episode; an episode still running after it is truncated."""


class Tokenizer(Protocol):
    """What the rollout needs from a tokenizer: ``tokenizers.Tokenizer`` and HF fast tokenizers both fit
    (``encode`` may return an ``Encoding`` with ``.ids`` or a list of ids)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


EnvironmentFactory = Callable[[Prompt], Environment]
"""Builds a fresh environment per sample (the samples of a group run side by side)."""


def environment_factory(task: Task) -> EnvironmentFactory | None:
    """A `multi_turn` task's ``environment(prompt) -> Environment``; a single-turn task has none."""
    return task.environment if task.multi_turn else None


@dataclass
class Turn:
    """A run of tokens from one source: ``prompt`` and ``env`` turns have loss mask 0 and version -1."""

    kind: Literal["prompt", "policy", "env"]
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason | None = None

    @classmethod
    def context(cls, kind: Literal["prompt", "env"], token_ids: Sequence[int] | np.ndarray) -> Turn:
        ids = np.asarray(token_ids, dtype=np.int32)
        return cls(kind, ids, np.zeros(len(ids), np.float32), np.full(len(ids), -1, np.int32))

    @classmethod
    def policy(cls, result: GenerateResult) -> Turn:
        return cls(
            "policy",
            np.asarray(result.token_ids, np.int32),
            np.asarray(result.logprobs, np.float32),
            np.asarray(result.versions, np.int32),
            result.finish_reason,
        )


def assemble(turns: Sequence[Turn]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32, loss_mask uint8, logprobs float32, versions int32) of the turns, concatenated."""
    tokens = np.concatenate([t.token_ids for t in turns]).astype(np.int32)
    loss_mask = np.concatenate([np.full(len(t.token_ids), t.kind == "policy", np.uint8) for t in turns])
    logprobs = np.concatenate([t.logprobs for t in turns]).astype(np.float32)
    versions = np.concatenate([t.versions for t in turns]).astype(np.int32)
    return tokens, loss_mask, logprobs, versions


def sample_status(finish_reason: FinishReason, truncated: bool, verdict: VerifierResult | None) -> Status:
    """Precedence: aborted > infra_error > format_error > truncated > ok."""
    if finish_reason == "abort":
        return "aborted"
    if verdict is not None and verdict.status != "ok":
        return verdict.status
    return "truncated" if truncated else "ok"


def prompt_token_ids(prompt: Prompt, tokenizer: Tokenizer, template: ChatTemplate | None = None) -> list[int]:
    """The ids a prompt is rolled out from: its text with special tokens (``<bos>``), its given ids, or its chat
    rendered with `template` and the generation prompt (`NoChatTemplate` without one)."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    if prompt.messages is not None:
        if template is None:
            raise NoChatTemplate(
                f"prompt {prompt.prompt_id!r} is a chat (messages), and this model has no chat template: set "
                "model.chat_template, or give model.tokenizer a directory with a tokenizer_config.json that has one"
            )
        return template.render(prompt.messages)
    assert prompt.text is not None
    return encode(tokenizer, prompt.text, add_special_tokens=True)


class NoChatTemplate(ValueError):
    """A chat prompt for a model without a chat template."""


class UnrunnablePrompt(ValueError):
    """A prompt no engine call can take, now or on a retry; ``reason`` names the failure for its dead letter."""

    def __init__(self, prompt_id: str, reason: str, detail: str) -> None:
        super().__init__(f"prompt {prompt_id!r}: {detail}")
        self.reason = reason
        self.detail = detail


def checked_prompt_ids(
    prompt: Prompt,
    tokenizer: Tokenizer,
    *,
    vocab_size: int | None,
    max_context_tokens: int | None,
    template: ChatTemplate | None = None,
) -> list[int]:
    """`prompt_token_ids`, or `UnrunnablePrompt` when they can never be rolled out.

    Reasons: ``no_chat_template`` (a chat prompt, and the model has none), ``prompt_not_tokenizable`` (the
    tokenizer or the chat template raised on it), ``empty_prompt``,
    ``invalid_token_ids`` (an id outside ``[0, vocab_size)``: it would fail the engine call, or assert on a
    GPU), ``prompt_too_long`` (``max_context_tokens`` leaves no room for one new token). A limit of None is
    not checked.
    """
    try:
        ids = prompt_token_ids(prompt, tokenizer, template)
    except NoChatTemplate as exc:
        raise UnrunnablePrompt(prompt.prompt_id, "no_chat_template", str(exc)) from exc
    except Exception as exc:  # a tokenizer raising on one text is that prompt's fault, permanently
        raise UnrunnablePrompt(prompt.prompt_id, "prompt_not_tokenizable", f"{type(exc).__name__}: {exc}") from exc
    if not ids:
        raise UnrunnablePrompt(prompt.prompt_id, "empty_prompt", "no tokens")
    if vocab_size is not None and (bad := [t for t in ids if not 0 <= t < vocab_size]):
        raise UnrunnablePrompt(
            prompt.prompt_id,
            "invalid_token_ids",
            f"token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
        )
    if max_context_tokens is not None and len(ids) >= max_context_tokens:
        raise UnrunnablePrompt(
            prompt.prompt_id,
            "prompt_too_long",
            f"{len(ids)} tokens leave no room for a reply in the model's context of {max_context_tokens}",
        )
    return ids


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
    scorer = _Scorer(task, prompt, sampling, tokenizer, verifiers, group_id)
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
    scorer = _Scorer(task, prompt, sampling, tokenizer, verifiers, group_id)
    limits = _Limits(env_timeout_s, max_turns, max_total_tokens, strict_truncation)

    async def episode(i: int) -> Sample:
        for attempt in range(infra_retries + 1):
            sample = await _run_episode(generate, scorer, i, prompt_ids, env(prompt), limits, template)
            if sample.status != "infra_error":
                break
            logger.warning("trajectory %s-%d: %s (try %d)", group_id, i, sample.info.get("error"), attempt + 1)
        return replace(sample, info={**sample.info, "attempts": attempt + 1})

    return list(await asyncio.gather(*(episode(i) for i in range(group_size))))


@dataclass(frozen=True)
class _Limits:
    env_timeout_s: float
    max_turns: int
    max_total_tokens: int | None
    strict_truncation: bool


@dataclass
class _Scorer:
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
        info: dict[str, Any] | None = None,
    ) -> Sample:
        tokens, loss_mask, logprobs, versions = assemble(turns)
        policy_turns = [t for t in turns if t.kind == "policy"]
        return Sample(
            trajectory_id=f"{self.group_id}-{index}",
            tokens=tokens,
            loss_mask=loss_mask,
            logprobs=logprobs,
            versions=versions,
            reward=reward,
            reward_source="none" if reward is None else "verifier",
            status=status,
            finish_reason=(policy_turns[-1].finish_reason if policy_turns else None) or "abort",
            num_turns=len(policy_turns),
            tags=self.prompt.tags,
            gen_s=gen_s,
            verify_s=verify_s,
            info=info or {},
        )

    def environment_failed(
        self,
        index: int,
        turns: list[Turn],
        gen_s: float,
        error: str,
        info: dict[str, Any] | None = None,
        *,
        reason: str,
    ) -> Sample:
        """The sample of an episode its environment broke: ``infra_error``, no reward, the typed ``reason``
        (``sandbox_lost``, ``verifier_timeout``, ...; the metrics count them) and the ``error``."""
        info = {**(info or {}), "error": f"environment: {error}", "infra_reason": reason}
        return self.sample(index, turns, reward=None, status="infra_error", gen_s=gen_s, info=info)

    async def finish(self, index: int, turns: list[Turn], gen_s: float, truncated: bool) -> Sample:
        """Score the completion (everything after the prompt) with the task's verifier and build the sample."""
        finish_reason = turns[-1].finish_reason or "abort"
        if finish_reason == "abort":
            return self.sample(index, turns, reward=None, status="aborted", gen_s=gen_s)
        if finish_reason == "prompt_too_long":
            info = {"error": "prompt_too_long: the context left no room for a reply under the engine's max_len"}
            return self.sample(index, turns, reward=None, status="infra_error", gen_s=gen_s, info=info)
        completion = [t for t in turns if t.kind != "prompt"]
        ids = np.concatenate([_strip_stop(t, self.sampling) for t in completion])
        text = "".join(_decode(self.tokenizer, _strip_stop(t, self.sampling)) for t in completion)
        start = time.perf_counter()
        verdict = await self.verifiers.verify(self.task, self.prompt, text, ids)
        return self.sample(
            index,
            turns,
            reward=verdict.reward,
            status=sample_status(finish_reason, truncated, verdict),
            gen_s=gen_s,
            verify_s=time.perf_counter() - start,
            info=dict(verdict.info),
        )


async def _run_episode(
    generate: Generate,
    scorer: _Scorer,
    index: int,
    prompt_ids: list[int],
    environment: Environment,
    limits: _Limits,
    template: ChatTemplate | None = None,
) -> Sample:
    """One multi-turn sample. An environment message is appended only when a policy reply follows it. An
    environment with ``opening()`` speaks first (its message follows the prompt); one with ``aclose()`` is closed
    when the episode ends, however it ends."""
    try:
        return await _episode_turns(generate, scorer, index, prompt_ids, environment, limits, template)
    finally:
        try:
            await asyncio.wait_for(environment.aclose(), timeout=limits.env_timeout_s)
        except Exception:  # the sample is already decided; a failed close only costs the environment's slot
            logger.warning("closing the environment of trajectory %s-%d failed", scorer.group_id, index, exc_info=True)


async def _episode_turns(
    generate: Generate,
    scorer: _Scorer,
    index: int,
    prompt_ids: list[int],
    environment: Environment,
    limits: _Limits,
    template: ChatTemplate | None,
) -> Sample:
    turns = [Turn.context("prompt", prompt_ids)]
    pending: list[int] = []
    gen_s = 0.0
    try:
        first = await asyncio.wait_for(environment.opening(), timeout=limits.env_timeout_s)
        pending = [] if first is None else step_ids(first, scorer.tokenizer, template, None)
    except Exception as exc:  # a boundary we own: environment failures are infrastructure failures
        logger.exception("environment failed to open trajectory %s-%d", scorer.group_id, index)
        return scorer.environment_failed(index, turns, 0.0, f"{type(exc).__name__}: {exc}", reason=_reason(exc))
    for _ in range(limits.max_turns):
        context_ids = np.concatenate([t.token_ids for t in turns] + [np.asarray(pending, np.int32)])
        budget = scorer.sampling.max_new_tokens
        if limits.max_total_tokens is not None:
            budget = min(budget, limits.max_total_tokens - len(context_ids))
        if budget < 1:
            break
        if pending:
            turns.append(Turn.context("env", pending))
        request = GenerateRequest(
            context_ids, max_new_tokens=budget, request_id=f"{scorer.group_id}-{index}", keep_prefix=True
        )
        result = (await asyncio.to_thread(generate, [request], scorer.sampling))[0]
        turns.append(Turn.policy(result))
        gen_s += result.gen_s
        if result.finish_reason == "length" and limits.strict_truncation:  # rollout.strict_truncation
            return scorer.sample(index, turns, reward=0.0, status="truncated", gen_s=gen_s, info={"strict": "length"})
        if result.finish_reason != "stop":  # "length": later turns are dropped; "abort": not scored
            return await _cut(scorer, index, turns, gen_s, environment, limits)
        reply_ids = _strip_stop(turns[-1], scorer.sampling)
        try:
            step = await asyncio.wait_for(
                environment.step(_decode(scorer.tokenizer, reply_ids), reply_ids), timeout=limits.env_timeout_s
            )
        except Exception as exc:  # a boundary we own: environment failures are infrastructure failures
            logger.exception("environment failed in trajectory %s-%d", scorer.group_id, index)
            return scorer.environment_failed(index, turns, gen_s, f"{type(exc).__name__}: {exc}", reason=_reason(exc))
        if step.done and step.reward is not None:
            problem = None if step.status == "format_error" else reward_problem(step.reward)
            if problem is not None:  # a broken environment fails its sample, not the group's validation
                logger.warning("environment of trajectory %s-%d: %s; infra_error", scorer.group_id, index, problem)
                return scorer.environment_failed(index, turns, gen_s, problem, step.info, reason="reward_invalid")
            reward = 0.0 if step.status == "format_error" else float(step.reward)
            return scorer.sample(index, turns, reward=reward, status=step.status, gen_s=gen_s, info=dict(step.info))
        if step.done:
            return await scorer.finish(index, turns, gen_s, truncated=False)
        try:
            pending = step_ids(step, scorer.tokenizer, template, turns[-1].token_ids)
        except NotBridged as exc:
            logger.warning("environment of trajectory %s-%d: %s; infra_error", scorer.group_id, index, exc)
            return scorer.environment_failed(index, turns, gen_s, str(exc), step.info, reason="not_bridged")
    return await _cut(scorer, index, turns, gen_s, environment, limits)


async def _cut(
    scorer: _Scorer, index: int, turns: list[Turn], gen_s: float, environment: Environment, limits: _Limits
) -> Sample:
    """An episode cut by a limit (a reply's length, the turns, the tokens): ``truncated``, scored by the
    environment's own ``final()`` when it has one (a sandbox's tests), else by the task's verifier."""
    if turns[-1].finish_reason in ("abort", "prompt_too_long"):
        return await scorer.finish(index, turns, gen_s, truncated=True)
    try:
        step = await asyncio.wait_for(environment.final(), timeout=limits.env_timeout_s)
    except Exception as exc:  # a boundary we own, as for step()
        return scorer.environment_failed(index, turns, gen_s, f"{type(exc).__name__}: {exc}", reason=_reason(exc))
    if step is None:
        return await scorer.finish(index, turns, gen_s, truncated=True)
    reward = 0.0 if step.status == "format_error" else float(step.reward or 0.0)
    return scorer.sample(index, turns, reward=reward, status="truncated", gen_s=gen_s, info=dict(step.info))


def _reason(exc: BaseException) -> str:
    """An environment failure's typed reason (a sandbox's or verifier's ``reason``), else what kind it was."""
    if isinstance(exc, asyncio.TimeoutError):
        return "environment_timeout"
    return str(getattr(exc, "reason", "environment_error"))


def _decode(tokenizer: Tokenizer, ids: np.ndarray) -> str:
    """Special tokens are kept in the text, so a verifier sees e.g. a stray ``<pad>`` as a format error."""
    return tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)


def _strip_stop(turn: Turn, sampling: SamplingParams) -> np.ndarray:
    """The turn's ids without a final stop token (a policy reply that finished with ``stop``)."""
    ids = turn.token_ids
    if turn.kind == "policy" and turn.finish_reason == "stop" and len(ids) and int(ids[-1]) in sampling.stop_token_ids:
        return ids[:-1]
    return ids
