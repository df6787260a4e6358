"""The run's prompts in admission order, under ids unique per run, restartable at any count (resume)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace

from pipeline.chat.template import ChatTemplate
from pipeline.config import LeewayConfig
from pipeline.rl.prompt_ids import Tokenizer, UnrunnablePrompt, checked_prompt_ids
from pipeline.tasks import Prompt, Task, load_prompts, with_system_prompt
from pipeline.wire.prompts import PromptError

WIDEST_INDEX = 10**18 - 1
"""The widest admission index `admitted_index` reads: a row is sized as if admitted under it."""
WIDEST_VERSION = 2**63 - 1
"""The widest policy version a prompt is stamped with at admission: a row is sized as if stamped with it."""


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

    def __init__(
        self,
        cfg: LeewayConfig,
        task: Task,
        start: int,
        *,
        tokenizer: Tokenizer | None = None,
        max_context_tokens: int | None = None,
        template: ChatTemplate | None = None,
    ) -> None:
        """`tokenizer` and `max_context_tokens` (the model's context): check every row of `task.prompts_file`
        against them too (`check_prompt_rows`, chats rendered with `template`); the queue's message size is
        always checked. `task.system_prompt` opens every chat prompt that has no system message."""
        source: Iterator[Prompt]
        system = cfg.task.system_prompt
        if cfg.task.prompts_file is not None:
            rows = [with_system_prompt(p, system) for p in load_prompts(cfg.task.prompts_file)]
            if not rows:
                raise ValueError(f"task.prompts_file = {cfg.task.prompts_file!r}: no prompts")
            check_prompt_rows(
                rows,
                cfg.task.prompts_file,
                max_msg_bytes=cfg.stream.max_msg_bytes,
                tokenizer=tokenizer,
                max_context_tokens=max_context_tokens,
                template=template,
            )
            source = itertools.cycle(rows)
        else:
            source = (with_system_prompt(p, system) for p in task.prompts())
        self._prompts = itertools.islice(source, start, None)
        self.next_index = start

    def take(self, count: int) -> list[Prompt]:
        out = []
        for prompt in itertools.islice(self._prompts, count):
            out.append(replace(prompt, prompt_id=admitted_prompt_id(prompt.prompt_id, self.next_index)))
            self.next_index += 1
        return out


def check_prompt_rows(
    rows: Sequence[Prompt],
    path: str,
    *,
    max_msg_bytes: int,
    tokenizer: Tokenizer | None = None,
    max_context_tokens: int | None = None,
    template: ChatTemplate | None = None,
) -> None:
    """Refuse the whole file if one row can never be admitted or rolled out; the error names file, row, limit.

    A row larger than the prompt queue's message limit (`stream.max_msg_bytes`, sized with the widest
    admitted id and version) would fail its admission publish, permanently, at whatever step the cycle
    reaches it, and again on every resume (admission order is fixed); a row whose tokens leave no room
    for a reply in the model's context (given `tokenizer` and `max_context_tokens`) would be dead-lettered
    by every generator as `prompt_too_long`. Refusing the file when it is loaded, rather than skipping
    the row, keeps the admission order (`<id>.<i>`) that of the file as written, so a fixed file resumes
    the same run, and turns an hours-later crash or a silently smaller data set into one clear error now.
    """
    for index, prompt in enumerate(rows):
        widest_id = admitted_prompt_id(prompt.prompt_id, WIDEST_INDEX)
        try:
            size = len(replace(prompt, prompt_id=widest_id, policy_version=WIDEST_VERSION).to_json())
        except PromptError as exc:  # an id too long to carry the admission index
            raise ValueError(f"task.prompts_file {path}: row {index}: cannot be admitted: {exc}") from exc
        if size > max_msg_bytes:
            raise ValueError(
                f"task.prompts_file {path}: row {index} (prompt {prompt.prompt_id!r}) is {size} bytes on the "
                f"prompt queue, over stream.max_msg_bytes = {max_msg_bytes}; shorten the row or raise the limit"
            )
        if tokenizer is None or max_context_tokens is None:
            continue
        try:
            checked_prompt_ids(
                prompt, tokenizer, vocab_size=None, max_context_tokens=max_context_tokens, template=template
            )
        except UnrunnablePrompt as exc:
            raise ValueError(
                f"task.prompts_file {path}: row {index}: {exc} ({exc.reason}; model context "
                f"{max_context_tokens} tokens)"
            ) from exc
