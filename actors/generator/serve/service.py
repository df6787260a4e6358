"""What the endpoint's routes do: render or bridge the prompt, run it on the generator's engine, record the
turn in its conversation, and build the reply. HTTP lives in `actors/generator/serve/app.py`.

Requests go into the same engine queue as the generator's own rollouts (`Engine.submit`), so one engine
batches both continuously. A request never disturbs the generator: a bad one is an `EndpointError` (an
OpenAI-shaped 4xx), and over ``generator.serve.max_inflight`` engine requests the endpoint answers 429 with
``Retry-After``; before the generator holds version 0 it answers 503.

The generator's event loop never does a request's heavy work: rendering and encoding the prompt, decoding the
replies (once, incrementally), the stop-string search, tool parsing, recording the turn and building the
response's bytes run in a worker thread (`asyncio.to_thread`), and a request whose text cannot fit the model's
context whatever the tokenizer does (`max_chars_per_token`) is refused before anything is rendered. Sessions
are bounded (`SessionLimits`): past a session's branches or tokens the answer is 413, and a new session while
``generator.serve.max_sessions`` are held by agent runs is 429, each naming the limit.

Sampling: a conversation an agent run trains on (`Conversations.open`) samples with the run's temperature,
top-p and top-k whatever the request says, because the trainer's importance correction assumes them; other
requests (evaluation, debugging) sample as they ask. ``max_tokens`` defaults to the run's
``engine.sampling.max_new_tokens`` and is cut to the room left in the engine's context.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import orjson
from tokenizers import Tokenizer

from actors.generator.engines.base import Engine, GenerateRequest, GenerateResult, SamplingParams
from actors.generator.serve.conversations import Conversation, Conversations, SessionFull, SessionLimits
from actors.generator.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    EndpointError,
    ModelCard,
    ModelList,
    TokensRequest,
)
from actors.generator.serve.replies import Answer, Reply, make_reply
from pipeline.chat.literal import encode_released
from pipeline.chat.template import ChatTemplate, ChatTemplateError, normalized
from pipeline.chat.tool_parsers import ParsedReply, ToolParser

log = logging.getLogger(__name__)

TEXT_CHARS_SLACK = 4
"""How far a tokenizer's normalizer may shrink text (composed characters) before it is cut into tokens: the
pre-render floor on a prompt's tokens is ``chars / (max_chars_per_token * TEXT_CHARS_SLACK)``."""

Body = bytes | list[bytes]
"""A route's answer: a JSON body, or the ``data:`` frames of a stream."""


@dataclass
class EndpointMetrics:
    """Counters reported with the generator's metrics (``endpoint`` in its report)."""

    requests: int = 0
    errors: dict[int, int] = field(default_factory=dict)
    turns_bridged: int = 0
    turns_fresh: int = 0
    tool_calls: int = 0
    tool_calls_unparseable: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": {str(k): v for k, v in sorted(self.errors.items())},
            "turns_bridged": self.turns_bridged,
            "turns_fresh": self.turns_fresh,
            "tool_calls": self.tool_calls,
            "tool_calls_unparseable": self.tool_calls_unparseable,
            "completion_tokens": self.completion_tokens,
        }


