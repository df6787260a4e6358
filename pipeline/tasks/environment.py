"""What a multi-turn task's environment answers: `EnvStep`, and the `Environment` protocol the rollout drives
(`pipeline/rl/rollout.py`). Here, below the RL logic, so that a task (a floor under it) can build environments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one policy reply: either the next message (text, tokenized by the rollout,
    token ids, or chat ``messages``) or ``done``. A done step with a reward makes the environment the verifier of the episode
    (``status`` ``ok`` or ``format_error``, the latter forcing reward 0); a done step without a reward lets
    `Task.verify` score the whole completion."""

    message: str | Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    """Chat messages to continue with instead of ``message`` (a user or tool turn): rendered with the model's chat
    template after the sampled reply (`ChatTemplate.bridge`), so the turn markers are the template's own and the
    sampled ids stay as they were."""
    done: bool = False
    reward: float | None = None
    status: Literal["ok", "format_error"] = "ok"
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """One episode's counterpart in a multi-turn rollout (tool, user simulator, game). Optional hooks the rollout
    calls when they exist: ``opening()`` (its first message, after the prompt), ``final()`` (its verdict on an
    episode cut by a limit before it said done: the reward of a truncated sample) and ``aclose()`` (however the
    episode ended). An exception with a ``reason`` (a sandbox's failure) names the sample's infra_error."""

    async def step(self, reply_text: str, reply_ids: np.ndarray) -> EnvStep:
        """React to the policy's reply (text with a final stop token removed; ids as sampled)."""
        ...
