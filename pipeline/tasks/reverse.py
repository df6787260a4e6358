"""Built-in task ``reverse_digits``: reverse a string of random digits.

Prompt text ``"31415926>"`` (the rollout prepends ``<bos>``); the expected completion is
``"62951413"`` followed by the stop token ``<eos>`` of the char tokenizer (`char_tokenizer.EOS_ID`).

Reward, per-position partial credit so a random policy already sees a gradient:
- the completion (its final stop token removed) is read as a sequence of positions, one per character,
  a special token such as ``<pad>`` counting as one position (the rollout decodes with special tokens
  kept);
- a completion without a single digit (e.g. empty, or only symbols) is a ``format_error`` with reward 0;
- otherwise reward = (positions that hold the right digit of the reversed string) / max(positions,
  num_digits): a stray symbol or special token at a position is simply a wrong position, and both
  missing and extra positions cost credit.

Length budget: with ``max_new_tokens = num_digits`` an exact answer scores 1.0 whether or not the
stop token follows (a reply cut by the length limit is ``truncated``, still scored and trained on);
with ``num_digits + 1`` the policy must also learn to stop, since the extra position caps the reward
at num_digits / (num_digits + 1).

Prompts are an infinite deterministic stream from ``seed``: the same seed yields the same prompts and
ids in every process. ``order: copy`` asks for the digits as given instead (same prompts, same reward rule).

Tokenizer (``tokenizer`` argument, exposed as the task's ``tokenizer`` attribute, which generators and
trainer use unless ``model.tokenizer`` is set): ``"char"`` (default), the shared char tokenizer of 21
tokens, or ``"digits"``, the 14-token `digits_tokenizer` (specials, digits and ``>`` only), with which a
random policy writes mostly digits and starts near the chance reward of 0.1 per position. Both give
``<pad> <bos> <eos>`` the ids 0, 1, 2.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from itertools import count
from typing import Any

from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.char_tokenizer import SPECIAL_TOKENS
from pipeline.wire.prompts import Prompt

SEPARATOR = ">"
DIGITS = "0123456789"
_POSITION_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS) + "|.", re.DOTALL)


class ReverseDigitsTask(Task):
    """Reverse ``num_digits`` random digits; see the module docstring for the reward."""

    name = "reverse_digits"

    def __init__(self, num_digits: int = 8, seed: int = 0, tokenizer: str = "char", order: str = "reverse") -> None:
        if num_digits < 1:
            raise ValueError(f"reverse_digits: num_digits must be >= 1, got {num_digits}")
        if order not in ORDERS:
            raise ValueError(f"reverse_digits: order must be one of {list(ORDERS)}, got {order!r}")
        self.order = order
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"reverse_digits: tokenizer must be one of {sorted(TOKENIZERS)}, got {tokenizer!r}")
        self.num_digits = num_digits
        self.seed = seed
        self.tokenizer_name = tokenizer
        self.tokenizer: Any = _load_tokenizer(tokenizer)

    def prompts(self) -> Iterator[Prompt]:
        rng = random.Random(f"reverse_digits-{self.seed}")
        for index in count():
            digits = "".join(rng.choice(DIGITS) for _ in range(self.num_digits))
            yield Prompt(
                prompt_id=f"reverse_digits-s{self.seed}-{index}",
                text=digits + SEPARATOR,
                answer=digits[::-1] if self.order == "reverse" else digits,
                tags=("reverse_digits",),
            )

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        if prompt.answer is None:
            raise ValueError(f"reverse_digits: prompt {prompt.prompt_id!r} has no answer")
        return VerifierResult(*score_reversal(prompt.answer, completion_text))


ORDERS = ("reverse", "copy")
"""What a reply must write: the digits reversed (the demo: a positional task for learned absolute positions), or as
given (``copy``: a constant offset back, which rotary positions express directly; the MoE demo's RoPE model learns
it in the demo's time, where reversal takes it thousands of steps)."""
TOKENIZERS = ("char", "digits")
"""Tokenizers a `ReverseDigitsTask` can choose."""


def _load_tokenizer(name: str) -> Any:
    if name == "digits":
        from pipeline.tasks.digits_tokenizer import load_digits_tokenizer

        return load_digits_tokenizer()
    from pipeline.tasks.char_tokenizer import load_char_tokenizer

    return load_char_tokenizer()


def completion_positions(completion: str) -> list[str]:
    """The completion's positions: one per character, a special token ``<...>`` of the char tokenizer as one."""
    return _POSITION_RE.findall(completion)


def score_reversal(target: str, completion: str) -> tuple[float, str, dict[str, object]]:
    """(reward, status, info) of ``completion`` against the reversed digits ``target``."""
    positions = completion_positions(completion)
    if not any(p in DIGITS for p in positions):
        return 0.0, "format_error", {"reason": "completion holds no digit"}
    matches = sum(a == b for a, b in zip(target, positions, strict=False))
    return matches / max(len(positions), len(target)), "ok", {"matches": matches}
