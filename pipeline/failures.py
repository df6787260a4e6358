"""The failure taxonomy: why a sample is an ``infra_error`` or a prompt can never run, as one enum and one exception.

A sample whose reward nobody could write (the sandbox died, the verifier hung, the agent crashed) is an
``infra_error``: reward None, masked out of the loss and the group baseline. Its ``info["infra_reason"]`` names
why, from `InfraReason`, and the generator's report counts samples per reason (``failure_reasons``), which the
trainer accepts only with names from here. A prompt that no engine call can take is dead-lettered with one of the
prompt reasons. Every code path that fails for one of these reasons raises an `InfraFailure` (or a subclass:
`pipeline.sandbox.SandboxError`, `pipeline.tasks.harbor.EpisodeFailure`, `pipeline.rl.prompt_ids.UnrunnablePrompt`),
so the reason travels as a typed attribute and is never parsed back out of a message.

This module sits below every floor of `pipeline/` (sandbox, wire and tasks included) and imports nothing.
"""

from __future__ import annotations

from enum import Enum


class InfraReason(str, Enum):
    """The names of failures that are not the policy's; the values are what samples, reports and dead letters carry."""

    # the sandbox a sample's episode ran in
    SANDBOX_START_FAILED = "sandbox_start_failed"
    SANDBOX_START_TIMEOUT = "sandbox_start_timeout"
    SANDBOX_LOST = "sandbox_lost"
    # the verifier (a task's tests, an environment's verdict, a scorer worker)
    VERIFIER_TIMEOUT = "verifier_timeout"
    SCORER_LOST = "scorer_lost"
    VERIFIER_CRASHED = "verifier_crashed"
    REWARD_MISSING = "reward_missing"
    REWARD_INVALID = "reward_invalid"
    REWARD_OUT_OF_RANGE = "reward_out_of_range"
    # the environment of a multi-turn episode
    ENVIRONMENT_TIMEOUT = "environment_timeout"
    ENVIRONMENT_ERROR = "environment_error"
    NOT_BRIDGED = "not_bridged"
    # an agent function's run
    AGENT_TIMEOUT = "agent_timeout"
    AGENT_ERROR = "agent_error"
    SESSION_LIMIT = "session_limit"  # its endpoint session past generator.serve's session limits
    # a prompt no engine call can take (its dead letter's reason), or a context that filled up mid-episode
    NO_CHAT_TEMPLATE = "no_chat_template"
    PROMPT_NOT_TOKENIZABLE = "prompt_not_tokenizable"
    EMPTY_PROMPT = "empty_prompt"
    INVALID_TOKEN_IDS = "invalid_token_ids"
    PROMPT_TOO_LONG = "prompt_too_long"

    def __str__(self) -> str:
        return self.value


POLICY_FAILURES = frozenset({"format_error", "agent_timeout", "scorer_timeout", "sandbox_broken"})
"""Failure names a generator also counts that are the policy's own (reward 0, trained on): a malformed reply, an
agent past its time limit where `rollout.agent_timeout_is` is ``policy``, a scorer killed at its deadline (or for
what it used) on the policy's answer, and a sandbox the agent's own commands broke (its supervisor killed, its
directories made unusable). A hostile answer must never turn into a masked, re-run ``infra_error``: re-runs select
for success."""

FAILURE_NAMES = frozenset(r.value for r in InfraReason) | POLICY_FAILURES
"""Every name a generator's ``failure_reasons`` count may carry."""


class InfraFailure(RuntimeError):
    """A failure that is not the policy's: ``reason`` names it (a class default, or given), ``detail`` says what
    happened. ``str()`` is ``"<reason>: <detail>"`` so a log line names the reason."""

    reason: InfraReason = InfraReason.ENVIRONMENT_ERROR

    def __init__(self, detail: str = "", *, reason: InfraReason | None = None) -> None:
        if reason is not None:
            self.reason = InfraReason(reason)
        self.detail = detail
        super().__init__(f"{self.reason.value}: {detail}" if detail else self.reason.value)
