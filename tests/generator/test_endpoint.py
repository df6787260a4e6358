"""The generator's OpenAI-compatible endpoint through the real `openai` client: token-exact turns across a
tool-calling episode, branches, versions, streaming, the token-in route, and bad input that never stops it."""

from __future__ import annotations

import asyncio

import httpx2
import numpy as np
import openai
import pytest
import torch

from actors.generator.engines.torch_engine import sampling_logprobs
from actors.generator.serve.replies import make_reply
from pipeline.chat.tool_parsers import hermes
from pipeline.rl.engine_records import GenerateResult, SamplingParams
from tests.support.endpoints import EOS, MODEL, ONE_TOKEN, RUN, TOKENIZER, chat_template, served

TOOLS = [{"type": "function", "function": {"name": "get_digits", "parameters": {"type": "object", "properties": {}}}}]
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_digits", "arguments": "{}"}}
START = [
    {"role": "user", "content": "r"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "content": "314>"},
]


def _assistant(message: openai.types.chat.ChatCompletionMessage) -> dict:
    return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})


def test_a_tool_calling_episode_trains_on_exactly_the_sampled_ids_and_the_bridged_context() -> None:
    async def main() -> None:
        async with served() as s:
            client = s.session_client("episode-1")
            messages = list(START)
            prompts, sampled = [], []
            for k in range(3):
                if k:
                    messages.append({"role": "user", "content": f"{k}5{k}>"})
                r = await client.chat.completions.create(
                    model=RUN,
                    messages=messages,
                    tools=TOOLS,
                    seed=10 + k,
                    extra_body={"return_token_ids": True, **ONE_TOKEN},
                )
                choice = r.choices[0]
                prompts.append(r.model_extra["prompt_token_ids"])
                sampled.append(choice.model_extra["token_ids"])
                assert choice.model_extra["policy_versions"] == [0] * len(sampled[-1])
                messages.append(_assistant(choice.message))
            session = s.service.conversations.get("episode-1")
            (branch,) = session.samples()
            # each turn's prompt is the previous prompt + its sampled ids (never re-tokenized) + the bridge
            for k in range(1, 3):
                assert prompts[k][: len(prompts[k - 1]) + len(sampled[k - 1])] == prompts[k - 1] + sampled[k - 1]
            assert branch.tokens.tolist() == prompts[-1] + sampled[-1]
            assert branch.tokens[branch.loss_mask == 1].tolist() == [t for ids in sampled for t in ids]
            assert (branch.versions[branch.loss_mask == 0] == -1).all()
            # recorded log-probs are the engine's behaviour log-probs: a separate forward agrees
            ids = torch.tensor([branch.tokens.tolist()])
            with torch.no_grad():
                logits = s.engine.model(input_ids=ids).logits[0, :-1]
            params = SamplingParams(max_new_tokens=6, temperature=1.0)
            reference = sampling_logprobs(logits, params).gather(-1, ids[0, 1:, None])[:, 0].numpy()
            loss = branch.loss_mask[1:] == 1
            np.testing.assert_allclose(branch.logprobs[1:][loss], reference[loss], atol=1e-4)

    asyncio.run(main())


def test_streaming_and_non_streaming_give_the_same_ids_for_a_seed() -> None:
    async def main() -> None:
        async with served() as s:
            messages = [{"role": "user", "content": "12>"}]
            plain = await s.client.chat.completions.create(model=RUN, messages=messages, seed=5, max_tokens=6)
            stream = await s.client.chat.completions.create(
                model=RUN, messages=messages, seed=5, max_tokens=6, stream=True, stream_options={"include_usage": True}
            )
            text, ids, usage = "", None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    if choice.finish_reason is not None:
                        ids = choice.model_extra["token_ids"]
            assert ids == plain.choices[0].model_extra["token_ids"]
            assert text == (plain.choices[0].message.content or "")
            assert usage is not None and usage.completion_tokens == len(ids)

    asyncio.run(main())


