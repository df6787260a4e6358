"""Training backends: the interface in `base`, the `torch` backend (CPU or GPU, FSDP2 over several ranks), checkpoint bytes.

`build_backend` picks the backend named by ``trainer.backend``; callers never import a concrete
backend by hand; the ``megatron`` backend (`actors/trainer/backends/megatron/`) is imported only when
named, since it needs the ``megatron`` extra. `TrainSequence`
is re-exported from `pipeline/rl/batching.py`, which produces it.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

from actors.trainer.backends.base import (
    LossExtras,
    LossFn,
    MicroBatch,
    MinibatchResult,
    StepResult,
    TrainBatch,
    TrainingBackend,
)
from actors.trainer.backends.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from actors.trainer.backends.torch_backend import TorchBackend
from pipeline.config import LeewayConfig
from pipeline.rl.batching import TrainSequence


def build_backend(config: LeewayConfig, model: PreTrainedModel, **overrides: Any) -> TrainingBackend:
    """The backend named by ``config.trainer.backend``, wrapping ``model`` (from `actors.models.build_policy_model`).
    ``overrides`` replace options `backend_options` reads from the config (SFT: its own lr, clip, temperature 1)."""
    if config.trainer.backend == "torch":
        return TorchBackend.from_config(config, model, **overrides)
    if config.trainer.backend == "megatron":
        try:
            from actors.trainer.backends.megatron import MegatronBackend
        except ImportError as exc:
            raise ValueError(
                f"trainer.backend='megatron' needs megatron-core: pip install -e '.[megatron]' ({exc})"
            ) from exc
        return MegatronBackend.from_config(config, model, **overrides)
    raise ValueError(f"trainer.backend={config.trainer.backend!r} is not implemented (available: 'torch', 'megatron')")


__all__ = [
    "CheckpointError",
    "LossExtras",
    "LossFn",
    "MicroBatch",
    "MinibatchResult",
    "StepResult",
    "TrainBatch",
    "TrainSequence",
    "TrainingBackend",
    "build_backend",
    "decode_checkpoint",
    "encode_checkpoint",
]
