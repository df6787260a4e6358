"""The verifier self-check: before a run trains on a task, its verifier must tell a right answer from a wrong one.

Third-party scorers ship with traps that RL finds at once: one that gives 1.0 to any non-empty string is a
reward hack the policy learns in a few steps; one that scores its own reference 0, or raises on it, gives a
run nothing to learn; one that raises on a malformed answer turns the policy's failures into masked
``infra_error``s. So on a sample of the run's prompts (`SELF_CHECK_ITEMS`), through the same `VerifierPool`
(threads, timeout) as a generator:

- the reference completion (`Task.reference_completion`) must score `Task.max_reward` with status ``ok``;
- an empty answer and a garbage answer (`GARBAGE`), each as it stands and written the way the task reads
  answers (`Task.completion_for`: inside the tags a reply is asked for), must be scored (``ok`` or
  ``format_error``, never an ``infra_error``) below it;
- hostile answers, on the first item, in the task's format: a code-execution probe (`probe_answer`: Python that
  names a fresh marker) that the scorer must never compile or evaluate (the scorer worker's audit hook watches
  for the marker: "evaluates answers as code"), and huge expressions (`HUGE_ANSWERS`: ``9**9**9``,
  ``9^{9^{9}}``) that must be scored within the pool's deadline (a scorer killed at it "times out on a huge
  expression"). Either is refused: a policy finds such an answer, and then it runs code where the scorer runs or
  turns every sample into a killed worker.

A task that fails is refused, naming the task, the item and what went wrong, unless the user sets
``task.skip_self_check``. A task whose rewards come from an agent function (its own, `Task.agent`, or the one
``task.agent`` names) or from an environment server (`Task.self_check` False) is not checked here: its verifier
runs inside the episode.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.verifiers import VerifierPool
from pipeline.wire.prompts import Prompt

log = logging.getLogger(__name__)

SELF_CHECK_ITEMS = 8
"""Prompts the self-check scores (three verifications each)."""
GARBAGE = "zq#~ v%8 ]x"
"""A reply no task should reward: letters, signs and a digit, matching no answer format."""
HUGE_ANSWERS = ("9**9**9", "9^{9^{9}}")
"""Expressions whose value has hundreds of millions of digits: a scorer that evaluates them never returns."""


def probe_answer(marker: str) -> str:
    """Python that, compiled or evaluated anywhere, shows `marker` to the worker's audit hook (and runs nothing:
    the worker refuses ``os.system``)."""
    return f"__import__('os').system('echo {marker}')"


class TaskSelfCheckError(ValueError):
    """The task's verifier failed its self-check; the message names the task, the item and the failure."""


@dataclass(frozen=True)
class SelfCheckFailure:
    prompt_id: str
    problem: str


async def self_check(
    task: Task,
    prompts: Sequence[Prompt],
    pool: VerifierPool,
    *,
    encode: Callable[[str], Sequence[int]] | None = None,
) -> list[SelfCheckFailure]:
    """Every failure on `prompts` (empty: the verifier passed). `encode` gives the ids handed to ``verify``
    beside each text (the run's tokenizer; none: no ids)."""
    failures: list[SelfCheckFailure] = []

    def ids(text: str) -> list[int]:
        try:
            return list(encode(text)) if encode is not None else []
        except Exception:  # a tokenizer without <unk> cannot write the garbage reply: a policy never could either
            return []

    async def score(prompt: Prompt, text: str) -> VerifierResult:
        return await pool.verify(task, prompt, text, ids(text))

    for prompt in prompts:
        try:
            reference = task.reference_completion(prompt)
        except Exception as exc:  # a task that cannot say what a right answer is, for a prompt it made
            failures.append(
                SelfCheckFailure(prompt.prompt_id, f"reference_completion raised {type(exc).__name__}: {exc}")
            )
            continue
        if reference is None:
            failures.append(SelfCheckFailure(prompt.prompt_id, "it has no reference answer to check the verifier with"))
            continue
        result = await score(prompt, reference)
        if result.status != "ok" or result.reward != task.max_reward:
            failures.append(
                SelfCheckFailure(
                    prompt.prompt_id,
                    f"its reference answer {reference!r} scores {_described(result)}, not the maximum {task.max_reward}",
                )
            )
        wrong = {"": "an empty answer", GARBAGE: "a garbage answer"}
        for answer, label in list(wrong.items()):
            wrong.setdefault(task.completion_for(answer), f"{label} in the task's format")
        for text, label in wrong.items():
            result = await score(prompt, text)
            if result.status == "infra_error":
                failures.append(
                    SelfCheckFailure(
                        prompt.prompt_id,
                        f"{label} {text!r} is an infra_error ({result.info.get('error')}): a verifier that fails on a "
                        "policy's answer masks the policy's failures; score it 0 (format_error) instead",
                    )
                )
            elif result.reward is not None and result.reward >= task.max_reward:
                failures.append(
                    SelfCheckFailure(
                        prompt.prompt_id, f"{label} {text!r} scores {result.reward}, the maximum: a reward hack"
                    )
                )
    if prompts:
        failures += await hostile_check(task, prompts[0], pool, ids)
    return failures


