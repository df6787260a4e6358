"""A trainer refuses a task whose verifier fails the self-check: before it connects or trains, with the reason
and the item, and an exit status that says it was refused (2), not a traceback."""

from __future__ import annotations

from pathlib import Path

from tests.support.builders import REPO, spawn_trainer


def test_a_trainer_refuses_a_task_that_rewards_garbage_naming_the_item(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    proc = spawn_trainer(
        REPO / "configs" / "reasoning-gym.yaml",
        log,
        "--set",
        "task.args.dataset=game_of_life_halting",
        "--set",
        "task.args.config={}",
        "--set",
        f"run.dir={tmp_path / 'run'}",
    )
    assert proc.wait(timeout=240) == 2
    text = log.read_text()
    assert "task 'reasoning_gym' failed its verifier self-check on item 'game_of_life_halting-train-s0-" in text
    assert "scores 1.0, the maximum: a reward hack" in text and "Traceback" not in text
