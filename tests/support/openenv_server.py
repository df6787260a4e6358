"""A real OpenEnv server (the openenv package's own `create_app` under uvicorn) on a free loopback port, in a thread
of the test process, serving `GuessDigit`: reset(seed) picks the digit ``seed % 10``; each step takes
``{"message": "<digit>"}`` and answers ``higher``/``lower``, until the right digit (reward 1) or the third try
(reward 0). It counts the sessions open at once, so a test can check the client's bound."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

TRIES = 3


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""


class Sessions:
    """How many GuessDigit environments are alive now, and the most there ever were."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.opened = 0

    def open(self) -> None:
        with self.lock:
            self.now += 1
            self.opened += 1
            self.most = max(self.most, self.now)

    def close(self) -> None:
        with self.lock:
            self.now -= 1


SESSIONS = Sessions()


class GuessDigit(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="", step_count=0)
        self.target = 0
        SESSIONS.open()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.target = (seed or 0) % 10
        self._state = State(episode_id=episode_id or f"guess-{seed}", step_count=0)
        return GuessObservation(prompt="Guess a digit.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        guess = action.message.strip()
        if guess == str(self.target):
            return GuessObservation(prompt="right", done=True, reward=1.0)
        if self._state.step_count >= TRIES:
            return GuessObservation(prompt="out of tries", done=True, reward=0.0)
        higher = guess.isdigit() and int(guess) < self.target
        return GuessObservation(prompt="higher" if higher else "lower", reward=0.0)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        SESSIONS.close()


@contextlib.contextmanager
def guess_server(max_sessions: int = 8) -> Iterator[str]:
    """The server's base URL while it runs."""
    app = create_app(GuessDigit, GuessAction, GuessObservation, max_concurrent_envs=max_sessions)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="openenv-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the OpenEnv test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
