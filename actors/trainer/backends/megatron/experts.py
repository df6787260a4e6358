"""HF <-> Megatron-core names and layouts of a mixture-of-experts layer (Qwen3-MoE).

transformers 5.19 keeps each layer's experts fused in two 3-D tensors; megatron-core's `SequentialMLP`
(the local spec without grouped GEMM) keeps one `MLP` per expert. ``E`` experts, ``I`` one expert's
intermediate size, ``h`` the hidden size::

    HF:       mlp.gate.weight [E, h]          mlp.experts.gate_up_proj [E, 2I, h] (gate rows, then up rows)
                                              mlp.experts.down_proj    [E, h, I]
    Megatron: mlp.router.weight [E, h]        mlp.experts.local_experts.{e}.linear_fc1.weight [2I, h] = gate; up
                                              mlp.experts.local_experts.{e}.linear_fc2.weight [h, I]

Both ways are slices and stacks, no arithmetic, so a round trip is exact. The expert index is the
global one (expert parallelism, which would renumber the local experts, is not built).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def _names(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."


def experts_to_megatron(hf: Mapping[str, Tensor], i: int, num_experts: int) -> dict[str, Tensor]:
    """Layer ``i``'s router and experts, HF -> full Megatron tensors."""
    h, m = _names(i)
    gate_up, down = hf[h + "experts.gate_up_proj"], hf[h + "experts.down_proj"]
    if gate_up.shape[0] != num_experts or down.shape[0] != num_experts:
        raise ValueError(
            f"{h}experts.gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)}: "
            f"expected {num_experts} experts in the first dimension"
        )
    out = {m + "router.weight": hf[h + "gate.weight"]}
    for e in range(num_experts):
        out[f"{m}experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
        out[f"{m}experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    return out


def experts_to_hf(mg: Mapping[str, Tensor], i: int, num_experts: int) -> dict[str, Tensor]:
    """Layer ``i``'s router and experts, full Megatron tensors -> HF."""
    h, m = _names(i)
    experts = range(num_experts)
    return {
        h + "gate.weight": mg[m + "router.weight"],
        h + "experts.gate_up_proj": torch.stack(
            [mg[f"{m}experts.local_experts.{e}.linear_fc1.weight"] for e in experts]
        ),
        h + "experts.down_proj": torch.stack([mg[f"{m}experts.local_experts.{e}.linear_fc2.weight"] for e in experts]),
    }


__all__ = ["experts_to_hf", "experts_to_megatron"]
