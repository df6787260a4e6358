"""The training-backend interface: what the trainer needs from a model that learns, and nothing more.

The backend owns the weights, the optimizer and the forward/backward; it knows nothing about RL.
The trainer owns the objective: importance correction, PPO clipping and loss normalisation live in
a ``loss_fn`` callback (built from ``pipeline.rl.correction`` and ``pipeline.rl.loss``), so the torch
backend and the Megatron-core one implement the same interface with their own packing and
parallelism and hand the same ``loss_fn`` the padded ``[S, T]`` layout below. What both do the same
way around their own forward (the options they read from the config, the micro-batch layout, the
minibatch loop, the skip of an update with a non-finite gradient norm, the dropout and autocast
policy) is written once, at the end of this module.

The record of one sequence, `TrainSequence`, lives in `pipeline/rl/batching.py` (which produces it; its
docstring shows how tokens, masks, log-probs and versions line up); `TrainBatch` and what follows
are the backend's own.

One optimizer step (``train_step``)::

    batch.sequences --split--> minibatches (num_minibatches, contiguous, in order)
      minibatch --pack by token budget--> micro-batches [S, T] (whole sequences, right-padded)
        micro-batch --forward--> logprobs [S, T] (grad), entropy [S, T] (detached)
                    --loss_fn(logprobs, micro, extras)--> (loss, stats) --backward--> grads accumulate
      clip global grad norm -> AdamW step -> zero grads

A loss_fn built from ``pipeline.rl.correction`` and ``pipeline.rl.loss`` (``version`` = the trainer's)::

    def loss_fn(logp, micro, extras):
        out = corrected_token_loss(logp, micro.behaviour_logprobs, micro.advantages, micro.loss_mask,
                                   staleness=version - micro.versions, method="tis",
                                   proximal_logp=micro.proximal_logprobs)
        return out.token_loss.sum() / constant_tokens, out.stats
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.config import LeewayConfig
from pipeline.rl.batching import ModelLimits, TrainSequence

log = logging.getLogger(__name__)


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
    ``routes`` ``[S, T, layers, top_k]`` int64 and ``routed`` ``[S, T]`` bool are set when a sequence
    carries the sampler's routes (`TrainSequence.routes`): ``routed`` is False on padding, where
    ``route_versions`` is -1 and on every row of a sequence without routes (its ``routes`` are 0 there).
    """

    seq_indices: tuple[int, ...]
    tokens: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    versions: Tensor
    advantages: Tensor
    proximal_logprobs: Tensor | None
    routes: Tensor | None = None
    routed: Tensor | None = None

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
    moe: Mapping[str, float] = field(default_factory=dict)
    """Routing metrics of a mixture-of-experts model (``moe/...``, `actors/trainer/backends/routing.py`); empty
    for a dense one."""

    @property
    def skipped_minibatches(self) -> int:
        """Updates skipped for a non-finite gradient norm; the trainer logs it per step
        (``trainer/skipped_minibatches``), since a skipped update otherwise only shows as a NaN norm."""
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

    optimizer: torch.optim.Optimizer
    """The AdamW every backend trains with."""

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next updates (SFT's warm-up and decay; RL trains at ``trainer.lr``)."""
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)

    def close(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing to release)
        """Release what the backend holds beyond memory (a leader of several ranks tells the others to stop)."""

    @abstractmethod
    def model_limits(self) -> ModelLimits:
        """The vocabulary size and context length of the model, from its config: the trainer refuses
        groups that do not fit (`pipeline.rl.batching.check_model_limits`) before they reach `train_step`."""


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


# ---- shared by the backends: options, micro-batch layout, minibatch loop, update, dropout and autocast ---


class BackendOptions(TypedDict):
    """The keyword arguments every backend's constructor takes from the config alike (`backend_options`);
    each backend's ``from_config`` adds its own (packing, parallel sizes, ...)."""

    lr: float
    betas: tuple[float, float]
    adam_eps: float
    weight_decay: float
    grad_clip: float
    micro_batch_tokens: int
    gradient_checkpointing: bool
    device: str
    temperature: float


