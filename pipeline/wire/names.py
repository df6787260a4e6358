"""Every NATS subject, stream, consumer and object-store key of a run, derived from the run name alone.

Generators and trainers launched independently agree on where trajectories and prompts live only
because they derive the same names here from `run.name`; nothing is configured twice.

    subjects                                   stream                   retention
    leeway.<run>.traj                          LEEWAY_<run>_TRAJ        limits (age, bytes): replayable
    leeway.<run>.prompts                       LEEWAY_<run>_PROMPTS     work queue: acked = gone
    leeway.<run>.dlq.traj, leeway.<run>.dlq.prompts  LEEWAY_<run>_DLQ   limits: inspectable
    object store: <run>/trajectories/<group_id>.<sha256>.arrow   (claim check for large groups, create-only)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
"""Same rule as `pipeline.config.RunConfig.name`: safe in subjects, stream names and object keys."""


def validate_run_name(run: str) -> str:
    """Return `run` if it is a valid run name, else ValueError naming it (no '.', '*', '>' or spaces)."""
    if not isinstance(run, str) or not RUN_NAME_RE.match(run):
        raise ValueError(f"run name {run!r}: must be 1-64 letters, digits, '-' or '_', starting with a letter or digit")
    return run


@dataclass(frozen=True)
class RunNames:
    """Names of one run's JetStream assets and object keys. Build with `RunNames.for_run(name)`."""

    run: str

    @classmethod
    def for_run(cls, run: str) -> RunNames:
        return cls(validate_run_name(run))

    def __post_init__(self) -> None:
        validate_run_name(self.run)

    @property
    def trajectory_stream(self) -> str:
        return f"LEEWAY_{self.run}_TRAJ"

    @property
    def trajectory_subject(self) -> str:
        return f"leeway.{self.run}.traj"

    @property
    def prompt_stream(self) -> str:
        return f"LEEWAY_{self.run}_PROMPTS"

    @property
    def prompt_subject(self) -> str:
        return f"leeway.{self.run}.prompts"

    @property
    def dead_letter_stream(self) -> str:
        return f"LEEWAY_{self.run}_DLQ"

    @property
    def dead_letter_subjects(self) -> str:
        """Wildcard covering every dead-letter subject of the run (the DLQ stream's subject filter)."""
        return f"leeway.{self.run}.dlq.>"

    @property
    def trajectory_dead_letter_subject(self) -> str:
        return f"leeway.{self.run}.dlq.traj"

    @property
    def prompt_dead_letter_subject(self) -> str:
        return f"leeway.{self.run}.dlq.prompts"

    @property
    def trainer_consumer(self) -> str:
        """Durable pull consumer shared by all trainer ranks."""
        return "trainer"

    @property
    def generator_consumer(self) -> str:
        """Durable pull consumer of the prompt work queue shared by all generators."""
        return "generators"

    def trajectory_key(self, group_id: str, sha256: str | None = None) -> str:
        """Object-store key of a claim-checked group (group ids never contain '/'; see trajectory.ID_RE).

        The body's digest is part of the key, so a regenerated group with the same id gets its own object
        and never overwrites the one an earlier message points to. Without `sha256`: the key pointers
        carried before keys held the digest (still accepted when read).
        """
        if sha256 is None:
            return f"{self.run}/trajectories/{group_id}.arrow"
        return f"{self.run}/trajectories/{group_id}.{sha256}.arrow"

    def claim_keys(self, group_id: str, sha256: str) -> tuple[str, str]:
        """The keys a claim pointer of this run for `group_id` with body digest `sha256` may name: current, legacy."""
        return self.trajectory_key(group_id, sha256), self.trajectory_key(group_id)
