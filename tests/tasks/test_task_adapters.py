"""The ecosystem's task libraries through Leeway's adapters, offline: reasoning-gym datasets (train and eval split
by seed, scorer exceptions as format errors, the shipped traps refused by the self-check) and math-verify
problems; the verifier self-check on the built-in tasks; rewards out of a task's range refused per sample."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from pipeline.tasks import Prompt, Task, VerifierPool, VerifierResult, get_task
from pipeline.tasks.self_check import GARBAGE, TaskSelfCheckError, require_verified_task, self_check

DATASETS = {
    "basic_arithmetic": {},
    "chain_sum": {"min_terms": 2, "max_terms": 3},
    "spell_backward": {},
}


def _verify(task: Task, prompt: Prompt, text: str) -> VerifierResult:
    async def main() -> VerifierResult:
        with VerifierPool(timeout_s=30.0) as pool:
            return await pool.verify(task, prompt, text, [])

    return asyncio.run(main())


def _check(task: Task, items: int = 8) -> list[str]:
    async def main() -> list[str]:
        with VerifierPool(timeout_s=30.0) as pool:
            prompts = list(itertools.islice(task.prompts(), items))
            return [f.problem for f in await self_check(task, prompts, pool)]

    return asyncio.run(main())


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_reasoning_gym_datasets_score_their_references_and_pass_the_self_check(dataset: str) -> None:
    task = get_task("reasoning_gym", dataset=dataset, size=40, eval_size=20, seed=3, config=DATASETS[dataset])
    prompts = list(itertools.islice(task.prompts(), 40))
    assert len({p.prompt_id for p in prompts}) == 40  # one epoch: every item once
    first = prompts[0]
    reference = task.reference_completion(first)
    assert reference is not None and reference.startswith("<answer>")
    assert _verify(task, first, f"Let me think. {reference}") == VerifierResult(1.0)
    no_tags = _verify(task, first, first.answer or "")
    assert no_tags.status == "format_error" and no_tags.reward == 0.0
    assert _check(task) == []
    # the same arguments build the same items in another process: a generator scores what the trainer admitted
    again = get_task("reasoning_gym", dataset=dataset, size=40, eval_size=20, seed=3, config=DATASETS[dataset])
    assert list(itertools.islice(again.prompts(), 40)) == prompts


def test_the_eval_split_is_never_a_train_question_and_comes_from_another_seed() -> None:
    task = get_task("reasoning_gym", dataset="basic_arithmetic", size=300, eval_size=100, seed=0, answer_format="raw")
    train = {p.text for p in itertools.islice(task.prompts(), 300)}
    held_out = task.eval_prompts()
    assert held_out and all(p.text not in train for p in held_out)
    assert all(p.metadata["split"] == "eval" and "eval" in p.tags for p in held_out)
    assert len(held_out) <= 100
    # raw answers: the whole reply is the answer
    assert _verify(task, held_out[0], f"  {held_out[0].answer} ").reward == 1.0


def test_question_format_asks_the_same_item_without_the_preamble_and_a_bad_one_is_named() -> None:
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    args = {"dataset": "chain_sum", "size": 60, "eval_size": 60, "seed": 0, "answer_format": "raw", "config": config}
    plain = get_task("reasoning_gym", **args)
    short = get_task("reasoning_gym", **args, question_format="{metadata[expression]} =")
    first, first_short = next(iter(plain.prompts())), next(iter(short.prompts()))
    assert first.text.startswith("State the final answer") and first.text.endswith(first_short.text)
    assert first_short.text[0].isdigit() and first_short.text.endswith(" =")
    assert first_short.answer == first.answer and _verify(short, first_short, first.answer).reward == 1.0
    # overlap is judged on the formatted question: only 200 distinct 1-digit sums exist, so many eval items go
    train = {p.text for p in itertools.islice(short.prompts(), 60)}
    assert short.eval_prompts() and all(p.text not in train for p in short.eval_prompts())
    with pytest.raises(ValueError, match=r"question_format='\{metadata\[nope\]\}'.*expression"):
        get_task("reasoning_gym", **args, question_format="{metadata[nope]}")


def test_a_scorer_that_raises_on_a_policy_answer_is_a_format_error_not_an_infra_error() -> None:
    task = get_task("reasoning_gym", dataset="prime_factorization", size=8, eval_size=0, seed=1)
    prompt = next(task.prompts())
    result = _verify(task, prompt, "<answer>2 × x</answer>")  # prime_factorization's scorer raises ValueError on it
    assert result.status == "format_error" and result.reward == 0.0 and result.info["reason"] == "scorer_raised"


def test_the_self_check_refuses_a_scorer_that_rewards_garbage_and_names_the_item() -> None:
    task = get_task("reasoning_gym", dataset="game_of_life_halting", size=16, eval_size=0, seed=0)
    problems = _check(task)
    assert any("a garbage answer" in p and "the maximum: a reward hack" in p for p in problems), problems

    async def main() -> None:
        with VerifierPool(timeout_s=30.0) as pool:
            prompts = list(itertools.islice(task.prompts(), 8))
            await require_verified_task(task, "reasoning_gym", prompts, pool, skip=False, has_agent=False)

    with pytest.raises(
        TaskSelfCheckError,
        match=r"task 'reasoning_gym' failed its verifier self-check on item 'game_of_life_halting-train-s0-\d+'",
    ):
        asyncio.run(main())


class _RaisesOnItsReference(Task):
    """A scorer written for other answers: it raises on its own reference (and on everything else)."""

    name = "broken"

    def prompts(self) -> Iterator[Prompt]:
        for i in itertools.count():
            yield Prompt(prompt_id=f"broken-{i}", text="2+2=", answer="4")

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        raise KeyError("expected_answer")


class _OutOfRange(_RaisesOnItsReference):
    reward_range = (0.0, 1.0)

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        return VerifierResult(1.0 if completion_text == prompt.answer else 7.0)


def test_the_self_check_refuses_a_scorer_that_raises_on_its_own_reference_and_skip_lets_it_through() -> None:
    task = _RaisesOnItsReference()
    problems = _check(task, items=2)
    assert problems[0].startswith("its reference answer '4' scores nothing (infra_error: KeyError")
    assert any("an empty answer '' is an infra_error" in p for p in problems)

    async def main(skip: bool) -> None:
        with VerifierPool(timeout_s=30.0) as pool:
            prompts = list(itertools.islice(task.prompts(), 2))
            await require_verified_task(task, "broken", prompts, pool, skip=skip, has_agent=False)

    with pytest.raises(TaskSelfCheckError, match="item 'broken-0'"):
        asyncio.run(main(skip=False))
    asyncio.run(main(skip=True))


def test_a_reward_outside_the_task_s_range_is_refused_for_its_sample() -> None:
    task = _OutOfRange()
    prompt = next(task.prompts())
    assert _verify(task, prompt, "4") == VerifierResult(1.0)
    refused = _verify(task, prompt, "5")
    assert refused.status == "infra_error" and refused.info["reason"] == "reward_out_of_range"


@pytest.mark.parametrize(
    "name, args", [("reverse_digits", {"num_digits": 4}), ("reverse_digits", {"tokenizer": "digits"})]
)
def test_the_built_in_tasks_pass_the_self_check(name: str, args: dict) -> None:
    assert _check(get_task(name, **args)) == []


def _math_file(path: Path) -> Path:
    rows = [
        {"prompt": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
        {"prompt": "Solve x + 3 = 5.", "answer": "2"},
        {"prompt": "What is 0.5 * 3?", "answer": "1.5"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_math_problems_are_scored_by_math_verify_symbolically(tmp_path: Path) -> None:
    task = get_task(
        "math", path=str(_math_file(tmp_path / "math.jsonl")), eval_path=str(_math_file(tmp_path / "eval.jsonl"))
    )
    by_answer = {p.answer: p for p in itertools.islice(task.prompts(), 3)}
    quarter = by_answer["\\frac{3}{4}"]
    assert (
        _verify(task, quarter, "1/2 + 1/4 = 3/4, so \\boxed{0.75}").reward == 1.0
    )  # the same number, written otherwise
    assert _verify(task, quarter, "\\boxed{2/3}").reward == 0.0
    unreadable = _verify(task, quarter, "I do not know")
    assert unreadable.status == "format_error" and unreadable.reward == 0.0
    assert _verify(task, by_answer["2"], "x = 2").reward == 1.0
    assert _check(task, items=3) == []
    assert [p.prompt_id for p in task.eval_prompts() or []] == ["eval-0", "eval-1", "eval-2"]
    assert GARBAGE  # the self-check's garbage reply scored 0 on every item above
