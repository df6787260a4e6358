"""The model and tokenizer of a run, built the same way by both roles (generator engine, trainer backend).

Both sides build through `build_policy_model` (one tokenizer lookup, one list of special-token names),
so a generator and a trainer started from the same spec and seed hold bit-identical version-0 weights
and agree on the stop token without shipping a snapshot between them.

A spec is either
- a local Hugging Face checkpoint directory, or a Hub id at ``model.revision`` (from the HF cache, downloaded
  unless ``HF_HUB_OFFLINE``; only the trainer loads it, generators build from the run's files), or
- a named preset ``tiny-llama-<layers>x<hidden>`` (e.g. ``tiny-llama-2x64``): a randomly initialised
  Llama with ``hidden // 32`` heads (`HEAD_DIM`), an MLP four times as wide, untied embeddings and
  ``MAX_POSITION_EMBEDDINGS`` positions (rotary position embeddings; ``tiny-llama-2x64-2048``: 2048), or
- a named preset ``tiny-gpt2-<layers>x<hidden>`` (e.g. ``tiny-gpt2-2x64``): a randomly initialised GPT-2
  with the same head size, MLP width, untied embeddings and context, but *learned absolute* position
  embeddings and every dropout at 0 (the trainer backend rejects dropout). Absolute positions make
  position-indexed tasks such as reversing digits learnable by RL in a few hundred steps; the CPU demo
  uses this preset, or
- a named mixture-of-experts preset ``tiny-qwen3moe-<layers>x<hidden>`` or ``tiny-olmoe-<layers>x<hidden>``
  (same optional ``-<positions>``): a randomly initialised Qwen3-MoE or OLMoE with the same heads and context,
  every layer sparse, `MOE_EXPERTS` experts of which `MOE_TOP_K` are routed per token, each expert an MLP as
  wide as the hidden size (Qwen3-MoE renormalises the top-k gate weights, OLMoE does not, as the released
  models). Their routers are initialised at random by the model's own init (a zero router would tie every
  expert for every token), so routing replay (`actors/moe.py`) has real choices to record, or
- a named benchmark preset from `NAMED_PRESETS` (``llama-1.4b``): a randomly initialised Llama of a
  real size, so GPU benchmarks of the engine and the trainer measure a realistic shape with nothing
  downloaded. Its vocabulary is fixed (a tokenizer with more ids is refused).

The tiny presets are sized for the CPU demo, which trains on 2 cores.

No checkpoint's own code ever runs: every transformers load passes ``trust_remote_code=False`` (so no terminal
prompt can turn it on), and a config is built only for an architecture transformers has (`config_from_dict`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from pipeline.chat.template import ChatTemplate, load_chat_template
from pipeline.config import LeewayConfig
from pipeline.tasks import Task
from pipeline.tasks.char_tokenizer import load_char_tokenizer

MAX_POSITION_EMBEDDINGS = 128
"""Context length of the tiny presets: prompts and completions of the built-in tasks are far shorter. A preset
named with a last ``-<positions>`` (``tiny-llama-2x64-2048``) has that many instead (the coding tasks' prompts)."""

HEAD_DIM = 32
"""Head size of the tiny presets; the number of heads is ``hidden // HEAD_DIM``. 32 is the smallest head size vLLM's
CPU attention accepts (32, 64, 96, 128, ...), so the CPU demo runs on `engine.kind: vllm` too."""

CHAT_TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")
"""Where a checkpoint's chat template may be, first found wins (`chat_template_in`): ``chat_template.jinja``, as
today's ``save_pretrained`` writes it (transformers' tokenizer loader prefers it to the key below), the
``chat_template`` key of ``tokenizer_config.json`` (older checkpoints), and ``chat_template.json``, the legacy file
of a processor (a multimodal checkpoint), which a tokenizer never reads: the last resort."""
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    *CHAT_TEMPLATE_FILES,
)
"""What a checkpoint directory may hold that describes the model without its weights."""
EOS_TOKENS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>")
"""Names tried, in order, for the end-of-sequence token: the model config's EOS, and a stop token."""
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
"""A chat template's end-of-turn token, preferred over EOS when the template writes it (ChatML, Llama 3, Gemma,
Phi): a Qwen3 tokenizer has both <|endoftext|> and <|im_end|>, and a chat turn ends with the second."""
BOS_TOKENS = ("<bos>", "<s>")
PAD_TOKENS = ("<pad>", "<|pad|>")

MOE_EXPERTS = 8
"""Experts per MoE layer of the tiny MoE presets."""
MOE_TOP_K = 2
"""Experts routed per token and layer by the tiny MoE presets."""

