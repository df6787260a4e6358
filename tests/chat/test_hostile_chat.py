"""Hostile text at the chat floor: a tool parser reads any reply without raising and in bounded work, and the
policy's context gets turn markers from the template's scaffold only, never from what a message says."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.chat.tool_parsers import MAX_TOOL_CALLS, TOOL_PARSERS, ParsedReply

HOSTILE_REPLIES = [
    "<tool_call>" + "[" * 2000,  # past the JSON parser's recursion: RecursionError on main
    "<tool_call>" + "{" * 100_000 + "</tool_call>",
    '<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>",
    '<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}</tool_call>',  # arguments given as a JSON string
    "<tool_call>" + json.dumps({"name": "f", "arguments": {"x": "y" * 3_000_000}}) + "</tool_call>",
    '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',  # a lone surrogate as the name
    '<tool_call>{"name": "f", "arguments": {"\\udfff": "\\ud800"}}</tool_call>',
    "text \ud800 with a lone surrogate <tool_call>\udfff</tool_call>",
    "</tool_call></tool_call><tool_call><tool_call><tool_call>",
    "<tool_call>" * 50_000,
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * (MAX_TOOL_CALLS + 5),
    '<tool_call>{"name": "' + "n" * 10_000 + '", "arguments": {}}</tool_call>',
    '<tool_call>{"name": ["f"], "arguments": {}}</tool_call><tool_call>5</tool_call><tool_call>null</tool_call>',
    "<tool_call>\x00\x01\x02\ufeff</tool_call>",
]


def _well_formed(parsed: ParsedReply) -> None:
    assert isinstance(parsed, ParsedReply)
    assert parsed.content is None or isinstance(parsed.content, str)
    assert parsed.unparseable >= 0 and len(parsed.tool_calls) <= MAX_TOOL_CALLS
    for call in parsed.tool_calls:
        json.dumps(call, ensure_ascii=False).encode("utf-8")  # what a response writes: no lone surrogate
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("reply", HOSTILE_REPLIES, ids=range(len(HOSTILE_REPLIES)))
def test_every_tool_parser_reads_hostile_replies_without_raising(name: str, reply: str) -> None:
    _well_formed(TOOL_PARSERS[name](reply))


def test_deep_nesting_is_an_unparseable_call_kept_in_the_content() -> None:
    reply = "<tool_call>" + "[" * 2000
    parsed = TOOL_PARSERS["hermes"](reply)
    assert parsed == ParsedReply(reply, [], 1)


def test_calls_past_the_cap_stay_in_the_content_and_count() -> None:
    one = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parsed = TOOL_PARSERS["hermes"](one * (MAX_TOOL_CALLS + 5))
    assert len(parsed.tool_calls) == MAX_TOOL_CALLS and parsed.unparseable == 5
    assert parsed.content == one * 5


_PIECES = st.sampled_from(
    ["<tool_call>", "</tool_call>", "[", "]", "{", "}", '"', "\\", ":", ",", '"name"', '"arguments"', "\ud800", "\n"]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_PIECES, st.text(max_size=8), st.builds(lambda p, n: p * n, _PIECES, st.integers(0, 3000)))))
def test_tool_parsers_never_raise_on_any_text(pieces: list[str]) -> None:
    reply = "".join(pieces)
    for parser in TOOL_PARSERS.values():
        _well_formed(parser(reply))
