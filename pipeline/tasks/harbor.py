"""Harbor-format coding tasks (``task.name: harbor``, ``task.args.path: DIR``, one task per subdirectory), each
episode in a sandbox of its own, rewarded only by what the task's verifier wrote.

A task directory, as Harbor lays it out (the format, not the package, which needs Python 3.12)::

    <task>/instruction.md        what the agent is asked to do (the prompt)
    <task>/task.toml             [agent] timeout_sec, [verifier] timeout_sec, [environment] cpus / memory_mb
    <task>/tests/test.sh         the verifier: writes /logs/verifier/reward.txt (a number) or reward.json
    <task>/solution/solve.sh     the oracle (`leeway tasks check` requires it to score the maximum)
    <task>/environment/          a Dockerfile (for a docker backend; bwrap runs the host's system read-only)

An episode: a sandbox starts (`pipeline/sandbox/`, admitted by the generator's pool), the built-in shell agent plays
(the model replies with one fenced ``bash`` block per turn, the sandbox runs it in ``/app``, its exit code and
output come back as the next user message; ``DONE`` ends), then the verifier, which the agent never shares: every
process of the agent's sandbox is killed as a group, its ``/app`` exported and the sandbox closed (its PID
namespace and uid gone); a fresh sandbox from the same pool gets only that ``/app``, the task's tests read-only at
``/tests`` (the agent never saw them) and an empty ``/logs``; ``/tests/test.sh`` runs under ``[verifier]
timeout_sec``, every process left is killed, and the reward is what the tests wrote to ``/logs/verifier``, read
through that sandbox's supervisor. Nothing the agent wrote to its own ``/logs`` or left running can reach it.

Failures are typed. The sandbox's (``sandbox_start_failed``, ``sandbox_start_timeout``, ``sandbox_lost``) and the
verifier's (``verifier_crashed``, ``reward_missing``) are infrastructure (`EpisodeFailure`,
an `InfraFailure` whose ``reason`` is an `InfraReason`): the rollout re-runs the episode (``rollout.infra_retries``)
and then sends an ``infra_error``, masked, never a 0. A sandbox its own processes broke (`SandboxBroken`: its
supervisor killed, its channel tampered with, an ``/app`` that cannot be exported) is the policy's failure,
``sandbox_broken``: reward 0, never a masked re-run, which would select for the episodes whose hack paid.
So are tests that run past ``[verifier] timeout_sec``: they ran nothing but the agent's ``/app`` (the task's own
tests pass their oracle in time: `leeway tasks check`), so the hang is the policy's answer, ``scorer_timeout`` with
reward 0, as for a scorer worker killed at its deadline; masked, it would be a way to turn a 0 into a re-run.
``agent_timeout`` is the policy's (reward 0) unless ``rollout.agent_timeout_is: infra``. A reply with neither a
command nor DONE is a format error: the agent is told, or with ``rollout.strict_format`` the episode ends with
reward 0. Each hook's deadline comes from task.toml and the run's sandbox settings (`hook_deadlines`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.failures import InfraFailure, InfraReason
from pipeline.sandbox import ExecResult, SandboxError, SandboxSpec
from pipeline.sandbox.base import SandboxBroken
from pipeline.sandbox.pool import SandboxPool
from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.chat_tokenizer import load_chat_template_text, load_chat_tokenizer
from pipeline.tasks.environment import Environment, EnvStep, Hook
from pipeline.tasks.files import shuffled_epochs
from pipeline.tasks.harbor_dirs import HarborTaskDir, admission_wait_s, hook_deadlines, load_task_dirs
from pipeline.tasks.settings import TaskSettings
from pipeline.tasks.verifiers import SCORER_TIMEOUT
from pipeline.wire.prompts import Prompt

if TYPE_CHECKING:
    from pipeline.sandbox.supervised import SupervisedSandbox

log = logging.getLogger(__name__)

SHELL_AGENT_PROMPT = (
    "You are working in a Linux shell in /app. To run a command, reply with one ```bash code block; its exit code "
    "and output come back. When the task is done, reply with DONE."
)
COMMAND = re.compile(r"```(?:bash|sh)?[ \t]*\n(.*?)```", re.DOTALL)
DONE = re.compile(r"(?m)^\s*DONE\s*$")
REWARD_FILES = ("/logs/verifier/reward.txt", "/logs/verifier/reward.json")
VERIFIER_COMMAND = "mkdir -p /logs/verifier /logs/home && exec bash /tests/test.sh"
SANDBOX_BROKEN = "sandbox_broken"
"""The policy failure (`pipeline.failures.POLICY_FAILURES`) of a sandbox the agent's own processes broke."""
VERIFIER_ENV = {"HOME": "/logs/home", "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
"""The tests run with a fresh home and no user site-packages: nothing the agent left in its home (a
``usercustomize.py``) runs inside them."""
MAX_OBSERVATION_CHARS = 2000
"""Output of one command shown to the model (the head and the tail when longer)."""


class EpisodeFailure(InfraFailure):
    """An episode that ended for a reason other than its policy's: ``reason`` (an `InfraReason`) is its name in the
    metrics, ``detail`` names the task and what happened."""

    def __init__(self, reason: InfraReason, detail: str) -> None:
        super().__init__(detail, reason=reason)


class HarborTask(Task):
    """Harbor task directories played by the shell agent in sandboxes; see the module docstring."""

    name = "harbor"
    multi_turn = True
    self_check = False
    verifies_in_workers = False
    """`verify` reads nothing (it refuses to judge); the tests in a sandbox are the verifier."""
    """Rewards come from each task's own tests in a sandbox: `leeway tasks check DIR` is this task's self-check."""
    sandboxed_agents = True
    """An agent function (`task.agent`) runs in the episode's sandbox (``ctx.sandbox``) and is scored by the tests."""

    def __init__(self, path: str, eval_size: int = 0, seed: int = 0, tokenizer: str = "text") -> None:
        self.tasks = load_task_dirs(path)
        if not 0 <= eval_size < len(self.tasks):
            raise ValueError(f"harbor: task.args.eval_size must be in [0, {len(self.tasks)}), got {eval_size}")
        ranked = sorted(self.tasks, key=lambda t: hashlib.sha256(f"{seed}:{t.name}".encode()).hexdigest())
        held_out = {t.name for t in ranked[:eval_size]}
        self._by_id = {t.name: t for t in self.tasks}
        self._train = [self._prompt(t) for t in self.tasks if t.name not in held_out]
        self._eval = [self._prompt(t) for t in self.tasks if t.name in held_out]
        self._seed = seed
        self.tokenizer = load_chat_tokenizer(tokenizer)
        self.chat_template = load_chat_template_text()
        self.settings = TaskSettings()
        """The run's sandbox pool settings, command timeout and rollout rules (`configure`); defaults until then."""
        self._pool: SandboxPool | None = None

    def configure(self, settings: TaskSettings) -> None:
        """Take the run's `sandbox.*` and `rollout.*` settings (`pipeline.tasks.task_for` calls this); a deadline
        that is not finite and above zero is refused by name (config fields check ``> 0``, which ``inf`` passes)."""
        deadlines = {
            "sandbox.command_timeout_s": settings.command_timeout_s,
            "sandbox.start_timeout_s": settings.sandbox.start_timeout_s,
            "sandbox.admission_timeout_s": admission_wait_s(settings),
        }
        for name, value in deadlines.items():
            if not 0 < value < math.inf:
                raise ValueError(f"harbor: {name} must be finite and > 0, got {value!r}")
        self.settings = settings

    def _prompt(self, task: HarborTaskDir) -> Prompt:
        messages = ({"role": "system", "content": SHELL_AGENT_PROMPT}, {"role": "user", "content": task.instruction})
        return Prompt(prompt_id=task.name, messages=messages, metadata={"task": task.name}, tags=("harbor", *task.tags))

    def prompts(self) -> Iterator[Prompt]:
        return shuffled_epochs(self._train, f"harbor-{self._seed}")

    def eval_prompts(self) -> list[Prompt] | None:
        return list(self._eval) or None

    def task_dir(self, prompt: Prompt) -> HarborTaskDir:
        name = str(prompt.metadata.get("task", prompt.prompt_id))
        found = self._by_id.get(name)
        if found is None:
            raise ValueError(f"harbor: no task directory {name!r} for prompt {prompt.prompt_id!r}")
        return found

    @property
    def pool(self) -> SandboxPool:
        """The generator's sandbox pool, made on first use (in the event loop the episodes run in)."""
        if self._pool is None:
            self._pool = SandboxPool(self.settings.sandbox)
        return self._pool

    def environment(self, prompt: Prompt) -> HarborEpisode:
        return HarborEpisode(self, self.task_dir(prompt))

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        """Never the judge of an episode (its tests in the sandbox are); a reward from nowhere is not one."""
        return VerifierResult(None, status="infra_error", info={"error": "harbor: scored only by its tests"})

    async def aclose(self) -> None:
        """Tear down the pool's sandboxes; a later episode (in another event loop, say) makes a new pool."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


class HarborEpisode(Environment):
    """One attempt at one task: the agent's sandbox lives from `opening` until `verify` hands its /app over (or
    `aclose`); the verifier's sandbox only while the tests run."""

    def __init__(self, task: HarborTask, task_dir: HarborTaskDir) -> None:
        self.task = task
        self.dir = task_dir
        self._stack = contextlib.AsyncExitStack()
        self.box: SupervisedSandbox | None = None
        """The agent's sandbox, from `opening` until `verify` closes it."""
        self._deadline = 0.0
        self.commands = 0

    def hook_timeout_s(self, hook: Hook) -> float:
        """Each hook's deadline from the task's own timeouts and the run's sandbox settings (`hook_deadlines`)."""
        return hook_deadlines(self.dir, self.task.settings)[hook]

    async def opening(self) -> EnvStep:
        spec = SandboxSpec(workdir="/app", writable=("/app", "/logs"), label=self.dir.name)
        try:
            self.box = await self._stack.enter_async_context(self.task.pool.sandbox(spec))
        except SandboxError as exc:
            raise EpisodeFailure(exc.reason, exc.detail) from exc
        self._deadline = time.monotonic() + self.dir.agent_timeout_s
        return EnvStep()

    async def step(self, reply_text: str, reply_ids: np.ndarray) -> EnvStep:
        assert self.box is not None, "step before opening"
        left = self._deadline - time.monotonic()
        if left <= 0:
            return self._agent_timeout()
        found = COMMAND.search(reply_text)
        if found is None:
            if DONE.search(reply_text):
                return await self.verify()
            if self.task.settings.strict_format:
                return EnvStep(done=True, reward=0.0, status="format_error", info={"error": "no command, no DONE"})
            return self._say("Reply with one ```bash code block, or DONE when the task is done.")
        self.commands += 1
        try:
            result = await self.box.exec(found.group(1), timeout_s=min(self.task.settings.command_timeout_s, left))
        except SandboxBroken as exc:
            return self.broken(exc)
        except SandboxError as exc:
            raise EpisodeFailure(exc.reason, exc.detail) from exc
        if result.timed_out and time.monotonic() >= self._deadline:
            return self._agent_timeout()
        shown = _clip(result.stdout + result.stderr)
        note = " (timed out)" if result.timed_out else ""
        return self._say(f"exit code {result.exit_code}{note}\n{shown}")

    def _say(self, text: str) -> EnvStep:
        return EnvStep(messages=({"role": "user", "content": text},))

    def _agent_timeout(self) -> EnvStep:
        if self.task.settings.agent_timeout_is == "infra":
            raise EpisodeFailure(InfraReason.AGENT_TIMEOUT, f"{self.dir.name}: past [agent] timeout_sec")
        return EnvStep(done=True, reward=0.0, info={"error": "agent_timeout", "commands": self.commands})

    def broken(self, exc: SandboxBroken) -> EnvStep:
        """The sandbox's own processes broke it (killed its supervisor, made /app unreadable or too big): the
        policy's failure, reward 0, never a masked re-run (re-runs select for success)."""
        log.warning("harbor %s: %s; reward 0 (sandbox_broken)", self.dir.name, exc)
        info = {"error": SANDBOX_BROKEN, "detail": str(exc), "commands": self.commands}
        return EnvStep(done=True, reward=0.0, info=info)

    async def final(self) -> EnvStep:
        """The episode was cut by a turn or token limit before DONE: the tests judge what the agent left."""
        return await self.verify()

    async def verify(self) -> EnvStep:
        """The agent's turn is over: every process of its sandbox is killed, its /app exported and the sandbox
        closed (its PID namespace and uid gone); then the tests run in a fresh sandbox holding only that /app, the
        task's tests read-only at /tests and an empty /logs, and the reward is what they wrote there."""
        base = self.task.settings.sandbox.base_dir
        with tempfile.TemporaryDirectory(prefix="leeway-verify-", dir=base) as tmp:
            app = Path(tmp) / "app.tar"
            broken = await self._hand_over(app)
            if broken is not None:
                return broken
            return await self._run_tests(app, await asyncio.to_thread(_readable_tests, self.dir.path / "tests", tmp))

    async def _hand_over(self, app: Path) -> EnvStep | None:
        """Kill the agent's processes, export its /app to `app`, close its sandbox; None, or the broken verdict."""
        box, self.box = self.box, None
        assert box is not None, "verify before opening"
        try:
            await box.kill_all()
            await box.export_tree("/app", app)
        except SandboxBroken as exc:
            return self.broken(exc)
        except OSError as exc:  # the supervisor could not read /app: the agent made it unreadable or removed it
            return self.broken(SandboxBroken(f"{box.spec.label}: /app cannot be exported: {exc}"))
        except SandboxError as exc:
            raise EpisodeFailure(exc.reason, exc.detail) from exc
        finally:
            await self._stack.aclose()
        return None

    async def _run_tests(self, app: Path, tests: Path) -> EnvStep:
        """``test.sh`` in a sandbox of its own under ``[verifier] timeout_sec``; the reward read once every process
        in it is gone. A verifier that cannot score (no start, no reward) is infrastructure; one past its time hung
        on the agent's /app: the policy's ``scorer_timeout``."""
        spec = SandboxSpec(
            workdir="/app",
            writable=("/app", "/logs"),
            binds={"/tests": tests},
            imports={"/app": app},
            label=f"{self.dir.name}-verifier",
        )
        timeout_s = self.dir.verifier_timeout_s
        try:
            async with self.task.pool.sandbox(spec) as box:
                ran = await box.exec(VERIFIER_COMMAND, timeout_s=timeout_s, env=VERIFIER_ENV)
                if ran.timed_out:  # on the agent's /app alone: the policy's answer hung the tests
                    log.warning(
                        "harbor %s: the tests ran past %g s; reward 0 (scorer_timeout)", self.dir.name, timeout_s
                    )
                    info = {"error": SCORER_TIMEOUT, "detail": f"past {timeout_s:g} s", "commands": self.commands}
                    return EnvStep(done=True, reward=0.0, info=info)
                await box.kill_all()
                reward = await _reward(box, self.dir.name, ran)
        except SandboxBroken as exc:  # the agent's code, run by the tests, broke the verifier's sandbox
            return self.broken(exc)
        except SandboxError as exc:
            raise EpisodeFailure(exc.reason, exc.detail) from exc
        return EnvStep(done=True, reward=reward, info={"commands": self.commands, "verifier_exit": ran.exit_code})

    async def aclose(self) -> None:
        self.box = None
        await self._stack.aclose()


