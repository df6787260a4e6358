"""`leeway bench moe`: routing replay (R3) on and off on the same recorded batch, and what routes cost on the wire.

    tiny Qwen3-MoE (seeded) ─┬─► sampler copy, weights perturbed (an older version: its routes differ)
                             │     sample --sequences x --new-tokens; one recorded forward: routes (RouteRecorder)
                             │     and behaviour log-probs
                             └─► per mode (replay off, replay on), from the same starting weights:
                                   TorchBackend(routing_replay=mode).logprobs  ─► mismatch before training
                                   --steps train_steps of the trainer's objective ─► agreement, unrouted, loss

``mismatch_*`` are over the sampled tokens, before any update: mean |log pi - log mu| and the k3 estimate
mean(r - 1 - log r), r = pi / mu (`actors/trainer/objective.py`). ``routing_agreement`` is the share of recorded
positions x layers where the trainer's own top-k equals the sampler's, measured in the first step (replay does not
change it: it is the trainer's own choice either way). The headline ratios divide replay's mismatch by no replay's.

Route bytes per token: uint8 ids, layers x top-k of them (what the Arrow column holds, before compression), and the
batch's routes compressed with zstd at the wire's level; against the seed's int32 (4 bytes an id) and base64 JSON
(2,600 / 1,952 of that) at the same layer and top-k counts, and at the seed's own shape (61 layers x top-8).
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actors.cli_args import positive_int

SEED_LAYERS, SEED_TOP_K = 61, 8
SEED_INT32_BYTES_PER_TOKEN = 1952
SEED_BASE64_JSON_BYTES_PER_TOKEN = 2600
"""The seed's figures for 61 layers x top-8: int32 ids, and the same base64-encoded inside JSON."""
WIRE_ZSTD_LEVEL = 1
"""Arrow's default zstd level, the trajectory codec's (`pipeline/wire/codec.py`)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=positive_int, default=4, help="MoE layers of the tiny model (default 4)")
    parser.add_argument("--hidden", type=positive_int, default=64, help="hidden size (default 64)")
    parser.add_argument("--experts", type=positive_int, default=8, help="experts per layer (default 8)")
    parser.add_argument("--top-k", type=positive_int, default=2, help="experts per token (default 2)")
    parser.add_argument("--sequences", type=positive_int, default=8, help="sequences in the batch (default 8)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=8, help="prompt tokens each (default 8)")
    parser.add_argument("--new-tokens", type=positive_int, default=24, help="sampled tokens each (default 24)")
    parser.add_argument("--steps", type=positive_int, default=3, help="training steps per mode (default 3)")
    parser.add_argument(
        "--perturb",
        type=float,
        default=0.01,
        help="sampler weights = trainer's + this x their std x noise (default 0.01)",
    )
    parser.add_argument(
        "--router-perturb",
        type=float,
        default=0.1,
        help="the same for the routers' weights, on top (default 0.1): what flips routes between versions",
    )
    parser.add_argument("--seed", type=int, default=0)


def tiny_qwen3_moe(*, layers: int, hidden: int, experts: int, top_k: int, vocab: int = 128, seed: int = 0) -> Any:
    """A randomly initialised Qwen3-MoE (every layer sparse, head_dim 32), float32, eval mode."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=1,
        head_dim=32,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=256,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float().eval()


def perturbed(model: Any, scale: float, router_scale: float, seed: int) -> Any:
    """A copy with every weight moved by ``scale`` x its std x standard noise, the routers' by ``router_scale`` more
    (the "sampler version": close to the trainer's, with some routes flipped)."""
    from actors.moe import moe_routers

    out = copy.deepcopy(model)
    routers = {id(p) for r in moe_routers(out) for p in r.parameters()}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in out.parameters():
            if param.numel() > 1:
                total = scale + (router_scale if id(param) in routers else 0.0)
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * total)
    return out


