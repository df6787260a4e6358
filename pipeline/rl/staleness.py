"""The staleness rule, written once: every role calls these pure functions and restates nothing.

A policy version is an integer (0 = the initial weights; each published optimizer step adds 1). When
the trainer holds version ``V``, a token sampled with the weights of version ``v`` has staleness
``V - v``. ``K = staleness.max_staleness`` bounds it, enforced at four places, upstream first so that
little work is wasted (pacing is preferred to dropping: dropping starves slow, hard prompts):

1. **Admission** (trainer, `admissible_prompts`): prompts enter the prompt queue only while
   ``outstanding + trained <= (S + K + 1) * batch_groups``, ``S`` = optimizer steps the trainer has
   taken (AReaL-style; counts in groups, one prompt = one group; ``outstanding`` = admitted and not
   yet consumed, ``trained`` = groups that entered an optimizer step). ``S`` is not ``V``: a resume
   publishes its checkpoint's weights as one more version, so ``V`` runs ahead of ``S`` afterwards,
   and a replay takes steps without publishing; the rule paces groups per step of training, so it
   counts steps. When each step trains ``batch_groups`` groups, at most ``K + 1`` steps' worth of
   groups are outstanding, so a prompt admitted after ``S`` steps is consumed by a step starting
   after ``S + K`` steps at the latest. A group consumed without training (filtered, capped away,
   invalid) leaves ``outstanding`` without entering ``trained``: its slot returns.
2. **Sync floor** (generator, `sync_floor`): before a rollout starts, the engine must hold a
   version ``>= max(newest known, every prompt's admission version) - K``. With ``K = 0`` every
   rollout uses the version the trainer held when it admitted the prompt: synchronous RL, exactly.
3. **Abort rule** (generator, `crosses_cap`, when ``staleness.abort_in_flight``): a running batch
   whose starting weights fall more than ``K`` behind the newest known version is aborted and its
   prompts handed back, since its tokens could no longer be trained.
4. **Cap at the loss** (trainer, `apply_staleness_cap`): tokens staler than ``K`` never reach the
   loss, under one of two policies (below). This is the counted last resort.

And one soft term: with ``correction.staleness_decay = gamma`` each token's importance weight is
multiplied by ``gamma ** staleness`` (`decay_weight`), so staler tokens count less.

Cap policies:

- ``drop_trajectory``: a sample with any loss token staler than ``K`` is dropped whole;
- ``mask_tokens``: only the stale tokens leave the loss mask; a sample left with no loss tokens
  counts as dropped.

A dropped sample is also invalid for its group's baseline (``pipeline.rl.batching`` ANDs ``keep`` into
the validity mask before ``pipeline.rl.advantages.compute_advantages``).

Worked example, ``V = 5``, ``K = 2``::

    versions  = [-1, -1, 2, 3, 3, -1, 4]     prompt, prompt, 3 sampled tokens, tool token, 1 sampled
    loss_mask = [ 0,  0, 1, 1, 1,  0, 1]
    staleness = [ -,  -, 3, 2, 2,  -, 1]     token 2 is over the cap
    drop_trajectory -> keep = False, every loss token removed
    mask_tokens     -> loss_mask = [0, 0, 0, 1, 1, 0, 1], keep = True, 1 token masked
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np

CapPolicy = Literal["drop_trajectory", "mask_tokens"]
CAP_POLICIES: tuple[str, ...] = ("drop_trajectory", "mask_tokens")

Weights = TypeVar("Weights")
"""A numpy array or a torch tensor (`decay_weight` works on either)."""


# ---- 1. admission (trainer) --------------------------------------------------------------------------


def admission_capacity(*, steps: int, max_staleness: int, batch_groups: int) -> int:
    """Groups the rule allows in total after `steps` optimizer steps: ``(S + K + 1) * batch_groups``."""
    return (steps + max_staleness + 1) * batch_groups


def admissible_prompts(*, steps: int, max_staleness: int, batch_groups: int, outstanding: int, trained: int) -> int:
    """How many new prompts may enter the prompt queue now (never negative).

    `steps` (``S``) counts the optimizer steps taken, not the version (see the module docstring);
    `outstanding` the admitted groups not yet consumed; `trained` the groups that entered an
    optimizer step.
    """
    for name, value in (
        ("steps", steps),
        ("outstanding", outstanding),
        ("trained", trained),
        ("staleness.max_staleness", max_staleness),
    ):
        if value < 0:
            raise ValueError(f"{name}={value!r} must be >= 0")
    if batch_groups < 1:
        raise ValueError(f"trainer.batch_groups={batch_groups!r} must be >= 1")
    capacity = admission_capacity(steps=steps, max_staleness=max_staleness, batch_groups=batch_groups)
    return max(0, capacity - outstanding - trained)


# ---- 2. and 3. sync floor and abort rule (generator) ------------------------------------------------


def sync_floor(newest_known: int, max_staleness: int, policy_versions: Sequence[int]) -> int:
    """Oldest engine version a new rollout may start with.

    Admission versions of -1 (an admitter that did not say) add no floor.

    >>> sync_floor(newest_known=7, max_staleness=2, policy_versions=[3, 8])
    6
    """
    return max(max([newest_known, *policy_versions]) - max_staleness, 0)


def crosses_cap(start_version: int, newest_known: int, max_staleness: int) -> bool:
    """True when tokens sampled at `start_version` are already staler than the cap."""
    return newest_known - start_version > max_staleness


# ---- 4. the cap at the loss (trainer) ----------------------------------------------------------------


@dataclass(frozen=True)
class CapDecision:
    """What the cap keeps. ``keep[i]`` is False for a dropped sample, whose ``loss_masks[i]`` is all 0.

    ``num_stale_tokens`` counts loss tokens over the cap; ``num_removed_tokens`` counts loss tokens
    the cap took out of the loss (under ``drop_trajectory`` that includes a dropped sample's fresh
    tokens).
    """

    keep: np.ndarray
    loss_masks: tuple[np.ndarray, ...]
    num_samples: int
    num_dropped: int
    num_stale_tokens: int
    num_removed_tokens: int

    @property
    def frac_dropped(self) -> float:
        """Fraction of this decision's samples the cap dropped. The trainer applies the cap per group and logs
        counts instead (`samples/dropped_by_cap` in `pipeline/rl/step_metrics.py`), not this fraction."""
        return self.num_dropped / self.num_samples if self.num_samples else 0.0


@dataclass(frozen=True)
class StalenessStats:
    """Staleness of the loss tokens of a batch. ``min``/``mean``/``max`` are None with no loss tokens.

    ``histogram`` maps staleness -> token count; ``versions_spanned[i]`` is ``max - min + 1`` over
    sample ``i``'s loss-token versions (0 with no loss tokens; above 1 means its weights changed
    mid-rollout).
    """

    min: int | None
    mean: float | None
    max: int | None
    histogram: dict[int, int]
    versions_spanned: np.ndarray
    num_tokens: int


def apply_staleness_cap(
    versions: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
    *,
    current_version: int,
    max_staleness: int,
    policy: CapPolicy = "drop_trajectory",
) -> CapDecision:
    """Apply the cap to a batch of samples (ragged 1-D arrays, one per sample; see module docstring).

    Raises ``ValueError`` for a loss token without a version (-1) or with a version newer than
    ``current_version``: either means the per-token alignment is broken, and training on it would
    hide that.
    """
    if policy not in CAP_POLICIES:
        raise ValueError(f"staleness.policy={policy!r} is not one of {CAP_POLICIES}")
    if max_staleness < 0:
        raise ValueError(f"staleness.max_staleness={max_staleness!r} must be >= 0")
    keep, new_masks = [], []
    num_stale = num_removed = 0
    for i, (sample_versions, mask) in enumerate(_pairs(versions, loss_masks)):
        staleness = _loss_token_staleness(i, sample_versions, mask, current_version)
        stale = mask & (staleness > max_staleness)
        num_stale += int(stale.sum())
        new_mask = mask & ~stale if policy == "mask_tokens" else (mask if not stale.any() else np.zeros_like(mask))
        dropped = bool(mask.any()) and not new_mask.any()
        num_removed += int(mask.sum() - new_mask.sum())
        keep.append(not dropped)
        new_masks.append(new_mask)
    keep_arr = np.array(keep, dtype=bool)
    return CapDecision(
        keep=keep_arr,
        loss_masks=tuple(new_masks),
        num_samples=len(keep),
        num_dropped=int((~keep_arr).sum()),
        num_stale_tokens=num_stale,
        num_removed_tokens=num_removed,
    )


def staleness_stats(
    versions: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray], current_version: int
) -> StalenessStats:
    """Staleness min/mean/max, histogram and versions spanned per sample, over loss tokens only."""
    per_sample, spanned = [], []
    for i, (sample_versions, mask) in enumerate(_pairs(versions, loss_masks)):
        staleness = _loss_token_staleness(i, sample_versions, mask, current_version)[mask]
        per_sample.append(staleness)
        spanned.append(int(staleness.max() - staleness.min() + 1) if staleness.size else 0)
    every = np.concatenate(per_sample) if per_sample else np.zeros(0, dtype=np.int64)
    values, counts = np.unique(every, return_counts=True)
    return StalenessStats(
        min=int(every.min()) if every.size else None,
        mean=float(every.mean()) if every.size else None,
        max=int(every.max()) if every.size else None,
        histogram={int(v): int(c) for v, c in zip(values, counts, strict=True)},
        versions_spanned=np.array(spanned, dtype=np.int64),
        num_tokens=int(every.size),
    )


# ---- the soft term: staleness decay (trainer's correction) ------------------------------------------


def decay_weight(staleness: Weights, gamma: float) -> Weights:
    """``gamma ** staleness``, elementwise (numpy or torch); callers zero the staleness of non-loss tokens."""
    return gamma**staleness  # type: ignore[operator,return-value]


# ---- helpers ------------------------------------------------------------------------------------------


def _pairs(versions: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-sample (versions as int64, loss mask as bool), checked for equal counts and lengths."""
    if len(versions) != len(loss_masks):
        raise ValueError(f"{len(versions)} version arrays but {len(loss_masks)} loss masks")
    pairs = []
    for i, (v, m) in enumerate(zip(versions, loss_masks, strict=True)):
        v_arr, m_arr = np.asarray(v, dtype=np.int64), np.asarray(m).astype(bool)
        if v_arr.shape != m_arr.shape or v_arr.ndim != 1:
            raise ValueError(
                f"sample {i}: versions shape {v_arr.shape} and loss_mask shape {m_arr.shape} must be equal 1-D"
            )
        pairs.append((v_arr, m_arr))
    return pairs


def _loss_token_staleness(index: int, versions: np.ndarray, mask: np.ndarray, current_version: int) -> np.ndarray:
    """``current_version - versions`` (meaningful on loss tokens only), after checking them."""
    loss_versions = versions[mask]
    if (loss_versions < 0).any():
        raise ValueError(f"sample {index}: a loss token has version -1 (loss tokens must carry the sampler's version)")
    if (loss_versions > current_version).any():
        raise ValueError(
            f"sample {index}: token version {int(loss_versions.max())} is newer than the trainer's version "
            f"{current_version} (trainer resumed behind the published weights?)"
        )
    return current_version - versions
