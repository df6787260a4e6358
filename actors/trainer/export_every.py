"""`trainer.export_every`: every N-th published version exported as a Hugging Face checkpoint, beside the run.

    LiveSession._publish(V) ──published(V)──► queue ──one worker thread──► `leeway export CONFIG --version V
                                                                             --to <run.dir>/exports/v<V>/`

The step never waits: `published` only enqueues, and the export runs as its own process (`actors/tools/export.py`:
its own store client with the store's retries, its own interpreter, so neither the GIL nor its memory touch the
trainer's step). Exports run one at a time, oldest first. A failed export (the version pruned by retention before
its turn, the store away past its retries) is logged as a WARNING with the end of its output and never stops the
trainer; `<run.dir>/logs/export.log` holds every export's output. `close` (the end of the session) waits for the
queued exports, so the last due version is on disk when the trainer exits. Version 0 (the initial weights) is
never exported here.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import threading
from pathlib import Path

from infra.files import write_private
from pipeline.config import LeewayConfig

log = logging.getLogger(__name__)

EXPORTS_DIR = "exports"
"""Under `run.dir`: one checkpoint directory per exported version, `v<V:08d>`."""
OUTPUT_TAIL_CHARS = 2000


def export_dir(run_dir: Path, version: int) -> Path:
    return run_dir / EXPORTS_DIR / f"v{version:08d}"


class PeriodicExports:
    """The session's exports of every `trainer.export_every`-th version (a no-op when it is 0)."""

    def __init__(self, cfg: LeewayConfig) -> None:
        self.cfg = cfg
        self.every = cfg.trainer.export_every
        self.exported: list[int] = []
        """Versions exported so far (in order), for the logs and tests."""
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def published(self, version: int) -> None:
        """Called after `version` is in the store: queue its export when it is due."""
        if self.every < 1 or version == 0 or version % self.every:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="trainer-export", daemon=True)
            self._thread.start()
        self._queue.put(version)

    def close(self) -> None:
        """Wait for the queued exports to finish."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join()
        self._thread = None

    def _work(self) -> None:
        run_dir = self.cfg.run.run_dir
        config_path = run_dir / EXPORTS_DIR / ".config.yaml"
        while (version := self._queue.get()) is not None:
            try:
                config_path.parent.mkdir(parents=True, exist_ok=True)
                write_private(config_path, self.cfg.to_yaml())  # it may carry a NATS token or credential paths
                self._export(config_path, version, export_dir(run_dir, version))
            except Exception:  # a background loop we own: log, keep the trainer going
                log.exception("trainer.export_every: exporting version %d failed", version)

    def _export(self, config_path: Path, version: int, out: Path) -> None:
        argv = [sys.executable, "-m", "actors.cli", "export", str(config_path), "--version", str(version)]
        log_path = self.cfg.run.run_dir / "logs" / "export.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([*argv, "--to", str(out)], capture_output=True, text=True, check=False)
        with log_path.open("a") as handle:
            handle.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            log.warning(
                "trainer.export_every: leeway export of version %d exited %d: %s",
                version,
                proc.returncode,
                (proc.stdout + proc.stderr)[-OUTPUT_TAIL_CHARS:],
            )
            return
        self.exported.append(version)
        log.info("trainer.export_every: version %d exported to %s", version, out)
