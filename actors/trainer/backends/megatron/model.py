"""A megatron-core `GPTModel` shaped like an HF checkpoint (`ModelShape`), local or Transformer Engine spec.

The local spec (megatron-core's own modules, no Transformer Engine) is the default and the only one
on the CPU; ``use_transformer_engine`` picks TE's fused layers on a GPU where TE is installed. The
two specs name the pre-attention and pre-MLP norms differently (TE fuses them into the following
linear layer); `te_name` / `local_name` translate, so conversion speaks the local names only.

Every fusion that needs CUDA kernels is off, dropout is 0 (Leeway refuses dropout), parameters are
fp32 masters created on the CPU (``use_cpu_initialization``) and then overwritten by the converted
HF weights. A Qwen3-MoE model gets megatron-core's `MoELayer` with per-head q/k norms (`_moe_options`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from actors.trainer.backends.megatron.convert import ModelShape

_TE_NORMS = {
    ".input_layernorm.": ".self_attention.linear_qkv.layer_norm_",
    ".pre_mlp_layernorm.": ".mlp.linear_fc1.layer_norm_",
}


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def te_name(local: str) -> str:
    for a, b in _TE_NORMS.items():
        if a in local:
            return local.replace(a, b)
    return local


def local_name(name: str) -> str:
    for a, b in _TE_NORMS.items():
        if b in name:
            return name.replace(b, a)
    return name


def build_gpt_model(
    shape: ModelShape, *, tp_size: int, pp_size: int = 1, pp_rank: int = 0, use_transformer_engine: bool
) -> torch.nn.Module:
    """The `GPTModel` of one TP rank of pipeline stage ``pp_rank`` (its ``num_layers / pp_size`` layers; the
    embedding on the first stage, final norm and LM head on the last), fp32, on the CPU, weights still random."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer import TransformerConfig

    normalization = "LayerNorm" if shape.family == "gpt2" else "RMSNorm"
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        pipeline_dtype=torch.float32,
        normalization=normalization,
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=shape.gated,
        activation_func=F.silu if shape.gated else functools.partial(F.gelu, approximate="tanh"),
        add_bias_linear=shape.linear_bias,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        qk_layernorm=shape.qk_norm,
        **_moe_options(shape),
    )
    experts = shape.num_experts or None
    if use_transformer_engine:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm
        )
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm, normalization=normalization
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        vocab_size=shape.padded_vocab(tp_size),
        max_sequence_length=shape.max_positions,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="learned_absolute" if shape.rope_theta is None else "rope",
        rotary_base=shape.rope_theta if shape.rope_theta is not None else 10000,
        parallel_output=True,
    )


def _moe_options(shape: ModelShape) -> dict[str, object]:
    """The MoE layer as the HF model computes it: one `MLP` per expert (no grouped GEMM), dropless, no
    auxiliary loss (the trainer's loss is the RL objective alone), softmax scores with the top-k
    renormalised exactly when Qwen3's ``norm_topk_prob`` is set (`replay`'s docstring shows why), and the
    ``allgather`` dispatcher (the ``alltoall`` one makes a ``torch.cuda.Stream`` when built)."""
    if not shape.is_moe:
        return {}
    return {
        "num_moe_experts": shape.num_experts,
        "moe_router_topk": shape.moe_top_k,
        "moe_ffn_hidden_size": shape.moe_ffn_hidden,
        "moe_router_pre_softmax": not shape.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
    }


__all__ = ["build_gpt_model", "local_name", "te_name", "transformer_engine_available"]
