"""Builders of the trainer tests: the char-tokenizer groups a tiny-llama trainer trains on, the config of a run
on the session stack, and the ways a test runs a trainer (in-process, or `leeway trainer` as a process).

`wire_group` is the transport tests' group instead: random ids of a large vocabulary, sized by `num_tokens`.
A trainer group is two samples of `PROMPT` plus four generated tokens; its rewards decide whether it trains
(`(1.0, 0.0)`: they disagree) or is filtered (`(1.0, 1.0)`), its `version` where the staleness cap puts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import uuid
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson

from actors.models import build_policy_model, load_tokenizer
from actors.servers import open_run_store, resolve_servers
from actors.trainer.backends import TrainingBackend, build_backend
from actors.trainer.loop import Trainer
from actors.trainer.runtime import open_trainer
from actors.trainer.session_protocol import RunLink
from actors.trainer.sessions import LiveSession, build_weight_publisher
from infra.stack import StackState
from pipeline.config import LeewayConfig, load_config
from pipeline.tasks import get_task
from pipeline.wire.jetstream import connect
from pipeline.wire.names import RunNames
from pipeline.wire.replay import ReplaySelection
from pipeline.wire.trajectories import TrajectoryPublisher, ensure_trajectory_streams
from pipeline.wire.trajectory import Sample, TrajectoryGroup
from storage.objectstore import ObjectStore

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 5, 6, 7, 8, 18]  # <bos> 1 2 3 4 >  (char tokenizer ids)
Backend = Literal["torch", "megatron"]
BACKENDS: tuple[Backend, ...] = ("torch", "megatron")
"""`trainer.backend` values; a test parametrized over them runs the same body on both."""
TRAINER_RUN_TIMEOUT_S = 60.0
"""Bound on an in-process trainer run of a few tiny steps (`run_trainer`); it ends as soon as the run does."""


def trainer_cfg(stack: StackState, tmp_path: Path, *overrides: str, backend: Backend = "torch") -> LeewayConfig:
    """A run of its own on the session stack: tiny-llama, 2 groups of 2 samples a step, 3 steps."""
    run = f"tr-{uuid.uuid4().hex[:10]}"
    base = [
        f"run.name={run}",
        f"run.dir={tmp_path / run}",
        f"nats.stack_dir={stack.dir}",
        "model.name_or_path=tiny-llama-1x32",
        "model.dtype=float32",
        "advantages.group_size=2",
        "trainer.batch_groups=2",
        "trainer.max_steps=3",
        "trainer.checkpoint_every=2",
        "trainer.lr=0.01",
        "trainer.queue_wait_timeout_s=60",
        "engine.sampling.max_new_tokens=4",
        "stream.max_bytes=8388608",
        "weights.grace_s=0",
        "logging.level=WARNING",
        "trainer.lease_ttl_s=3",  # a trainer SIGKILLed by a test leaves a lease the next one takes over: quickly
        "trainer.lease_heartbeat_s=0.5",
    ]
    return load_config(None, [*base, *overrides, f"trainer.backend={backend}"], environ={})


def make_sample(reward: float, version: int, seed: int) -> Sample:
    """`PROMPT` then 4 random generated tokens at `version`, with random behaviour log-probs."""
    rng = np.random.default_rng(seed)
    completion = rng.integers(4, 14, 4)
    n = len(PROMPT) + len(completion)
    mask = np.r_[np.zeros(len(PROMPT), np.uint8), np.ones(len(completion), np.uint8)]
    return Sample(
        tokens=np.r_[PROMPT, completion].astype(np.int32),
        loss_mask=mask,
        logprobs=np.where(mask == 1, -rng.uniform(2.0, 3.5, n), 0).astype(np.float32),
        versions=np.where(mask == 1, version, -1).astype(np.int32),
        reward=reward,
        reward_source="verifier",
        status="ok",
    )


def make_group(group_id: str, version: int = 0, rewards: Sequence[float] = (1.0, 0.0)) -> TrajectoryGroup:
    """One sample per reward, seeded by the group id (the same id gives the same tokens)."""
    seed = int.from_bytes(group_id.encode()[-6:], "little")
    samples = [make_sample(r, version, seed + i) for i, r in enumerate(rewards)]
    return TrajectoryGroup.from_samples(group_id=group_id, prompt_id=group_id, generator_id="test", samples=samples)


def wire_group(
    group_id: str, version: int = 3, num_samples: int = 2, num_tokens: int = 48, seed: str | None = None
) -> TrajectoryGroup:
    """A group for the wire (transport, claim checks): random tokens of a large vocabulary (8 of them prompt)
    and random log-probs, seeded by `seed` (default: the group id); `num_tokens` sets its encoded size."""
    rng = np.random.default_rng(zlib.crc32((seed or group_id).encode()))
    samples = []
    for _ in range(num_samples):
        mask = np.r_[np.zeros(8, np.uint8), np.ones(num_tokens - 8, np.uint8)]
        samples.append(
            Sample(
                tokens=rng.integers(0, 151_936, num_tokens).astype(np.int32),
                loss_mask=mask,
                logprobs=np.where(mask == 1, -rng.exponential(0.3, num_tokens), 0).astype(np.float32),
                versions=np.where(mask == 1, version, -1).astype(np.int32),
                reward=1.0,
                reward_source="verifier",
            )
        )
    return TrajectoryGroup.from_samples(group_id=group_id, prompt_id="p", generator_id="gen-0", samples=samples)


async def publish_groups(cfg: LeewayConfig, groups: Sequence[TrajectoryGroup]) -> None:
    """Publish `groups` to the run's trajectory stream, one by one: stream order is the order given. Groups over
    `stream.max_inline_bytes` go to the run's object store (claim checks), as a generator sends them."""
    names = RunNames.for_run(cfg.run.name)
    nc = await connect(resolve_servers(cfg).nats_url, name="test-publisher")
    store = open_run_store(cfg)
    try:
        js = nc.jetstream()
        await ensure_trajectory_streams(js, names, cfg.stream)
        publisher = TrajectoryPublisher(js, names, cfg.stream, store=store)
        for group in groups:
            await publisher.publish(group)
    finally:
        await nc.drain()
        store.close()


