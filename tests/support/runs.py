"""`leeway run` on the demo, for the tests that run it end to end (`test_run`, `test_fleet`, the ranks and
megatron tests): small bounded configs, a run to its end, a plumbing run's checks, and what the run's stream and
prompt queue hold afterwards (to account for every admitted prompt)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

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
"""Generous bound on a short `leeway run` of the demo (about 40 s on 2 cores); the test ends when the run does."""


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


def children_of(pid: int) -> dict[int, int | None]:
    """pid -> start ticks of every direct child of `pid` right now."""
    out: dict[int, int | None] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out[int(entry.name)] = start_ticks(int(entry.name))
    return out


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


PLUMBING_STEPS = 5
"""A plumbing run's steps: past the demo's staleness cap (2), so the last steps can only train groups generated
with weights this run's trainer published (and a generator pulled and applied)."""


def run_plumbing(cfg: LeewayConfig, tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> list[dict[str, Any]]:
    """`leeway run` with `cfg` (`trainer.max_steps` steps, a few) to its end, and what it must show whatever it
    learned: exit 0 (`run_to_end`), every step committed once, one version published per step, each trained
    group trained once, recorded in the stream and generated within the cap, some of them with weights this
    trainer published, and the final checkpoint written; the records.

    Learning is proven elsewhere: `tests/launcher/test_run.py::test_short_demo_learns_within_the_cap` for the demo
    on one torch process, and exact-equivalence tests for what a variant changes (ranks, backends)."""
    steps = cfg.trainer.max_steps
    config_path = tmp_path / "demo.yaml"
    config_path.write_text(cfg.to_yaml())
    run_dir = cfg.run.run_dir
    text = run_to_end(config_path, run_dir, procs)
    assert f"step {steps}/{steps} reward" in text, text[-4000:]
    records = run_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [int(r["version"]) for r in records] == list(range(1, steps + 1)), "one version published per step"
    trained = [g for r in records for g in r["trained_group_ids"]]
    assert len(trained) == len(set(trained)) == steps * cfg.trainer.batch_groups, "a group trained twice"
    groups = {g.group_id: g for g in asyncio.run(recorded_groups(cfg))}
    cap, newest = cfg.staleness.max_staleness, 0
    for record in records:
        trainer_version = int(record["version"]) - 1  # the weights the step was computed with
        for group_id in record["trained_group_ids"]:
            loss_versions = groups[group_id].versions[groups[group_id].loss_mask.astype(bool)]
            assert trainer_version - cap <= int(loss_versions.min()) <= int(loss_versions.max()) <= trainer_version
            newest = max(newest, int(loss_versions.max()))
    assert newest >= 1, "no trained group was generated with weights this trainer published"
    assert "checkpoint written" in (run_dir / "logs" / "trainer.log").read_text(), "the trainer stopped cleanly"
    assert_final_export(run_dir, steps)
    return records


def assert_final_export(run_dir: Path, version: int) -> None:
    """The run's `final/` export holds `version` and loads in plain transformers with every tensor in place (no
    missing, unexpected or mismatched names: the backend published Hugging Face names for this model family)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run_dir / "final"
    info = json.loads((final / "leeway.json").read_text())
    assert info["version"] == version, info
    _, loading = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert not any(loading.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    assert AutoTokenizer.from_pretrained(final).get_vocab()


RISE_EDGE = 10
RISE_MIN = 0.01


def assert_reward_rises(records: list[dict[str, Any]]) -> None:
    """The reward rises: the mean of the last `RISE_EDGE` steps beats the mean of the first by more than three
    standard errors of that difference (and by at least `RISE_MIN`). Per-step noise from successive differences
    (a slow trend barely inflates it): sigma ~ sd(diff)/sqrt(2); the difference of two means of RISE_EDGE steps
    then has standard error sigma * sqrt(2 / RISE_EDGE)."""
    rewards = [float(r["reward/unfiltered_mean"]) for r in records]
    sigma = statistics.pstdev([b - a for a, b in zip(rewards, rewards[1:], strict=False)]) / 2**0.5
    rise = statistics.mean(rewards[-RISE_EDGE:]) - statistics.mean(rewards[:RISE_EDGE])
    margin = max(RISE_MIN, 3 * sigma * (2 / RISE_EDGE) ** 0.5)
    assert rise > margin, f"reward rose by {rise:.3f} (needed {margin:.3f}): {[round(r, 3) for r in rewards]}"