def backend_options(config: LeewayConfig) -> BackendOptions:
    """AdamW, clipping and micro-batch settings from ``trainer``; the temperature from the sampler (the
    recomputed log-probs must be those of the distribution the generator sampled from)."""
    t = config.trainer
    return BackendOptions(
        lr=t.lr,
        betas=t.betas,
        adam_eps=t.adam_eps,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        micro_batch_tokens=t.micro_batch_tokens,
        gradient_checkpointing=t.gradient_checkpointing,
        device=t.device,
        temperature=config.engine.sampling.temperature,
    )


def check_options(temperature: float, grad_clip: float) -> None:
    """Refuse a temperature or a clip no backend can train with (ValueError naming the value)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy sampling has no log-prob to correct)")
    if grad_clip <= 0:
        raise ValueError(f"trainer.grad_clip={grad_clip} must be > 0")


def step_unless_non_finite(
    optimizer: torch.optim.Optimizer, grad_norm: float, clip: Callable[[], None] | None = None
) -> tuple[float, bool]:
    """The end of every update: with a finite global `grad_norm`, `clip` (if the backend scales the
    gradients only now) and the optimizer step; with a non-finite one, no step at all (weights and
    optimizer state untouched, reported rather than hidden). Gradients are cleared either way.
    Returns (grad_norm, skipped), as `train_minibatches`' ``optimizer_update`` does."""
    skipped = not math.isfinite(grad_norm)
    if skipped:
        log.warning("non-finite gradient norm %s: optimizer update skipped", grad_norm)
    else:
        if clip is not None:
            clip()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")

Accumulate = Callable[[list[int], int, int], tuple[float, float, list[dict[str, float]], int]]
"""(minibatch's sequence indices, its index, minibatches) -> (summed loss, summed entropy over loss
tokens, per-micro-batch stats, micro-batches run): forward and backward of one minibatch."""


def padded_micro_batch(batch: TrainBatch, seq_indices: list[int], device: torch.device) -> MicroBatch:
    """Right-pad the chosen sequences into ``[S, T]`` tensors on `device` (the loss_fn's layout)."""
    seqs = [batch.sequences[i] for i in seq_indices]
    rows, width = len(seqs), max(s.num_tokens for s in seqs)
    has_prox = [s.proximal_logprobs is not None for s in seqs]
    if any(has_prox) and not all(has_prox):
        raise ValueError("proximal_logprobs must be set on every sequence of a batch or on none")
    columns: dict[str, np.ndarray] = {
        "tokens": np.zeros((rows, width), np.int64),
        "attention_mask": np.zeros((rows, width), np.int64),
        "loss_mask": np.zeros((rows, width), np.bool_),
        "behaviour_logprobs": np.zeros((rows, width), np.float32),
        "versions": np.zeros((rows, width), np.int64),
        "advantages": np.zeros((rows, width), np.float32),
    }
    if all(has_prox):
        columns["proximal_logprobs"] = np.zeros((rows, width), np.float32)
    for row, seq in enumerate(seqs):
        n = seq.num_tokens
        columns["tokens"][row, :n] = seq.tokens
        columns["attention_mask"][row, :n] = 1
        columns["loss_mask"][row, :n] = np.asarray(seq.loss_mask) != 0
        columns["behaviour_logprobs"][row, :n] = seq.behaviour_logprobs
        columns["versions"][row, :n] = seq.versions
        columns["advantages"][row, :n] = seq.advantages_per_token()
        if "proximal_logprobs" in columns:
            columns["proximal_logprobs"][row, :n] = seq.proximal_logprobs
    columns.update(_route_columns(seqs, width))
    tensors = {k: torch.from_numpy(v).to(device) for k, v in columns.items()}
    return MicroBatch(
        seq_indices=tuple(seq_indices), proximal_logprobs=tensors.pop("proximal_logprobs", None), **tensors
    )


