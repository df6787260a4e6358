"""The trainer's objective as a backend `loss_fn`: staleness-aware importance correction + loss normalisation.

The backend hands over log-probs with grad for one micro-batch; this module turns them into the
step's loss with `pipeline.rl.correction` (tis / mis / decoupled_ppo / none, token or sequence level,
optional staleness decay, whose rule is in `pipeline/rl/staleness.py`) and `pipeline.rl.loss` (constant or
token_mean). The ratio always uses the behaviour log-probs recorded by the generator, never a
recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from actors.trainer.backends.base import LossExtras, MicroBatch
from pipeline.config import AdvantagesConfig, CorrectionConfig
from pipeline.rl.correction import corrected_token_loss
from pipeline.rl.loss import aggregate_loss


@dataclass
class CorrectedObjective:
    """`loss_fn` for `TrainingBackend.train_step` at trainer version `version`.

    `constant_tokens` is the Dr. GRPO divisor for the whole step; with several minibatches each
    update divides by its share, so the gradient scale does not depend on the split. Under
    `token_mean` the divisor is the minibatch's loss-token count (MIS-rejected tokens included: a
    divisor that depended on the correction would need a second pass).
    """

    correction: CorrectionConfig
    advantages: AdvantagesConfig
    version: int
    constant_tokens: int

    def __call__(self, logprobs: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
        staleness = self.version - micro.versions
        out = corrected_token_loss(
            logprobs,
            micro.behaviour_logprobs,
            micro.advantages,
            micro.loss_mask,
            staleness=staleness,
            method=self.correction.method,
            level=self.correction.level,
            clip_c=self.correction.clip_c,
            proximal_logp=micro.proximal_logprobs,
            ppo_eps_low=self.correction.ppo_eps_low,
            ppo_eps_high=self.correction.ppo_eps_high,
            staleness_decay=self.correction.staleness_decay,
        )
        loss = aggregate_loss(
            out.token_loss,
            out.trained_mask,
            loss_norm=self.advantages.loss_norm,
            constant_tokens=max(1, self.constant_tokens // extras.num_minibatches),
            num_trained_tokens=extras.minibatch_loss_tokens,
        )
        stats = dict(out.stats)
        mask = micro.loss_mask.bool()
        if mask.any():
            stats["entropy_mean"] = float(extras.entropy[mask].mean())
        stats.update(sampler_mismatch(logprobs, micro.behaviour_logprobs, mask))
        return loss, stats


LOG_RATIO_BOUND = 20.0
"""|log pi - log mu| is clamped here before exp() in the k3 estimate, so one wild token cannot overflow it."""


def sampler_mismatch(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Train/sampler mismatch over the micro-batch's loss tokens, before any correction: ``mismatch/mean_abs_logprob_diff``
    = mean |log pi - log mu| and ``mismatch/k3_kl`` = mean (r - 1 - log r) with r = pi / mu (Schulman's k3
    estimate of KL(mu || pi), >= 0 per token). Over every loss token, so stale tokens add their version gap
    (``is/logp_gap_fresh`` is the same |gap| over staleness-0 tokens only). Empty without loss tokens."""
    if not mask.any():
        return {}
    with torch.no_grad():
        log_r = (logprobs.detach() - behaviour_logprobs)[mask].double().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return {
            "mismatch/mean_abs_logprob_diff": float(log_r.abs().mean()),
            "mismatch/k3_kl": float((log_r.exp() - 1 - log_r).mean()),
        }
