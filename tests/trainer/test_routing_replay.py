"""Routing replay (R3) in the torch backend: the sampler's routes reach the trainer's forward, the router still
learns, unrouted positions follow the documented rule, replay off only measures; and `leeway bench moe`."""

from __future__ import annotations

import argparse
import copy

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from actors.models import build_model
from actors.moe import RouteRecorder, moe_routers
from actors.tools.bench.moe import perturbed, recorded_batch, run, tiny_qwen3_moe
from actors.trainer.backends import LossExtras, MicroBatch, TrainBatch, TrainSequence
from actors.trainer.backends.torch_backend import TorchBackend
from actors.trainer.objective import CorrectedObjective
from actors.trainer.rank_group import decode_batch, encode_batch
from pipeline.config import AdvantagesConfig, CorrectionConfig
from pipeline.rl.step_metrics import merge_loss_stats

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS, TOP_K, EXPERTS, PROMPT = 2, 2, 8, 4


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return tiny_qwen3_moe(layers=LAYERS, hidden=64, experts=EXPERTS, top_k=TOP_K, seed=0)


@pytest.fixture(scope="module")
def sampled(model: nn.Module) -> dict[str, np.ndarray]:
    """Three sequences sampled and recorded by a router-perturbed copy: many routes differ from the trainer's."""
    sampler = perturbed(model, 0.0, 0.5, seed=1)
    prompts = torch.randint(0, model.config.vocab_size, (3, PROMPT), generator=torch.Generator().manual_seed(0))
    return recorded_batch(sampler, prompts, new_tokens=8, seed=0)


def _sequences(sampled: dict[str, np.ndarray], lengths: tuple[int, ...] = (12, 9, 11)) -> list[TrainSequence]:
    """Sequences of different lengths (padding and packing both matter), each with the sampler's routes."""
    out = []
    for i, n in enumerate(lengths):
        mask = np.zeros(n, np.uint8)
        mask[PROMPT:] = 1
        versions = sampled["route_versions"][i, :n].copy()
        versions[-1] = -1
        out.append(
            TrainSequence(
                tokens=sampled["tokens"][i, :n],
                loss_mask=mask,
                behaviour_logprobs=sampled["behaviour"][i, :n],
                versions=np.zeros(n, np.int64),
                advantage=1.0 - i,
                routes=sampled["routes"][i, :n],
                route_versions=versions,
            )
        )
    return out


def _backend(model: nn.Module, **options: object) -> TorchBackend:
    return TorchBackend(copy.deepcopy(model), lr=1e-2, **options)  # type: ignore[arg-type]


def _nll(logp: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
    return -torch.where(micro.loss_mask, logp, 0.0).sum() / extras.minibatch_loss_tokens, {}


def _forced_logprobs(model: nn.Module, seq: TrainSequence) -> np.ndarray:
    """An HF forward of one sequence alone with its recorded experts forced into every router (weights: the
    router's softmax at those experts, renormalised), written here independently of `actors.moe.RouteReplay`."""
    forced = torch.from_numpy(np.asarray(seq.routes, np.int64))
    handles = []
    for layer, router in enumerate(moe_routers(model)):

        def force(module: nn.Module, args: object, output: tuple[Tensor, ...], layer: int = layer) -> tuple:
            logits, _, own = output
            chosen = torch.where(torch.from_numpy(seq.route_versions >= 0)[:, None], forced[:, layer], own)
            weights = torch.softmax(logits.float(), -1).gather(-1, chosen)
            return logits, weights / weights.sum(-1, keepdim=True), chosen

        handles.append(router.register_forward_hook(force))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(np.asarray(seq.tokens, np.int64))[None]).logits[0].float()
    finally:
        for handle in handles:
            handle.remove()
    logp = torch.log_softmax(logits[:-1], -1).gather(
        -1, torch.from_numpy(np.asarray(seq.tokens[1:], np.int64))[:, None]
    )
    return np.concatenate([[0.0], logp.squeeze(-1).numpy()])


