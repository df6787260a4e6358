"""The endpoint's doors under hostile requests, through the real app, engine and `openai`/`httpx` clients: the
generator's event loop keeps ticking under the worst requests (`max_loop_stall_s` measures the longest gap of a
ticker task while one request is served), sessions and the generator's set of them are bounded with 4xx answers
naming the limit, every malformed request shape is a 4xx naming the field (never a 500), and every endpoint asks
for a key, loopback included."""

from __future__ import annotations

import asyncio
import contextlib
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2
import numpy as np
import openai
import orjson
import pytest

from actors.generator.agents import AgentRunner
from actors.generator.serve import build_app, read_api_key
from actors.generator.serve.conversations import Conversation, Conversations, SessionFull, SessionLimits
from actors.generator.serve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from pipeline.rl.engine_records import GenerateResult
from pipeline.tasks.agents import AgentContext, AgentOutcome
from pipeline.wire.prompts import Prompt
from tests.support.endpoints import EOS, ONE_TOKEN, RUN, served
from tests.support.waits import until

STALL_LIMIT_S = 0.1
"""The longest the generator's event loop may go without ticking while one request is served."""
TICK_S = 0.002
LONG = {"max_new_tokens": 1024, "max_len": 1100, "model_spec": "tiny-llama-1x32-1100", "max_body_bytes": 8 << 20}
"""A tiny model that samples 1,024-token replies cheaply (``ignore_eos``), with room for 8 MiB bodies."""
USER = [{"role": "user", "content": "1>"}]
PROMPT = Prompt(prompt_id="p-doors", messages=[{"role": "user", "content": "1>"}])


@contextlib.asynccontextmanager
async def max_loop_stall_s() -> AsyncIterator[list[float]]:
    """The longest gap between two ticks of a task sleeping `TICK_S` on this loop, in ``[0]`` once the block ends:
    what every other task of the generator (heartbeats, NATS, weight sync, other requests) waited at worst."""
    gaps = [0.0]
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last - TICK_S)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    try:
        yield gaps
    finally:
        done.set()
        await ticker


def _sixty_thousand_stop_strings() -> dict[str, Any]:
    stops = [f"~{k:06d}~" for k in range(60_000)]
    return {"messages": USER, "n": 8, "max_tokens": 1024, "stop": stops, "ignore_eos": True}


def _longest_stops_and_long_streams() -> dict[str, Any]:
    """The worst request that is served: every stop string allowed, at its longest (never sampled: searched to the
    end), over 8 x 1,024 streamed tokens."""
    stops = [chr(0x4E00 + k) * MAX_STOP_CHARS for k in range(MAX_STOP_STRINGS)]
    return {"messages": USER, "n": 8, "max_tokens": 1024, "stop": stops, "stream": True, "ignore_eos": True}


def _four_mib_message() -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "9" * (4 << 20)}]}


@pytest.mark.parametrize(
    ("request_", "status", "needle"),
    [
        (_sixty_thousand_stop_strings, 400, "MAX_STOP_STRINGS"),
        (_longest_stops_and_long_streams, 200, '"finish_reason":"length"'),
        (_four_mib_message, 400, "context_length_exceeded"),
    ],
    ids=["60k-stop-strings-n8", "longest-stops-8x1024-streamed", "4MiB-message"],
)
def test_the_event_loop_keeps_ticking_under_the_worst_requests(
    request_: Callable[[], dict[str, Any]], status: int, needle: str
) -> None:
    """The request's bytes are made before the ticker starts and the answer is read as bytes, so what is measured is
    the generator's side alone (its client would be elsewhere)."""
    body = orjson.dumps({"model": RUN, **request_()})

    async def main() -> float:
        async with served(**LONG) as s:  # type: ignore[arg-type]
            async with httpx2.AsyncClient(base_url=s.endpoint.url, timeout=300) as http:
                async with max_loop_stall_s() as stall:
                    headers = {"content-type": "application/json"}
                    async with http.stream("POST", "/v1/chat/completions", content=body, headers=headers) as r:
                        answer = b"".join([chunk async for chunk in r.aiter_raw()])
                assert r.status_code == status and needle.encode() in answer, answer[-300:]
            ok = await s.client.chat.completions.create(model=RUN, messages=USER, extra_body=ONE_TOKEN)
            assert ok.choices[0].model_extra["token_ids"]
            return stall[0]

    stall_s = asyncio.run(main())
    print(f"\n{request_.__name__}: longest event-loop stall {stall_s * 1000:.1f} ms")
    assert stall_s < STALL_LIMIT_S, f"the event loop stalled {stall_s * 1000:.0f} ms"


