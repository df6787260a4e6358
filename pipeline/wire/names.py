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
"""The one rule for a run name (`pipeline.config.RunConfig.name` checks it here too): safe in subjects,
stream names and object keys, so no '.', '*', '>', '/' or spaces."""
RUN_NAME_RULE = "1-64 letters, digits, '-' or '_', starting with a letter or digit"
"""`RUN_NAME_RE` in words, for the error message."""


def validate_run_name(run: str) -> str:
    """Return `run` if it is a valid run name, else ValueError saying what is allowed and naming `run`."""
    if not isinstance(run, str) or not RUN_NAME_RE.match(run):
        raise ValueError(f"run name must be {RUN_NAME_RULE}, got {run!r}")
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
        """Durable pull consumer of the trajectory stream, bound by the trainer's rank 0 alone."""
        return "trainer"

    @property
    def generator_consumer(self) -> str:
        """Durable pull consumer of the prompt work queue shared by all generators."""
        return "generators"

    def trajectory_key(self, group_id: str, sha256: str) -> str:
        """Object-store key of a claim-checked group (group ids never contain '/'; see trajectory.ID_RE).

        The body's digest is part of the key, so a regenerated group with the same id gets its own object
        and never overwrites the one an earlier message points to.
        """
        return f"{self.run}/trajectories/{group_id}.{sha256}.arrow"
