"""skyrl-gym's multi-turn environments through Leeway's rollout, offline: the environment's observations are
chat messages rendered with the model's chat template after the sampled reply (the sampled ids untouched, the
environment's turns masked), its done step's reward is the episode's, and its verifier passes the self-check."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from actors.generator.engines.base import GenerateRequest, GenerateResult, SamplingParams
from pipeline.chat.template import ChatTemplate
from pipeline.rl.scoring import run_group
from pipeline.tasks import VerifierPool, get_task
from pipeline.tasks.chat_tokenizer import load_chat_template_text
from pipeline.tasks.self_check import self_check

ROWS = [
    {"id": "q-0", "messages": [{"role": "user", "content": "What is 6*7?"}], "answer": "42"},
    {"id": "q-1", "prompt": "What is 2+3?", "answer": "5"},
]


def _task(tmp_path: Path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return get_task("skyrl_gym", env="gsm8k_multi_turn", path=str(path), max_turns=3, answer_template="#### {answer}")


class _Replies:
    """The engine's side of the episode, scripted: each request answered with the next reply, then <eos>."""

    def __init__(self, tokenizer, texts: Sequence[str], eos: int) -> None:
        self.tokenizer, self.texts, self.eos = tokenizer, list(texts), eos
        self.requests: list[GenerateRequest] = []

    def __call__(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        self.requests.extend(requests)
        out = []
        for _ in requests:
            ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False).ids + [self.eos]
            n = len(ids)
            out.append(
                GenerateResult(np.asarray(ids, np.int32), np.full(n, -0.5, np.float32), np.full(n, 4, np.int32), "stop")
            )
        return out


def test_a_gsm8k_multi_turn_episode_bridges_the_environment_s_messages_and_takes_its_reward(tmp_path: Path) -> None:
    task = _task(tmp_path)
    template = ChatTemplate(task.tokenizer, load_chat_template_text(), eos_token="<eos>", bos_token="<bos>")
    eos = task.tokenizer.token_to_id("<eos>")
    prompt = next(p for p in itertools.islice(task.prompts(), 2) if p.prompt_id == "q-0")
    engine = _Replies(task.tokenizer, ["I think 41", "#### 42"], eos)
    sampling = SamplingParams(max_new_tokens=16, stop_token_ids=(eos,))
    with VerifierPool() as pool:
        pool.attach(task)  # its environments live in the pool's workers
        (sample,) = asyncio.run(
            run_group(
                engine,
                task,
                prompt,
                1,
                sampling,
                task.environment,
                tokenizer=task.tokenizer,
                verifiers=pool,
                template=template,
            )
        )
    assert sample.status == "ok" and sample.reward == 1.0 and sample.num_turns == 2
    first, second = (list(r.input_ids) for r in engine.requests)
    opening = template.render(prompt.messages)
    reply = task.tokenizer.encode("I think 41", add_special_tokens=False).ids + [eos]
    hint = "Please provide your step-by-step reasoning, and also include a tentative numeric answer at the end in the exact format: '#### ANSWER'."
    bridge = template.bridge([{"role": "user", "content": hint}], ended_with_eos=True)
    assert (
        first == opening and second == opening + reply + bridge
    )  # the environment's turn in the template's own markers
    assert sample.tokens.tolist() == second + task.tokenizer.encode("#### 42", add_special_tokens=False).ids + [eos]
    policy = sample.tokens[sample.loss_mask == 1].tolist()
    assert policy == reply + task.tokenizer.encode("#### 42", add_special_tokens=False).ids + [eos]


def test_without_a_chat_template_the_environment_s_messages_are_an_infra_error(tmp_path: Path) -> None:
    task = _task(tmp_path)
    eos = task.tokenizer.token_to_id("<eos>")
    prompt = next(p for p in itertools.islice(task.prompts(), 2) if p.prompt_id == "q-1")
    sampling = SamplingParams(max_new_tokens=16, stop_token_ids=(eos,))
    with VerifierPool() as pool:
        pool.attach(task)  # its environments live in the pool's workers
        (sample,) = asyncio.run(
            run_group(
                _Replies(task.tokenizer, ["no idea"], eos),
                task,
                prompt,
                1,
                sampling,
                task.environment,
                tokenizer=task.tokenizer,
                verifiers=pool,
            )
        )
    assert sample.status == "infra_error" and sample.reward is None and "no chat template" in sample.info["error"]


def test_the_skyrl_gym_verifier_passes_the_self_check(tmp_path: Path) -> None:
    task = _task(tmp_path)

    async def main() -> list[str]:
        with VerifierPool(timeout_s=30.0) as pool:
            return [f.problem for f in await self_check(task, list(itertools.islice(task.prompts(), 2)), pool)]

    assert asyncio.run(main()) == []
