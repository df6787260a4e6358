"""Aggregate per-token losses into the step's scalar loss.

``loss_norm`` (``advantages.loss_norm``):

- ``constant`` (Dr. GRPO, default): ``sum(token_loss) / constant_tokens``, with a fixed token
  budget such as ``batch_groups * group_size * max_new_tokens``. No length bias, and the gradient
  scale of a step does not depend on how many samples failed, were filtered or were masked.
- ``token_mean``: ``sum(token_loss) / number of loss tokens``. The trainer
  (`actors/trainer/objective.py`) passes the minibatch's loss-token count as ``num_trained_tokens``
  (`LossExtras.minibatch_loss_tokens`): the loss tokens of valid samples, *including* tokens MIS
  rejected, because a divisor that depended on the correction would need a pass over the whole
  minibatch before the first backward. Only without ``num_trained_tokens`` (one call over a whole
  batch) is the divisor ``trained_mask``'s count, which excludes the rejected tokens.

Invariant (RL360's step 70; RL360 is the open-source RL codebase behind the K2 Horizon models, see
`docs/design.md`, "Rewards, groups and failures"): masked samples (infra failures, missing rewards,
dropped by the staleness cap) never enter a denominator. Adding them to a batch changes neither the baseline nor
the gradient; ``tests/rl/test_loss.py`` checks this with autograd. RL360 divided by the sample count
including masked samples and shrank one step's gradient by x0.59.

With gradient accumulation or data parallelism, ``token_mean`` must divide by the minibatch's token
count, not a micro-batch's: pass it as ``num_trained_tokens`` (counted over every micro-batch and
rank; the backends hand it to the loss_fn as `LossExtras.minibatch_loss_tokens`).

Invalid samples reach this module with a loss mask of zeros: `pipeline.rl.batching.prepare_group`
zeroes it before the trainer builds its batch.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossNorm = Literal["constant", "token_mean"]
LOSS_NORMS: tuple[str, ...] = ("constant", "token_mean")


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

    ``num_trained_tokens`` overrides the ``token_mean`` count (for micro-batches and ranks, and
    the trainer's MIS-inclusive divisor; see the module docstring); it is ignored under ``constant``.
    """
    if token_loss.shape != trained_mask.shape:
        raise ValueError(f"token_loss has shape {tuple(token_loss.shape)}, trained_mask {tuple(trained_mask.shape)}")
    total = torch.where(trained_mask.bool(), token_loss, 0.0).sum()
    if loss_norm == "token_mean" and num_trained_tokens is not None:
        if num_trained_tokens < 0:
            raise ValueError(f"num_trained_tokens={num_trained_tokens!r} must be >= 0")
        return total / max(num_trained_tokens, 1)
    return total / loss_denominator(trained_mask, loss_norm=loss_norm, constant_tokens=constant_tokens)
