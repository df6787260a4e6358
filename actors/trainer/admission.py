"""How many prompts the live trainer admits now, and how many groups retention took before they were read.

Both feed the admission rule (`pipeline/rl/staleness.py`): outstanding groups hold slots, and a group that
can no longer arrive (decided, dropped, refused, or removed by stream retention) must give its slot back,
or admission stalls. The live session, the trainer test fakes and the loop's still-to-come count share them
(`outstanding_groups`).
"""

from __future__ import annotations

import logging

from actors.trainer.checkpoints import TrainerState
from pipeline.config import LeewayConfig
from pipeline.rl.staleness import admissible_prompts
from pipeline.wire.group_limits import GroupLimits

log = logging.getLogger(__name__)


def outstanding_groups(state: TrainerState, settled: int = 0) -> int:
    """Admitted groups that can still arrive: neither decided in a committed step nor among the `settled` ones of the
    step still filling (already delivered, dropped or refused, not yet committed)."""
    return state.admitted - state.decided_groups - settled


def admission_count(cfg: LeewayConfig, state: TrainerState, pending_dropped: int = 0) -> int:
    """How many prompts the staleness rule admits now; `pending_dropped`: groups of the step still filling
    that are already decided (dropped or refused) but not yet committed, whose slots are free too."""
    return admissible_prompts(
        steps=state.step,
        max_staleness=cfg.staleness.max_staleness,
        batch_groups=cfg.trainer.batch_groups,
        outstanding=max(0, outstanding_groups(state, pending_dropped)),
        trained=state.trained_groups,
    )


def group_limits(cfg: LeewayConfig, max_positions: int | None) -> GroupLimits:
    """The largest group the trainer's door takes (`pipeline.wire.group_limits`): `rollout.max_group_*`, and the
    model's context (`max_positions`) times the claimed samples, checked on the headers before anything inflates."""
    return GroupLimits.for_run(
        group_size=cfg.advantages.group_size,
        max_sample_tokens=max_positions,
        max_samples=cfg.rollout.max_group_samples,
        max_tokens=cfg.rollout.max_group_tokens,
    )


def count_lost_to_retention(start_seq: int, first_seq: int, last_seq: int, what: str) -> int:
    """Groups between `start_seq` and the stream's first sequence, removed by retention before they were
    read; said at WARNING (`what` names the reader), so a gap is never silent."""
    end = min(first_seq - 1, last_seq)
    lost = max(0, end - start_seq + 1)
    if lost:
        log.warning(
            "%s: trajectory stream seqs %d..%d (%d groups) were removed by retention (stream.max_age_s / "
            "stream.max_bytes) before this trainer read them; they are lost to training",
            what,
            start_seq,
            end,
            lost,
        )
    return lost
