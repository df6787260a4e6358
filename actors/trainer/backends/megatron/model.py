"""A megatron-core `GPTModel` shaped like an HF checkpoint (`ModelShape`), local or Transformer Engine spec.

The local spec (megatron-core's own modules, no Transformer Engine) is the default and the only one
on the CPU; ``use_transformer_engine`` picks TE's fused layers on a GPU where TE is installed. The
two specs name the pre-attention and pre-MLP norms differently (TE fuses them into the following
linear layer); `te_name` / `local_name` translate, so conversion speaks the local names only.

Every fusion that needs CUDA kernels is off, dropout is 0 (Leeway refuses dropout), parameters are
fp32 masters created on the CPU (``use_cpu_initialization``) and then overwritten by the converted
HF weights.
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
    )
    if use_transformer_engine:
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization=normalization)
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


__all__ = ["build_gpt_model", "local_name", "te_name", "transformer_engine_available"]