async def hostile_check(
    task: Task, prompt: Prompt, pool: VerifierPool, ids: Callable[[str], list[int]]
) -> list[SelfCheckFailure]:
    """The hostile answers of the module docstring on one prompt; every failure found."""
    failures: list[SelfCheckFailure] = []
    marker = f"leeway_probe_{secrets.token_hex(8)}"
    probe = task.completion_for(probe_answer(marker))
    result = await pool.verify(task, prompt, probe, ids(probe), probe=marker)
    if result.info.get("evaluated_probe"):
        failures.append(
            SelfCheckFailure(
                prompt.prompt_id,
                f"its scorer evaluates answers as code: the probe {probe!r} was compiled by it. A policy's answer "
                "would run as code where the scorer runs",
            )
        )
    failures += _hostile_verdict(task, prompt, probe, "the code-execution probe", result)
    for expression in HUGE_ANSWERS:
        text = task.completion_for(expression)
        result = await pool.verify(task, prompt, text, ids(text))
        if result.info.get("error") == "scorer_timeout":
            failures.append(
                SelfCheckFailure(
                    prompt.prompt_id,
                    f"its scorer times out on a huge expression {text!r} (killed at the {pool.timeout_s:g} s "
                    "deadline): it evaluates the answer",
                )
            )
            break
        failures += _hostile_verdict(task, prompt, text, "a huge expression", result)
    return failures


def _hostile_verdict(
    task: Task, prompt: Prompt, text: str, label: str, result: VerifierResult
) -> list[SelfCheckFailure]:
    if result.status == "infra_error":
        return [SelfCheckFailure(prompt.prompt_id, f"{label} {text!r} is an infra_error ({result.info.get('error')})")]
    if result.reward is not None and result.reward >= task.max_reward:
        return [SelfCheckFailure(prompt.prompt_id, f"{label} {text!r} scores {result.reward}, the maximum")]
    return []


async def require_verified_task(
    task: Task,
    task_name: str,
    prompts: Sequence[Prompt],
    pool: VerifierPool,
    *,
    skip: bool,
    has_agent: bool,
    encode: Callable[[str], Sequence[int]] | None = None,
) -> None:
    """Refuse the task (`TaskSelfCheckError`) if its verifier fails the self-check; see the module docstring."""
    if skip:
        log.warning("task %s: verifier self-check skipped (task.skip_self_check)", task_name)
        return
    if has_agent:
        log.info("task %s: no verifier self-check, its rewards come from its agent or its environment", task_name)
        return
    failures = await self_check(task, prompts, pool, encode=encode)
    if failures:
        first = failures[0]
        raise TaskSelfCheckError(
            f"task {task_name!r} failed its verifier self-check on item {first.prompt_id!r}: {first.problem} "
            f"({len(failures)} failed checks over {len(prompts)} items). Fix the task, or set task.skip_self_check: "
            "true to train on it anyway"
        )
    log.info("task %s: verifier self-check passed on %d items", task_name, len(prompts))


def _described(result: VerifierResult) -> str:
    if result.status == "infra_error":
        return f"nothing (infra_error: {result.info.get('error')})"
    reason = result.info.get("reason") or result.info.get("error")
    return f"{result.reward} ({result.status}{': ' + str(reason) if reason else ''})"