def test_a_rewritten_history_starts_a_branch_and_shared_tokens_are_trained_once() -> None:
    async def main() -> None:
        async with served() as s:
            client = s.session_client("episode-2")
            first = await client.chat.completions.create(
                model=RUN, messages=START, tools=TOOLS, seed=1, extra_body=ONE_TOKEN
            )
            reply = _assistant(first.choices[0].message)
            turn2 = [*START, reply, {"role": "user", "content": "159>"}]
            await client.chat.completions.create(model=RUN, messages=turn2, tools=TOOLS, seed=2, extra_body=ONE_TOKEN)
            # the agent rewrites its history: the same first reply, but another second message
            rewritten = [*START, reply, {"role": "user", "content": "777>"}]
            await client.chat.completions.create(
                model=RUN, messages=rewritten, tools=TOOLS, seed=3, extra_body=ONE_TOKEN
            )
            session = s.service.conversations.get("episode-2")
            assert len(session.branches) == 2
            one, two = session.samples()
            assert (one.branch, two.branch) == (0, 1)
            first_ids = first.choices[0].model_extra["token_ids"]
            start = chat_template().render(START, tools=TOOLS)
            shared = slice(len(start), len(start) + len(first_ids))
            # the fresh render of the rewritten history reproduces the first reply's one token: it is shared
            assert two.tokens[shared].tolist() == first_ids
            assert one.loss_mask[shared].all() and not two.loss_mask[shared].any()
            assert (two.versions[shared] == -1).all()
            assert two.loss_mask[-1] == 1 and two.loss_mask.sum() >= 1

    asyncio.run(main())


def test_a_turn_cut_by_length_drops_the_turns_after_it() -> None:
    async def main() -> None:
        async with served() as s:
            client = s.session_client("episode-3")
            first = await client.chat.completions.create(model=RUN, messages=START, max_tokens=1, seed=4)
            assert first.choices[0].finish_reason == "length"
            more = [*START, _assistant(first.choices[0].message), {"role": "user", "content": "1>"}]
            second = await client.chat.completions.create(model=RUN, messages=more, seed=5)
            assert second.choices[0].model_extra["token_ids"]  # served, but never trained on
            (only,) = s.service.conversations.get("episode-3").samples()
            assert only.num_turns == 1 and only.loss_mask.sum() == 1

    asyncio.run(main())


def test_a_weight_update_mid_episode_shows_in_policy_versions() -> None:
    async def main() -> None:
        async with served() as s:
            client = s.session_client("episode-4")
            first = await client.chat.completions.create(model=RUN, messages=START, seed=6, extra_body=ONE_TOKEN)
            update = {
                name: t + 0.01 for name, t in s.engine.model.state_dict().items() if name.endswith("c_attn.weight")
            }
            await asyncio.to_thread(s.engine.update_weights, update, 1)
            more = [*START, _assistant(first.choices[0].message), {"role": "user", "content": "2>"}]
            second = await client.chat.completions.create(model=RUN, messages=more, seed=7, extra_body=ONE_TOKEN)
            assert set(first.choices[0].model_extra["policy_versions"]) == {0}
            assert set(second.choices[0].model_extra["policy_versions"]) == {1}
            samples = s.service.conversations.get("episode-4").samples()
            trained = np.concatenate([b.versions[b.loss_mask == 1] for b in samples])
            assert set(trained.tolist()) >= {1}

    asyncio.run(main())


def test_the_token_in_route_and_completions_return_ids_log_probs_and_versions() -> None:
    async def main() -> None:
        async with served() as s:
            ids = chat_template().render([{"role": "user", "content": "12>"}])
            r = await s.client.post(
                f"{s.endpoint.url}/inference/v1/generate",
                cast_to=httpx2.Response,
                body={"model": RUN, "token_ids": ids, "sampling_params": {"max_tokens": 4, "seed": 3, "logprobs": 1}},
            )
            body = r.json()
            assert body["prompt_token_ids"] == ids
            (choice,) = body["choices"]
            tokens = [int(e["token"].removeprefix("token_id:")) for e in choice["logprobs"]["content"]]
            assert tokens == choice["token_ids"] and len(choice["policy_versions"]) == len(tokens)
            completion = await s.client.completions.create(model=MODEL, prompt=ids, max_tokens=4, seed=3, logprobs=1)
            assert completion.choices[0].model_extra["token_ids"] == choice["token_ids"]
            models = await s.client.models.list()
            assert {m.id for m in models.data} == {RUN, MODEL}

    asyncio.run(main())


