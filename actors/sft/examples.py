"""SFT examples: rows of a file, or a task's reference answers, as token ids with the loss on what the model writes.

Every example is rendered exactly as the RL pipeline later sees the same conversation, so SFT teaches the tokens
the generator will sample:

- a text prompt with a completion: the prompt's ids as a generator builds them (`prompt_token_ids`: ``<bos>`` and
  the text), then the completion's ids and the stop token the engine stops at (the chat template's end-of-turn
  token, else the tokenizer's EOS); the loss covers the completion and that stop token;
- a chat (``messages``, or a prompt given as messages): rendered with the model's chat template; every assistant
  turn is what the template appends after the conversation before it with the generation prompt, up to and
  including its end-of-turn token (what the template writes after that token, a newline in ChatML, is context,
  never sampled, so never trained on). A template that does not render an assistant turn by appending (one that
  rewrites earlier turns) is refused for that row, naming it;
- ``sft.from_task``: each train prompt of the task, rendered as the generator renders it (chat template,
  ``task.system_prompt``), with `Task.reference_completion` as the completion.

Rows that are not what they should be are refused naming the file and row (nothing is guessed); examples longer
than the model's context or with ids outside its vocabulary are left out and counted (`ExampleSet.skipped`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from actors.models import eos_token_id
from pipeline.chat.template import ChatTemplate, ChatTemplateError
from pipeline.rl.prompt_ids import UnrunnablePrompt, checked_prompt_ids, prompt_token_ids
from pipeline.tasks import Prompt, Task, read_rows, with_system_prompt

FROM_TASK_LIMIT = 100_000
"""`sft.from_task` without `sft.max_examples` stops here on a task whose train prompts never repeat."""


class ExampleError(ValueError):
    """A row that cannot become an example; the message names the file (or task) and the row."""


@dataclass(frozen=True, eq=False)
class SftExample:
    """One example: ``tokens`` and a bool ``loss_mask`` of the same length (``loss_mask[0]`` is False)."""

    example_id: str
    tokens: np.ndarray
    loss_mask: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


@dataclass
class ExampleSet:
    """The examples of one SFT run, where they came from, and what was left out (reason -> count)."""

    examples: list[SftExample]
    source: str
    skipped: Counter[str] = field(default_factory=Counter)

    def fingerprint(self) -> str:
        """A hash of every example's ids and mask: `leeway sft --resume` refuses state saved over other data."""
        digest = hashlib.sha256()
        for example in self.examples:
            digest.update(example.tokens.astype(np.int64).tobytes())
            digest.update(np.packbits(example.loss_mask).tobytes())
            digest.update(b"|")
        return digest.hexdigest()


