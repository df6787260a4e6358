"""The SFT result as a Hugging Face checkpoint directory: what `model.name_or_path` and plain `transformers` load.

    model.safetensors  config.json  generation_config.json      (the trained weights, fp32, and the model's shape)
    tokenizer.json  tokenizer_config.json  chat_template.jinja (when the run has one)

Nothing is pickled. The generation config lists every stop token the engine stops at, so ``model.generate`` ends
where a Leeway generator ends. The files are written into a sibling directory and moved into place one by one, so
a reader never sees a half-written weight file.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedTokenizerFast

from actors.models import BOS_TOKENS, PAD_TOKENS, eos_token_id, special_token_id, stop_token_ids
from pipeline.chat.template import ChatTemplate

UNK_TOKENS = ("<unk>",)


def write_checkpoint(
    out_dir: Path,
    weights: dict[str, torch.Tensor],
    config: PretrainedConfig,
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
) -> list[str]:
    """Write the checkpoint into ``out_dir`` (other files there are kept); returns the names written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir))
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        model = skeleton.to_empty(device="cpu")
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if k not in _tied(model)]
        if missing or unexpected:
            raise ValueError(f"sft export: weights do not match the model (missing {missing}, unexpected {unexpected})")
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        stops = list(stop_token_ids(tokenizer))
        if template is not None and template.eos_id not in stops:
            stops.insert(0, template.eos_id)
        model.generation_config = GenerationConfig(
            eos_token_id=stops[0] if len(stops) == 1 else stops,
            bos_token_id=special_token_id(tokenizer, BOS_TOKENS),
            pad_token_id=special_token_id(tokenizer, PAD_TOKENS),
        )
        model.save_pretrained(staging, safe_serialization=True)
        hf_tokenizer(tokenizer, template).save_pretrained(staging)
        names = sorted(p.name for p in staging.iterdir() if p.is_file())
        for name in names:
            (staging / name).replace(out_dir / name)
        return names
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
