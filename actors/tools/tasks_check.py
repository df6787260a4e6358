"""`leeway tasks check DIR [CONFIG]`: every Harbor task in DIR must be solvable and must pay neither for nothing nor
for a known reward hack, before anyone trains on the set.

    each task:  sandbox ─► /solution/solve.sh (the oracle)  ─► tests ─► reward == max_reward ?
                sandbox ─► (do nothing)                      ─► tests ─► reward <  max_reward ?
                sandbox ─► each hack of `task_hacks.HACKS`  ─► tests ─► reward <  max_reward ?

Every attempt goes through exactly what an episode goes through (`pipeline/tasks/harbor.py`: its sandbox from the
config's `sandbox.*`, the agent's leftovers killed, the tests copied in afterwards, the reward read from what
they wrote), so a task that passes here scores the way training will score it. The hacks (`actors/tools/task_hacks.py`:
reading the tests, the test runner's secrets from its memory, exiting 0 early, writing the reward file, a process
left behind to rewrite it, patching the test runner) are what a policy under RL pressure finds first; a reward
hack that pays one episode in ten is learnable. A task whose oracle fails, whose tests pay an empty attempt or any
hack (named), or whose verifier cannot run is named with the reason. Prints one JSON object per task (each hack's
reward under ``hacks``) and a summary; exit 1 when any task fails, 2 when DIR holds no task.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from actors.cli_args import WithConfig, add_config_arguments
from actors.tools.task_hacks import HACKS, Hack
from pipeline.config import LeewayConfig

MAX_REWARD = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`leeway tasks check`'s description, flags and handler."""
    parser.description = (
        "Every task directory under DIR (instruction.md, task.toml, tests/test.sh, solution/solve.sh) "
        "is attempted in its own sandboxes, as an episode would be: once running solution/solve.sh, which "
        "must make the tests write reward 1, once doing nothing and once per known reward hack (actors/tools/"
        "task_hacks.py), each of which must score less. Sandbox settings come "
        "from CONFIG's sandbox section (or --set sandbox.*). One JSON line per task, then a summary; exit 1 when "
        "a task fails."
    )
    parser.add_argument("dir", help="a directory of Harbor task directories (e.g. configs/data/coding)")
    add_config_arguments(parser, required=False)
    parser.add_argument("--concurrency", type=int, default=2, help="attempts (sandboxes) run at once (default 2)")
    parser.set_defaults(handler=WithConfig(main))


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    from pipeline.sandbox import SandboxRefused
    from pipeline.tasks import TaskSettings
    from pipeline.tasks.harbor import HarborTask

    try:
        task = HarborTask(args.dir)
        task.configure(TaskSettings.from_config(cfg))
        task.pool  # noqa: B018 (a machine without bubblewrap is refused here, before any task runs)
    except (ValueError, SandboxRefused) as exc:
        print(f"leeway tasks check: {exc}", flush=True)
        return 2
    results = asyncio.run(_check_all(task, args.concurrency))
    failed = [r for r in results if not r["passed"]]
    for result in results:
        print(json.dumps(result), flush=True)
    summary = {"tasks": len(results), "passed": len(results) - len(failed), "failed": [r["task"] for r in failed]}
    print(json.dumps(summary), flush=True)
    return 1 if failed else 0


async def _check_all(task: Any, concurrency: int) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(max(1, concurrency))
    try:
        return list(await asyncio.gather(*(check_task_dir(task, d, gate) for d in task.tasks)))
    finally:
        await task.aclose()


async def check_task_dir(task: Any, task_dir: Any, gate: asyncio.Semaphore | None = None) -> dict[str, Any]:
    """The oracle's reward, a do-nothing agent's and every hack's, and whether each is what it must be."""
    started = time.monotonic()
    gate = gate or asyncio.Semaphore(1)

    async def attempt(solve: bool = False, hack: Hack | None = None) -> dict[str, Any]:
        async with gate:
            return await _attempt(task, task_dir, solve=solve, hack=hack)

    oracle, nothing, *hacked = await asyncio.gather(attempt(solve=True), attempt(), *(attempt(hack=h) for h in HACKS))
    out: dict[str, Any] = {"task": task_dir.name, "oracle_reward": oracle.get("reward")}
    out["nothing_reward"] = nothing.get("reward")
    out["hacks"] = {h.name: r.get("reward", "error") for h, r in zip(HACKS, hacked, strict=True)}
    problems = []
    if "error" in oracle:
        problems.append(f"oracle: {oracle['error']}")
    elif oracle["reward"] < MAX_REWARD:
        problems.append(f"the oracle solution scores {oracle['reward']:g}, not {MAX_REWARD:g}")
    if "error" in nothing:
        problems.append(f"do-nothing agent: {nothing['error']}")
    elif nothing["reward"] >= MAX_REWARD:
        problems.append(f"an agent that does nothing scores {nothing['reward']:g}: the tests pay for nothing")
    for hack, result in zip(HACKS, hacked, strict=True):
        if "error" in result:
            problems.append(f"hack {hack.name}: the verifier failed instead of scoring it ({result['error']})")
        elif not result["reward"] < MAX_REWARD:
            problems.append(f"hack {hack.name} scores {result['reward']:g}: the tests pay a reward hack")
    out["passed"] = not problems
    if problems:
        out["problems"] = problems
    out["seconds"] = round(time.monotonic() - started, 3)
    return out


async def _attempt(task: Any, task_dir: Any, *, solve: bool, hack: Hack | None = None) -> dict[str, Any]:
    from pipeline.tasks.harbor import EpisodeFailure, HarborEpisode

    episode = HarborEpisode(task, task_dir)
    try:
        await episode.opening()
        box = episode.box
        assert box is not None
        if solve:
            solution = task_dir.path / "solution"
            if not (solution / "solve.sh").is_file():
                return {"error": f"{solution / 'solve.sh'} is missing"}
            for path in sorted(solution.rglob("*")):
                if path.is_file():
                    inside = "/tmp/solution/" + path.relative_to(solution).as_posix()
                    await box.write_file(inside, path.read_bytes(), mode=0o755)
            ran = await box.exec("bash /tmp/solution/solve.sh", timeout_s=task_dir.agent_timeout_s)
            if not ran.ok:
                why = " (timed out)" if ran.timed_out else ""
                return {"error": f"solve.sh exit {ran.exit_code}{why}: {(ran.stdout + ran.stderr)[-300:]}"}
        if hack is not None:  # its commands' exit status is its business, as an agent's is
            await box.exec(hack.command, timeout_s=min(60.0, task_dir.agent_timeout_s))
        step = await episode.verify()
        return {"reward": float(step.reward if step.reward is not None else float("nan"))}
    except EpisodeFailure as exc:
        return {"error": str(exc)}
    finally:
        await episode.aclose()
