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
output come back as the next user message; ``DONE`` ends), then every process the agent left is killed, the tests
are copied into ``/tests`` (the agent never saw them), ``/tests/test.sh`` runs, and the reward is what it wrote.
Failures are typed (`EpisodeFailure`, an `InfraFailure` whose ``reason`` is an `InfraReason`): the sandbox's
(``sandbox_start_failed``, ``sandbox_start_timeout``, ``sandbox_lost``) and the verifier's (``verifier_timeout``,
``verifier_crashed``, ``reward_missing``) are infrastructure: the rollout re-runs the episode
(``rollout.infra_retries``) and then sends an ``infra_error``, masked, never a 0. ``agent_timeout`` is the policy's
(reward 0) unless ``rollout.agent_timeout_is: infra``. A reply with neither a command nor DONE is a format error:
the agent is told, or with ``rollout.strict_format`` the episode ends with reward 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.failures import InfraFailure, InfraReason
from pipeline.sandbox import SandboxError, SandboxSpec
from pipeline.sandbox.pool import SandboxPool
from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.chat_tokenizer import load_chat_template_text, load_chat_tokenizer
from pipeline.tasks.environment import Environment, EnvStep, Hook
from pipeline.tasks.files import shuffled_epochs
from pipeline.tasks.harbor_dirs import HarborTaskDir, admission_wait_s, hook_deadlines, load_task_dirs
from pipeline.tasks.settings import TaskSettings
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
        }
        for name, value in deadlines.items():
            if not 0 < value < math.inf:
                raise ValueError(f"harbor: {name} must be finite and > 0, got {value!r}")
        if not 0 <= admission_wait_s(settings) < math.inf:
            raise ValueError(
                f"harbor: the sandbox pool's admission wait must be finite, got {admission_wait_s(settings)!r}"
            )
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
    """One attempt at one task: its sandbox lives from `opening` to `aclose`."""

    def __init__(self, task: HarborTask, task_dir: HarborTaskDir) -> None:
        self.task = task
        self.dir = task_dir
        self._stack = contextlib.AsyncExitStack()
        self.box: SupervisedSandbox | None = None
        self._deadline = 0.0
        self.commands = 0

    def hook_timeout_s(self, hook: Hook) -> float:
        """Each hook's deadline from the task's own timeouts and the run's sandbox settings (`hook_deadlines`)."""
        return hook_deadlines(self.dir, self.task.settings)[hook]

    async def opening(self) -> EnvStep:
        spec = SandboxSpec(
            workdir="/app",
            writable=("/app", "/logs", "/tests"),
            label=self.dir.name,
        )
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

    async def final(self) -> EnvStep:
        """The episode was cut by a turn or token limit before DONE: the tests judge what the agent left."""
        return await self.verify()

    async def verify(self) -> EnvStep:
        """Kill what the agent left, copy the tests in, run them; the reward is what they wrote."""
        assert self.box is not None
        box = self.box
        try:
            await box.kill_all()
            await box.exec("rm -rf /logs/verifier /logs/home /tests/* && mkdir -p /logs/home", timeout_s=30)
            for path in sorted((self.dir.path / "tests").rglob("*")):
                if path.is_file():
                    inside = "/tests/" + path.relative_to(self.dir.path / "tests").as_posix()
                    await box.write_file(inside, path.read_bytes(), mode=0o755)
            ran = await box.exec("bash /tests/test.sh", timeout_s=self.dir.verifier_timeout_s, env=VERIFIER_ENV)
            if ran.timed_out:
                raise EpisodeFailure(
                    InfraReason.VERIFIER_TIMEOUT, f"{self.dir.name}: past {self.dir.verifier_timeout_s:g} s"
                )
            reward = await self._reward(ran.exit_code, ran.stderr)
        except SandboxError as exc:
            raise EpisodeFailure(exc.reason, exc.detail) from exc
        return EnvStep(done=True, reward=reward, info={"commands": self.commands, "verifier_exit": ran.exit_code})

    async def _reward(self, exit_code: int, stderr: str) -> float:
        assert self.box is not None
        for path in REWARD_FILES:
            try:
                raw = (await self.box.read_file(path, max_bytes=1 << 16)).decode(errors="replace").strip()
            except FileNotFoundError:
                continue
            try:
                return _parse_reward(raw, path)
            except ValueError as exc:
                raise EpisodeFailure(InfraReason.VERIFIER_CRASHED, f"{self.dir.name}: {exc}") from exc
        reason = InfraReason.VERIFIER_CRASHED if exit_code != 0 else InfraReason.REWARD_MISSING
        raise EpisodeFailure(reason, f"{self.dir.name}: no reward file (test.sh exit {exit_code}): {stderr[-300:]}")

    async def aclose(self) -> None:
        await self._stack.aclose()


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
