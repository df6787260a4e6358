"""The training-backend interface: what the trainer needs from a model that learns, and nothing more.

The backend owns the weights, the optimizer and the forward/backward; it knows nothing about RL.
The trainer owns the objective: importance correction, PPO clipping and loss normalisation live in
a ``loss_fn`` callback (built from ``pipeline.correction`` and ``pipeline.loss``), so a Megatron-core
backend can later implement the same interface with its own packing and parallelism (its
``forward_step`` would unpack THD logits into the padded ``[S, T]`` layout below and call the same
``loss_fn``).

The record of one sequence, `TrainSequence`, lives in `pipeline/batching.py` (which produces it; its
docstring shows how tokens, masks, log-probs and versions line up); `TrainBatch` and what follows
are the backend's own.

One optimizer step (``train_step``)::

    batch.sequences --split--> minibatches (num_minibatches, contiguous, in order)
      minibatch --pack by token budget--> micro-batches [S, T] (whole sequences, right-padded)
        micro-batch --forward--> logprobs [S, T] (grad), entropy [S, T] (detached)
                    --loss_fn(logprobs, micro, extras)--> (loss, stats) --backward--> grads accumulate
      clip global grad norm -> AdamW step -> zero grads

A loss_fn built from ``pipeline.correction`` and ``pipeline.loss`` (``version`` = the trainer's)::

    def loss_fn(logp, micro, extras):
        out = corrected_token_loss(logp, micro.behaviour_logprobs, micro.advantages, micro.loss_mask,
                                   staleness=version - micro.versions, method="tis",
                                   proximal_logp=micro.proximal_logprobs)
        return out.token_loss.sum() / constant_tokens, out.stats
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from pipeline.batching import ModelLimits, TrainSequence


@dataclass(frozen=True, eq=False)
class TrainBatch:
    """The sequences of one optimizer step (or one `logprobs` call), in the trainer's order."""

    sequences: tuple[TrainSequence, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sequences", tuple(self.sequences))
        if not self.sequences:
            raise ValueError("TrainBatch.sequences is empty")

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def num_loss_tokens(self) -> int:
        return sum(s.num_loss_tokens for s in self.sequences)


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """Whole sequences of one minibatch, right-padded to ``[S, T]`` on the backend's device.

    ``seq_indices[i]`` is row ``i``'s index in ``TrainBatch.sequences``. Padding has ``loss_mask``
    False, ``attention_mask`` 0, tokens 0, log-probs 0 and advantage 0. ``loss_mask`` is bool.
    ``versions`` are int64 so that ``trainer_version - versions`` (staleness) needs no cast.
    """

    seq_indices: tuple[int, ...]
    tokens: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    versions: Tensor
    advantages: Tensor
    proximal_logprobs: Tensor | None

    @property
    def num_padded_tokens(self) -> int:
        return int(self.tokens.numel())


@dataclass(frozen=True, eq=False)
class LossExtras:
    """What else a loss_fn may use besides the log-probs and the micro-batch.

    ``entropy`` is the per-token entropy of the (tempered) policy, detached (an entropy bonus with
    grad is not supported). ``minibatch_loss_tokens`` counts loss tokens over the whole minibatch,
    the ``token_mean`` divisor before correction masks any; a divisor that depends on the
    correction (MIS-masked tokens) must be computed by the trainer beforehand.
    """

    entropy: Tensor
    minibatch_index: int
    num_minibatches: int
    micro_index: int
    num_micro_batches: int
    minibatch_seq_indices: tuple[int, ...]
    minibatch_loss_tokens: int


class LossFn(Protocol):
    """``loss_fn(logprobs [S, T] with grad, micro, extras) -> (loss, stats)``.

    ``loss`` is a scalar that the backend back-propagates as is and sums over micro-batches: it
    must already carry the step's normalisation (divide by the constant budget or by the
    minibatch's trained-token count, never by the micro-batch's). ``stats`` are floats, returned
    per micro-batch in `StepResult.micro_stats`.
    """

    def __call__(self, logprobs: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]: ...


@dataclass(frozen=True)
class MinibatchResult:
    """One optimizer update. ``grad_norm`` is the global norm before clipping; when it is not finite
    the update is skipped (``skipped`` True, weights and optimizer state untouched)."""

    loss: float
    grad_norm: float
    skipped: bool
    num_micro_batches: int
    num_loss_tokens: int


@dataclass(frozen=True)
class StepResult:
    """What `TrainingBackend.train_step` did. ``loss``: sum of loss_fn outputs, averaged over
    minibatches; ``grad_norm``: mean pre-clip norm over minibatches; ``entropy_mean``: over loss
    tokens of the whole batch (NaN when there are none). Timings in seconds."""

    loss: float
    grad_norm: float
    entropy_mean: float
    num_loss_tokens: int
    minibatches: tuple[MinibatchResult, ...]
    micro_stats: tuple[dict[str, float], ...]
    forward_backward_s: float
    optimizer_s: float
    total_s: float

    @property
    def skipped_minibatches(self) -> int:
        return sum(m.skipped for m in self.minibatches)


class TrainingBackend(ABC):
    """A trainable causal LM: log-probs, optimizer steps, weight export and exact checkpoint state.

    Checkpoint contract: ``load_state(state_tensors(), state_meta())`` on a backend built from the
    same config restores weights, optimizer and RNG so that the next steps are bit-identical (on
    the same device and library versions). Tensor keys are ``<group>/<name>`` with groups
    ``model``, ``optimizer`` and ``rng``; `actors.trainer.backends.checkpoint` writes one safetensors file
    per group.
    """

    @abstractmethod
    def logprobs(self, batch: TrainBatch) -> list[np.ndarray]:
        """Per sequence, float32 ``log pi(token_t | tokens_<t)`` at every position; position 0 is 0.

        No grad, no weight change; tokens outside ``loss_mask`` get values too (prompt tokens).
        """

    @abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, num_minibatches: int = 1) -> StepResult:
        """Split ``batch`` into ``num_minibatches`` contiguous minibatches and take one clipped AdamW
        update per minibatch, the gradient being that of the summed ``loss_fn`` outputs."""

    @abstractmethod
    def export_weights(self, dtype: torch.dtype) -> dict[str, Tensor]:
        """The served tensors: HF names (``model.state_dict()`` keys), floating tensors cast to
        ``dtype``, contiguous CPU copies that later steps never mutate."""

    def export_weights_owned(self, dtype: torch.dtype, names: Collection[str] | None) -> dict[str, Tensor]:
        """`export_weights` restricted to `names` (None: all), for a sharded publish where each rank
        stores the tensors it owns. A sharded backend overrides it; then every rank must call it."""
        return {n: t for n, t in self.export_weights(dtype).items() if names is None or n in names}

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every served tensor, in `export_weights` order (ranks split the publish by size)."""
        return {n: tuple(t.shape) for n, t in self.export_weights(torch.float32).items()}

    @abstractmethod
    def state_tensors(self) -> dict[str, Tensor]:
        """Everything of the checkpoint that is a tensor, as CPU copies (see the class docstring)."""

    @abstractmethod
    def state_meta(self) -> dict[str, Any]:
        """The JSON-safe rest of the checkpoint (hyperparameters, Python/numpy RNG states)."""

    @abstractmethod
    def load_state(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """Restore what `state_tensors` and `state_meta` returned; raises ValueError on a mismatch."""

    def close(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing to release)
        """Release what the backend holds beyond memory (a leader of several ranks tells the others to stop)."""

    @abstractmethod
    def model_limits(self) -> ModelLimits:
        """The vocabulary size and context length of the model, from its config: the trainer refuses
        groups that do not fit (`pipeline.batching.check_model_limits`) before they reach `train_step`."""


def mean_or_nan(total: float, count: int) -> float:
    """``total / count``, NaN for an empty count (a mean over nothing is not 0)."""
    return total / count if count else math.nan


def split_minibatches(num_sequences: int, num_minibatches: int) -> list[list[int]]:
    """Contiguous, near-equal index chunks; raises ValueError when a chunk would be empty."""
    if not 1 <= num_minibatches <= num_sequences:
        raise ValueError(f"num_minibatches={num_minibatches} must be in [1, {num_sequences}] (the batch's sequences)")
    return [chunk.tolist() for chunk in np.array_split(np.arange(num_sequences), num_minibatches)]


def pack_by_token_budget(lengths: Sequence[int], budget_tokens: int) -> list[list[int]]:
    """Group sequence indices into micro-batches whose padded size ``rows x longest`` fits the budget.

    Sequences are taken longest first (stable, so the packing is deterministic) and kept whole; a
    sequence longer than the budget forms a micro-batch of its own. Rows within a micro-batch keep
    that order; every index appears exactly once.
    """
    if budget_tokens < 1:
        raise ValueError(f"trainer.micro_batch_tokens={budget_tokens} must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    packs: list[list[int]] = []
    for index in order:
        # Longest first: the pack's first row is its longest, so padded size = rows * that length.
        if packs and (len(packs[-1]) + 1) * lengths[packs[-1][0]] <= budget_tokens:
            packs[-1].append(index)
        else:
            packs.append([index])
    return packs
