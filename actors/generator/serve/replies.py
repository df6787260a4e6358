"""From engine results to OpenAI response bodies: stop strings, text, tool calls, log-probs, the id extras.

Every choice carries the extras agent trainers read: ``token_ids`` (the sampled ids, exactly) and
``policy_versions`` (the policy version of each of them); the response carries ``prompt_token_ids`` when
the request asked ``return_token_ids``. A streamed response holds the same ids in its last chunk.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from pipeline.chat.tool_parsers import ParsedReply, ToolParser
from pipeline.rl.engine_records import GenerateResult


@dataclass(frozen=True)
class Reply:
    """One choice: the (possibly stop-string-cut) result, its text without the end-of-turn token, parsed."""

    result: GenerateResult
    text: str
    parsed: ParsedReply

    @property
    def finish_reason(self) -> str:
        if self.result.finish_reason == "stop" and self.parsed.tool_calls:
            return "tool_calls"
        return str(self.result.finish_reason)


def decode(tokenizer: Tokenizer, ids: Sequence[int] | np.ndarray, stop_ids: Sequence[int]) -> str:
    """The reply's text: special tokens kept (a tool-call marker is one), a final stop token dropped."""
    ids = [int(t) for t in ids]
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def cut_at_stop_strings(
    tokenizer: Tokenizer, result: GenerateResult, stops: Sequence[str], stop_ids: Sequence[int]
) -> tuple[GenerateResult, str]:
    """The result cut after the token that completes the first stop string (finish reason ``stop``), and its
    text up to that string. Tokens sampled after it are dropped: they are neither returned nor trained on."""
    text = decode(tokenizer, result.token_ids, stop_ids)
    if not stops or not any(s in text for s in stops):
        return result, text
    for k in range(1, len(result.token_ids) + 1):
        prefix = tokenizer.decode([int(t) for t in result.token_ids[:k]], skip_special_tokens=False)
        hits = [prefix.find(s) for s in stops if s in prefix]
        if hits:
            cut = replace(
                result,
                token_ids=result.token_ids[:k],
                logprobs=result.logprobs[:k],
                versions=result.versions[:k],
                finish_reason="stop",
            )
            return cut, prefix[: min(hits)]
    return result, text


def make_reply(
    tokenizer: Tokenizer, result: GenerateResult, stops: Sequence[str], stop_ids: Sequence[int], parser: ToolParser
) -> Reply:
    result, text = cut_at_stop_strings(tokenizer, result, stops, stop_ids)
    return Reply(result, text, parser(text))


