"""The agent-function contract: ``task.agent: "package.module:function"``.

    async def run(prompt: Prompt, client: openai.AsyncOpenAI, ctx: AgentContext) -> AgentOutcome

``client`` is already pointed at a fresh session of the generator's own endpoint
(``<endpoint>/sessions/<id>/v1``): every request the agent (or a harness it starts, handed ``ctx.base_url``)
makes on it is one turn of the episode, recorded with its exact ids, log-probs and policy versions. The
outcome carries the reward the agent's verifier wrote; a reward of None, an exception or a run past
``task.agent_timeout_s`` makes the episode an ``infra_error``: masked out of the loss and the group baseline.
A ``format_error`` outcome is reward 0 and trained on.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.wire.prompts import Prompt


@dataclass(frozen=True)
class AgentOutcome:
    """What an agent run ends with: its verifier's reward (None: no verdict), a status and free-form info."""

    reward: float | None
    status: Literal["ok", "format_error"] = "ok"
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentContext:
    """Where the agent's episode lives: the session's base URL (for a harness that takes a URL), its key
    (None on a keyless loopback endpoint), the served model name, and the run's turn limit."""

    session_id: str
    base_url: str
    api_key: str | None
    model: str
    max_tokens: int
    index: int
    """The sample's index in its group (0 .. group_size - 1)."""
    sandbox: Any = None
    """The episode's sandbox (`pipeline.sandbox.Sandbox`: ``exec``, ``write_file``, ``read_file``) when the task
    runs one (harbor); the agent works in it, and the task's tests, not the agent, then give the reward."""


AgentFunction = Callable[[Prompt, Any, AgentContext], Awaitable[AgentOutcome]]


def load_agent(target: str) -> AgentFunction:
    """``"package.module:function"`` to the function; ValueError naming `task.agent` when it is not one."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"task.agent = {target!r}: expected 'package.module:function'")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"task.agent = {target!r}: cannot import it: {exc}") from exc
    if not callable(function):
        raise ValueError(f"task.agent = {target!r} is not callable")
    return function
