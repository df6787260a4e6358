"""The chat tokenizer of the built-in agent task, shipped as a real ``tokenizer.json``, and its chat template.

One token per character over a small alphabet, after special tokens:
``<pad> <bos> <eos> <unk>``, the role markers ``<|system|> <|user|> <|assistant|> <|tool|>``, and the
Hermes tool-call markers ``<tool_call> </tool_call>``, so a role or a tool call costs one token and the
turns of an episode fit the tiny presets' 128 positions. ``<eos>`` ends every turn (the engine's stop
token). The template (``chat_template.jinja`` next to this module) is ChatML-like::

    <|system|>get_digits<eos><|user|>r<eos><|assistant|><tool_call>{"name": ...}</tool_call><eos><|tool|>123><eos><|assistant|>

with the tools listed by name only. A second variant, ``chat_digits_tokenizer.json``, keeps the
special tokens and only the digits and ``>``: with it a random policy writes a digit about half the time, so
the agent demo's reward starts well above zero. A test checks that both files are what `build_chat_tokenizer`
writes, so edit the function and regenerate the files, never the files by hand::

    python -c "from pipeline.tasks.chat_tokenizer import *; build_chat_tokenizer(TOKENIZER_PATH); \\
build_chat_tokenizer(DIGITS_TOKENIZER_PATH, characters=DIGITS_CHARACTERS)"
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Tokenizer

from pipeline.tasks.char_tokenizer import ALPHABETS, build_charset_tokenizer

TOKENIZER_PATH = Path(__file__).with_name("chat_tokenizer.json")
DIGITS_TOKENIZER_PATH = Path(__file__).with_name("chat_digits_tokenizer.json")
TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

SPECIAL_TOKENS = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<unk>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<tool_call>",
    "</tool_call>",
)
CHARACTERS = string.digits + '>{}":, _adegimnrstu'
"""Ordinary characters, in id order after the special tokens: the digits and the separator of the task, and what
the template's tool-call JSON and tool list need (``{"name": "get_digits", "arguments": {}}``). Like the
digits tokenizer of ``reverse_digits``, the alphabet is small on purpose: a random policy then writes digits
often enough for the reward to start above zero; any other character encodes as ``<unk>``."""


DIGITS_CHARACTERS = string.digits + ">"
"""The alphabet of the digits variant: what the policy writes in ``reverse_tool``; the template's other text
(tool names, tool-call JSON) encodes as ``<unk>``, a constant part of the context."""


def build_chat_tokenizer(path: str | Path | None = None, *, characters: str = CHARACTERS) -> Tokenizer:
    """Build the tokenizer (and write it to ``path`` when given); ``characters``: `CHARACTERS` or
    `DIGITS_CHARACTERS`."""
    return build_charset_tokenizer(SPECIAL_TOKENS, characters, unk="<unk>", path=path)


TEXT_CHARACTERS = ALPHABETS["text"]
"""The alphabet of the text variant: printable ASCII with newline and tab (shell commands, code, their output)."""


def load_chat_tokenizer(variant: str = "chat") -> Tokenizer:
    """The shipped tokenizer: ``chat`` (`CHARACTERS`) or ``digits`` (`DIGITS_CHARACTERS`); ``text``
    (`TEXT_CHARACTERS`, built here: nothing to ship) for tasks whose replies are code."""
    if variant not in ("chat", "digits", "text"):
        raise ValueError(f"chat tokenizer variant must be 'chat', 'digits' or 'text', got {variant!r}")
    if variant == "text":
        return build_chat_tokenizer(characters=TEXT_CHARACTERS)
    return Tokenizer.from_file(str(TOKENIZER_PATH if variant == "chat" else DIGITS_TOKENIZER_PATH))


def load_chat_template_text() -> str:
    """The shipped chat template."""
    return TEMPLATE_PATH.read_text()
