"""Harbor tasks through the real rollout, in real bubblewrap sandboxes, with a scripted policy (the shell agent's
replies are fixed, so each test decides what the agent does): a reward counts only if the task's tests wrote it, in
a verifier sandbox the agent never shared (a reward it forges, a process it leaves behind, a /logs it breaks never
count), a sandbox the agent broke scores 0 and is never re-run, a sandbox killed by the host is re-run and never
scores 0, every failure is typed, task directories with symlinks or nan/inf/non-positive timeouts are refused, each
hook's deadline comes from task.toml and the config (every episode here runs under a rollout timeout of 1 ms that
Harbor's own deadlines replace), and `leeway tasks check` passes the shipped set and catches a broken oracle and
tests that pay for nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from actors.generator.engines.base import GenerateRequest, GenerateResult, SamplingParams
from actors.models import load_chat_template_for, stop_token_ids
from pipeline.config import LeewayConfig, load_config
from pipeline.rl.scoring import run_group
from pipeline.tasks import TaskSettings, VerifierPool
from pipeline.tasks.harbor import HarborTask
from pipeline.wire.trajectory import Sample, TrajectoryGroup
from tests.support.runs import REPO, leeway_argv
from tests.support.waits import wait_until

CODING = REPO / "configs" / "data" / "coding"
SOLVE = "```bash\n" + (CODING / "reverse-words" / "solution" / "solve.sh").read_text() + "\n```"
KILL_SUPERVISOR = "kill -9 $PPID; kill -9 1; echo sent"
"""An agent command that kills the sandbox's supervisor (the process that runs its commands)."""
WRONG = "```bash\necho 'def reverse_words(s): return s' > /app/solution.py\n```"


def _one_task(tmp_path: Path, name: str = "reverse-words", **edits: str) -> Path:
    """A task set of one shipped task, with files replaced by `edits` (relative path -> new text)."""
    root = tmp_path / "tasks"
    shutil.copytree(CODING / name, root / name)
    for relative, text in edits.items():
        (root / name / relative).write_text(textwrap.dedent(text))
    return root


