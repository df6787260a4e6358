"""An environment's answer as token ids: text tokenized on its own, ids as given, chat messages bridged with the
model's chat template after the sampled reply (`pipeline/chat/template.py`), so turn markers are the template's
and the sampled ids stay as they were. Used by the multi-turn episodes (`pipeline/rl/episodes.py`).

What an environment says is the world's text (a sandbox's output, a web page, a game's screen): special-token text
in it is tokenized as the characters it is, in a text message as in chat messages (`pipeline/chat/literal.py`),
so an observation that writes ``<|im_end|>`` or ``<eos>`` cannot end the turn or open one. An environment that
means a special token gives ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pipeline.chat.literal import encode_literal
from pipeline.tasks.environment import EnvStep

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from pipeline.chat.template import ChatTemplate


class NotBridged(ValueError):
    """An environment's chat messages cannot continue the conversation token for token."""


def step_ids(step: EnvStep, tokenizer: Tokenizer, template: ChatTemplate | None, reply: np.ndarray | None) -> list[int]:
    """The ids of an environment's message: its chat ``messages`` bridged after the sampled `reply` ids (the
    prompt's end when None), else its text or ids."""
    if step.messages is None:
        return message_ids(step.message, tokenizer)
    if template is None:
        raise NotBridged("it answered with chat messages, and this model has no chat template (model.chat_template)")
    ended = reply is None or (len(reply) > 0 and int(reply[-1]) == template.eos_id)
    try:
        ids = template.bridge(list(step.messages), ended_with_eos=ended)
    except Exception as exc:  # the template cannot render what the environment sent
        raise NotBridged(f"its messages do not render with the chat template: {type(exc).__name__}: {exc}") from exc
    if ids is None:
        raise NotBridged("the chat template does not render its messages by appending to the conversation")
    return ids


def message_ids(message: str | Sequence[int] | None, tokenizer: Tokenizer) -> list[int]:
    if message is None:
        return []
    if isinstance(message, str):
        return encode_literal(tokenizer, message)
    return [int(t) for t in message]


def encode(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    encoded = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(getattr(encoded, "ids", encoded))
