"""The torch engine on mixture-of-experts models records routes where tokens are made.

Every position a request's forwards computed carries the experts each MoE layer chose there and the version of the
weights of that forward. The reference is Hugging Face's own forward, run over the same positions with a KV cache
under the weights each position's version names (so a position after an in-flight update attends over the keys
the old weights wrote, as in the engine), on a separate model: its routers must pick the same experts (as sets, a
near-tie of the router logits aside) and give the same behaviour log-probs. A second turn that reuses a kept
prefix carries only its new positions' routes; one that finds its prefix dropped (a weight update in between)
carries the recomputed prefix's, under the new version, and the engine counts those positions.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from actors.generator.engines.base import GenerateRequest, GenerateResult, SamplingParams
from actors.generator.engines.slot_runner import FastSlotRunner
from actors.generator.engines.torch_engine import TorchEngine, sampling_logprobs
from actors.models import MOE_TOP_K, build_model
from actors.moe import moe_routers

VOCAB = 21
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)
PROMPTS = ([1, 5, 6, 7, 8, 14], [1, 9, 9, 14], [1, 4, 14])
TIE = 1e-5
"""Router logits closer than this between the k-th and the (k+1)-th expert may rank either way in another kernel."""
MOE_SPECS = ["tiny-qwen3moe-2x64", "tiny-olmoe-2x64"]


def _weights(spec: str, version: int) -> dict[str, torch.Tensor]:
    """Version ``v``'s weights: a model seeded ``v`` (unrelated weights, so a route of the wrong version shows)."""
    return {
        name: t.detach().clone() for name, t in build_model(spec, vocab_size=VOCAB, seed=version).state_dict().items()
    }


class _Swap:
    """``on_decode_step``: before step ``at`` of the next busy period, update the engine to ``version``."""

    def __init__(self) -> None:
        self.engine: TorchEngine | None = None
        self.at: int | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.version = 0

    def arm(self, at: int, weights: dict[str, torch.Tensor], version: int) -> None:
        self.at, self.weights, self.version = at, weights, version

    def __call__(self, step: int) -> None:
        if step == self.at and self.engine is not None:
            self.at = None
            self.engine.update_weights(self.weights, self.version)


def _engine(spec: str, swap: _Swap | None = None, on_step: Callable[[int], None] | None = None) -> TorchEngine:
    model = build_model(spec, vocab_size=VOCAB, seed=0)
    engine = TorchEngine(model, pad_token_id=0, seed=1, on_decode_step=on_step or swap)
    assert isinstance(engine.runner, FastSlotRunner)
    if swap is not None:
        swap.engine = engine
    return engine


def _hf_forward(spec: str, ids: list[int], versions: np.ndarray) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """HF's forward over ``ids``, each run of equal ``versions`` under that version's weights on top of the KV cache
    the earlier runs wrote: (chosen experts [T, layers, k], router logits [T, layers, experts], logits [T, vocab])."""
    model = build_model(spec, vocab_size=VOCAB, seed=0)
    picked: list[list[torch.Tensor]] = [[] for _ in moe_routers(model)]
    scores: list[list[torch.Tensor]] = [[] for _ in moe_routers(model)]
    for layer, router in enumerate(moe_routers(model)):

        def keep(_module: torch.nn.Module, _args: object, out: tuple[torch.Tensor, ...], layer: int = layer) -> None:
            picked[layer].append(out[2])
            scores[layer].append(out[0])

        router.register_forward_hook(keep)
    cache, logits, start = None, [], 0
    bounds = [*np.flatnonzero(np.diff(versions)) + 1, len(ids)]
    for end in bounds:
        model.load_state_dict(_weights(spec, int(versions[start])))
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids[start:end]]), past_key_values=cache, use_cache=True)
        cache, start = out.past_key_values, end
        logits.append(out.logits[0])
    experts = torch.stack([torch.cat(chunks) for chunks in picked], dim=1).numpy()
    router_logits = torch.stack([torch.cat(chunks) for chunks in scores], dim=1).numpy()
    return experts, router_logits, torch.cat(logits)


def _assert_same_experts(routes: np.ndarray, experts: np.ndarray, router_logits: np.ndarray) -> None:
    """The same expert sets per position and layer, except where the reference's router logits nearly tie at the
    k-th place (there another kernel may rank either way)."""
    differ = (np.sort(routes, axis=-1) != np.sort(experts, axis=-1)).any(axis=-1)
    ranked = -np.sort(-router_logits, axis=-1)
    gap = ranked[..., MOE_TOP_K - 1] - ranked[..., MOE_TOP_K]
    assert (gap[differ] < TIE).all(), f"routes differ at (position, layer) {np.argwhere(differ & (gap >= TIE))}"
    assert differ.mean() < 0.05


