"""The generator process: prompts in, scored trajectory groups out, weights pulled on its own schedule.

```
  prompt queue (JetStream work queue)                                   trajectory stream (JetStream)
      │ take(<= concurrency), short timeout                                       ▲
      ▼                                                                           │ publish (Nats-Msg-Id =
  Generator.run ── ensure(staleness floor) ── one batched engine.generate ── verify ── group id = prompt id)
      │   waits on WeightSync        │        (worker thread; concurrency x       │        │ then, only after
      │   for the version            │         group_size requests)               │        ▼ the publish ack:
      │                              │ in_progress() every heartbeat_s            │     lease.done()  (ack)
      │                              └──────── aborted (cap crossed / shutdown) ──┴──► lease.release() (nak)
      ▼
  WeightSync (actors/generator/weight_sync.py): KV doorbell + LATEST poll -> WeightSubscriber.pull -> engine.update_weights
      in_flight: applied between two decode steps of the running batch; between_rollouts: before the next batch
  metrics loop: every 2 s a JSON report on leeway.<run>.metrics.generator (actors/generator/metrics.py)
```

The loops and who unblocks them:
- The batch loop consumes prompts; it waits for prompts (the trainer's admission unblocks it) and,
  before a batch, for weights: the engine must hold a version >= max(newest known, every prompt's
  ``metadata["policy_version"]``) - ``staleness.max_staleness``. The trainer publishing that version
  (seen by the KV watch or the LATEST poll) unblocks it. With max_staleness 0 every rollout uses the
  version the trainer held when it admitted the prompt: the synchronous setting, exactly.
- The weight-sync loop consumes version news and waits for nothing but the store.
- The heartbeat keeps held prompts from being redelivered while a long batch runs.

Invariants and failure behaviour:
- group id = prompt id: a prompt redelivered after a generator died yields a group with the same id,
  which JetStream (Nats-Msg-Id) and the trainer's record deduplicate.
- A prompt is acked only after its group's publish is acknowledged; a generator killed before that
  leaves the prompt to be redelivered after ``stream.prompt_ack_wait_s``, and no partial group exists
  (a group is one message).
- A batch with an aborted sample publishes nothing for that prompt and naks it (another generator
  takes it at once). Aborts come from ``staleness.abort_in_flight`` (the batch's oldest weights fell
  more than the cap behind the newest known version) or from shutdown.
- SIGINT/SIGTERM: stop taking prompts; the running batch gets `SHUTDOWN_GRACE_S` to finish, then it
  is aborted and its prompts nak'ed; NATS is drained and closed; `main` returns 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson
import torch
from tokenizers import Tokenizer

from actors.generator.engines.base import Engine, GenerateRequest, GenerateResult, NamedTensors, SamplingParams
from actors.generator.engines.torch_engine import TorchEngine
from actors.generator.metrics import REPORT_INTERVAL_S, GeneratorMetrics, format_report
from actors.generator.weight_sync import Pulled, WeightSync
from actors.models import build_policy_model, eos_token_id, load_tokenizer, pad_token_id
from pipeline.config import LeewayConfig
from pipeline.names import RunNames
from pipeline.prompt_queue import PromptLease, policy_version, task_prompt
from pipeline.rollout import EnvironmentFactory, run_group
from pipeline.staleness import crosses_cap, sync_floor
from pipeline.tasks import Prompt, Task
from pipeline.trajectory import Sample, TrajectoryGroup

log = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 0.5
"""Long-poll of one prompt fetch: short, so a batch starts with whatever is available."""
TAKE_RETRY_S = 1.0
"""Pause after a failed prompt fetch (server away) before the next one."""
SHUTDOWN_GRACE_S = 5.0
"""On SIGINT/SIGTERM the running batch may finish within this long; then it is aborted and nak'ed."""
ABORT_CHECK_S = 0.05
"""How often a running batch checks the staleness cap (abort_in_flight) and shutdown."""
MAX_BATCHES_PUBLISHING = 2
"""Batches whose groups are still being published while the engine already generates the next one."""
LOG_EVERY_REPORTS = 10
"""Log a metrics line every this many reports (20 s at the 2 s report interval)."""