class _Agent:
    """A `Generate` callable: the scripted replies of attempt k are ``scripts[k]`` (the last script repeats);
    ``on_reply(attempt, turn)`` runs before each reply (a test's hook: kill the sandbox)."""

    def __init__(self, task: HarborTask, scripts: Sequence[Sequence[str]], on_reply: Callable[..., None] | None = None):
        self.task = task
        self.scripts = [list(s) for s in scripts]
        self.on_reply = on_reply
        self.attempt = 0
        self.turn = 0
        self.eos = stop_token_ids(task.tokenizer)[0]

    def __call__(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        script = self.scripts[min(self.attempt, len(self.scripts) - 1)]
        if self.turn >= len(script):  # a new attempt began: its first reply
            self.attempt, self.turn = self.attempt + 1, 0
            script = self.scripts[min(self.attempt, len(self.scripts) - 1)]
        if self.on_reply is not None:
            self.on_reply(self.attempt, self.turn)
        text = script[self.turn]
        self.turn += 1
        ids = list(self.task.tokenizer.encode(text, add_special_tokens=False).ids) + [self.eos]
        n = len(ids)
        return [
            GenerateResult(np.asarray(ids, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32), "stop")  # type: ignore[arg-type]
            for _ in requests
        ]


def _episode(
    root: Path,
    scripts: Sequence[Sequence[str]],
    *sets: str,
    on_reply: Callable[..., None] | None = None,
    max_turns: int = 8,
) -> tuple[Sample, HarborTask]:
    cfg = load_config(None, ["sandbox.starts_per_s=0", *sets], environ={})
    task = HarborTask(str(root))
    task.configure(TaskSettings.from_config(cfg))
    return _episode_with(
        task,
        scripts,
        on_reply,
        infra_retries=cfg.rollout.infra_retries,
        strict_truncation=cfg.rollout.strict_truncation,
        max_turns=max_turns,
    )


def test_the_reward_is_what_the_tests_wrote_after_the_agents_commands(tmp_path: Path) -> None:
    root = _one_task(tmp_path)
    solved, _ = _episode(root, [[SOLVE, "DONE"]])
    assert (solved.status, solved.reward, solved.reward_source) == ("ok", 1.0, "verifier")
    wrong, _ = _episode(root, [[WRONG, "DONE"]])
    assert (wrong.status, wrong.reward) == ("ok", 0.0)
    # the tests were never in view of the agent
    peek = "```bash\nls /tests; cat /tests/test.sh\n```"
    peeked, task = _episode(root, [[peek, "DONE"]])
    transcript = task.tokenizer.decode([int(t) for t in peeked.tokens], skip_special_tokens=False)
    assert "reward.txt" not in transcript.split("ls /tests")[1] and peeked.reward == 0.0


FORGE = """```bash
mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && echo '{"reward": 1}' > /logs/verifier/reward.json
(while true; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; sleep 0.01; done) &
setsid bash -c 'while true; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; sleep 0.01; done' &
chmod 000 /logs; echo forged
```"""


def test_a_reward_the_agent_forges_or_a_process_it_leaves_rewriting_it_never_counts(tmp_path: Path) -> None:
    """The agent writes the reward files, leaves two processes (one in a session of its own) rewriting them and
    makes /logs unusable: the verifier runs in a sandbox of its own with a fresh /logs, so the reward is the
    tests' 0 (the /app it left holds a wrong solution), never 1 and never a masked infra_error."""
    forged, _ = _episode(_one_task(tmp_path), [[WRONG, FORGE, "DONE"]], "rollout.infra_retries=0")
    assert (forged.status, forged.reward, forged.reward_source) == ("ok", 0.0, "verifier")
    assert "error" not in forged.info and forged.info["verifier_exit"] == 0


def test_an_agent_that_kills_its_supervisor_scores_zero_never_a_masked_rerun(tmp_path: Path) -> None:
    """From inside, the supervisor (the PID namespace's init) shrugs off the agent's signals: the sandbox goes on
    and the tests score the wrong solution 0, with no re-run. (A supervisor that dies anyway once a command of
    the policy ran is ``sandbox_broken``: the agent-function test below and the next one.)"""
    killer = "```bash\n" + KILL_SUPERVISOR + "\n```"
    tried, _ = _episode(_one_task(tmp_path), [[WRONG, killer, "DONE"]], "rollout.infra_retries=1")
    assert (tried.status, tried.reward, tried.info["attempts"]) == ("ok", 0.0, 1) and "error" not in tried.info


def test_a_supervisor_that_died_between_commands_is_the_policys_even_once_the_host_saw_it_exit(tmp_path: Path) -> None:
    cfg = load_config(None, ["sandbox.starts_per_s=0"], environ={})
    task = HarborTask(str(_one_task(tmp_path)))
    task.configure(TaskSettings.from_config(cfg))

    def kill_supervisor(attempt: int, turn: int) -> None:
        if turn == 1:  # as if the policy's command had killed it (raised its oom_score_adj, then filled memory)
            (box,) = task.pool._live
            assert box._proc is not None
            os.kill(box._proc.pid, signal.SIGKILL)
            wait_until(lambda: box._proc.returncode is not None, what="the host to see the supervisor exit")

    broken, _ = _episode_with(task, [[SOLVE, "DONE"]], kill_supervisor, infra_retries=1)
    assert (broken.status, broken.reward, broken.info.get("error")) == ("ok", 0.0, "sandbox_broken")


def test_an_app_the_agent_made_unreadable_or_too_big_to_hand_over_scores_zero_never_infra(tmp_path: Path) -> None:
    root = _one_task(tmp_path)
    locked = "```bash\nchmod 000 /app/solution.py; mkdir /app/d; touch /app/d/f; chmod 000 /app/d /app\n```"
    unreadable, _ = _episode(root, [[SOLVE, locked, "DONE"]], "rollout.infra_retries=0")
    assert (unreadable.status, unreadable.reward) == ("ok", 0.0), unreadable.info
    big = "```bash\nfor i in 1 2 3; do head -c 900000 /dev/urandom > /app/blob$i; done; ls /app\n```"
    too_big, _ = _episode(root, [[SOLVE, big, "DONE"]], "rollout.infra_retries=0", "sandbox.max_file_mb=1")
    assert (too_big.status, too_big.reward, too_big.info["error"]) == ("ok", 0.0, "sandbox_broken")


def test_a_nan_reward_on_a_cut_episode_fails_that_sample_alone(tmp_path: Path) -> None:
    """The turn limit cuts the episode before DONE: the tests judge it (`final`) and write NaN; the sample is a
    typed reward_invalid (its group still validates), not a NaN that loses the whole group."""
    nan = "#!/bin/bash\nmkdir -p /logs/verifier; echo nan > /logs/verifier/reward.txt\n"
    root = _one_task(tmp_path, **{"tests/test.sh": nan})
    cut, _ = _episode(root, [[SOLVE, "DONE"]], "rollout.infra_retries=0", max_turns=1)
    assert (cut.status, cut.reward, cut.info["infra_reason"]) == ("infra_error", None, "reward_invalid")
    TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="gen", samples=[cut])


