"""The fixed workload for `leeway bench weights`: successive bf16 versions of a synthetic model.

    fp32 master weights --AdamW step on N(0, 1) gradients--> fp32 --cast--> bf16 version (yielded)

The state is shaped like a small Llama (HF names, matrices ~ N(0, 0.02), norm weights 1.0) so the
changed fraction per step, and hence every codec number, depends only on `num_params`, `lr` and
`seed`. Gradients are i.i.d. standard normal, which makes Adam's step about `lr` per element; real
RL gradients are smaller and more correlated, so real deltas are sparser than these.

`codec_stats` measures the delta codec between two yielded versions. It is pure (no I/O) so the
object-store benchmark can wrap it with its own publish/pull timing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import numpy as np
import torch

from storage.delta_codec import (
    apply_delta,
    encode_delta,
    encode_xor_zstd_baseline,
    entropy_bound_bytes,
    index_value_baseline_bytes,
    tensor_bits,
)

NUM_LAYERS = 4
"""Layers of the synthetic model; the hidden size is solved from `num_params`."""
MATRIX_INIT_STD = 0.02
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8


EXPERT_MARK = ".mlp.experts."
"""What an expert tensor's HF name holds (Qwen3-MoE and OLMoE: ``mlp.experts.gate_up_proj`` / ``down_proj``)."""


