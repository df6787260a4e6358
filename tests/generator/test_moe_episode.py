"""Routes of one agent episode on a MoE model, through the endpoint and the real ``openai`` client: a weight update
lands between its two turns. Every position's route carries the version of the forward that computed it; the second
turn adds only its new positions when its prefix was kept (``engine.prefix_across_updates``), and recomputes, routes
and counts the prefix under the new weights when the update dropped it (the default)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from actors.generator.agents import AgentRunner
from pipeline.tasks.agents import AgentContext, AgentOutcome
from pipeline.tasks.tool_reverse import ReverseToolTask
from pipeline.wire.trajectory import Sample, TrajectoryGroup
from tests.support.endpoints import ONE_TOKEN, Served, served

PROMPT = next(ReverseToolTask(digits_per_turn=2, turns=2, seed=3).prompts())
MOE = "tiny-qwen3moe-2x64"
"""The first turn samples one token and stops (`ONE_TOKEN`), so the second continues the episode's branch."""


def _two_turns(box: dict[str, Any]):  # type: ignore[no-untyped-def]
    async def agent(prompt: Any, client: Any, ctx: AgentContext) -> AgentOutcome:
        s: Served = box["served"]
        messages = [{"role": "user", "content": "12>"}]
        first = await client.chat.completions.create(model=ctx.model, messages=messages, extra_body=ONE_TOKEN)
        box["first_ids"] = first.choices[0].model_extra["token_ids"]
        tensors = {k: v.detach().clone() + 0.05 * torch.randn_like(v) for k, v in s.engine.model.state_dict().items()}
        await asyncio.to_thread(s.engine.update_weights, tensors, 1)  # between the two turns
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "3>"},
        ]
        await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=5)
        return AgentOutcome(1.0)

    return agent


def _episode(prefix_across_updates: bool) -> tuple[Sample, dict[str, Any], dict[str, int]]:
    box: dict[str, Any] = {}

    async def main() -> tuple[Sample, dict[str, int]]:
        async with served(model_spec=MOE, max_new_tokens=5, prefix_across_updates=prefix_across_updates) as s:
            box["served"] = s
            runner = AgentRunner(
                _two_turns(box), s.service, base_url=s.endpoint.url, api_key=None, timeout_s=120, max_tokens=5
            )
            (sample,) = await runner.group(PROMPT, 1)
            return sample, dict(s.engine.prefix_stats)

    sample, stats = asyncio.run(main())
    return sample, box, stats


def _turn_boundary(sample: Sample, first_ids: list[int]) -> int:
    """Positions the first turn fed: its context and reply but the reply's last token."""
    tokens = sample.tokens.tolist()
    for end in range(len(first_ids), len(tokens) + 1):
        if tokens[end - len(first_ids) : end] == first_ids and sample.loss_mask[end - 1]:
            return end - 1
    raise AssertionError("the first reply is not in the sample")


@pytest.mark.parametrize("kept", [True, False], ids=["prefix-kept", "prefix-dropped"])
def test_each_position_s_route_has_the_version_that_computed_it_across_an_update_between_turns(kept: bool) -> None:
    sample, box, stats = _episode(kept)
    group = TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=[sample])
    assert group.routes is not None and group.routes.shape[1:] == (2, 2)
    versions = sample.route_versions.tolist()
    boundary = _turn_boundary(sample, box["first_ids"])
    assert versions[-1] == -1 and -1 not in versions[:-1]  # every fed position routed, the last token never fed
    assert set(versions[boundary:-1]) == {1}  # the second turn's positions: after the update
    if kept:
        assert set(versions[:boundary]) == {0}  # computed by the first turn, before the update: never sent again
        assert stats["prefix_hits"] == 1 and stats["recomputed_prefix_tokens"] == 0
        assert "recomputed_route_positions" not in sample.info
    else:
        assert set(versions[:boundary]) == {1}  # the dropped prefix computed again, and routed, by version 1
        assert sample.info["recomputed_route_positions"] == boundary
        assert stats["recomputed_prefix_tokens"] > 0
    np.testing.assert_array_equal(group.sample(0).routes, sample.routes)
