"""Importance correction for off-policy (stale) tokens: per-token losses and their health stats.

Every trained token was sampled from a behaviour policy ``mu`` (the generator's weights at some
version ``v``, after temperature/top-p), whose log-prob the generator recorded. The trainer holds
``pi_theta`` at version ``V``. The ratio ``rho = pi / mu`` corrects for the gap; it is computed by
one function, ``importance_ratio``, and always detached when used as a weight. ``mu`` is never
recomputed: only the sampler knows the distribution the token was actually drawn from.

Methods (``correction.method``), as per-token *losses* (to minimise; ``A`` = advantage)::

    none           loss = -A * log pi                         plain on-policy REINFORCE
    tis            loss = -min(rho, C) * A * log pi           rho = pi / mu
    mis            loss = -rho * A * log pi  if 1/C <= rho <= C, else the token is not trained
    decoupled_ppo  loss = -min(pi_prox/mu, C) * min(r A, clip(r, 1-eps_low, 1+eps_high) A),
                   r = pi / pi_prox, pi_prox = the trainer's weights at the start of the step

With ``staleness_decay = gamma`` every weight is further multiplied by ``gamma ** staleness``
(`pipeline.rl.staleness.decay_weight`).

``level="sequence"`` replaces each token's ``log rho`` by the mean of ``log rho`` over its sample's
loss tokens (the geometric-mean ratio), so a whole sample is truncated or masked together. For
``decoupled_ppo`` the level applies to the behaviour weight ``pi_prox/mu``; the PPO ratio ``r``
stays per token.

Invariants:
- ``loss_mask`` must already be 0 on prompt/tool tokens, on every token of an invalid (masked)
  sample and on tokens cut by the staleness cap. Stats are means over ``loss_mask`` tokens only,
  so masked samples never dilute them (the RL360 codebase, see ``docs/design.md``, logged
  ``train/tis`` as ``1 - masked/kept`` because its means counted masked tokens).
- MIS-masked tokens are *not trained*: ``trained_mask`` excludes them and their loss is 0. They
  still count in the trainer's ``token_mean`` divisor, the minibatch's loss tokens (see
  ``pipeline.rl.loss``).
- Values at positions outside ``loss_mask`` (NaN log-probs on prompt tokens, garbage staleness)
  never reach the loss, the stats or the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from pipeline.rl.staleness import decay_weight

Method = Literal["tis", "mis", "decoupled_ppo", "none"]
Level = Literal["token", "sequence"]

METHODS: tuple[str, ...] = ("tis", "mis", "decoupled_ppo", "none")
LEVELS: tuple[str, ...] = ("token", "sequence")
DEFAULT_CLIP_C = 2.0
DEFAULT_PPO_EPS_LOW = 0.2
DEFAULT_PPO_EPS_HIGH = 0.28


@dataclass(frozen=True)
class CorrectedLoss:
    """Per-token loss and what went into it; all tensors have the input's shape.

    ``token_loss`` carries the graph to ``logp`` and is 0 outside ``trained_mask``.
    ``trained_mask`` = ``loss_mask`` minus the tokens MIS rejected: the tokens that count as trained.
    ``weights`` is the detached weight applied per token (IS weight x staleness decay), 0 outside
    ``trained_mask``. ``stats`` are Python floats, ready to log.
    """

    token_loss: Tensor
    trained_mask: Tensor
    weights: Tensor
    stats: dict[str, float]


def importance_ratio(
    target_logp: Tensor, behaviour_logp: Tensor, loss_mask: Tensor, *, level: Level = "token"
) -> Tensor:
    """``rho = exp(log target - log behaviour)``, detached; exactly 1 outside ``loss_mask``.

    ``level="sequence"``: each loss token gets its sample's geometric-mean ratio
    ``exp(mean over the sample's loss tokens of (log target - log behaviour))``. A 1-D input is one
    sample; a 2-D input is ``[samples, tokens]``. A sample with no loss tokens gets ratio 1.
    """
    mask = loss_mask.bool()
    log_ratio = torch.where(mask, target_logp.detach() - behaviour_logp.detach(), 0.0)
    if level == "sequence":
        rows_ratio, rows_mask = log_ratio.reshape(-1, log_ratio.shape[-1]), mask.reshape(-1, mask.shape[-1])
        sample_log_ratio = rows_ratio.sum(-1) / rows_mask.sum(-1).clamp(min=1)
        log_ratio = torch.where(rows_mask, sample_log_ratio[:, None], 0.0).reshape(log_ratio.shape)
    elif level != "token":
        raise ValueError(f"correction.level={level!r} is not one of {LEVELS}")
    return torch.exp(log_ratio)


def corrected_token_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    staleness: Tensor,
    method: Method = "tis",
    level: Level = "token",
    clip_c: float = DEFAULT_CLIP_C,
    proximal_logp: Tensor | None = None,
    ppo_eps_low: float = DEFAULT_PPO_EPS_LOW,
    ppo_eps_high: float = DEFAULT_PPO_EPS_HIGH,
    staleness_decay: float | None = None,
) -> CorrectedLoss:
    """Per-token corrected policy-gradient loss (see the module docstring for the formulas).

    Shapes: all tensors ``[tokens]`` (one sample) or ``[samples, tokens]``. ``logp`` is the
    trainer's log-prob with grad; ``behaviour_logp`` the generator's recorded one; ``staleness``
    the trainer version minus the token's version (ints); ``advantages`` already broadcast per token.

    ``proximal_logp`` (``decoupled_ppo`` only) is the log-prob under the weights at the step's
    start, computed without grad. If ``None``, ``logp.detach()`` is used, which is exact when the
    step takes one optimizer update (any number of gradient-accumulation micro-batches) and wrong
    once the weights change inside the step.
    """
    _check_config(method, level, clip_c, ppo_eps_low, ppo_eps_high, staleness_decay)
    _check_shapes(
        logp,
        behaviour_logp=behaviour_logp,
        advantages=advantages,
        loss_mask=loss_mask,
        staleness=staleness,
        proximal_logp=proximal_logp,
    )
    mask = loss_mask.bool()
    adv = torch.where(mask, advantages.detach().to(logp.dtype), 0.0)
    if method == "decoupled_ppo":
        prox = logp.detach() if proximal_logp is None else proximal_logp.detach()
        rho = importance_ratio(prox, behaviour_logp, mask, level=level)
    else:
        rho = importance_ratio(logp, behaviour_logp, mask, level=level)

    trained = mask
    if method == "tis" or method == "decoupled_ppo":
        is_weight = rho.clamp(max=clip_c)
    elif method == "mis":
        trained = mask & (rho >= 1.0 / clip_c) & (rho <= clip_c)
        is_weight = rho
    else:
        is_weight = torch.ones_like(rho)
    weights = torch.where(trained, is_weight * _decay(staleness, mask, staleness_decay, rho.dtype), 0.0)

    if method == "decoupled_ppo":
        ppo_ratio = torch.exp(torch.where(mask, logp - prox, 0.0))
        clipped = ppo_ratio.clamp(1.0 - ppo_eps_low, 1.0 + ppo_eps_high)
        objective = torch.minimum(ppo_ratio * adv, clipped * adv)
    else:
        objective = torch.where(mask, logp, 0.0) * adv
    token_loss = torch.where(trained, -weights * objective, 0.0)

    stats = _stats(logp, behaviour_logp, mask, trained, rho, weights, staleness, clip_c=clip_c, method=method)
    if method == "decoupled_ppo":
        with torch.no_grad():
            clip_active = mask & (clipped * adv < ppo_ratio * adv)
            stats["ppo_clip_frac"] = _frac(clip_active, mask)
    return CorrectedLoss(token_loss=token_loss, trained_mask=trained, weights=weights.detach(), stats=stats)


def _decay(staleness: Tensor, mask: Tensor, gamma: float | None, dtype: torch.dtype) -> Tensor:
    """``gamma ** staleness`` on loss tokens, 1 elsewhere (or everywhere when decay is off)."""
    if gamma is None:
        return torch.ones(mask.shape, dtype=dtype, device=mask.device)
    return decay_weight(torch.where(mask, staleness, 0).to(dtype), gamma)


@torch.no_grad()
def _stats(
    logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    trained: Tensor,
    rho: Tensor,
    weights: Tensor,
    staleness: Tensor,
    *,
    clip_c: float,
    method: str,
) -> dict[str, float]:
    """Health of the correction over loss tokens only; NaN where there is nothing to average.

    ``rho_*`` are the raw ratio's tails (before truncation/masking), ``weight_*`` the applied
    weight (after truncation, masking and decay). ``ess`` = (sum w)^2 / (sum w^2) / n over the
    ``n`` loss tokens, 1.0 when every weight is equal. ``logp_gap_fresh`` = mean |log pi - log mu|
    over staleness-0 tokens: the trainer/sampler numerical gap, watched as a trend.
    ``decoupled_ppo`` adds ``ppo_clip_frac``: loss tokens where the clipped branch won (no gradient).
    """
    num_loss = int(mask.sum())
    fresh = mask & (staleness == 0)
    stats = {
        "num_loss_tokens": float(num_loss),
        "num_trained_tokens": float(trained.sum()),
        "num_fresh_tokens": float(fresh.sum()),
    }
    if num_loss == 0:
        nan = math.nan
        return stats | {
            k: nan
            for k in (
                "rho_mean",
                "rho_min",
                "rho_max",
                "weight_mean",
                "weight_min",
                "weight_max",
                "frac_truncated",
                "frac_masked",
                "ess",
                "logp_gap_fresh",
            )
        }
    r, w = rho[mask].double(), weights[mask].double()
    sum_w_sq = float((w * w).sum())
    truncates = method in ("tis", "decoupled_ppo")
    gap = (logp.detach() - behaviour_logp.detach()).abs()[fresh].double()
    return stats | {
        "rho_mean": float(r.mean()),
        "rho_min": float(r.min()),
        "rho_max": float(r.max()),
        "weight_mean": float(w.mean()),
        "weight_min": float(w.min()),
        "weight_max": float(w.max()),
        "frac_truncated": _frac(mask & (rho > clip_c), mask) if truncates else 0.0,
        "frac_masked": _frac(mask & ~trained, mask),
        "ess": float(w.sum()) ** 2 / sum_w_sq / num_loss if sum_w_sq > 0 else 0.0,
        "logp_gap_fresh": float(gap.mean()) if gap.numel() else math.nan,
    }


def _frac(selected: Tensor, mask: Tensor) -> float:
    """Fraction of ``mask`` tokens that are ``selected``."""
    return float((selected & mask).sum()) / max(int(mask.sum()), 1)


def _check_config(
    method: str, level: str, clip_c: float, ppo_eps_low: float, ppo_eps_high: float, staleness_decay: float | None
) -> None:
    """Reject bad config values, naming the field and the value."""
    if method not in METHODS:
        raise ValueError(f"correction.method={method!r} is not one of {METHODS}")
    if level not in LEVELS:
        raise ValueError(f"correction.level={level!r} is not one of {LEVELS}")
    if not clip_c >= 1.0:
        raise ValueError(f"correction.clip_c={clip_c!r} must be >= 1 (MIS keeps [1/C, C])")
    if not 0.0 <= ppo_eps_low < 1.0:
        raise ValueError(f"correction.ppo_eps_low={ppo_eps_low!r} must be in [0, 1)")
    if not ppo_eps_high >= 0.0:
        raise ValueError(f"correction.ppo_eps_high={ppo_eps_high!r} must be >= 0")
    if staleness_decay is not None and not 0.0 < staleness_decay <= 1.0:
        raise ValueError(f"correction.staleness_decay={staleness_decay!r} must be in (0, 1] or None")


def _check_shapes(logp: Tensor, **others: Tensor | None) -> None:
    """Every per-token tensor must line up with ``logp``: misalignment would train on wrong tokens."""
    if logp.dim() not in (1, 2):
        raise ValueError(f"logp must be [tokens] or [samples, tokens], got shape {tuple(logp.shape)}")
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logp has {tuple(logp.shape)}")
