"""Every shipped config starts: its engine and its trainer backend build, and they agree on version 0.

CI has no GPU, so each `configs/*.yaml` is loaded with ``--set``-style overrides that move both roles to
the CPU. A config that names a checkpoint directory (none is shipped) is pointed at a tiny Hugging Face
checkpoint written to ``tmp_path``: a 1-layer Llama saved with ``save_pretrained`` next to the char
tokenizer's ``tokenizer.json``, so the real loading path (``from_pretrained``, ``Tokenizer.from_file``)
runs. Everything else (dtype, sampling temperature, backend options, task) is the file's own.

What a config must allow, checked here:
- the generator's engine (`build_engine`) and the trainer's backend (`build_backend` over
  `build_policy_model`) build from it;
- the engine's initial weights equal the trainer's version 0 as published (fp32 master weights cast to
  ``model.dtype``), so a generator can start before the first pull;
- after loading version 0 the engine samples, and the trainer's recomputed log-probs of those tokens
  match the engine's behaviour log-probs (to bf16 rounding when ``model.dtype`` is bfloat16).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from actors.generator.engines.base import GenerateRequest
from actors.generator.engines.torch_engine import TorchEngine
from actors.generator.runtime import build_engine, sampling_params
from actors.models import (
    build_model,
    build_policy_model,
    eos_token_id,
    is_preset,
    load_chat_template_for,
    load_tokenizer,
    pad_token_id,
)
from actors.trainer.backends import TrainBatch, TrainingBackend, TrainSequence, build_backend
from pipeline.config import LeewayConfig, load_config
from pipeline.rl.prompt_ids import prompt_token_ids
from pipeline.tasks import Task, get_task
from pipeline.tasks.char_tokenizer import load_char_tokenizer
from pipeline.tasks.chat_tokenizer import load_chat_template_text, load_chat_tokenizer
from storage.weights import TORCH_DTYPES

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))

CPU_OVERRIDES = ("engine.device=cpu", "trainer.device=cpu")
TINY_CHECKPOINT = "tiny-llama-1x32"
"""The preset saved as the stand-in checkpoint: the smallest Llama the presets allow, to keep CI cheap."""
TEST_MAX_NEW_TOKENS = 4
"""Tokens sampled per check; enough to run the prefill and cached decode steps."""
LOGPROB_ATOL = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 5e-3}
"""Engine (``model.dtype``) vs trainer (fp32) log-probs of the same tokens under the same weights."""


def test_the_shipped_configs_are_the_documented_ones() -> None:
    assert [p.name for p in SHIPPED] == [
        "agent.yaml",
        "coding.yaml",
        "demo.yaml",
        "gpu-qwen3.yaml",
        "gpu-single-node.yaml",
        "math.yaml",
        "moe.yaml",
        "multi-node.yaml",
        "reasoning-gym.yaml",
        "reasoning.yaml",
    ]


def _write_tiny_checkpoint(directory: Path, *, chat: bool = False, tokenizer: Tokenizer | None = None) -> Path:
    """A 1-layer Llama in HF format with `tokenizer` (the task's own), else the char tokenizer (for a chat config:
    the chat tokenizer and its chat template in ``tokenizer_config.json``): what `model.name_or_path` would point
    at."""
    tokenizer = tokenizer or (load_chat_tokenizer("chat") if chat else load_char_tokenizer())
    model = build_model(
        TINY_CHECKPOINT,
        vocab_size=tokenizer.get_vocab_size(),
        seed=7,
        pad_token_id=pad_token_id(tokenizer),
        eos_token_id=eos_token_id(tokenizer),
    )
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    if chat:
        (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": load_chat_template_text()}))
    return directory


def _cpu_config(path: Path, tmp_path: Path) -> LeewayConfig:
    """The shipped config on the CPU; a checkpoint directory that is not in the repo becomes a tiny one."""
    cfg = load_config(path, CPU_OVERRIDES, environ={})
    spec = cfg.model.name_or_path
    if is_preset(spec) or (ROOT / spec).is_dir():
        return cfg
    # a config that takes its tokenizer from the task (configs/reasoning.yaml's numeric alphabet) gets a checkpoint
    # sized for it, as `leeway sft` writes one
    own = None if cfg.model.tokenizer else getattr(get_task(cfg.task.name, **cfg.task.args), "tokenizer", None)
    checkpoint = _write_tiny_checkpoint(tmp_path / "policy", chat=bool(cfg.task.args.get("chat")), tokenizer=own)
    overrides = [*CPU_OVERRIDES, f"model.name_or_path={checkpoint}"]
    if cfg.model.tokenizer == spec:
        overrides.append(f"model.tokenizer={checkpoint}")
    return load_config(path, overrides, environ={})


def _roles(cfg: LeewayConfig) -> tuple[Task, TorchEngine, TrainingBackend]:
    """Task, engine and backend built the way `leeway generator` and `leeway trainer` build them."""
    task = get_task(cfg.task.name, **cfg.task.args)
    tokenizer = load_tokenizer(cfg, task)
    engine = build_engine(cfg, tokenizer, "gen-test")
    assert isinstance(engine, TorchEngine)  # the only engine built so far (pipeline/config.py)
    backend = build_backend(cfg, build_policy_model(cfg, tokenizer))
    return task, engine, backend


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_builds_an_engine_and_a_backend_that_agree(path: Path, tmp_path: Path) -> None:
    cfg = _cpu_config(path, tmp_path)
    task, engine, backend = _roles(cfg)
    tokenizer = load_tokenizer(cfg, task)

    version_0 = backend.export_weights(TORCH_DTYPES[cfg.model.dtype])
    initial = engine.model.state_dict()
    assert sorted(version_0) == sorted(initial)
    for name, tensor in version_0.items():
        assert torch.equal(tensor, initial[name]), f"{path.name}: {name} differs between engine and trainer"
    engine.load_state(version_0, version=0)

    prompt = next(iter(task.prompts()))
    prompt_ids = prompt_token_ids(prompt, tokenizer, load_chat_template_for(cfg, tokenizer, task))
    prompt_ids = prompt_ids[-(engine.max_context_tokens - TEST_MAX_NEW_TOKENS) :]  # the stand-in's context is short
    # The trainer recomputes log pi under temperature only (actors/trainer/backends/torch_backend.py).
    params = replace(sampling_params(cfg, tokenizer), max_new_tokens=TEST_MAX_NEW_TOKENS, top_k=0, top_p=1.0)
    (result,) = engine.generate([GenerateRequest(prompt_ids, seed=0)], params)
    assert len(result.token_ids) >= 1
    assert (result.versions == 0).all()

    num_prompt, num_new = len(prompt_ids), len(result.token_ids)
    sequence = TrainSequence(
        tokens=np.concatenate([np.asarray(prompt_ids, np.int64), result.token_ids.astype(np.int64)]),
        loss_mask=np.concatenate([np.zeros(num_prompt, np.int8), np.ones(num_new, np.int8)]),
        behaviour_logprobs=np.concatenate([np.zeros(num_prompt, np.float32), result.logprobs]),
        versions=np.concatenate([np.zeros(num_prompt, np.int32), result.versions]),
    )
    (trainer_logprobs,) = backend.logprobs(TrainBatch((sequence,)))
    np.testing.assert_allclose(
        trainer_logprobs[num_prompt:], result.logprobs, atol=LOGPROB_ATOL[cfg.model.dtype], err_msg=path.name
    )