@pytest.mark.parametrize("packing", [True, False])
def test_replay_routes_every_recorded_position_through_the_samplers_experts(
    model: nn.Module, sampled: dict[str, np.ndarray], packing: bool
) -> None:
    seqs = _sequences(sampled)
    backend = _backend(model, routing_replay=True, packing=packing)
    seen = RouteRecorder(backend.model)  # registered after the replay hooks: it sees the experts actually used
    with seen.recording():
        logp = backend.logprobs(TrainBatch(tuple(seqs)))
    used = seen.take().astype(np.int64)
    order = sorted(range(len(seqs)), key=lambda i: -seqs[i].num_tokens)  # micro-batch rows: longest first
    if not packing:  # padded rows [S, T] flattened: keep each row's real positions
        used = used.reshape(len(seqs), -1, LAYERS, TOP_K)
        used = np.concatenate([used[row, : seqs[i].num_tokens] for row, i in enumerate(order)])
    expected = np.concatenate([seqs[i].routes for i in order]).astype(np.int64)
    recorded = np.concatenate([seqs[i].route_versions >= 0 for i in order])
    assert recorded.sum() > 0 and not np.array_equal(used, expected), "the last positions keep their own top-k"
    np.testing.assert_array_equal(np.sort(used[recorded], -1), np.sort(expected[recorded], -1))
    for seq, got in zip(seqs, logp, strict=True):
        np.testing.assert_allclose(got, _forced_logprobs(copy.deepcopy(model), seq), atol=2e-5)
    own = _backend(model, packing=packing).logprobs(TrainBatch(tuple(seqs)))
    assert max(float(np.abs(a - b).max()) for a, b in zip(own, logp, strict=True)) > 1e-3  # replay changed them


def test_under_replay_the_gradient_still_reaches_the_routers(model: nn.Module, sampled: dict[str, np.ndarray]) -> None:
    backend = _backend(model, routing_replay=True)
    before = [r.weight.detach().clone() for r in moe_routers(backend.model)]
    result = backend.train_step(TrainBatch(tuple(_sequences(sampled))), _nll)
    after = [r.weight.detach() for r in moe_routers(backend.model)]
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert 0.0 < result.moe["moe/routing_agreement"] < 1.0  # the perturbed sampler chose other experts somewhere
    assert result.moe["moe/recorded_position_layers"] == LAYERS * sum(s.num_tokens - 1 for s in _sequences(sampled))


def test_unrouted_positions_keep_the_trainers_own_top_k_and_are_counted(model: nn.Module) -> None:
    """The trainer's own routes recorded (agreement 1), then some positions' records dropped and their ids
    scrambled: the log-probs are the plain forward's, and the dropped positions (not a sequence's last) counted."""
    prompts = torch.randint(0, model.config.vocab_size, (3, PROMPT), generator=torch.Generator().manual_seed(2))
    own = recorded_batch(model, prompts, new_tokens=8, seed=2)
    seqs = _sequences(own)
    seqs[0].route_versions[[2, 5]] = -1
    seqs[0].routes[[2, 5]] = (seqs[0].routes[[2, 5]] + 1) % EXPERTS
    seqs[1] = TrainSequence(seqs[1].tokens, seqs[1].loss_mask, seqs[1].behaviour_logprobs, seqs[1].versions)
    batch = TrainBatch(tuple(seqs))
    plain = _backend(model).logprobs(batch)
    backend = _backend(model, routing_replay=True)
    for got, want in zip(backend.logprobs(batch), plain, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)
    moe = backend.train_step(batch, _nll).moe
    assert moe["moe/unrouted_positions"] == 2 + (seqs[1].num_tokens - 1)
    assert moe["moe/routing_agreement"] == 1.0


def test_replay_off_measures_agreement_without_changing_the_forward(
    model: nn.Module, sampled: dict[str, np.ndarray]
) -> None:
    seqs = _sequences(sampled)
    bare = [TrainSequence(s.tokens, s.loss_mask, s.behaviour_logprobs, s.versions, s.advantage) for s in seqs]
    measuring = _backend(model, routing_replay=False)
    for got, want in zip(
        measuring.logprobs(TrainBatch(tuple(seqs))), _backend(model).logprobs(TrainBatch(tuple(bare))), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    moe = measuring.train_step(TrainBatch(tuple(seqs)), _nll).moe
    assert 0.0 < moe["moe/routing_agreement"] < 1.0
    assert moe["moe/expert_load_max_over_mean"] >= 1.0


def test_replay_on_a_dense_model_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="moe.routing_replay"):
        TorchBackend(build_model("tiny-llama-2x64", vocab_size=32, seed=0), lr=1e-3, routing_replay=True)


