"""`leeway run --resume`: a run with a private stack stops, then continues from its checkpoint on the same data;
`--fresh` never deletes trained steps without `--discard-checkpoints`; `--resume` with nothing to resume says so."""

from __future__ import annotations

import subprocess
from pathlib import Path

import orjson
import pytest

from actors.launcher.run import MetricsTail
from actors.launcher.run_dir import NothingToResume, RunDirInUse, prepare_run_dir
from infra.stack import load_state, start_stack, stop_stack
from pipeline.config import load_config
from tests.support.runs import COMMON, DEMO, DEMO_DEADLINE_S, REPO, leeway_argv, log_tails

FIRST_STEPS, MORE_STEPS = 12, 20


def _run(config_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        leeway_argv("run", str(config_path), "--no-live", *flags),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=DEMO_DEADLINE_S,
    )


def _steps_and_versions(run_dir: Path) -> list[tuple[int, int]]:
    records = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines() if line]
    return [(int(r["step"]), int(r["version"])) for r in records]


def test_resume_with_nothing_there_and_fresh_and_resume_together_are_refused(tmp_path: Path) -> None:
    cfg = load_config(str(DEMO), [*COMMON, f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(NothingToResume, match="holds no earlier run"):
        prepare_run_dir(cfg, fresh=False, resume=True)
    with pytest.raises(RunDirInUse, match="exclude each other"):
        prepare_run_dir(cfg, fresh=True, resume=True)


@pytest.mark.timeout(120)
def test_resume_refuses_a_run_whose_private_stack_still_runs(tmp_path: Path) -> None:
    cfg = load_config(str(DEMO), [*COMMON, f"run.dir={tmp_path / 'run'}"])
    run_dir = prepare_run_dir(cfg, fresh=False)
    start_stack(run_dir / "stack")  # the live `leeway run` of this directory
    try:
        with pytest.raises(RunDirInUse, match="a `leeway run` is using"):
            prepare_run_dir(cfg, fresh=False, resume=True)
    finally:
        stop_stack(run_dir / "stack", timeout_s=1.0)
    assert prepare_run_dir(cfg, fresh=False, resume=True) == run_dir  # stopped: it can be resumed


@pytest.mark.slow
@pytest.mark.timeout(DEMO_DEADLINE_S * 3)
def test_a_stopped_run_resumes_on_its_private_stack_and_fresh_will_not_delete_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(
        str(DEMO),
        [
            *COMMON,
            f"run.dir={run_dir}",
            f"nats.stack_dir={tmp_path / 'no-shared-stack'}",  # so the run starts a private one in run.dir
            f"trainer.max_steps={FIRST_STEPS}",
            "trainer.checkpoint_every=5",
        ],
    )
    config_path = tmp_path / "demo.yaml"
    config_path.write_text(cfg.to_yaml())

    empty = _run(config_path, "--resume")
    assert empty.returncode == 2 and "holds no earlier run" in empty.stderr, empty.stderr

    first = _run(config_path)
    assert first.returncode == 0, first.stdout + first.stderr + log_tails(run_dir)
    assert [s for s, _ in _steps_and_versions(run_dir)] == list(range(1, FIRST_STEPS + 1))
    stack_state = load_state(run_dir / "stack")
    assert stack_state is not None and not stack_state.processes, "the private stack is stopped at the end"

    refused = _run(config_path, "--fresh")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"{FIRST_STEPS} trained steps" in refused.stderr and "--resume" in refused.stderr
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "stack").is_dir()  # nothing deleted

    resumed = _run(config_path, "--resume", "--set", f"trainer.max_steps={MORE_STEPS}")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + log_tails(run_dir)
    steps_versions = _steps_and_versions(run_dir)
    assert [s for s, _ in steps_versions] == list(range(1, MORE_STEPS + 1))  # one history, continued
    versions = [v for _, v in steps_versions]
    assert all(b > a for a, b in zip(versions, versions[1:], strict=False)), versions
    trainer_log = (run_dir / "logs" / "trainer.log").read_text(errors="replace")
    assert f"resumed step {FIRST_STEPS}" in trainer_log

    discarded = _run(config_path, "--fresh", "--discard-checkpoints", "--set", "trainer.max_steps=2")
    assert discarded.returncode == 0, discarded.stdout + discarded.stderr + log_tails(run_dir)
    assert [s for s, _ in _steps_and_versions(run_dir)] == [1, 2]  # a new run from scratch


def test_the_live_view_follows_metrics_across_a_resumes_roll_back(tmp_path: Path) -> None:
    """A resumed trainer replaces metrics.jsonl without the steps its checkpoint lost: the tail starts over."""
    path = tmp_path / "metrics.jsonl"
    records: list[dict[str, object]] = []
    tail = MetricsTail(path, records)
    tail.poll()  # no file yet
    path.write_bytes(b"".join(orjson.dumps({"step": s}) + b"\n" for s in (1, 2, 3)) + b'{"step": 4, "tor')
    tail.poll()
    assert [r["step"] for r in records] == [1, 2, 3]  # the torn line of a killed trainer waits
    rolled = tmp_path / "metrics.tmp"
    rolled.write_bytes(b"".join(orjson.dumps({"step": s}) + b"\n" for s in (1, 2)))
    rolled.replace(path)  # what `roll_back_metrics` does: the checkpoint was at step 2
    tail.poll()
    assert [r["step"] for r in records] == [1, 2]
    with path.open("ab") as handle:
        handle.write(orjson.dumps({"step": 3}) + b"\n")
    tail.poll()
    assert [r["step"] for r in records] == [1, 2, 3]
