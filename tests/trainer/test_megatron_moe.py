"""The megatron backend on a tiny Qwen3-MoE: expert weight names both ways, routing replay, and the same loss as
the torch side (the HF model under `actors.moe.RouteReplay`) on the same routed batch.

megatron-core runs in a rank process started here (``python tests/trainer/test_megatron_moe.py OUT_DIR``, a world
of one), never in the pytest process: it keeps its process groups in module globals. The rank writes its log-probs
and losses as safetensors under ``OUT_DIR``; the pytest process computes the HF side and compares.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from actors.moe import RouteReplay
from actors.trainer.backends import MicroBatch, TrainBatch, TrainSequence

REPO = Path(__file__).resolve().parents[2]
VOCAB = 37
LAYERS, EXPERTS, TOP_K = 2, 8, 2
LENGTHS = (9, 6)
RANK_TIMEOUT_S = 300
"""A rank that has not finished by then is hung; the test fails with its log."""


def _qwen3_moe(norm_topk_prob: bool = True) -> Qwen3MoeForCausalLM:
    """4 query heads over 2 KV heads of 16, 8 experts of 32, top-2; the routers' weights made large enough that
    the trainer's own top-k is decisive (replayed and own routes then give clearly different log-probs)."""
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = Qwen3MoeForCausalLM(config)
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight", "gate.weight")):
                torch.nn.init.normal_(param, mean=1.0 if "norm" in name else 0.0, std=0.3)
    return model.eval()


def _batch() -> TrainBatch:
    """Two sequences; recorded routes drawn at random (not the model's own choice), the last position of each
    unrecorded (route version -1, as the sampler never fed it)."""
    rng = np.random.default_rng(0)
    sequences = []
    for i, n in enumerate(LENGTHS):
        routes = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(n * LAYERS)]).reshape(n, LAYERS, TOP_K)
        versions = np.zeros(n, np.int32)
        versions[-1] = -1
        sequences.append(
            TrainSequence(
                tokens=rng.integers(1, VOCAB, n),
                loss_mask=np.r_[0, np.ones(n - 1)],
                behaviour_logprobs=np.zeros(n),
                versions=np.zeros(n, np.int64),
                advantage=1.0,
                sample_id=f"s{i}",
                routes=routes.astype(np.uint8),
                route_versions=versions,
            )  # fmt: skip
        )
    return TrainBatch(sequences)


def _hf_logprobs(model: Qwen3MoeForCausalLM, batch: TrainBatch, *, replay: bool) -> list[np.ndarray]:
    """Per-sequence log-probs from the HF model, routed by `RouteReplay` (own top-k where unrecorded)."""
    replayer, out = RouteReplay(model), []
    for seq in batch.sequences:
        routes = torch.from_numpy(seq.routes.astype(np.int64))
        recorded = torch.from_numpy(np.asarray(seq.route_versions) >= 0)
        tokens = torch.from_numpy(np.asarray(seq.tokens, np.int64))[None]
        with torch.no_grad(), replayer.replaying(routes, recorded, replay=replay):
            logits = model(input_ids=tokens).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]
        out.append(np.r_[0.0, logp.numpy()])
    return out