def test_a_reply_without_command_or_done_is_told_or_with_strict_format_ends_at_zero(tmp_path: Path) -> None:
    root = _one_task(tmp_path)
    told, task = _episode(root, [["I think I will write it.", SOLVE, "DONE"]])
    assert told.reward == 1.0 and told.num_turns == 3
    strict, _ = _episode(root, [["I think I will write it.", SOLVE, "DONE"]], "rollout.strict_format=true")
    assert (strict.status, strict.reward, strict.num_turns) == ("format_error", 0.0, 1)


def test_a_sandbox_killed_mid_episode_is_sandbox_lost_rerun_and_never_scores_zero(tmp_path: Path) -> None:
    root = _one_task(tmp_path)
    holder: dict[str, HarborTask] = {}

    def kill_first_attempt(attempt: int, turn: int) -> None:
        if attempt == 0 and turn == 1:  # after the solution is written, before DONE: the sandbox dies
            for box in list(holder["task"].pool._live):  # the host kills it (`kill`: not the policy's doing)
                asyncio.run(box.kill("killed by the test"))

    cfg_sets = ("rollout.infra_retries=1",)
    cfg = load_config(None, ["sandbox.starts_per_s=0", *cfg_sets], environ={})
    task = HarborTask(str(root))
    task.configure(TaskSettings.from_config(cfg))
    holder["task"] = task
    # the same scripted policy twice: the first attempt's sandbox is killed; the rerun solves it
    rerun, _ = _episode_with(task, [[SOLVE, "DONE"]], kill_first_attempt, infra_retries=1)
    assert (rerun.status, rerun.reward, rerun.info["attempts"]) == ("ok", 1.0, 2)
    never = HarborTask(str(root))
    never.configure(TaskSettings.from_config(cfg))
    holder["task"] = never
    lost, _ = _episode_with(never, [[SOLVE, "DONE"]], lambda a, t: kill_first_attempt(0, t), infra_retries=1)
    assert (lost.status, lost.reward, lost.reward_source) == ("infra_error", None, "none")
    assert lost.info["infra_reason"] == "sandbox_lost" and lost.info["attempts"] == 2


def _episode_with(
    task: HarborTask,
    scripts: Sequence[Sequence[str]],
    on_reply: Callable[..., None] | None,
    *,
    infra_retries: int,
    strict_truncation: bool = False,
    max_turns: int = 8,
) -> tuple[Sample, HarborTask]:
    """One episode of the task's first prompt, played by the scripted `_Agent`, through the real rollout."""
    agent = _Agent(task, scripts, on_reply)
    template = load_chat_template_for(LeewayConfig(), task.tokenizer, task)
    sampling = SamplingParams(max_new_tokens=4096, stop_token_ids=stop_token_ids(task.tokenizer))

    async def go() -> list[Sample]:
        with VerifierPool() as verifiers:
            try:
                return await run_group(
                    agent,
                    task,
                    next(iter(task.prompts())),
                    1,
                    sampling,
                    task.environment,
                    tokenizer=task.tokenizer,
                    verifiers=verifiers,
                    template=template,
                    env_timeout_s=0.001,  # Harbor declares its own hook deadlines: this one never applies
                    max_turns=max_turns,
                    infra_retries=infra_retries,
                    strict_truncation=strict_truncation,
                )
            finally:
                await task.aclose()

    (sample,) = asyncio.run(go())
    return sample, task


