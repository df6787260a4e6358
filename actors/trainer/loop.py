"""The trainer loop: consumes trajectory groups, bounds staleness, corrects, steps, publishes version V+1.

```
   session.admit ──► prompts (work queue), as many as `admissible_prompts` allows: (S+K+1)·B groups in all
                     (id "<task id>.<i>", policy_version = V; S = steps taken; a replay admits nothing;
                     slots of dead-lettered prompts/groups come back first: `slots.py`)
   session.fetch ──► collect_batch ── dedupe by group id ── door: ids < vocab, length <= context ── cap at
   (live: a catch-up     │            session.cap_version ── validity ── GRPO/RLOO
    range after --resume,│            └─ refused at the door: dead-lettered (live) or skipped (catch-up,
    then the durable     │               replay); untrainable: dropped with a reason; both acked at once, counted
                         ▼
                       train_on_batch ── backend.train_step(loss_fn = corrected objective at V)
    consumer; replay:    ▼
    a recorded range)  session.publish ── live: WeightPublisher parts, manifest, LATEST ── KV announcement
                         ▼
                       commit ── session.ack the groups used (only now) ── write_metrics ── session.checkpoint
```

The session (`actors/trainer/session_protocol.py`) is a `LiveSession` for `leeway trainer [--resume]` and a
`ReplaySession` for `--replay`; `actors/trainer/sessions.py`'s docstring says what each does at every arrow. The staleness
rule behind admission and the cap is written once, in `pipeline/rl/staleness.py`. With several
trainer ranks (`leeway trainer --nproc N`, or RANK/WORLD_SIZE in the environment) this loop runs on
rank 0 only; its backend is a `LeaderBackend` and the session publishes, checkpoints and resumes
through the `RankGroup`, whose commands the other ranks follow (`actors/trainer/rank_group.py`). The
process around the loop (`leeway trainer`: logging, signals, ranks, `open_trainer`, which assembles a
`Trainer` from its parts) is `actors/trainer/runtime.py`.

The loop waits on one thing only: trajectory groups (`collect_batch`), which generators produce
from admitted prompts; while it waits it re-checks admission, so a dropped group's slot is refilled
at once. While groups keep arriving it also tops admission up as soon as fewer than one batch of
admitted groups is still to come (low water): when most groups are filtered (a saturated reward,
dynamic sampling) the generators would otherwise run dry before every refill. `trainer.queue_wait_timeout_s`
without a trainable group stops the run (`QueueWaitTimeout`, an expected stop that says why: the groups that
did arrive counted by drop reason, or that none did; exit status 2, no traceback).

Invariants and failure behaviour:
- Trainable groups are acked only after the version trained on them is published and announced,
  so a trainer killed mid-step gets them again. Delivery is at-least-once; the record of handled
  group ids (`RecentIds`, persisted in checkpoints) makes each group trained or dropped once.
- A group that will not train (refused at the door, capped, filtered, invalid, or a duplicate of a
  handled one) is acked (or dead-lettered) as soon as it is decided, so it is not redelivered while
  a slow batch fills, and its admission slot comes back at once (`pending_dropped`). Its id joins
  `handled` and the counters only at the commit of its step, with the trainable groups, so that a
  checkpoint's `handled`, counters and watermark always describe the same committed steps. The
  watermark stays right: `consumed_seq` is the highest sequence of a committed step, so an early
  acked group of a step that never committed (killed, stopped, crashed) lies after it; a resume
  re-reads it in the catch-up (the stream keeps acked messages) and decides it again, once. It was
  never trained, so nothing is trained twice; within a session the open batch dedupes it by id.
- An exception the loop cannot handle is logged and a final checkpoint is written before the
  trainer exits non-zero (`main` of `actors/trainer/runtime.py` returns 1), unless the exception came from inside the optimizer
  step: then the weights are in an unknown state and the previous checkpoint stands. If the step
  had been taken (the failure came while publishing), its groups are recorded as handled in that
  checkpoint, since its weights hold their training; unacked, they come back and are deduped.
- `--resume` (1) loads the newest complete checkpoint (none: the initial weights at step 0);
  (2) publishes its weights as a new full version after the newest published one (LATEST, or a
  manifest past it when a trainer died between writing the two), so versions never go backward;
  the manifest's `parent_version` is the version published before it; (3) moves the metrics of
  the lost steps to `metrics.rolled_back.jsonl`; (4) re-reads the stream from the checkpoint's
  watermark (`consumed_seq + 1`) to its current end before returning to the durable consumer
  (groups retention removed before that start are logged and counted, `groups/lost_to_retention`,
  and their admission slots return: they will never arrive).
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
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from actors.trainer.admission import outstanding_groups
from actors.trainer.backends import StepResult, TrainBatch, TrainingBackend
from actors.trainer.checkpoints import RecentIds, TrainerState
from actors.trainer.metrics_log import MetricsLog
from actors.trainer.objective import CorrectedObjective
from actors.trainer.session_protocol import Session
from actors.trainer.slots import slots_to_return
from pipeline.config import LeewayConfig
from pipeline.rl.batching import (
    DROP_CAP,
    DROP_FILTER,
    GroupPolicy,
    ModelLimits,
    PreparedGroup,
    TrainSequence,
    check_model_limits,
    prepare_group,
)
from pipeline.rl.step_metrics import (
    merge_loss_stats,
    refusal_metrics,
    reward_metrics,
    sample_counts,
    staleness_metrics,
    timing_split,
)
from pipeline.wire.consumer import Delivery

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 0.25
"""One wait for groups; admission and the stop flag are re-checked between waits."""
WAIT_LOG_EVERY_S = 30.0
"""While no trainable group arrives, say so this often (and reset the held groups' ack wait)."""
DROP_INVALID = "invalid"
"""Drop reason of a group the batching logic refused (logged with the reason)."""
DROP_MEANING = {
    DROP_FILTER: "every sample of the group scored the same: no learning signal, as when a policy solves none of "
    "its tasks",
    DROP_CAP: "older than the staleness cap allows",
}
"""What a drop reason means, where `QueueWaitTimeout` names it."""


@dataclass
class Batch:
    """The groups of one step: trainable ones, and every group consumed while filling it."""

    trainable: list[PreparedGroup] = field(default_factory=list)
    consumed: list[PreparedGroup] = field(default_factory=list)
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Group id -> (reason, detail) of the groups refused at the door (not in `consumed`)."""
    seqs: list[int] = field(default_factory=list)
    """Stream sequences of every delivery, duplicates included (the rest are acked at commit)."""
    received_at_s: dict[str, float] = field(default_factory=dict)
    duplicates: int = 0
    wait_s: float = 0.0

    @property
    def num_dropped(self) -> int:
        """Groups of this batch that will not train (dropped or refused): their slots are free."""
        return len(self.consumed) - len(self.trainable) + len(self.refused)

    def handled_ids(self) -> list[str]:
        return [p.group_id for p in self.consumed] + list(self.refused)


class StopRequested(Exception):
    """SIGINT/SIGTERM arrived while waiting for groups: the step is abandoned."""


class QueueWaitTimeout(RuntimeError):
    """No trainable group arrived for `trainer.queue_wait_timeout_s`: an expected stop, not a crash. The message
    says why (what the groups that did arrive were dropped for, or that none arrived); the final checkpoint is
    written as after any error, and `leeway trainer` ends with the message as its last line, no traceback, and
    exit status 2 (`actors/trainer/runtime.py`)."""


class Trainer:
    """One trainer process. `run()` is the loop drawn in the module docstring; `session` is live or replay."""

    def __init__(
        self, cfg: LeewayConfig, backend: TrainingBackend, session: Session, *, stop: asyncio.Event | None = None
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.session = session
        self.stop = stop if stop is not None else asyncio.Event()
        """Set by SIGINT/SIGTERM (`actors/trainer/runtime.py`): the loop finishes or abandons the step, then checkpoints."""
        self.state = TrainerState()
        """The loop's progress; `run` replaces it by the session's (a resumed run's comes from its checkpoint)."""
        self.handled = RecentIds()
        """Ids of the groups trained or dropped, so that a redelivered group is handled once."""
        self.group_policy = GroupPolicy(
            max_staleness=session.staleness_cap,
            cap_policy=cfg.staleness.policy,
            estimator=cfg.advantages.estimator,
            std_normalize=cfg.advantages.std_normalize,
        )
        self.limits: ModelLimits = backend.model_limits()
        """What a group must fit to reach `train_step` (checked at the door, `_take`)."""
        self.metrics: MetricsLog | None = None
        """Opened once the session has started: a resume first rolls back the records of lost steps."""
        self.queue_depth: int | None = None
        self.started_at_s = time.time()
        self._last_wait_report_s = time.monotonic()
        self._in_optimizer_step = False
        """True while `train_step` runs: a failure then leaves the weights unknown (no final checkpoint)."""
        self._uncommitted: Batch | None = None
        """The batch whose optimizer step was taken but not yet committed (see `_checkpoint_after_failure`)."""

    # ------------------------------------------------------------------------------------------ loop

    async def run(self) -> int:
        """The loop; returns 0 at max_steps, at a stop request or at the end of a replay. Any other
        exception is logged, a final checkpoint written (`_checkpoint_after_failure`), then re-raised."""
        try:
            self.state = await self.session.start()
            self.handled = RecentIds(self.state.handled_group_ids)
            self.metrics = MetricsLog(self.cfg, self.session.metrics_path, eval_path=self.session.eval_path)
            try:
                await self._steps()
            except StopRequested:
                log.info("stop requested: abandoning the current step; its groups are given back")
                await self.session.give_back()
            except Exception as exc:
                if not isinstance(exc, QueueWaitTimeout):  # an expected stop: `main` logs it, once
                    log.error("trainer failed at step %d: %s: %s", self.state.step, type(exc).__name__, exc)
                await self._checkpoint_after_failure()
                raise
            await self.session.checkpoint(self.state, self.handled, final=True)
        finally:
            await self.close()
        return 0

    async def _steps(self) -> None:
        while self.state.step < self.cfg.trainer.max_steps and not self.stop.is_set():
            await self.admit()
            batch = await self.collect_batch()
            if batch is None:
                return
            version = self.session.current_version(self.state.version)
            result, compute_s = await self.train_on_batch(batch, version)
            self._uncommitted = batch
            publish_s = await self.publish_version()
            await self.commit(batch)
            self.write_metrics(batch, result, version, compute_s, publish_s)
            await self.session.checkpoint(self.state, self.handled, final=False)

    async def _checkpoint_after_failure(self) -> None:
        """Write a final checkpoint if the state describes the weights (see the module docstring); never raises."""
        if self._in_optimizer_step:
            log.error("the failure came inside the optimizer step: weights unknown, the last checkpoint stands")
            return
        try:
            if self._uncommitted is not None:  # the weights hold this step: record its groups as handled
                self._record(self._uncommitted)
            await self.session.give_back()
            await self.session.checkpoint(self.state, self.handled, final=True)
        except Exception:  # a boundary we own: the original error is the one to report
            log.exception("final checkpoint after the failure could not be written")

    async def admit(self, batch: Batch | None = None) -> None:
        """Return the slots of prompts and groups dead-lettered elsewhere (`slots.py`), then admit prompts."""
        entries = await self.session.new_dead_letters(self.state)
        if entries:
            in_batch = batch.received_at_s if batch is not None else {}
            returned = slots_to_return(
                entries, admitted=self.state.admitted, is_known=lambda g: g in self.handled or g in in_batch
            )
            self.handled.add_all(returned)
            self.state.dead_lettered_groups += len(returned)
            if returned:
                log.info(
                    "%d admission slots returned for dead-lettered prompts/groups: %s", len(returned), returned[:8]
                )
        await self.session.admit(self.state, pending_dropped=batch.num_dropped if batch is not None else 0)

    async def collect_batch(self) -> Batch | None:
        """Fill a batch of `trainer.batch_groups` trainable groups; None when a replay has run out."""
        batch, need = Batch(), self.cfg.trainer.batch_groups
        started = last_progress = time.monotonic()
        while len(batch.trainable) < need:
            if self.stop.is_set():
                raise StopRequested
            deliveries = await self.session.fetch(max_groups=need - len(batch.trainable), timeout_s=FETCH_TIMEOUT_S)
            trainable_before = len(batch.trainable)
            decided: list[int] = []  # groups that will not train: acked once per fetch, in parallel
            for delivery in deliveries:
                seq = await self._take(delivery, batch)
                if seq is not None:
                    decided.append(seq)
            if decided:
                await self.session.ack(decided)
            now = time.monotonic()
            if len(batch.trainable) > trainable_before:
                last_progress = now
            if deliveries:
                if decided and self._still_to_come(batch) < need:
                    await self.admit(
                        batch
                    )  # low water: refill the slots dropped groups freed before the queue runs dry
                continue
            if self.session.exhausted:
                if not batch.trainable:
                    return None
                break
            await self._while_waiting(batch, idle_s=now - last_progress)
        batch.wait_s = time.monotonic() - started
        return batch

    def _still_to_come(self, batch: Batch) -> int:
        """Admitted groups not yet delivered: neither decided in a committed step nor held by `batch`."""
        return outstanding_groups(self.state, len(batch.consumed) + len(batch.refused))

    async def _while_waiting(self, batch: Batch, idle_s: float) -> None:
        """No group arrived: refill admission, keep held groups from redelivery, say why we wait, give up late."""
        await self.admit(batch)
        now = time.monotonic()
        if now - self._last_wait_report_s > WAIT_LOG_EVERY_S:
            self._last_wait_report_s = now
            await self.session.keep_alive()
            log.info(
                "waiting for trajectory groups: %d/%d trainable, %d dropped so far",
                len(batch.trainable),
                self.cfg.trainer.batch_groups,
                batch.num_dropped,
            )
        if idle_s > self.cfg.trainer.queue_wait_timeout_s:
            raise QueueWaitTimeout(
                f"no trainable group for {self.cfg.trainer.queue_wait_timeout_s:.0f} s "
                f"(trainer.queue_wait_timeout_s); {self._why_none_trains(batch)}"
            )

    def _why_none_trains(self, batch: Batch) -> str:
        """The groups this batch dropped or refused, counted by reason; or that none arrived."""
        reasons = Counter(p.drop_reason or DROP_INVALID for p in batch.consumed if not p.trainable)
        reasons.update(reason for reason, _ in batch.refused.values())
        if not reasons:
            return f"no group arrived: are generators running for run {self.cfg.run.name!r}?"
        counts = ", ".join(
            f"{n} {reason}" + (f" ({DROP_MEANING[reason]})" if reason in DROP_MEANING else "")
            for reason, n in reasons.most_common()
        )
        return f"{sum(reasons.values())} groups arrived that cannot train: {counts}"

    async def _take(self, delivery: Delivery, batch: Batch) -> int | None:
        """Dedupe, the door, then cap / validity / advantages (`pipeline/rl/batching.py`) for one delivered group.

        Returns the stream sequence to ack now when the group will not train (the caller acks a fetch's
        worth at once); a refused group is dead-lettered here. See the module docstring."""
        group = delivery.group
        batch.seqs.append(delivery.seq)
        if group.group_id in self.handled:
            batch.duplicates += 1  # at-least-once delivery: decided in a committed step
            return delivery.seq
        if group.group_id in batch.received_at_s:
            batch.duplicates += 1  # redelivered while this batch fills: treated as its first copy was
            if group.group_id in batch.refused:
                await self.session.refuse(delivery, *batch.refused[group.group_id])
                return None
            trains = any(p.group_id == group.group_id for p in batch.trainable)
            return None if trains else delivery.seq
        batch.received_at_s[group.group_id] = time.time()
        refusal = check_model_limits(group, self.limits)
        if refusal is not None:
            log.warning(
                "refusing group %s (stream seq %d): %s: %s",
                group.group_id,
                delivery.seq,
                refusal.reason,
                refusal.detail,
            )
            batch.refused[group.group_id] = (refusal.reason, refusal.detail)
            await self.session.refuse(delivery, refusal.reason, refusal.detail)
            return None
        version = self.session.cap_version(group, self.state.version)
        try:
            prepared = prepare_group(group, version=version, policy=self.group_policy)
        except ValueError as exc:  # e.g. versions newer than any this trainer published: never trainable
            log.warning("dropping group %s (stream seq %d): %s", group.group_id, delivery.seq, exc)
            prepared = PreparedGroup(group, trainable=False, drop_reason=DROP_INVALID)
        batch.consumed.append(prepared)
        if prepared.trainable:
            batch.trainable.append(prepared)
            return None
        return delivery.seq

    async def train_on_batch(self, batch: Batch, version: int) -> tuple[StepResult, float]:
        """Recompute log-probs at `version` and take one optimizer step (several minibatches under decoupled_ppo)."""
        cfg = self.cfg
        sequences = [s for g in batch.trainable for s in g.samples]
        train_batch = TrainBatch(tuple(sequences))
        constant = cfg.advantages.constant_tokens or (
            cfg.trainer.batch_groups * cfg.advantages.group_size * cfg.engine.sampling.max_new_tokens
        )
        objective = CorrectedObjective(cfg.correction, cfg.advantages, version, constant)
        minibatches = min(cfg.trainer.minibatches, len(sequences))
        started = time.monotonic()
        if cfg.correction.method == "decoupled_ppo" and minibatches > 1:
            proximal = await asyncio.to_thread(self.backend.logprobs, train_batch)
            train_batch = TrainBatch(tuple(_with_proximal(s, p) for s, p in zip(sequences, proximal, strict=True)))
        self._in_optimizer_step = True
        result = await asyncio.to_thread(self.backend.train_step, train_batch, objective, num_minibatches=minibatches)
        self._in_optimizer_step = False
        return result, time.monotonic() - started

    async def publish_version(self) -> float:
        """Count the step; the session publishes its weights (live: V+1) before anything is acked."""
        started = time.monotonic()
        self.state.step += 1
        await self.session.publish(self.state)
        return time.monotonic() - started

    async def commit(self, batch: Batch) -> None:
        """The version is published: ack every delivery of the step still held, and record the groups as handled."""
        await self.session.ack(batch.seqs)
        self._record(batch)
        self.queue_depth = await self.session.queue_depth()

    def _record(self, batch: Batch) -> None:
        """The step's groups are handled: ids, watermark and counters move together (once per batch)."""
        s = self.state
        self.handled.add_all(batch.handled_ids())
        s.consumed_seq = max([s.consumed_seq, *batch.seqs])
        s.trained_groups += len(batch.trainable)
        s.discarded_groups += batch.num_dropped
        self._uncommitted = None

    # -------------------------------------------------------------------------------------- metrics

    def write_metrics(
        self, batch: Batch, result: StepResult, trained_at_version: int, compute_s: float, publish_s: float
    ) -> None:
        """One metrics record: rewards, counts, staleness, correction stats, timings, group ids."""
        counts = sample_counts(batch.consumed)
        checked = [p for p in batch.consumed if p.drop_reason != DROP_INVALID]
        self.state.dropped_by_cap_total += counts["samples/dropped_by_cap"]
        step_s = batch.wait_s + compute_s + publish_s
        reports = self.session.generator_reports.current()
        record: dict[str, Any] = {
            "step": self.state.step,
            "version": self.session.current_version(self.state.version),
            "time_s": time.time() - self.started_at_s,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "trainer/skipped_minibatches": result.skipped_minibatches,
            "entropy": result.entropy_mean,
            **reward_metrics(batch.consumed),
            **counts,
            "samples/dropped_by_cap_total": self.state.dropped_by_cap_total,
            "groups/trained": len(batch.trainable),
            "groups/dropped": batch.num_dropped,
            "groups/duplicates": batch.duplicates,
            "groups/invalid": len(batch.consumed) - len(checked),
            **refusal_metrics(batch.refused),
            "groups/dead_lettered_elsewhere_total": self.state.dead_lettered_groups,
            "groups/lost_to_retention": self.state.lost_to_retention,
            **self.session.forged_counts(),
            **staleness_metrics(checked, trained_at_version),
            **timing_split(batch.consumed, batch.received_at_s, time.time()),
            **merge_loss_stats(result.micro_stats),
            **result.moe,
            "time/wait_s": batch.wait_s,
            "time/compute_s": compute_s,
            "time/publish_s": publish_s,
            "time/step_s": step_s,
            "time/wait_fraction": batch.wait_s / step_s if step_s > 0 else 0.0,
            "trainer/tokens_per_s": result.num_loss_tokens / compute_s if compute_s > 0 else None,
            "trained_group_ids": [p.group_id for p in batch.trainable],
            "dropped_group_ids": {p.group_id: p.drop_reason for p in batch.consumed if not p.trainable},
            "queue/trajectories": self.queue_depth,
            "generators": dict(reports),
            "generators/tokens_per_s": sum(r.get("tokens_per_s") or 0.0 for r in reports.values()),
            **failure_counts(reports.values()),
        }
        assert self.metrics is not None, "write_metrics before run() opened the metrics log"
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

    async def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        try:
            await self.session.close()
        finally:
            self.backend.close()  # several ranks: the others stop now (after the final checkpoint)


def _with_proximal(seq: TrainSequence, proximal: np.ndarray) -> TrainSequence:
    return replace(seq, proximal_logprobs=proximal)


def failure_counts(reports: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The generators' typed failures, summed (each report's counts are cumulative): ``failures/<reason>``."""
    out: dict[str, int] = {"failures/retried_episodes": 0}
    for report in reports:
        out["failures/retried_episodes"] += int(report.get("retried_episodes") or 0)
        for reason, count in (report.get("failure_reasons") or {}).items():
            out[f"failures/{reason}"] = out.get(f"failures/{reason}", 0) + int(count)
    return out


def _num(value: float | None) -> float:
    return float("nan") if value is None else float(value)
