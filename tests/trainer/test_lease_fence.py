"""The run lease fences: a trainer cut off from NATS past its lease's time to live stops writing before a second
trainer can take over; the second trains; `--resume` afterwards loads only checkpoints of holders that still held
the lease when they wrote them (a checkpoint committed after its writer's lease passed on is skipped)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import orjson
import pytest
import torch

from actors.models import build_policy_model, load_tokenizer
from actors.servers import open_run_store, resolve_servers
from actors.trainer.backends import build_backend
from actors.trainer.backends.base import LossFn, StepResult, TrainBatch, TrainingBackend
from actors.trainer.checkpoints import (
    MANIFEST_FILE,
    SUPERSEDED_FILE,
    TrainerState,
    checkpoint_prefix,
    committed_attempts,
    load_latest_checkpoint,
    resumable_checkpoints,
    write_checkpoint,
)
from actors.trainer.lease_epochs import begin_epoch
from actors.trainer.loop import Trainer
from actors.trainer.run_lease import LeasedSession, LeaseKeeper
from actors.trainer.session_protocol import RunLink
from actors.trainer.sessions import build_weight_publisher
from infra.stack import StackState
from pipeline.config import LeewayConfig
from pipeline.tasks import get_task
from pipeline.wire.lease import LeaseLost
from storage.filestore import FileStore
from storage.manifest import Manifest, manifest_key
from storage.objectstore import ObjectStore
from tests.support.builders import make_group, metrics_records, publish_groups, trainer_cfg
from tests.support.fakes import WrappedBackend
from tests.support.stores import WRITE_METHODS, FaultyStore
from tests.support.waits import until

LEASE = ("trainer.lease_ttl_s=4", "trainer.lease_heartbeat_s=0.2")
"""Short enough for a test; the fence (2.1 s after the last renewal) leaves a loaded machine room to renew."""
EVENT_DEADLINE_S = 120.0
"""Upper bound on waiting for an event that must happen."""


# ---- a checkpoint committed after the lease passed on is never resumed (store only) ---------------------------


def _checkpoint(store: ObjectStore, run: str, version: int, holder: dict[str, object]) -> None:
    state = TrainerState(step=version, version=version, consumed_seq=version)
    tensors = {"model/w": torch.full((2, 3), float(version))}
    write_checkpoint(store, run, state, tensors, {"backend": "fake"}, holder=holder)


def test_a_checkpoint_its_writer_committed_after_losing_the_lease_is_skipped_and_the_newest_valid_one_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, run = FileStore(tmp_path / "store"), "fence"
    a = begin_epoch(store, run, {"holder": "A", "host": "a", "pid": 1}, committed_attempts(store, run))
    _checkpoint(store, run, 3, a)  # A holds the lease: valid
    b = begin_epoch(store, run, {"holder": "B", "host": "b", "pid": 2}, committed_attempts(store, run))
    _checkpoint(store, run, 5, a)  # A, cut off, wrote on after B's takeover: the newest, and superseded
    with caplog.at_level(logging.WARNING, logger="actors.trainer.checkpoints"):
        loaded = load_latest_checkpoint(store, run)
    assert loaded is not None and loaded[0].version == 3  # B resumes from A's checkpoint of before the takeover
    assert any("v5" in m and "'a'" in m and "had lost the lease" in m for m in caplog.messages)
    assert store.exists(checkpoint_prefix(run, 5) + SUPERSEDED_FILE)  # set aside: never tried again
    _checkpoint(store, run, 6, b)  # B trains on and checkpoints
    c = begin_epoch(store, run, {"holder": "C", "host": "c", "pid": 3}, committed_attempts(store, run))
    assert c["epoch"] == 3 and resumable_checkpoints(store, run) == [3, 6]  # an ordinary restart loses nothing
    loaded = load_latest_checkpoint(store, run)
    assert loaded is not None and loaded[0].version == 6


# ---- the partition: A cut off from NATS, B takes over, a resume loads B's -------------------------------------


class _FreezingProxy:
    """A loopback TCP proxy to `upstream`; `freeze()` stops forwarding bytes both ways (the connections stay open:
    a partition, not a disconnect) and `thaw()` forwards what waited."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.flowing = threading.Event()
        self.flowing.set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="freezing-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def freeze(self) -> None:
        self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.listener.close()
        self.thaw()
        for s in self.sockets:
            s.close()


class _Gated(WrappedBackend):
    """The real backend; its step number `gated_step` waits for `gate` (the partition happens meanwhile)."""

    def __init__(self, inner: TrainingBackend, gated_step: int) -> None:
        self.inner, self.gated_step, self.steps = inner, gated_step, 0
        self.entered, self.gate = threading.Event(), threading.Event()

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, num_minibatches: int = 1) -> StepResult:
        self.steps += 1
        if self.steps == self.gated_step:
            self.entered.set()
            self.gate.wait(EVENT_DEADLINE_S)
        return self.inner.train_step(batch, loss_fn, num_minibatches=num_minibatches)


