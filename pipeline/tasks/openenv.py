"""Built-in task ``openenv``: episodes against an OpenEnv environment server, one session per sample, through the
openenv package's own client (``GenericEnvClient``: ``reset``/``step`` over the server's WebSocket).

    task:
      name: openenv
      args: {url: "http://127.0.0.1:8000", action_field: message, observation_field: prompt, max_sessions: 8}

The server chooses the episode: prompt ``i`` is the episode that ``reset(seed)`` opens, with seed ``seed + i``
(``seed + EVAL_SEED_OFFSET + i`` for the eval split). The prompt itself holds only the task's ``instructions`` (a
system message with ``chat: true``, else text); the server's opening observation follows it as the episode's first
turn (`OpenEnvEpisode.opening`, its `Environment.opening`), so it never has to be fetched where prompts are made.
Each policy reply becomes the action ``{action_field: reply}`` (or, with ``action: json``, the reply parsed as a
JSON object: a reply that is not one ends the episode as a ``format_error``, reward 0); each observation goes back
as the next user turn (``observation_field``, else the observation as JSON), as a chat message through the model's
chat template with ``chat: true``. The reward is the one the server gives with ``done``. An episode cut by Leeway's
turn or token limit before the server said ``done`` scores 0 (``format_error``: the policy did not finish). A server
that cannot be reached, refuses the session or drops the socket mid-episode makes the sample an ``infra_error`` (its
state is on the server: the episode cannot go on in a new session); the next episode opens a new connection. At most
``max_sessions`` episodes hold a session at once (the server's capacity; the others wait), and a session is closed
when its episode ends, however it ends.

The verifier self-check does not apply: rewards come from the server, and there are no reference answers.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import orjson

from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.char_tokenizer import alphabet_tokenizer
from pipeline.tasks.environment import Environment, EnvStep
from pipeline.wire.prompts import Prompt

EVAL_SEED_OFFSET = 1_000_003
DEFAULT_INSTRUCTIONS = "Act in the environment. Reply with your action only."
ACTION_FORMATS = ("text", "json")


class OpenEnvTask(Task):
    """Episodes of one OpenEnv server; see the module docstring."""

    name = "openenv"
    multi_turn = True
    self_check = False
    verifies_in_workers = False
    """`verify` only scores a cut episode 0; the server's verdicts are the rewards."""

    def __init__(
        self,
        url: str,
        action_field: str = "message",
        action: str = "text",
        observation_field: str | None = None,
        instructions: str = DEFAULT_INSTRUCTIONS,
        chat: bool = False,
        seed: int = 0,
        eval_size: int = 0,
        max_sessions: int = 8,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        reward_range: Sequence[float] | None = None,
        tokenizer: str = "text",
    ) -> None:
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ImportError as exc:
            raise ValueError(
                "task openenv needs the openenv package: pip install 'leeway[envs]' and "
                f"pip install --no-deps openenv==0.10.0 ({exc})"
            ) from exc
        if action not in ACTION_FORMATS:
            raise ValueError(f"openenv: task.args.action must be one of {ACTION_FORMATS}, got {action!r}")
        if max_sessions < 1:
            raise ValueError(f"openenv: task.args.max_sessions must be >= 1, got {max_sessions}")
        if not url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"openenv: task.args.url must be an http(s):// or ws(s):// URL, got {url!r}")
        self._client_class = GenericEnvClient
        self.url = url
        self.action_field = action_field
        self.action = action
        self.observation_field = observation_field
        self.instructions = instructions
        self.chat = chat
        self.seed = seed
        self.eval_size = eval_size
        self.connect_timeout_s = connect_timeout_s
        self.message_timeout_s = message_timeout_s
        self.max_sessions = max_sessions
        self.reward_range = None if reward_range is None else (float(reward_range[0]), float(reward_range[1]))
        self.tokenizer = alphabet_tokenizer(tokenizer)
        self._sessions: asyncio.Semaphore | None = None
        self._sessions_loop: asyncio.AbstractEventLoop | None = None

    # ---- prompts -------------------------------------------------------------------------------

    def prompts(self) -> Iterator[Prompt]:
        for i in itertools.count():
            yield self._prompt("train", self.seed + i)

    def eval_prompts(self) -> list[Prompt] | None:
        if not self.eval_size:
            return None
        return [self._prompt("eval", self.seed + EVAL_SEED_OFFSET + i) for i in range(self.eval_size)]

    def _prompt(self, split: str, seed: int) -> Prompt:
        content: dict[str, Any] = (
            {"messages": ({"role": "system", "content": self.instructions},)}
            if self.chat
            else {"text": self.instructions}
        )
        return Prompt(
            prompt_id=f"openenv-{split}-s{seed}",
            metadata={"seed": seed, "split": split},
            tags=("openenv", split),
            **content,
        )

    # ---- episodes ------------------------------------------------------------------------------

    def environment(self, prompt: Prompt) -> OpenEnvEpisode:
        seed = prompt.metadata.get("seed")
        if not isinstance(seed, int):
            raise ValueError(f"openenv: prompt {prompt.prompt_id!r} has no integer seed: it was not made by this task")
        return OpenEnvEpisode(self, seed)

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        """Only for an episode Leeway cut before the server said ``done``: the policy did not finish."""
        return VerifierResult(0.0, "format_error", {"reason": "the episode ended before the environment was done"})

    def sessions(self) -> asyncio.Semaphore:
        """The bound on open sessions, in the event loop the episodes run in."""
        loop = asyncio.get_running_loop()
        if self._sessions is None or self._sessions_loop is not loop:
            self._sessions, self._sessions_loop = asyncio.Semaphore(self.max_sessions), loop
        return self._sessions

    def observation_message(self, observation: Any) -> EnvStep:
        if isinstance(observation, dict) and self.observation_field is not None:
            if self.observation_field not in observation:
                raise ValueError(
                    f"openenv: the observation has no field {self.observation_field!r}: {sorted(observation)}"
                )
            text = str(observation[self.observation_field])
        else:
            shown = (
                {k: v for k, v in observation.items() if k != "metadata"}
                if isinstance(observation, dict)
                else observation
            )
            text = orjson.dumps(shown, default=str).decode()
        return EnvStep(messages=[{"role": "user", "content": text}]) if self.chat else EnvStep(message=text)


