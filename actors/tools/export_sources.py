"""What `leeway export` writes beside the weights: the run's model config, tokenizer, chat template and generation
config, taken from the store and the config alone, exactly as the run's processes used them.

    preset (tiny-llama-2x64, ...)  config.json as every role builds it (`actors.models.write_model_config`);
                                   the tokenizer and template the config names (`model.tokenizer`, the task's)
    checkpoint / Hub model         the files the trainer published under <run>/model/ (`actors/model_files.py`),
                                   each checked against its manifest's sha256, and the tokenizer and template a
                                   generator built from them (`local_config`)

The published tokenizer files are copied byte for byte where they are what the run used (the same vocabulary, the
same template text); where the run used another tokenizer or template (``model.tokenizer`` unset: the task's;
``model.chat_template``), that one is written instead, so ``AutoTokenizer`` encodes as the run's engine did.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from actors.model_files import fetch_model_files, local_config
from actors.models import chat_template_in, is_preset, load_chat_template_for, load_tokenizer, write_model_config
from pipeline.chat.template import ChatTemplate
from pipeline.config import LeewayConfig
from pipeline.tasks import task_for
from storage.objectstore import ObjectStore

TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""Published files copied as they are when the run used the published tokenizer and template."""


@dataclass
class ModelSources:
    """Everything but the weights of an exported checkpoint."""

    config: PretrainedConfig
    tokenizer: Tokenizer
    template: ChatTemplate | None
    files: dict[str, bytes] = field(default_factory=dict)
    """Published files to write byte for byte (over what the tokenizer writer produced)."""
    generation: GenerationConfig | None = None
    """The checkpoint's own generation config, kept (its stop tokens extended)."""


def run_model_sources(cfg: LeewayConfig, store: ObjectStore) -> ModelSources:
    """The run's model files (see the module docstring); `ModelFilesError` when a checkpoint run's are missing."""
    task = task_for(cfg)
    with tempfile.TemporaryDirectory(prefix="leeway-export-model-") as tmp:
        if is_preset(cfg.model.name_or_path):
            tokenizer = load_tokenizer(cfg, task)
            write_model_config(cfg, tokenizer, Path(tmp))
            config = AutoConfig.from_pretrained(tmp, local_files_only=True)
            return ModelSources(config, tokenizer, load_chat_template_for(cfg, tokenizer, task))
        fetched = fetch_model_files(store, cfg, Path(tmp), wait_s=0.0)
        local = local_config(cfg, fetched)
        tokenizer = load_tokenizer(local, task)
        template = load_chat_template_for(local, tokenizer, task)
        generation = (
            GenerationConfig.from_pretrained(fetched) if (fetched / "generation_config.json").is_file() else None
        )
        return ModelSources(
            AutoConfig.from_pretrained(fetched, local_files_only=True),
            tokenizer,
            template,
            _used_published_files(fetched, tokenizer, template),
            generation,
        )


def _used_published_files(directory: Path, tokenizer: Tokenizer, template: ChatTemplate | None) -> dict[str, bytes]:
    """The published tokenizer files the run used, byte for byte (see the module docstring)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return {}
    published = Tokenizer.from_file(str(path))
    if published.get_vocab(with_added_tokens=True) != tokenizer.get_vocab(with_added_tokens=True):
        return {}  # the run encoded with another tokenizer (the task's): that one is written
    out = {"tokenizer.json": path.read_bytes()}
    if chat_template_in(directory) == (template.template if template is not None else None):
        out.update(
            {name: (directory / name).read_bytes() for name in TOKENIZER_SIDE_FILES if (directory / name).is_file()}
        )
    return out
