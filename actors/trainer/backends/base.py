"""The training-backend interface: what the trainer needs from a model that learns, and nothing more.

The backend owns the weights, the optimizer and the forward/backward; it knows nothing about RL.
The trainer owns the objective: importance correction, PPO clipping and loss normalisation live in
a ``loss_fn`` callback (built from ``pipeline.correction`` and ``pipeline.loss``), so a Megatron-core
backend can later implement the same interface with its own packing and parallelism (its
``forward_step`` would unpack THD logits into the padded ``[S, T]`` layout below and call the same
``loss_fn``).

How one sequence lines up (a 3-token prompt, 4 generated tokens; position 0 never has a log-prob)::

    position             0     1     2     3      4      5      6
    tokens               151   9707  25    785    3681   374    151643
    loss_mask            0     0     0     1      1      1      1
    behaviour_logprobs   0.0   0.0   0.0   -0.01  -2.30  -0.00  -0.12   # log mu(token_t | tokens_<t)
    versions             -1    -1    -1    6      6      7      7
    logprobs (backend)   0.0   lp1   lp2   lp3    lp4    lp5    lp6     # log pi(token_t | tokens_<t)

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class TrainSequence:
    """One sample to train on, column-aligned as in the module docstring.

    ``advantage`` is one float for the whole sample or a float32 array per token (only its values at
    loss tokens matter). ``proximal_logprobs`` (optional) are the trainer's log-probs under the
    weights at the step's start, for ``decoupled_ppo``; compute them with `TrainingBackend.logprobs`.
    An invalid (masked) sample must arrive with ``loss_mask`` all zero: the backend never decides
    what is trainable. ``loss_mask[0]`` must be 0, since the first token has no context to predict it.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    versions: np.ndarray
    advantage: float | np.ndarray = 0.0
    proximal_logprobs: np.ndarray | None = None
    sample_id: str = ""

    def __post_init__(self) -> None:
        where = f"TrainSequence {self.sample_id!r}"
        tokens = np.asarray(self.tokens)
        if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"{where}: tokens must be a non-empty 1-D integer array, got {tokens.dtype} shape {tokens.shape}"
            )
        columns = {
            "loss_mask": self.loss_mask,
            "behaviour_logprobs": self.behaviour_logprobs,
            "versions": self.versions,
            "proximal_logprobs": self.proximal_logprobs,
        }
        if not np.isscalar(self.advantage):
            columns["advantage"] = self.advantage
        for name, column in columns.items():
            if column is not None and np.shape(column) != tokens.shape:
                raise ValueError(f"{where}: {name} has shape {np.shape(column)}, tokens have {tokens.shape}")
        if np.asarray(self.loss_mask)[0]:
            raise ValueError(f"{where}: loss_mask[0] is 1, but position 0 has no log-prob (nothing precedes it)")

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.tokens).shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    def advantages_per_token(self) -> np.ndarray:
        """The advantage broadcast to every position, float32."""
        return np.broadcast_to(np.asarray(self.advantage, dtype=np.float32), (self.num_tokens,))


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

    @abstractmethod
    def state_tensors(self) -> dict[str, Tensor]:
        """Everything of the checkpoint that is a tensor, as CPU copies (see the class docstring)."""

    @abstractmethod
    def state_meta(self) -> dict[str, Any]:
        """The JSON-safe rest of the checkpoint (hyperparameters, Python/numpy RNG states)."""

    @abstractmethod
    def load_state(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """Restore what `state_tensors` and `state_meta` returned; raises ValueError on a mismatch."""


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
