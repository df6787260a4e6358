"""From engine results to the response models of `protocol.py`: stop strings, text, tool calls, log-probs and
the id extras (``token_ids``, ``policy_versions``, ``prompt_token_ids``).

A reply's ids are never decoded and encoded again: the text is derived from the sampled ids, and the ids go
out as sampled (cut only after a stop string), so what a client sees is what the trainer trains on. A
streamed response holds the same ids as an unstreamed one, in the chunk that ends each choice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, replace
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from actors.generator.serve.protocol import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    GenerateChoice,
    GenerateResponse,
    Usage,
    new_id,
)
from pipeline.chat.tool_parsers import ParsedReply, ToolParser
from pipeline.rl.engine_records import GenerateResult


@dataclass(frozen=True)
class Reply:
    """One choice: the (possibly stop-string-cut) result, its text without the end-of-turn token, parsed, and
    ``pieces``: the text of each token in order (one incremental pass), which add up to ``text``."""

    result: GenerateResult
    text: str
    parsed: ParsedReply
    pieces: tuple[str, ...] = ()

    @property
    def finish_reason(self) -> str:
        if self.result.finish_reason == "stop" and self.parsed.tool_calls:
            return "tool_calls"
        return str(self.result.finish_reason)


def detokenize(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's text, in one pass (`tokenizers.decoders.DecodeStream`: each step decodes a few tokens, never the
    prefix again), special tokens kept; a token that ends inside a character adds "" and the next one the rest."""
    stream = DecodeStream(skip_special_tokens=False)
    return [stream.step(tokenizer, int(t)) or "" for t in ids]


def _first_stop(pieces: Sequence[str], stops: Sequence[str]) -> tuple[int, int] | None:
    """(tokens up to and including the one that completes the first stop string, that string's offset in the
    text); None: no stop string occurs. Each step searches only the new piece and the ``longest - 1`` characters
    before it (all a stop string it completes can reach back), so the search is linear in the reply."""
    stops = [s for s in stops if s]
    if not stops:
        return None
    keep = max(len(s) for s in stops) - 1
    tail, length = "", 0  # the last `keep` characters of the text so far; the text's length
    for k, piece in enumerate(pieces):
        if not piece:
            continue
        window = tail + piece
        hits = [i for i in (window.find(s) for s in stops) if i >= 0]
        if hits:
            return k + 1, length - len(tail) + min(hits)
        length += len(piece)
        tail = window[len(window) - keep :] if keep else ""
    return None


def make_reply(
    tokenizer: Tokenizer, result: GenerateResult, stops: Sequence[str], stop_ids: Sequence[int], parser: ToolParser
) -> Reply:
    """The reply's text (a final stop token dropped), cut after the token that completes the first stop string
    (finish reason ``stop``; tokens sampled after it are neither returned nor trained on), and parsed. Linear in
    the reply: its ids are decoded once, incrementally."""
    ids = result.token_ids.tolist()
    pieces = detokenize(tokenizer, ids)
    if ids and ids[-1] in stop_ids:
        pieces[-1] = ""
    stop = _first_stop(pieces, stops)
    if stop is not None:
        k, offset = stop
        result = replace(
            result,
            token_ids=result.token_ids[:k],
            logprobs=result.logprobs[:k],
            versions=result.versions[:k],
            finish_reason="stop",
        )
        pieces = pieces[:k]
        text = "".join(pieces)[:offset]
    else:
        text = "".join(pieces)
    return Reply(result, text, parser(text), tuple(pieces))


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


