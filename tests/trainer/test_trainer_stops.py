"""A run that cannot learn stops on purpose, not with a crash: when no trainable group arrives for
`trainer.queue_wait_timeout_s` (every group that does arrive scores the same for each sample: no learning
signal), `leeway trainer` logs why as its last line, with no traceback, and exits 2, as it does for a task that
fails its self-check. (Its final checkpoint is written as at any stop: `test_trainer_survival.py`.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

from infra.role_logs import STOP_EXIT, stop_reason
from infra.stack import StackState
from tests.support.builders import make_group, publish_groups, spawn_trainer, trainer_cfg

STOP_DEADLINE_S = 240.0
"""Generous bound on the trainer's start (imports, model, servers) and its 2 s wait; it ends as soon as it stops."""


def test_a_run_without_a_learning_signal_stops_with_its_reason_and_no_traceback(
    stack: StackState, tmp_path: Path
) -> None:
    cfg = trainer_cfg(stack, tmp_path, "trainer.queue_wait_timeout_s=2", "logging.level=INFO")
    asyncio.run(publish_groups(cfg, [make_group(g, rewards=(1.0, 1.0)) for g in ("a", "b", "c")]))
    config = tmp_path / "config.yaml"
    config.write_text(cfg.to_yaml())
    log = tmp_path / "trainer.log"
    assert spawn_trainer(config, log).wait(timeout=STOP_DEADLINE_S) == STOP_EXIT, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text, text
    assert text.rstrip().splitlines()[-1].endswith(f"trainer stopped: {stop_reason(log, 'trainer')}")
    assert stop_reason(log, "trainer") == (
        "no trainable group for 2 s (trainer.queue_wait_timeout_s); 3 groups arrived that cannot train: "
        "3 no_disagreement (every sample of the group scored the same: no learning signal, as when a policy "
        "solves none of its tasks)"
    )
