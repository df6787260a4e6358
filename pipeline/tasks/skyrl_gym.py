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

The environment's calls are plain functions (skyrl-gym's ``step`` is synchronous); they run on a thread so a
slow one does not hold the generator's event loop, under the rollout's ``env_timeout_s``. A ``step`` that
raises is an ``infra_error`` (the environment's failure, not the policy's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.char_tokenizer import alphabet_tokenizer
from pipeline.tasks.environment import Environment, EnvStep
from pipeline.tasks.files import load_prompts, shuffled_epochs
from pipeline.wire.prompts import Prompt


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
        self._env(self._prompts[0])  # an unknown env name or a bad env_config fails here, naming the task

    def prompts(self) -> Iterator[Prompt]:
        return shuffled_epochs(self._prompts, f"skyrl_gym-{self.env_name}-{self._seed}")

    def eval_prompts(self) -> list[Prompt] | None:
        return None if self._eval is None else list(self._eval)

    def completion_for(self, answer: str) -> str:
        return self.answer_template.format(answer=answer)

    def environment(self, prompt: Prompt) -> SkyRLEpisode:
        return SkyRLEpisode(self._env(prompt))

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        out = self._env(prompt).step(completion_text)
        return VerifierResult(float(out["reward"]))

    def _env(self, prompt: Prompt) -> Any:
        """A fresh environment for `prompt`, already given the prompt as its opening chat."""
        try:
            env = self._make_env(
                self.env_name,
                env_config=dict(self.env_config),
                extras={"reward_spec": {"ground_truth": prompt.answer}, "max_turns": self.max_turns},
            )
        except Exception as exc:
            raise ValueError(
                f"skyrl_gym: cannot make environment {self.env_name!r} with task.args.env_config={self.env_config}: {exc}"
            ) from exc
        env.init(list(prompt.messages) if prompt.messages is not None else [{"role": "user", "content": prompt.text}])
        return env


class SkyRLEpisode(Environment):
    """One sample's environment, as Leeway's rollout drives it (`pipeline.tasks.environment.Environment`)."""

    def __init__(self, env: Any) -> None:
        self.env = env

    async def step(self, reply_text: str, reply_ids: np.ndarray) -> EnvStep:
        out = await asyncio.to_thread(self.env.step, reply_text)
        info = {k: v for k, v in (out.get("metadata") or {}).items() if isinstance(v, str | int | float | bool)}
        if out["done"]:
            return EnvStep(done=True, reward=float(out["reward"]), info=info)
        observations = [dict(m) for m in out.get("observations") or []]
        return EnvStep(messages=observations or None, info=info)