@dataclass(frozen=True)
class Answer:
    """One request's replies and what its client asked to see of them; each method is one route's body, so
    the prompt, the replies and the options are given once whichever form goes out."""

    tokenizer: Tokenizer
    model: str
    prompt_ids: list[int]
    replies: Sequence[Reply]
    _: KW_ONLY
    logprobs: bool = False
    return_token_ids: bool = False

    @property
    def usage(self) -> Usage:
        completion = sum(len(r.result.token_ids) for r in self.replies)
        prompt = len(self.prompt_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    @property
    def shown_prompt_ids(self) -> list[int] | None:
        """The prompt's ids when the client asked for them (``return_token_ids``); None leaves the key out."""
        return self.prompt_ids if self.return_token_ids else None

    def chat(self) -> ChatCompletionResponse:
        choices = [
            ChatCompletionChoice(
                index=index,
                message=ChatMessage(content=reply.parsed.content, tool_calls=reply.parsed.tool_calls or None),
                finish_reason=reply.finish_reason,
                logprobs=self._chat_logprobs(reply),
                token_ids=reply.result.token_ids.tolist(),
                policy_versions=reply.result.versions.tolist(),
            )
            for index, reply in enumerate(self.replies)
        ]
        return ChatCompletionResponse(
            model=self.model, choices=choices, usage=self.usage, prompt_token_ids=self.shown_prompt_ids
        )

    def chat_chunks(self, *, include_usage: bool) -> Iterator[ChatCompletionStreamResponse]:
        """The streamed form of `chat`: per choice a role chunk, content deltas token by token (or one delta
        with the tool calls), then a chunk with the finish reason and the id extras; the usage last, if asked.
        Made one at a time, so a long stream never holds all its chunks as objects."""
        head = ChatCompletionStreamResponse(model=self.model, choices=[])

        def chunk(choice: ChatStreamChoice, prompt_token_ids: list[int] | None = None) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=head.id, created=head.created, model=self.model, choices=[choice], prompt_token_ids=prompt_token_ids
            )

        for index, reply in enumerate(self.replies):
            first = ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content=""))
            yield chunk(first, self.shown_prompt_ids if index == 0 else None)
            for choice in self._deltas(index, reply):
                yield chunk(choice)
            last = ChatStreamChoice(
                index=index,
                delta=ChatDelta(),
                finish_reason=reply.finish_reason,
                token_ids=reply.result.token_ids.tolist(),
                policy_versions=reply.result.versions.tolist(),
            )
            yield chunk(last)
        if include_usage:
            yield head.model_copy(update={"usage": self.usage})

    def completion(self) -> CompletionResponse:
        choices = []
        for index, reply in enumerate(self.replies):
            logprobs = None
            if self.logprobs:
                content = logprobs_content(self.tokenizer, reply.result)
                logprobs = CompletionLogprobs(
                    tokens=[c["token"] for c in content], token_logprobs=[c["logprob"] for c in content]
                )
            choice = CompletionChoice(
                index=index,
                text=reply.text,
                finish_reason=reply.finish_reason,
                logprobs=logprobs,
                token_ids=reply.result.token_ids.tolist(),
                policy_versions=reply.result.versions.tolist(),
            )
            choices.append(choice)
        return CompletionResponse(
            model=self.model, choices=choices, usage=self.usage, prompt_token_ids=self.shown_prompt_ids
        )

    def generate(self, request_id: str | None) -> GenerateResponse:
        """``/inference/v1/generate``'s body: always the ids and log-probs, tokens named by id (vLLM's form)."""
        choices = [
            GenerateChoice(
                index=index,
                token_ids=reply.result.token_ids.tolist(),
                finish_reason=reply.finish_reason,
                logprobs=ChatLogprobs(content=logprobs_content(self.tokenizer, reply.result, as_ids=True)),
                policy_versions=reply.result.versions.tolist(),
            )
            for index, reply in enumerate(self.replies)
        ]
        return GenerateResponse(
            request_id=request_id or new_id("gen"), prompt_token_ids=self.prompt_ids, choices=choices
        )

    def _chat_logprobs(self, reply: Reply) -> ChatLogprobs | None:
        return ChatLogprobs(content=logprobs_content(self.tokenizer, reply.result)) if self.logprobs else None

    def _deltas(self, index: int, reply: Reply) -> Iterator[ChatStreamChoice]:
        """The content between a choice's role chunk and its last chunk."""
        if reply.parsed.tool_calls:
            calls = [{"index": k, **call} for k, call in enumerate(reply.parsed.tool_calls)]
            yield ChatStreamChoice(index=index, delta=ChatDelta(content=reply.parsed.content, tool_calls=calls))
            return
        for piece, entry in _text_pieces(self.tokenizer, reply, self.logprobs):
            logprobs = None if entry is None else ChatLogprobs(content=[entry])
            yield ChatStreamChoice(index=index, delta=ChatDelta(content=piece), logprobs=logprobs)


def _text_pieces(tokenizer: Tokenizer, reply: Reply, logprobs: bool) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """The reply's text split at token boundaries (`Reply.pieces`), so the pieces add up to exactly the unstreamed
    content, cut where a stop string cut it."""
    entries = logprobs_content(tokenizer, reply.result) if logprobs else None
    said = 0
    for k, piece in enumerate(reply.pieces):
        piece = piece[: max(0, len(reply.text) - said)]
        said += len(piece)
        if piece or entries is not None:
            yield piece, None if entries is None else entries[k]
