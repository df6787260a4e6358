"""Built-in task ``math``: math problems from a JSONL or Parquet file, scored with math-verify (the optional extra
``leeway[envs]``).

    task:
      name: math
      args: {path: data/math.jsonl, eval_path: data/math-test.jsonl, seed: 0}

Rows as for every prompts file (`pipeline.tasks.load_prompts`): a ``prompt`` and an ``answer`` (LaTeX or plain,
``"\\frac{1}{2}"``, ``"0.5"``, ``"\\boxed{3}"``). math-verify reads the reply's final answer (``\\boxed{...}``
first, else the last expression it can parse) and compares it with the answer symbolically, so ``1/2`` and
``0.5`` agree. A reply with no answer math-verify can read, or one it chokes on, is a ``format_error``
(reward 0). The verifier runs in a scorer worker (`pipeline/tasks/verifiers.py`), on its main thread, where
math-verify's own signal time limits (`MATH_VERIFY_TIMEOUT_S`) work: ``\\boxed{9^{9^{9}}}`` scores 0 when they
fire, and the worker's deadline kills what they miss. The worker builds only `MathScorer` (no prompts file).

``eval_path`` names the held-out problems (`eval_prompts`); without it the task has no eval split. The task's
tokenizer (``tokenizer``: ``text`` or ``numeric``) is one of `char_tokenizer.alphabet_tokenizer`'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.char_tokenizer import alphabet_tokenizer
from pipeline.tasks.files import load_prompts, shuffled_epochs
from pipeline.tasks.scorer_recipe import ScorerRecipe
from pipeline.wire.prompts import Prompt

logging.getLogger("math_verify").setLevel(logging.ERROR)  # off the main thread it warns on every call

MATH_VERIFY_TIMEOUT_S = 3
"""math-verify's own limit on parsing and on comparing (seconds, each; main thread only)."""


class MathTask(Task):
    """Problems from ``path``, cycled forever in an order shuffled per epoch from ``seed``; see the module docstring."""

    name = "math"
    reward_range = (0.0, 1.0)
    scorer_recipe = ScorerRecipe("pipeline.tasks.math_problems:MathScorer")

    def __init__(self, path: str, seed: int = 0, eval_path: str | None = None, tokenizer: str = "text") -> None:
        try:
            import math_verify  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"task math needs the math-verify package: pip install 'leeway[envs]' ({exc})") from exc
        self._prompts = load_prompts(path)
        if not self._prompts:
            raise ValueError(f"math: task.args.path {path} has no rows")
        missing = [p.prompt_id for p in self._prompts if p.answer is None]
        if missing:
            raise ValueError(f"math: every row of {path} needs an 'answer'; {missing[0]} has none")
        self._eval = load_prompts(eval_path) if eval_path is not None else None
        self._seed = seed
        self.tokenizer = alphabet_tokenizer(tokenizer)

    def prompts(self) -> Iterator[Prompt]:
        return shuffled_epochs(self._prompts, f"math-{self._seed}")

    def eval_prompts(self) -> list[Prompt] | None:
        return None if self._eval is None else list(self._eval)

    def completion_for(self, answer: str) -> str:
        answer = answer.strip()
        return answer if answer.startswith("\\boxed") else f"\\boxed{{{answer}}}"

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        return score_math(prompt, completion_text)


class MathScorer:
    """What a scorer worker builds for the math task: its verifier alone."""

    reward_range = MathTask.reward_range

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        return score_math(prompt, completion_text)


def score_math(prompt: Prompt, completion_text: str) -> VerifierResult:
    """math-verify's verdict on the reply against the prompt's answer, with its time limits on where they work."""
    from math_verify import parse, verify

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    if prompt.answer is None:
        raise ValueError(f"math: prompt {prompt.prompt_id!r} has no answer")
    gold = _parse(parse, prompt.answer)
    if not gold:
        raise ValueError(f"math: math-verify cannot read the answer of prompt {prompt.prompt_id!r}: {prompt.answer!r}")
    try:
        given = parse(completion_text, parsing_timeout=timeout)
        if not given:
            return VerifierResult(0.0, "format_error", {"reason": "no answer math-verify can read in the reply"})
        right = verify(gold, given, timeout_seconds=timeout)
    except Exception as exc:  # math-verify choked on what the policy wrote
        return VerifierResult(0.0, "format_error", {"reason": "scorer_raised", "error": f"{type(exc).__name__}: {exc}"})
    return VerifierResult(1.0 if right else 0.0)


def _parse(parse: Any, answer: str) -> list[Any]:
    """The reference as math-verify reads it: as written, else as an inline formula (a bare ``\\frac{1}{2}``)."""
    return parse(answer, parsing_timeout=None) or parse(f"${answer}$", parsing_timeout=None)
