"""Built-in task ``reverse_digits``: reverse a string of random digits.

Prompt text ``"31415926>"`` (the rollout prepends ``<bos>``); the expected completion is
``"62951413"`` followed by the stop token ``<eos>`` of the char tokenizer (`char_tokenizer.EOS_ID`).

Reward, per-position partial credit so a random policy already sees a gradient:
- the completion (its final stop token removed) must be one or more digits and nothing else, else
  ``format_error`` with reward 0 (a stray symbol or special token is a policy mistake);
- otherwise reward = (positions that match the reversed digits) / max(len(completion), num_digits),
  so both missing and extra digits cost credit.

Prompts are an infinite deterministic stream from ``seed``: the same seed yields the same prompts and
ids in every process.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from itertools import count

from pipeline.tasks import Prompt, Task, VerifierResult

SEPARATOR = ">"


class ReverseDigitsTask(Task):
    """Reverse ``num_digits`` random digits; see the module docstring for the reward."""

    name = "reverse_digits"

    def __init__(self, num_digits: int = 8, seed: int = 0) -> None:
        if num_digits < 1:
            raise ValueError(f"reverse_digits: num_digits must be >= 1, got {num_digits}")
        self.num_digits = num_digits
        self.seed = seed

    def prompts(self) -> Iterator[Prompt]:
        rng = random.Random(f"reverse_digits-{self.seed}")
        for index in count():
            digits = "".join(rng.choice("0123456789") for _ in range(self.num_digits))
            yield Prompt(prompt_id=f"reverse_digits-s{self.seed}-{index}", text=digits + SEPARATOR,
                         answer=digits[::-1], tags=("reverse_digits",))

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        if prompt.answer is None:
            raise ValueError(f"reverse_digits: prompt {prompt.prompt_id!r} has no answer")
        return VerifierResult(*score_reversal(prompt.answer, completion_text))


def score_reversal(target: str, completion: str) -> tuple[float, str, dict[str, object]]:
    """(reward, status, info) of ``completion`` against the reversed digits ``target``."""
    if not completion or not all(c in "0123456789" for c in completion):
        return 0.0, "format_error", {"reason": "completion is not a non-empty string of digits"}
    matches = sum(a == b for a, b in zip(target, completion, strict=False))
    return matches / max(len(completion), len(target)), "ok", {"matches": matches}
