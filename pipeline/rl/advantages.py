"""Group advantages for GRPO / RLOO, with failed samples kept out of the baseline.

One group = all samples drawn for one prompt. A sample is *valid* only when its reward says
something about the policy: a verifier wrote it (``reward_source == "verifier"``), it is not
``None``, and the trajectory did not die for infrastructure reasons (``infra_error``, ``aborted``).
A ``format_error`` scored 0 by the verifier is a policy failure and stays valid; so does a
``truncated`` sample.

Invalid samples get advantage 0 and never enter the baseline (RL360, the open-source RL codebase
behind the K2 Horizon models, see `docs/design.md`; at its step 70 counting masked
samples at reward 0 dragged the baseline from 0.75 to 0.44 and added +0.31 to every advantage).
A group trains only if at least two valid samples disagree; otherwise every advantage is 0.

Worked example (GRPO)::

    rewards  = [1.0, 0.0, None, 1.0]
    statuses = ["ok", "format_error", "infra_error", "truncated"]
    valid    = [True, True, False, True]
    baseline = (1 + 0 + 1) / 3 = 2/3
    advantages = [1/3, -2/3, 0, 1/3], trainable = True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

Estimator = Literal["grpo", "rloo"]

STATUSES = frozenset({"ok", "truncated", "format_error", "infra_error", "aborted"})
"""Every trajectory status the schema allows."""

INFRA_FAILURE_STATUSES = frozenset({"infra_error", "aborted"})
"""Statuses that say nothing about the policy: masked out of the loss and the baseline."""

REWARD_SOURCES = frozenset({"verifier", "none"})

STD_EPS = 1e-6
"""Added to the group std before dividing, so a near-constant group cannot blow up advantages."""


def is_valid_sample(*, status: str, reward_source: str, reward: float | None) -> bool:
    """Whether a sample's reward may enter the baseline and its tokens the loss.

    Trust a reward only if a verifier wrote it: an allow-list of good outcomes rather than a
    deny-list of known failures, so a failure nobody named is masked instead of scored 0.
    Raises ``ValueError`` for an unknown status or reward source, and for a verifier reward that
    is NaN or infinite (a broken verifier must be loud, not silently masked).
    """
    if status not in STATUSES:
        raise ValueError(f"status={status!r} is not one of {sorted(STATUSES)}")
    if reward_source not in REWARD_SOURCES:
        raise ValueError(f"reward_source={reward_source!r} is not one of {sorted(REWARD_SOURCES)}")
    if status in INFRA_FAILURE_STATUSES or reward_source != "verifier" or reward is None:
        return False
    if not math.isfinite(reward):
        raise ValueError(f"reward={reward!r} from the verifier is not finite (status={status!r})")
    return True


def valid_mask(rewards: Sequence[float | None], statuses: Sequence[str], reward_sources: Sequence[str]) -> np.ndarray:
    """Per-sample validity for one group, as a bool array (see ``is_valid_sample``)."""
    if not len(rewards) == len(statuses) == len(reward_sources):
        raise ValueError(
            f"group columns differ in length: rewards={len(rewards)}, statuses={len(statuses)}, "
            f"reward_sources={len(reward_sources)}"
        )
    return np.array(
        [
            is_valid_sample(status=s, reward_source=src, reward=r)
            for r, s, src in zip(rewards, statuses, reward_sources, strict=True)
        ],
        dtype=bool,
    )


def compute_advantages(
    rewards: Sequence[float | None],
    valid: Sequence[bool] | np.ndarray,
    *,
    estimator: Estimator = "grpo",
    std_normalize: bool = False,
) -> tuple[np.ndarray, bool]:
    """Advantages for one group and whether the group trains at all.

    - ``grpo``: baseline = mean reward over the valid samples.
    - ``rloo``: baseline for sample ``i`` = mean reward of the *other* valid samples.
    - ``std_normalize``: divide by the population std (ddof=0) of the valid rewards plus
      ``STD_EPS``. Off by default (Dr. GRPO): per-group std scaling up-weights easy/hard groups.

    Invalid samples get advantage exactly 0 whatever their reward. If fewer than two valid
    samples exist, or all valid rewards are equal, the group carries no learning signal:
    the result is all zeros and ``trainable`` is False.

    Returns ``(advantages, trainable)``, advantages as float64 of the group's length.
    """
    valid_arr = np.asarray(valid, dtype=bool)
    if valid_arr.shape != (len(rewards),):
        raise ValueError(f"valid has shape {valid_arr.shape}, expected ({len(rewards)},) to match rewards")
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"advantages.estimator={estimator!r} is not 'grpo' or 'rloo'")
    for i, (r, ok) in enumerate(zip(rewards, valid_arr, strict=True)):
        if ok and (r is None or not math.isfinite(r)):
            raise ValueError(f"sample {i} is marked valid but its reward is {r!r}")

    advantages = np.zeros(len(rewards), dtype=np.float64)
    valid_rewards = np.array([r for r, ok in zip(rewards, valid_arr, strict=True) if ok], dtype=np.float64)
    if valid_rewards.size < 2 or np.ptp(valid_rewards) == 0.0:
        return advantages, False

    if estimator == "grpo":
        baselines = np.full(valid_rewards.size, valid_rewards.mean())
    else:
        baselines = (valid_rewards.sum() - valid_rewards) / (valid_rewards.size - 1)
    valid_advantages = valid_rewards - baselines
    if std_normalize:
        valid_advantages = valid_advantages / (valid_rewards.std() + STD_EPS)
    advantages[valid_arr] = valid_advantages
    return advantages, True
