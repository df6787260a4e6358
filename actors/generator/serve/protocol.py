"""The endpoint's request bodies (pydantic, unknown fields refused) and its OpenAI-shaped errors.

Field names follow OpenAI and vLLM, which agent harnesses already speak: ``max_tokens`` or
``max_completion_tokens``, ``stop`` (a string or a list), ``seed``, ``logprobs``/``top_logprobs``, ``tools``,
and the extras ``return_token_ids``, ``session_id``, ``stop_token_ids``, ``ignore_eos`` (vLLM's: the run's stop
tokens do not end the reply; not on a trained session, whose sampling is the run's). Fields a harness sends by habit and
that change nothing here (``user``, ``stream_options``, ``parallel_tool_calls``, ``metadata``, ``store``) are
accepted; a penalty or logit bias other than the neutral value is refused, never silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


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


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
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
        return self

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(_Body):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _messages_have_roles(self) -> ChatRequest:
        for i, message in enumerate(self.messages):
            if message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"messages[{i}].role must be system, developer, user, assistant or tool")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ValueError("response_format other than text is not supported")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


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
    stop_token_ids: list[int] | None = None
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
    """Validate a decoded JSON body; a failure is a 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = f"unknown field {where!r}"
        raise EndpointError(400, f"{where}: {message}" if where else message, param=where) from None
