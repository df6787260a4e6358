"""Tiny model presets and model loading, shared by the inference engines and the trainer backend.

Both sides build the model through `build_model`, so a generator and a trainer started from the same
spec and seed hold bit-identical version-0 weights without shipping a snapshot between them.

A spec is either
- a local Hugging Face checkpoint directory (loaded with ``local_files_only=True``; nothing is ever
  fetched from a hub), or
- a named preset ``tiny-llama-<layers>x<hidden>`` (e.g. ``tiny-llama-2x64``): a randomly initialised
  Llama with ``hidden // 16`` heads, an MLP four times as wide, untied embeddings and
  ``MAX_POSITION_EMBEDDINGS`` positions (rotary position embeddings), or
- a named preset ``tiny-gpt2-<layers>x<hidden>`` (e.g. ``tiny-gpt2-2x64``): a randomly initialised GPT-2
  with the same head size, MLP width, untied embeddings and context, but *learned absolute* position
  embeddings and every dropout at 0 (the trainer backend rejects dropout). Absolute positions make
  position-indexed tasks such as reversing digits learnable by RL in a few hundred steps; the CPU demo
  uses this preset.

The presets are sized for the CPU demo, which trains on 2 cores.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

MAX_POSITION_EMBEDDINGS = 128
"""Context length of the tiny presets: prompts and completions of the built-in tasks are far shorter."""

HEAD_DIM = 16
"""Head size of the tiny presets; the number of heads is ``hidden // HEAD_DIM``."""

_PRESET_RE = re.compile(r"^tiny-(?P<family>llama|gpt2)-(?P<layers>\d+)x(?P<hidden>\d+)$")
PRESET_FORMS = "'tiny-llama-<layers>x<hidden>' or 'tiny-gpt2-<layers>x<hidden>'"


def is_preset(spec: str) -> bool:
    """True when ``spec`` names a tiny preset rather than a checkpoint directory."""
    return _PRESET_RE.match(spec) is not None


def preset_config(
    spec: str,
    *,
    vocab_size: int,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> PretrainedConfig:
    """The config of a tiny preset (`LlamaConfig` or `GPT2Config`); raises ValueError for a name that is not one."""
    match = _PRESET_RE.match(spec)
    if match is None:
        raise ValueError(f"model spec {spec!r} is not a preset of the form {PRESET_FORMS}")
    num_layers, hidden = int(match["layers"]), int(match["hidden"])
    if num_layers < 1 or hidden < HEAD_DIM or hidden % HEAD_DIM:
        raise ValueError(f"model spec {spec!r}: need >= 1 layer and a hidden size that is a multiple of {HEAD_DIM}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    num_heads = hidden // HEAD_DIM
    if match["family"] == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=MAX_POSITION_EMBEDDINGS,
            n_embd=hidden,
            n_layer=num_layers,
            n_head=num_heads,
            n_inner=4 * hidden,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            tie_word_embeddings=False,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def build_model(
    spec: str,
    *,
    vocab_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> PreTrainedModel:
    """Build the causal LM named by ``spec`` in eval mode on the CPU.

    A preset is initialised from ``seed`` inside a forked RNG, so the same (spec, vocab_size, seed)
    gives the same weights in every process and the caller's global RNG is left untouched. A
    checkpoint must have at least ``vocab_size`` embedding rows, or token ids of the tokenizer would
    index past the embedding table.
    """
    if is_preset(spec):
        config = preset_config(
            spec, vocab_size=vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model_class = GPT2LMHeadModel if isinstance(config, GPT2Config) else LlamaForCausalLM
            model = model_class(config)
        model = model.to(dtype)
    elif Path(spec).is_dir():
        model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True, dtype=dtype)
        rows = model.get_input_embeddings().weight.shape[0]
        if rows < vocab_size:
            raise ValueError(f"model {spec!r} has {rows} embedding rows, fewer than vocab_size={vocab_size}")
    else:
        raise ValueError(
            f"model spec {spec!r} is neither a tiny preset ({PRESET_FORMS}) nor an existing local checkpoint directory"
        )
    return model.eval()
