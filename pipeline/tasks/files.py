"""Prompts and rows from files: `load_prompts` (a JSONL or Parquet prompt file, each row checked), `read_rows` (the
rows of such a file, shared with SFT's examples), `with_system_prompt` and `shuffled_epochs` (a prompt list cycled
forever in an order every process agrees on).

What a file-backed task builds on (``exact_match``, ``math``, ``skyrl_gym``, a run's `task.prompts_file`), kept apart
from the task contract so that reading a file never needs more than the prompt record.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.wire.prompts import Prompt, PromptError


def load_prompts(path: str | Path, *, id_prefix: str | None = None) -> list[Prompt]:
    """Prompts from a JSONL or Parquet file of rows ``{"prompt": str, "answer": str?, "tags": [str]?, ...}``, or
    chats: ``{"messages": [{"role", "content"}, ...], ...}`` instead of ``prompt`` (rendered with the model's chat
    template by the generator). Other columns go to ``metadata``. ``prompt_id`` is the row's ``id`` column if present, else
    ``<file stem>-<row index>``. A row without a string ``prompt`` raises ValueError naming file and row.
    """
    path = Path(path)
    rows = read_rows(path, what="prompt file")
    prefix = id_prefix or path.stem
    return [_prompt_from_row(row, path, i, prefix) for i, row in enumerate(rows)]


def read_rows(path: str | Path, *, what: str) -> list[Any]:
    """The rows of a JSONL or Parquet file (prompts, SFT examples); ValueError naming `what`, the file and the line
    for a missing file, another format or a line that is not JSON."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{what} {path}: expected a .jsonl or .parquet file")
    rows = []
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: not valid JSON: {exc}") from exc
    return rows


def _prompt_from_row(row: Any, path: Path, index: int, prefix: str) -> Prompt:
    if not isinstance(row, dict):
        raise ValueError(f"{path}: row {index} is not an object")
    messages = row.get("messages")
    if messages is None and not isinstance(row.get("prompt"), str):
        raise ValueError(f"{path}: row {index} has neither a string 'prompt' nor a list 'messages'")
    if messages is not None and row.get("prompt") is not None:
        raise ValueError(f"{path}: row {index} has both 'prompt' and 'messages'; give one")
    answer = row.get("answer")
    metadata = {k: v for k, v in row.items() if k not in ("prompt", "messages", "answer", "tags", "id")}
    try:
        return Prompt(
            prompt_id=str(row.get("id", f"{prefix}-{index}")),
            text=row.get("prompt"),
            messages=None if messages is None else [_file_message(m) for m in messages],
            answer=None if answer is None else str(answer),
            metadata=metadata,
            tags=tuple(str(t) for t in row.get("tags") or ()),
        )
    except PromptError as exc:
        raise ValueError(f"{path}: row {index}: {exc}") from exc


def shuffled_epochs(items: Sequence[Any], key: str) -> Iterator[Any]:
    """`items` forever, each epoch in an order shuffled from ``key`` and the epoch: the same in every process."""
    for epoch in itertools.count():
        order = list(items)
        random.Random(f"{key}-{epoch}").shuffle(order)
        yield from order


def with_system_prompt(prompt: Prompt, system_prompt: str | None) -> Prompt:
    """`prompt` with a system message first, when it is a chat without one and `system_prompt` is set
    (``task.system_prompt``); any other prompt as it is."""
    if system_prompt is None or prompt.messages is None or prompt.messages[0].get("role") == "system":
        return prompt
    return replace(prompt, messages=({"role": "system", "content": system_prompt}, *prompt.messages))


def _file_message(message: Any) -> Any:
    """A message as a file holds it; Parquet's struct columns give every key of every row, unset ones as None."""
    if not isinstance(message, dict):
        return message
    return {k: v for k, v in message.items() if v is not None or k == "content"}
