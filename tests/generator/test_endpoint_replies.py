"""The endpoint's response bodies without a server: the keys a client reads are there, ``null`` where OpenAI
sends ``null``, and the extras that do not apply are absent (`protocol._ResponseBody.omit_when_none`)."""

from __future__ import annotations

import numpy as np

from actors.generator.serve.replies import Answer, Reply, make_reply
from pipeline.chat.tool_parsers import hermes
from pipeline.rl.engine_records import GenerateResult
from tests.support.endpoints import EOS, RUN, TOKENIZER

CALL = '<tool_call>{"name": "get_digits", "arguments": {}}</tool_call>'


def _reply(text: str, finish_reason: str = "stop") -> Reply:
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids + ([EOS] if finish_reason == "stop" else [])
    n = len(ids)
    result = GenerateResult(
        np.asarray(ids, np.int32), np.full(n, -0.5, np.float32), np.arange(n, dtype=np.int32), finish_reason
    )
    return make_reply(TOKENIZER, result, (), (EOS,), hermes)


def _answer(*replies: Reply, logprobs: bool = False, return_token_ids: bool = False) -> Answer:
    return Answer(TOKENIZER, RUN, [11, 12], list(replies), logprobs=logprobs, return_token_ids=return_token_ids)


def test_a_chat_body_sends_null_log_probs_and_leaves_out_what_was_not_asked() -> None:
    body = _answer(_reply("12"), _reply(CALL)).chat().model_dump()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    plain, call = body["choices"]
    assert plain["message"] == {"role": "assistant", "content": "12"}
    assert call["message"]["content"] is None and call["message"]["tool_calls"][0]["function"]["name"] == "get_digits"
    assert plain["logprobs"] is None and plain["token_ids"] == [11, 12, EOS] and plain["policy_versions"] == [0, 1, 2]
    completion_tokens = len(plain["token_ids"]) + len(call["token_ids"])
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": completion_tokens,
        "total_tokens": 2 + completion_tokens,
    }


def test_asked_extras_are_sent_and_two_bodies_get_their_own_ids() -> None:
    answer = _answer(_reply("12"), logprobs=True, return_token_ids=True)
    body, again = answer.chat().model_dump(), answer.chat().model_dump()
    assert body["prompt_token_ids"] == [11, 12] and body["id"] != again["id"]
    (entry, *_) = body["choices"][0]["logprobs"]["content"]
    assert entry == {
        "token": "1",
        "logprob": -0.5,
        "bytes": [49],
        "top_logprobs": [{"token": "1", "logprob": -0.5, "bytes": [49]}],
    }
    completion = answer.completion().model_dump()
    assert completion["object"] == "text_completion" and completion["id"].startswith("cmpl-")
    assert completion["choices"][0]["logprobs"] == {"tokens": ["1", "2", "<eos>"], "token_logprobs": [-0.5] * 3}
    generate = answer.generate(None).model_dump()
    assert list(generate) == ["request_id", "prompt_token_ids", "choices"] and generate["request_id"].startswith("gen-")


def test_a_stream_shares_one_id_and_sends_the_ids_once_at_the_end_of_each_choice() -> None:
    chunks = [
        c.model_dump()
        for c in _answer(_reply("12"), _reply(CALL), return_token_ids=True).chat_chunks(include_usage=True)
    ]
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    assert chunks[0]["prompt_token_ids"] == [11, 12] and all("prompt_token_ids" not in c for c in chunks[1:])
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    assert [c["choices"][0]["delta"] for c in chunks[1:3]] == [{"content": "1"}, {"content": "2"}]
    ends = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert [(e["delta"], e["finish_reason"], e["token_ids"][-1]) for e in ends] == [
        ({}, "stop", EOS),
        ({}, "tool_calls", EOS),
    ]
    (calls,) = [c["choices"][0]["delta"] for c in chunks[:-1] if "tool_calls" in c["choices"][0]["delta"]]
    assert calls["content"] is None and calls["tool_calls"][0]["index"] == 0
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 2
    assert all("usage" not in c for c in chunks[:-1]) and all("token_ids" not in c["choices"][0] for c in chunks[:3])
