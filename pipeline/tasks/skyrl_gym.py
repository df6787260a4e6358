"""Built-in task ``skyrl_gym``: a multi-turn text environment of the skyrl-gym library (the optional extra
``leeway[envs]``), one environment per sample, through Leeway's multi-turn rollout.

    task:
      name: skyrl_gym
      args: {env: gsm8k_multi_turn, path: data/gsm8k.jsonl, max_turns: 3, answer_template: "#### {answer}"}

Prompts come from a prompts file (`pipeline.tasks.load_prompts`: ``prompt`` or ``messages``, and ``answer``,
the ground truth the environment scores against as its ``reward_spec``). For each sample the task makes the
environment (``skyrl_gym.make(env, env_config, extras={"reward_spec": {"ground_truth": answer}, "max_turns"})``)
and hands it the prompt as a chat (``init``). Each policy reply goes to its ``step``; the observations it
answers with are chat messages, which the rollout renders with the model's chat template after the sampled
reply (`EnvStep.messages`: the template's own turn markers, the sampled ids untouched). The episode's reward is
the reward of the step that says ``done``. An episode that ends another way (Leeway's turn or token limit) is
scored by `verify`: one fresh environment, stepped once with the whole completion.

Environments read the policy's replies, so they live in scorer workers (`pipeline/tasks/verifiers.py`): the
generator attaches the task to its `VerifierPool` (`VerifierPool.attach`), each episode opens its environment in
one worker (`SkyRLScorer`, rebuilt from the env's name and config: no prompts file) and sends it its steps. A step
past the pool's deadline kills that worker: the episode is the policy's failure (reward 0, ``info["error"] =
"scorer_timeout"``), the other episodes on it end ``scorer_lost`` (masked). A ``step`` that raises is an
``infra_error`` (the environment's failure, not the policy's).

Environments that execute the reply or reach the network (`REFUSED_ENVS`: ``lcb``, ``searchcode``, ``search``,
``text2sql``, ``rlm``) are refused by name when the task is built: no worker may run them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.failures import InfraFailure, InfraReason
from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.char_tokenizer import alphabet_tokenizer
from pipeline.tasks.environment import Environment, EnvStep
from pipeline.tasks.files import load_prompts, shuffled_epochs
from pipeline.tasks.scorer_process import ScorerLost, ScorerTimeout
from pipeline.tasks.scorer_recipe import ScorerRecipe
from pipeline.wire.prompts import Prompt

if TYPE_CHECKING:
    from pipeline.tasks.scorer_process import WorkerSlot
    from pipeline.tasks.verifiers import VerifierPool

REFUSED_ENVS = {
    "lcb": "it runs the reply's code (LiveCodeBench tests) in a subprocess of the scorer",
    "searchcode": "it runs the reply's Python in a subprocess (its python tool)",
    "search": "it sends the reply's queries to a retrieval server over the network",
    "text2sql": "it runs the reply's SQL against database files of the host",
    "rlm": "it exec()s the reply's code in the scorer's own interpreter",
}
"""skyrl-gym environments no scorer worker runs, and why: each executes model output or needs the network or the
host's files, which a worker never has; run such an environment as a sandboxed task (Harbor) instead."""
_episode_ids = itertools.count()


class SkyRLGymTask(Task):
    """One skyrl-gym environment over a prompts file; see the module docstring."""

    name = "skyrl_gym"
    multi_turn = True

    def __init__(
        self,
        env: str,
        path: str,
        eval_path: str | None = None,
        env_config: Mapping[str, Any] | None = None,
        max_turns: int = 3,
        answer_template: str = "{answer}",
        reward_range: Sequence[float] | None = (0.0, 1.0),
        seed: int = 0,
        tokenizer: str = "text",
    ) -> None:
        try:
            import skyrl_gym
        except ImportError as exc:
            raise ValueError(f"task skyrl_gym needs the skyrl-gym package: pip install 'leeway[envs]' ({exc})") from exc
        if max_turns < 1:
            raise ValueError(f"skyrl_gym: task.args.max_turns must be >= 1, got {max_turns}")
        if "{answer}" not in answer_template:
            raise ValueError(f"skyrl_gym: task.args.answer_template must hold '{{answer}}', got {answer_template!r}")
        if env in REFUSED_ENVS:
            raise ValueError(
                f"skyrl_gym: environment {env!r} is refused: {REFUSED_ENVS[env]}. Model output never runs outside a "
                "sandbox; a scorer worker has no network and no host files"
            )
        self._make_env = skyrl_gym.make
        self.env_name = env
        self.env_config = dict(env_config or {})
        self.max_turns = max_turns
        self.answer_template = answer_template
        self.reward_range = None if reward_range is None else (float(reward_range[0]), float(reward_range[1]))
        self._prompts = load_prompts(path)
        if not self._prompts:
            raise ValueError(f"skyrl_gym: task.args.path {path} has no rows")
        missing = [p.prompt_id for p in self._prompts if p.answer is None]
        if missing:
            raise ValueError(
                f"skyrl_gym: every row of {path} needs an 'answer' (the ground truth); {missing[0]} has none"
            )
        self._eval = load_prompts(eval_path) if eval_path is not None else None
        self._seed = seed
        self.tokenizer = alphabet_tokenizer(tokenizer)
        self.scorer_recipe = ScorerRecipe(
            "pipeline.tasks.skyrl_gym:SkyRLScorer",
            {"env": env, "env_config": self.env_config, "max_turns": max_turns, "reward_range": self.reward_range},
        )
        self.scorers: VerifierPool | None = None
        """The pool whose workers hold this task's environments (`use_scorers`)."""
        make_environment(self._make_env, env, self.env_config, max_turns, self._prompts[0])  # bad names fail here

    def use_scorers(self, pool: VerifierPool) -> None:
        """Run this task's environments in `pool`'s workers (`VerifierPool.attach` calls it)."""
        self.scorers = pool

    def prompts(self) -> Iterator[Prompt]:
        return shuffled_epochs(self._prompts, f"skyrl_gym-{self.env_name}-{self._seed}")

    def eval_prompts(self) -> list[Prompt] | None:
        return None if self._eval is None else list(self._eval)

    def completion_for(self, answer: str) -> str:
        return self.answer_template.format(answer=answer)

    def environment(self, prompt: Prompt) -> SkyRLEpisode:
        if self.scorers is None:
            raise InfraFailure(
                f"skyrl_gym {self.env_name}: no scorer workers: attach the task to a VerifierPool "
                "(pool.attach(task)) before its episodes run",
                reason=InfraReason.SCORER_LOST,
            )
        return SkyRLEpisode(self.scorers, self.scorer_recipe, prompt)

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        return SkyRLScorer(self.env_name, self.env_config, self.max_turns, self.reward_range).verify(
            prompt, completion_text, completion_ids
        )


