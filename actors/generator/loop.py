"""The generator's batch loop: prompts in, scored trajectory groups out, weights pulled on their own schedule.

```
  prompt queue (JetStream work queue)                                      trajectory stream (JetStream)
      │ take(<= concurrency), short timeout                                          ▲
      ▼                                                                              │ publish (Nats-Msg-Id =
  Generator.run ─► run_batch: refuse ─► sync ─► submit ────────► score ────────── group id = prompt id)
      │            unrunnable   (sync_floor)  all prompts x        score_group per   │ then, only after
      │            (dead-letter  waits on     group_size to the    group as soon as  ▼ the publish ack:
      │            or nak)       WeightSync   engine at once       its G are done    lease.done()  (ack)
      │                                  │ in_progress() every heartbeat_s
      │                                  └── aborted (cap crossed / shutdown) ──────► lease.release() (nak)
      ▼
  WeightSync (actors/generator/weight_sync.py): KV doorbell + LATEST poll -> WeightSubscriber.pull -> engine
      in_flight: applied between two decode steps of the running batch; between_rollouts: before the next batch
```

A multi-turn task (one with an environment, `pipeline.rl.episodes.environment_factory`) replaces generate +
score by `pipeline.rl.scoring.run_group` per prompt: its episodes call the engine once per turn.

The loops and who unblocks them:
- The batch loop consumes prompts; it waits for prompts (the trainer's admission unblocks it) and,
  before a batch, for the engine to reach the batch's sync floor (`sync_floor` in
  `pipeline/rl/staleness.py`, from the newest known version and the prompts' admission versions). The
  trainer publishing that version (seen by the KV watch or the LATEST poll) unblocks it.
- The weight-sync loop consumes version news and waits for nothing but the store.
- The heartbeat keeps held prompts from being redelivered while a long batch runs.
- Process wiring (servers, engine, weight-sync and metrics loops, signals): `actors/generator/runtime.py`.

Invariants and failure behaviour:
- group id = prompt id: a prompt redelivered after a generator died yields a group with the same id,
  which JetStream (Nats-Msg-Id) and the trainer's record deduplicate.
- A prompt is acked only after its group's publish is acknowledged; a generator killed before that
  leaves the prompt to be redelivered after ``stream.prompt_ack_wait_s``, and no partial group exists
  (a group is one message).
- One prompt fails alone. Before the engine call, a prompt no engine call can take (`checked_prompt_ids`:
  ids outside the vocabulary, no room in the engine's ``max_len``) is dead-lettered with its reason, and one
  admitted at a version the store's LATEST has not reached (left from an earlier run of the same name) is
  released with a WARNING instead of being waited for. A batch whose version the engine cannot reach within
  `generator.weight_pull_timeout_s` (pulls failing) is handed back, said why (ERROR, ``weight_pull_timeouts``), and no
  prompt is taken until the version is applied. If the engine refuses the batch or fails a group's
  requests, that group is generated again in an engine call of its own; a prompt whose rollout or publish
  fails is nak'ed alone. The others are published and acked.
- The engine streams: a group is scored as soon as its G samples are done (`Engine.submit` futures), while
  the engine keeps decoding the rest; a continuously batching engine fills a finished sample's slot with a
  waiting request at its next step. In ``in_flight`` mode each prompt is a batch of its own, taken as soon
  as one of the ``generator.concurrency`` places frees, so the engine is handed a finished group's
  successor at once; the abort rule and shutdown abort only that batch's requests (`Engine.abort` by
  request id). ``between_rollouts`` keeps one batch of up to ``concurrency`` prompts at a time.
- Verifiers run on the generator's `VerifierPool` (threads of their own, under
  ``generator.verifier_timeout_s``): a hung verifier makes its sample an ``infra_error`` and holds no
  thread that generation or a weight pull needs.
- A batch with an aborted sample publishes nothing for that prompt and naks it (another generator
  takes it at once). Aborts come from the abort rule (`crosses_cap` in `pipeline/rl/staleness.py`, when
  ``staleness.abort_in_flight``) or from shutdown.
- On `request_stop` (SIGINT/SIGTERM): stop taking prompts; the running batch gets `shutdown_grace_s` to
  finish, then it is aborted and its prompts nak'ed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any

from tokenizers import Tokenizer

from actors.generator.agents import AgentRunner
from actors.generator.engines.base import Engine, SamplingParams
from actors.generator.metrics import GeneratorMetrics, metered, metered_submit
from actors.generator.rollouts import GroupTooLarge, Outcome, Rollouts
from actors.generator.weight_sync import (
    WeightPullTimeout,
    WeightSync,
    unknown_version_message,
)
from pipeline.chat.template import ChatTemplate
from pipeline.config import LeewayConfig
from pipeline.rl.prompt_ids import UnrunnablePrompt, checked_prompt_ids
from pipeline.rl.staleness import crosses_cap, sync_floor
from pipeline.tasks import Task, VerifierPool
from pipeline.wire.prompt_queue import PromptLease, PromptQueue
from pipeline.wire.prompts import Prompt
from pipeline.wire.trajectories import TrajectoryPublisher
from pipeline.wire.trajectory import TrajectoryGroup

log = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 0.5
"""Long-poll of one prompt fetch: short, so a batch starts with whatever is available."""
TAKE_RETRY_S = 1.0
"""Pause after a failed prompt fetch (server away) before the next one."""
SHUTDOWN_GRACE_S = 5.0
"""Default `Generator.shutdown_grace_s`: on a stop request the running batch may finish within this long."""
ABORT_CHECK_S = 0.05
"""How often a running batch checks the abort rule and shutdown."""
MAX_BATCHES_PUBLISHING = 2
"""Batches whose groups are still being published while the engine already generates the next one (in
``in_flight`` mode, where each prompt is a batch of its own: up to `generator.concurrency` groups publish
while as many generate)."""
UNKNOWN_VERSION_NAK_DELAY_S = 10.0
"""Default `Generator.unknown_version_nak_delay_s`: a prompt admitted at a version the store does not have (or
taken while the store cannot be read) comes back after this long, not in a tight loop."""


class Generator:
    """One generator: the batch loop of the module docstring. Built by `GeneratorRuntime.open`
    (`actors/generator/runtime.py`)."""

    def __init__(
        self,
        cfg: LeewayConfig,
        *,
        engine: Engine,
        tokenizer: Tokenizer,
        task: Task,
        sampling: SamplingParams,
        queue: PromptQueue,
        publisher: TrajectoryPublisher,
        weights: WeightSync,
        metrics: GeneratorMetrics,
        generator_id: str,
        verifiers: VerifierPool,
        agents: AgentRunner | None = None,
        template: ChatTemplate | None = None,
    ) -> None:
        """`template`: the model's chat template, which renders chat prompts (`Prompt.messages`); without one a chat
        prompt is dead-lettered (``no_chat_template``)."""
        self.cfg = cfg
        self.template = template
        self.engine = engine
        self.tokenizer = tokenizer
        self.task = task
        self.sampling = sampling
        self.queue = queue
        self.publisher = publisher
        self.weights = weights
        self.metrics = metrics
        self.generator_id = generator_id
        self.verifiers = verifiers
        self.shutdown_grace_s = SHUTDOWN_GRACE_S
        self.unknown_version_nak_delay_s = UNKNOWN_VERSION_NAK_DELAY_S
        self.weight_pull_timeout_s = cfg.generator.weight_pull_timeout_s
        self._stuck_at: int | None = None
        """The version the engine could not reach in time for held prompts: no prompt is taken until it has it."""
        self.rollouts = Rollouts(
            generate=metered(engine.generate, metrics),
            submit=metered_submit(engine.submit, metrics),
            task=task,
            sampling=sampling,
            tokenizer=tokenizer,
            verifiers=verifiers,
            group_size=cfg.advantages.group_size,
            agents=agents,
            template=template,
            rollout=cfg.rollout,
        )
        self._stop = asyncio.Event()
        self._publishing: set[asyncio.Task[None]] = set()

    def request_stop(self) -> None:
        """Stop taking prompts; the running batch finishes within `shutdown_grace_s` or is aborted."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # ---- the loop -----------------------------------------------------------------------------------

    async def run(self) -> None:
        """The batch loop, until `request_stop`. Waits for version 0 first (a trainer may not exist yet)."""
        if not await self._until_stop(self.weights.ensure(0, on_wait=self._log_waiting)):
            return
        log.info("generator %s: serving version %d", self.generator_id, self.weights.engine_version)
        if self.cfg.generator.update_mode == "in_flight":
            await self._stream_prompts()
        else:
            await self._batch_after_batch()
        await self._wait_for_publishing(0)

    async def _batch_after_batch(self) -> None:
        """``between_rollouts``: one batch at a time, so weights change only between two batches."""
        while not self.stopping:
            if not await self._unstuck():
                break
            leases = await self._take(self.cfg.generator.concurrency)
            if not leases:
                continue
            if self.stopping:
                await _release(leases)
                break
            await self._wait_for_publishing(MAX_BATCHES_PUBLISHING - 1)
            await self.run_batch(leases, background_publish=True)

    async def _stream_prompts(self) -> None:
        """``in_flight``: every prompt is a batch of its own, started as soon as one of the
        `generator.concurrency` places is free, so the engine (which batches all requests in flight
        together) gets a finished group's successor at once instead of waiting for the whole batch."""
        running: set[asyncio.Task[None]] = set()
        """One task per prompt generating, from its creation (a task not yet started holds its place too)."""

        async def one(lease: PromptLease) -> None:
            await self.run_batch([lease], background_publish=True)

        while not self.stopping:
            free = self.cfg.generator.concurrency - len(running)
            if free <= 0:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                continue
            if not await self._unstuck():
                break
            leases = await self._take(free)
            if not leases:
                continue
            if self.stopping:
                await _release(leases)
                break
            await self._wait_for_publishing(self.cfg.generator.concurrency)
            for lease in leases:
                task = asyncio.create_task(one(lease))
                running.add(task)
                task.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running, return_exceptions=True)

    async def run_batch(self, leases: list[PromptLease], *, background_publish: bool = False) -> None:
        """One batch: refuse what cannot run, sync weights to the batch's floor, generate and score, then
        publish+ack or nak each prompt on its own.

        With `background_publish` the publish+ack phase runs as a task (tracked in `_publishing`) so the
        engine starts the next batch meanwhile; prompts stay heartbeated until their group is acked.
        """
        held = list(leases)  # heartbeated; a prompt refused before the rollout leaves it
        heartbeat = asyncio.create_task(self._heartbeat(held))
        self.metrics.rollouts_in_flight += len(leases)
        try:
            prompt_ids = await self._refuse_unrunnable(held)
            if held and not await self._sync([lease.prompt for lease in held]):
                await _release(held)
                held.clear()
            if not held:
                self._batch_done(heartbeat, len(leases))
                return
            start_s = time.time()
            outcomes = await self._rollouts([lease.prompt for lease in held], prompt_ids)
            end_s = time.time()
        except Exception:  # the batch boundary: nothing was acked, so every prompt still held goes back
            log.exception("batch of %d prompts failed; returning them to the queue", len(held))
            await _release(held)
            self._batch_done(heartbeat, len(leases))
            return
        except BaseException:
            self._batch_done(heartbeat, len(leases))
            raise
        publish = self._publish_batch(list(held), outcomes, start_s, end_s, heartbeat, len(leases))
        if background_publish:
            task = asyncio.create_task(publish)
            self._publishing.add(task)
            task.add_done_callback(self._publishing.discard)
        else:
            await publish

    # ---- the steps of a batch -----------------------------------------------------------------------

    async def _refuse_unrunnable(self, held: list[PromptLease]) -> list[list[int]]:
        """Take out of `held` (in place) every prompt that cannot run; returns the token ids of those left.

        A prompt no engine call can ever take (`checked_prompt_ids`: ids outside the vocabulary, no room in
        the context) is dead-lettered with its reason; one admitted at a version the store does not have is
        released (`_unknown_versions`). The rest of the batch goes on without them.
        """
        vocab_sizes = [v for v in (self.engine.vocab_size, _tokenizer_vocab_size(self.tokenizer)) if v]
        runnable: list[tuple[PromptLease, list[int]]] = []
        for lease in held:
            try:
                ids = checked_prompt_ids(
                    lease.prompt,
                    self.tokenizer,
                    vocab_size=min(vocab_sizes) if vocab_sizes else None,
                    max_context_tokens=self.engine.max_context_tokens,
                    template=self.template,
                )
            except UnrunnablePrompt as exc:
                log.warning("generator %s: %s; dead-lettering it (%s)", self.generator_id, exc, exc.reason)
                await _reject(lease, exc.reason.value, exc.detail)
                continue
            runnable.append((lease, ids))
        unknown = await self._unknown_versions([lease for lease, _ in runnable])
        runnable = [(lease, ids) for lease, ids in runnable if lease not in unknown]
        held[:] = [lease for lease, _ in runnable]
        return [ids for _, ids in runnable]

    async def _unknown_versions(self, held: list[PromptLease]) -> list[PromptLease]:
        """Release and return the prompts admitted at a version the store's LATEST has not reached.

        A trainer publishes a version (LATEST included) before it admits prompts at it, so such a prompt
        was admitted by another run under the same name (a prompt stream kept, the store wiped): waiting
        for its version would hold it forever. It is nak'ed after `unknown_version_nak_delay_s` (and, past
        ``stream.prompt_max_deliver``, dead-lettered by the queue), with a WARNING that says what to do.
        """
        newest_admitted = max((lease.prompt.policy_version for lease in held), default=-1)
        if newest_admitted <= self.weights.newest_known:
            return []
        try:
            latest = await self.weights.poll_once()
        except Exception:  # the store is away: do not sit on the prompts while it is
            log.warning(
                "reading the store's LATEST failed; returning %d prompts to the queue", len(held), exc_info=True
            )
            await _release(held, self.unknown_version_nak_delay_s)
            return list(held)
        have = max(self.weights.newest_known, -1 if latest is None else latest)
        unknown = [lease for lease in held if lease.prompt.policy_version > have]
        if unknown:
            log.warning(
                "%s; returning %d prompts (e.g. %s) to the queue",
                unknown_version_message(self.cfg.run.name, "prompts admitted at", newest_admitted, latest),
                len(unknown),
                unknown[0].prompt.prompt_id,
            )
            await _release(unknown, self.unknown_version_nak_delay_s)
        return unknown

    async def _sync(self, prompts: Sequence[Prompt]) -> bool:
        """Bring the engine to the batch's sync floor (`pipeline/rl/staleness.py`); False if shutdown came first,
        or if the engine could not get there within `weight_pull_timeout_s` (the caller hands the prompts back).

        A version that can never be pulled (another model's manifest, a missing delta, a store away) would
        otherwise hold the batch's prompts for good; given back, they go to a generator that can run them, and
        this one takes no more prompts until it reaches that version (`_unstuck`), still trying meanwhile.
        """
        if self.cfg.generator.update_mode == "between_rollouts":
            try:
                await self.weights.catch_up()
            except Exception:  # the floor below is what the batch needs; `ensure` retries and bounds it
                log.warning("pulling the newest version before a batch failed", exc_info=True)
        floor = sync_floor(
            self.weights.newest_known, self.cfg.staleness.max_staleness, [p.policy_version for p in prompts]
        )
        try:
            return await self._until_stop(self.weights.ensure(floor, give_up_after_s=self.weight_pull_timeout_s))
        except WeightPullTimeout as exc:
            self.metrics.weight_pull_timeouts += 1
            self.metrics.weights_stuck = 1
            self._stuck_at = max(floor, self._stuck_at if self._stuck_at is not None else -1)
            log.error(
                "generator %s: %s; handing %d prompts back to the queue and taking no more until version %d "
                "is applied (still trying). Is store.url the trainer's, and model.name_or_path the trainer's model?",
                self.generator_id,
                exc,
                len(prompts),
                floor,
            )
            return False

    async def _unstuck(self) -> bool:
        """Before taking prompts: if a version could not be reached in time (`_sync`), wait for it with no prompt
        held, pulling until it is applied. False if shutdown came first."""
        stuck_at = self._stuck_at
        if stuck_at is None:
            return True
        if not await self._until_stop(self.weights.ensure(stuck_at)):
            return False
        log.info("generator %s: version %d applied; taking prompts again", self.generator_id, stuck_at)
        if self._stuck_at == stuck_at:
            self._stuck_at = None
            self.metrics.weights_stuck = 0
        return True

    async def _rollouts(self, prompts: list[Prompt], prompt_ids: list[list[int]]) -> list[Outcome]:
        """Every group of the batch, generated and scored while `_watch_abort` may abort the engine; a
        prompt whose rollout failed gets its exception in place of its samples."""
        group_size = self.cfg.advantages.group_size
        request_ids = [f"{p.prompt_id}-{i}" for p in prompts for i in range(group_size)]
        watch = asyncio.create_task(self._watch_abort(self.weights.engine_version, request_ids))
        try:
            return await self.rollouts.run(prompts, prompt_ids)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    async def _publish_batch(
        self,
        leases: list[PromptLease],
        outcomes: list[Outcome],
        start_s: float,
        end_s: float,
        heartbeat: asyncio.Task[None],
        num_in_flight: int,
    ) -> None:
        """Publish+ack every group; a prompt whose rollout or publish failed goes back to the queue alone."""
        try:
            published = await asyncio.gather(
                *(self._publish(lease, out, start_s, end_s) for lease, out in zip(leases, outcomes, strict=True)),
                return_exceptions=True,
            )
            failed = []
            for lease, outcome, result in zip(leases, outcomes, published, strict=True):
                error = outcome if isinstance(outcome, BaseException) else result
                if isinstance(error, GroupTooLarge):  # the trainer's door would refuse it: dead-lettered, not retried
                    await _reject(lease, error.reason, str(error))
                elif isinstance(error, BaseException):
                    log.error(
                        "group %s not published (its %s failed); its prompt goes back to the queue",
                        lease.prompt.prompt_id,
                        "rollout" if error is outcome else "publish",
                        exc_info=error,
                    )
                    failed.append(lease)
            await _release(failed)
        finally:
            self._batch_done(heartbeat, num_in_flight)

    async def _publish(self, lease: PromptLease, outcome: Outcome, start_s: float, end_s: float) -> None:
        """Publish the group, then ack its prompt; an aborted group is never published and its prompt nak'ed.
        A failed rollout publishes nothing (its caller naks the prompt)."""
        if isinstance(outcome, BaseException):
            return
        samples = outcome
        if any(s.status == "aborted" for s in samples):
            self.metrics.group_aborted()
            await _release([lease])
            return
        prompt_id = lease.prompt.prompt_id
        group = TrajectoryGroup.from_samples(  # raises TrajectoryValidationError on a broken sample
            group_id=prompt_id,
            prompt_id=prompt_id,
            generator_id=self.generator_id,
            samples=[replace(s, gen_start_s=start_s, gen_end_s=end_s) for s in samples],
        )
        await self.publisher.publish(group)
        self.metrics.samples_failed([(s.status, s.info) for s in samples])
        self.metrics.group_published(
            group.versions,
            group.loss_mask,
            group.num_samples,
            max(self.weights.newest_known, self.weights.engine_version),
        )
        try:
            await lease.done()
        except Exception:  # the group is stored; a redelivered prompt republishes the same id (deduped)
            log.warning(
                "ack of prompt %s not confirmed; it may be redelivered (its group id dedupes it)",
                prompt_id,
                exc_info=True,
            )

    # ---- around a batch -----------------------------------------------------------------------------

    async def _take(self, limit: int) -> list[PromptLease]:
        """Up to `limit` prompts; [] when none came or the server is away."""
        try:
            return await self.queue.take(limit, timeout_s=TAKE_TIMEOUT_S)
        except asyncio.TimeoutError:  # nats-py can raise a bare one from a fetch that found nothing
            return []
        except Exception:  # NATS away: the connection reconnects on its own; try again shortly
            log.warning("taking prompts failed; retrying in %.1f s", TAKE_RETRY_S, exc_info=True)
            await asyncio.sleep(TAKE_RETRY_S)
            return []

    async def _watch_abort(self, start_version: int, request_ids: list[str]) -> None:
        """Abort the batch's engine requests when the batch crosses the cap (abort rule) or shutdown's grace
        runs out. Keeps aborting until cancelled, so a multi-turn episode cannot start a new turn. Other
        batches' requests (`request_ids` are the batch's: ``<prompt id>-<i>``) are not touched."""
        shutdown_deadline: float | None = None
        aborting = False
        while True:
            now = time.monotonic()
            if self.stopping and shutdown_deadline is None:
                shutdown_deadline = now + self.shutdown_grace_s
                log.info(
                    "generator %s: stopping; the running batch has %.1f s to finish",
                    self.generator_id,
                    self.shutdown_grace_s,
                )
            if not aborting and shutdown_deadline is not None and now >= shutdown_deadline:
                log.warning("generator %s: aborting the running batch (shutdown)", self.generator_id)
                aborting = True
            if not aborting and self._crossed_cap(start_version):
                aborting = True
            if aborting:
                self.engine.abort(request_ids)
            await asyncio.sleep(ABORT_CHECK_S)

    def _crossed_cap(self, start_version: int) -> bool:
        cap = self.cfg.staleness
        if not (cap.abort_in_flight and crosses_cap(start_version, self.weights.newest_known, cap.max_staleness)):
            return False
        log.info(
            "generator %s: aborting the running batch: started at version %d, newest is %d (cap %d)",
            self.generator_id,
            start_version,
            self.weights.newest_known,
            cap.max_staleness,
        )
        return True

    async def _heartbeat(self, leases: list[PromptLease]) -> None:
        """`in_progress` on every held prompt each `generator.heartbeat_s` (a background loop we own)."""
        while True:
            await asyncio.sleep(self.cfg.generator.heartbeat_s)
            for lease in list(leases):
                try:
                    await lease.in_progress()
                except Exception:
                    log.warning("heartbeat of prompt %s failed", lease.prompt.prompt_id, exc_info=True)

    def _batch_done(self, heartbeat: asyncio.Task[None], num_prompts: int) -> None:
        heartbeat.cancel()
        self.metrics.rollouts_in_flight = max(0, self.metrics.rollouts_in_flight - num_prompts)

    async def _wait_for_publishing(self, at_most: int) -> None:
        """Let earlier batches' publishing overlap the next generation, but never more than `at_most` of them."""
        while len(self._publishing) > at_most:
            await asyncio.wait(self._publishing, return_when=asyncio.FIRST_COMPLETED)

    async def _until_stop(self, work: Coroutine[Any, Any, int]) -> bool:
        """Await `work` unless stop comes first (then cancel it); True if it finished."""
        task = asyncio.create_task(work)
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return False
        task.result()
        return True

    def _log_waiting(self, waited_s: float) -> None:
        log.info(
            "generator %s: waiting for weights version %s of run %r (%.0f s so far; is a trainer running?)",
            self.generator_id,
            max(0, self.weights.newest_known),
            self.cfg.run.name,
            waited_s,
        )


async def _release(leases: Sequence[PromptLease], delay_s: float | None = None) -> None:
    """Nak prompts so another generator takes them (at once, or after `delay_s`); a failed nak just means
    ack-wait redelivery."""
    for lease in leases:
        try:
            await lease.release(delay_s)
        except Exception:
            log.warning(
                "nak of prompt %s failed; it comes back after the ack wait", lease.prompt.prompt_id, exc_info=True
            )


async def _reject(lease: PromptLease, reason: str, detail: str) -> None:
    """Dead-letter a prompt that can never run; if even that fails, it comes back after the ack wait."""
    try:
        await lease.reject(reason, detail)
    except Exception:
        log.warning("dead-lettering prompt %s failed", lease.prompt.prompt_id, exc_info=True)


def _tokenizer_vocab_size(tokenizer: Tokenizer) -> int | None:
    get = getattr(tokenizer, "get_vocab_size", None)
    return int(get()) if callable(get) else None
