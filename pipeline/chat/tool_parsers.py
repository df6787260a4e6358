"""Tool-call parsers: the text of a model's reply to OpenAI ``tool_calls``, by name (`model.tool_parser`).

A parser never fails a reply and never raises, whatever the text (the model's, so hostile: nesting deeper than
the JSON parser recurses, megabytes inside one tag, lone surrogates, tags left open): text it cannot read as a
tool call stays in the content, and the number of such unparseable calls comes back so the endpoint can count
them. Its work is bounded: a call body past `MAX_TOOL_CALL_CHARS` is not parsed, and past `MAX_TOOL_CALLS`
calls the rest of the reply stays content. The ids it makes (``call_<n>_<hex>``)
are unique within a session only in combination with the turn; clients echo them back in ``tool`` messages.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into plain ``content`` (None when only tool calls were written) and OpenAI tool calls."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    unparseable: int = 0


ToolParser = Callable[[str], ParsedReply]

MAX_TOOL_CALLS = 128
"""Tool calls read from one reply; the ``<tool_call>`` blocks after them stay in the content, counted unparseable."""
MAX_TOOL_CALL_CHARS = 1 << 20
"""The longest body of one ``<tool_call>`` that is handed to the JSON parser; a longer one is unparseable."""
MAX_NAME_CHARS = 256
"""The longest function name a call may have (OpenAI allows 64; some clients more)."""

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def hermes(text: str) -> ParsedReply:
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number."""
    if "<tool_call>" not in text:
        return ParsedReply(text)
    calls: list[dict[str, Any]] = []
    unparseable = 0
    kept: list[str] = []
    last = 0
    for match in _HERMES.finditer(text):
        if len(calls) + unparseable >= MAX_TOOL_CALLS:
            unparseable += 1 + text.count("<tool_call>", match.end())
            break
        kept.append(text[last : match.start()])
        last = match.end()
        call = _call(match.group(1).strip())
        if call is None:
            unparseable += 1
            kept.append(match.group(0))
        else:
            calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return ParsedReply(content or None if calls else "".join(kept), calls, unparseable)


def _call(body: str) -> dict[str, Any] | None:
    """One call, or None when the body is not one: not JSON (a RecursionError is the JSON parser refusing nesting
    past its depth), too long, no usable name, arguments that are not an object."""
    data = _json(body)
    if not isinstance(data, dict) or not _usable_name(data.get("name")):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        return None
    try:
        encoded = json.dumps(arguments)  # ASCII: a lone surrogate in a string comes out escaped
    except (ValueError, RecursionError):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:16]}",
        "type": "function",
        "function": {"name": data["name"], "arguments": encoded},
    }


def _json(text: str) -> Any:
    """The JSON value of `text`, or None (not JSON, longer than `MAX_TOOL_CALL_CHARS`, nested too deep)."""
    if len(text) > MAX_TOOL_CALL_CHARS:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None


def _usable_name(name: Any) -> bool:
    """A name a client can be sent: a non-empty string, bounded, valid UTF-8 (no lone surrogate from a ``\\ud800``
    escape, which no JSON encoder of a response could write)."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def no_tools(text: str) -> ParsedReply:
    """Every reply is plain content."""
    return ParsedReply(text)


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": hermes, "qwen": hermes, "qwen3": hermes, "none": no_tools}
"""`model.tool_parser` names."""


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"model.tool_parser = {name!r}: one of {sorted(TOOL_PARSERS)}") from None