def make_environment(make: Any, name: str, config: Mapping[str, Any], max_turns: int, prompt: Prompt) -> Any:
    """A fresh skyrl-gym environment for `prompt`, already given the prompt as its opening chat."""
    try:
        env = make(
            name,
            env_config=dict(config),
            extras={"reward_spec": {"ground_truth": prompt.answer}, "max_turns": max_turns},
        )
    except Exception as exc:
        raise ValueError(
            f"skyrl_gym: cannot make environment {name!r} with task.args.env_config={config}: {exc}"
        ) from exc
    env.init(list(prompt.messages) if prompt.messages is not None else [{"role": "user", "content": prompt.text}])
    return env


class SkyRLScorer:
    """What a scorer worker builds for the task: its environments and its verifier, from the env's name alone."""

    def __init__(
        self,
        env: str,
        env_config: Mapping[str, Any] | None = None,
        max_turns: int = 3,
        reward_range: Sequence[float] | None = None,
    ) -> None:
        if env in REFUSED_ENVS:
            raise ValueError(f"skyrl_gym: environment {env!r} is refused: {REFUSED_ENVS[env]}")
        import skyrl_gym

        self._make = skyrl_gym.make
        self.env, self.env_config, self.max_turns = env, dict(env_config or {}), max_turns
        self.reward_range = None if reward_range is None else (float(reward_range[0]), float(reward_range[1]))

    def open_environment(self, prompt: Prompt) -> Any:
        return make_environment(self._make, self.env, self.env_config, self.max_turns, prompt)

    def step_environment(self, env: Any, text: str) -> dict[str, Any]:
        """One step, as JSON: done, reward, the observations (chat messages) and the metadata's plain values."""
        out = env.step(text)
        info = {k: v for k, v in (out.get("metadata") or {}).items() if isinstance(v, str | int | float | bool)}
        observations = [dict(m) for m in out.get("observations") or []]
        return {"done": bool(out["done"]), "reward": out.get("reward"), "messages": observations, "info": info}

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        out = self.open_environment(prompt).step(completion_text)
        return VerifierResult(float(out["reward"]))


class SkyRLEpisode(Environment):
    """One sample's environment, living in a scorer worker; the rollout drives this proxy
    (`pipeline.tasks.environment.Environment`)."""

    def __init__(self, pool: VerifierPool, recipe: ScorerRecipe, prompt: Prompt) -> None:
        self.pool, self.recipe, self.prompt = pool, recipe, prompt
        self.env_id = f"episode-{next(_episode_ids)}"
        self._slot: WorkerSlot | None = None
        self._generation = 0

    async def opening(self) -> EnvStep | None:
        request = {"op": "env_open", "recipe": self.recipe.to_json(), "prompt": self.prompt.to_json().decode()}
        try:
            self._slot, self._generation, reply = await self.pool.run(
                self.pool.request, self.recipe, {**request, "env": self.env_id}
            )
        except ScorerTimeout as exc:
            raise InfraFailure(f"opening the environment: {exc}", reason=InfraReason.SCORER_LOST) from None
        _raise_error(reply)
        return None

    async def step(self, reply_text: str, reply_ids: np.ndarray) -> EnvStep:
        if self._slot is None:
            raise ScorerLost("this episode's environment was never opened")
        request = {"op": "env_step", "env": self.env_id, "text": reply_text}
        try:
            _, _, reply = await self.pool.run(
                self.pool.request, self.recipe, request, slot=self._slot, generation=self._generation
            )
        except ScorerTimeout as exc:  # this reply hung the environment: the policy's failure
            return EnvStep(done=True, reward=0.0, info={"error": "scorer_timeout", "detail": str(exc)})
        _raise_error(reply)
        out = reply["step"]
        if out["done"]:
            return EnvStep(done=True, reward=float(out["reward"]), info=out["info"])
        return EnvStep(messages=out["messages"] or None, info=out["info"])

    async def aclose(self) -> None:
        if self._slot is None:
            return
        request = {"op": "env_close", "env": self.env_id}
        try:
            await self.pool.run(self.pool.request, self.recipe, request, slot=self._slot, generation=self._generation)
        except (ScorerLost, ScorerTimeout):
            return


def _raise_error(reply: dict[str, Any]) -> None:
    if "error" in reply:
        raise InfraFailure(f"skyrl-gym environment: {reply['error']}", reason=InfraReason.ENVIRONMENT_ERROR)
