"""`leeway run configs/coding.yaml`, the whole pipeline with sandboxes: a sandbox killed from outside mid-episode
is `sandbox_lost` and its episode is run again (the generator reports both), every published sample carries a
typed status, and a generator killed with SIGKILL leaves no sandbox process behind. The CPU demo model solves
none of the tasks, so the trainer never steps here: the run is stopped once this is seen."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

from infra.stack import StackState
from pipeline.config import load_config
from pipeline.sandbox.uids import UID_BASE, UID_COUNT
from tests.support.runs import COMMON, REPO, ROLE_STOP_DEADLINE_S, leeway_argv, log_tails

DEADLINE_S = 600.0
"""Generous bound on each wait below (each ends as soon as what it waits for is there)."""


def _generator_pid(run_dir: Path) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"generator" in cmdline and any(str(run_dir).encode() in part for part in cmdline):
            return int(entry)
    return None


def _sandbox_processes() -> list[int]:
    """Live processes of any leased sandbox uid (the generator's sandboxes are the only ones during this test)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        uid = int(fields.get("Uid", "-1").split()[0])
        if UID_BASE <= uid < UID_BASE + UID_COUNT and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(entry))
    return found


def _outer_bwraps(generator_pid: int) -> list[int]:
    """The sandboxes' outer bwrap processes: the generator's children running bwrap."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        name, ppid = stat[stat.index("(") + 1 : stat.rindex(")")], int(stat[stat.rindex(")") + 2 :].split()[1])
        if name == "bwrap" and ppid == generator_pid:
            out.append(int(entry))
    return out


def _wait(what: str, check, run_dir: Path) -> object:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not seen within {DEADLINE_S:g} s: {what}\n{log_tails(run_dir)}")


def test_a_coding_run_reruns_a_lost_sandbox_and_a_killed_generator_leaves_no_sandbox(
    tmp_path: Path, stack: StackState, cleanup: list[subprocess.Popen[bytes]]
) -> None:
    run_dir = tmp_path / "run"
    sets = [
        *COMMON,
        f"run.name=coding-{uuid.uuid4().hex[:8]}",
        f"run.dir={run_dir}",
        f"nats.stack_dir={stack.dir}",
        "trainer.queue_wait_timeout_s=3600",
        "engine.sampling.max_new_tokens=24",
    ]
    cfg = load_config(str(REPO / "configs" / "coding.yaml"), sets)
    config_path = tmp_path / "coding.yaml"
    config_path.write_text(cfg.to_yaml())
    proc = subprocess.Popen(
        leeway_argv("run", str(config_path), "--no-live", "--fresh"),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    cleanup.append(proc)
    gen_log = run_dir / "logs" / "gen-0.log"
    text = lambda: gen_log.read_text(errors="replace") if gen_log.exists() else ""  # noqa: E731
    generator = _wait("the generator process", lambda: _generator_pid(run_dir), run_dir)
    assert isinstance(generator, int)
    # kill sandboxes from outside until an episode meets a dead one (a kill between its tests and its close
    # changes nothing: that episode was already scored)
    while "sandbox_lost" not in text():
        victims = _wait("a live sandbox", lambda: _outer_bwraps(generator), run_dir)
        assert isinstance(victims, list)
        victim = victims[0]
        os.killpg(victim, signal.SIGKILL)
        _wait("the killed sandbox gone", lambda v=victim: v not in _outer_bwraps(generator), run_dir)
    # its episode was run again, and the generator's report says so, with the typed failures of what it published
    report = _wait(
        "a report line with re-run episodes",
        lambda: [m for m in re.finditer(r"failures: ([^;]*); (\d+) episodes re-run", text()) if int(m[2]) >= 1],
        run_dir,
    )
    assert isinstance(report, list)
    published = re.findall(r"(\d+) groups published", text())
    assert published and int(published[-1]) >= 1, log_tails(run_dir)
    # SIGKILL the generator: its sandboxes die with it
    assert _wait("sandboxes running", lambda: _sandbox_processes(), run_dir)
    os.kill(generator, signal.SIGKILL)
    _wait("no sandbox process left", lambda: not _sandbox_processes() or None, run_dir)
    assert _sandbox_processes() == []
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=ROLE_STOP_DEADLINE_S)
