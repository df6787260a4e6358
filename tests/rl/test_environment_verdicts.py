"""An environment's own rewards and deadlines: every reward it hands over (a done step's, a cut episode's `final`)
is checked like a verifier's and fails its sample alone, and each hook runs under the deadline the environment
declares (a Harbor task's come from its task.toml), the rollout's fixed one only for environments that declare none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np

from actors.generator.engines.base import GenerateRequest, GenerateResult, SamplingParams
from pipeline.rl.scoring import run_group
from pipeline.tasks import Prompt, Task, VerifierPool, VerifierResult
from pipeline.tasks.char_tokenizer import EOS_ID, load_char_tokenizer
from pipeline.tasks.environment import Environment, EnvStep, Hook
from pipeline.wire.trajectory import Sample, TrajectoryGroup

TOK = load_char_tokenizer()
SAMPLING = SamplingParams(max_new_tokens=6, stop_token_ids=(EOS_ID,))
PROMPT = Prompt("p0", text="21>", answer="12")


def _replies(n: int) -> Callable[[Sequence[GenerateRequest], SamplingParams], list[GenerateResult]]:
    """A `Generate` callable whose every reply is ``1`` and a stop token (``n`` of them in all)."""
    left = [n]

    def generate(requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        left[0] -= len(requests)
        assert left[0] >= 0, "more replies asked for than scripted"
        ids = np.asarray([*TOK.encode("1", add_special_tokens=False).ids, EOS_ID], np.int32)
        return [GenerateResult(ids, np.full(2, -0.5, np.float32), np.zeros(2, np.int32), "stop") for _ in requests]

    return generate


def _run(n: int, env: Callable[[Prompt], Environment], task: Task | None = None, **kwargs: object) -> list[Sample]:
    """One group of ``n`` episodes of `env` through the real rollout."""
    with VerifierPool() as verifiers:
        return asyncio.run(
            run_group(
                _replies(n),
                task or _RangedTask(),
                PROMPT,
                n,
                SAMPLING,
                env,
                tokenizer=TOK,
                verifiers=verifiers,
                **kwargs,
            )
        )


class _RangedTask(Task):
    """Rewards in [0, 1]; its verifier (reached only when an environment gives no verdict) scores 0.25."""

    reward_range = (0.0, 1.0)

    def prompts(self):
        yield PROMPT

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        return VerifierResult(0.25)


class _Judge(Environment):
    """Answers every reply with a message; an episode cut by the turn limit gets `verdict` from `final`."""

    def __init__(self, verdict: EnvStep | None, done: EnvStep | None = None) -> None:
        self.verdict = verdict
        self.done = done

    async def step(self, reply_text: str, reply_ids: np.ndarray) -> EnvStep:
        return self.done or EnvStep(message="|")

    async def final(self) -> EnvStep | None:
        return self.verdict


def _group(samples: list[Sample]) -> TrajectoryGroup:
    return TrajectoryGroup.from_samples(group_id="g", prompt_id="p0", generator_id="gen", samples=samples)


def test_a_nan_or_out_of_range_final_verdict_fails_its_cut_sample_alone_and_the_group_validates() -> None:
    verdicts = [float("nan"), 0.5, 7.0, float("inf"), None]
    judges = iter([_Judge(EnvStep(done=True, reward=r)) for r in verdicts])
    samples = _run(len(verdicts), lambda prompt: next(judges), max_turns=1)
    assert [(s.status, s.reward) for s in samples] == [
        ("infra_error", None),
        ("truncated", 0.5),
        ("infra_error", None),
        ("infra_error", None),
        ("truncated", 0.25),  # no verdict: the task's verifier scores the cut episode
    ]
    reasons = [s.info.get("infra_reason") for s in samples]
    assert reasons == ["reward_invalid", None, "reward_out_of_range", "reward_invalid", None]
    assert "outside the task's range [0.0, 1.0]" in samples[2].info["error"]
    assert _group(samples).num_samples == 5  # the NaN failed one sample, not the group


def test_a_done_step_outside_the_tasks_range_is_reward_out_of_range() -> None:
    judges = iter([_Judge(None, EnvStep(done=True, reward=-0.5)), _Judge(None, EnvStep(done=True, reward=1.0))])
    samples = _run(2, lambda prompt: next(judges))
    assert [(s.status, s.reward, s.info.get("infra_reason")) for s in samples] == [
        ("infra_error", None, "reward_out_of_range"),
        ("ok", 1.0, None),
    ]
    _group(samples)


class _Slow(Environment):
    """Its step takes a moment (a test run, say) and declares a deadline of `declared` for it."""

    def __init__(self, declared: float | None) -> None:
        self.declared = declared

    def hook_timeout_s(self, hook: Hook) -> float | None:
        return self.declared if hook == "step" else None

    async def step(self, reply_text: str, reply_ids: np.ndarray) -> EnvStep:
        await asyncio.sleep(0.2)
        return EnvStep(done=True, reward=1.0)


def test_a_hook_runs_under_the_deadline_its_environment_declares_not_the_rollouts() -> None:
    # the rollout's own deadline (env_timeout_s) is far below the step's time: a declared one governs instead
    (honoured,) = _run(1, lambda prompt: _Slow(30.0), env_timeout_s=0.01)
    assert (honoured.status, honoured.reward) == ("ok", 1.0)
    (undeclared,) = _run(1, lambda prompt: _Slow(None), env_timeout_s=0.01)
    assert (undeclared.status, undeclared.info["infra_reason"]) == ("infra_error", "environment_timeout")
    (tight,) = _run(1, lambda prompt: _Slow(0.01), env_timeout_s=60.0)
    assert (tight.status, tight.info["infra_reason"]) == ("infra_error", "environment_timeout")
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        (refused,) = _run(1, lambda prompt, bad=bad: _Slow(bad))
        assert (refused.status, refused.info["infra_reason"]) == ("infra_error", "environment_error")
        assert "hook_timeout_s('step')" in refused.info["error"]
