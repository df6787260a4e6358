"""The run's prompts in admission order, under ids unique per run, restartable at any count (resume)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace

from pipeline.config import LeewayConfig
from pipeline.tasks import Prompt, Task, load_prompts


def admitted_prompt_id(prompt_id: str, index: int) -> str:
    """The id a prompt is admitted under: unique per run even when a task cycles its prompts."""
    return f"{prompt_id}.{index}"


def admitted_index(admitted_id: str) -> int | None:
    """The admission index `i` of an id made by `admitted_prompt_id`; None for an id not of that form."""
    _, dot, index = admitted_id.rpartition(".")
    return int(index) if dot and index.isdigit() and len(index) < 19 else None


class PromptFeed:
    """The run's prompts in admission order: the task's deterministic stream (or `task.prompts_file`,
    cycled), the i-th renamed `admitted_prompt_id(id, i)`. Built at `start` = prompts already
    admitted, so a resumed trainer re-admits exactly the ids it admitted after its checkpoint
    (the queue deduplicates them by `Nats-Msg-Id`) and then continues."""

    def __init__(self, cfg: LeewayConfig, task: Task, start: int) -> None:
        source: Iterator[Prompt]
        if cfg.task.prompts_file is not None:
            rows = load_prompts(cfg.task.prompts_file)
            if not rows:
                raise ValueError(f"task.prompts_file = {cfg.task.prompts_file!r}: no prompts")
            source = itertools.cycle(rows)
        else:
            source = task.prompts()
        self._prompts = itertools.islice(source, start, None)
        self.next_index = start

    def take(self, count: int) -> list[Prompt]:
        out = []
        for prompt in itertools.islice(self._prompts, count):
            out.append(replace(prompt, prompt_id=admitted_prompt_id(prompt.prompt_id, self.next_index)))
            self.next_index += 1
        return out
