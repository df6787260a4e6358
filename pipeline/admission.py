"""AReaL-style prompt admission: pace generation so little work ever exceeds the staleness cap.

The trainer admits prompts into the prompt queue only while::

    queued + in_flight + trained <= (V + K + 1) * batch_groups

where ``V`` is the trainer's current policy version, ``K = max_staleness`` and the counts are in
groups (one prompt = one group):

- ``queued``: admitted prompts no generator has picked up yet;
- ``in_flight``: picked up and not yet consumed by the trainer (generating, or finished and waiting
  in the trajectory stream). The trainer cannot tell these two apart cheaply and need not: only
  the sum matters;
- ``trained``: groups that entered an optimizer step, since the run began (restored on resume).

A group the trainer consumes *without* training on it (filtered because its valid samples agree,
dropped by the staleness cap, dead-lettered) returns its slot: ``on_group_discarded``. Otherwise a
filter that drops a third of the groups would shrink admission every step until it starved.

Why it bounds staleness: when each step trains ``batch_groups`` groups, ``trained = V * batch_groups``
and at most ``(K + 1)`` steps' worth of groups are outstanding. Consumed in order, a prompt admitted
at version ``V`` enters a step that starts at version ``V + K`` at the latest, so a token sampled
with weights of version ``V`` or newer has staleness at most ``K``. Generators that fall more than
``K`` versions behind resync before a new rollout, which keeps the sampling side inside the cap.
Pacing is preferred to dropping: dropping starves slow, hard prompts.

The object is a pure state machine: no clocks, no I/O. ``admit()`` reserves nothing; publish up
to that many prompts, then report the number actually published with ``on_admitted``.
"""

from __future__ import annotations


class PromptAdmission:
    """Counts groups by state and answers how many new prompts may be admitted now."""

    def __init__(self, *, batch_groups: int, max_staleness: int) -> None:
        if batch_groups < 1:
            raise ValueError(f"batch_groups={batch_groups!r} must be >= 1")
        if max_staleness < 0:
            raise ValueError(f"staleness.max_staleness={max_staleness!r} must be >= 0")
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.version = 0
        self.outstanding = 0
        """Admitted and not yet consumed: queued + in_flight."""
        self.trained = 0

    @property
    def capacity(self) -> int:
        """Total groups the formula allows at the current version: ``(V + K + 1) * batch_groups``."""
        return (self.version + self.max_staleness + 1) * self.batch_groups

    def admit(self) -> int:
        """How many new prompts may be admitted now (never negative). Does not change state."""
        return max(0, self.capacity - self.outstanding - self.trained)

    def observe(self, *, version: int, queued: int, in_flight: int, trained: int) -> None:
        """Replace the state with an absolute snapshot (resume, or a periodic reconciliation)."""
        for name, value in (("version", version), ("queued", queued), ("in_flight", in_flight), ("trained", trained)):
            if value < 0:
                raise ValueError(f"{name}={value!r} must be >= 0")
        self.version = version
        self.outstanding = queued + in_flight
        self.trained = trained

    def on_admitted(self, num_groups: int) -> None:
        """``num_groups`` prompts were published to the prompt queue."""
        _check_count("num_groups", num_groups)
        self.outstanding += num_groups

    def on_group_trained(self, num_groups: int = 1) -> None:
        """``num_groups`` outstanding groups entered an optimizer step."""
        self._consume(num_groups)
        self.trained += num_groups

    def on_group_discarded(self, num_groups: int = 1) -> None:
        """``num_groups`` outstanding groups were consumed without training; their slots return."""
        self._consume(num_groups)

    def on_version(self, version: int) -> None:
        """The trainer now holds ``version``. Versions only move forward."""
        if version < self.version:
            raise ValueError(f"version={version!r} is older than the current version {self.version}")
        self.version = version

    def _consume(self, num_groups: int) -> None:
        _check_count("num_groups", num_groups)
        if num_groups > self.outstanding:
            raise ValueError(f"consumed {num_groups} groups but only {self.outstanding} are outstanding")
        self.outstanding -= num_groups


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name}={value!r} must be >= 0")
