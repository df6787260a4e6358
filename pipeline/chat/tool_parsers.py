"""Tool-call parsers: the text of a model's reply to OpenAI ``tool_calls``, by name (`model.tool_parser`).

A parser never fails a reply: text it cannot read as a tool call stays in the content, and the number of
such unparseable calls comes back so the endpoint can count them. The ids it makes (``call_<n>_<hex>``)
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
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:16]}",
        "type": "function",
        "function": {"name": data["name"], "arguments": json.dumps(arguments)},
    }


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