def test_expert_weights_round_trip_hf_megatron_hf_exactly() -> None:
    from actors.trainer.backends.megatron.convert import ModelShape, hf_to_megatron, megatron_to_hf

    model = _qwen3_moe()
    hf = model.state_dict()
    shape = ModelShape.from_hf_config(model.config)
    mg = hf_to_megatron(shape, hf)
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(mg["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"], gate_up[5])
    assert torch.equal(mg["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    assert torch.equal(
        mg["decoder.layers.0.self_attention.k_layernorm.weight"], hf["model.layers.0.self_attn.k_norm.weight"]
    )
    back = megatron_to_hf(shape, mg, list(hf))
    assert list(back) == list(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qwen3_moe_with_dense_layers_is_refused_by_name() -> None:
    from actors.trainer.backends.megatron.convert import ModelShape

    config = _qwen3_moe().config
    config.mlp_only_layers = [1]
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelShape.from_hf_config(config)


def test_layer_routes_follow_megatrons_position_major_token_order() -> None:
    from actors.trainer.backends.megatron.replay import layer_routes

    routes = torch.arange(2 * 3 * 2 * 1).reshape(2, 3, 2, 1)  # [S=2, T=3, L=2, K=1]
    routed = torch.tensor([[True, True, False], [True, False, False]])
    chosen, keep = layer_routes(routes, routed, layer=1)
    # row t * S + s holds sequence s at position t
    assert chosen[:, 0].tolist() == [routes[s, t, 1, 0].item() for t in range(3) for s in range(2)]
    assert keep.tolist() == [True, True, True, False, False, False]


def test_replay_topk_keeps_the_routers_own_experts_only_where_unrecorded() -> None:
    from actors.trainer.backends.megatron.replay import replay_topk

    scores = torch.tensor([[0.5, 0.25, 1.5, 2.5], [1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    own = torch.tensor([[3, 2], [3, 2]])
    values, indices = replay_topk(scores, own, torch.tensor([[0, 1], [0, 1]]), torch.tensor([True, False]))
    assert indices.tolist() == [[0, 1], [3, 2]]
    assert values.tolist() == [[0.5, 0.25], [4.0, 3.0]]
    values.sum().backward()  # the router's scores still get a gradient at the replayed experts
    assert scores.grad is not None and scores.grad[0].tolist() == [1.0, 1.0, 0.0, 0.0]


def _run_rank(out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = out / "rank.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, __file__, str(out)], env=env, stdout=sink, stderr=sink)
        try:
            code = proc.wait(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    if code:
        raise AssertionError(f"megatron rank exited {code}:\n{log.read_text()[-4000:]}")


def test_megatron_and_torch_give_the_same_loss_on_a_routed_batch_with_replay(tmp_path: Path) -> None:
    _run_rank(tmp_path)
    got = load_file(tmp_path / "megatron.safetensors")
    model, batch = _qwen3_moe(), _batch()
    replayed, own = _hf_logprobs(model, batch, replay=True), _hf_logprobs(model, batch, replay=False)
    plain = _hf_logprobs(_qwen3_moe(norm_topk_prob=False), batch, replay=True)
    for i in range(len(LENGTHS)):
        np.testing.assert_allclose(got[f"plain/{i}"].numpy(), plain[i], atol=1e-4, err_msg=f"unnormalised seq {i}")
        np.testing.assert_allclose(got[f"replay/{i}"].numpy(), replayed[i], atol=1e-4, err_msg=f"replay seq {i}")
        np.testing.assert_allclose(got[f"own/{i}"].numpy(), own[i], atol=1e-4, err_msg=f"own seq {i}")
        assert np.abs(replayed[i] - own[i]).max() > 1e-2, "the recorded routes must change the log-probs"
    torch_loss = -sum(float(lp[1:].sum()) for lp in replayed) / sum(n - 1 for n in LENGTHS)
    assert abs(float(got["loss"]) - torch_loss) < 1e-5
    assert int(got["unrouted"]) == len(LENGTHS)  # one unrecorded position per sequence, counted once
    assert 0.0 <= float(got["agreement"]) < 1.0


def _loss_fn(logp: Tensor, micro: MicroBatch, extras: object) -> tuple[Tensor, dict[str, float]]:
    return -(logp * micro.loss_mask).sum() / sum(n - 1 for n in LENGTHS), {}


def _rank_main(out: Path) -> None:
    """The megatron side: log-probs with replay on and off, the loss of one step with replay on, and log-probs
    with replay of a model whose gate weights are not renormalised (``norm_topk_prob=False``)."""
    from actors.trainer.backends.megatron import MegatronBackend

    torch.set_num_threads(1)
    backend = MegatronBackend(_qwen3_moe(), lr=0.0, routing_replay=True)
    batch = _batch()
    tensors = {f"replay/{i}": torch.from_numpy(lp) for i, lp in enumerate(backend.logprobs(batch))}
    assert backend.route_replay is not None
    unrouted = backend.route_replay.unrouted
    backend.routing_replay = False
    tensors |= {f"own/{i}": torch.from_numpy(lp) for i, lp in enumerate(backend.logprobs(batch))}
    agreement = backend.route_replay.agreement
    backend.routing_replay = True
    loss = backend.train_step(batch, _loss_fn).loss
    tensors |= {"loss": torch.tensor(loss, dtype=torch.float64), "unrouted": torch.tensor(unrouted),
                "agreement": torch.tensor(agreement)}  # fmt: skip
    plain = MegatronBackend(_qwen3_moe(norm_topk_prob=False), lr=0.0, routing_replay=True)
    tensors |= {f"plain/{i}": torch.from_numpy(lp) for i, lp in enumerate(plain.logprobs(batch))}
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "megatron.safetensors")


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