def transformer_shapes(num_params: int, experts: int = 0) -> dict[str, tuple[int, ...]]:
    """HF-named parameter shapes totalling about `num_params` (hidden d, FFN 3d, vocab 8d, tied head). With
    ``experts`` E > 0 each MLP is a Qwen3-MoE block instead: a router and E experts of width 3d/2 (top-2 of them
    as wide as the dense FFN), stored fused as HF writes them."""
    if num_params < 1:
        raise ValueError(f"num_params must be >= 1, got {num_params}")
    if experts < 0:
        raise ValueError(f"experts must be >= 0, got {experts}")
    mlp = 3 * 3 if not experts else experts * 3 * 1.5  # per d^2: dense 3 * d * 3d, MoE E * 3 * d * 1.5d
    params_per_d2 = NUM_LAYERS * (4 + mlp) + 8  # attention 4 d^2, the MLP, embedding 8d * d
    hidden = max(8, round(math.sqrt(num_params / params_per_d2) / 8) * 8)
    ffn = 3 * hidden
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (8 * hidden, hidden)}
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{prefix}.self_attn.{proj}.weight"] = (hidden, hidden)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        if experts:
            width = ffn // 2
            shapes[f"{prefix}.mlp.gate.weight"] = (experts, hidden)
            shapes[f"{prefix}{EXPERT_MARK}gate_up_proj"] = (experts, 2 * width, hidden)
            shapes[f"{prefix}{EXPERT_MARK}down_proj"] = (experts, hidden, width)
            continue
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (ffn, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (ffn, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, ffn)
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def synthetic_versions(
    num_params: int, lr: float, steps: int, warmup: int = 5, seed: int = 0, experts: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield `steps + 1` bf16 states: version 0 after `warmup` AdamW steps, then one per further step.

    Memory: the fp32 weights, gradients and two Adam moments (16 bytes/param) plus the yielded bf16
    copies; 100M params stay under 2 GiB plus whatever versions the caller keeps.
    """
    generator = torch.Generator().manual_seed(seed)
    params: dict[str, torch.nn.Parameter] = {}
    for name, shape in transformer_shapes(num_params, experts).items():
        tensor = torch.empty(shape, dtype=torch.float32)
        if len(shape) == 1:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, MATRIX_INIT_STD, generator=generator)
        params[name] = torch.nn.Parameter(tensor)
        params[name].grad = torch.empty_like(tensor)
    optimizer = torch.optim.AdamW(params.values(), lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0)

    def step() -> None:
        for param in params.values():
            param.grad.normal_(generator=generator)
        optimizer.step()

    def snapshot() -> dict[str, torch.Tensor]:
        return {name: param.detach().to(torch.bfloat16) for name, param in params.items()}

    for _ in range(warmup):
        step()
    yield snapshot()
    for _ in range(steps):
        step()
        yield snapshot()


def codec_stats(
    prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor], threads: int = 1, timing_repeats: int = 3
) -> dict:
    """Delta codec numbers for `prev -> new` (same names, shapes, dtypes), summed over tensors.

    Sizes are bytes. `entropy_bound_bytes` is the order-0 bound on the whole state (positions n*H(p)
    plus the entropy of changed XOR values); `entropy_bound_per_tensor_bytes` sums it per tensor, a
    tighter bound because density differs between tensors. Speeds are GB (1e9 bytes) of full state
    per second with `threads` threads, each tensor timed `timing_repeats` times and the fastest kept
    (benchmark machines are shared; the minimum is the codec's cost). `bit_exact` checks every applied
    tensor against `new`.
    """
    if timing_repeats < 1:
        raise ValueError(f"codec_stats: timing_repeats must be >= 1, got {timing_repeats}")
    if prev.keys() != new.keys():
        raise ValueError(f"codec_stats: tensor names differ ({sorted(prev.keys() ^ new.keys())[:5]} ...)")
    totals = dict.fromkeys(
        ("full", "delta", "xor", "index_value", "bound_per_tensor", "changed", "expert_full", "expert_delta"), 0.0
    )
    encode_s = apply_s = 0.0
    bit_exact = True
    for name in prev:
        old_bits, new_bits = tensor_bits(prev[name]), tensor_bits(new[name])
        best_encode_s = best_apply_s = math.inf
        for _ in range(timing_repeats):
            start = time.perf_counter()
            blob = encode_delta(old_bits, new_bits, threads=threads)
            best_encode_s = min(best_encode_s, time.perf_counter() - start)
            target = old_bits.copy()
            start = time.perf_counter()
            apply_delta(target, blob, threads=threads)
            best_apply_s = min(best_apply_s, time.perf_counter() - start)
        encode_s += best_encode_s
        apply_s += best_apply_s
        bit_exact &= bool(np.array_equal(target, new_bits))
        totals["full"] += old_bits.nbytes
        totals["delta"] += len(blob)
        if EXPERT_MARK in name:
            totals["expert_full"] += old_bits.nbytes
            totals["expert_delta"] += len(blob)
        totals["xor"] += len(encode_xor_zstd_baseline(old_bits, new_bits))
        totals["index_value"] += index_value_baseline_bytes(old_bits, new_bits)
        totals["bound_per_tensor"] += entropy_bound_bytes(old_bits, new_bits)
        totals["changed"] += int(np.count_nonzero(old_bits != new_bits))
    all_old = np.concatenate([tensor_bits(t) for t in prev.values()])
    all_new = np.concatenate([tensor_bits(t) for t in new.values()])
    bound = entropy_bound_bytes(all_old, all_new)
    num_elements = all_old.size
    return {
        "num_elements": num_elements,
        "num_tensors": len(prev),
        "threads": threads,
        "changed_fraction": totals["changed"] / num_elements if num_elements else 0.0,
        "full_bytes": int(totals["full"]),
        "delta_bytes": int(totals["delta"]),
        "expert_full_bytes": int(totals["expert_full"]),
        "expert_delta_bytes": int(totals["expert_delta"]),
        "entropy_bound_bytes": bound,
        "entropy_bound_per_tensor_bytes": totals["bound_per_tensor"],
        "delta_vs_entropy_bound": totals["delta"] / bound if bound else float("nan"),
        "xor_zstd1_bytes": int(totals["xor"]),
        "index_value_bytes": int(totals["index_value"]),
        "encode_gbps": totals["full"] / encode_s / 1e9 if encode_s else float("nan"),
        "decode_apply_gbps": totals["full"] / apply_s / 1e9 if apply_s else float("nan"),
        "bit_exact": bit_exact,
    }
