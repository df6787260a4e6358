"""HF <-> Megatron-core weight names and layouts, and their tensor-parallel shards.

Four HF families map onto one `GPTModel` built from the local (or Transformer Engine) layer spec:

| HF family | norm | MLP | positions | biases |
| --- | --- | --- | --- | --- |
| ``llama`` | RMSNorm | SwiGLU (gate, up fused) | rotary | none |
| ``qwen2`` | RMSNorm | SwiGLU (gate, up fused) | rotary | q, k, v only |
| ``gpt2``  | LayerNorm | GELU (tanh) | learned absolute | all |
| ``qwen3_moe`` | RMSNorm, per-head q/k norm | SwiGLU experts + top-k router (`moe`) | rotary | none |

Layouts (``g`` query groups = KV heads, ``r = heads / g`` query heads per group, ``d`` head size)::

    HF:       q_proj [g*r*d, h]   k_proj [g*d, h]   v_proj [g*d, h]        (GPT-2: c_attn [h, 3h], Conv1D)
    Megatron: linear_qkv [g*(r+2)*d, h] = for each group: its r query heads, its key, its value
    HF:       gate_proj [f, h]  up_proj [f, h]
    Megatron: linear_fc1 [2f, h] = gate; up     (per TP rank: its gate rows; its up rows)

The full (unsharded) Megatron tensors are the pivot: `hf_to_megatron` / `megatron_to_hf` convert
whole models both ways without a rounding step (only reshapes, concatenations and transposes), and
`shard` / `unshard` split the pivot for a tensor-parallel rank and join it back. Column-parallel
weights split along rows (the QKV split keeps whole query groups together, so ``g`` must divide by
the TP size); row-parallel weights along columns; norms, row-parallel biases and position
embeddings are replicated. The vocabulary is padded with zero rows up to a multiple of the TP size
(`ModelShape.padded_vocab`); the backend masks the padded logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from actors.trainer.backends.megatron.experts import experts_to_hf, experts_to_megatron

Family = Literal["llama", "qwen2", "gpt2", "qwen3_moe"]
FAMILIES: tuple[Family, ...] = ("llama", "qwen2", "gpt2", "qwen3_moe")


@dataclass(frozen=True)
class ModelShape:
    """What conversion and model construction need from an HF config, in Megatron's terms."""

    family: Family
    num_layers: int
    hidden: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden: int
    vocab_size: int
    max_positions: int
    norm_eps: float
    tied_embeddings: bool
    rope_theta: float | None
    num_experts: int = 0
    """Routed experts per layer; 0 for a dense model."""
    moe_top_k: int = 0
    moe_ffn_hidden: int = 0
    """One expert's intermediate size."""
    norm_topk_prob: bool = True
    """Qwen3-MoE: the top-k gate weights renormalised to sum to 1 (else the full softmax's values)."""

    @property
    def gated(self) -> bool:
        return self.family != "gpt2"

    @property
    def qkv_bias(self) -> bool:
        return self.family in ("qwen2", "gpt2")

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of queries and keys before the rotary embedding (Qwen3)."""
        return self.family == "qwen3_moe"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def linear_bias(self) -> bool:
        """Biases on every linear layer (GPT-2), beyond the QKV bias."""
        return self.family == "gpt2"

    def padded_vocab(self, tp_size: int) -> int:
        return -(-self.vocab_size // tp_size) * tp_size

    @classmethod
    def from_hf_config(cls, config: object) -> ModelShape:
        """Raises ValueError for a family or option this conversion does not cover."""
        family = getattr(config, "model_type", None)
        if family not in FAMILIES:
            raise ValueError(f"model type {family!r}: the megatron backend converts {', '.join(FAMILIES)} only")
        get = config.__getattribute__
        if family == "gpt2":
            hidden, heads = int(get("n_embd")), int(get("n_head"))
            return cls(
                family="gpt2",
                num_layers=int(get("n_layer")),
                hidden=hidden,
                num_heads=heads,
                num_query_groups=heads,
                head_dim=hidden // heads,
                ffn_hidden=int(getattr(config, "n_inner", None) or 4 * hidden),
                vocab_size=int(get("vocab_size")),
                max_positions=int(get("n_positions")),
                norm_eps=float(get("layer_norm_epsilon")),
                tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
                rope_theta=None,
            )
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"model config hidden_act={act!r}: the megatron backend supports 'silu' for {family}")
        for option in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if getattr(config, option, False):
                raise ValueError(f"model config {option}=True: not converted for {family} (the megatron backend)")
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"model config rope_parameters={rope}: only default rotary embeddings are converted")
        return cls(
            family=family,
            **_moe_fields(config),
            num_layers=int(get("num_hidden_layers")),
            hidden=hidden,
            num_heads=heads,
            num_query_groups=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            ffn_hidden=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            max_positions=int(get("max_position_embeddings")),
            norm_eps=float(get("rms_norm_eps")),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        )


def _moe_fields(config: object) -> dict[str, int | bool]:
    """The MoE fields of a Qwen3-MoE config (none for a dense family); raises for a layout not converted."""
    if getattr(config, "model_type", None) != "qwen3_moe":
        return {}
    if list(getattr(config, "mlp_only_layers", None) or []) or int(getattr(config, "decoder_sparse_step", 1)) != 1:
        raise ValueError(
            "model config mlp_only_layers / decoder_sparse_step: the megatron backend converts Qwen3-MoE "
            "with every layer sparse only (mlp_only_layers=[], decoder_sparse_step=1)"
        )
    get = config.__getattribute__
    return {
        "num_experts": int(get("num_experts")),
        "moe_top_k": int(get("num_experts_per_tok")),
        "moe_ffn_hidden": int(get("moe_intermediate_size")),
        "norm_topk_prob": bool(get("norm_topk_prob")),
    }


def _hf_layer_names(shape: ModelShape, i: int) -> dict[str, str]:
    """HF names of layer ``i``'s tensors, by role."""
    if shape.family == "gpt2":
        p = f"transformer.h.{i}."
        return {"ln1": p + "ln_1", "ln2": p + "ln_2", "qkv": p + "attn.c_attn", "proj": p + "attn.c_proj",
                "fc1": p + "mlp.c_fc", "fc2": p + "mlp.c_proj"}  # fmt: skip
    p = f"model.layers.{i}."
    return {"ln1": p + "input_layernorm", "ln2": p + "post_attention_layernorm", "q": p + "self_attn.q_proj",
            "k": p + "self_attn.k_proj", "v": p + "self_attn.v_proj", "proj": p + "self_attn.o_proj",
            "gate": p + "mlp.gate_proj", "up": p + "mlp.up_proj", "fc2": p + "mlp.down_proj",
            "q_norm": p + "self_attn.q_norm", "k_norm": p + "self_attn.k_norm"}  # fmt: skip


