"""Checks of the config that span fields or sections, beyond each field's own type and bounds.

Kept out of `pipeline/config.py` (the schema) so that the schema reads as the reference it is; its
`LeewayConfig._cross_checks` calls these on the parsed values (plain numbers: this module imports
nothing of the schema, and neither torch nor NATS).
"""

from __future__ import annotations

from typing import Any

MAX_STALENESS_LIMIT = 64
"""Upper bound of `staleness.max_staleness` (K).

Why a bound: K sizes the admission window, ``outstanding + trained <= (S + K + 1) * batch_groups``
(`pipeline/rl/staleness.py`), so up to ``(K + 1) * batch_groups`` groups are in flight at once, each a
prompt in the work queue or a generator and then a message in the trajectory stream, which must keep
it until it is trained (``stream.max_bytes``; past it retention removes unread groups: see
`window_warning`). A K in the hundreds or thousands (what a typo, or "no cap" meant as a big
number, looks like) turns into thousands of groups sampled by weights that far behind, whose
importance ratios the correction mostly truncates at ``correction.clip_c``: tokens that cost a
rollout and carry little signal. 64 is 8 times the largest shipped value (8, in
`configs/multi-node.yaml`), so every sensible asynchronous setting fits."""


class SettingConflicts(ValueError):
    """Settings of different sections that contradict each other, as (dotted key, value, why); reported one
    line per key with the override that set it, like `pipeline.config.BackendConflicts`."""

    def __init__(self, conflicts: list[tuple[str, Any, str]]) -> None:
        self.conflicts = conflicts
        super().__init__("; ".join(f"{key} = {value!r}: {why}" for key, value, why in conflicts))


def heartbeat_conflict(heartbeat_s: float, prompt_ack_wait_s: float) -> tuple[str, Any, str] | None:
    """`generator.heartbeat_s` must be below `stream.prompt_ack_wait_s`: a prompt not heartbeated within its
    ack wait is redelivered to another generator while the first still runs it, so a long rollout would be
    generated twice (and its first copy's ack refused)."""
    if heartbeat_s < prompt_ack_wait_s:
        return None
    return (
        "generator.heartbeat_s",
        heartbeat_s,
        f"must be below stream.prompt_ack_wait_s = {prompt_ack_wait_s!r}: a prompt not heartbeated within its ack "
        "wait is redelivered to another generator while the first still runs it; lower generator.heartbeat_s or "
        "raise stream.prompt_ack_wait_s",
    )


def lease_conflict(heartbeat_s: float, ttl_s: float) -> tuple[str, Any, str] | None:
    """`trainer.lease_heartbeat_s` must be below `trainer.lease_ttl_s`: a lease renewed less often than it goes
    stale would be taken over from a live trainer."""
    if heartbeat_s < ttl_s:
        return None
    return (
        "trainer.lease_heartbeat_s",
        heartbeat_s,
        f"must be below trainer.lease_ttl_s = {ttl_s!r}: a second trainer would take the lease over from a live "
        "one; lower trainer.lease_heartbeat_s or raise trainer.lease_ttl_s",
    )


def stop_grace_conflict(stop_grace_s: float | None, final_checkpoint_s: float) -> tuple[str, Any, str] | None:
    """`run.stop_grace_s`, when set, must leave the trainer its final checkpoint budget: a SIGKILL in the
    middle of the final checkpoint loses every step since the last periodic one."""
    if stop_grace_s is None or stop_grace_s > final_checkpoint_s:
        return None
    return (
        "run.stop_grace_s",
        stop_grace_s,
        f"must be above outages.final_checkpoint_s = {final_checkpoint_s!r}: a stop would SIGKILL the trainer in its "
        "final checkpoint; raise run.stop_grace_s, lower outages.final_checkpoint_s, or leave run.stop_grace_s unset",
    )


def window_warning(max_staleness: int, batch_groups: int, max_inline_bytes: int, max_bytes: int) -> str | None:
    """A warning when the staleness window (of admission) may not fit in the trajectory stream, else None.

    The window is ``(K + 1) * batch_groups`` groups of up to ``stream.max_inline_bytes`` each (a larger
    group is claim-checked: its message carries a pointer). Past ``stream.max_bytes``, retention removes
    groups before the trainer reads them. A warning, not an error: most groups are far smaller than the
    inline limit.
    """
    window = (max_staleness + 1) * batch_groups
    worst = window * max_inline_bytes
    if worst <= max_bytes:
        return None
    return (
        f"staleness.max_staleness = {max_staleness} lets {window} groups be outstanding "
        f"((K + 1) x trainer.batch_groups); at up to stream.max_inline_bytes = {max_inline_bytes} each "
        f"that is {worst} bytes, more than stream.max_bytes = {max_bytes}: if groups are that large, "
        "retention removes some before the trainer reads them"
    )