def test_mismatch_metrics_are_zero_on_the_trainers_own_logprobs_and_positive_on_the_samplers(
    model: nn.Module, sampled: dict[str, np.ndarray]
) -> None:
    seqs = _sequences(sampled)
    backend = _backend(model, routing_replay=False)
    own = backend.logprobs(TrainBatch(tuple(seqs)))
    objective = CorrectedObjective(CorrectionConfig(), AdvantagesConfig(), version=0, constant_tokens=64)
    mine = [TrainSequence(s.tokens, s.loss_mask, lp, s.versions, s.advantage) for s, lp in zip(seqs, own, strict=True)]
    backend.optimizer.step = lambda: None  # type: ignore[method-assign]  # both measured on the same weights
    same = merge_loss_stats(backend.train_step(TrainBatch(tuple(mine)), objective).micro_stats)
    other = merge_loss_stats(backend.train_step(TrainBatch(tuple(seqs)), objective).micro_stats)
    assert same["mismatch/mean_abs_logprob_diff"] < 1e-5 and abs(same["mismatch/k3_kl"]) < 1e-8
    assert other["mismatch/mean_abs_logprob_diff"] > 1e-3 and other["mismatch/k3_kl"] > 0


@pytest.mark.parametrize(
    ("routes", "versions", "field"),
    [
        (np.zeros((5, 2, 2), np.uint8), None, "route_versions"),
        (None, np.zeros(6, np.int32), "routes"),
        (np.zeros((5, 2, 2), np.uint8), np.zeros(6, np.int32), "routes"),
        (np.zeros((6, 4), np.uint8), np.zeros(6, np.int32), "routes"),
        (np.zeros((6, 2, 2), np.float32), np.zeros(6, np.int32), "routes"),
        (np.zeros((6, 2, 2), np.uint8), np.zeros(5, np.int32), "route_versions"),
    ],
)
def test_train_sequence_refuses_routes_that_do_not_fit_naming_the_field(
    routes: np.ndarray | None, versions: np.ndarray | None, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        TrainSequence(
            tokens=np.arange(6),
            loss_mask=np.zeros(6, np.uint8),
            behaviour_logprobs=np.zeros(6, np.float32),
            versions=np.zeros(6, np.int64),
            routes=routes,
            route_versions=versions,
        )


def test_routes_cross_to_other_ranks_and_a_sequence_without_them_arrives_unrouted(
    sampled: dict[str, np.ndarray],
) -> None:
    seqs = _sequences(sampled)
    seqs[1] = TrainSequence(seqs[1].tokens, seqs[1].loss_mask, seqs[1].behaviour_logprobs, seqs[1].versions)
    back = decode_batch(encode_batch(TrainBatch(tuple(seqs)))).sequences
    np.testing.assert_array_equal(back[0].routes, seqs[0].routes)
    np.testing.assert_array_equal(back[0].route_versions, seqs[0].route_versions)
    assert (back[1].route_versions == -1).all()


def test_bench_moe_replay_lowers_the_mismatch_and_routes_cost_a_fraction_of_int32() -> None:
    args = argparse.Namespace(
        layers=2, hidden=64, experts=8, top_k=2, sequences=4, prompt_tokens=4, new_tokens=8, steps=1,
        perturb=0.01, router_perturb=0.1, seed=0,
    )  # fmt: skip
    result = run(args)
    for mode in ("replay_off", "replay_on"):
        assert set(result[mode]) >= {
            "mismatch_mean_abs_logprob_diff",
            "mismatch_k3_kl",
            "routing_agreement",
            "unrouted_positions",
            "loss",
        }
    assert result["replay_on"]["mismatch_k3_kl"] <= result["replay_off"]["mismatch_k3_kl"]
    assert result["k3_replay_vs_off"] <= 1.0
    wire = result["route_bytes"]
    assert wire["raw_per_token"] == 2 * 2 and wire["seed_int32_per_token"] == 4 * 2 * 2
    assert wire["zstd_per_token"] < wire["raw_per_token"] < wire["seed_base64_json_per_token"]
