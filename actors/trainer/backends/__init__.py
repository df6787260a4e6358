"""Training backends: the interface in `base`, the CPU/single-GPU `torch` backend, checkpoint bytes.

`build_backend` picks the backend named by ``trainer.backend``; callers never import a concrete
backend by hand, so a Megatron-core backend can be added behind the same interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors.trainer.backends.base import (
    LossExtras,
    LossFn,
    MicroBatch,
    MinibatchResult,
    StepResult,
    TrainBatch,
    TrainingBackend,
    TrainSequence,
)
from actors.trainer.backends.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from pipeline.config import LeewayConfig


def build_backend(config: LeewayConfig, model: PreTrainedModel) -> TrainingBackend:
    """The backend named by ``config.trainer.backend``, wrapping ``model`` (built with `actors.models.build_model`)."""
    if config.trainer.backend == "torch":
        from actors.trainer.backends.torch_backend import TorchBackend

        return TorchBackend.from_config(config, model)
    raise ValueError(f"trainer.backend={config.trainer.backend!r} is not implemented yet (available: 'torch')")


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
