"""Role logs rotate by size inside the role (`infra/role_logs.py`): records and raw output alike, nothing lost at a
rollover, at most `backups` old files kept; a role started without a log path logs to stderr as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from infra.process import spawn_child
from infra.role_logs import LOG_FILE_ENV

LINES = 1500
MAX_BYTES = 4000
BACKUPS = 3
CHILD = f"""
import logging, sys
from infra.role_logs import configure_role_logging
configure_role_logging("INFO", "%(message)s", max_bytes={MAX_BYTES}, backups={BACKUPS})
log = logging.getLogger("role")
for i in range({LINES}):
    if i % 10 == 9:
        print(f"raw line {{i:05d}}", file=sys.stderr, flush=True)  # what a traceback or a C library writes
    else:
        log.info("record line %05d", i)
"""
REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 120.0


def test_a_role_log_rotates_by_size_keeping_every_recent_line_in_order(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "role.log"
    child = spawn_child([sys.executable, "-c", CHILD], log_path=log, env={**_env(), LOG_FILE_ENV: str(log)}, cwd=REPO)
    assert child.wait(timeout=DEADLINE_S) == 0
    files = [log.with_name(f"role.log.{n}") for n in range(BACKUPS, 0, -1)] + [log]  # oldest first
    assert all(f.exists() for f in files) and not log.with_name(f"role.log.{BACKUPS + 1}").exists()
    assert all(f.stat().st_size <= MAX_BYTES + 64 for f in files)  # a raw line may follow the last checked record
    numbers = [int(line.split()[-1]) for f in files for line in f.read_text().splitlines()]
    assert numbers == list(range(numbers[0], LINES))  # a contiguous tail, in order: nothing lost at a rollover
    assert numbers[0] > 0  # older lines went with the oldest file
    assert any(
        line.startswith("raw line") for line in log.read_text().splitlines() + files[-2].read_text().splitlines()
    )


def test_without_a_log_path_records_go_to_stderr(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert done.returncode == 0
    assert len(done.stderr.splitlines()) == LINES and not list(tmp_path.iterdir())


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != LOG_FILE_ENV}
