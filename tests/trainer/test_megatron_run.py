"""`trainer.backend: megatron` through the real stack and real rank processes: the demo runs through `leeway run`,
and the ranks (TP, DP, PP over gloo) take the steps one rank takes, publish sharded and resume across layouts.

The SIGKILL-and-resume test runs on both backends from one body (`tests/trainer/test_trainer.py`, parametrized by
`backend`); the ranks here run the same worker as the torch ranks test (`tests/support/ranks.py`), with a
megatron `RankLayout`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from actors.trainer.checkpoints import checkpoint_files
from infra.stack import StackState
from storage.filestore import FileStore
from tests.support.ranks import TOLERANCE, RankLayout, max_diff, pull, run_ranks
from tests.support.runs import DEMO_DEADLINE_S, PLUMBING_STEPS, run_plumbing, shared_stack_config


@pytest.mark.slow
@pytest.mark.timeout(DEMO_DEADLINE_S + 60)
def test_the_demo_runs_through_leeway_run_on_the_megatron_backend(
    tmp_path: Path, stack: StackState, cleanup: list[subprocess.Popen[bytes]]
) -> None:
    """`trainer.backend: megatron` through `leeway run`: the trainer takes every step on megatron, publishes each
    version (converted to the HF names) the generators pull and apply, checkpoints and exits 0 (`run_plumbing`).
    A plumbing run of `PLUMBING_STEPS` steps: that a megatron step is the torch backend's step is proven by
    `tests/trainer/test_megatron.py::test_megatron_logprobs_and_one_step_match_the_torch_backend` (GPT-2, the
    demo's family), that its ranks take one rank's steps by the test below, and that the torch backend learns the
    demo by `tests/launcher/test_run.py::test_short_demo_learns_within_the_cap`."""
    cfg = shared_stack_config(tmp_path, stack, "run-megatron", PLUMBING_STEPS, "trainer.backend=megatron")
    assert cfg.trainer.backend == "megatron"
    run_plumbing(cfg, tmp_path, cleanup)
    assert "backend: megatron" in (cfg.run.run_dir / "config.yaml").read_text(), "the config every role ran with"


# ---- ranks: the ranks worker (RankGroup publish and checkpoint) on the megatron backend ----------------------


def _megatron(tp_size: int = 1, pp_size: int = 1) -> RankLayout:
    return RankLayout("megatron", tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size)


@pytest.mark.slow
def test_megatron_ranks_match_one_rank_publish_sharded_and_resume_across_layouts(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path / "store"))
    one = run_ranks(tmp_path, 1, "one", layout=_megatron())
    ref1, ref2 = pull(store, "one", 1), pull(store, "one", 2, after=1)
    assert max_diff(ref1, ref2) > 100 * TOLERANCE, "the second step must move the weights measurably"
    for name, nproc, tp_size, pp_size in (("tp2", 2, 2, 1), ("dp2", 2, 1, 1), ("pp2", 2, 1, 2)):
        got = run_ranks(tmp_path, nproc, name, layout=_megatron(tp_size, pp_size))
        for a, b in zip(one, got, strict=True):  # loss, grad norm, entropy
            assert a[:3] == pytest.approx(b[:3], rel=TOLERANCE, abs=TOLERANCE), name
        assert max_diff(pull(store, name, 2, after=1), ref2) < TOLERANCE, name
    # the TP=2 checkpoint: each rank wrote its rows of the full tensors; one rank resumes it
    ckpt = set(checkpoint_files(store, "tp2", 1))  # names in the manifest (under its attempt)
    assert {"index.json", "rank-00000/model.safetensors", "rank-00001/model.safetensors"} <= ckpt
    resumed = run_ranks(tmp_path, 1, "tp2-on-one", load_run="tp2", layout=_megatron())
    assert resumed[0][:3] == pytest.approx(one[1][:3], rel=TOLERANCE, abs=TOLERANCE)
    assert max_diff(pull(store, "tp2-on-one", 2), ref2) < TOLERANCE