def _route_columns(seqs: Sequence[TrainSequence], width: int) -> dict[str, np.ndarray]:
    """``routes`` [S, T, L, K] int64 and ``routed`` [S, T] bool when any sequence has routes, else nothing."""
    shapes = {np.asarray(s.routes).shape[1:] for s in seqs if s.routes is not None}
    if not shapes:
        return {}
    if len(shapes) > 1:
        raise ValueError(f"routes of one batch differ in [layers, top_k]: {sorted(shapes)}")
    layers, top_k = shapes.pop()
    routes = np.zeros((len(seqs), width, layers, top_k), np.int64)
    routed = np.zeros((len(seqs), width), np.bool_)
    for row, seq in enumerate(seqs):
        if seq.routes is not None and seq.route_versions is not None:
            n = seq.num_tokens
            routes[row, :n] = seq.routes
            routed[row, :n] = np.asarray(seq.route_versions) >= 0
    return {"routes": routes, "routed": routed}


def train_minibatches(
    batch: TrainBatch,
    num_minibatches: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    accumulate: Accumulate,
    optimizer_update: Callable[[], tuple[float, bool]],
) -> StepResult:
    """`TrainingBackend.train_step` around a backend's `accumulate` (one minibatch's forward and
    backward) and `optimizer_update` (clip and step: grad norm, skipped): one update per minibatch,
    the model in train mode meanwhile, gradients cleared however it ends."""
    start = time.perf_counter()
    chunks = split_minibatches(len(batch.sequences), num_minibatches)
    results: list[MinibatchResult] = []
    micro_stats: list[dict[str, float]] = []
    entropy_sum, fb_s, opt_s = 0.0, 0.0, 0.0
    model.train()  # gradient checkpointing only acts in train mode; dropout is rejected at init
    try:
        for mb_index, chunk in enumerate(chunks):
            t0 = time.perf_counter()
            loss, ent, stats, num_micro = accumulate(chunk, mb_index, len(chunks))
            t1 = time.perf_counter()
            grad_norm, skipped = optimizer_update()
            opt_s += time.perf_counter() - t1
            fb_s += t1 - t0
            entropy_sum += ent
            micro_stats.extend(stats)
            loss_tokens = sum(batch.sequences[i].num_loss_tokens for i in chunk)
            results.append(MinibatchResult(loss, grad_norm, skipped, num_micro, loss_tokens))
    finally:
        model.eval()
        optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=sum(r.loss for r in results) / len(results),
        grad_norm=sum(r.grad_norm for r in results) / len(results),
        entropy_mean=mean_or_nan(entropy_sum, batch.num_loss_tokens),
        num_loss_tokens=batch.num_loss_tokens,
        minibatches=tuple(results),
        micro_stats=tuple(micro_stats),
        forward_backward_s=fb_s,
        optimizer_s=opt_s,
        total_s=time.perf_counter() - start,
    )


def check_loss(loss: Any) -> Tensor:
    """`loss`, when it is the scalar tensor the loss_fn contract asks for; ValueError otherwise."""
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ValueError(
            f"loss_fn must return a scalar tensor as its loss, got {type(loss).__name__} "
            f"{tuple(getattr(loss, 'shape', ()))}"
        )
    return loss


def reject_dropout(model: nn.Module) -> None:
    """Dropout makes the recomputed log pi random, biasing every importance ratio: refuse it."""
    config = getattr(model, "config", None)
    for name in _DROPOUT_FIELDS:
        value = getattr(config, name, 0.0)
        if isinstance(value, (int, float)) and value > 0:
            raise ValueError(f"model config {name}={value}: dropout must be 0 for RL training")
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            raise ValueError(f"model module {name} has dropout p={module.p}: dropout must be 0 for RL training")


def default_autocast(device: torch.device) -> bool:
    """bf16 autocast where it is supported and fast: CUDA with bf16. Never by default on the CPU."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def bf16_autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on `device` when `enabled`, else nothing."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