@torch.no_grad()
def recorded_batch(sampler: Any, prompts: torch.Tensor, new_tokens: int, seed: int) -> dict[str, np.ndarray]:
    """Sample ``new_tokens`` per prompt (temperature 1), then one recorded forward over every sequence: ``tokens``
    [B, T], ``routes`` [B, T, L, K] (the last position has none: ``route_versions`` -1), ``behaviour`` [B, T]."""
    from actors.moe import RouteRecorder

    gen = torch.Generator().manual_seed(seed)
    tokens = prompts
    for _ in range(new_tokens):
        logits = sampler(input_ids=tokens, use_cache=False).logits[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        tokens = torch.cat([tokens, nxt], dim=1)
    recorder = RouteRecorder(sampler)
    with recorder.recording():
        logits = sampler(input_ids=tokens, use_cache=False).logits.float()
    rows, width = tokens.shape
    routes = recorder.take().reshape(rows, width, recorder.shape.layers, recorder.shape.top_k)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    behaviour = torch.nn.functional.pad(logp, (1, 0)).numpy().astype(np.float32)
    versions = np.zeros((rows, width), np.int32)
    versions[:, -1] = -1  # the last token is never fed to the sampler
    return {"tokens": tokens.numpy(), "routes": routes, "route_versions": versions, "behaviour": behaviour}


def _sequences(batch: dict[str, np.ndarray], prompt_tokens: int, seed: int) -> list[Any]:
    from pipeline.rl.batching import TrainSequence

    rows, width = batch["tokens"].shape
    rewards = np.random.default_rng(seed).choice([0.0, 1.0], size=rows)
    advantages = rewards - rewards.mean()
    mask = np.zeros(width, np.uint8)
    mask[prompt_tokens:] = 1
    return [
        TrainSequence(
            tokens=batch["tokens"][i],
            loss_mask=mask,
            behaviour_logprobs=batch["behaviour"][i],
            versions=np.zeros(width, np.int64),
            advantage=float(advantages[i]),
            sample_id=f"s{i}",
            routes=batch["routes"][i],
            route_versions=batch["route_versions"][i],
        )
        for i in range(rows)
    ]


def _mode(model: Any, sequences: list[Any], replay: bool, steps: int) -> dict[str, Any]:
    """Mismatch before training, then ``steps`` updates on the same batch, with replay on or off."""
    from actors.trainer.backends import TrainBatch
    from actors.trainer.backends.torch_backend import TorchBackend
    from actors.trainer.objective import CorrectedObjective, sampler_mismatch
    from pipeline.config import AdvantagesConfig, CorrectionConfig

    backend = TorchBackend(copy.deepcopy(model), lr=1e-3, routing_replay=replay)
    batch = TrainBatch(tuple(sequences))
    logp = backend.logprobs(batch)
    mask = torch.from_numpy(np.concatenate([s.loss_mask for s in sequences]) != 0)
    before = sampler_mismatch(
        torch.from_numpy(np.concatenate(logp)),
        torch.from_numpy(np.concatenate([s.behaviour_logprobs for s in sequences])),
        mask,
    )
    objective = CorrectedObjective(
        CorrectionConfig(), AdvantagesConfig(), version=0, constant_tokens=batch.num_loss_tokens
    )
    losses, metrics = [], []
    for _ in range(steps):
        result = backend.train_step(batch, objective)
        losses.append(result.loss)
        metrics.append(dict(result.moe))
    return {
        "mismatch_mean_abs_logprob_diff": before["mismatch/mean_abs_logprob_diff"],
        "mismatch_k3_kl": before["mismatch/k3_kl"],
        "routing_agreement": metrics[0]["moe/routing_agreement"],
        "unrouted_positions": metrics[0]["moe/unrouted_positions"],
        "expert_load_max_over_mean": metrics[0]["moe/expert_load_max_over_mean"],
        "loss": losses,
    }


def route_bytes(routes: np.ndarray, num_experts: int) -> dict[str, Any]:
    """Bytes per token of ``routes`` [tokens, L, K] as the wire carries them, and the seed's at the same shape."""
    from actors.moe import RouteShape

    tokens, layers, top_k = routes.shape
    shape = RouteShape(layers=layers, top_k=top_k, num_experts=num_experts)
    raw = np.ascontiguousarray(routes, dtype=shape.dtype)
    compressed = pa.Codec("zstd", compression_level=WIRE_ZSTD_LEVEL).compress(raw.tobytes(), asbytes=True)
    int32 = 4 * shape.width
    return {
        "layers": layers,
        "top_k": top_k,
        "raw_per_token": raw.nbytes / tokens,
        "zstd_per_token": len(compressed) / tokens,
        "seed_int32_per_token": int32,
        "seed_base64_json_per_token": int32 * SEED_BASE64_JSON_BYTES_PER_TOKEN / SEED_INT32_BYTES_PER_TOKEN,
        "raw_vs_seed_int32": raw.nbytes / tokens / int32,
        "zstd_vs_seed_int32": len(compressed) / tokens / int32,
        "at_seed_shape": {
            "raw_per_token": SEED_LAYERS * SEED_TOP_K * shape.dtype.itemsize,
            "seed_int32_per_token": SEED_INT32_BYTES_PER_TOKEN,
            "seed_base64_json_per_token": SEED_BASE64_JSON_BYTES_PER_TOKEN,
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    torch.set_num_threads(1)
    model = tiny_qwen3_moe(
        layers=args.layers, hidden=args.hidden, experts=args.experts, top_k=args.top_k, seed=args.seed
    )
    sampler = perturbed(model, args.perturb, args.router_perturb, args.seed + 1)
    prompts = torch.randint(
        0,
        model.config.vocab_size,
        (args.sequences, args.prompt_tokens),
        generator=torch.Generator().manual_seed(args.seed),
    )
    batch = recorded_batch(sampler, prompts, args.new_tokens, args.seed)
    sequences = _sequences(batch, args.prompt_tokens, args.seed)
    off = _mode(model, sequences, replay=False, steps=args.steps)
    on = _mode(model, sequences, replay=True, steps=args.steps)
    routes = batch["routes"][:, :-1].reshape(-1, args.layers, args.top_k)  # positions that have a route
    return {
        "model": {"layers": args.layers, "hidden": args.hidden, "experts": args.experts, "top_k": args.top_k},
        "batch": {
            "sequences": args.sequences,
            "tokens": int(batch["tokens"].size),
            "perturb": args.perturb,
            "router_perturb": args.router_perturb,
        },
        "replay_off": off,
        "replay_on": on,
        "k3_replay_vs_off": on["mismatch_k3_kl"] / off["mismatch_k3_kl"] if off["mismatch_k3_kl"] else None,
        "abs_diff_replay_vs_off": on["mismatch_mean_abs_logprob_diff"] / off["mismatch_mean_abs_logprob_diff"]
        if off["mismatch_mean_abs_logprob_diff"]
        else None,
        "route_bytes": route_bytes(routes, args.experts),
        "wall_s": time.perf_counter() - started,
    }
