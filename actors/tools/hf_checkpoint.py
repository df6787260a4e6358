"""A Hugging Face checkpoint directory: what `model.name_or_path`, plain `transformers`, vLLM and SGLang load.

    model.safetensors (or model-0000k-of-0000n.safetensors + model.safetensors.index.json past `max_shard_size`)
    config.json  generation_config.json                          (the model's shape; every stop token)
    tokenizer.json  tokenizer_config.json  chat_template.jinja   (when the run has a template)

One writer for every checkpoint Leeway hands out: the SFT result (`actors/sft/export.py`, fp32) and any published
policy version (`leeway export`, `leeway run`'s ``final/``, `trainer.export_every`: `actors/tools/export.py`). The
weights keep their dtype and bits (loaded into the model by assignment, not copied through another dtype). Nothing
is pickled. The generation config lists every stop token the engine stops at, so ``model.generate`` ends where a
Leeway generator ends. `files` (the run's own tokenizer and template files, byte for byte) replace what the
tokenizer writer produced. The files are written into a sibling directory and moved into place one by one, so a
reader never sees a half-written weight file.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedTokenizerFast

from actors.models import BOS_TOKENS, PAD_TOKENS, eos_token_id, special_token_id, stop_token_ids
from pipeline.chat.template import ChatTemplate

UNK_TOKENS = ("<unk>",)
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""Largest `model*.safetensors` file before the weights are split into shards with an index (as the Hub's models)."""


def write_checkpoint(
    out_dir: Path,
    weights: dict[str, torch.Tensor],
    config: PretrainedConfig,
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    files: Mapping[str, bytes] | None = None,
    generation: GenerationConfig | None = None,
) -> list[str]:
    """Write the checkpoint into ``out_dir`` (other files there are kept); returns the names written.

    ``weights`` are HF parameter names of ``config``'s model in the dtype to write (a name the model lacks, or a
    parameter no weight fills, is refused before anything is written). ``generation`` (the checkpoint's own
    generation config) is kept, its stop tokens extended to every one the engine stops at."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir))
    try:
        dtypes = {t.dtype for t in weights.values()}
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=dtypes.pop() if len(dtypes) == 1 else None)
        model = skeleton.to_empty(device="cpu")
        missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
        missing = [k for k in missing if k not in _tied(model)]
        if missing or unexpected:
            raise ValueError(f"export: weights do not match the model (missing {missing}, unexpected {unexpected})")
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        model.generation_config = _generation_config(tokenizer, template, generation)
        model.save_pretrained(staging, safe_serialization=True, max_shard_size=max_shard_size)
        hf_tokenizer(tokenizer, template).save_pretrained(staging)
        for name, data in (files or {}).items():
            (staging / name).write_bytes(data)
        names = sorted(p.name for p in staging.iterdir() if p.is_file())
        for name in names:
            (staging / name).replace(out_dir / name)
        return names
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _generation_config(
    tokenizer: Tokenizer, template: ChatTemplate | None, base: GenerationConfig | None
) -> GenerationConfig:
    """`base` (or a fresh one) stopping at every stop token of the tokenizer and the template's end of turn."""
    stops = list(stop_token_ids(tokenizer))
    if template is not None and template.eos_id not in stops:
        stops.insert(0, template.eos_id)
    config = GenerationConfig.from_dict(base.to_dict()) if base is not None else GenerationConfig()
    had = config.eos_token_id
    for token in [had] if isinstance(had, int) else list(had or []):
        if token not in stops:
            stops.append(token)
    config.eos_token_id = stops[0] if len(stops) == 1 else stops
    if config.bos_token_id is None:
        config.bos_token_id = special_token_id(tokenizer, BOS_TOKENS)
    if config.pad_token_id is None:
        config.pad_token_id = special_token_id(tokenizer, PAD_TOKENS)
    return config


def hf_tokenizer(tokenizer: Tokenizer, template: ChatTemplate | None) -> PreTrainedTokenizerFast:
    """The tokenizer as `transformers` saves and loads it, with its special tokens named and the chat template."""

    def token(candidates: tuple[str, ...]) -> str | None:
        token_id = special_token_id(tokenizer, candidates)
        return None if token_id is None else tokenizer.id_to_token(token_id)

    eos_id = template.eos_id if template is not None else eos_token_id(tokenizer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=token(BOS_TOKENS),
        eos_token=None if eos_id is None else tokenizer.id_to_token(eos_id),
        pad_token=token(PAD_TOKENS),
        unk_token=token(UNK_TOKENS),
    )
    if template is not None:
        hf.chat_template = template.template
    return hf


def _tied(model: torch.nn.Module) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or []
    if isinstance(keys, dict):
        return set(keys)
    return set(keys)
