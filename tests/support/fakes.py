"""Fakes of the loops' collaborators, for tests that run in milliseconds without servers. Each implements one
protocol of the code under test exactly (no private attribute of anything is touched), and notes what it is
asked in `events`, in order, so a test can assert on the order of calls across collaborators.

- `FakeWeightSource` (`actors.generator.weight_sync.WeightSource`) and `FakeEngine` (`Engine`) for `WeightSync`;
- `FakeSession` (`actors.trainer.sessions.Session`) for the trainer loop (`Trainer`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.generator.engines.base import (
    Engine,
    GenerateRequest,
    GenerateResult,
    NamedTensors,
    SamplingParams,
    WeightsRefused,
)
from actors.generator.weight_sync import Pulled
from actors.trainer.admission import admission_count
from actors.trainer.backends import LossFn, StepResult, TrainBatch, TrainingBackend
from actors.trainer.checkpoints import RecentIds, TrainerState
from actors.trainer.generator_reports import GeneratorReports
from actors.trainer.slots import DeadLetterEntry
from pipeline.config import LeewayConfig
from pipeline.rl.batching import ModelLimits
from pipeline.wire.consumer import Delivery
from pipeline.wire.trajectory import TrajectoryGroup

Event = tuple[Any, ...]

# ---- weight sync ---------------------------------------------------------------------------------------------


def version_tensors(version: int) -> dict[str, torch.Tensor]:
    """The weights of `version` in a `FakeWeightSource`: one tensor holding the version number."""
    return {"w": torch.full((2,), float(version))}


class FakeWeightSource:
    """A `WeightSource` over the versions a test publishes (`publish`), each `version_tensors(version)`.

    `latest()` is the newest published version; `pull(version)` fails like the store for a version it does not
    have, raises `ConnectionError` for the next `fail_pulls[version]` pulls of that version, and is a full
    snapshot for the first pull, a delta after. Notes `("published", v)` and `("pull", v)` in `events`.
    """

    def __init__(self, events: list[Event] | None = None) -> None:
        self.events: list[Event] = events if events is not None else []
        self.published: list[int] = []
        self.fail_pulls: dict[int, int] = {}
        self.latest_reads = 0
        self._held: int | None = None
        self._lock = threading.Lock()  # pulls run in worker threads

    def publish(self, version: int) -> None:
        with self._lock:
            assert not self.published or version > self.published[-1], "versions only move forward"
            self.published.append(version)
            self.events.append(("published", version))

    def latest(self) -> int | None:
        with self._lock:
            self.latest_reads += 1
            return self.published[-1] if self.published else None

    def pull(self, version: int) -> Pulled:
        with self._lock:
            self.events.append(("pull", version))
            if version not in self.published:
                raise ValueError(f"version {version} is not in the store (published: {self.published})")
            if self.fail_pulls.get(version, 0) > 0:
                self.fail_pulls[version] -= 1
                raise ConnectionError(f"store unreachable pulling version {version}")
            full = self._held is None
            self._held = version
            tensors = version_tensors(version)
            return Pulled(version=version, tensors=tensors, num_bytes=8 if full else 4, full=full)

    def forget(self) -> None:
        with self._lock:
            self.events.append(("forget",))
            self._held = None


class FakeEngine(Engine):
    """An `Engine` that holds named tensors and a version, notes `("load_state", v)` and `("update_weights", v)`
    in `events` as it applies them, and generates nothing."""

    def __init__(self, events: list[Event] | None = None) -> None:
        self.events: list[Event] = events if events is not None else []
        self.tensors: dict[str, torch.Tensor] = {}
        self.aborts = 0
        self.refuse: set[int] = set()
        """Versions whose next update is refused once (as an engine whose workers got other bytes refuses)."""
        self._version = -1
        self._applied = threading.Condition()

    @property
    def version(self) -> int:
        return self._version

    def _apply(self, what: str, named_tensors: NamedTensors, version: int) -> None:
        if version in self.refuse:
            self.refuse.discard(version)
            self.events.append(("refused", version))
            raise WeightsRefused(version, "tensor 'w' fails its hash", applied=False)
        with self._applied:
            self.events.append((what, version))
            self.tensors.update({name: t.clone() for name, t in named_tensors.items()})
            self._version = version
            self._applied.notify_all()

    def load_state(self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None = None) -> None:
        self._apply("load_state", named_tensors, version)

    def update_weights(
        self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None = None
    ) -> None:
        self._apply("update_weights", named_tensors, version)

    def generate(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        raise NotImplementedError("FakeEngine holds weights only; it generates nothing")

    def abort(self, request_ids: Collection[str] | None = None) -> None:
        self.aborts += 1

    def wait_for_version(self, version: int, timeout_s: float) -> bool:
        """Block (a worker thread) until the engine holds `version` or newer; False after `timeout_s`."""
        with self._applied:
            return self._applied.wait_for(lambda: self._version >= version, timeout=timeout_s)


# ---- trainer session -----------------------------------------------------------------------------------------

PROMPT_TASK_ID = "t"
"""Admitted prompt ids are `t.<i>`, as `PromptFeed` names the i-th prompt of a task (`slots.py` reads them)."""
MAX_EMPTY_FETCHES = 100
"""A `FakeSession` whose test queued too little fails after this many empty fetches in a row instead of
letting the loop spin until `trainer.queue_wait_timeout_s`."""


class FakeSession:
    """A `Session` without servers: the groups a test queues (`deliver`, `redeliver`, or `on_admit` answering
    admitted prompts), the live session's admission rule over prompt ids `t.<i>`, and every call in `events`.
    `on_fetch(deliveries)` sees what each fetch returns (a test's hook into the moment the loop waits).

    `fetch` hands out up to `per_fetch` queued deliveries at once (all asked for when None) and returns at
    once; `ends=True` makes it a replay that is `exhausted` once nothing is queued. Versions are the
    trainer's own, as in a live session; `publish` moves `state.version` on.
    """

    def __init__(
        self,
        cfg: LeewayConfig,
        metrics_path: Path,
        *,
        on_admit: Callable[[list[str]], None] | None = None,
        on_fetch: Callable[[list[Delivery]], None] | None = None,
        per_fetch: int | None = None,
        ends: bool = False,
    ) -> None:
        self.cfg = cfg
        self.metrics_path = metrics_path
        self.eval_path: Path | None = None
        self.staleness_cap: int | None = cfg.staleness.max_staleness
        self.generator_reports = GeneratorReports()
        self.events: list[Event] = []
        self.queued: deque[Delivery] = deque()
        self.admitted_ids: list[str] = []
        self.dead_letters: list[DeadLetterEntry] = []
        """Returned once by the next `new_dead_letters`."""
        self.on_admit = on_admit
        self.on_fetch = on_fetch
        self.per_fetch = per_fetch
        self.ends = ends
        self._last_seq = 0
        self._empty_fetches = 0

    # ---- what the test queues

    def deliver(self, group: TrajectoryGroup) -> Delivery:
        """Queue `group` as the next message of the stream (a new sequence)."""
        self._last_seq += 1
        delivery = Delivery(group=group, seq=self._last_seq, msg=None)
        self.queued.append(delivery)
        return delivery

    def redeliver(self, delivery: Delivery) -> Delivery:
        """Queue `delivery` again, as the consumer redelivers an unacked message (same sequence)."""
        again = Delivery(group=delivery.group, seq=delivery.seq, msg=None, num_delivered=delivery.num_delivered + 1)
        self.queued.append(again)
        return again

    # ---- the Session protocol

    async def start(self) -> TrainerState:
        self.events.append(("start",))
        return TrainerState()

    def cap_version(self, group: TrajectoryGroup, trainer_version: int) -> int:
        return trainer_version

    def current_version(self, trainer_version: int) -> int:
        return trainer_version

    async def admit(self, state: TrainerState, pending_dropped: int = 0) -> None:
        """`LiveSession.admit`'s rule; the prompts go to `admitted_ids` (and `on_admit`) instead of a queue."""
        count = admission_count(self.cfg, state, pending_dropped)
        if count <= 0:
            return
        ids = [f"{PROMPT_TASK_ID}.{i}" for i in range(state.admitted, state.admitted + count)]
        state.admitted += count
        self.admitted_ids += ids
        self.events.append(("admit", ids))
        if self.on_admit is not None:
            self.on_admit(ids)

    async def new_dead_letters(self, state: TrainerState) -> list[DeadLetterEntry]:
        entries, self.dead_letters = self.dead_letters, []
        return entries

    async def fetch(self, max_groups: int, timeout_s: float) -> list[Delivery]:
        limit = max_groups if self.per_fetch is None else min(max_groups, self.per_fetch)
        out = [self.queued.popleft() for _ in range(min(limit, len(self.queued)))]
        self.events.append(("fetch", [(d.group.group_id, d.seq) for d in out]))
        self._empty_fetches = 0 if out or self.ends else self._empty_fetches + 1
        assert self._empty_fetches < MAX_EMPTY_FETCHES, f"the test queued too few groups: {self.events[-8:]}"
        if self.on_fetch is not None:
            self.on_fetch(out)
        return out

    async def refuse(self, delivery: Delivery, reason: str, detail: str) -> None:
        self.events.append(("refuse", delivery.group.group_id, delivery.seq, reason))

    @property
    def exhausted(self) -> bool:
        return self.ends and not self.queued

    async def keep_alive(self) -> None:
        self.events.append(("keep_alive",))

    async def publish(self, state: TrainerState) -> None:
        state.version += 1
        self.events.append(("publish", state.version))

    async def ack(self, seqs: Sequence[int]) -> None:
        self.events.append(("ack", list(seqs)))

    async def give_back(self) -> None:
        self.events.append(("give_back",))

    async def queue_depth(self) -> int | None:
        return len(self.queued)

    async def checkpoint(self, state: TrainerState, handled: RecentIds, *, final: bool) -> None:
        self.events.append(("checkpoint", state.step, final))

    def forged_counts(self) -> dict[str, int]:
        return {}

    async def close(self) -> None:
        self.events.append(("close",))

    # ---- reading the events

    def acked(self) -> list[int]:
        """Every sequence acked so far, in order."""
        return [seq for event in self.events if event[0] == "ack" for seq in event[1]]

    def of_kind(self, kind: str) -> list[Event]:
        return [event for event in self.events if event[0] == kind]


def event_index(events: Iterable[Event], predicate: Callable[[Event], bool]) -> int:
    """The position of the first event matching `predicate` (fails, listing the events, when none does)."""
    events = list(events)
    for i, event in enumerate(events):
        if predicate(event):
            return i
    raise AssertionError(f"no such event in {events}")


class WrappedBackend(TrainingBackend):
    """A real backend behind every method, for a test to override the one it watches or breaks."""

    def __init__(self, inner: TrainingBackend) -> None:
        self.inner = inner

    def logprobs(self, batch: TrainBatch) -> list[np.ndarray]:
        return self.inner.logprobs(batch)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, num_minibatches: int = 1) -> StepResult:
        return self.inner.train_step(batch, loss_fn, num_minibatches=num_minibatches)

    def export_weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return self.inner.export_weights(dtype)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.inner.state_tensors()

    def state_meta(self) -> dict[str, Any]:
        return self.inner.state_meta()

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        self.inner.load_state(tensors, meta)

    def model_limits(self) -> ModelLimits:
        return self.inner.model_limits()