def logprobs_content(tokenizer: Tokenizer, result: GenerateResult, *, as_ids: bool = False) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content``: one entry per sampled token with its behaviour log-prob; ``token`` is its
    text, or ``token_id:<id>`` (vLLM's form for token-in clients). ``top_logprobs`` holds the sampled token
    only: the engine keeps no alternatives."""
    out = []
    for token_id, logprob in zip(result.token_ids.tolist(), result.logprobs.tolist(), strict=True):
        token = f"token_id:{token_id}" if as_ids else (tokenizer.id_to_token(token_id) or "")
        entry = {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        out.append({**entry, "top_logprobs": [dict(entry)]})
    return out


def usage(prompt_len: int, replies: Sequence[Reply]) -> dict[str, int]:
    completion = sum(len(r.result.token_ids) for r in replies)
    return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def chat_body(
    tokenizer: Tokenizer,
    model: str,
    prompt_ids: list[int],
    replies: Sequence[Reply],
    *,
    logprobs: bool,
    return_token_ids: bool,
) -> dict[str, Any]:
    choices = []
    for index, reply in enumerate(replies):
        message: dict[str, Any] = {"role": "assistant", "content": reply.parsed.content}
        if reply.parsed.tool_calls:
            message["tool_calls"] = reply.parsed.tool_calls
        choices.append(
            {
                "index": index,
                "message": message,
                "finish_reason": reply.finish_reason,
                "logprobs": {"content": logprobs_content(tokenizer, reply.result)} if logprobs else None,
                "token_ids": reply.result.token_ids.tolist(),
                "policy_versions": reply.result.versions.tolist(),
            }
        )
    body: dict[str, Any] = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(len(prompt_ids), replies),
    }
    if return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def chat_chunks(
    tokenizer: Tokenizer,
    model: str,
    prompt_ids: list[int],
    replies: Sequence[Reply],
    *,
    logprobs: bool,
    return_token_ids: bool,
    include_usage: bool,
) -> Iterator[dict[str, Any]]:
    """The streamed form of `chat_body`: a role chunk, content deltas token by token (or one delta with the
    tool calls), then a chunk with the finish reason and the id extras."""
    common = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    for index, reply in enumerate(replies):
        first: dict[str, Any] = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        if return_token_ids and index == 0:
            yield {**common, "choices": [first], "prompt_token_ids": prompt_ids}
        else:
            yield {**common, "choices": [first]}
        if reply.parsed.tool_calls:
            calls = [{"index": k, **call} for k, call in enumerate(reply.parsed.tool_calls)]
            delta: dict[str, Any] = {"content": reply.parsed.content, "tool_calls": calls}
            yield {**common, "choices": [{"index": index, "delta": delta, "finish_reason": None}]}
        else:
            for piece, entry in _text_pieces(tokenizer, reply, logprobs):
                choice = {"index": index, "delta": {"content": piece}, "finish_reason": None}
                if entry is not None:
                    choice["logprobs"] = {"content": [entry]}
                yield {**common, "choices": [choice]}
        last = {
            "index": index,
            "delta": {},
            "finish_reason": reply.finish_reason,
            "token_ids": reply.result.token_ids.tolist(),
            "policy_versions": reply.result.versions.tolist(),
        }
        yield {**common, "choices": [last]}
    if include_usage:
        yield {**common, "choices": [], "usage": usage(len(prompt_ids), replies)}


def _text_pieces(tokenizer: Tokenizer, reply: Reply, logprobs: bool) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """The reply's text split at token boundaries (the text of the first k tokens, minus that of k - 1)."""
    entries = logprobs_content(tokenizer, reply.result) if logprobs else None
    said = ""
    ids = reply.result.token_ids.tolist()
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=False)
        text = text[: len(reply.text)] if len(text) > len(reply.text) else text
        piece, said = text[len(said) :], text
        if piece or entries is not None:
            yield piece, None if entries is None else entries[k - 1]


def completion_body(
    tokenizer: Tokenizer,
    model: str,
    prompt_ids: list[int],
    replies: Sequence[Reply],
    *,
    logprobs: bool,
    return_token_ids: bool,
) -> dict[str, Any]:
    choices = []
    for index, reply in enumerate(replies):
        lp = None
        if logprobs:
            content = logprobs_content(tokenizer, reply.result)
            lp = {"tokens": [c["token"] for c in content], "token_logprobs": [c["logprob"] for c in content]}
        choices.append(
            {
                "index": index,
                "text": reply.text,
                "finish_reason": reply.finish_reason,
                "logprobs": lp,
                "token_ids": reply.result.token_ids.tolist(),
                "policy_versions": reply.result.versions.tolist(),
            }
        )
    body: dict[str, Any] = {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(len(prompt_ids), replies),
    }
    if return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def tokens_body(
    tokenizer: Tokenizer, prompt_ids: list[int], replies: Sequence[Reply], request_id: str
) -> dict[str, Any]:
    """``/inference/v1/generate``'s answer (vLLM's token-in, token-out shape)."""
    return {
        "request_id": request_id,
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "index": index,
                "token_ids": reply.result.token_ids.tolist(),
                "finish_reason": reply.finish_reason,
                "logprobs": {"content": logprobs_content(tokenizer, reply.result, as_ids=True)},
                "policy_versions": reply.result.versions.tolist(),
            }
            for index, reply in enumerate(replies)
        ],
    }