# ---- bounded sessions ------------------------------------------------------------------------------------------


def test_a_session_past_its_branches_is_refused_413_naming_the_limit() -> None:
    async def main() -> None:
        async with served(session_limits=SessionLimits(max_branches=8, max_tokens=1 << 20)) as s:
            client = s.session_client("many-branches")
            for _ in range(2):  # 4 + 4 branches: at the limit
                await client.chat.completions.create(model=RUN, messages=USER, n=4, extra_body=ONE_TOKEN)
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model=RUN, messages=USER, n=4, extra_body=ONE_TOKEN)
            assert refused.value.status_code == 413 and "generator.serve.max_session_branches" in str(refused.value)
            assert len(s.service.conversations.get("many-branches").branches) <= 8
            await client.close()

    asyncio.run(main())


def test_concurrent_requests_on_one_session_cannot_pass_its_branches_together() -> None:
    """Room is reserved when a request is admitted: requests in flight together count against the cap."""

    async def main() -> None:
        async with served(session_limits=SessionLimits(max_branches=8, max_tokens=1 << 20)) as s:
            client = s.session_client("together")
            outcomes = await asyncio.gather(
                *(
                    client.chat.completions.create(model=RUN, messages=USER, n=4, extra_body=ONE_TOKEN)
                    for _ in range(4)
                ),
                return_exceptions=True,
            )
            refused = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(refused) == 2 and all(getattr(o, "status_code", None) == 413 for o in refused), outcomes
            conversation = s.service.conversations.get("together")
            assert len(conversation.branches) == 8 and conversation.pending_branches == 0
            await client.close()

    asyncio.run(main())


def test_the_kept_sessions_tokens_are_bounded_together_idle_ones_dropped_held_ones_kept() -> None:
    """``generator.serve.max_kept_tokens``: a request that needs more drops the least recently used sessions no
    request or agent run is using, else it is refused (429 naming the limit)."""
    conversations = Conversations(16, SessionLimits(max_branches=64, max_tokens=1 << 20, max_kept_tokens=1000))
    old = conversations.get("old")
    old.record(list(range(2, 400)), [_result([3] * 16 + [EOS])])  # idle, holds ~415 tokens
    busy = conversations.get("busy")
    busy.check_room(1, 400)  # a request in flight: 401 reserved
    new = conversations.get("new")
    new.check_room(1, 300)  # 415 + 401 + 301 > 1000: the idle one goes
    assert "old" not in conversations._conversations and "busy" in conversations._conversations
    with pytest.raises(SessionFull) as full:  # 401 + 301 + 301 > 1000 and nothing is idle
        conversations.get("third").check_room(1, 300)
    assert full.value.limit == "generator.serve.max_kept_tokens"
    busy.release(1, 400)
    conversations.get("third").check_room(1, 300)  # room again once the request gave its reservation back


def test_a_session_past_its_tokens_is_refused_413_naming_the_limit() -> None:
    async def main() -> None:
        async with served(session_limits=SessionLimits(max_branches=256, max_tokens=1024)) as s:
            client = s.session_client("long-one")
            long_user = [{"role": "user", "content": "12" * 30}]
            with pytest.raises(openai.APIStatusError) as refused:
                for _ in range(64):
                    await client.chat.completions.create(model=RUN, messages=long_user, n=4, extra_body=ONE_TOKEN)
            assert refused.value.status_code == 413 and "generator.serve.max_session_tokens" in str(refused.value)
            assert s.service.conversations.get("long-one").tokens <= 1024
            await client.close()

    asyncio.run(main())


