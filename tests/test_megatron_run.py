"""`trainer.backend: megatron` through the real stack: the demo learns, and a SIGKILLed trainer resumes.

Both reuse the torch backend's integration tests (`tests/test_run.py`, `tests/test_trainer.py`) with
the backend switched, so the two backends answer to the same checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import test_run
import test_trainer
from test_run import DEMO_DEADLINE_S, ROLE_STOP_DEADLINE_S, _shared_stack_config, run_demo_to_target

from infra.stack import StackState
from pipeline.config import LeewayConfig
from storage.filestore import FileStore

REPO = Path(__file__).resolve().parents[1]
cleanup = test_run.cleanup
"""`tests/test_run.py`'s fixture: processes a test started, killed with their groups if it fails half-way."""
DEMO_STEPS = 300
"""The demo's own 250 steps plus the fleet test's margin: the asynchronous demo usually crosses the target
between steps 160 and 210, but one clean-clone run on the megatron backend peaked at 0.783 by step 250.
The test stops the run at the target, so the margin costs nothing when it is not needed."""
TARGET_REWARD = 0.8
WINDOW = 5
"""The reward is a mean over this many steps (the live view's and the README's window)."""


@pytest.mark.slow
@pytest.mark.timeout(DEMO_DEADLINE_S + ROLE_STOP_DEADLINE_S + 60)
def test_the_demo_learns_with_the_megatron_backend(
    tmp_path: Path, stack: StackState, cleanup: list[subprocess.Popen[bytes]]
) -> None:
    """The demo on the megatron backend reaches the target (the run is stopped once it has)."""
    cfg = _shared_stack_config(tmp_path, stack, "run-megatron", DEMO_STEPS, "trainer.backend=megatron")
    assert cfg.trainer.backend == "megatron"
    run_demo_to_target(cfg, tmp_path, cleanup, TARGET_REWARD, WINDOW)
    assert "backend: megatron" in (cfg.run.run_dir / "config.yaml").read_text(), "the config every role ran with"


@pytest.mark.slow
def test_resume_after_sigkills_trains_every_group_exactly_once_with_megatron(
    stack: StackState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tests/test_trainer.py`'s SIGKILL-and-resume test, every trainer process on the megatron backend."""
    plain_cfg = test_trainer._cfg

    def megatron_cfg(stack: StackState, tmp_path: Path, *overrides: str) -> LeewayConfig:
        return plain_cfg(stack, tmp_path, *overrides, "trainer.backend=megatron")

    monkeypatch.setattr(test_trainer, "_cfg", megatron_cfg)
    test_trainer.test_resume_after_sigkills_trains_every_group_exactly_once(stack, tmp_path)
    (config,) = tmp_path.glob("trainer.yaml")
    assert "backend: megatron" in config.read_text()


# ---- ranks: `tests/test_trainer_ranks.py`'s worker (RankGroup publish and checkpoint) on the megatron backend ---

RANKS_WORKER = REPO / "tests" / "test_megatron_run.py"
TP_ENV, PP_ENV = "LEEWAY_TEST_MEGATRON_TP", "LEEWAY_TEST_MEGATRON_PP"
"""The worker's `megatron.tensor_parallel_size` and `pipeline_parallel_size` (data parallel: the rest)."""


def _megatron_ranks(
    tmp_path: Path, nproc: int, tp_size: int, run: str, load_run: str | None = None, pp_size: int = 1
) -> Any:
    """`test_trainer_ranks._run_ranks`, each rank running this file's worker (the same `_worker`)."""
    import test_trainer_ranks

    plain = dict(os.environ)
    os.environ[TP_ENV], os.environ[PP_ENV] = str(tp_size), str(pp_size)
    try:
        original = test_trainer_ranks.__file__
        test_trainer_ranks.__file__ = str(RANKS_WORKER)  # `_run_ranks` starts `sys.executable __file__ ...`
        return test_trainer_ranks._run_ranks(tmp_path, nproc, run, load_run)
    finally:
        test_trainer_ranks.__file__ = original
        os.environ.clear()
        os.environ.update(plain)


@pytest.mark.slow
def test_megatron_ranks_match_one_rank_publish_sharded_and_resume_across_layouts(tmp_path: Path) -> None:
    import test_trainer_ranks as ranks

    store = FileStore(str(tmp_path / "store"))
    one = _megatron_ranks(tmp_path, 1, 1, "one")
    ref1, ref2 = ranks._pull(store, "one", 1), ranks._pull(store, "one", 2, after=1)
    assert ranks._max_diff(ref1, ref2) > 100 * ranks.TOLERANCE, "the second step must move the weights measurably"
    for name, nproc, tp_size, pp_size in (("tp2", 2, 2, 1), ("dp2", 2, 1, 1), ("pp2", 2, 1, 2)):
        got = _megatron_ranks(tmp_path, nproc, tp_size, name, pp_size=pp_size)
        for a, b in zip(one, got, strict=True):  # loss, grad norm, entropy
            assert a[:3] == pytest.approx(b[:3], rel=ranks.TOLERANCE, abs=ranks.TOLERANCE), name
        assert ranks._max_diff(ranks._pull(store, name, 2, after=1), ref2) < ranks.TOLERANCE, name
    # the TP=2 checkpoint: each rank wrote its rows of the full tensors; one rank resumes it
    ckpt = {k.rsplit("checkpoints/v00000001/", 1)[1] for k in store.list("tp2/checkpoints/")}
    assert {"index.json", "rank-00000/model.safetensors", "rank-00001/model.safetensors"} <= ckpt
    resumed = _megatron_ranks(tmp_path, 1, 1, "tp2-on-one", load_run="tp2")
    assert resumed[0][:3] == pytest.approx(one[1][:3], rel=ranks.TOLERANCE, abs=ranks.TOLERANCE)
    assert ranks._max_diff(ranks._pull(store, "tp2-on-one", 2), ref2) < ranks.TOLERANCE


def _with_megatron(cfg: LeewayConfig) -> LeewayConfig:
    """The torch ranks test's config on the megatron backend, TP and PP sizes from the environment."""
    return cfg.model_copy(
        update={
            "trainer": cfg.trainer.model_copy(update={"backend": "megatron"}),
            "megatron": cfg.megatron.model_copy(
                update={
                    "tensor_parallel_size": int(os.environ[TP_ENV]),
                    "pipeline_parallel_size": int(os.environ[PP_ENV]),
                }
            ),
        }
    )


if __name__ == "__main__":  # a rank of `_megatron_ranks`: test_trainer_ranks's worker, megatron config
    import test_trainer_ranks

    torch_cfg = test_trainer_ranks._cfg
    test_trainer_ranks._cfg = lambda: _with_megatron(torch_cfg())
    store_root, run, load_run, out = sys.argv[1:5]
    test_trainer_ranks._worker(store_root, run, None if load_run == "-" else load_run, out)
