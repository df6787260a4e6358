"""Rollouts: token/mask/version alignment, scoring apart from generation, multi-turn rules, truncation, and
failure statuses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from actors.generator.engines.base import GenerateRequest, GenerateResult, SamplingParams
from actors.generator.engines.torch_engine import TorchEngine
from actors.models import build_model
from pipeline.failures import InfraFailure, InfraReason
from pipeline.rl.engine_records import Generate
from pipeline.rl.prompt_ids import UnrunnablePrompt, checked_prompt_ids, prompt_token_ids
from pipeline.rl.scoring import group_requests, run_group, score_group
from pipeline.tasks import Prompt, Task, VerifierPool, VerifierResult
from pipeline.tasks.char_tokenizer import EOS_ID, PAD_ID, load_char_tokenizer
from pipeline.tasks.environment import Environment, EnvStep
from pipeline.tasks.reverse import ReverseDigitsTask
from pipeline.wire.trajectory import Sample, TrajectoryGroup

TOK = load_char_tokenizer()
SAMPLING = SamplingParams(max_new_tokens=6, stop_token_ids=(EOS_ID,))
PROMPT = Prompt("p0", text="21>", answer="12")


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


def _result(text: str, finish: str = "stop", version: int = 3) -> GenerateResult:
    ids = _ids(text) + ([EOS_ID] if finish == "stop" else [])
    return GenerateResult(
        np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32), np.full(len(ids), version, np.int32), finish
    )  # type: ignore[arg-type]


class _ScriptedEngine:
    """A `Generate` callable replying from a script, one reply per request, in order."""

    def __init__(self, replies: Sequence[GenerateResult]) -> None:
        self.replies = list(replies)
        self.requests: list[GenerateRequest] = []

    def __call__(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        self.requests.extend(requests)
        return [self.replies.pop(0) for _ in requests]


class _TranscriptTask(Task):
    """Scores any transcript 0.5 and says what it was shown (``info["seen"]``: it runs in a scorer worker)."""

    def prompts(self):
        yield PROMPT

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        return VerifierResult(0.5, info={"seen": completion_text})


class _Env(Environment):
    def __init__(self, steps: Sequence[EnvStep | Exception]) -> None:
        self.steps = list(steps)
        self.seen: list[str] = []

    async def step(self, reply_text: str, reply_ids: np.ndarray) -> EnvStep:
        self.seen.append(reply_text)
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        return step


def _run(
    generate: Generate,
    env: Callable[[Prompt], _Env] | None = None,
    group_size: int = 1,
    task: Task | None = None,
    **kwargs: object,
) -> list[Sample]:
    task = task or (ReverseDigitsTask(num_digits=2) if env is None else _TranscriptTask())
    with VerifierPool() as verifiers:
        return asyncio.run(
            run_group(generate, task, PROMPT, group_size, SAMPLING, env, tokenizer=TOK, verifiers=verifiers, **kwargs)
        )


def test_single_turn_group_aligns_tokens_masks_versions_and_logprobs() -> None:
    engine = TorchEngine(build_model("tiny-llama-2x64", vocab_size=TOK.get_vocab_size(), seed=0), pad_token_id=PAD_ID)
    samples = _run(engine.generate, group_size=4)
    prompt_ids = TOK.encode("21>").ids
    assert len(samples) == 4 and len({s.trajectory_id for s in samples}) == 4
    for s in samples:
        n = len(prompt_ids)
        assert s.tokens.dtype == np.int32 and s.loss_mask.dtype == np.uint8
        assert s.logprobs.dtype == np.float32 and s.versions.dtype == np.int32
        assert s.tokens[:n].tolist() == prompt_ids
        assert s.loss_mask.tolist() == [0] * n + [1] * (len(s.tokens) - n)
        assert s.versions.tolist() == [-1] * n + [0] * (len(s.tokens) - n)
        assert (s.logprobs[:n] == 0).all() and (s.logprobs[n:] < 0).all()
        assert s.num_turns == 1 and s.tags == () and s.gen_s > 0
        if s.status in ("ok", "format_error", "truncated"):
            assert s.reward is not None and s.reward_source == "verifier"
        assert s.finish_reason == ("length" if s.status == "truncated" else s.finish_reason)


def test_single_turn_statuses_follow_finish_reason_and_verifier() -> None:
    engine = _ScriptedEngine([_result("12"), _result("xx"), _result("121212", "length"), _result("1", "abort")])
    ok, bad_format, cut, aborted = _run(engine, group_size=4)
    assert (ok.status, ok.reward, ok.reward_source) == ("ok", 1.0, "verifier")
    assert (bad_format.status, bad_format.reward) == ("format_error", 0.0)
    assert (cut.status, cut.finish_reason, cut.reward) == ("truncated", "length", 1 / 3)
    assert (aborted.status, aborted.reward, aborted.reward_source) == ("aborted", None, "none")


def test_groups_sharing_one_generate_call_are_scored_apart_in_request_order() -> None:
    other = Prompt("p1", text="43>", answer="34", tags=("hard",))
    ids = {p.prompt_id: prompt_token_ids(p, TOK) for p in (PROMPT, other)}
    requests = group_requests(ids["p0"], 2, "p0") + group_requests(ids["p1"], 2, "p1")
    engine = _ScriptedEngine([_result("12"), _result("xx"), _result("34"), _result("3", "abort")])
    results = engine(requests, SAMPLING)  # one call for both groups, as a generator batches them
    task = ReverseDigitsTask(num_digits=2)

    def score(prompt: Prompt, group: list[GenerateResult]) -> list[Sample]:
        with VerifierPool() as verifiers:
            return asyncio.run(
                score_group(
                    task,
                    prompt,
                    ids[prompt.prompt_id],
                    group,
                    SAMPLING,
                    tokenizer=TOK,
                    group_id=prompt.prompt_id,
                    verifiers=verifiers,
                )
            )

    first, second = score(PROMPT, results[:2]), score(other, results[2:])
    assert [r.request_id for r in requests] == ["p0-0", "p0-1", "p1-0", "p1-1"]
    assert [s.trajectory_id for s in first + second] == ["p0-0", "p0-1", "p1-0", "p1-1"]
    assert [(s.status, s.reward) for s in first] == [("ok", 1.0), ("format_error", 0.0)]
    assert [(s.status, s.reward) for s in second] == [("ok", 1.0), ("aborted", None)]
    assert second[0].tags == ("hard",) and second[0].tokens.tolist() == ids["p1"] + _ids("34") + [EOS_ID]


def test_multi_turn_masks_env_tokens_and_keeps_policy_versions() -> None:
    engine = _ScriptedEngine([_result("11", version=3), _result("12", version=4)])
    env = _Env([EnvStep(message="|no|"), EnvStep(done=True, reward=1.0)])
    (s,) = _run(engine, lambda prompt: env)
    prompt_ids, reply1, msg, reply2 = TOK.encode("21>").ids, _ids("11") + [EOS_ID], _ids("|no|"), _ids("12") + [EOS_ID]
    assert s.tokens.tolist() == prompt_ids + reply1 + msg + reply2
    assert s.loss_mask.tolist() == [0] * 4 + [1] * 3 + [0] * 4 + [1] * 3
    assert s.versions.tolist() == [-1] * 4 + [3] * 3 + [-1] * 4 + [4] * 3
    assert s.logprobs.tolist() == [0] * 4 + [-0.5] * 3 + [0] * 4 + [-0.5] * 3
    assert (s.status, s.reward, s.reward_source, s.num_turns) == ("ok", 1.0, "verifier", 2)
    assert env.seen == ["11", "12"]  # stop token trimmed from the text the environment sees
    assert engine.requests[1].input_ids.tolist() == prompt_ids + reply1 + msg  # type: ignore[union-attr]


def test_a_turn_cut_by_length_stays_and_later_turns_are_dropped() -> None:
    engine = _ScriptedEngine([_result("11"), _result("121212", "length"), _result("never")])
    env = _Env([EnvStep(message="|"), EnvStep(message="|"), EnvStep(done=True, reward=1.0)])
    (s,) = _run(engine, lambda prompt: env, task=_TranscriptTask())
    assert s.status == "truncated" and s.finish_reason == "length" and s.num_turns == 2
    assert s.tokens.tolist()[-6:] == _ids("121212") and len(engine.replies) == 1
    assert env.seen == ["11"]  # the cut reply never reached the environment
    assert (s.reward, s.reward_source) == (0.5, "verifier")  # the verifier still scores the whole episode
    assert s.info["seen"] == "11|121212"


def test_environment_failure_is_an_infra_error_without_reward() -> None:
    engine = _ScriptedEngine([_result("11"), _result("12")])
    (s,) = _run(engine, lambda prompt: _Env([EnvStep(message="|"), RuntimeError("tool crashed")]))
    assert (s.status, s.reward, s.reward_source, s.num_turns) == ("infra_error", None, "none", 2)
    assert "tool crashed" in s.info["error"]


def test_environment_timeout_is_an_infra_error() -> None:
    class _Hangs(Environment):
        async def step(self, reply_text: str, reply_ids: np.ndarray) -> EnvStep:
            await asyncio.sleep(10)
            return EnvStep(done=True, reward=1.0)

    (s,) = _run(_ScriptedEngine([_result("12")]), lambda prompt: _Hangs(), env_timeout_s=0.05)
    assert (s.status, s.reward) == ("infra_error", None)
    assert s.info["infra_reason"] == "environment_timeout"


def test_an_environment_failure_is_named_by_the_exception_s_typed_reason() -> None:
    lost = InfraFailure("the box died", reason=InfraReason.SANDBOX_LOST)
    (typed,) = _run(_ScriptedEngine([_result("12")]), lambda prompt: _Env([lost]))
    (untyped,) = _run(_ScriptedEngine([_result("12")]), lambda prompt: _Env([RuntimeError("tool crashed")]))
    assert (typed.status, typed.reward, typed.info["infra_reason"]) == ("infra_error", None, "sandbox_lost")
    assert typed.info["error"] == "environment: InfraFailure: sandbox_lost: the box died"
    assert (untyped.status, untyped.info["infra_reason"]) == ("infra_error", "environment_error")


def test_environment_format_error_ends_the_episode_with_reward_zero() -> None:
    engine = _ScriptedEngine([_result("1x")])
    (s,) = _run(engine, lambda prompt: _Env([EnvStep(done=True, reward=0.7, status="format_error")]))
    assert (s.status, s.reward, s.reward_source) == ("format_error", 0.0, "verifier")


def test_turn_and_token_limits_truncate_the_episode() -> None:
    env = _Env([EnvStep(message="|")] * 5)
    (s,) = _run(_ScriptedEngine([_result("1")] * 5), lambda prompt: env, max_turns=2)
    assert (s.status, s.num_turns, s.finish_reason) == ("truncated", 2, "stop")
    engine = _ScriptedEngine([_result("1")] * 5)
    (s,) = _run(engine, lambda prompt: _Env([EnvStep(message="|||")] * 5), max_total_tokens=9)
    # prompt 4 + reply 2 + message 3 leaves no room: the message is dropped with the turn it would have fed
    assert (s.status, s.num_turns, len(s.tokens)) == ("truncated", 1, 6)


def test_prompts_no_engine_call_can_take_are_refused_with_a_dead_letter_reason() -> None:
    limits = {"vocab_size": TOK.get_vocab_size(), "max_context_tokens": 8}
    assert checked_prompt_ids(PROMPT, TOK, **limits) == prompt_token_ids(PROMPT, TOK)
    cases = {
        "invalid_token_ids": Prompt("oov", token_ids=(1, TOK.get_vocab_size())),
        "prompt_too_long": Prompt("long", token_ids=(1,) * 8),
        "empty_prompt": Prompt("empty", token_ids=()),
    }
    for reason, prompt in cases.items():
        with pytest.raises(UnrunnablePrompt, match=prompt.prompt_id) as refused:
            checked_prompt_ids(prompt, TOK, **limits)
        assert refused.value.reason == reason
    assert checked_prompt_ids(cases["prompt_too_long"], TOK, vocab_size=None, max_context_tokens=None) == [1] * 8


SCRIPTED_REWARDS: dict[str, object] = {"12": 1.0, "11": float("nan"), "22": float("inf"), "21": 1e39, "2": "high"}


class _RewardByTextTask(Task):
    """Hands back the reward `SCRIPTED_REWARDS` gives the completion text (NaN, inf, past float32 included); a class
    without arguments, so a scorer worker rebuilds it as it is."""

    def prompts(self):
        yield PROMPT

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        return VerifierResult(SCRIPTED_REWARDS[completion_text])  # type: ignore[arg-type]


def test_a_non_finite_verifier_reward_fails_its_sample_alone_and_the_group_still_validates() -> None:
    rewards = SCRIPTED_REWARDS
    engine = _ScriptedEngine([_result(text) for text in rewards])
    samples = _run(engine, group_size=len(rewards), task=_RewardByTextTask())
    assert [(s.status, s.reward, s.reward_source) for s in samples] == [("ok", 1.0, "verifier")] + [
        ("infra_error", None, "none")
    ] * 4
    assert all("verifier: reward" in s.info["error"] for s in samples[1:])
    group = TrajectoryGroup.from_samples(group_id="g", prompt_id="p0", generator_id="gen", samples=samples)
    assert group.num_samples == 5  # validation passes: one sample failed, not the group


def test_a_non_finite_environment_reward_fails_its_sample_alone() -> None:
    engine = _ScriptedEngine([_result("12"), _result("12")])
    steps = iter([EnvStep(done=True, reward=float("nan")), EnvStep(done=True, reward=0.5)])
    nan, fine = _run(engine, lambda prompt: _Env([next(steps)]), group_size=2)
    assert (nan.status, nan.reward, "environment: reward" in nan.info["error"]) == ("infra_error", None, True)
    assert (fine.status, fine.reward) == ("ok", 0.5)
    TrajectoryGroup.from_samples(group_id="g", prompt_id="p0", generator_id="gen", samples=[nan, fine])