async def _reward(box: SupervisedSandbox, name: str, ran: ExecResult) -> float:
    """The reward the tests wrote (reward.txt, else reward.json), read through the verifier's supervisor."""
    for path in REWARD_FILES:
        try:
            raw = (await box.read_file(path, max_bytes=1 << 16)).decode(errors="replace").strip()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise EpisodeFailure(InfraReason.VERIFIER_CRASHED, f"{name}: {exc}") from exc
        try:
            return _parse_reward(raw, path)
        except ValueError as exc:
            raise EpisodeFailure(InfraReason.VERIFIER_CRASHED, f"{name}: {exc}") from exc
    reason = InfraReason.VERIFIER_CRASHED if ran.exit_code != 0 else InfraReason.REWARD_MISSING
    raise EpisodeFailure(reason, f"{name}: no reward file (test.sh exit {ran.exit_code}): {ran.stderr[-300:]}")


def _readable_tests(source: Path, tmp: str) -> Path:
    """A copy of the task's tests the verifier's sandbox (a uid of its own) can read, to bind read-only at /tests:
    the task directory itself may sit where that uid cannot pass (a home directory, a 0700 temp directory).
    ``tmp`` itself lets it through to the copy without listing what else is there (the /app tar)."""
    os.chmod(tmp, 0o711)
    copy = Path(tmp) / "tests"
    shutil.copytree(source, copy, symlinks=True)
    for top, _dirs, files in os.walk(copy):
        os.chmod(top, 0o755)
        for name in files:
            os.chmod(os.path.join(top, name), 0o755)
    return copy


def _parse_reward(raw: str, path: str) -> float:
    if path.endswith(".json"):
        import json

        data: Any = json.loads(raw)
        if isinstance(data, Mapping):
            if "reward" in data:
                return float(data["reward"])
            values = [float(v) for v in data.values()]
            if not values:
                raise ValueError(f"{path} holds no reward")
            return sum(values) / len(values)
        return float(data)
    return float(raw.split()[0]) if raw else _empty(path)


def _empty(path: str) -> float:
    raise ValueError(f"{path} is empty")


def _clip(text: str) -> str:
    if len(text) <= MAX_OBSERVATION_CHARS:
        return text
    half = MAX_OBSERVATION_CHARS // 2
    return f"{text[:half]}\n... ({len(text) - MAX_OBSERVATION_CHARS} characters cut) ...\n{text[-half:]}"