def test_a_reply_s_tool_call_text_becomes_tool_calls_and_an_unparseable_one_stays_content() -> None:
    def reply(text: str):
        ids = np.asarray(TOKENIZER.encode(text, add_special_tokens=False).ids + [EOS], np.int32)
        result = GenerateResult(ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int32), "stop")
        return make_reply(TOKENIZER, result, (), (EOS,), hermes)

    good = reply('<tool_call>{"name": "get_digits", "arguments": {"n": 3}}</tool_call>')
    assert good.finish_reason == "tool_calls" and good.parsed.content is None
    assert good.parsed.tool_calls[0]["function"] == {"name": "get_digits", "arguments": '{"n": 3}'}
    bad = reply("12<tool_call>{nope</tool_call>")
    assert bad.finish_reason == "stop" and bad.parsed.unparseable == 1 and "<tool_call>" in bad.parsed.content


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "1"}], "frobnicate": 1}', 400, "unknown field 'frobnicate'"),
        (b'{"messages": [{"role": "wizard", "content": "1"}]}', 400, "role"),
        (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "1"}]}', 400, "unknown model"),
        (b'{"messages": [{"role": "user", "content": "1"}], "temperature": -1}', 400, "temperature"),
        (b'{"messages": [{"role": "user", "content": "1"}], "presence_penalty": 1.5}', 400, "presence_penalty"),
        (b'{"messages": [{"role": "user", "content": "' + b"9" * 200 + b'"}]}', 400, "context_length_exceeded"),
        (b'{"messages": [{"role": "user", "content": "' + b"9" * 3000 + b'"}]}', 413, "max_body_bytes"),
    ],
)
def test_bad_requests_get_openai_shaped_errors_and_the_endpoint_goes_on(body: bytes, status: int, needle: str) -> None:
    async def main() -> None:
        async with served(max_body_bytes=2048) as s:
            async with httpx2.AsyncClient(base_url=s.endpoint.url) as http:
                r = await http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
                assert r.status_code == status, r.text
                error = r.json()["error"]
                assert needle in error["message"] + str(error.get("code")) + str(error.get("param"))
            ok = await s.client.chat.completions.create(model=RUN, messages=[{"role": "user", "content": "1>"}])
            assert ok.choices[0].model_extra["token_ids"]

    asyncio.run(main())


def test_a_wrong_key_is_401_and_the_right_one_is_served() -> None:
    async def main() -> None:
        async with served(api_key="sesame") as s:
            wrong = openai.AsyncOpenAI(base_url=f"{s.endpoint.url}/v1", api_key="nope", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model=RUN, messages=[{"role": "user", "content": "1"}])
            await wrong.close()
            ok = await s.client.chat.completions.create(model=RUN, messages=[{"role": "user", "content": "1"}])
            assert ok.choices

    asyncio.run(main())


def test_no_weights_yet_is_503_and_over_capacity_is_429_both_with_retry_after() -> None:
    async def main() -> None:
        async with served(version=None) as s:
            with pytest.raises(openai.InternalServerError) as raised:
                await s.client.chat.completions.create(model=RUN, messages=[{"role": "user", "content": "1"}])
            assert raised.value.status_code == 503 and raised.value.response.headers["retry-after"]
        async with served(max_inflight=2) as s:
            with pytest.raises(openai.RateLimitError) as limited:
                await s.client.chat.completions.create(model=RUN, messages=[{"role": "user", "content": "1"}], n=3)
            assert limited.value.response.headers["retry-after"]

    asyncio.run(main())


def test_a_client_that_disconnects_mid_stream_leaves_the_endpoint_serving() -> None:
    async def main() -> None:
        async with served() as s:
            async with httpx2.AsyncClient(base_url=s.endpoint.url) as http:
                body = {"model": RUN, "messages": [{"role": "user", "content": "1>"}], "stream": True, "n": 4}
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    async for _ in response.aiter_bytes():
                        break  # hang up after the first bytes
            ok = await s.client.chat.completions.create(model=RUN, messages=[{"role": "user", "content": "1>"}])
            assert ok.choices[0].model_extra["token_ids"]
            health = await s.client.get(f"{s.endpoint.url}/health", cast_to=httpx2.Response)
            assert health.json()["policy_version"] == 0

    asyncio.run(main())


def test_ignore_eos_samples_every_requested_token() -> None:
    async def main() -> None:
        async with served() as s:
            messages = [{"role": "user", "content": "12>"}]
            lengths = {}
            for ignore in (False, True):
                lengths[ignore] = []
                for seed in range(12):
                    r = await s.client.chat.completions.create(
                        model=RUN,
                        messages=messages,
                        seed=seed,
                        max_tokens=8,
                        extra_body={"return_token_ids": True, "ignore_eos": ignore},
                    )
                    lengths[ignore].append(len(r.choices[0].model_extra["token_ids"]))
                    if ignore:
                        assert r.choices[0].finish_reason == "length"
            assert min(lengths[False]) < 8  # these seeds do sample the stop token ...
            assert lengths[True] == [8] * 12  # ... which no longer ends the reply

    asyncio.run(main())