class _WriteLog(FaultyStore):
    """The real store; remembers (monotonic time, method, key) of every write that reached it."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner, lambda method, key: None)
        self.writes: list[tuple[float, str, str]] = []

    def _check(self, method: str, key: str) -> None:
        if method in WRITE_METHODS or method == "delete":
            self.writes.append((time.monotonic(), method, key))


async def _leased_trainer(
    cfg: LeewayConfig,
    *,
    resume: bool,
    wrap_backend: Callable[[TrainingBackend], TrainingBackend] | None = None,
    wrap_store: Callable[[ObjectStore], ObjectStore] | None = None,
) -> tuple[Trainer, float]:
    """`open_trainer`'s live path (lease, fenced store, `LeasedSession`) with the backend and store wrapped; also
    returns when (monotonic) the lease was taken: its create or takeover was sent no earlier."""
    stop = asyncio.Event()
    task = get_task(cfg.task.name, **cfg.task.args)
    model = build_policy_model(cfg, load_tokenizer(cfg, task))
    backend = build_backend(cfg, model)
    if wrap_backend is not None:
        backend = wrap_backend(backend)
    link = await RunLink.open(cfg)
    if wrap_store is not None:
        link = dataclasses.replace(link, store=wrap_store(link.store))
    lease = await LeaseKeeper.take(cfg, link.js, link.names, on_lost=stop.set)
    assert lease.lease.renewed_at is not None
    taken_at = lease.lease.renewed_at  # read before the keeper's first beat runs
    link = lease.fenced(link)
    publisher = build_weight_publisher(cfg, link.store, model)
    session = await LeasedSession.open(cfg, link, backend, publisher, task, resume=resume)
    assert isinstance(session, LeasedSession)
    session.lease = lease
    return Trainer(cfg, backend, session, stop=stop), taken_at


def _through(cfg: LeewayConfig, port: int) -> LeewayConfig:
    url = urlsplit(resolve_servers(cfg).nats_url)
    netloc = url.netloc.rsplit(":", 1)[0] + f":{port}"
    return cfg.model_copy(update={"nats": cfg.nats.model_copy(update={"url": urlunsplit(url._replace(netloc=netloc))})})


def test_a_trainer_cut_off_from_nats_stops_writing_before_a_second_takes_over_and_a_resume_loads_only_the_second(
    stack: StackState, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = trainer_cfg(
        stack, tmp_path, "trainer.max_steps=3", "trainer.checkpoint_every=1", "staleness.max_staleness=8", *LEASE
    )
    groups = [f"g{i}" for i in range(6)]
    asyncio.run(publish_groups(cfg, [make_group(g) for g in groups]))
    upstream = urlsplit(resolve_servers(cfg).nats_url)
    proxy = _FreezingProxy((upstream.hostname or "127.0.0.1", upstream.port or 4222))
    gated: list[_Gated] = []
    a_store: list[_WriteLog] = []

    def gate(backend: TrainingBackend) -> TrainingBackend:
        gated.append(_Gated(backend, gated_step=2))
        return gated[0]

    def log_writes(store: ObjectStore) -> ObjectStore:
        a_store.append(_WriteLog(store))
        return a_store[0]

    async def scenario() -> None:
        a, _ = await _leased_trainer(_through(cfg, proxy.port), resume=False, wrap_backend=gate, wrap_store=log_writes)
        a_running = asyncio.create_task(a.run())
        await until(lambda: gated[0].entered.is_set() or a_running.done(), what="A in its second step", timeout_s=60)
        assert not a_running.done()
        proxy.freeze()  # A is cut off from NATS (the store it still reaches)
        b, b_took_at = await asyncio.wait_for(_leased_trainer(cfg, resume=True), EVENT_DEADLINE_S)
        assert await asyncio.wait_for(b.run(), EVENT_DEADLINE_S) == 0  # B trains the rest of the run
        keeper = a.session.lease  # type: ignore[attr-defined]
        assert keeper.past_fence()  # A fenced itself on its own clock
        a_fence_at = keeper.lease.renewed_at + keeper.fence_s
        assert a_fence_at < b_took_at  # ... before B could take over
        released_at = time.monotonic()
        gated[0].gate.set()  # A's step ends while it is still cut off: it must write nothing of it
        await until(
            lambda: (
                any(w[0] >= released_at for w in a_store[0].writes)
                or any("trainer failed at step" in m for m in caplog.messages)
            ),
            what="A to write or to give up its step",
            timeout_s=60,
        )
        late = [w for w in a_store[0].writes if w[0] >= a_fence_at]
        assert not late, f"A wrote after its fence: {late}"
        assert a_store[0].writes and max(w[0] for w in a_store[0].writes) < b_took_at
        proxy.thaw()
        with pytest.raises(LeaseLost, match="lease was last renewed"):  # A stops naming the lease (exit status 1)
            await asyncio.wait_for(a_running, EVENT_DEADLINE_S)

        c, _ = await _leased_trainer(cfg, resume=True)  # `--resume` afterwards
        assert await asyncio.wait_for(c.run(), EVENT_DEADLINE_S) == 0
        assert c.state.step == 3  # B's last checkpoint: nothing trained since
        b_token = b.session.holder  # type: ignore[attr-defined]
        store = open_run_store(cfg)
        newest = resumable_checkpoints(store, cfg.run.name)[-1]
        manifest = orjson.loads(store.get(checkpoint_prefix(cfg.run.name, newest) + MANIFEST_FILE))
        assert manifest["holder"]["holder"] == b_token["holder"] and manifest["holder"]["epoch"] == 2
        weights = Manifest.from_json(store.get(manifest_key(cfg.run.name, 2)), key="v2")
        assert weights.holder is not None and weights.holder["holder"] == b_token["holder"]

    with caplog.at_level(logging.INFO):
        try:
            asyncio.run(scenario())
        finally:
            proxy.close()
    trained = [g for r in metrics_records(cfg.run.run_dir / "metrics.jsonl") for g in r["trained_group_ids"]]
    assert sorted(trained) == groups  # every group trained, none twice (A's cut-off step never committed)