@pytest.mark.parametrize(
    ("edits", "reason"),
    [
        ({"tests/test.sh": "#!/bin/bash\necho written nowhere\n"}, "reward_missing"),
        ({"tests/test.sh": "#!/bin/bash\nexit 7\n"}, "verifier_crashed"),
        (
            {"tests/test.sh": "#!/bin/bash\nmkdir -p /logs/verifier; echo lots > /logs/verifier/reward.txt\n"},
            "verifier_crashed",
        ),
    ],
)
def test_a_verifier_that_cannot_score_is_a_typed_infra_error_never_a_zero(
    tmp_path: Path, edits: dict[str, str], reason: str
) -> None:
    sample, _ = _episode(_one_task(tmp_path, **edits), [[SOLVE, "DONE"]], "rollout.infra_retries=0")
    assert (sample.status, sample.reward, sample.info["infra_reason"]) == ("infra_error", None, reason)


def test_tests_that_hang_on_the_agents_app_are_the_policys_scorer_timeout_never_a_masked_rerun(tmp_path: Path) -> None:
    """The tests ran nothing but the agent's /app: a hang past [verifier] timeout_sec is its answer's doing."""
    root = _one_task(tmp_path, **{"task.toml": "[verifier]\ntimeout_sec = 1.0\n"})
    hang = "```bash\nprintf 'import time\\ntime.sleep(1000)\\n' > /app/solution.py\n```"
    sample, _ = _episode(root, [[hang, "DONE"]], "rollout.infra_retries=1")
    assert (sample.status, sample.reward, sample.info["error"], sample.info["attempts"]) == (
        "ok",
        0.0,
        "scorer_timeout",
        1,
    )


def test_an_agent_out_of_time_scores_zero_or_with_agent_timeout_is_infra_is_masked(tmp_path: Path) -> None:
    root = _one_task(tmp_path, **{"task.toml": "[agent]\ntimeout_sec = 1.0\n"})
    slow = ["```bash\nsleep 1000\n```", SOLVE, "DONE"]
    policy, _ = _episode(root, [slow])
    assert (policy.status, policy.reward, policy.info["error"]) == ("ok", 0.0, "agent_timeout")
    infra, _ = _episode(root, [slow], "rollout.agent_timeout_is=infra", "rollout.infra_retries=0")
    assert (infra.status, infra.reward, infra.info["infra_reason"]) == ("infra_error", None, "agent_timeout")


def test_tasks_check_catches_a_broken_oracle_and_free_rewards(tmp_path: Path) -> None:
    """(The shipped set passing, hacks included, is tests/tools/test_tasks_check.py's.)"""
    root = _one_task(
        tmp_path, **{"solution/solve.sh": "#!/bin/bash\necho 'def reverse_words(s): return s' > /app/solution.py\n"}
    )
    shutil.copytree(CODING / "fizzbuzz-list", root / "fizzbuzz-list")
    (root / "fizzbuzz-list" / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"
    )
    broken = subprocess.run(
        leeway_argv("tasks", "check", str(root)), cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert '"failed": ["fizzbuzz-list", "reverse-words"]' in broken.stdout
    assert "the oracle solution scores 0" in broken.stdout and "scores 1: the tests pay for nothing" in broken.stdout


def test_leeway_eval_plays_a_harbor_tasks_held_out_episodes_in_sandboxes(tmp_path: Path) -> None:
    """A multi-turn task's evaluation runs episodes (an environment each), not one reply scored by `verify`: every
    sample is scored by the task's tests (the demo model solves none: reward 0, never an infra_error)."""
    import torch

    from actors.models import build_policy_model, load_tokenizer
    from actors.trainer.sessions import build_weight_publisher
    from pipeline.tasks import task_for
    from storage.filestore import FileStore

    sets = [
        f"store.url=file://{tmp_path / 'store'}",
        "run.name=harbor-eval",
        "task.args.eval_size=2",
        "sandbox.starts_per_s=0",
        "engine.sampling.max_new_tokens=16",
    ]
    cfg = load_config(str(REPO / "configs" / "coding.yaml"), sets, environ={})
    task = task_for(cfg)
    torch.manual_seed(0)
    model = build_policy_model(cfg, load_tokenizer(cfg, task))
    with FileStore(tmp_path / "store") as store:
        publisher = build_weight_publisher(cfg, store, model)
        publisher.publish(0, {k: v.detach().clone() for k, v in model.state_dict().items()})
        publisher.close()
    argv = leeway_argv("eval", str(REPO / "configs" / "coding.yaml"), "--version", "0", "--samples", "2")
    done = subprocess.run(
        [*argv, *(a for s in sets for a in ("--set", s))], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["prompts"] == 2 and sum(result["statuses"].values()) == 4
    assert "infra_error" not in result["statuses"] and result["mean_reward"] == 0.0


async def _oracle_agent(prompt: Any, client: Any, ctx: Any) -> Any:
    """An agent function that asks the model once and then writes the task's oracle in its sandbox itself."""
    from pipeline.tasks.agents import AgentOutcome

    await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "12>"}])
    solution = CODING / prompt.metadata["task"] / "solution" / "solve.sh"
    ran = await ctx.sandbox.exec(solution.read_text(), timeout_s=60)
    return AgentOutcome(1.0 if ran.ok else None, info={"wrote": ran.ok})  # its own reward is not the one counted


