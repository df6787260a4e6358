"""The endpoint's request bodies (pydantic, unknown fields refused), its response bodies, and its OpenAI-shaped
errors (vLLM's ``protocol.py``: the wire format in one module, the work in `service.py`).

Field names follow OpenAI and vLLM, which agent harnesses already speak: ``max_tokens`` or
``max_completion_tokens``, ``stop`` (a string or a list), ``seed``, ``logprobs``/``top_logprobs``, ``tools``,
and the extras ``return_token_ids``, ``session_id``, ``stop_token_ids``, ``ignore_eos`` (vLLM's: the run's stop
tokens do not end the reply; not on a trained session, whose sampling is the run's). Fields a harness sends by habit and
that change nothing here (``user``, ``stream_options``, ``parallel_tool_calls``, ``metadata``, ``store``) are
accepted; a penalty or logit bias other than the neutral value is refused, never silently ignored. Every
message, tool call and tool is checked for its shape (`Message`, `Tool`): a ``content`` that is not text, a
``tool_calls`` that is not a list of calls with a ``function`` object, is a 400 naming the field, never an error
deep in the template. Stop strings are bounded (`MAX_STOP_STRINGS` of at most `MAX_STOP_CHARS` characters, as
vLLM bounds them), and so are ``stop_token_ids``.

Responses carry, beside OpenAI's keys, the extras agent trainers read: each choice's ``token_ids`` (the
sampled ids, exactly) and ``policy_versions`` (the policy version of each), and the body's
``prompt_token_ids`` when the request asked ``return_token_ids``. A key OpenAI sends as ``null`` is sent as
``null``; an extra that does not apply is left out (`_ResponseBody.omit_when_none`), so clients see the same
keys as from OpenAI or vLLM.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)


class EndpointError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


MAX_STOP_STRINGS = 16
"""Most stop strings a request may give (OpenAI allows 4): each is searched for after every sampled token."""
MAX_STOP_CHARS = 256
"""Longest stop string; the search after each token looks back this far, so the search is linear in the reply."""
MAX_STOP_TOKEN_IDS = 1024
"""Most ``stop_token_ids`` a request may give: the engine checks each sampled token against them."""


class _Part(BaseModel):
    """A message's content part: text only (this endpoint serves a text model)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: _Function


