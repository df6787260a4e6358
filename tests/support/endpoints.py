"""An endpoint over a real `TorchEngine` (tiny-gpt2, the built-in chat tokenizer and template), served by
uvicorn on 127.0.0.1 in the test's event loop, and the real ``openai`` client pointed at it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
import torch

from actors.generator.engines.base import SamplingParams
from actors.generator.engines.torch_engine import TorchEngine
from actors.generator.serve import Endpoint, EndpointService, build_app
from actors.generator.serve.conversations import SessionLimits
from actors.models import build_model
from pipeline.chat.template import ChatTemplate
from pipeline.chat.tool_parsers import hermes
from pipeline.tasks.chat_tokenizer import load_chat_template_text, load_chat_tokenizer

TOKENIZER = load_chat_tokenizer()
EOS = TOKENIZER.token_to_id("<eos>")
MODEL = "tiny-gpt2-2x64"
RUN = "endpoint-test"
ONE_TOKEN = {"stop_token_ids": list(range(TOKENIZER.get_vocab_size()))}
"""Every id stops a reply: each turn samples exactly one token and ends with ``stop``, whatever the random weights."""


def chat_template() -> ChatTemplate:
    return ChatTemplate(TOKENIZER, load_chat_template_text(), eos_token="<eos>", bos_token="<bos>")


def model(seed: int = 0, spec: str = MODEL) -> torch.nn.Module:
    return build_model(spec, vocab_size=TOKENIZER.get_vocab_size(), seed=seed)


@dataclass
class Served:
    engine: TorchEngine
    service: EndpointService
    endpoint: Endpoint
    client: openai.AsyncOpenAI

    def session_client(self, session_id: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.endpoint.url}/sessions/{session_id}/v1", api_key=self.client.api_key, max_retries=0
        )


@contextlib.asynccontextmanager
async def served(
    *,
    version: int | None = 0,
    api_key: str | None = None,
    max_new_tokens: int = 6,
    max_inflight: int = 64,
    max_body_bytes: int = 1 << 20,
    max_len: int | None = None,
    model_spec: str = MODEL,
    prefix_across_updates: bool = False,
    max_sessions: int = 64,
    session_limits: SessionLimits | None = None,
) -> AsyncIterator[Served]:
    """An endpoint whose engine holds ``version`` (None: no weights yet, version -1)."""
    net = model(spec=model_spec)
    engine = TorchEngine(
        net,
        pad_token_id=0,
        seed=7,
        version=-1,
        max_slots=16,
        max_len=max_len,
        prefix_across_updates=prefix_across_updates,
    )
    if version is not None:
        engine.load_state(dict(net.state_dict()), version)
    service = EndpointService(
        engine=engine,
        tokenizer=TOKENIZER,
        template=chat_template(),
        tool_parser=hermes,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=(EOS,)),
        model_names=(RUN, MODEL),
        max_inflight=max_inflight,
        max_sessions=max_sessions,
        session_limits=session_limits,
    )
    endpoint = Endpoint(build_app(service, api_key=api_key, max_body_bytes=max_body_bytes), host="127.0.0.1", port=0)
    await endpoint.start()
    client = openai.AsyncOpenAI(base_url=f"{endpoint.url}/v1", api_key=api_key or "unused", max_retries=0)
    try:
        yield Served(engine, service, endpoint, client)
    finally:
        await client.close()
        await endpoint.stop()
