"""What differs between a live trainer and a replay: where groups come from, where results go.

The loop in `actors/trainer/loop.py` is the same for both; it asks its session, never a mode flag.

```
                      LiveSession (`leeway trainer [--resume]`)      ReplaySession (`--replay SELECTION`)
  start               fresh: publish version 0                       open the recorded range
                      resume: newest checkpoint, republished as
                      newest+1, lost metrics rolled back
  groups from         catch-up `ReplayReader` (after a resume), then  the recorded range, until it ends
                      the durable `TrajectoryConsumer`; a group
                      re-read by resumes past the limit is
                      dead-lettered (`resume_reads.py`)
  cap counts against  the trainer's version V                        the newest version recorded so far
  admission           `admissible_prompts` (`pipeline/rl/staleness.py`)  none
                      + slots of dead letters of messages that
                      exist (`slots.py`)
  refused group       dead-lettered (`token_out_of_vocab`, ...)       skipped and counted
  publish             V+1 (parts, manifest, LATEST), then announced   nothing
  ack / nak           the durable consumer                           nothing (an `ack none` consumer)
  checkpoint          every `trainer.checkpoint_every` steps and at   none
                      the end of the session
  metrics             <run.dir>/metrics.jsonl                         <run.dir>/replays/<time>/metrics.jsonl
```

Each session owns its `RunLink` (NATS connection, object store) and closes it. The live session's
writes that an outage of minutes should not end the run (weight publish, checkpoint, final checkpoint,
prompt admission) are retried with backoff and jitter for their budget in `outages.*`
(`pipeline/wire/retry.py`), the step's held groups kept alive by in-progress acks between tries; all are
idempotent (a checkpoint retry reuses its attempt, so a commit of unknown outcome is adopted). The KV
announcement is tried once and only warns when it fails: generators also poll `LATEST`.
Both sessions compare the first stream sequence they mean to read with the stream's first one and
say (WARNING, `groups/lost_to_retention`) how many groups retention removed before they were read. The replay session's
version is the one the live trainer held at least when it consumed those groups, so the cap and the
correction see the staleness the live run saw, or more (`staleness.cap_in_replay=false`: no cap).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from transformers import PreTrainedModel

from actors.models import load_chat_template_for, load_tokenizer
from actors.trainer.admission import admission_count, count_lost_to_retention, group_limits
from actors.trainer.backends import TrainingBackend
from actors.trainer.checkpoints import (
    RecentIds,
    TrainerState,
    load_latest_checkpoint,
    new_attempt,
    write_checkpoint,
)
from actors.trainer.claim_gc import collect_claims
from actors.trainer.export_every import PeriodicExports
from actors.trainer.generator_reports import GeneratorReports
from actors.trainer.metrics_log import EVAL_LOG, roll_back_metrics
from actors.trainer.prompt_feed import PromptFeed
from actors.trainer.resume_reads import ResumeReads
from actors.trainer.session_protocol import RunLink
from actors.trainer.slots import DeadLetterCheck, DeadLetterEntry, read_dead_letters_quietly
from pipeline.config import LeewayConfig
from pipeline.tasks import Task
from pipeline.wire.announce import generator_metrics_subject, try_announce, version_kv
from pipeline.wire.consumer import Delivery, TrajectoryConsumer, ensure_trainer_consumer
from pipeline.wire.prompt_queue import PromptQueue, ensure_prompt_queue, queue_prompt
from pipeline.wire.prompts import Prompt
from pipeline.wire.replay import ReplayReader, ReplaySelection
from pipeline.wire.retry import PERMANENT_ERRORS, outage_backoff, retry_async
from pipeline.wire.trajectories import ensure_trajectory_streams
from pipeline.wire.trajectory import TrajectoryGroup
from storage.manifest import config_hash
from storage.objectstore import ObjectStore
from storage.weights import TORCH_DTYPES, WeightPublisher, WeightStoreError, list_versions

if TYPE_CHECKING:
    from actors.trainer.rank_group import RankGroup

log = logging.getLogger(__name__)

QUEUE_INFO_TIMEOUT_S = 2.0
"""Bound on the consumer-info request behind the `queue/trajectories` metric."""
STREAM_INFO_TIMEOUT_S = 5.0
"""Bound on the stream-info request behind the retention check at (re)start."""
PUBLISH_PERMANENT_ERRORS = (*PERMANENT_ERRORS, WeightStoreError)
"""A weight publish failing with these (a version conflict, a bad tensor) is not retried."""


# ---- live -------------------------------------------------------------------------------------------------


class LiveSession:
    """`leeway trainer [--resume]`: the durable consumer, admission, published versions, checkpoints.

    Acks go through `ack` only, which the loop calls after `publish` returned; `publish` returns once
    the version's manifest and LATEST are in the store and the KV announcement is written.
    """

    def __init__(
        self,
        cfg: LeewayConfig,
        link: RunLink,
        backend: TrainingBackend,
        publisher: WeightPublisher,
        task: Task,
        consumer: TrajectoryConsumer,
        prompt_queue: PromptQueue,
        kv: KeyValue | None,
        *,
        resume: bool,
        ranks: RankGroup | None = None,
    ) -> None:
        self.cfg = cfg
        self.ranks = ranks
        """Several trainer ranks: publish, checkpoint and resume are rounds of the whole group."""
        self.link = link
        self.names = link.names
        self.backend = backend
        self.publisher = publisher
        self.task = task
        self.consumer = consumer
        self.prompt_queue = prompt_queue
        self.kv = kv
        self.resume = resume
        self.metrics_path = cfg.run.run_dir / "metrics.jsonl"
        self.eval_path: Path | None = cfg.run.run_dir / EVAL_LOG
        self.staleness_cap: int | None = cfg.staleness.max_staleness
        self.generator_reports = GeneratorReports()
        self.prompt_feed: PromptFeed | None = None
        """Built by `start`, at the count of prompts admitted so far."""
        self.catch_up: ReplayReader | None = None
        """After a resume: the groups acked after the checkpoint, read again before the durable consumer."""
        self.resume_reads: ResumeReads | None = None
        """After a resume: how often resumes re-read each group past the watermark (`resume_reads.py`)."""
        self.resume_read_limit = consumer.max_deliver
        """Re-reads of one group on resume before it is dead-lettered (`max_deliveries`): the consumer's limit."""
        self.poisoned: set[str] = set()
        """Ids of groups this session dead-lettered from the catch-up: a durable redelivery of one is acked."""
        self.last_checkpoint_step = 0
        self.dead_letter_check = DeadLetterCheck(
            link.js,
            link.names,
            terminated=consumer.dead_letters.terminated,
            trajectory_letters_trusted=link.roles_enforced,
        )
        """Only dead letters of messages that exist return slots; `dead_letter_check.forged` counts the rest."""
        self.exports = PeriodicExports(cfg)
        """`trainer.export_every`: due versions exported in the background after they are published."""
        self.holder: dict[str, Any] | None = None
        """The run lease's holder token, written into every checkpoint manifest (`actors/trainer/run_lease.py`)."""

    @classmethod
    async def open(
        cls,
        cfg: LeewayConfig,
        link: RunLink,
        backend: TrainingBackend,
        publisher: WeightPublisher,
        task: Task,
        *,
        resume: bool,
        ranks: RankGroup | None = None,
    ) -> LiveSession:
        """Make sure the streams, the trainer's consumer and the prompt queue exist, bind them, listen to generators."""
        js, names = link.js, link.names
        await ensure_trajectory_streams(js, names, cfg.stream)
        await ensure_trainer_consumer(js, names)
        await ensure_prompt_queue(js, names, cfg.stream)
        limits = group_limits(cfg, backend.model_limits().max_positions)
        consumer = await TrajectoryConsumer.bind(js, names, cfg.stream, link.store, limits=limits)
        kv = await version_kv(js, names) if cfg.weights.announce else None
        queue = PromptQueue(js, names, cfg.stream)
        session = cls(cfg, link, backend, publisher, task, consumer, queue, kv, resume=resume, ranks=ranks)
        await link.nc.subscribe(generator_metrics_subject(names), cb=session._on_generator_report)
        return session

    # ---- start: fresh or resumed

    async def start(self) -> TrainerState:
        return await (self._resume() if self.resume else self._start_fresh())

    async def _start_fresh(self) -> TrainerState:
        latest = await self._newest_published()
        if latest is not None:
            raise RuntimeError(
                f"run {self.names.run!r} already has published weights (version {latest}); continue it with "
                f"`leeway trainer CONFIG --resume`, or start a new run with --set run.name=<new name>"
            )
        self.prompt_feed = self._prompt_feed(start=0)
        await self._publish(0)
        log.info("trainer ready: fresh run %s, version 0 published", self.names.run)
        return TrainerState()

    async def _resume(self) -> TrainerState:
        """Restore the newest checkpoint, republish it as newest+1, roll back lost metrics, catch up."""
        loaded = await asyncio.to_thread(self._load_latest_checkpoint)
        latest = await self._newest_published()
        if loaded is None and latest is None:
            log.warning("--resume: run %s has neither checkpoint nor weights; starting fresh", self.names.run)
            return await self._start_fresh()
        state = TrainerState()
        if loaded is None:
            log.warning(
                "--resume: run %s has no complete checkpoint; restarting from the initial weights", self.names.run
            )
        else:
            state = loaded
        self.prompt_feed = self._prompt_feed(start=state.admitted)  # a bad prompts file is refused before publishing
        restored = state.version
        state.version = max(latest if latest is not None else -1, restored) + 1
        await self._publish(state.version)
        log.info(
            "trainer ready: resumed step %d (checkpointed version %d), republished as version %d",
            state.step,
            restored,
            state.version,
        )
        self.last_checkpoint_step = state.step
        moved = roll_back_metrics(self.metrics_path, state.step)
        if moved:
            log.info("moved %d metrics records of steps after %d to metrics.rolled_back.jsonl", moved, state.step)
        await self._catch_up_from(state.consumed_seq + 1, state)
        return state

    def _prompt_feed(self, start: int) -> PromptFeed:
        """The run's prompts from admission `start` on; the rows of `task.prompts_file` are checked against the
        queue's message size and the model's context first (`check_prompt_rows`), before anything is published."""
        limits = self.backend.model_limits()
        tokenizer = template = None
        if self.cfg.task.prompts_file is not None:
            tokenizer = load_tokenizer(self.cfg, self.task)
            template = load_chat_template_for(self.cfg, tokenizer, self.task)
        return PromptFeed(
            self.cfg, self.task, start, tokenizer=tokenizer, max_context_tokens=limits.max_positions, template=template
        )

    def _load_latest_checkpoint(self) -> TrainerState | None:
        """Restore the newest complete checkpoint into the backend (every rank's) and return its state."""
        if self.ranks is not None:
            return self.ranks.load_latest()
        loaded = load_latest_checkpoint(self.link.store, self.names.run)
        if loaded is None:
            return None
        state, tensors, meta = loaded
        self.backend.load_state(tensors, meta)
        return state

    async def _newest_published(self) -> int | None:
        """The newest version with a manifest; can be past LATEST when a trainer died between the two."""
        latest = await asyncio.to_thread(self.publisher.latest_version)
        listed = await asyncio.to_thread(list_versions, self.link.store, self.names.run)
        newest = max([-1 if latest is None else latest, *listed])
        return None if newest < 0 else newest

    async def _catch_up_from(self, seq: int, state: TrainerState) -> None:
        """Read `seq`..the stream's current end again (acked after the checkpoint, training lost) first.

        Groups retention removed before `seq` could be read are counted in `state.lost_to_retention`, which
        returns their admission slots (`admit`): they will never arrive. The watermark then moves past them,
        so a later resume from the same checkpointed state does not count (and free) them again."""
        info = await asyncio.wait_for(self.link.js.stream_info(self.names.trajectory_stream), STREAM_INFO_TIMEOUT_S)
        lost = count_lost_to_retention(seq, info.state.first_seq, info.state.last_seq, "resume")
        if lost:
            state.lost_to_retention += lost
            state.consumed_seq = seq + lost - 1
            seq = state.consumed_seq + 1
        if info.state.last_seq < seq:
            return
        seq = max(seq, info.state.first_seq)
        self.resume_reads = await asyncio.to_thread(
            ResumeReads.load, self.link.store, self.names.run, after_seq=state.consumed_seq
        )
        selection = ReplaySelection(from_seq=seq, until_seq=info.state.last_seq)
        self.catch_up = await ReplayReader.open(self.link.js, self.names, self.cfg.stream, self.link.store, selection)
        self.catch_up.limits = self.consumer.limits  # a group too large is skipped before it inflates
        log.info("catching up: re-reading trajectory stream seqs %d..%d", seq, info.state.last_seq)

    # ---- versions and admission

    def cap_version(self, group: TrajectoryGroup, trainer_version: int) -> int:
        return trainer_version

    def current_version(self, trainer_version: int) -> int:
        return trainer_version

    async def admit(self, state: TrainerState, pending_dropped: int = 0) -> None:
        """Publish as many prompts as `admissible_prompts` allows, tagged with the current version.

        Dropped, refused, dead-lettered and lost-to-retention groups are no longer outstanding: their slots
        are free (`TrainerState`)."""
        assert self.prompt_feed is not None, "admit before start"
        count = admission_count(self.cfg, state, pending_dropped)
        if count <= 0:
            return
        prompts = [queue_prompt(p, state.version) for p in self.prompt_feed.take(count)]
        await retry_async(
            lambda: self._admit_all(prompts),
            what=f"admitting {len(prompts)} prompts",
            backoff=outage_backoff(self.cfg.outages.fetch_s),
            heartbeat=self.keep_alive,
        )
        state.admitted += len(prompts)  # re-admitted duplicates (after a resume) count: they are outstanding

    async def _admit_all(self, prompts: Sequence[Prompt]) -> None:
        await self.prompt_queue.admit_many(prompts)  # a retry re-sends all: the queue dedupes by prompt id

    async def new_dead_letters(self, state: TrainerState) -> list[DeadLetterEntry]:
        entries, watermark = await read_dead_letters_quietly(self.link.js, self.names, after_seq=state.dead_letter_seq)
        genuine, state.dead_letter_seq = await self.dead_letter_check.genuine(entries, watermark)
        return genuine

    # ---- groups in

    async def fetch(self, max_groups: int, timeout_s: float) -> list[Delivery]:
        """The catch-up range first (after a resume), then the durable consumer."""
        if self.catch_up is None:
            deliveries = await self.consumer.fetch(max_groups=max_groups, timeout_s=timeout_s)
            if not self.poisoned:
                return deliveries
            gone = [d.seq for d in deliveries if d.group.group_id in self.poisoned]
            if gone:  # dead-lettered from the catch-up already: this copy is done with
                await self.consumer.ack(gone)
            return [d for d in deliveries if d.group.group_id not in self.poisoned]
        deliveries = await self.catch_up.fetch(max_groups=max_groups, timeout_s=timeout_s)
        if deliveries:
            assert self.resume_reads is not None, "catch-up without resume reads"
            read = {d.group.group_id: d.seq for d in deliveries}
            deliveries, poisoned = await self.resume_reads.screen(
                deliveries,
                self.link.js,
                self.names,
                limit=self.resume_read_limit,
                max_body=self.cfg.stream.max_msg_bytes,
            )
            self.poisoned.update(poisoned)
            for group_id in poisoned:  # this process wrote those dead letters: decided, their slots come back
                self.consumer.dead_letters.terminated[read[group_id]] = None
        if self.catch_up.done:
            log.info("caught up with the groups whose training was lost; continuing with live data")
            await self.catch_up.close()
            self.catch_up = None
        return deliveries

    async def refuse(self, delivery: Delivery, reason: str, detail: str) -> None:
        if delivery.msg is not None:  # catch-up deliveries were acked or dead-lettered before the resume
            await self.consumer.dead_letter(delivery.seq, reason, detail)

    @property
    def exhausted(self) -> bool:
        return False

    async def keep_alive(self) -> None:
        await self.consumer.in_progress()  # a slow batch must not outlive the consumer's ack wait

    # ---- results out

    async def publish(self, state: TrainerState) -> None:
        state.version += 1
        await self._publish(state.version)

    async def _publish(self, version: int) -> None:
        """Publish `version` (retried for `outages.publish_s`, the step's groups kept alive meanwhile: a failed
        publish leaves the publisher at the previous version), then announce it (one bounded try that only
        warns if it fails: `try_announce`)."""
        ranks = self.ranks
        if ranks is not None:  # every rank stores its parts; rank 0 commits
            publish = lambda: asyncio.to_thread(ranks.publish, version)  # noqa: E731
        else:
            tensors = self.backend.export_weights(TORCH_DTYPES[self.cfg.model.dtype])
            publish = lambda: asyncio.to_thread(self.publisher.publish, version, tensors)  # noqa: E731
        manifest = await retry_async(
            publish,
            what=f"publishing weights version {version}",
            permanent=PUBLISH_PERMANENT_ERRORS,
            backoff=outage_backoff(self.cfg.outages.publish_s),
            heartbeat=self.keep_alive,
        )
        if self.kv is not None:  # a doorbell only: a failure warns (generators poll LATEST too), never ends the run
            await try_announce(self.kv, version)
        self.exports.published(version)
        log.debug("published version %d (%s, parent %s)", version, manifest.kind, manifest.parent_version)

    async def ack(self, seqs: Sequence[int]) -> None:
        await self.consumer.ack(seqs)

    async def give_back(self) -> None:
        await self.consumer.nak(self.consumer.held_seqs)

    async def queue_depth(self) -> int | None:
        """Groups waiting in the stream for this trainer (for the live view); None if unknown right now."""
        try:
            info = await asyncio.wait_for(
                self.link.js.consumer_info(self.names.trajectory_stream, self.names.trainer_consumer),
                QUEUE_INFO_TIMEOUT_S,
            )
        except (asyncio.TimeoutError, nats.errors.Error):
            return None
        return int(info.num_pending)

    async def checkpoint(self, state: TrainerState, handled: RecentIds, *, final: bool) -> None:
        """Every `trainer.checkpoint_every` steps (and at the end of a session) write a checkpoint."""
        if state.step == self.last_checkpoint_step:
            return
        if not final and state.step % self.cfg.trainer.checkpoint_every:
            return
        state.handled_group_ids = handled.to_list()
        if self.cfg.stream.claim_gc != "never":
            state.claim_objects = [*state.claim_objects, *self.consumer.take_acked_claims()]
        budget = self.cfg.outages.final_checkpoint_s if final else self.cfg.outages.checkpoint_s
        ranks = self.ranks
        if ranks is not None:
            write = lambda: asyncio.to_thread(ranks.checkpoint, state)  # noqa: E731
        else:
            tensors, meta = self.backend.state_tensors(), self.backend.state_meta()
            attempt = new_attempt()  # one attempt for every retry: a commit of unknown outcome is adopted
            write = lambda: asyncio.to_thread(  # noqa: E731
                write_checkpoint,
                self.link.store,
                self.names.run,
                state,
                tensors,
                meta,
                attempt=attempt,
                holder=self.holder,
            )
        await retry_async(
            write,
            what=f"writing the {'final ' if final else ''}checkpoint of step {state.step}",
            backoff=outage_backoff(budget),
            heartbeat=self.keep_alive,
        )
        self.last_checkpoint_step = state.step
        log.info(
            "checkpoint written at step %d (version %d, stream seq %d)", state.step, state.version, state.consumed_seq
        )
        state.claim_objects = await collect_claims(
            self.link.js,
            self.link.store,
            self.names,
            state.claim_objects,
            policy=self.cfg.stream.claim_gc,
            up_to_seq=state.consumed_seq,
        )

    def forged_counts(self) -> dict[str, int]:
        return {"dead_letters/forged_total": self.dead_letter_check.forged}

    async def _on_generator_report(self, msg: Msg) -> None:
        self.generator_reports.receive(msg.data, msg.subject)  # validates; a bad report is logged and ignored

    async def close(self) -> None:
        if self.catch_up is not None:
            await self.catch_up.close()
        await self.consumer.close()
        await self.link.nc.drain()
        await asyncio.to_thread(self.publisher.close)
        await asyncio.to_thread(self.exports.close)


def build_weight_publisher(cfg: LeewayConfig, store: ObjectStore, model: PreTrainedModel) -> WeightPublisher:
    """The run's `WeightPublisher`, from ``weights.*`` and ``model.dtype``."""
    w = cfg.weights
    return WeightPublisher(
        store,
        cfg.run.name,
        model_config_hash=config_hash(model.config.to_dict()),
        dtype=TORCH_DTYPES[cfg.model.dtype],
        full_every=w.full_every,
        keep_versions=w.keep_versions,
        grace_s=w.grace_s,
        part_bytes=w.part_bytes,
        parallelism=w.parallelism,
    )
