"""Tasks: where prompts come from and how completions are scored.

A `Task` yields `Prompt`s (the one prompt record, `pipeline/prompts.py`) and scores a completion with
`Task.verify`, which returns a `VerifierResult` with status ``ok`` (reward set) or ``format_error``
(reward 0: the policy's fault, trained on). The caller never invokes ``verify`` directly but through `run_verifier`, which applies a timeout and turns
an exception or a timeout into ``infra_error`` with reward None: an infrastructure failure is never
scored as a policy failure, so it stays out of the loss and out of the group baseline.

`get_task` resolves a built-in name (`BUILTIN_TASKS`) or ``"package.module:function"``; built-ins are
imported lazily so that importing this package stays cheap and free of circular imports.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import json
import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline.prompts import Prompt, PromptError

logger = logging.getLogger(__name__)

VerifierStatus = Literal["ok", "format_error", "infra_error"]

BUILTIN_TASKS: dict[str, str] = {
    "reverse_digits": "pipeline.tasks.reverse:ReverseDigitsTask",
    "exact_match": "pipeline.tasks:ExactMatchTask",
}
"""Built-in task name -> ``module:callable`` returning a `Task`."""


@dataclass(frozen=True)
class VerifierResult:
    """``reward`` is None exactly when ``status == "infra_error"``; ``format_error`` carries reward 0."""

    reward: float | None
    status: VerifierStatus = "ok"
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.reward is None) != (self.status == "infra_error"):
            raise ValueError(f"VerifierResult: reward={self.reward!r} does not fit status={self.status!r}")


class Task(ABC):
    """A prompt source and a verifier. ``verify`` may be a plain or an ``async`` method; it runs in a
    worker thread (plain) or on the event loop (async) under `run_verifier`'s timeout."""

    name: str = "task"

    @abstractmethod
    def prompts(self) -> Iterator[Prompt]:
        """The prompts, in a deterministic order (built-in tasks: infinite, from their seed)."""

    @abstractmethod
    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        """Score one completion (the reply text with its final stop token removed, and the reply's ids)."""


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a task from a built-in name or ``"module:function"`` (called with ``kwargs``)."""
    target = BUILTIN_TASKS.get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"task {name!r} is neither a built-in ({sorted(BUILTIN_TASKS)}) nor 'module:function'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"task {name!r}: cannot import {target!r}: {exc}") from exc
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise ValueError(f"task {name!r}: {target} returned {type(task).__name__}, not a pipeline.tasks.Task")
    return task


async def run_verifier(
    task: Task, prompt: Prompt, completion_text: str, completion_ids: Sequence[int], *, timeout_s: float
) -> VerifierResult:
    """``task.verify`` with a timeout; an exception or a timeout becomes ``infra_error`` with reward None.

    A plain ``verify`` runs in a worker thread, which cannot be killed: after a timeout it may keep running
    in the background, but its result is ignored.
    """
    try:
        if inspect.iscoroutinefunction(task.verify):
            coro = task.verify(prompt, completion_text, completion_ids)
        else:
            coro = asyncio.to_thread(task.verify, prompt, completion_text, completion_ids)
        result = await asyncio.wait_for(coro, timeout=timeout_s)
    except asyncio.TimeoutError:
        logger.warning(
            "verifier of task %s timed out after %.1f s on prompt %s", task.name, timeout_s, prompt.prompt_id
        )
        return VerifierResult(None, "infra_error", {"error": f"verifier timed out after {timeout_s} s"})
    except Exception as exc:  # a boundary we own: any verifier failure is an infrastructure failure
        logger.exception("verifier of task %s raised on prompt %s", task.name, prompt.prompt_id)
        return VerifierResult(None, "infra_error", {"error": f"{type(exc).__name__}: {exc}"})
    if not isinstance(result, VerifierResult):
        return VerifierResult(None, "infra_error", {"error": f"verifier returned {type(result).__name__}"})
    return result


def load_prompts(path: str | Path, *, id_prefix: str | None = None) -> list[Prompt]:
    """Prompts from a JSONL or Parquet file of rows ``{"prompt": str, "answer": str?, "tags": [str]?, ...}``.

    Other columns go to ``metadata``. ``prompt_id`` is the row's ``id`` column if present, else
    ``<file stem>-<row index>``. A row without a string ``prompt`` raises ValueError naming file and row.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open() as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{line_no}: not valid JSON: {exc}") from exc
    else:
        raise ValueError(f"prompt file {path}: expected a .jsonl or .parquet file")
    prefix = id_prefix or path.stem
    return [_prompt_from_row(row, path, i, prefix) for i, row in enumerate(rows)]


def _prompt_from_row(row: Any, path: Path, index: int, prefix: str) -> Prompt:
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise ValueError(f"{path}: row {index} has no string 'prompt' field")
    answer = row.get("answer")
    metadata = {k: v for k, v in row.items() if k not in ("prompt", "answer", "tags", "id")}
    try:
        return Prompt(
            prompt_id=str(row.get("id", f"{prefix}-{index}")),
            text=row["prompt"],
            answer=None if answer is None else str(answer),
            metadata=metadata,
            tags=tuple(str(t) for t in row.get("tags") or ()),
        )
    except PromptError as exc:
        raise ValueError(f"{path}: row {index}: {exc}") from exc


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
        for epoch in itertools.count():
            order = list(self._prompts)
            random.Random(f"{self._seed}-{epoch}").shuffle(order)
            yield from order

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        assert prompt.answer is not None
        return VerifierResult(float(completion_text.strip() == prompt.answer.strip()))