async def _idle_agent(prompt: Any, client: Any, ctx: Any) -> Any:
    from pipeline.tasks.agents import AgentOutcome

    await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "12>"}])
    return AgentOutcome(1.0)  # claims success, wrote nothing: the tests say 0


async def _breaking_agent(prompt: Any, client: Any, ctx: Any) -> Any:
    """Writes the oracle, then its sandbox's supervisor dies (killed from here, as if a command had done it) and
    its next command meets a broken sandbox: the policy's failure, 0, whatever the agent claims."""
    from pipeline.tasks.agents import AgentOutcome

    await _oracle_agent(prompt, client, ctx)
    os.kill(ctx.sandbox._proc.pid, signal.SIGKILL)
    await ctx.sandbox.exec("echo still here", timeout_s=10)
    return AgentOutcome(1.0)


async def _slow_agent(prompt: Any, client: Any, ctx: Any) -> Any:
    await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "12>"}])
    await ctx.sandbox.exec("sleep 1000", timeout_s=600)
    raise AssertionError("unreachable")


def test_an_agent_function_works_in_the_episodes_sandbox_and_the_tests_score_it(tmp_path: Path) -> None:
    from actors.generator.agents import AgentRunner
    from tests.support.endpoints import served

    root = _one_task(tmp_path)
    task = HarborTask(str(root))
    task.configure(TaskSettings.from_config(load_config(None, ["sandbox.starts_per_s=0"], environ={})))
    prompt = next(iter(task.prompts()))

    async def go() -> dict[str, list[Sample]]:
        out = {}
        async with served() as s:
            for name, agent, timeout_is in (
                ("oracle", _oracle_agent, "policy"),
                ("idle", _idle_agent, "policy"),
                ("breaker", _breaking_agent, "policy"),
                ("slow-policy", _slow_agent, "policy"),
                ("slow-infra", _slow_agent, "infra"),
            ):
                runner = AgentRunner(
                    agent,
                    s.service,
                    base_url=s.endpoint.url,
                    api_key=None,
                    timeout_s=30 if agent is not _slow_agent else 2,
                    max_tokens=6,
                    sandboxes=task.environment,
                    agent_timeout_is=timeout_is,
                )
                out[name] = await runner.group(prompt, 1)
        await task.aclose()
        return out

    runs = asyncio.run(go())
    assert [(x.status, x.reward) for x in runs["oracle"]] == [("ok", 1.0)]
    assert all(x.info["wrote"] and x.loss_mask.sum() > 0 for x in runs["oracle"])
    assert [(x.status, x.reward) for x in runs["idle"]] == [("ok", 0.0)]
    assert [(x.status, x.reward, x.info["error"]) for x in runs["breaker"]] == [("ok", 0.0, "sandbox_broken")]
    assert [(x.status, x.reward) for x in runs["slow-policy"]] == [("ok", 0.0)]
    assert [(x.status, x.info["infra_reason"]) for x in runs["slow-infra"]] == [("infra_error", "agent_timeout")]


