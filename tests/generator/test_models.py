"""The named benchmark preset has the shape the GPU benchmarks quote, and refuses a tokenizer it cannot hold."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from actors.models import NAMED_PRESETS, is_preset, preset_config


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
