"""Built-in task ``exact_match``: prompts from a JSONL or Parquet file, reward 1 for the answer exactly.

task:
  name: exact_match
  args: {path: prompts.jsonl, seed: 0}
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.files import load_prompts, shuffled_epochs
from pipeline.wire.prompts import Prompt


class ExactMatchTask(Task):
    """Prompts from a JSONL/Parquet file, cycled forever in an order shuffled per epoch from ``seed``;
    reward 1 when the stripped completion equals the stripped answer, else 0."""

    name = "exact_match"

    def __init__(self, path: str, seed: int = 0) -> None:
        self._prompts = load_prompts(path)
        if not self._prompts:
            raise ValueError(f"exact_match: prompt file {path} has no rows")
        if any(p.answer is None for p in self._prompts):
            raise ValueError(f"exact_match: every row of {path} needs an 'answer'")
        self._seed = seed

    def prompts(self) -> Iterator[Prompt]:
        return shuffled_epochs(self._prompts, str(self._seed))

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        assert prompt.answer is not None
        return VerifierResult(float(completion_text.strip() == prompt.answer.strip()))
