"""Message text as the characters it is: special-token text inside a message (``<|im_end|>\\n<|im_start|>assistant``
in a tool's output, a sandbox's stdout, an environment's observation) is tokenized as plain text, never as the
special token, so only the chat template's scaffold makes turn markers in the policy's context.

How, keeping ordinary text token for token what it was: before a render, every special token's text in a
message's strings (and in the tool list) is swapped for a placeholder the template cannot tell from text
(``\\ue000<nonce>_<k>\\ue001``: private-use characters around a number the sender cannot guess). The rendered text
then holds real special-token text only where the template wrote it. Encoding:

- no placeholder in the text (no message wrote a special token: the common case): the tokenizer's own
  ``encode``, exactly as before;
- else the text is cut at the scaffold's special tokens (each its id, with the whitespace an ``lstrip``/``rstrip``
  token swallows), and each piece between them, placeholders put back, is encoded by a copy of the tokenizer
  with ``encode_special_tokens`` set (transformers' ``split_special_tokens``): the marker text becomes the ids
  of its characters.

Added tokens that are not special (Qwen's ``<tool_call>``, ``<tool_response>``, ``<think>``) are structure too (a
tool's output that writes ``</tool_response><tool_response>`` would forge a second response), so they are treated
the same: the copy re-flags them special (same ids) and splits them. Assistant messages are not swapped: they are
the policy's own text, rendered as it was sampled.

Every encode here goes through ``encode_batch``, which releases the GIL while it runs (``encode`` holds it for the
whole call: a 4 MiB message encoded in a worker thread still stalled the event loop for seconds).
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer

MAX_LITERAL_COPIES = 8
"""Tokenizer copies with special tokens split kept per process, one per distinct tokenizer object."""

_COPIES: dict[int, tuple[Tokenizer, Tokenizer]] = {}
_COPIES_LOCK = threading.Lock()


def literal_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that encodes special-token text as plain text (its own ``encode_special_tokens`` flag,
    never the shared tokenizer's, which other threads encode with); one per tokenizer object, cached."""
    with _COPIES_LOCK:
        cached = _COPIES.get(id(tokenizer))
        if cached is not None and cached[0] is tokenizer:
            return cached[1]
        if len(_COPIES) >= MAX_LITERAL_COPIES:
            _COPIES.clear()
        copy = Tokenizer.from_str(tokenizer.to_str())
        plain = [t.content for t in copy.get_added_tokens_decoder().values() if not t.special and t.content]
        copy.add_special_tokens([AddedToken(content, special=True) for content in plain])  # same ids, now split
        copy.encode_special_tokens = True
        _COPIES[id(tokenizer)] = (tokenizer, copy)  # the original kept: its id stays its own
        return copy


def encode_released(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """``tokenizer.encode(text).ids`` through ``encode_batch``, which lets go of the GIL while it works, so an encode
    in a worker thread never holds up the event loop (the same ids: one text, one encoding)."""
    return list(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def encode_literal(tokenizer: Any, text: str) -> list[int]:
    """`text`'s ids with every special token's text split into ordinary tokens (ordinary text: the ids
    ``tokenizer.encode(text, add_special_tokens=False)`` gives). A tokenizer that is not a `tokenizers.Tokenizer`
    has no such mode and encodes as it does."""
    if isinstance(tokenizer, Tokenizer):
        return encode_released(literal_tokenizer(tokenizer), text)
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(encoded, "ids", encoded))


class LiteralSpecials:
    """The placeholders of one chat template (a nonce per instance, so cached renders stay comparable) and the
    encoding that honours them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        added = [t for t in tokenizer.get_added_tokens_decoder().values() if t.content]
        added.sort(key=lambda t: len(t.content), reverse=True)
        self.specials = tuple(t.content for t in added)
        self._ids = {t.content: tokenizer.token_to_id(t.content) for t in added}
        self._index = {content: k for k, content in enumerate(self.specials)}
        self._find = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        self._scaffold = (
            re.compile("|".join(_scaffold_pattern(k, t.content, t.lstrip, t.rstrip) for k, t in enumerate(added)))
            if added
            else None
        )
        nonce = f"{secrets.randbelow(10**12):012d}"
        self._mark = f"\ue000{nonce}_"
        self._placeholder = re.compile(re.escape(self._mark) + r"(\d+)\ue001")

    def hide_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The messages with special-token text swapped for placeholders (assistant messages as they are)."""
        return [dict(m) if m.get("role") == "assistant" else self._hide(dict(m)) for m in messages]

    def hide_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
        return [self._hide(dict(t)) for t in tools] if tools else None

    def restore(self, text: str) -> str:
        """The text the template rendered, placeholders back to the special tokens' text."""
        if self._mark not in text:
            return text
        return self._placeholder.sub(lambda m: self._special_of(m), text)

    def encode(self, text: str) -> list[int]:
        """The ids of a rendered text: special tokens where the scaffold wrote them, message text as characters."""
        if self._mark not in text or self._scaffold is None:
            return encode_released(self.tokenizer, text)
        ids: list[int] = []
        at = 0
        for match in self._scaffold.finditer(text):
            ids += self._encode_piece(text[at : match.start()])
            ids.append(self._ids[self.specials[int(str(match.lastgroup)[1:])]])
            at = match.end()
        return ids + self._encode_piece(text[at:])

    def _encode_piece(self, text: str) -> list[int]:
        if not text:
            return []
        return encode_released(literal_tokenizer(self.tokenizer), self.restore(text))

    def _special_of(self, match: re.Match[str]) -> str:
        k = int(match.group(1))
        return self.specials[k] if k < len(self.specials) else match.group(0)

    def _hide(self, value: Any) -> Any:
        if isinstance(value, str):
            if self._find is None:
                return value
            return self._find.sub(lambda m: f"{self._mark}{self._index[m.group(0)]}\ue001", value)
        if isinstance(value, Mapping):
            return {self._hide(k): self._hide(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._hide(v) for v in value]
        return value


def _scaffold_pattern(k: int, content: str, lstrip: bool, rstrip: bool) -> str:
    """Special token `k` as the tokenizer matches it in the scaffold: with the whitespace it strips on either side
    (the group ``t<k>`` names which token matched)."""
    return f"(?P<t{k}>" + ("\\s*" if lstrip else "") + re.escape(content) + ("\\s*" if rstrip else "") + ")"
