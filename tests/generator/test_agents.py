"""Agent functions through the endpoint with the real `openai` client: a run's session becomes samples carrying
its reward; one that raises, hangs past its timeout, returns no reward or makes no request is one masked
``infra_error`` sample, and the group baseline ignores it."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import openai

from actors.generator.agents import AgentRunner
from pipeline.failures import InfraFailure, InfraReason
from pipeline.rl.advantages import compute_advantages, valid_mask
from pipeline.tasks.agents import AgentContext, AgentOutcome, load_agent
from pipeline.tasks.tool_reverse import ReverseToolTask
from pipeline.wire.prompts import Prompt
from pipeline.wire.trajectory import TrajectoryGroup
from tests.support.endpoints import TOKENIZER, chat_template, served
from tests.support.generators import FakeTrainer, generator_cfg, running_generator, unique_run

PROMPT = next(ReverseToolTask(digits_per_turn=2, turns=2, seed=3).prompts())


async def _reply_once(prompt: Prompt, client: Any, ctx: AgentContext) -> AgentOutcome:
    r = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "12>"}])
    return AgentOutcome(0.25 * (ctx.index + 1), info={"ids": r.choices[0].model_extra["token_ids"]})


async def _raises(prompt: Prompt, client: Any, ctx: AgentContext) -> AgentOutcome:
    await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "1>"}])
    raise RuntimeError("harness crashed")


async def _hangs(prompt: Prompt, client: Any, ctx: AgentContext) -> AgentOutcome:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _no_reward(prompt: Prompt, client: Any, ctx: AgentContext) -> AgentOutcome:
    await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "1>"}])
    return AgentOutcome(None)


async def _no_request(prompt: Prompt, client: Any, ctx: AgentContext) -> AgentOutcome:
    return AgentOutcome(1.0)


async def _sandbox_lost(prompt: Prompt, client: Any, ctx: AgentContext) -> AgentOutcome:
    await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "1>"}])
    raise InfraFailure("the sandbox stopped answering", reason=InfraReason.SANDBOX_LOST)


async def _mixed(prompt: Prompt, client: Any, ctx: AgentContext) -> AgentOutcome:
    return await (_reply_once, _raises, _hangs, _no_reward, _reply_once)[ctx.index](prompt, client, ctx)


def test_an_agent_run_s_session_becomes_samples_with_its_reward_and_episode_id() -> None:
    async def main() -> None:
        async with served() as s:
            runner = AgentRunner(
                _reply_once, s.service, base_url=s.endpoint.url, api_key=None, timeout_s=60, max_tokens=6
            )
            samples = await runner.group(PROMPT, 3)
            assert [x.reward for x in samples] == [0.25, 0.5, 0.75]
            for sample in samples:
                assert sample.status == "ok" and sample.reward_source == "verifier"
                assert sample.tokens[sample.loss_mask == 1].tolist() == sample.info["ids"]
                assert sample.episode_id.startswith(PROMPT.prompt_id) and sample.branch == 0
            assert len(s.service.conversations) == 0  # closed with their runs

    asyncio.run(main())


def test_failed_agent_runs_are_masked_infra_errors_and_leave_the_baseline_alone() -> None:
    async def main() -> None:
        async with served() as s:
            runner = AgentRunner(_mixed, s.service, base_url=s.endpoint.url, api_key=None, timeout_s=2, max_tokens=6)
            samples = await runner.group(PROMPT, 5)
            assert [x.status for x in samples] == ["ok", "infra_error", "infra_error", "infra_error", "ok"]
            errors = [x.info["error"] for x in samples[1:4]]
            assert "harness crashed" in errors[0] and errors[1].startswith("agent_timeout") and "no reward" in errors[2]
            assert all(x.reward is None and x.reward_source == "none" for x in samples[1:4])
            group = TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="gen", samples=samples)
            valid = valid_mask(list(group.reward), group.status, group.reward_source)
            advantages, trainable = compute_advantages([x.reward for x in samples], valid)
            assert trainable and valid.tolist() == [True, False, False, False, True]
            np.testing.assert_allclose(advantages, [-0.5, 0, 0, 0, 0.5])  # baseline: mean of 0.25 and 1.25 only
            assert [x.info["infra_reason"] for x in samples[1:4]] == ["agent_error", "agent_timeout", "agent_error"]

    asyncio.run(main())


def test_a_run_that_made_no_request_leaves_its_chat_prompt_rendered_with_the_chat_template() -> None:
    chat = Prompt("chat-0", messages=({"role": "user", "content": "12>"},), tags=("chat",))

    async def main() -> None:
        async with served() as s:
            runner = AgentRunner(
                _no_request, s.service, base_url=s.endpoint.url, api_key=None, timeout_s=60, max_tokens=6
            )
            (sample,) = await runner.group(chat, 1)
        assert (sample.status, sample.reward, sample.info["error"]) == ("infra_error", None, "agent made no request")
        assert sample.tokens.tolist() == chat_template().render(chat.messages)  # the model's view, generation prompt
        assert not sample.loss_mask.any() and (sample.versions == -1).all() and sample.tags == ("chat",)
        assert sample.episode_id == sample.trajectory_id and sample.episode_id.startswith("chat-0-")

    asyncio.run(main())


def test_a_failed_run_s_infra_reason_is_its_exception_s_typed_reason() -> None:
    async def main() -> None:
        async with served() as s:
            runner = AgentRunner(
                _sandbox_lost, s.service, base_url=s.endpoint.url, api_key=None, timeout_s=60, max_tokens=6
            )
            (sample,) = await runner.group(PROMPT, 1)
        assert (sample.status, sample.reward, sample.info["infra_reason"]) == ("infra_error", None, "sandbox_lost")
        assert sample.info["error"] == "sandbox_lost: the sandbox stopped answering"
        assert sample.loss_mask.any()  # the branch it sampled before failing, masked out by its status

    asyncio.run(main())


def test_the_built_in_agent_runs_its_tool_episode_and_task_agent_names_load() -> None:
    async def main() -> None:
        task = ReverseToolTask(digits_per_turn=2, turns=2, seed=0)
        async with served(max_new_tokens=3) as s:
            runner = AgentRunner(
                task.agent, s.service, base_url=s.endpoint.url, api_key=None, timeout_s=60, max_tokens=3
            )
            samples = await runner.group(next(task.prompts()), 2)
            for sample in samples:
                assert sample.status == "ok" and 0.0 <= sample.reward <= 1.0
                assert sample.num_turns >= 1 and sample.loss_mask.sum() >= 1
        assert load_agent("pipeline.tasks.tool_reverse:run") is task.agent

    asyncio.run(main())


def test_a_generator_runs_its_task_s_agent_through_its_own_endpoint_and_publishes_the_episodes(stack: Any) -> None:
    cfg = generator_cfg(
        stack,
        unique_run(),
        "task.name=reverse_tool",
        "task.args={digits_per_turn: 2, turns: 2, tokenizer: chat}",
        "engine.sampling.max_new_tokens=3",
    )
    task = ReverseToolTask(digits_per_turn=2, turns=2, seed=5)

    async def main() -> None:
        async with FakeTrainer(cfg, tokenizer=TOKENIZER, prompts=task.prompts()) as trainer:
            await trainer.publish(0)
            async with running_generator(cfg, "agent-gen") as rt:
                assert rt.endpoint is not None and rt.endpoint.url.startswith("http://127.0.0.1:")
                await trainer.admit(2, policy_version=0)
                groups = await trainer.groups(2)
                for group in groups:
                    assert group.num_samples >= cfg.advantages.group_size
                    assert len(set(group.episode_ids)) == cfg.advantages.group_size  # one episode per agent run
                    assert set(group.status) <= {"ok", "truncated"} and not np.isnan(group.reward).any()
                    assert (group.versions[group.loss_mask == 1] == 0).all() and group.loss_mask.sum() > 0
                # the same endpoint serves anyone else meanwhile (evaluation, debugging): never trained on
                key = (cfg.run.run_dir / "endpoint.key").read_text().strip()  # generated: no key was configured
                client = openai.AsyncOpenAI(base_url=f"{rt.endpoint.url}/v1", api_key=key, max_retries=0)
                r = await client.chat.completions.create(
                    model=cfg.run.name, messages=[{"role": "user", "content": "1>"}]
                )
                assert r.choices[0].model_extra["policy_versions"] == [0] * len(r.choices[0].model_extra["token_ids"])
                await client.close()
                assert rt.service is not None and rt.service.metrics.requests >= 2 * cfg.advantages.group_size + 1

    asyncio.run(main())