class OpenEnvEpisode(Environment):
    """One sample's session on the server (`pipeline.tasks.environment.Environment`, with an opening and a close)."""

    def __init__(self, task: OpenEnvTask, seed: int) -> None:
        self.task = task
        self.seed = seed
        self.client: Any = None
        self._slot: asyncio.Semaphore | None = None

    async def opening(self) -> EnvStep:
        slot = self.task.sessions()
        await slot.acquire()
        self._slot = slot
        self.client = self.task._client_class(
            base_url=self.task.url,
            connect_timeout_s=self.task.connect_timeout_s,
            message_timeout_s=self.task.message_timeout_s,
        )
        await self.client.connect()
        result = await self.client.reset(seed=self.seed)
        return self.task.observation_message(result.observation)

    async def step(self, reply_text: str, reply_ids: np.ndarray) -> EnvStep:
        action: Any
        if self.task.action == "json":
            try:
                action = orjson.loads(reply_text)
            except orjson.JSONDecodeError:
                action = None
            if not isinstance(action, dict):
                return EnvStep(
                    done=True, reward=0.0, status="format_error", info={"reason": "the reply is not a JSON object"}
                )
        else:
            action = {self.task.action_field: reply_text}
        result = await self.client.step(action)
        if result.done:
            return EnvStep(done=True, reward=float(result.reward or 0.0))
        return self.task.observation_message(result.observation)

    async def aclose(self) -> None:
        try:
            if self.client is not None:
                await self.client.close()
        finally:
            self.client = None
            if self._slot is not None:
                self._slot.release()
                self._slot = None
