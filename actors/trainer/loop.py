"""The trainer: consumes trajectory groups, bounds staleness, corrects, steps, publishes version V+1.

```
   prompts (work queue) ◄── admit_prompts ── pipeline.staleness.admissible_prompts: (S+K+1)·B in all
                              (id "<task id>.<i>", metadata policy_version = V)    ▲ S = steps taken
   trajectories ──► collect_batch ── dedupe by group id ── cap at V (drop | mask) ── validity ── GRPO/RLOO
   (durable consumer;   │                                  └─ untrainable: dropped with a reason, counted
    after --resume a    ▼
    catch-up range     train_on_batch ── backend.train_step(loss_fn = corrected objective at V)
    first; --replay:    ▼
    a recorded range)  publish_version ── WeightPublisher: parts, manifest, LATEST ── KV announcement
                        ▼
                       commit ── ack the groups used (only now) ── write_metrics ── maybe_checkpoint
```

The loop waits on one thing only: trajectory groups (`collect_batch`), which generators produce
from admitted prompts; while it waits it re-checks admission, so a dropped group's slot is refilled
at once. `trainer.queue_wait_timeout_s` without a trainable group ends the run with an error.

Invariants and failure behaviour:
- Groups are acked only after the version trained on them is published and announced, so a
  trainer killed mid-step gets them again. Delivery is at-least-once; the record of handled group
  ids (`RecentIds`, persisted in checkpoints) makes each group trained or dropped once.
- `--resume` (1) loads the newest complete checkpoint (none: the initial weights at step 0);
  (2) publishes its weights as a new full version after the newest published one (LATEST, or a
  manifest past it when a trainer died between writing the two), so versions never go backward;
  the manifest's `parent_version` is the version published before it; (3) moves the metrics of
  the lost steps to `metrics.rolled_back.jsonl`; (4) re-reads the stream from the checkpoint's
  watermark (`consumed_seq + 1`) to its current end before returning to the durable consumer.
  The groups whose training was lost (acked after the checkpoint) are thus trained again, once.
  Their staleness is counted against the new version as usual (a resume makes them one version
  staler; the importance ratio is unaffected, it uses the recorded behaviour log-probs).
- Replay (`--replay`) trains on a recorded range, publishes nothing, acks nothing, writes no
  checkpoint; its metrics go to `<run.dir>/replays/<time>/metrics.jsonl`. Staleness is counted
  against the newest policy version recorded in the groups replayed so far (the version the live
  trainer held at least); `staleness.cap_in_replay=false` switches the cap off.
- SIGINT/SIGTERM while waiting for groups abandons the step (its groups are nak'ed for immediate
  redelivery); during compute or publishing the step is finished first. Either way a final
  checkpoint is written, so a later `--resume` loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import orjson

from actors.models import build_policy_model, load_tokenizer
from actors.trainer.checkpoints import RecentIds, TrainerState, load_latest_checkpoint, write_checkpoint
from actors.trainer.metrics_log import MetricsLog, replay_metrics_path, roll_back_metrics
from actors.trainer.prompt_feed import PromptFeed
from pipeline.batching import GroupPolicy, PreparedGroup, prepare_group
from pipeline.config import LeewayConfig
from pipeline.names import RunNames
from pipeline.prompt_queue import queue_prompt
from pipeline.staleness import admissible_prompts
from pipeline.step_metrics import merge_loss_stats, reward_metrics, sample_counts, staleness_metrics, timing_split
from pipeline.transport import ReplaySelection

log = logging.getLogger("leeway.trainer")

FETCH_TIMEOUT_S = 0.25
"""One wait for groups; admission and the stop flag are re-checked between waits."""
WAIT_LOG_EVERY_S = 30.0
"""While no trainable group arrives, say so this often (and reset the held groups' ack wait)."""
QUEUE_INFO_TIMEOUT_S = 2.0
"""Bound on the consumer-info request behind the `queue/trajectories` metric."""
DROP_INVALID = "invalid"
"""Drop reason of a group the batching logic refused (logged with the reason)."""


@dataclass
class Batch:
    """The groups of one step: trainable ones, and every group consumed while filling it."""

    trainable: list[PreparedGroup] = field(default_factory=list)
    consumed: list[PreparedGroup] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    """Stream sequences of every delivery, duplicates included (all are acked at commit)."""
    received_at_s: dict[str, float] = field(default_factory=dict)
    duplicates: int = 0
    wait_s: float = 0.0

    @property
    def num_dropped(self) -> int:
        return len(self.consumed) - len(self.trainable)


class StopRequested(Exception):
    """SIGINT/SIGTERM arrived while waiting for groups: the step is abandoned."""


class QueueWaitTimeout(RuntimeError):
    """No trainable group arrived for `trainer.queue_wait_timeout_s`."""


class Trainer:
    """One trainer process. `run()` is the loop drawn in the module docstring."""

    def __init__(self, cfg: LeewayConfig, *, resume: bool = False, replay: Any = None) -> None:
        self.cfg = cfg
        self.names = RunNames.for_run(cfg.run.name)
        self.resume = resume
        self.replay = replay
        """A `transport.ReplaySelection` in replay mode, else None."""
        self.state = TrainerState()
        self.handled = RecentIds()
        self.stop = asyncio.Event()
        self.generator_reports: dict[str, dict[str, Any]] = {}
        self.replay_version = 0
        self.last_checkpoint_step = 0
        self.started_at = time.time()
        self.consumer: Any = None
        """The durable `TrajectoryConsumer` (None in replay); the only source that acks."""
        self.source: Any = None
        """Where groups are read now: the consumer, a catch-up `ReplayReader`, or the replay."""
        self.kv: Any = None
        self.nc: Any = None
        self.metrics: MetricsLog | None = None
        self.publisher: Any = None
        self.queue_depth: int | None = None
        self._last_wait_report = time.monotonic()

    # ---------------------------------------------------------------------------------------- set-up

    async def setup(self) -> None:
        """Connect, build model/backend/publisher, then start fresh, resume, or open the replay range."""
        from actors.endpoints import connect_nats, open_run_store, resolve_endpoints
        from actors.trainer.backends import build_backend
        from pipeline import transport
        from pipeline.tasks import get_task

        cfg = self.cfg
        endpoints = resolve_endpoints(cfg)
        self.store = open_run_store(cfg, endpoints)
        self.nc = await connect_nats(cfg, endpoints, name="leeway-trainer")
        self.js = self.nc.jetstream()
        self.task = get_task(cfg.task.name, **cfg.task.args)
        model = build_policy_model(cfg, load_tokenizer(cfg, self.task))
        self.backend = build_backend(cfg, model)
        if self.replay is not None:
            self.source = await transport.ReplayReader.open(self.js, self.names, cfg.stream, self.store, self.replay)
            self.metrics = MetricsLog(cfg, replay_metrics_path(cfg))
            log.info("replaying %s into training; metrics in %s", self.replay, self.metrics.path)
            return
        self.publisher = build_weight_publisher(cfg, self.store, model)
        await self._open_live_transport()
        await (self._resume() if self.resume else self._start_fresh())
        self.metrics = MetricsLog(cfg, cfg.run.run_dir / "metrics.jsonl")

    async def _open_live_transport(self) -> None:
        from pipeline import transport
        from pipeline.announce import generator_metrics_subject, version_kv
        from pipeline.prompt_queue import PromptQueue, ensure_prompt_queue

        cfg = self.cfg
        await transport.ensure_trajectory_streams(self.js, self.names, cfg.stream)
        await transport.ensure_trainer_consumer(self.js, self.names)
        await ensure_prompt_queue(self.js, self.names, cfg.stream)
        self.prompt_queue = PromptQueue(self.js, self.names, cfg.stream)
        self.consumer = await transport.TrajectoryConsumer.bind(self.js, self.names, cfg.stream, self.store)
        self.source = self.consumer
        self.kv = await version_kv(self.js, self.names) if cfg.weights.announce else None
        await self.nc.subscribe(generator_metrics_subject(self.names), cb=self._on_generator_report)

    async def _newest_published(self) -> int | None:
        """The newest version with a manifest; can be past LATEST when a trainer died between the two."""
        from storage.weights import list_versions

        latest = await asyncio.to_thread(self.publisher.latest_version)
        listed = await asyncio.to_thread(list_versions, self.store, self.names.run)
        newest = max([-1 if latest is None else latest, *listed])
        return None if newest < 0 else newest

    async def _start_fresh(self) -> None:
        latest = await self._newest_published()
        if latest is not None:
            raise RuntimeError(
                f"run {self.names.run!r} already has published weights (version {latest}); continue it with "
                f"`leeway trainer CONFIG --resume`, or start a new run with --set run.name=<new name>"
            )
        self.prompt_feed = PromptFeed(self.cfg, self.task, start=0)
        await self._publish(0)
        log.info("trainer ready: fresh run %s, version 0 published", self.names.run)

    async def _resume(self) -> None:
        """Restore the newest checkpoint, republish it as newest+1, roll back lost metrics, catch up."""
        loaded = await asyncio.to_thread(load_latest_checkpoint, self.store, self.names.run)
        latest = await self._newest_published()
        if loaded is None and latest is None:
            log.warning("--resume: run %s has neither checkpoint nor weights; starting fresh", self.names.run)
            return await self._start_fresh()
        if loaded is None:
            log.warning(
                "--resume: run %s has no complete checkpoint; restarting from the initial weights", self.names.run
            )
        else:
            self.state, tensors, meta = loaded
            self.backend.load_state(tensors, meta)
        restored = self.state.version
        self.state.version = max(latest if latest is not None else -1, restored) + 1
        await self._publish(self.state.version)
        log.info(
            "trainer ready: resumed step %d (checkpointed version %d), republished as version %d",
            self.state.step,
            restored,
            self.state.version,
        )
        self.handled = RecentIds(self.state.handled_group_ids)
        self.last_checkpoint_step = self.state.step
        self.prompt_feed = PromptFeed(self.cfg, self.task, start=self.state.admitted)
        moved = roll_back_metrics(self.cfg.run.run_dir / "metrics.jsonl", self.state.step)
        if moved:
            log.info("moved %d metrics records of steps after %d to metrics.rolled_back.jsonl", moved, self.state.step)
        await self._catch_up_from(self.state.consumed_seq + 1)

    async def _catch_up_from(self, seq: int) -> None:
        """Read `seq`..the stream's current end again (acked after the checkpoint, training lost) first."""
        from pipeline import transport

        info = await self.js.stream_info(self.names.trajectory_stream)
        if info.state.last_seq < seq:
            return
        selection = transport.ReplaySelection(from_seq=seq, until_seq=info.state.last_seq)
        self.source = await transport.ReplayReader.open(self.js, self.names, self.cfg.stream, self.store, selection)
        log.info("catching up: re-reading trajectory stream seqs %d..%d", seq, info.state.last_seq)

    # ------------------------------------------------------------------------------------------ loop

    async def run(self) -> int:
        try:
            await self.setup()
            try:
                while self.state.step < self.cfg.trainer.max_steps and not self.stop.is_set():
                    await self.admit_prompts()
                    batch = await self.collect_batch()
                    if batch is None:
                        break
                    result, compute_s = await self.train_on_batch(batch)
                    publish_s = await self.publish_version()
                    await self.commit(batch)
                    self.write_metrics(batch, result, compute_s, publish_s)
                    await self.maybe_checkpoint()
            except StopRequested:
                log.info("stop requested: abandoning the current step; its groups are given back")
                if self.consumer is not None:
                    await self.consumer.nak(self.consumer.held_seqs)
            await self.maybe_checkpoint(final=True)
        finally:
            await self.close()
        return 0

    async def admit_prompts(self, pending: Batch | None = None) -> None:
        """Publish as many prompts as the staleness-aware limit allows, tagged with the current version."""
        if self.replay is not None:
            return
        s = self.state
        dropped = s.discarded_groups + (pending.num_dropped if pending else 0)
        count = admissible_prompts(
            version=s.step,
            max_staleness=self.cfg.staleness.max_staleness,
            batch_groups=self.cfg.trainer.batch_groups,
            outstanding=max(0, s.admitted - s.trained_groups - dropped),
            trained=s.trained_groups,
        )
        if count <= 0:
            return
        prompts = self.prompt_feed.take(count)
        await self.prompt_queue.admit_many(queue_prompt(p, s.version) for p in prompts)
        s.admitted += len(prompts)  # re-admitted duplicates (after a resume) count: they are outstanding

    async def collect_batch(self) -> Batch | None:
        """Fill a batch of `trainer.batch_groups` trainable groups; None when a replay has run out."""
        batch, need = Batch(), self.cfg.trainer.batch_groups
        started = last_progress = time.monotonic()
        while len(batch.trainable) < need:
            if self.stop.is_set():
                raise StopRequested
            deliveries = await self.source.fetch(max_groups=need - len(batch.trainable), timeout_s=FETCH_TIMEOUT_S)
            trainable_before = len(batch.trainable)
            for delivery in deliveries:
                self._take(delivery, batch)
            now = time.monotonic()
            if len(batch.trainable) > trainable_before:
                last_progress = now
            if deliveries:
                continue
            if self._source_exhausted():
                if self.replay is not None:
                    return batch if batch.trainable else None
                continue
            await self._while_waiting(batch, idle_s=now - last_progress)
        batch.wait_s = time.monotonic() - started
        return batch

    async def _while_waiting(self, batch: Batch, idle_s: float) -> None:
        """No group arrived: refill admission, keep held groups from redelivery, say why we wait, give up late."""
        await self.admit_prompts(pending=batch)
        now = time.monotonic()
        if now - self._last_wait_report > WAIT_LOG_EVERY_S:
            self._last_wait_report = now
            if self.consumer is not None:
                await self.consumer.in_progress()  # a slow batch must not outlive the consumer's ack wait
            log.info(
                "waiting for trajectory groups: %d/%d trainable, %d dropped so far",
                len(batch.trainable),
                self.cfg.trainer.batch_groups,
                batch.num_dropped,
            )
        if idle_s > self.cfg.trainer.queue_wait_timeout_s:
            raise QueueWaitTimeout(
                f"no trainable group for {self.cfg.trainer.queue_wait_timeout_s:.0f} s "
                f"(trainer.queue_wait_timeout_s); are generators running for run {self.names.run!r}?"
            )

    def _take(self, delivery: Any, batch: Batch) -> None:
        """Dedupe, then cap / validity / advantages for one delivered group."""
        group = delivery.group
        batch.seqs.append(delivery.seq)
        if group.group_id in self.handled or group.group_id in batch.received_at_s:
            batch.duplicates += 1  # at-least-once delivery: handled already; acked with this batch
            return
        batch.received_at_s[group.group_id] = time.time()
        try:
            prepared = prepare_group(group, version=self._cap_version(group), policy=self._group_policy())
        except ValueError as exc:  # e.g. versions newer than any this trainer published: never trainable
            log.warning("dropping group %s (stream seq %d): %s", group.group_id, delivery.seq, exc)
            prepared = PreparedGroup(group, trainable=False, drop_reason=DROP_INVALID)
        batch.consumed.append(prepared)
        if prepared.trainable:
            batch.trainable.append(prepared)

    def _cap_version(self, group: Any) -> int:
        """The version staleness is counted against: the trainer's own, or in replay the newest seen so far."""
        if self.replay is None:
            return self.state.version
        self.replay_version = max(self.replay_version, group.group_max_version)
        return self.replay_version

    def _current_version(self) -> int:
        return self.replay_version if self.replay is not None else self.state.version

    def _group_policy(self) -> GroupPolicy:
        cfg = self.cfg
        cap: int | None = cfg.staleness.max_staleness
        if self.replay is not None and not cfg.staleness.cap_in_replay:
            cap = None
        return GroupPolicy(
            max_staleness=cap,
            cap_policy=cfg.staleness.policy,
            estimator=cfg.advantages.estimator,
            std_normalize=cfg.advantages.std_normalize,
        )

    def _source_exhausted(self) -> bool:
        """True when a replay range is done; a finished catch-up hands over to the durable consumer."""
        if self.source is self.consumer or not self.source.done:
            return False
        if self.replay is not None:
            return True
        log.info("caught up with the groups whose training was lost; continuing with live data")
        self.source = self.consumer
        return False

    async def train_on_batch(self, batch: Batch) -> tuple[Any, float]:
        """Recompute log-probs and take one optimizer step (several minibatches under decoupled_ppo)."""
        from actors.trainer.backends import TrainBatch, TrainSequence
        from actors.trainer.objective import CorrectedObjective

        cfg = self.cfg
        sequences = [
            TrainSequence(
                tokens=s.tokens,
                loss_mask=s.loss_mask,
                behaviour_logprobs=s.behaviour_logprobs,
                versions=s.versions,
                advantage=s.advantage,
                sample_id=s.sample_id,
            )
            for g in batch.trainable
            for s in g.samples
        ]
        train_batch = TrainBatch(tuple(sequences))
        constant = cfg.advantages.constant_tokens or (
            cfg.trainer.batch_groups * cfg.advantages.group_size * cfg.engine.sampling.max_new_tokens
        )
        objective = CorrectedObjective(cfg.correction, cfg.advantages, self._current_version(), constant)
        minibatches = min(cfg.trainer.minibatches, len(sequences))
        started = time.monotonic()
        if cfg.correction.method == "decoupled_ppo" and minibatches > 1:
            proximal = await asyncio.to_thread(self.backend.logprobs, train_batch)
            train_batch = TrainBatch(tuple(_with_proximal(s, p) for s, p in zip(sequences, proximal, strict=True)))
        result = await asyncio.to_thread(self.backend.train_step, train_batch, objective, num_minibatches=minibatches)
        return result, time.monotonic() - started

    async def publish_version(self) -> float:
        """Publish V+1 (parts, manifest, LATEST), then announce it; nothing is acked before this returns."""
        started = time.monotonic()
        self.state.step += 1
        if self.replay is None:
            self.state.version += 1
            await self._publish(self.state.version)
        return time.monotonic() - started

    async def _publish(self, version: int) -> None:
        from pipeline.announce import announce_version
        from storage.weights import TORCH_DTYPES

        tensors = self.backend.export_weights(TORCH_DTYPES[self.cfg.model.dtype])
        manifest = await asyncio.to_thread(self.publisher.publish, version, tensors)
        if self.kv is not None:
            await announce_version(self.kv, version)
        log.debug("published version %d (%s, parent %s)", version, manifest.kind, manifest.parent_version)

    async def commit(self, batch: Batch) -> None:
        """The version is published: ack every delivery of the step, and record the groups as handled."""
        if self.consumer is not None:
            await self.consumer.ack(batch.seqs)
        s = self.state
        self.handled.add_all(p.group_id for p in batch.consumed)
        s.consumed_seq = max([s.consumed_seq, *batch.seqs])
        s.trained_groups += len(batch.trainable)
        s.discarded_groups += batch.num_dropped
        self.queue_depth = await self._queue_depth()

    async def _queue_depth(self) -> int | None:
        """Groups waiting in the stream for this trainer (for the live view); None if unknown right now."""
        if self.consumer is None:
            return None
        try:
            info = await asyncio.wait_for(
                self.js.consumer_info(self.names.trajectory_stream, self.names.trainer_consumer), QUEUE_INFO_TIMEOUT_S
            )
        except (asyncio.TimeoutError, nats.errors.Error):
            return None
        return int(info.num_pending)

    # -------------------------------------------------------------------------------------- metrics

    async def _on_generator_report(self, msg: Any) -> None:
        try:
            report = orjson.loads(msg.data)
            self.generator_reports[str(report["generator_id"])] = report
        except (orjson.JSONDecodeError, KeyError, TypeError):
            log.warning("ignoring a malformed generator report on %s", msg.subject)

    def write_metrics(self, batch: Batch, result: Any, compute_s: float, publish_s: float) -> None:
        """One metrics record: rewards, counts, staleness, correction stats, timings, group ids."""
        version_trained_at = self._current_version() - (0 if self.replay is not None else 1)
        counts = sample_counts(batch.consumed)
        checked = [p for p in batch.consumed if p.drop_reason != DROP_INVALID]
        self.state.dropped_by_cap_total += counts["samples/dropped_by_cap"]
        step_s = batch.wait_s + compute_s + publish_s
        record: dict[str, Any] = {
            "step": self.state.step,
            "version": self._current_version(),
            "time_s": time.time() - self.started_at,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "entropy": result.entropy_mean,
            **reward_metrics(batch.consumed),
            **counts,
            "samples/dropped_by_cap_total": self.state.dropped_by_cap_total,
            "groups/trained": len(batch.trainable),
            "groups/dropped": batch.num_dropped,
            "groups/duplicates": batch.duplicates,
            "groups/invalid": len(batch.consumed) - len(checked),
            **staleness_metrics(checked, version_trained_at),
            **timing_split(batch.consumed, batch.received_at_s, time.time()),
            **merge_loss_stats(result.micro_stats),
            "time/wait_s": batch.wait_s,
            "time/compute_s": compute_s,
            "time/publish_s": publish_s,
            "time/step_s": step_s,
            "time/wait_fraction": batch.wait_s / step_s if step_s > 0 else 0.0,
            "trainer/tokens_per_s": result.num_loss_tokens / compute_s if compute_s > 0 else None,
            "trained_group_ids": [p.group_id for p in batch.trainable],
            "dropped_group_ids": {p.group_id: p.drop_reason for p in batch.consumed if not p.trainable},
            "queue/trajectories": self.queue_depth,
            "generators": dict(self.generator_reports),
            "generators/tokens_per_s": sum(float(r.get("tokens_per_s") or 0) for r in self.generator_reports.values()),
        }
        assert self.metrics is not None
        self.metrics.write(record)
        log.info(
            "step %d version %d loss %.4f reward %.3f staleness %.2f wait %.2fs compute %.2fs publish %.2fs",
            record["step"],
            record["version"],
            result.loss,
            _num(record["reward/unfiltered_mean"]),
            _num(record.get("staleness/mean")),
            batch.wait_s,
            compute_s,
            publish_s,
        )

    # ----------------------------------------------------------------------------------- checkpoint

    async def maybe_checkpoint(self, *, final: bool = False) -> None:
        """Every `trainer.checkpoint_every` steps (and at the end of a session) write a checkpoint."""
        s = self.state
        if self.replay is not None or self.publisher is None or s.step == self.last_checkpoint_step:
            return
        if not final and s.step % self.cfg.trainer.checkpoint_every:
            return
        s.handled_group_ids = self.handled.to_list()
        tensors, meta = self.backend.state_tensors(), self.backend.state_meta()
        await asyncio.to_thread(write_checkpoint, self.store, self.names.run, s, tensors, meta)
        self.last_checkpoint_step = s.step
        log.info("checkpoint written at step %d (version %d, stream seq %d)", s.step, s.version, s.consumed_seq)

    async def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.source is not None and self.source is not self.consumer:
            await self.source.close()
        if self.consumer is not None:
            await self.consumer.close()
        if self.nc is not None:
            await self.nc.drain()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)


def build_weight_publisher(cfg: LeewayConfig, store: Any, model: Any) -> Any:
    """A `storage.weights.WeightPublisher` for the run, from ``weights.*`` and ``model.dtype``."""
    from storage.manifest import config_hash
    from storage.weights import TORCH_DTYPES, WeightPublisher

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


def _with_proximal(seq: Any, proximal: Any) -> Any:
    from dataclasses import replace

    return replace(seq, proximal_logprobs=proximal)


def _num(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def main(cfg: LeewayConfig, *, resume: bool = False, replay: ReplaySelection | None = None) -> int:
    """`leeway trainer CONFIG [--resume] [--replay SELECTION]` (the CLI parses the flags)."""
    import torch

    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.run.seed)
    trainer = Trainer(cfg, resume=resume, replay=replay)

    async def _run() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, trainer.stop.set)
        return await trainer.run()

    return asyncio.run(_run())