def test_agent_sessions_count_toward_max_sessions_and_a_run_past_its_share_fails_session_limit() -> None:
    release = asyncio.Event()

    async def held(prompt: Prompt, client: openai.AsyncOpenAI, ctx: AgentContext) -> AgentOutcome:
        await client.chat.completions.create(model=ctx.model, messages=USER, extra_body=ONE_TOKEN)
        await release.wait()
        return AgentOutcome(1.0)

    async def greedy(prompt: Prompt, client: openai.AsyncOpenAI, ctx: AgentContext) -> AgentOutcome:
        with contextlib.suppress(openai.APIStatusError):  # an agent that shrugs off the refusal still fails
            for _ in range(8):
                await client.chat.completions.create(model=ctx.model, messages=USER, n=4, extra_body=ONE_TOKEN)
        return AgentOutcome(1.0)

    async def main() -> None:
        limits = SessionLimits(max_branches=6, max_tokens=1 << 20)
        async with served(max_sessions=2, session_limits=limits) as s:
            runner = AgentRunner(held, s.service, base_url=s.endpoint.url, api_key=None, timeout_s=60, max_tokens=6)
            group = asyncio.create_task(runner.group(PROMPT, 3))
            await until(lambda: len(s.service.conversations) == 2, what="two agent runs holding sessions")
            with pytest.raises(openai.RateLimitError) as full:  # a new session while both are agent runs'
                await s.session_client("outsider").chat.completions.create(model=RUN, messages=USER)
            assert "generator.serve.max_sessions" in str(full.value)
            release.set()
            samples = await group
            assert sorted(x.status for x in samples) == ["infra_error", "ok", "ok"]
            (refused,) = [x for x in samples if x.status == "infra_error"]
            assert refused.info["infra_reason"] == "session_limit" and refused.reward is None
            runner = AgentRunner(greedy, s.service, base_url=s.endpoint.url, api_key=None, timeout_s=60, max_tokens=6)
            (sample,) = await runner.group(PROMPT, 1)
            assert sample.status == "infra_error" and sample.info["infra_reason"] == "session_limit"
            assert "max_session_branches" in sample.info["error"]
            await runner.close()
            assert len(s.service.conversations) == 0  # every agent session closed with its run

    asyncio.run(main())


def _result(ids: list[int], version: int = 0) -> GenerateResult:
    n = len(ids)
    return GenerateResult(
        np.asarray(ids, np.int32), np.full(n, -0.5, np.float32), np.full(n, version, np.int32), "stop"
    )


def _wide_session(requests: int, n: int) -> Conversation:
    """``requests`` turns of ``n`` replies each on one session, as the endpoint records them."""
    conversation = Conversation("wide", trained=True, limits=SessionLimits(max_branches=1 << 20, max_tokens=1 << 30))
    prompt = list(range(2, 40)) * 4
    for r in range(requests):
        conversation.record(prompt, [_result([3 + (r + k) % 30] * 16 + [EOS]) for k in range(n)])
    return conversation


def test_building_a_wide_session_s_samples_is_near_linear() -> None:
    """60 requests x n=64 made 3,840 branches; each branch was compared with every earlier one (38 s)."""

    def cost_s(requests: int) -> float:
        conversation = _wide_session(requests, 64)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            samples = conversation.samples()
            best = min(best, time.perf_counter() - started)
        assert len(samples) == len({tuple(s.tokens.tolist()) for s in samples})  # a repeated reply trains once
        return best

    small, large = cost_s(15), cost_s(60)  # 960 and 3,840 branches: x4 linear, x16 quadratic
    assert large / small < 8, f"{small:.3f} s for 960 branches, {large:.3f} s for 3,840"


# ---- malformed requests: the fuzz corpus -----------------------------------------------------------------------

