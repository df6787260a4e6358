"""`leeway run` on the demo, for the tests that run it end to end (`test_run`, `test_fleet`, the ranks and
megatron tests): small bounded configs, a run to a reward target, and what the run's stream and prompt queue
hold afterwards (to account for every admitted prompt)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from actors.launcher.run import read_metrics
from actors.servers import open_run_store, resolve_servers
from actors.trainer.checkpoints import load_latest_checkpoint
from infra.process import start_ticks
from infra.stack import StackState
from pipeline.config import LeewayConfig, load_config
from pipeline.wire.jetstream import connect
from pipeline.wire.names import RunNames
from pipeline.wire.prompt_queue import Prompt
from pipeline.wire.replay import ReplayReader, ReplaySelection

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
COMMON = ["stream.max_bytes=67108864", "trainer.queue_wait_timeout_s=120", "logging.level=INFO"]
"""Small, bounded versions of the demo (2 CI cores): a stream that reserves little, INFO logs to read."""
ROLE_STOP_DEADLINE_S = 120.0
"""Generous bound on a role's (or a whole run's) clean stop after SIGTERM; waits end as soon as it exited."""
DEMO_DEADLINE_S = 540.0
"""Generous bound on the short demo (about 40 s on 2 cores); the test ends when the run does."""


def leeway_argv(*args: str) -> list[str]:
    """`leeway ARGS...` as this interpreter runs it."""
    return [sys.executable, "-m", "actors.cli", *args]


def run_records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's `metrics.jsonl` records, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def log_tails(run_dir: Path) -> str:
    """The last 20 lines of every role's log of the run (for a failure message)."""
    out = []
    for log in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []:
        out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:]))
    return "\n".join(out)


def alive(pid: int, ticks: int | None = None) -> bool:
    """Running and not a zombie (and, given `ticks`, still the same process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        return False
    return ticks is None or start_ticks(pid) == ticks


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (e.g. a run directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if text in cmdline and alive(int(entry.name)):
            found.append(f"{entry.name}: {cmdline}")
    return found


async def recorded_groups(cfg: LeewayConfig, from_seq: int | None = None) -> list[Any]:
    """Every group in the run's trajectory stream (from `from_seq`), read back through a replay."""
    endpoints = resolve_servers(cfg)
    nc = await connect(endpoints.nats_url, name="test-run-replay")
    try:
        js = nc.jetstream()
        reader = await ReplayReader.open(
            js,
            RunNames.for_run(cfg.run.name),
            cfg.stream,
            open_run_store(cfg, endpoints),
            ReplaySelection(from_seq=from_seq),
        )
        groups = []
        while not reader.done:
            groups += [d.group for d in await reader.fetch(max_groups=64, timeout_s=1.0)]
        await reader.close()
        return groups
    finally:
        await nc.close()


async def queued_prompt_ids(cfg: LeewayConfig) -> tuple[int, set[str]]:
    """(prompts ever admitted, ids still in the prompt work queue) of the run."""
    names = RunNames.for_run(cfg.run.name)
    nc = await connect(resolve_servers(cfg).nats_url, name="test-run-prompts")
    try:
        js = nc.jetstream()
        info = await js.stream_info(names.prompt_stream)
        queued = set()
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await js.get_msg(names.prompt_stream, seq)
            except Exception:  # acked (deleted from the work queue) meanwhile
                continue
            queued.add(Prompt.from_json(msg.data).prompt_id)
        return int(info.state.last_seq), queued
    finally:
        await nc.close()


def unconsumed_from(cfg: LeewayConfig) -> int:
    """First trajectory-stream sequence a resumed trainer reads again: its newest checkpoint's watermark + 1.

    Not the consumer's ack floor: a group that will not train is acked as soon as it is decided, but
    recorded only at the commit of its step; a stop that abandons the step leaves it acked, unrecorded
    and after the watermark, where a resume decides it again (`actors/trainer/loop.py`)."""
    latest = load_latest_checkpoint(open_run_store(cfg), cfg.run.name)
    return (latest[0].consumed_seq if latest is not None else 0) + 1


def shared_stack_config(tmp_path: Path, stack: StackState, name: str, steps: int, *extra: str) -> LeewayConfig:
    """The demo as run `name` on the session stack, `steps` steps, in `tmp_path/run`."""
    return load_config(
        str(DEMO),
        [
            *COMMON,
            f"run.name={name}",
            f"run.dir={tmp_path / 'run'}",
            f"nats.stack_dir={stack.dir}",
            f"trainer.max_steps={steps}",
            *extra,
        ],
    )


def best_window_mean(records: list[dict[str, Any]], window: int) -> float:
    """The best mean unfiltered reward over `window` consecutive steps (0 before there are that many)."""
    rewards = [float(r["reward/unfiltered_mean"]) for r in records]
    return max((statistics.mean(rewards[i : i + window]) for i in range(len(rewards) - window + 1)), default=0.0)


def run_to_end(config_path: Path, run_dir: Path, procs: list[subprocess.Popen[bytes]]) -> str:
    """`leeway run CONFIG --no-live --fresh` until it ends by itself (its own session, in `procs` so a test that
    fails kills its group); asserts exit 0, showing the output and every role's log tail otherwise; the output."""
    proc = subprocess.Popen(
        leeway_argv("run", str(config_path), "--no-live", "--fresh"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    procs.append(proc)
    out, _ = proc.communicate(timeout=DEMO_DEADLINE_S)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text + log_tails(run_dir)
    return text


def run_demo_to_target(
    cfg: LeewayConfig, tmp_path: Path, procs: list[subprocess.Popen[bytes]], target: float, window: int
) -> list[dict[str, Any]]:
    """`leeway run` with `cfg` until the `window`-step mean reward reaches `target`, then Ctrl-C; the records.

    Past the target nearly every group agrees and is filtered, so the steps left to `trainer.max_steps`
    are the slowest of a run and prove nothing more: a learning test ends on the event. Fails, with the
    rewards, when the run ends at its `trainer.max_steps` without reaching the target."""
    config_path = tmp_path / "demo.yaml"
    config_path.write_text(cfg.to_yaml())
    output, run_dir = tmp_path / "run.out", cfg.run.run_dir
    with output.open("wb") as sink:  # a file, not a pipe: nobody reads the output while the run goes on
        proc = subprocess.Popen(
            leeway_argv("run", str(config_path), "--no-live", "--fresh"),
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    procs.append(proc)
    deadline = time.monotonic() + DEMO_DEADLINE_S
    while True:
        records = read_metrics(run_dir / "metrics.jsonl", 0)[0]
        if best_window_mean(records, window) >= target or proc.poll() is not None:
            break
        assert time.monotonic() < deadline, f"reward {target} not reached within {DEMO_DEADLINE_S} s"
        time.sleep(0.2)
    reached = best_window_mean(records, window) >= target
    if reached and proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # the trainer finishes or abandons its step and checkpoints
    proc.wait(timeout=ROLE_STOP_DEADLINE_S)
    assert proc.returncode in (0, 130), output.read_text(errors="replace") + log_tails(run_dir)
    records = run_records(run_dir)
    rewards = [round(float(r["reward/unfiltered_mean"]), 2) for r in records]
    assert reached, f"best {window}-step reward {best_window_mean(records, window):.3f}: {rewards}"
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert len(records) <= cfg.trainer.max_steps
    assert statistics.mean(rewards[:window]) < 0.3, "the demo must start near chance for the rise to mean anything"
    assert "checkpoint written" in (run_dir / "logs" / "trainer.log").read_text(), "the trainer stopped cleanly"
    return records