_PRESET_RE = re.compile(
    r"^tiny-(?P<family>llama|gpt2|qwen3moe|olmoe)-(?P<layers>\d+)x(?P<hidden>\d+)(?:-(?P<positions>\d+))?$"
)
NAMED_PRESETS: dict[str, dict[str, int]] = {
    "llama-1.4b": {
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 5632,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
}
"""Named Llama shapes (untied embeddings, random init) for the GPU benchmarks; see the module docstring."""

_PRESET_CLASSES: dict[type[PretrainedConfig], type[PreTrainedModel]] = {
    LlamaConfig: LlamaForCausalLM,
    GPT2Config: GPT2LMHeadModel,
    Qwen3MoeConfig: Qwen3MoeForCausalLM,
    OlmoeConfig: OlmoeForCausalLM,
}
"""The model class of each preset config (what `build_model` builds and `write_model_config` names)."""

PRESET_FORMS = (
    "'tiny-llama-<layers>x<hidden>[-<positions>]', 'tiny-gpt2-<layers>x<hidden>[-<positions>]', "
    "'tiny-qwen3moe-<layers>x<hidden>[-<positions>]', 'tiny-olmoe-<layers>x<hidden>[-<positions>]' or one of "
    + ", ".join(repr(name) for name in NAMED_PRESETS)
)


def is_preset(spec: str) -> bool:
    """True when ``spec`` names a preset (tiny or named) rather than a checkpoint directory."""
    return spec in NAMED_PRESETS or _PRESET_RE.match(spec) is not None


def preset_config(
    spec: str,
    *,
    vocab_size: int,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> PretrainedConfig:
    """The config of a preset (`LlamaConfig`, `GPT2Config`, `Qwen3MoeConfig` or `OlmoeConfig`); raises ValueError
    for a name that is not one.

    A named preset keeps its own vocabulary, which must hold ``vocab_size`` ids."""
    if spec in NAMED_PRESETS:
        shape = NAMED_PRESETS[spec]
        if vocab_size > shape["vocab_size"]:
            raise ValueError(
                f"model spec {spec!r} has {shape['vocab_size']} token ids, fewer than vocab_size={vocab_size}"
            )
        return LlamaConfig(
            **shape,
            num_key_value_heads=shape["num_attention_heads"],
            tie_word_embeddings=False,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
        )
    match = _PRESET_RE.match(spec)
    if match is None:
        raise ValueError(f"model spec {spec!r} is not a preset of the form {PRESET_FORMS}")
    num_layers, hidden = int(match["layers"]), int(match["hidden"])
    positions = int(match["positions"] or MAX_POSITION_EMBEDDINGS)
    if num_layers < 1 or hidden < HEAD_DIM or hidden % HEAD_DIM:
        raise ValueError(f"model spec {spec!r}: need >= 1 layer and a hidden size that is a multiple of {HEAD_DIM}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    num_heads = hidden // HEAD_DIM
    if match["family"] == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=positions,
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
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "max_position_embeddings": positions,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "pad_token_id": pad_token_id,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    if match["family"] == "qwen3moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=HEAD_DIM,
            intermediate_size=4 * hidden,  # dense MLP layers only; every layer of the preset is sparse
            moe_intermediate_size=hidden,
            num_experts=MOE_EXPERTS,
            num_experts_per_tok=MOE_TOP_K,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if match["family"] == "olmoe":  # OLMoE's experts are `intermediate_size` wide
        return OlmoeConfig(**common, intermediate_size=hidden, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K)
    return LlamaConfig(**common, intermediate_size=4 * hidden)


def build_model(
    spec: str,
    *,
    vocab_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    revision: str | None = None,
    config_dir: Path | None = None,
) -> PreTrainedModel:
    """Build the causal LM named by ``spec`` in eval mode on the CPU.

    A preset is initialised from ``seed`` inside a forked RNG, so the same (spec, vocab_size, seed)
    gives the same weights in every process and the caller's global RNG is left untouched. A
    checkpoint is a local directory or a Hub id at ``revision`` (the HF cache and ``HF_HUB_OFFLINE`` are
    honoured); it must have at least ``vocab_size`` embedding rows, or token ids of the tokenizer would
    index past the embedding table. ``config_dir`` (a generator without the checkpoint): the model is built
    from the run's ``config.json`` there, seeded, its weights to be replaced by version 0
    (`actors/model_files.py`).
    """
    if config_dir is not None:
        path = config_dir / "config.json"
        try:
            raw = json.loads(path.read_bytes())
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from exc
        config = config_from_dict(raw, str(path))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        model = model.to(dtype)
        _check_rows(model, spec, vocab_size)
        return model.eval()
    if is_preset(spec):
        config = preset_config(
            spec, vocab_size=vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _PRESET_CLASSES[type(config)](config)
        model = model.to(dtype)
    elif Path(spec).is_dir():
        model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True, dtype=dtype, trust_remote_code=False)
        _check_rows(model, spec, vocab_size)
    elif "/" in spec and not spec.startswith(("/", ".")):
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, revision=revision, dtype=dtype, trust_remote_code=False)
        except OSError as exc:  # not in the cache and no Hub (HF_HUB_OFFLINE), or no such repo or revision
            raise ValueError(f"model.name_or_path = {spec!r} (revision {revision!r}): cannot load it: {exc}") from exc
        _check_rows(model, spec, vocab_size)
    else:
        raise ValueError(
            f"model spec {spec!r} is neither a preset ({PRESET_FORMS}), an existing local checkpoint directory "
            "nor a Hub id (owner/name)"
        )
    return model.eval()


def config_from_dict(raw: object, where: str) -> PretrainedConfig:
    """The transformers config of a ``config.json``'s contents (`where` names the file in errors), of an
    architecture transformers has: its ``model_type`` picks the class; an ``auto_map`` (the checkpoint's own
    code) is never followed. Raises ValueError naming the field."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a JSON object")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        custom = (
            f", and its auto_map names the checkpoint's own code ({raw['auto_map']!r})" if "auto_map" in raw else ""
        )
        raise ValueError(
            f"{where}: model_type = {model_type!r} is not an architecture transformers has{custom}; Leeway never "
            "runs a checkpoint's own code (trust_remote_code is off)"
        )
    try:
        return CONFIG_MAPPING[model_type].from_dict(raw)
    except Exception as exc:  # untrusted input: whatever the config class raises on it is a bad file
        raise ValueError(f"{where}: not a valid {model_type} config: {type(exc).__name__}: {exc}") from exc


def _check_rows(model: PreTrainedModel, spec: str, vocab_size: int) -> None:
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < vocab_size:
        raise ValueError(f"model {spec!r} has {rows} embedding rows, fewer than vocab_size={vocab_size}")


def checkpoint_dir(cfg: LeewayConfig) -> Path | None:
    """Where this process finds the checkpoint's files: the local directory, or the Hub snapshot of
    ``model.name_or_path`` at ``model.revision`` (downloaded into the HF cache, or read from it when
    ``HF_HUB_OFFLINE`` is set); None for a preset."""
    spec = cfg.model.name_or_path
    if is_preset(spec):
        return None
    if Path(spec).is_dir():
        return Path(spec)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(spec, revision=cfg.model.revision, allow_patterns=list(MODEL_FILES)))


def tokenizer_path(cfg: LeewayConfig) -> Path | None:
    """`model.tokenizer` on this machine: the file or directory it names, or, when it names the checkpoint's Hub
    id (``model.tokenizer: Qwen/Qwen3-0.6B`` beside the same ``model.name_or_path``), that checkpoint's snapshot
    at ``model.revision`` in the HF cache (downloaded unless ``HF_HUB_OFFLINE``); None when it is not set."""
    spec = cfg.model.tokenizer
    if spec is None:
        return None
    if Path(spec).exists() or spec != cfg.model.name_or_path or is_preset(spec):
        return Path(spec)
    try:
        return checkpoint_dir(cfg)
    except Exception as exc:  # not in the cache and no Hub, no such repo or revision
        raise ValueError(
            f"model.tokenizer = {spec!r} (revision {cfg.model.revision!r}): cannot fetch it: {exc}"
        ) from exc


def load_tokenizer(cfg: LeewayConfig, task: Task | None = None) -> Tokenizer:
    """`model.tokenizer` (a tokenizer.json, a directory holding one, or the checkpoint's Hub id), else the
    task's `Task.tokenizer`, else the built-in char tokenizer."""
    path = tokenizer_path(cfg)
    if path is None:
        return (task.tokenizer if task is not None else None) or load_char_tokenizer()
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"model.tokenizer = {cfg.model.tokenizer!r}: no tokenizer.json there")
    return Tokenizer.from_file(str(path))


def special_token_id(tokenizer: Tokenizer, candidates: Sequence[str]) -> int | None:
    """The id of the first of `candidates` the tokenizer knows, or None."""
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return None


def eos_token_id(tokenizer: Tokenizer) -> int | None:
    return special_token_id(tokenizer, EOS_TOKENS)


def stop_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Every end-of-sequence and end-of-turn token the tokenizer has (as a Hub model's generation_config lists
    them): the engine stops at any of them, so a chat model ends its turn and a base model its text."""
    ids = (tokenizer.token_to_id(t) for t in (*EOS_TOKENS, *END_OF_TURN_TOKENS))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def pad_token_id(tokenizer: Tokenizer) -> int:
    return special_token_id(tokenizer, PAD_TOKENS) or 0


def build_policy_model(
    cfg: LeewayConfig, tokenizer: Tokenizer, *, dtype: torch.dtype = torch.float32, config_dir: Path | None = None
) -> PreTrainedModel:
    """The run's model (``model.name_or_path`` at ``model.revision``, seeded by ``run.seed``) sized to the
    tokenizer, on the CPU; from the run's ``config.json`` in ``config_dir`` where given (see `build_model`).

    The trainer builds it in fp32 (master weights), the engine in ``model.dtype``; the weights agree
    because both come from the same seeded fp32 initialisation.
    """
    return build_model(
        cfg.model.name_or_path,
        vocab_size=tokenizer.get_vocab_size(),
        seed=cfg.run.seed,
        dtype=dtype,
        pad_token_id=pad_token_id(tokenizer),
        bos_token_id=special_token_id(tokenizer, BOS_TOKENS),
        eos_token_id=eos_token_id(tokenizer),
        revision=cfg.model.revision,
        config_dir=config_dir,
    )


def chat_template_in(directory: Path) -> str | None:
    """The chat template of a checkpoint or tokenizer directory, from the first of `CHAT_TEMPLATE_FILES` that
    holds one; None when none does. A file that holds a malformed one is refused naming it (``ValueError``)."""
    for name in CHAT_TEMPLATE_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if path.suffix == ".jinja":
            return path.read_text()
        try:
            has_template = json.loads(path.read_text()).get("chat_template") is not None
        except (ValueError, AttributeError) as exc:  # not JSON, or JSON that is not an object
            raise ValueError(f"chat template: {path} is not a JSON object ({exc})") from exc
        if has_template:
            return load_chat_template(path)
    return None


def load_chat_template_for(cfg: LeewayConfig, tokenizer: Tokenizer, task: Task | None = None) -> ChatTemplate | None:
    """The run's chat template: `model.chat_template`, else the one of the directory `model.tokenizer` names
    (`chat_template_in`: where transformers puts it; a directory holding none of `CHAT_TEMPLATE_FILES` defers to
    the task), else the task's ``chat_template`` text; None when there is none.
    Its end-of-turn token is the first of `END_OF_TURN_TOKENS` the template writes, else the tokenizer's EOS."""
    text: str | None = None
    source = "the chat template"
    tokenizer_dir = tokenizer_path(cfg)
    if cfg.model.chat_template is not None:
        text = load_chat_template(cfg.model.chat_template)
        source = f"model.chat_template ({cfg.model.chat_template})"
    elif tokenizer_dir is not None and any((tokenizer_dir / name).is_file() for name in CHAT_TEMPLATE_FILES):
        text = chat_template_in(tokenizer_dir)
        source = f"the chat template of {tokenizer_dir}"
    elif task is not None:
        text = task.chat_template
        source = f"task {cfg.task.name}'s chat template"
    if text is None:
        return None
    written = [t for t in END_OF_TURN_TOKENS if t in text]
    eos = special_token_id(tokenizer, written) if written else None
    eos = eos_token_id(tokenizer) if eos is None else eos
    if eos is None:
        raise ValueError(
            f"model.chat_template: the tokenizer has none of the end-of-turn tokens {END_OF_TURN_TOKENS + EOS_TOKENS}"
        )
    bos = special_token_id(tokenizer, BOS_TOKENS)
    return ChatTemplate(
        tokenizer,
        text,
        eos_token=tokenizer.id_to_token(eos),
        bos_token=None if bos is None else tokenizer.id_to_token(bos),
        template_args=cfg.model.chat_template_args,
        source=source,
    )


def write_model_config(cfg: LeewayConfig, tokenizer: Tokenizer, directory: Path) -> None:
    """Write a preset's ``config.json`` (what `build_policy_model` builds, with its architecture named) into
    ``directory``: an engine that reads a model directory (vLLM) starts from it and takes every weight from the
    store."""
    spec = cfg.model.name_or_path
    config = preset_config(
        spec,
        vocab_size=tokenizer.get_vocab_size(),
        pad_token_id=pad_token_id(tokenizer),
        bos_token_id=special_token_id(tokenizer, BOS_TOKENS),
        eos_token_id=eos_token_id(tokenizer),
    )
    config.architectures = [_PRESET_CLASSES[type(config)].__name__]
    config.save_pretrained(directory)