_CALL = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
MALFORMED: list[tuple[str, dict[str, Any], int, str]] = [
    ("function-as-string", {"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]}, 400, "function"),
    ("tool-calls-int", {"messages": [{"role": "assistant", "tool_calls": 5}]}, 400, "tool_calls"),
    ("content-int", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("content-dict", {"messages": [{"role": "tool", "tool_call_id": "c0", "content": {"a": 1}}]}, 400, "content"),
    ("image-part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "type"),
    ("part-text-int", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "text"),
    (
        "call-name-int",
        {"messages": [{"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": 3}}]}]},
        400,
        "name",
    ),
    (
        "arguments-list",
        {"messages": [{"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": [1]}}]}]},
        400,
        "arguments",
    ),
    ("tool-call-id-int", {"messages": [{"role": "tool", "tool_call_id": 7, "content": "x"}]}, 400, "tool_call_id"),
    ("tools-function-string", {"messages": USER, "tools": [{"type": "function", "function": "f"}]}, 400, "tools"),
    ("too-many-stops", {"messages": USER, "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, 400, "MAX_STOP_STRINGS"),
    ("long-stop", {"messages": USER, "stop": "x" * (MAX_STOP_CHARS + 1)}, 400, "MAX_STOP_CHARS"),
    ("many-stop-ids", {"messages": USER, "stop_token_ids": list(range(5000))}, 400, "stop_token_ids"),
]


@pytest.mark.parametrize(("body", "status", "needle"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_a_malformed_request_is_a_4xx_naming_the_field_never_a_500(
    body: dict[str, Any], status: int, needle: str
) -> None:
    async def main() -> None:
        async with served() as s:
            async with httpx2.AsyncClient(base_url=s.endpoint.url) as http:
                r = await http.post("/v1/chat/completions", json={"model": RUN, **body})
                assert r.status_code == status, r.text
                error = r.json()["error"]
                assert needle in f"{error['message']} {error['param']}"
            assert s.service.metrics.errors.get(500) is None
            ok = await s.client.chat.completions.create(model=RUN, messages=USER, extra_body=ONE_TOKEN)
            assert ok.choices[0].model_extra["token_ids"]

    asyncio.run(main())


def test_a_reply_that_breaks_the_tool_parser_is_unparseable_content_not_a_failed_request() -> None:
    async def main() -> None:
        async with served() as s:
            text = "<tool_call>" + "[" * 5000
            parsed = s.service.parse_reply(text)
            assert parsed.unparseable == 1 and parsed.content == text and not parsed.tool_calls

    asyncio.run(main())


# ---- keys ------------------------------------------------------------------------------------------------------


def test_a_run_without_a_configured_key_gets_a_generated_one_in_a_0600_file(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.delenv("LEEWAY_ENDPOINT_KEY", raising=False)
    key = read_api_key(env_name="LEEWAY_ENDPOINT_KEY", file=None, run_dir=tmp_path / "run")
    path = tmp_path / "run" / "endpoint.key"
    assert key and path.read_text().strip() == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_api_key(env_name="LEEWAY_ENDPOINT_KEY", file=None, run_dir=tmp_path / "run") == key  # every generator

    async def main() -> None:
        async with served() as s:
            app = build_app(s.service, api_key=key, max_body_bytes=1 << 20)
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
                keyless = await http.post("/v1/chat/completions", json={"model": RUN, "messages": USER})
                assert keyless.status_code == 401
                health = await http.get("/health")
                assert health.status_code == 200 and health.json() == {"status": "ok"}  # liveness, nothing more
                keyed = {"authorization": f"Bearer {path.read_text().strip()}"}
                assert (await http.get("/health", headers=keyed)).json()["policy_version"] == 0
                r = await http.post(
                    "/v1/chat/completions", json={"model": RUN, "messages": USER, **ONE_TOKEN}, headers=keyed
                )
                assert r.status_code == 200 and r.json()["choices"][0]["token_ids"]

    asyncio.run(main())


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_application_json_is_refused_415(content_type: str | None) -> None:
    """A browser page may post ``text/plain`` (or a form) to 127.0.0.1 without a preflight; only JSON is served."""

    async def main() -> None:
        async with served() as s:
            body = b'{"model": "%s", "messages": [{"role": "user", "content": "1>"}]}' % RUN.encode()
            headers = {} if content_type is None else {"content-type": content_type}
            async with httpx2.AsyncClient(base_url=s.endpoint.url) as http:
                r = await http.post("/v1/chat/completions", content=body, headers=headers)
            assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
            assert s.service.metrics.completion_tokens == 0

    asyncio.run(main())