def _mg_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _fuse_qkv(shape: ModelShape, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``[g*r*d, ...]``, ``[g*d, ...]``, ``[g*d, ...]`` -> Megatron's per-group ``[g*(r+2)*d, ...]``."""
    g, d = shape.num_query_groups, shape.head_dim
    r = shape.num_heads // g
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, r * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return fused.reshape(g * (r + 2) * d, *rest)


def _split_qkv(shape: ModelShape, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    g, d = shape.num_query_groups, shape.head_dim
    r = shape.num_heads // g
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (r + 2) * d, *rest).split([r * d, d, d], dim=1)
    return q.reshape(g * r * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def hf_to_megatron(shape: ModelShape, hf: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Whole-model HF state dict -> full (unsharded, vocabulary unpadded) Megatron state dict."""
    out: dict[str, Tensor] = {}
    gpt2 = shape.family == "gpt2"
    root = "transformer." if gpt2 else "model."
    out["embedding.word_embeddings.weight"] = hf[root + ("wte.weight" if gpt2 else "embed_tokens.weight")]
    if gpt2:
        out["embedding.position_embeddings.weight"] = hf["transformer.wpe.weight"]
    norm_params = ("weight", "bias") if gpt2 else ("weight",)
    for i in range(shape.num_layers):
        n, m = _hf_layer_names(shape, i), _mg_layer(i)
        for param in norm_params:
            out[f"{m}input_layernorm.{param}"] = hf[f"{n['ln1']}.{param}"]
            out[f"{m}pre_mlp_layernorm.{param}"] = hf[f"{n['ln2']}.{param}"]
        if gpt2:  # Conv1D stores [in, out]: transpose; c_attn's columns are q | k | v
            q, k, v = hf[n["qkv"] + ".weight"].t().chunk(3, dim=0)
            qb, kb, vb = hf[n["qkv"] + ".bias"].chunk(3, dim=0)
            out[m + "self_attention.linear_proj.weight"] = hf[n["proj"] + ".weight"].t()
            out[m + "mlp.linear_fc1.weight"] = hf[n["fc1"] + ".weight"].t()
            out[m + "mlp.linear_fc2.weight"] = hf[n["fc2"] + ".weight"].t()
            for role, mg in (
                ("proj", "self_attention.linear_proj"),
                ("fc1", "mlp.linear_fc1"),
                ("fc2", "mlp.linear_fc2"),
            ):
                out[f"{m}{mg}.bias"] = hf[n[role] + ".bias"]
        else:
            q, k, v = (hf[n[x] + ".weight"] for x in ("q", "k", "v"))
            if shape.qkv_bias:
                qb, kb, vb = (hf[n[x] + ".bias"] for x in ("q", "k", "v"))
            out[m + "self_attention.linear_proj.weight"] = hf[n["proj"] + ".weight"]
            if shape.is_moe:
                out.update(experts_to_megatron(hf, i, shape.num_experts))
            else:
                out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[n["gate"] + ".weight"], hf[n["up"] + ".weight"]])
                out[m + "mlp.linear_fc2.weight"] = hf[n["fc2"] + ".weight"]
            if shape.qk_norm:
                out[m + "self_attention.q_layernorm.weight"] = hf[n["q_norm"] + ".weight"]
                out[m + "self_attention.k_layernorm.weight"] = hf[n["k_norm"] + ".weight"]
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(shape, q, k, v)
        if shape.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(shape, qb, kb, vb)
    for param in norm_params:
        out[f"decoder.final_layernorm.{param}"] = hf[f"{root}{'ln_f' if gpt2 else 'norm'}.{param}"]
    if not shape.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(shape: ModelShape, mg: Mapping[str, Tensor], hf_names: Sequence[str]) -> dict[str, Tensor]:
    """Full Megatron state dict -> the HF tensors named in ``hf_names`` (the HF model's state-dict
    keys; a tied ``lm_head.weight`` there gets the embedding). Raises KeyError for a name it cannot make."""
    hf: dict[str, Tensor] = {}
    gpt2 = shape.family == "gpt2"
    root = "transformer." if gpt2 else "model."
    embed = mg["embedding.word_embeddings.weight"][: shape.vocab_size]
    hf[root + ("wte.weight" if gpt2 else "embed_tokens.weight")] = embed
    if gpt2:
        hf["transformer.wpe.weight"] = mg["embedding.position_embeddings.weight"]
    norm_params = ("weight", "bias") if gpt2 else ("weight",)
    for i in range(shape.num_layers):
        n, m = _hf_layer_names(shape, i), _mg_layer(i)
        for param in norm_params:
            hf[f"{n['ln1']}.{param}"] = mg[f"{m}input_layernorm.{param}"]
            hf[f"{n['ln2']}.{param}"] = mg[f"{m}pre_mlp_layernorm.{param}"]
        q, k, v = _split_qkv(shape, mg[m + "self_attention.linear_qkv.weight"])
        if shape.qkv_bias:
            qb, kb, vb = _split_qkv(shape, mg[m + "self_attention.linear_qkv.bias"])
        if gpt2:
            hf[n["qkv"] + ".weight"] = torch.cat([q, k, v]).t()
            hf[n["qkv"] + ".bias"] = torch.cat([qb, kb, vb])
            hf[n["proj"] + ".weight"] = mg[m + "self_attention.linear_proj.weight"].t()
            hf[n["fc1"] + ".weight"] = mg[m + "mlp.linear_fc1.weight"].t()
            hf[n["fc2"] + ".weight"] = mg[m + "mlp.linear_fc2.weight"].t()
            for role, mgn in (
                ("proj", "self_attention.linear_proj"),
                ("fc1", "mlp.linear_fc1"),
                ("fc2", "mlp.linear_fc2"),
            ):
                hf[n[role] + ".bias"] = mg[f"{m}{mgn}.bias"]
        else:
            hf[n["q"] + ".weight"], hf[n["k"] + ".weight"], hf[n["v"] + ".weight"] = q, k, v
            if shape.qkv_bias:
                hf[n["q"] + ".bias"], hf[n["k"] + ".bias"], hf[n["v"] + ".bias"] = qb, kb, vb
            hf[n["proj"] + ".weight"] = mg[m + "self_attention.linear_proj.weight"]
            if shape.is_moe:
                hf.update(experts_to_hf(mg, i, shape.num_experts))
            else:
                hf[n["gate"] + ".weight"], hf[n["up"] + ".weight"] = mg[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
                hf[n["fc2"] + ".weight"] = mg[m + "mlp.linear_fc2.weight"]
            if shape.qk_norm:
                hf[n["q_norm"] + ".weight"] = mg[m + "self_attention.q_layernorm.weight"]
                hf[n["k_norm"] + ".weight"] = mg[m + "self_attention.k_layernorm.weight"]
    for param in norm_params:
        hf[f"{root}{'ln_f' if gpt2 else 'norm'}.{param}"] = mg[f"decoder.final_layernorm.{param}"]
    if "lm_head.weight" in hf_names:
        hf["lm_head.weight"] = embed if shape.tied_embeddings else mg["output_layer.weight"][: shape.vocab_size]
    missing = [name for name in hf_names if name not in hf]
    if missing:
        raise KeyError(f"megatron -> HF conversion makes no tensor for {missing[:5]}")
    return {name: hf[name].contiguous() for name in hf_names}


# -- tensor-parallel shards ------------------------------------------------------------------

ShardRule = Literal["replicated", "rows", "columns", "gated_rows"]


def shard_rule(shape: ModelShape, name: str) -> ShardRule:
    """How the Megatron tensor ``name`` is split over tensor-parallel ranks."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return "rows"
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return "gated_rows" if shape.gated else "rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "columns"
    return "replicated"


def _pad_vocab(shape: ModelShape, name: str, tensor: Tensor, tp_size: int) -> Tensor:
    if not name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return tensor
    extra = shape.padded_vocab(tp_size) - tensor.shape[0]
    return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])]) if extra else tensor