# ---- building the pieces ------------------------------------------------------------------------------


def sampling_params(cfg: LeewayConfig, tokenizer: Tokenizer) -> SamplingParams:
    eos = eos_token_id(tokenizer)
    s = cfg.engine.sampling
    return SamplingParams(
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop_token_ids=() if eos is None else (eos,),
    )


def build_engine(cfg: LeewayConfig, tokenizer: Tokenizer, generator_id: str) -> Engine:
    """The configured engine, with the model's random init in place until version 0 is pulled (version -1)."""
    model = build_policy_model(cfg, tokenizer, dtype=getattr(torch, cfg.model.dtype)).to(cfg.engine.device)
    seed = (cfg.run.seed * 1_000_003 + zlib.crc32(generator_id.encode())) % 2**62
    return TorchEngine(model, pad_token_id=pad_token_id(tokenizer), seed=seed, version=-1)


def task_environment(task: Task) -> EnvironmentFactory | None:
    """A multi-turn task exposes ``environment(prompt) -> Environment``; single-turn tasks have none."""
    factory = getattr(task, "environment", None)
    return factory if callable(factory) else None


def default_generator_id(cfg: LeewayConfig) -> str:
    return cfg.generator.id or f"{socket.gethostname()}-{os.getpid()}"


class StoreWeightSource:
    """`WeightSource` over `storage.weights.WeightSubscriber` (the subscriber owns its own tensor copies)."""

    def __init__(self, subscriber: Any) -> None:
        self._subscriber = subscriber

    def latest(self) -> int | None:
        return self._subscriber.latest()

    def pull(self, version: int) -> Pulled:
        have = self._subscriber.version
        try:
            plan = self._subscriber.plan(have, version)
            num_bytes, full = plan.num_bytes, plan.from_full
        except Exception:  # the pull below raises the real error with its context
            num_bytes, full = 0, have is None
        self._subscriber.pull(version)
        return Pulled(version=version, tensors=self._subscriber.tensors, num_bytes=num_bytes, full=full)


# ---- trajectories -------------------------------------------------------------------------------------


def to_trajectory_group(
    samples: Sequence[Sample],
    *,
    group_id: str,
    prompt_id: str,
    generator_id: str,
    gen_start_s: float,
    gen_end_s: float,
) -> TrajectoryGroup:
    """Rollout samples -> the validated wire record (raises TrajectoryValidationError on a broken sample)."""
    return TrajectoryGroup.from_samples(
        group_id=group_id,
        prompt_id=prompt_id,
        generator_id=generator_id,
        samples=[replace(s, gen_start_s=gen_start_s, gen_end_s=gen_end_s) for s in samples],
    )


