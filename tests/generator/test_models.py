"""The named benchmark preset has the shape the GPU benchmarks quote, and refuses a tokenizer it cannot hold; the tiny
mixture-of-experts presets have random routers and build the same weights in both roles from the same seed, also
from the ``config.json`` a generator gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

from actors.models import (
    HEAD_DIM,
    MOE_EXPERTS,
    MOE_TOP_K,
    NAMED_PRESETS,
    build_policy_model,
    is_preset,
    preset_config,
    write_model_config,
)
from actors.moe import moe_routers, route_shape
from pipeline.config import load_config
from pipeline.tasks.char_tokenizer import load_char_tokenizer


def test_llama_1_4b_has_the_benchmark_shape() -> None:
    assert is_preset("llama-1.4b")
    config = preset_config("llama-1.4b", vocab_size=14, eos_token_id=1)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (2048, 24, 16)
    assert (config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (5632, 32000, False)
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert 1.3e9 < params < 1.45e9


def test_named_preset_refuses_a_larger_vocabulary() -> None:
    too_many = NAMED_PRESETS["llama-1.4b"]["vocab_size"] + 1
    with pytest.raises(ValueError, match="fewer than vocab_size"):
        preset_config("llama-1.4b", vocab_size=too_many)


@pytest.mark.parametrize(
    ("spec", "architecture", "renormalised"),
    [("tiny-qwen3moe-2x64-256", "Qwen3MoeForCausalLM", True), ("tiny-olmoe-2x64-256", "OlmoeForCausalLM", False)],
)
def test_moe_presets_build_the_same_random_routers_in_both_roles_and_from_their_config_file(
    spec: str, architecture: str, renormalised: bool, tmp_path: Path
) -> None:
    cfg = load_config(None, ["run.name=moe", f"model.name_or_path={spec}", "run.seed=5"], environ={})
    tokenizer = load_char_tokenizer()
    trainer = build_policy_model(cfg, tokenizer)
    generator = build_policy_model(cfg, tokenizer, dtype=torch.bfloat16)
    write_model_config(cfg, tokenizer, tmp_path)
    from_file = build_policy_model(cfg, tokenizer, config_dir=tmp_path)

    config = AutoConfig.from_pretrained(tmp_path)
    assert config.architectures == [architecture] and type(from_file).__name__ == architecture
    assert (config.num_experts, config.num_experts_per_tok, config.max_position_embeddings) == (MOE_EXPERTS, 2, 256)
    assert config.norm_topk_prob is renormalised and not config.tie_word_embeddings
    assert trainer.model.layers[0].self_attn.head_dim == HEAD_DIM
    assert route_shape(trainer) is not None and route_shape(trainer).layers == 2  # every layer sparse
    assert route_shape(trainer).top_k == MOE_TOP_K
    weights = trainer.state_dict()
    for other in (generator.state_dict(), from_file.state_dict()):
        assert other.keys() == weights.keys()
        for name, tensor in weights.items():
            assert torch.equal(other[name].float(), tensor.to(other[name].dtype).float()), name
    routers = [router.weight for router in moe_routers(trainer)]
    assert all(0.005 < float(w.detach().std()) for w in routers) and not torch.equal(routers[0], routers[1])
