"""OpenEnv environments through Leeway's rollout, against a real OpenEnv server (the openenv package's `create_app`
under uvicorn on 127.0.0.1) and the package's own client: the server's opening observation follows the prompt,
each reply is an action and each observation the next turn, the reward is the server's; sessions are bounded and
closed; an unreachable server is an infra error, a reply that is no action a format error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np
import pytest

from actors.generator.engines.base import GenerateRequest, GenerateResult, SamplingParams
from pipeline.rl.scoring import run_group
from pipeline.tasks import VerifierPool, get_task

# `make test` installs openenv; only a machine that did not (the GPU check's `-m gpu` collection) lacks it
pytest.importorskip("openenv", reason="openenv is installed by `make test` (pip install --no-deps openenv==0.10.0)")
from tests.support.openenv_server import SESSIONS, guess_server


class _Replies:
    """The engine's side, scripted per episode seed: each request of an episode answered with its next reply."""

    def __init__(self, tokenizer, eos: int, replies: Sequence[str]) -> None:
        self.tokenizer, self.eos, self.replies = tokenizer, eos, list(replies)
        self.requests: list[GenerateRequest] = []

    def __call__(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        self.requests.extend(requests)
        out = []
        for request in requests:
            turn = sum(1 for r in self.requests if r.request_id == request.request_id) - 1
            ids = self.tokenizer.encode(self.replies[min(turn, len(self.replies) - 1)], add_special_tokens=False).ids
            ids = [*ids, self.eos]
            n = len(ids)
            out.append(
                GenerateResult(np.asarray(ids, np.int32), np.full(n, -0.5, np.float32), np.full(n, 2, np.int32), "stop")
            )
        return out


def _episodes(task, replies: Sequence[str], group_size: int = 1, seed_index: int = 7, **kwargs):
    eos = task.tokenizer.token_to_id("<eos>")
    prompt = next(p for i, p in enumerate(task.prompts()) if i == seed_index)
    engine = _Replies(task.tokenizer, eos, replies)
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=(eos,))
    with VerifierPool() as pool:
        samples = asyncio.run(
            run_group(
                engine,
                task,
                prompt,
                group_size,
                sampling,
                task.environment,
                tokenizer=task.tokenizer,
                verifiers=pool,
                **kwargs,
            )
        )
    return prompt, engine, samples


def _wait_closed() -> None:
    deadline = time.monotonic() + 30
    while SESSIONS.now and time.monotonic() < deadline:  # the server closes a session after its socket closes
        time.sleep(0.02)
    assert SESSIONS.now == 0


def test_an_episode_plays_against_the_server_and_takes_its_reward() -> None:
    with guess_server() as url:
        task = get_task("openenv", url=url, observation_field="prompt", seed=0)
        prompt, engine, (sample,) = _episodes(task, ["3", "7"])  # seed 7: the digit is 7
        _wait_closed()
    assert prompt.metadata["seed"] == 7 and sample.status == "ok" and sample.reward == 1.0 and sample.num_turns == 2
    encode = lambda text: task.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    eos = task.tokenizer.token_to_id("<eos>")
    opening = task.tokenizer.encode(prompt.text).ids + encode("Guess a digit.")
    first, second = (list(r.input_ids) for r in engine.requests)
    assert first == opening  # the server's opening observation after the prompt, before the first reply
    assert second == opening + encode("3") + [eos] + encode("higher")
    assert sample.tokens[sample.loss_mask == 1].tolist() == encode("3") + [eos] + encode("7") + [eos]


def test_sessions_are_bounded_and_closed_and_a_cut_episode_scores_zero() -> None:
    with guess_server() as url:
        task = get_task("openenv", url=url, observation_field="prompt", max_sessions=2)
        SESSIONS.most = 0
        opened = SESSIONS.opened
        _, _, samples = _episodes(task, ["0", "1", "2"], group_size=6, seed_index=9)  # never right: out of tries
        assert [s.reward for s in samples] == [0.0] * 6 and {s.status for s in samples} == {"ok"}
        assert SESSIONS.opened - opened == 6 and SESSIONS.most <= 2
        _, _, (cut,) = _episodes(task, ["0"], max_turns=1, seed_index=9)  # Leeway's limit before the server's
        assert cut.status == "format_error" and cut.reward == 0.0
        _wait_closed()


def test_an_unreachable_server_is_an_infra_error_and_a_reply_that_is_no_action_a_format_error() -> None:
    with guess_server() as url:
        json_task = get_task("openenv", url=url, action="json")
        _, _, (bad,) = _episodes(json_task, ["7 please"])
        assert bad.status == "format_error" and bad.reward == 0.0
        _wait_closed()
    gone = get_task("openenv", url=url, connect_timeout_s=2.0)  # the server has stopped
    _, _, (lost,) = _episodes(gone, ["7"])
    assert lost.status == "infra_error" and lost.reward is None and "environment" in lost.info["error"]