class Message(BaseModel):
    """One chat message, checked for its shape only (unknown keys kept for the template): a content that is not
    text, a tool call whose ``function`` is not an object, is a 400 naming the field, never an error deeper in."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    """One entry of ``tools``: a function the model may call."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: _ToolSpec


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool | int | None = None
    return_token_ids: bool = False
    session_id: str | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True

    @model_validator(mode="after")
    def _neutral_penalties(self) -> _Body:
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                raise ValueError(f"{name} is not supported (the trainer could not correct for it); leave it out")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported (the trainer could not correct for it); leave it out")
        stops = self.stops()
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: {len(stops)} stop strings; at most {MAX_STOP_STRINGS} (MAX_STOP_STRINGS)")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop: a stop string is over {MAX_STOP_CHARS} characters (MAX_STOP_CHARS)")
        return self

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(_Body):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _text_responses(self) -> ChatRequest:
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ValueError("response_format other than text is not supported")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the client sent them (the keys it gave, unknown ones included), for the template."""
        return [m.model_dump(exclude_unset=True) for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_unset=True) for t in self.tools] if self.tools else None

    def text_chars(self) -> int:
        """Characters of text the messages and tools hold: with `max_chars_per_token`, a floor on the prompt's
        tokens known before anything is rendered."""
        chars = sum(
            len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or ())
            for m in self.messages
        )
        for message in self.messages:
            for call in message.tool_calls or ():
                arguments = call.function.arguments
                chars += len(call.function.name) + (len(arguments) if isinstance(arguments, str) else 0)
        return chars


class CompletionRequest(_Body):
    """``POST /v1/completions``: a text prompt, or a list of token ids."""

    prompt: str | list[int]
    echo: bool = False

    def token_limit(self) -> int | None:
        return self.max_tokens


class GenerateSamplingParams(BaseModel):
    """``sampling_params`` of ``/inference/v1/generate`` (vLLM's names)."""

    model_config = ConfigDict(extra="allow")

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    logprobs: int | None = None


class TokensRequest(BaseModel):
    """``POST /inference/v1/generate``: token ids in, token ids out."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    session_id: str | None = None
    request_id: str | None = None


Route = Literal["chat", "completions", "tokens"]


def parse_body(model: type[BaseModel], data: object) -> Any:
    """Validate a decoded JSON body; a failure is a 400 naming the bad field (the deepest, when a value matched no
    branch of a union: ``messages.0.content.list[_Part].0.type``, not just ``content``)."""
    if not isinstance(data, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        first = max(errors, key=lambda e: len(e["loc"]))  # of a union's failed branches, the one that got furthest
        where = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = f"unknown field {where!r}"
        raise EndpointError(400, f"{where}: {message}" if where else message, param=where) from None


# ---- responses -----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """A response id in OpenAI's form (``chatcmpl-<hex>``), unique without coordination between generators."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now_s() -> int:
    return int(time.time())


class _ResponseBody(BaseModel):
    """A response body: keys in field order. OpenAI sends some absent keys as ``null`` (a choice's
    ``logprobs``) and leaves others out (a message's ``tool_calls``); the fields named in ``omit_when_none``
    are the ones left out when None, so a body has exactly the keys it always had."""

    omit_when_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self.omit_when_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class Usage(_ResponseBody):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatLogprobs(_ResponseBody):
    """A chat choice's ``logprobs`` (and the token-in route's): one entry per sampled token, as built by
    `replies.logprobs_content` (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""

    content: list[dict[str, Any]]


class CompletionLogprobs(_ResponseBody):
    """A completion choice's ``logprobs`` (OpenAI's legacy form): the tokens' texts and log-probs."""

    tokens: list[str]
    token_logprobs: list[float]


class ChatMessage(_ResponseBody):
    omit_when_none = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionChoice(_ResponseBody):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None
    token_ids: list[int]
    policy_versions: list[int]


class CompletionChoice(_ResponseBody):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int]
    policy_versions: list[int]


class ChatDelta(_ResponseBody):
    """A chunk's ``delta``: only the keys given are sent (vLLM sends deltas with ``exclude_unset``), so the last
    chunk's delta is ``{}`` while a tool-call delta sends ``content: null``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class ChatStreamChoice(_ResponseBody):
    """A chunk's choice: the ids and versions come once, in the chunk that holds the finish reason."""

    omit_when_none = frozenset({"logprobs", "token_ids", "policy_versions"})

    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None
    policy_versions: list[int] | None = None


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class _Envelope(_ResponseBody, Generic[ChoiceT]):
    """What every completion body holds around its choices, in this order. ``usage`` is absent only from the
    stream chunks before the last; ``prompt_token_ids`` is present only when the request asked
    ``return_token_ids``."""

    omit_when_none = frozenset({"usage", "prompt_token_ids"})

    id: str
    object: str
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[ChoiceT]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponse(_Envelope[ChatCompletionChoice]):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    usage: Usage


class ChatCompletionStreamResponse(_Envelope[ChatStreamChoice]):
    """One ``data:`` chunk; every chunk of a response has the same ``id`` and ``created``."""

    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionResponse(_Envelope[CompletionChoice]):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    usage: Usage


class GenerateChoice(_ResponseBody):
    index: int
    token_ids: list[int]
    finish_reason: str
    logprobs: ChatLogprobs
    policy_versions: list[int]


class GenerateResponse(_ResponseBody):
    """``/inference/v1/generate``'s answer (vLLM's token-in, token-out shape)."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[GenerateChoice]


class ModelCard(_ResponseBody):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "leeway"
    max_model_len: int | None
    """The engine's context in tokens (None: unbounded), so a harness can size its prompts."""


class ModelList(_ResponseBody):
    object: Literal["list"] = "list"
    data: list[ModelCard]