def shard(shape: ModelShape, full: Mapping[str, Tensor], tp_rank: int, tp_size: int) -> dict[str, Tensor]:
    """The tensors TP rank ``tp_rank`` of ``tp_size`` holds, from a full Megatron state dict."""
    if shape.num_query_groups % tp_size or shape.num_heads % tp_size:
        raise ValueError(
            f"megatron.tensor_parallel_size={tp_size} must divide the {shape.num_heads} attention heads "
            f"and {shape.num_query_groups} KV heads"
        )
    out = {}
    for name, tensor in full.items():
        tensor = _pad_vocab(shape, name, tensor, tp_size)
        rule = shard_rule(shape, name)
        if rule == "rows":
            tensor = tensor.chunk(tp_size, dim=0)[tp_rank]
        elif rule == "columns":
            tensor = tensor.chunk(tp_size, dim=1)[tp_rank]
        elif rule == "gated_rows":
            gate, up = tensor.chunk(2, dim=0)
            tensor = torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
        out[name] = tensor.contiguous()
    return out


def unshard(shape: ModelShape, name: str, pieces: Sequence[Tensor]) -> Tensor:
    """Join the TP ranks' pieces of ``name`` (rank order) into the full tensor, vocabulary unpadded."""
    rule = shard_rule(shape, name)
    if rule == "replicated":
        full = pieces[0]
    elif rule == "columns":
        full = torch.cat(list(pieces), dim=1)
    elif rule == "gated_rows":
        halves = [p.chunk(2, dim=0) for p in pieces]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    else:
        full = torch.cat(list(pieces), dim=0)
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        full = full[: shape.vocab_size]
    return full.contiguous()


def unshard_all(shape: ModelShape, pieces: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """`unshard` for every tensor of the TP ranks' state dicts."""
    return {name: unshard(shape, name, [p[name] for p in pieces]) for name in pieces[0]}


__all__ = [
    "FAMILIES",
    "ModelShape",
    "hf_to_megatron",
    "megatron_to_hf",
    "shard",
    "shard_rule",
    "unshard",
    "unshard_all",
]