class EndpointService:
    """The endpoint's work, over one engine, tokenizer and (optional) chat template."""

    def __init__(
        self,
        *,
        engine: Engine,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        tool_parser: ToolParser,
        sampling: SamplingParams,
        model_names: Sequence[str],
        max_inflight: int,
        max_sessions: int,
        session_limits: SessionLimits | None = None,
        submit: Callable[[Sequence[GenerateRequest], SamplingParams], list[Future[GenerateResult]]] | None = None,
    ) -> None:
        self.engine = engine
        self.submit = submit or engine.submit
        """How requests reach the engine (the generator's metered submit, so its tokens/s count them)."""
        self.tokenizer = tokenizer
        self.template = template
        self.tool_parser = tool_parser
        self.sampling = sampling
        self.model_names = tuple(model_names)
        self.max_inflight = max_inflight
        self.conversations = Conversations(max_sessions, session_limits)
        """Each session's conversation, kept to bridge its next turn and, for an agent run, to train on."""
        self.metrics = EndpointMetrics()
        self.inflight = 0
        self.stopping = False
        self.max_chars_per_token = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
        """The most characters one token can stand for (its vocabulary entry's length bounds its text)."""

    @property
    def model(self) -> str:
        """The name every reply carries, whichever of `model_names` the request named."""
        return self.model_names[0]

    # ---- routes --------------------------------------------------------------------------------

    async def chat(self, req: ChatRequest, session_id: str | None) -> Body:
        """The reply's JSON, or its stream's frames (sent once the reply is complete: same ids)."""
        self._check_model(req.model)
        template = self._template()
        self._refuse_long_text(req.text_chars(), "messages")
        conversation = self._conversation(session_id)
        async with conversation.lock:
            prompt_ids, keys, tools_key = await asyncio.to_thread(self._chat_prompt, conversation, template, req)
        results = await self._generate(conversation, prompt_ids, req, req.token_limit())
        async with conversation.lock:
            body, parsed = await asyncio.to_thread(
                self._chat_body, conversation, req, prompt_ids, results, keys, tools_key
            )
        self.metrics.tool_calls += sum(len(p.tool_calls) for p in parsed)
        self.metrics.tool_calls_unparseable += sum(p.unparseable for p in parsed)
        return body

    async def completions(self, req: CompletionRequest, session_id: str | None) -> Body:
        self._check_model(req.model)
        if req.stream:
            raise EndpointError(
                400, "stream is not supported on /v1/completions; use /v1/chat/completions", param="stream"
            )
        if isinstance(req.prompt, str):
            self._refuse_long_text(len(req.prompt), "prompt")
            prompt_ids = await asyncio.to_thread(self._encode, req.prompt)
        else:
            prompt_ids = [int(t) for t in req.prompt]
        if not prompt_ids:
            raise EndpointError(400, "the prompt has no tokens", param="prompt")
        conversation = self._conversation(session_id)
        results = await self._generate(conversation, prompt_ids, req, req.token_limit())

        def finish() -> bytes:
            replies = [self._reply(r, req.stops()) for r in results]
            conversation.record(prompt_ids, [r.result for r in replies])
            logprobs, ids = bool(req.logprobs), req.return_token_ids
            answer = Answer(self.tokenizer, self.model, prompt_ids, replies, logprobs=logprobs, return_token_ids=ids)
            return _json(answer.completion())

        async with conversation.lock:
            return await asyncio.to_thread(finish)

    async def tokens(self, req: TokensRequest, session_id: str | None) -> Body:
        self._check_model(req.model)
        params = req.sampling_params
        conversation = self._conversation(session_id or req.session_id)
        body = CompletionRequest(
            prompt=req.token_ids,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            n=params.n,
            seed=params.seed,
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
        )
        prompt_ids = list(req.token_ids)
        results = await self._generate(conversation, prompt_ids, body, params.max_tokens)

        def finish() -> bytes:
            replies = [self._reply(r, ()) for r in results]
            conversation.record(prompt_ids, [r.result for r in replies])
            return _json(Answer(self.tokenizer, self.model, prompt_ids, replies).generate(req.request_id))

        async with conversation.lock:
            return await asyncio.to_thread(finish)

    def models(self) -> ModelList:
        max_len = self.engine.max_context_tokens
        return ModelList(data=[ModelCard(id=name, max_model_len=max_len) for name in self.model_names])

    # ---- the engine ----------------------------------------------------------------------------

    async def _generate(
        self, conversation: Conversation, prompt_ids: list[int], req: ChatRequest | CompletionRequest, limit: int | None
    ) -> list[GenerateResult]:
        self._refuse_unservable(prompt_ids, req.n)
        try:
            conversation.check_room(req.n, len(prompt_ids))
        except SessionFull as exc:
            if exc.limit == "generator.serve.max_kept_tokens":  # the generator's, not this session's: come back
                raise EndpointError(
                    429, exc.detail, kind="rate_limit_error", param=exc.limit, code="session_limit", retry_after_s=5
                ) from None
            raise EndpointError(413, exc.detail, param=exc.limit, code="session_limit") from None
        try:
            return await self._generate_reserved(conversation, prompt_ids, req, limit)
        except BaseException:
            conversation.release(req.n, len(prompt_ids))  # never recorded
            raise

    async def _generate_reserved(
        self, conversation: Conversation, prompt_ids: list[int], req: ChatRequest | CompletionRequest, limit: int | None
    ) -> list[GenerateResult]:
        params = self._params(conversation, req, limit)
        seeds = [None if req.seed is None else req.seed + k for k in range(req.n)]
        stem = f"serve-{uuid.uuid4().hex[:12]}"
        keep = bool(conversation.session_id)  # its next turn extends this one: the engine keeps the KV cache
        requests = [
            GenerateRequest(prompt_ids, seed=s, request_id=f"{stem}-{k}", keep_prefix=keep) for k, s in enumerate(seeds)
        ]
        try:
            futures = self.submit(requests, params)
        except ValueError as exc:  # ids outside the vocabulary
            raise EndpointError(400, str(exc), param="prompt") from None
        self.inflight += req.n
        try:
            results = list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except asyncio.CancelledError:
            self.engine.abort([r.request_id for r in requests])
            raise
        finally:
            self.inflight -= req.n
        self.metrics.completion_tokens += sum(len(r.token_ids) for r in results)
        return results

    def _conversation(self, session_id: str | None) -> Conversation:
        try:
            return self.conversations.get(session_id)
        except SessionFull as exc:
            raise EndpointError(
                429, exc.detail, kind="rate_limit_error", param=exc.limit, code="session_limit", retry_after_s=5
            ) from None

    def _refuse_long_text(self, chars: int, param: str) -> None:
        """Refuse, before anything is rendered or encoded, text that cannot fit the model's context whatever it
        encodes to (each token stands for at most `max_chars_per_token` characters)."""
        room = self.engine.max_context_tokens
        floor = chars // (self.max_chars_per_token * TEXT_CHARS_SLACK)
        if room is not None and floor >= room:
            raise EndpointError(
                400,
                f"the request holds {chars} characters of text, at least {floor} tokens; the model's context is "
                f"{room} tokens",
                param=param,
                code="context_length_exceeded",
            )

    def _refuse_unservable(self, prompt_ids: list[int], n: int) -> None:
        """A request the engine cannot take now is answered at once (503, 400 or 429), never queued: a client
        that retries later is better served than one whose request waits behind the generator's rollouts."""
        if self.stopping:
            raise EndpointError(503, "the generator is stopping", kind="service_unavailable", retry_after_s=5)
        if self.engine.version < 0:
            raise EndpointError(
                503,
                "the generator holds no policy weights yet (waiting for version 0)",
                kind="service_unavailable",
                retry_after_s=2,
            )
        room = self.engine.max_context_tokens
        if room is not None and len(prompt_ids) >= room:
            raise EndpointError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {room} tokens and leaves no room for a reply",
                param="messages",
                code="context_length_exceeded",
            )
        if self.inflight + n > self.max_inflight:
            raise EndpointError(
                429,
                f"over capacity: {self.inflight} requests in the engine (generator.serve.max_inflight = {self.max_inflight})",
                kind="rate_limit_error",
                retry_after_s=1,
            )

    def _params(
        self, conversation: Conversation, req: ChatRequest | CompletionRequest, limit: int | None
    ) -> SamplingParams:
        run = self.sampling
        run_stops = () if req.ignore_eos and not conversation.trained else tuple(run.stop_token_ids)
        stop_ids = run_stops + tuple(req.stop_token_ids or ())
        if conversation.trained:
            temperature, top_p, top_k = run.temperature, run.top_p, run.top_k
        else:
            temperature = run.temperature if req.temperature is None else req.temperature
            top_p = run.top_p if req.top_p is None else req.top_p
            top_k = run.top_k if req.top_k is None or req.top_k < 0 else req.top_k
        return SamplingParams(
            max_new_tokens=limit or run.max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_ids,
        )

    # ---- helpers -------------------------------------------------------------------------------

    def _chat_prompt(
        self, conversation: Conversation, template: ChatTemplate, req: ChatRequest
    ) -> tuple[list[int], list[tuple[Any, ...]], str]:
        """(prompt ids, the messages' keys, the tools' key), in a worker thread. The ids are bridged from the
        branch the messages continue, so earlier sampled ids are kept exactly, else the conversation is rendered
        fresh."""
        messages, tools = req.message_dicts(), req.tool_dicts()
        tools_key = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode() if tools else ""
        try:
            keys = [normalized(m) for m in messages]
            prompt_ids = self._bridged(conversation, template, messages, keys, tools, tools_key)
            if prompt_ids is None:
                prompt_ids = template.render(messages, tools=tools)
                self.metrics.turns_fresh += 1
            else:
                self.metrics.turns_bridged += 1
        except ChatTemplateError as exc:
            raise EndpointError(400, str(exc), param="messages") from None
        return prompt_ids, keys, tools_key

    def _chat_body(
        self,
        conversation: Conversation,
        req: ChatRequest,
        prompt_ids: list[int],
        results: list[GenerateResult],
        keys: list[tuple[Any, ...]],
        tools_key: str,
    ) -> tuple[Body, list[ParsedReply]]:
        """The replies decoded, parsed and recorded, and the response's bytes (in a worker thread)."""
        replies = [self._reply(r, req.stops()) for r in results]
        said = [
            normalized({"role": "assistant", "content": r.parsed.content, "tool_calls": r.parsed.tool_calls})
            for r in replies
        ]
        conversation.record(prompt_ids, [r.result for r in replies], messages=keys, replies=said, tools_key=tools_key)
        logprobs = bool(req.logprobs) or bool(req.top_logprobs)
        answer = Answer(
            self.tokenizer, self.model, prompt_ids, replies, logprobs=logprobs, return_token_ids=req.return_token_ids
        )
        parsed = [r.parsed for r in replies]
        if not req.stream:
            return _json(answer.chat()), parsed
        chunks = answer.chat_chunks(include_usage=bool((req.stream_options or {}).get("include_usage")))
        return [b"data: " + _json(chunk) + b"\n\n" for chunk in chunks] + [b"data: [DONE]\n\n"], parsed

    def _bridged(
        self,
        conversation: Conversation,
        template: ChatTemplate,
        messages: list[dict[str, Any]],
        keys: list[tuple[Any, ...]],
        tools: list[dict[str, Any]] | None,
        tools_key: str,
    ) -> list[int] | None:
        """The branch's ids + the new messages' bridge, when the request continues one of the conversation's
        branches."""
        found = conversation.find_chat_branch(keys, tools_key)
        if found is None:
            return None
        index, covered = found
        ids = conversation.branches[index].ids
        ended_with_eos = len(ids) > 0 and int(ids[-1]) == template.eos_id
        bridge = template.bridge(messages[covered:], tools=tools, ended_with_eos=ended_with_eos)
        return None if bridge is None else [int(t) for t in ids] + bridge

    def _reply(self, result: GenerateResult, stops: Sequence[str]) -> Reply:
        return make_reply(self.tokenizer, result, stops, self.sampling.stop_token_ids, self.parse_reply)

    def parse_reply(self, text: str) -> ParsedReply:
        """The tool parser, bounded at this door: a reply it cannot take is content with one unparseable call
        (logged), never a failed request."""
        try:
            return self.tool_parser(text)
        except (RecursionError, ValueError, TypeError, KeyError) as exc:
            log.warning("endpoint: the tool parser failed on a %d-character reply: %s", len(text), type(exc).__name__)
            return ParsedReply(content=text, unparseable=1)

    def _encode(self, text: str) -> list[int]:
        return encode_released(self.tokenizer, text, add_special_tokens=True)  # off the GIL: the loop ticks on

    def _template(self) -> ChatTemplate:
        if self.template is None:
            raise EndpointError(
                400,
                "this model has no chat template: set model.chat_template, or use /v1/completions or /inference/v1/generate",
                param="messages",
            )
        return self.template

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise EndpointError(
                400,
                f"unknown model {model!r}; this generator serves {list(self.model_names)}",
                param="model",
                code="model_not_found",
            )


def _json(body: Any) -> bytes:
    return orjson.dumps(body.model_dump())
