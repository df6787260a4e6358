"""From received trajectory groups to what a trainer step trains on: cap, validity, advantages, filter.

Pure logic, no I/O: the trainer loop feeds groups in and gets back `PreparedGroup`s, each either
trainable (with one `TrainSequence` per sample, masked samples carrying an all-zero loss mask) or
not, with the reason. The order of decisions follows DESIGN.md and RL360's lessons:

    group ──► staleness cap (drop_trajectory | mask_tokens) against the trainer's version V
          ──► validity: status ok/truncated/format_error with a verifier reward; dropped samples invalid
          ──► advantages over the valid samples only (GRPO or RLOO)
          ──► trainable only if at least two valid samples disagree, else "filtered"

A masked sample (infra failure, missing reward, dropped by the cap) is in no baseline and no
denominator: its tokens reach the backend with loss mask 0, so only its presence is visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.advantages import compute_advantages, valid_mask
from pipeline.staleness import CapPolicy, apply_staleness_cap
from pipeline.trajectory import TrajectoryGroup

DROP_CAP = "staleness_cap"
DROP_FILTER = "no_disagreement"


@dataclass(frozen=True)
class GroupPolicy:
    """The config a group decision depends on (a copy of the relevant fields, so this stays pure)."""

    max_staleness: int | None
    """None: no cap (replay with the cap switched off)."""
    cap_policy: CapPolicy = "drop_trajectory"
    estimator: str = "grpo"
    std_normalize: bool = False


@dataclass(frozen=True, eq=False)
class TrainableSample:
    """One sample ready for the backend (field for field a `TrainSequence`); invalid ones have mask 0."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    versions: np.ndarray
    advantage: float
    sample_id: str


@dataclass
class PreparedGroup:
    """One group after the decisions above; `samples` is empty unless `trainable`."""

    group: TrajectoryGroup
    trainable: bool
    drop_reason: str | None
    samples: list[TrainableSample] = field(default_factory=list)
    valid: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    kept_by_cap: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    num_stale_tokens: int = 0

    @property
    def group_id(self) -> str:
        return self.group.group_id


def _rewards(group: TrajectoryGroup) -> list[float | None]:
    return [None if np.isnan(r) else float(r) for r in group.reward]


def _first_token_unmasked(mask: np.ndarray) -> np.ndarray:
    """Position 0 has no context to predict it; a loss mask never covers it (prompts are never empty)."""
    if mask.size and mask[0]:
        mask = mask.copy()
        mask[0] = 0
    return mask


def prepare_group(group: TrajectoryGroup, *, version: int, policy: GroupPolicy) -> PreparedGroup:
    """Apply the cap, validity and advantages to one group at trainer version `version`."""
    versions = [group.versions[group.token_slice(i)] for i in range(group.num_samples)]
    masks = [group.loss_mask[group.token_slice(i)] for i in range(group.num_samples)]
    if policy.max_staleness is None:
        keep = np.ones(group.num_samples, dtype=bool)
        cap_masks: Sequence[np.ndarray] = masks
        stale_tokens = 0
    else:
        decision = apply_staleness_cap(
            versions, masks, current_version=version, max_staleness=policy.max_staleness, policy=policy.cap_policy
        )
        keep, cap_masks, stale_tokens = decision.keep, decision.loss_masks, decision.num_stale_tokens
    rewards = _rewards(group)
    valid = valid_mask(rewards, group.status, group.reward_source) & keep
    prepared = PreparedGroup(group, False, None, valid=valid, kept_by_cap=keep, num_stale_tokens=stale_tokens)
    if not keep.any():
        prepared.drop_reason = DROP_CAP
        return prepared
    advantages, trainable = compute_advantages(
        rewards,
        valid,
        estimator=policy.estimator,
        std_normalize=policy.std_normalize,  # type: ignore[arg-type]
    )
    if not trainable:
        uncapped_valid = valid_mask(rewards, group.status, group.reward_source)
        capped_away = not keep.all() and compute_advantages(rewards, uncapped_valid)[1]
        prepared.drop_reason = DROP_CAP if capped_away else DROP_FILTER
        return prepared
    prepared.trainable = True
    for i in range(group.num_samples):
        s = group.token_slice(i)
        mask = np.asarray(cap_masks[i], dtype=np.uint8) if valid[i] else np.zeros(s.stop - s.start, dtype=np.uint8)
        prepared.samples.append(
            TrainableSample(
                tokens=group.tokens[s],
                loss_mask=_first_token_unmasked(mask),
                behaviour_logprobs=group.logprobs[s],
                versions=group.versions[s],
                advantage=float(advantages[i]),
                sample_id=group.trajectory_ids[i],
            )
        )
    return prepared
