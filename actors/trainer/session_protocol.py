"""The trainer's session contract: the `Session` protocol the loop asks (a live run or a replay answers it, see
`actors/trainer/sessions.py`'s table), and the `RunLink` (names, NATS, object store) each session owns.

Four classes implement the protocol: `LiveSession`, the lease-holding `LeasedSession` around it
(`actors/trainer/run_lease.py`), `ReplaySession` (`actors/trainer/replay_session.py`) and the tests' fake. Kept apart
from them so that each reads against one contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from actors.servers import connect_nats, open_run_store, resolve_servers
from actors.trainer.checkpoints import RecentIds, TrainerState
from actors.trainer.generator_reports import GeneratorReports
from actors.trainer.slots import DeadLetterEntry
from pipeline.config import LeewayConfig
from pipeline.wire.consumer import Delivery
from pipeline.wire.names import RunNames
from pipeline.wire.trajectory import TrajectoryGroup
from storage.objectstore import ObjectStore


@dataclass(frozen=True)
class RunLink:
    """The run's names, NATS connection and object store; the session holding it closes it."""

    names: RunNames
    nc: NatsClient
    js: JetStreamContext
    store: ObjectStore
    roles_enforced: bool = False
    """The trainer connects as a user of its own, so the server keeps generators off what is the trainer's (its
    dead letters among them: `infra.nats_server.GENERATOR_PUBLISH_DENY`)."""

    @classmethod
    async def open(cls, cfg: LeewayConfig) -> RunLink:
        servers = resolve_servers(cfg)
        store = open_run_store(cfg, servers)
        nc = await connect_nats(cfg, servers, name="leeway-trainer", role="trainer")
        enforced = "trainer" in servers.nats_role_urls
        return cls(RunNames.for_run(cfg.run.name), nc, nc.jetstream(), store, roles_enforced=enforced)


class Session(Protocol):
    """What the trainer loop asks of a session (the two answers are in the module docstring)."""

    metrics_path: Path
    eval_path: Path | None
    """The evaluator's eval.jsonl whose results the step records carry (live only)."""
    staleness_cap: int | None
    """`staleness.max_staleness`, or None when a replay runs with the cap off."""
    generator_reports: GeneratorReports
    """The newest valid metrics report of each generator heard from recently (live only)."""

    async def start(self) -> TrainerState:
        """Fresh, resumed (a checkpoint's state) or replaying; the loop continues from the state returned."""
        ...

    def cap_version(self, group: TrajectoryGroup, trainer_version: int) -> int:
        """The version `group`'s staleness counts against (a replay first takes note of the group)."""
        ...

    def current_version(self, trainer_version: int) -> int:
        """The version a step trains at now (the objective's) and the one a metrics record names."""
        ...

    async def admit(self, state: TrainerState, pending_dropped: int = 0) -> None:
        """Admit the prompts the staleness rule allows; `pending_dropped`: dropped groups of the open batch."""
        ...

    async def new_dead_letters(self, state: TrainerState) -> list[DeadLetterEntry]:
        """Dead letters stored since `state.dead_letter_seq` (which moves past them); live only."""
        ...

    async def fetch(self, max_groups: int, timeout_s: float) -> list[Delivery]: ...

    async def refuse(self, delivery: Delivery, reason: str, detail: str) -> None:
        """A group this model can never train: live, dead-letter it; from a catch-up or a replay, nothing."""
        ...

    @property
    def exhausted(self) -> bool:
        """No group will ever come again (the end of a replayed range)."""
        ...

    async def keep_alive(self) -> None:
        """Reset the ack wait of held groups during a long wait for the rest of a batch."""
        ...

    async def publish(self, state: TrainerState) -> None:
        """Make the step's weights the next version; returns only once generators can find them."""
        ...

    async def ack(self, seqs: Sequence[int]) -> None: ...

    async def give_back(self) -> None:
        """Nak every held group for immediate redelivery (the step was abandoned)."""
        ...

    async def queue_depth(self) -> int | None: ...

    async def checkpoint(self, state: TrainerState, handled: RecentIds, *, final: bool) -> None: ...

    def forged_counts(self) -> dict[str, int]:
        """Counts of forged input refused so far, by metric name (forged dead letters; forged versions)."""
        ...

    async def close(self) -> None: ...