def test_what_the_agent_leaves_in_its_home_does_not_run_inside_the_tests(tmp_path: Path) -> None:
    # a usercustomize.py that answers the checker's token and exits 0 before any check: it fools the shipped
    # test.sh whenever the tests' python imports it
    cheat = "import os, sys; print(sys.stdin.readline().strip(), flush=True); os._exit(0)"
    plant = (
        "```bash\nd=$(python3 -m site --user-site) && mkdir -p $d && "
        f"echo '{cheat}' > $d/usercustomize.py && echo planted\n```"
    )
    planted, _ = _episode(_one_task(tmp_path), [[plant, "DONE"]])
    assert planted.reward == 0.0


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("[verifier]\ntimeout_sec = nan\n", "[verifier] timeout_sec"),
        ("[verifier]\ntimeout_sec = inf\n", "[verifier] timeout_sec"),
        ("[agent]\ntimeout_sec = -5.0\n", "[agent] timeout_sec"),
        ("[agent]\ntimeout_sec = 0\n", "[agent] timeout_sec"),
        ("[agent]\ntimeout_sec = '60'\n", "[agent] timeout_sec"),
        ("[environment]\ncpus = -inf\n", "[environment] cpus"),
        ("[environment]\nmemory_mb = 0\n", "[environment] memory_mb"),
        ("[environment]\nmemory_mb = 512.5\n", "[environment] memory_mb"),
    ],
)
def test_a_task_toml_with_a_nan_inf_or_non_positive_timeout_or_limit_is_refused_by_file_and_field(
    tmp_path: Path, toml: str, field: str
) -> None:
    root = _one_task(tmp_path, **{"task.toml": toml})
    with pytest.raises(ValueError, match=r"task\.toml: \[") as refused:
        HarborTask(str(root))
    assert field in str(refused.value) and str(root / "reverse-words" / "task.toml") in str(refused.value)


def test_a_task_directory_holding_a_symlink_is_refused_naming_the_link(tmp_path: Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("AWS_SECRET_ACCESS_KEY=...")
    cases = {"instruction.md": secret, "tests/test_solution.py": secret, "tests/data": tmp_path}
    for relative, target in cases.items():
        root = _one_task(tmp_path / relative.replace("/", "_"))
        link = root / "reverse-words" / relative
        if link.exists():
            link.unlink()
        link.symlink_to(target)
        with pytest.raises(ValueError, match="is a symlink") as refused:
            HarborTask(str(root))
        assert str(link) in str(refused.value)
    inside = _one_task(tmp_path / "inside")  # even a link that stays inside the task directory
    (inside / "reverse-words" / "tests" / "again.sh").symlink_to("test.sh")
    with pytest.raises(ValueError, match="again.sh"):
        HarborTask(str(inside))
    linked_task = tmp_path / "linked"
    linked_task.mkdir()
    (linked_task / "reverse-words").symlink_to(_one_task(tmp_path / "real") / "reverse-words")
    with pytest.raises(ValueError, match="is a symlink"):
        HarborTask(str(linked_task))


def test_each_hook_deadline_comes_from_task_toml_and_the_config_never_a_fixed_minute(tmp_path: Path) -> None:
    """A verifier allowed 15 minutes gets them: `final` and `step` (which runs the tests on DONE) are given more
    than the tests' own timeout, so only the tests' deadline (a typed ``verifier_timeout``) can cut them."""
    root = _one_task(tmp_path, **{"task.toml": "[verifier]\ntimeout_sec = 900.0\n[agent]\ntimeout_sec = 30.0\n"})
    task = HarborTask(str(root))
    sets = ["sandbox.command_timeout_s=45", "sandbox.start_timeout_s=20", "sandbox.admission_timeout_s=30"]
    cfg = load_config(None, sets, environ={})
    task.configure(TaskSettings.from_config(cfg))
    episode = task.environment(next(iter(task.prompts())))
    deadlines = {hook: episode.hook_timeout_s(hook) for hook in ("opening", "step", "final", "aclose")}
    assert deadlines["final"] > 900 + 20 and deadlines["step"] > deadlines["final"] + 30  # command: the agent's 30
    assert 20 + 30 < deadlines["opening"] < 900 and deadlines["aclose"] > 0
    shorter = HarborTask(str(_one_task(tmp_path / "short", **{"task.toml": "[verifier]\ntimeout_sec = 5.0\n"})))
    shorter.configure(TaskSettings.from_config(cfg))
    assert shorter.environment(next(iter(shorter.prompts()))).hook_timeout_s("final") < deadlines["final"] - 800
    for field, value in (("command_timeout_s", math.inf), ("start_timeout_s", math.nan)):
        settings = TaskSettings.from_config(cfg)
        if field == "command_timeout_s":
            settings = dataclasses.replace(settings, command_timeout_s=value)
        else:
            settings = dataclasses.replace(
                settings, sandbox=dataclasses.replace(settings.sandbox, start_timeout_s=value)
            )
        with pytest.raises(ValueError, match=f"sandbox.{field}"):
            task.configure(settings)