def _check(spec: str, prompt: list[int], result: GenerateResult, earlier: np.ndarray | None = None) -> None:
    """``result``'s routes against HF's forward of its whole sequence; ``earlier``: the route versions of the
    positions before ``routes_start`` (a reused prefix: the earlier turn's)."""
    assert result.routes is not None and result.route_versions is not None
    ids = [*prompt, *result.token_ids[:-1].tolist()]
    start = result.routes_start
    assert result.routes.shape == (len(ids) - start, 2, MOE_TOP_K) and result.routes.dtype == np.uint8
    versions = result.route_versions if earlier is None else np.concatenate([earlier[:start], result.route_versions])
    assert len(versions) == len(ids)
    fed = np.arange(len(prompt) - 1, len(ids))  # the position each sampled token's logits came from
    assert (versions[fed] == result.versions).all(), "a token's version is that of the forward that made its logits"
    experts, router_logits, logits = _hf_forward(spec, ids, versions)
    _assert_same_experts(result.routes, experts[start:], router_logits[start:])
    reference = sampling_logprobs(logits[fed], PARAMS).gather(-1, torch.as_tensor(result.token_ids)[:, None].long())
    assert np.abs(reference[:, 0].numpy() - result.logprobs).mean() <= 1e-3


@pytest.mark.parametrize("spec", MOE_SPECS)
def test_every_position_carries_the_experts_and_version_of_the_forward_that_wrote_it(spec: str) -> None:
    swap = _Swap()
    late: list[Future[GenerateResult]] = []

    def act(step: int) -> None:  # a request admitted mid-way (its own prefill), then an update before step 3
        if step == 1:
            late.extend(engine.submit([GenerateRequest(PROMPTS[2], seed=9)], PARAMS))
        swap(step)

    engine = _engine(spec, swap, on_step=act)
    swap.arm(3, _weights(spec, 1), 1)
    requests = [GenerateRequest(PROMPTS[0], seed=s) for s in (1, 2, 3)] + [GenerateRequest(PROMPTS[1], seed=4)]
    results = engine.generate(requests, PARAMS)  # the three samples of PROMPTS[0] share one prefill
    results.append(late[0].result())
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1], PROMPTS[2]]
    for prompt, result in zip(prompts, results, strict=True):
        assert result.routes_start == 0
        assert result.versions.tolist() == ([0, 0, 1, 1, 1, 1] if prompt is PROMPTS[2] else [0, 0, 0, 1, 1, 1])
        _check(spec, list(prompt), result)
    np.testing.assert_array_equal(results[0].routes[: len(PROMPTS[0])], results[1].routes[: len(PROMPTS[0])])


def test_a_second_turn_carries_only_its_new_positions_under_the_version_that_computed_them() -> None:
    spec = MOE_SPECS[0]
    swap = _Swap()
    engine = _engine(spec, swap)
    swap.arm(2, _weights(spec, 1), 1)  # in flight during the first turn
    (first,) = engine.generate([GenerateRequest(PROMPTS[0], seed=3, keep_prefix=True)], PARAMS)
    _check(spec, PROMPTS[0], first)
    kept = len(PROMPTS[0]) + len(first.token_ids) - 1
    second_prompt = [*PROMPTS[0], *first.token_ids.tolist(), 9, 10, 14]
    swap.arm(2, _weights(spec, 2), 2)  # and during the second
    (second,) = engine.generate([GenerateRequest(second_prompt, seed=4, keep_prefix=True)], PARAMS)
    assert engine.prefix_stats["prefix_hits"] == 1 and engine.prefix_stats["recomputed_prefix_tokens"] == 0
    assert second.routes_start == kept
    assert set(first.route_versions.tolist()) == {0, 1} and second.route_versions[0] == 1
    assert second.route_versions[-1] == 2
    _check(spec, second_prompt, second, earlier=first.route_versions)


def test_a_second_turn_after_an_update_recomputes_its_prefix_under_the_new_version_and_counts_it() -> None:
    spec = MOE_SPECS[1]
    engine = _engine(spec)
    (first,) = engine.generate([GenerateRequest(PROMPTS[1], seed=3, keep_prefix=True)], PARAMS)
    engine.update_weights(_weights(spec, 1), 1)  # drops the kept prefix: other weights
    second_prompt = [*PROMPTS[1], *first.token_ids.tolist(), 9, 14]
    group = [GenerateRequest(second_prompt, seed=s, keep_prefix=True) for s in (4, 5)]
    second = engine.generate(group, PARAMS)
    kept = len(PROMPTS[1]) + len(first.token_ids) - 1
    assert (first.route_versions == 0).all()
    assert engine.prefix_stats["prefix_hits"] == 0 and engine.prefix_stats["recomputed_prefix_tokens"] == kept
    for result in second:
        assert result.routes_start == 0 and (result.route_versions == 1).all()
        _check(spec, second_prompt, result)


def test_a_dense_model_records_no_routes() -> None:
    engine = TorchEngine(build_model("tiny-llama-2x64", vocab_size=VOCAB, seed=0), pad_token_id=0)
    assert engine.runner.recorder is None
    (result,) = engine.generate([GenerateRequest(PROMPTS[0], seed=1)], PARAMS)
    assert result.routes is None and result.route_versions is None and result.routes_start == 0


def test_the_generic_runner_records_the_same_routes_as_the_fast_one() -> None:
    spec = MOE_SPECS[0]
    fast = _engine(spec)
    slow = TorchEngine(build_model(spec, vocab_size=VOCAB, seed=0), pad_token_id=0, seed=1, fast_forward=False)
    requests = [GenerateRequest(PROMPTS[0], seed=s) for s in (1, 2)] + [GenerateRequest(PROMPTS[1], seed=3)]
    for a, b in zip(fast.generate(requests, PARAMS), slow.generate(requests, PARAMS), strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.routes, b.routes)
        np.testing.assert_array_equal(a.route_versions, b.route_versions)
