"""How `leeway run` ends when its trainer stops the run on purpose (exit 2 and a `log_stop` line: a task that
fails its self-check, no trainable group for `trainer.queue_wait_timeout_s`): the summary is written, the reason
is the last line, exit 2, and no log tail or traceback; any other trainer exit still shows the log's end.
A run without matplotlib (the `plots` extra) ends with its summary and one line naming the extra.
`run_pipeline` is replaced by the outcome it would return (the trainer's own stop is
`tests/trainer/test_trainer_stops.py`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pytest

from actors.launcher import run
from actors.launcher.run import RunOutcome
from infra.role_logs import STOP_EXIT, log_stop
from pipeline.config import load_config
from tests.support.runs import COMMON, DEMO

REASON = "no trainable group for 180 s (trainer.queue_wait_timeout_s); 12 groups arrived that cannot train"
ARGS = argparse.Namespace(generators=1, no_live=True, fresh=False, resume=False, discard_checkpoints=False)


def _trainer_log(path: Path, stopped: bool) -> Path:
    """A trainer log as `leeway trainer` writes it: a few lines, then its stop line or a traceback."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log = logging.getLogger("tests.trainer-log")
    log.addHandler(handler)
    try:
        log.error("waiting for trajectory groups: 0/4 trainable, 7 dropped so far")
        if stopped:
            log_stop(log, "trainer", REASON)
        else:
            log.error("trainer exiting with an error\nTraceback (most recent call last):\nRuntimeError: boom")
    finally:
        log.removeHandler(handler)
        handler.close()
    return path


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainer_rc: int, stopped: bool) -> int:
    cfg = load_config(str(DEMO), [*COMMON, f"run.dir={tmp_path / 'run'}"])
    outcome = RunOutcome(cfg.run.run_dir, [], trainer_rc, False, _trainer_log(tmp_path / "trainer.log", stopped))
    monkeypatch.setattr(run, "run_pipeline", lambda *args, **kwargs: outcome)
    return run.main(cfg, ARGS)


def test_a_run_the_trainer_stopped_ends_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(tmp_path, monkeypatch, STOP_EXIT, stopped=True) == 2
    out, err = capsys.readouterr()
    assert "summary" in out and (tmp_path / "run" / "summary.md").is_file()
    assert err.splitlines()[-1] == f"leeway run: the trainer stopped the run: {REASON}"
    assert "waiting for trajectory groups" not in err and "exited with" not in err


def test_a_trainer_that_failed_still_shows_the_end_of_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(tmp_path, monkeypatch, 1, stopped=False) == 1
    err = capsys.readouterr().err
    assert "leeway run: the trainer exited with 1; the end of" in err and err.rstrip().endswith("RuntimeError: boom")


def test_a_run_without_matplotlib_ends_with_its_summary_and_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, as where it is not installed
    cfg = load_config(str(DEMO), [*COMMON, f"run.dir={tmp_path / 'run'}"])
    record = {"step": 1, "version": 1, "time_s": 2.0, "reward/unfiltered_mean": 0.1}
    outcome = RunOutcome(cfg.run.run_dir, [record], 0, False, None)
    monkeypatch.setattr(run, "run_pipeline", lambda *args, **kwargs: outcome)
    assert run.main(cfg, ARGS) == 0
    out = capsys.readouterr().out
    assert "leeway run: no report.png: plots need matplotlib: pip install 'leeway[plots]'" in out
    assert (tmp_path / "run" / "summary.md").is_file() and not (tmp_path / "run" / "report.png").exists()
