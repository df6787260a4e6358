"""What a multi-turn task's environment answers: `EnvStep`, and the `Environment` base class the rollout drives
(`pipeline/rl/episodes.py`). Here, below the RL logic, so that a task (a floor under it) can build environments."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Hook = Literal["opening", "step", "final", "aclose"]
"""The environment calls the rollout makes, each under a deadline (`Environment.hook_timeout_s`)."""


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one policy reply: either the next message (text, tokenized by the rollout,
    token ids, or chat ``messages``) or ``done``. A done step with a reward makes the environment the verifier of the episode
    (``status`` ``ok`` or ``format_error``, the latter forcing reward 0); a done step without a reward lets
    `Task.verify` score the whole completion. Special-token text in a text message stays text (only the
    template's scaffold makes turn markers); an environment that means a special token gives ids."""

    message: str | Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    """Chat messages to continue with instead of ``message`` (a user or tool turn): rendered with the model's chat
    template after the sampled reply (`ChatTemplate.bridge`), so the turn markers are the template's own and the
    sampled ids stay as they were."""
    done: bool = False
    reward: float | None = None
    status: Literal["ok", "format_error"] = "ok"
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One episode's counterpart in a multi-turn rollout (tool, user simulator, game, sandbox); a task makes a fresh
    one per sample (`Task.environment`). The rollout calls, in order: `opening` once, then `step` after each policy
    reply until a step is ``done`` or a limit cuts the episode (then `final`), and `aclose` however the episode ended.
    A hook raising an `pipeline.failures.InfraFailure` names the sample's ``infra_error`` by its ``reason``; any
    other exception is an ``environment_error``, a hook past its deadline (`hook_timeout_s`) an
    ``environment_timeout``. A reward a hook returns is checked like a verifier's: not a finite number
    (``reward_invalid``) or outside the task's ``reward_range`` (``reward_out_of_range``) fails its sample alone."""

    @abstractmethod
    async def step(self, reply_text: str, reply_ids: np.ndarray) -> EnvStep:
        """React to the policy's reply (text with a final stop token removed; ids as sampled)."""

    async def opening(self) -> EnvStep | None:
        """The environment's first message, placed after the prompt before the first reply (a sandbox's welcome,
        a game's first observation), or None: the prompt alone opens the episode."""
        return None

    async def final(self) -> EnvStep | None:
        """The verdict on an episode cut by a limit before a step said ``done`` (a sandbox's tests: the reward of
        a truncated sample), or None: the task's verifier scores the completion."""
        return None

    def hook_timeout_s(self, hook: Hook) -> float | None:
        """The longest `hook` may take, when this environment knows it, or None: the rollout's ``env_timeout_s``.

        An environment whose operations have deadlines of their own (a sandbox's: a command's, the tests', a wait
        for a slot, all from its task and the run's config) declares their sum here, so a task whose tests may
        run ten minutes is not cut at a fixed minute; the rollout's deadline is then a backstop that fires only
        when an inner deadline failed to. Must be finite and above zero."""
        return None

    async def aclose(self) -> None:
        """Release what the episode held (a sandbox, a server session); called once, however the episode ended."""
        return None