class Renderer:
    """Turns prompts, completions and chats into (ids, loss mask) with the run's tokenizer and chat template."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        stop = template.eos_id if template is not None else eos_token_id(tokenizer)
        if stop is None:
            raise ValueError("sft: the tokenizer has no end-of-sequence token to end a completion with")
        self.stop_id = int(stop)

    def completion_ids(self, text: str) -> list[int]:
        return [*self.tokenizer.encode(text, add_special_tokens=False).ids, self.stop_id]

    def prompt_completion(self, prompt_ids: Sequence[int], completion: str) -> tuple[list[int], list[bool]]:
        reply = self.completion_ids(completion)
        return [*prompt_ids, *reply], [False] * len(prompt_ids) + [True] * len(reply)

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[bool]]:
        """A whole conversation; the loss on its assistant turns (see the module docstring)."""
        if self.template is None:
            raise ExampleError(
                "a chat (messages) needs a chat template: set model.chat_template, or give model.tokenizer a "
                "directory that has one (chat_template.jinja, or the key in tokenizer_config.json)"
            )
        messages = [dict(m) for m in messages]
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            raise ExampleError("the chat has no assistant message to learn")
        try:
            ids = self.template.render(messages, generation=False)
            mask = [False] * len(ids)
            for i in turns:
                before = self.template.render(messages[:i], generation=True)
                through = self.template.render(messages[: i + 1], generation=False)
                if through[: len(before)] != before or ids[: len(through)] != through:
                    raise ExampleError(
                        f"the chat template does not render assistant message {i} by appending to the conversation "
                        "before it (it rewrites earlier turns); give such conversations one assistant turn each"
                    )
                reply = through[len(before) :]
                end = reply.index(self.template.eos_id) + 1 if self.template.eos_id in reply else len(reply)
                for position in range(len(before), len(before) + end):
                    mask[position] = True
        except ChatTemplateError as exc:
            raise ExampleError(str(exc)) from exc
        return ids, mask


def example(example_id: str, ids: Sequence[int], mask: Sequence[bool]) -> SftExample:
    return SftExample(example_id, np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.bool_))


def examples_from_file(path: str | Path, renderer: Renderer, *, max_examples: int | None = None) -> list[SftExample]:
    """Rows ``{"messages": [...]}`` or ``{"prompt": str | messages, "completion": str | messages}`` of a JSONL or
    Parquet file (an ``id`` column names the example); see the module docstring."""
    path = Path(path)
    rows = read_rows(path, what="sft.data")
    out = []
    for index, row in enumerate(rows[:max_examples] if max_examples else rows):
        where = f"{path}: row {index}"
        try:
            ids, mask = _row(row, renderer)
        except ExampleError as exc:
            raise ExampleError(f"{where}: {exc}") from exc
        out.append(example(str(row.get("id", f"{path.stem}-{index}")), ids, mask))
    if not out:
        raise ExampleError(f"{path}: no examples")
    return out


def _row(row: Any, renderer: Renderer) -> tuple[list[int], list[bool]]:
    if not isinstance(row, dict):
        raise ExampleError("is not an object")
    messages, prompt, completion = row.get("messages"), row.get("prompt"), row.get("completion")
    if messages is not None:
        if prompt is not None or completion is not None:
            raise ExampleError("has 'messages' and 'prompt'/'completion'; give one form")
        return renderer.chat(_messages(messages, "messages"))
    if prompt is None or completion is None:
        raise ExampleError("needs 'messages', or both 'prompt' and 'completion'")
    if isinstance(prompt, str) and isinstance(completion, str):
        text_prompt = Prompt(prompt_id="sft", text=prompt)
        return renderer.prompt_completion(prompt_token_ids(text_prompt, renderer.tokenizer), completion)
    if isinstance(prompt, str):
        raise ExampleError("'completion' is a list of messages: give 'prompt' as messages too")
    reply = (
        [{"role": "assistant", "content": completion}]
        if isinstance(completion, str)
        else _messages(completion, "completion")
    )
    return renderer.chat([*_messages(prompt, "prompt"), *reply])


def _messages(value: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) and "role" in m for m in value):
        raise ExampleError(f"'{name}' must be a non-empty list of messages with a 'role'")
    return [{k: v for k, v in m.items() if v is not None or k == "content"} for m in value]


def examples_from_task(
    task: Task,
    renderer: Renderer,
    *,
    task_name: str,
    system_prompt: str | None = None,
    max_examples: int | None = None,
    skipped: Counter[str] | None = None,
) -> list[SftExample]:
    """The task's train prompts (until one repeats: one epoch of a finite split), each with its reference
    completion; prompts without one are counted in ``skipped`` as ``no_reference``."""
    skipped = Counter() if skipped is None else skipped
    limit = max_examples or FROM_TASK_LIMIT
    seen: set[str] = set()
    out: list[SftExample] = []
    for prompt in _take(task.prompts(), limit):
        if prompt.prompt_id in seen:
            break
        seen.add(prompt.prompt_id)
        completion = task.reference_completion(prompt)
        if completion is None:
            skipped["no_reference"] += 1
            continue
        try:
            ids = checked_prompt_ids(
                with_system_prompt(prompt, system_prompt),
                renderer.tokenizer,
                vocab_size=None,
                max_context_tokens=None,
                template=renderer.template,
            )
        except UnrunnablePrompt as exc:
            skipped[exc.reason.value] += 1
            continue
        out.append(example(prompt.prompt_id, *renderer.prompt_completion(ids, completion)))
    if not out:
        raise ExampleError(
            f"sft.from_task: task {task_name!r} gave no example with a reference answer "
            f"(Task.reference_completion; left out: {dict(skipped)})"
        )
    return out


def _take(items: Iterable[Prompt], limit: int) -> Iterable[Prompt]:
    for n, item in enumerate(items):
        if n >= limit:
            return
        yield item


def within_limits(
    examples: list[SftExample], *, vocab_size: int, max_tokens: int, skipped: Counter[str]
) -> list[SftExample]:
    """The examples the model can take: at most ``max_tokens`` ids, all in ``[0, vocab_size)``, something to learn."""
    kept = []
    for ex in examples:
        if ex.num_tokens > max_tokens:
            skipped["too_long"] += 1
        elif int(ex.tokens.min()) < 0 or int(ex.tokens.max()) >= vocab_size:
            skipped["invalid_token_ids"] += 1
        elif ex.num_loss_tokens == 0:
            skipped["nothing_to_learn"] += 1
        else:
            kept.append(ex)
    return kept