class _Precomputed(Engine):
    """Hands `run_group` results already produced by the generator's one batched generate call, so the
    group's scoring and assembly stay in `pipeline.rollout` while many groups share one engine call."""

    def __init__(self, prompt_ids: list[int], results: list[GenerateResult]) -> None:
        self._prompt_ids = prompt_ids
        self._results = results

    @property
    def version(self) -> int:
        return max((int(r.versions.max()) for r in self._results if len(r.versions)), default=-1)

    def load_state(self, named_tensors: NamedTensors, version: int) -> None:
        raise AssertionError("a precomputed engine holds no weights")

    update_weights = load_state

    def generate(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        assert len(requests) == len(self._results), "run_group asked for another number of samples"
        for request in requests:
            assert list(request.input_ids) == self._prompt_ids, "run_group tokenized the prompt differently"
        return self._results

    def abort(self) -> None:
        pass


def prompt_token_ids(prompt: Prompt, tokenizer: Tokenizer) -> list[int]:
    """The ids `run_group` feeds the engine for a prompt (text with special tokens, or the given ids)."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    assert prompt.text is not None
    encoded = tokenizer.encode(prompt.text, add_special_tokens=True)
    return list(getattr(encoded, "ids", encoded))


# ---- the generator -------------------------------------------------------------------------------------


@dataclass
class _Held:
    """One prompt of the running batch."""

    lease: PromptLease
    prompt: Prompt


class Generator:
    """One generator: the batch loop of the module docstring. Build with `Generator.connect` or by hand (tests)."""

    def __init__(
        self,
        cfg: LeewayConfig,
        *,
        engine: Engine,
        tokenizer: Any,
        task: Task,
        queue: Any,
        publisher: Any,
        weights: WeightSync,
        metrics: GeneratorMetrics,
        generator_id: str,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.task = task
        self.queue = queue
        self.publisher = publisher
        self.weights = weights
        self.metrics = metrics
        self.generator_id = generator_id
        self.sampling = sampling_params(cfg, tokenizer)
        self.environment = task_environment(task)
        self._stop = asyncio.Event()
        self._publishing: set[asyncio.Task[None]] = set()

    def request_stop(self) -> None:
        """Stop taking prompts; the running batch finishes within `SHUTDOWN_GRACE_S` or is aborted."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def run(self) -> None:
        """The batch loop, until `request_stop`. Waits for version 0 first (a trainer may not exist yet)."""
        waiting = asyncio.create_task(self.weights.ensure(0, on_wait=self._log_waiting))
        if not await self._until_stop(waiting):
            return
        log.info("generator %s: serving version %d", self.generator_id, self.weights.engine_version)
        while not self.stopping:
            try:
                leases = await self.queue.take(self.cfg.generator.concurrency, timeout_s=TAKE_TIMEOUT_S)
            except asyncio.TimeoutError:  # nats-py can raise a bare one from a fetch that found nothing
                continue
            except Exception:  # NATS away: the connection reconnects on its own; try again shortly
                log.warning("taking prompts failed; retrying in %.1f s", TAKE_RETRY_S, exc_info=True)
                await asyncio.sleep(TAKE_RETRY_S)
                continue
            if not leases:
                continue
            if self.stopping:
                await _release(leases)
                break
            await self._wait_for_publishing(MAX_BATCHES_PUBLISHING - 1)
            await self.run_batch(leases, background_finish=True)
        await self._wait_for_publishing(0)

    async def _wait_for_publishing(self, at_most: int) -> None:
        """Let earlier batches' publishing overlap the next generation, but never more than `at_most` of them."""
        while len(self._publishing) > at_most:
            await asyncio.wait(self._publishing, return_when=asyncio.FIRST_COMPLETED)

    def _log_waiting(self, waited_s: float) -> None:
        log.info(
            "generator %s: waiting for weights version %s of run %r (%.0f s so far; is a trainer running?)",
            self.generator_id,
            max(0, self.weights.newest_known),
            self.cfg.run.name,
            waited_s,
        )

    async def _until_stop(self, task: asyncio.Task[Any]) -> bool:
        """Await `task` unless stop comes first (then cancel it); True if it finished."""
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

    async def run_batch(self, leases: list[PromptLease], *, background_finish: bool = False) -> None:
        """One batch: sync weights to the staleness floor, roll out, then publish+ack or nak each prompt.

        With `background_finish` the publish+ack phase runs as a task (tracked in `_publishing`) so the
        engine starts the next batch meanwhile; prompts stay heartbeated until their group is acked.
        """
        held = [_Held(lease, task_prompt(lease.prompt)) for lease in leases]
        heartbeat = asyncio.create_task(self._heartbeat(leases))
        self.metrics.rollouts_in_flight += len(held)
        try:
            if not await self._sync_for(leases):
                await _release(leases)
                self._batch_done(heartbeat, len(held))
                return
            start_s = time.time()
            groups = await self._rollouts(held)
            end_s = time.time()
        except Exception:  # the batch boundary: nothing was acked, so every prompt goes back
            log.exception("batch of %d prompts failed; returning them to the queue", len(leases))
            await _release(leases)
            self._batch_done(heartbeat, len(held))
            return
        except BaseException:
            self._batch_done(heartbeat, len(held))
            raise
        finish = self._finish_batch(held, groups, start_s, end_s, heartbeat)
        if background_finish:
            task = asyncio.create_task(finish)
            self._publishing.add(task)
            task.add_done_callback(self._publishing.discard)
        else:
            await finish

    async def _finish_batch(
        self, held: list[_Held], groups: list[list[Sample]], start_s: float, end_s: float, heartbeat: Any
    ) -> None:
        try:
            outcomes = await asyncio.gather(
                *(self._finish(h, samples, start_s, end_s) for h, samples in zip(held, groups, strict=True)),
                return_exceptions=True,
            )
            failed = [h.lease for h, r in zip(held, outcomes, strict=True) if isinstance(r, BaseException)]
            for h, r in zip(held, outcomes, strict=True):
                if isinstance(r, BaseException):
                    log.error(
                        "group %s not published; its prompt goes back to the queue", h.prompt.prompt_id, exc_info=r
                    )
            await _release(failed)
        finally:
            self._batch_done(heartbeat, len(held))

    def _batch_done(self, heartbeat: Any, num_prompts: int) -> None:
        heartbeat.cancel()
        self.metrics.rollouts_in_flight = max(0, self.metrics.rollouts_in_flight - num_prompts)

    async def _sync_for(self, leases: list[PromptLease]) -> bool:
        """Bring the engine to the staleness floor of the batch; False if shutdown came first."""
        if self.cfg.generator.update_mode == "between_rollouts":
            await self.weights.catch_up()
        floor = sync_floor(
            self.weights.newest_known,
            self.cfg.staleness.max_staleness,
            [policy_version(lease.prompt) for lease in leases],
        )
        return await self._until_stop(asyncio.create_task(self.weights.ensure(floor)))

    async def _rollouts(self, held: list[_Held]) -> list[list[Sample]]:
        """All groups of the batch, under the abort watch (staleness cap, shutdown)."""
        start_version = self.weights.engine_version
        work = asyncio.create_task(self._generate(held))
        watch = asyncio.create_task(self._watch_abort(start_version))
        try:
            return await work
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    async def _watch_abort(self, start_version: int) -> None:
        """Abort the engine's running calls when the batch crosses the cap (abort_in_flight) or shutdown's
        grace runs out. Keeps aborting until cancelled, so a multi-turn episode cannot start a new turn."""
        shutdown_deadline: float | None = None
        aborting = False
        while True:
            now = time.monotonic()
            if self.stopping and shutdown_deadline is None:
                shutdown_deadline = now + SHUTDOWN_GRACE_S
                log.info(
                    "generator %s: stopping; the running batch has %.0f s to finish",
                    self.generator_id,
                    SHUTDOWN_GRACE_S,
                )
            if not aborting and shutdown_deadline is not None and now >= shutdown_deadline:
                log.warning("generator %s: aborting the running batch (shutdown)", self.generator_id)
                aborting = True
            cap = self.cfg.staleness
            if (
                not aborting
                and cap.abort_in_flight
                and crosses_cap(start_version, self.weights.newest_known, cap.max_staleness)
            ):
                log.info(
                    "generator %s: aborting the running batch: started at version %d, newest is %d (cap %d)",
                    self.generator_id,
                    start_version,
                    self.weights.newest_known,
                    cap.max_staleness,
                )
                aborting = True
            if aborting:
                self.engine.abort()
            await asyncio.sleep(ABORT_CHECK_S)

    async def _generate(self, held: list[_Held]) -> list[list[Sample]]:
        if self.environment is not None:
            return list(await asyncio.gather(*(self._multi_turn(h) for h in held)))
        return await self._single_turn(held)

    async def _single_turn(self, held: list[_Held]) -> list[list[Sample]]:
        """One engine call for concurrency x group_size requests; then each group is scored by `run_group`."""
        group_size = self.cfg.advantages.group_size
        prompt_ids = [prompt_token_ids(h.prompt, self.tokenizer) for h in held]
        requests = [
            GenerateRequest(ids, request_id=f"{h.prompt.prompt_id}-{i}")
            for h, ids in zip(held, prompt_ids, strict=True)
            for i in range(group_size)
        ]
        results = await self._engine_generate(requests)
        return list(
            await asyncio.gather(
                *(
                    run_group(
                        _Precomputed(ids, results[k * group_size : (k + 1) * group_size]),
                        self.task,
                        h.prompt,
                        group_size,
                        self.sampling,
                        tokenizer=self.tokenizer,
                        verifier_timeout_s=self.cfg.generator.verifier_timeout_s,
                        group_id=h.prompt.prompt_id,
                    )
                    for k, (h, ids) in enumerate(zip(held, prompt_ids, strict=True))
                )
            )
        )

    async def _engine_generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        self.metrics.generate_started()
        num_tokens = 0
        try:
            results = await asyncio.to_thread(self.engine.generate, requests, self.sampling)
            num_tokens = sum(len(r.token_ids) for r in results)
            return results
        finally:
            self.metrics.generate_finished(num_tokens)

    async def _multi_turn(self, h: _Held) -> list[Sample]:
        assert self.environment is not None
        return await run_group(
            _MeteredEngine(self.engine, self.metrics),
            self.task,
            h.prompt,
            self.cfg.advantages.group_size,
            self.sampling,
            self.environment,
            tokenizer=self.tokenizer,
            verifier_timeout_s=self.cfg.generator.verifier_timeout_s,
            group_id=h.prompt.prompt_id,
        )

    async def _finish(self, h: _Held, samples: list[Sample], start_s: float, end_s: float) -> None:
        """Publish the group, then ack its prompt; an aborted group is never published and its prompt nak'ed."""
        if any(s.status == "aborted" for s in samples):
            self.metrics.group_aborted()
            await _release([h.lease])
            return
        group = to_trajectory_group(
            samples,
            group_id=h.prompt.prompt_id,
            prompt_id=h.prompt.prompt_id,
            generator_id=self.generator_id,
            gen_start_s=start_s,
            gen_end_s=end_s,
        )
        await self.publisher.publish(group)
        self.metrics.group_published(
            group.versions,
            group.loss_mask,
            group.num_samples,
            max(self.weights.newest_known, self.weights.engine_version),
        )
        try:
            await h.lease.done()
        except Exception:  # the group is stored; a redelivered prompt republishes the same id (deduped)
            log.warning(
                "ack of prompt %s not confirmed; it may be redelivered (its group id dedupes it)",
                h.prompt.prompt_id,
                exc_info=True,
            )

    async def _heartbeat(self, leases: list[PromptLease]) -> None:
        """`in_progress` on every held prompt each `generator.heartbeat_s` (a background loop we own)."""
        while True:
            await asyncio.sleep(self.cfg.generator.heartbeat_s)
            for lease in leases:
                try:
                    await lease.in_progress()
                except Exception:
                    log.warning("heartbeat of prompt %s failed", lease.prompt.prompt_id, exc_info=True)

    async def report_metrics(self, nc: Any, subject: str) -> None:
        """Publish a metrics report every `REPORT_INTERVAL_S` (core NATS, fire-and-forget) until cancelled."""
        count = 0
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            record = self.metrics.report(version=self.weights.engine_version, newest_known=self.weights.newest_known)
            try:
                await nc.publish(subject, orjson.dumps(record))
            except Exception:
                log.warning("publishing generator metrics failed", exc_info=True)
            count += 1
            if count % LOG_EVERY_REPORTS == 0:
                log.info(format_report(record))


class _MeteredEngine(Engine):
    """Counts busy time and tokens of multi-turn generate calls (which `run_group` makes itself)."""

    def __init__(self, engine: Engine, metrics: GeneratorMetrics) -> None:
        self._engine = engine
        self._metrics = metrics

    @property
    def version(self) -> int:
        return self._engine.version

    def load_state(self, named_tensors: NamedTensors, version: int) -> None:
        self._engine.load_state(named_tensors, version)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        self._engine.update_weights(named_tensors, version)

    def generate(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        self._metrics.generate_started()
        num_tokens = 0
        try:
            results = self._engine.generate(requests, params)
            num_tokens = sum(len(r.token_ids) for r in results)
            return results
        finally:
            self._metrics.generate_finished(num_tokens)

    def abort(self) -> None:
        self._engine.abort()


async def _release(leases: Sequence[PromptLease]) -> None:
    """Nak prompts so another generator takes them at once; a failed nak just means ack-wait redelivery."""
    for lease in leases:
        try:
            await lease.release()
        except Exception:
            log.warning(
                "nak of prompt %s failed; it comes back after the ack wait", lease.prompt.prompt_id, exc_info=True
            )


# ---- the process ---------------------------------------------------------------------------------------


class GeneratorRuntime:
    """A `Generator` wired to the run's servers, with its background loops (weight sync, metrics).

    ``async with GeneratorRuntime.open(cfg) as rt: await rt.generator.run()``; leaving the block stops
    the loops, drains NATS and closes the store. Tests reach `generator`, `weights` and `engine` here.
    """

    def __init__(self) -> None:
        self.generator: Generator
        self.weights: WeightSync
        self.engine: Engine
        self._nc: Any = None
        self._store: Any = None
        self._subscriber: Any = None
        self._background: list[asyncio.Task[Any]] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, cfg: LeewayConfig, *, generator_id: str | None = None, engine: Engine | None = None
    ) -> AsyncIterator[GeneratorRuntime]:
        rt = cls()
        try:
            await rt._start(cfg, generator_id or default_generator_id(cfg), engine)
            yield rt
        finally:
            await rt._close()

    async def _start(self, cfg: LeewayConfig, generator_id: str, engine: Engine | None) -> None:
        from actors.endpoints import connect_nats, open_run_store, resolve_endpoints
        from pipeline.announce import generator_metrics_subject, version_kv, watch_announcements
        from pipeline.prompt_queue import PromptQueue, ensure_prompt_queue
        from pipeline.tasks import get_task
        from pipeline.transport import TrajectoryPublisher, ensure_trajectory_streams
        from storage.weights import WeightSubscriber

        names = RunNames.for_run(cfg.run.name)
        endpoints = resolve_endpoints(cfg)
        self._store = open_run_store(cfg, endpoints)
        task = get_task(cfg.task.name, **cfg.task.args)
        tokenizer = load_tokenizer(cfg, task)
        self.engine = engine or build_engine(cfg, tokenizer, generator_id)
        self._nc = await connect_nats(cfg, endpoints, name=f"leeway-generator-{generator_id}")
        self._subscriber = WeightSubscriber(self._store, cfg.run.name, parallelism=cfg.weights.parallelism)
        js = self._nc.jetstream()
        await ensure_trajectory_streams(js, names, cfg.stream)
        await ensure_prompt_queue(js, names, cfg.stream)
        kv = await version_kv(js, names) if cfg.weights.announce else None
        metrics = GeneratorMetrics(generator_id)
        self.weights = WeightSync(
            StoreWeightSource(self._subscriber),
            self.engine,
            metrics,
            poll_interval_s=cfg.generator.poll_interval_s,
            update_mode=cfg.generator.update_mode,
            announcements=None if kv is None else lambda: watch_announcements(kv),
        )
        self.generator = Generator(
            cfg,
            engine=self.engine,
            tokenizer=tokenizer,
            task=task,
            queue=PromptQueue(js, names, cfg.stream),
            publisher=TrajectoryPublisher(js, names, cfg.stream, self._store),
            weights=self.weights,
            metrics=metrics,
            generator_id=generator_id,
        )
        self._background = [
            asyncio.create_task(self.weights.run()),
            asyncio.create_task(self.generator.report_metrics(self._nc, generator_metrics_subject(names))),
        ]

    async def _close(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self.generator.queue.close()
            with contextlib.suppress(Exception):
                await self._nc.drain()
        if self._subscriber is not None:
            await asyncio.to_thread(self._subscriber.close)
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()


async def serve(
    cfg: LeewayConfig,
    *,
    generator_id: str | None = None,
    stop: asyncio.Event | None = None,
    engine: Engine | None = None,
) -> None:
    """Connect to the run's servers and run one generator until `stop` is set."""
    async with GeneratorRuntime.open(cfg, generator_id=generator_id, engine=engine) as rt:
        watcher = asyncio.create_task(_stop_when(stop, rt.generator)) if stop is not None else None
        try:
            await rt.generator.run()
        finally:
            if watcher is not None:
                watcher.cancel()
        log.info("generator %s: stopped", rt.generator.generator_id)


async def _stop_when(stop: asyncio.Event, generator: Generator) -> None:
    await stop.wait()
    generator.request_stop()


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    """`leeway generator CONFIG`: one generator until SIGINT/SIGTERM; returns 0 after a clean shutdown."""
    import torch

    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.engine.torch_threads)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop=stop)

    asyncio.run(run())
    return 0
