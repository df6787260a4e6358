"""`leeway trainer --replay SELECTION`: the session that trains on a recorded range of the trajectory stream.

It publishes, acks and checkpoints nothing (see the table in `actors/trainer/sessions.py`). Its version is
the newest policy version recorded in the groups replayed so far, so the cap and the correction see the
staleness the live run saw, or more. Anyone with the run's NATS token can publish on the trajectory
subject, so a recorded version is believed only up to the newest version the run's store holds: a group
claiming a version beyond it (a forged `max_version`) would otherwise raise the replay's version past
every genuine group and drop them all over the cap. Such a group is counted (`forged_versions`), logged,
and dropped as invalid; the replay's version does not move.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from actors.trainer.admission import count_lost_to_retention, group_limits
from actors.trainer.checkpoints import RecentIds, TrainerState
from actors.trainer.generator_reports import GeneratorReports
from actors.trainer.metrics_log import replay_metrics_path
from actors.trainer.session_protocol import RunLink
from actors.trainer.sessions import STREAM_INFO_TIMEOUT_S
from actors.trainer.slots import DeadLetterEntry
from pipeline.config import LeewayConfig
from pipeline.wire.consumer import Delivery
from pipeline.wire.replay import ReplayReader, ReplaySelection
from pipeline.wire.trajectory import TrajectoryGroup
from storage.weights import list_versions

log = logging.getLogger(__name__)


class ReplaySession:
    """`leeway trainer --replay SELECTION`: trains on a recorded range; publishes, acks and checkpoints nothing."""

    def __init__(self, cfg: LeewayConfig, link: RunLink, reader: ReplayReader) -> None:
        self.cfg = cfg
        self.link = link
        self.reader = reader
        self.metrics_path = replay_metrics_path(cfg)
        self.eval_path: Path | None = None
        self.staleness_cap: int | None = cfg.staleness.max_staleness if cfg.staleness.cap_in_replay else None
        self.generator_reports = GeneratorReports()
        self.newest_version = 0
        """The newest policy version recorded in the groups replayed so far (never past `published_max`)."""
        self.published_max: int | None = None
        """The newest version the run's store holds (read at start); None if it holds none (nothing to check by)."""
        self.forged_versions = 0
        """Groups that claimed a version the store never had: dropped, the replay's version unmoved."""

    @classmethod
    async def open(
        cls, cfg: LeewayConfig, link: RunLink, selection: ReplaySelection, *, max_positions: int | None = None
    ) -> ReplaySession:
        reader = await ReplayReader.open(link.js, link.names, cfg.stream, link.store, selection)
        reader.limits = group_limits(cfg, max_positions)  # the live door's caps: a recorded giant is refused too
        return cls(cfg, link, reader)

    async def start(self) -> TrainerState:
        log.info("replaying %s into training; metrics in %s", self.reader.selection, self.metrics_path)
        versions = await asyncio.to_thread(list_versions, self.link.store, self.link.names.run)
        self.published_max = versions[-1] if versions else None
        if self.published_max is None:
            log.warning(
                "replay: the store holds no weights of run %s, so recorded versions cannot be checked against it",
                self.link.names.run,
            )
        state = TrainerState()
        from_seq = self.reader.selection.from_seq
        if from_seq is not None:
            info = await asyncio.wait_for(
                self.link.js.stream_info(self.link.names.trajectory_stream), STREAM_INFO_TIMEOUT_S
            )
            state.lost_to_retention = count_lost_to_retention(
                from_seq, info.state.first_seq, info.state.last_seq, "replay"
            )
        return state

    def cap_version(self, group: TrajectoryGroup, trainer_version: int) -> int:
        claimed = group.group_max_version
        if self.published_max is not None and claimed > self.published_max:
            self.forged_versions += 1
            log.warning(
                "replay: group %s claims version %d, past the newest the store holds (%d); dropped as invalid",
                group.group_id,
                claimed,
                self.published_max,
            )
            return self.newest_version  # below the claim: `prepare_group` drops the group as invalid
        self.newest_version = max(self.newest_version, claimed)
        return self.newest_version

    def current_version(self, trainer_version: int) -> int:
        return self.newest_version

    async def admit(self, state: TrainerState, pending_dropped: int = 0) -> None:
        return None

    async def new_dead_letters(self, state: TrainerState) -> list[DeadLetterEntry]:
        return []

    async def fetch(self, max_groups: int, timeout_s: float) -> list[Delivery]:
        return await self.reader.fetch(max_groups=max_groups, timeout_s=timeout_s)

    async def refuse(self, delivery: Delivery, reason: str, detail: str) -> None:
        return None  # a replay dead-letters nothing: the loop skips and counts the group

    @property
    def exhausted(self) -> bool:
        return self.reader.done

    async def keep_alive(self) -> None:
        return None

    async def publish(self, state: TrainerState) -> None:
        return None

    async def ack(self, seqs: Sequence[int]) -> None:
        return None

    async def give_back(self) -> None:
        return None

    async def queue_depth(self) -> int | None:
        return None

    async def checkpoint(self, state: TrainerState, handled: RecentIds, *, final: bool) -> None:
        return None

    def forged_counts(self) -> dict[str, int]:
        return {"groups/forged_versions_total": self.forged_versions}

    async def close(self) -> None:
        await self.reader.close()
        await self.link.nc.drain()
