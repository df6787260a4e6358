"""Aggregate per-token losses into the step's scalar loss.

``loss_norm`` (``advantages.loss_norm``):

- ``constant`` (Dr. GRPO, default): ``sum(token_loss) / constant_tokens``, with a fixed token
  budget such as ``batch_groups * group_size * max_new_tokens``. No length bias, and the gradient
  scale of a step does not depend on how many samples failed, were filtered or were masked.
- ``token_mean``: ``sum(token_loss) / number of trained tokens``. Trained tokens are the loss
  tokens of valid samples that correction did not reject (``CorrectedLoss.trained_mask``).

Invariant (RL360's step 70; RL360 is the open-source RL codebase behind the K2 Horizon models, see
`docs/design.md`, "Rewards, groups and failures"): masked samples (infra failures, missing rewards,
dropped by the staleness cap) never enter a denominator. Adding them to a batch changes neither the baseline nor
the gradient; ``tests/test_loss.py`` checks this with autograd. RL360 divided by the sample count
including masked samples and shrank one step's gradient by x0.59.

With gradient accumulation or data parallelism, ``token_mean`` must divide by the *step's* trained
token count, not a micro-batch's: pass it as ``num_trained_tokens`` (summed over micro-batches and
all-reduced over ranks).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossNorm = Literal["constant", "token_mean"]
LOSS_NORMS: tuple[str, ...] = ("constant", "token_mean")


def sample_loss_mask(loss_mask: Tensor, sample_valid: Tensor) -> Tensor:
    """``loss_mask [samples, tokens]`` with every token of an invalid sample zeroed, as bool.

    Build the mask handed to ``pipeline.rl.correction`` with this, so a masked sample's tokens are
    out of the loss, the stats and the ``token_mean`` count at once.
    """
    if loss_mask.dim() != 2 or sample_valid.shape != loss_mask.shape[:1]:
        raise ValueError(
            f"loss_mask must be [samples, tokens] and sample_valid [samples]; got {tuple(loss_mask.shape)} "
            f"and {tuple(sample_valid.shape)}"
        )
    return loss_mask.bool() & sample_valid.bool()[:, None]


def loss_denominator(
    trained_mask: Tensor, *, loss_norm: LossNorm = "constant", constant_tokens: int | None = None
) -> float:
    """The number the summed token loss is divided by (see the module docstring).

    ``token_mean`` with no trained tokens returns 1.0, so an empty batch yields loss 0 (still
    attached to the graph) instead of NaN.
    """
    if loss_norm == "constant":
        if constant_tokens is None or constant_tokens <= 0:
            raise ValueError(
                f"advantages.constant_tokens={constant_tokens!r} must be a positive int for loss_norm='constant'"
            )
        return float(constant_tokens)
    if loss_norm == "token_mean":
        return float(max(int(trained_mask.bool().sum()), 1))
    raise ValueError(f"advantages.loss_norm={loss_norm!r} is not one of {LOSS_NORMS}")


def aggregate_loss(
    token_loss: Tensor,
    trained_mask: Tensor,
    *,
    loss_norm: LossNorm = "constant",
    constant_tokens: int | None = None,
    num_trained_tokens: int | None = None,
) -> Tensor:
    """Scalar loss: the sum of ``token_loss`` over ``trained_mask``, divided per ``loss_norm``.

    ``num_trained_tokens`` overrides the ``token_mean`` count (for micro-batches and ranks; see
    the module docstring); it is ignored under ``constant``.
    """
    if token_loss.shape != trained_mask.shape:
        raise ValueError(f"token_loss has shape {tuple(token_loss.shape)}, trained_mask {tuple(trained_mask.shape)}")
    total = torch.where(trained_mask.bool(), token_loss, 0.0).sum()
    if loss_norm == "token_mean" and num_trained_tokens is not None:
        if num_trained_tokens < 0:
            raise ValueError(f"num_trained_tokens={num_trained_tokens!r} must be >= 0")
        return total / max(num_trained_tokens, 1)
    return total / loss_denominator(trained_mask, loss_norm=loss_norm, constant_tokens=constant_tokens)