def metrics_records(path: Path) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl`, in order."""
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


async def run_trainer(
    cfg: LeewayConfig, replay: ReplaySelection | None = None, timeout_s: float = TRAINER_RUN_TIMEOUT_S
) -> Trainer:
    """`open_trainer` (live, or a replay of `replay`) run to its end."""
    trainer = await open_trainer(cfg, replay=replay)
    await asyncio.wait_for(trainer.run(), timeout=timeout_s)
    return trainer


async def live_trainer(
    cfg: LeewayConfig,
    *,
    wrap_backend: Callable[[TrainingBackend], TrainingBackend] | None = None,
    wrap_store: Callable[[ObjectStore], ObjectStore] | None = None,
    resume: bool = False,
) -> Trainer:
    """`open_trainer`'s live path (fresh, or `--resume` with `resume`), assembled from its public parts, with
    the backend wrapped by `wrap_backend` and the store (the weight publisher's and the checkpoints') wrapped by
    `wrap_store`."""
    task = get_task(cfg.task.name, **cfg.task.args)
    model = build_policy_model(cfg, load_tokenizer(cfg, task))
    backend = build_backend(cfg, model)
    if wrap_backend is not None:
        backend = wrap_backend(backend)
    link = await RunLink.open(cfg)
    store = link.store
    if wrap_store is not None:
        store = wrap_store(link.store)
        link = dataclasses.replace(link, store=store)
    publisher = build_weight_publisher(cfg, store, model)
    session = await LiveSession.open(cfg, link, backend, publisher, task, resume=resume)
    return Trainer(cfg, backend, session)


def spawn_trainer(config_path: Path, log_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`leeway trainer CONFIG EXTRA...` as a process of its own, its output appended to `log_path`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "actors.cli", "trainer", str(config_path), *extra],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
