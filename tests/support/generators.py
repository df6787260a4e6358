"""The generator tests' harness: a run's config, a test-side trainer made of the real pieces a trainer uses,
and a generator running in-process.

`FakeTrainer` publishes versions with a real `WeightPublisher` (random perturbations of one tiny model) and
the KV announcement, admits prompts through the prompt work queue (tagged with `policy_version`) and reads
groups through the trainer's durable consumer. Each test takes a run name of its own (`unique_run`), so
streams, buckets and prefixes never mix.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

from actors.generator.runtime import GeneratorRuntime
from actors.models import build_model
from actors.servers import connect_nats, open_run_store
from pipeline.config import LeewayConfig, load_config
from pipeline.tasks.char_tokenizer import load_char_tokenizer
from pipeline.tasks.reverse import ReverseDigitsTask
from pipeline.wire.announce import announce_version, version_kv
from pipeline.wire.consumer import TrajectoryConsumer, ensure_trainer_consumer
from pipeline.wire.names import RunNames
from pipeline.wire.prompt_queue import PromptQueue, ensure_prompt_queue, queue_prompt
from pipeline.wire.prompts import Prompt
from pipeline.wire.trajectories import ensure_trajectory_streams
from pipeline.wire.trajectory import TrajectoryGroup
from storage.weights import WeightPublisher
from tests.support.waits import until

TOKENIZER = load_char_tokenizer()
MODEL = "tiny-llama-2x64"
WAIT_S = 30.0
"""Upper bound on waiting for one event of a generator test (a group, a pull); waits end when it happens."""


def generator_cfg(stack: Any, run: str, *sets: str) -> LeewayConfig:
    """Run `run` on the session stack: tiny-llama-2x64, groups of 4, reverse 4 digits, 12 new tokens."""
    return load_config(
        None,
        [
            f"run.name={run}",
            f"run.dir={stack.dir}/runs/{run}",  # the endpoint's generated key file lands here, not in the checkout
            f"nats.stack_dir={stack.dir}",
            f"store.url=s3://{stack.bucket}/test-generator",
            f"model.name_or_path={MODEL}",
            "model.dtype=float32",
            "advantages.group_size=4",
            "generator.concurrency=2",
            "generator.poll_interval_s=0.5",
            "engine.sampling.max_new_tokens=12",
            "task.args={num_digits: 4}",
            "stream.max_bytes=16777216",  # JetStream reserves max_bytes per stream: keep the session stack roomy
            *sets,
        ],
        environ={},
    )


def unique_run() -> str:
    return f"gen-{uuid.uuid4().hex[:10]}"


class FakeTrainer:
    """Publishes versions (random perturbations of one tiny model), admits prompts, reads groups."""

    def __init__(
        self, cfg: LeewayConfig, *, tokenizer: Any = TOKENIZER, prompts: Iterator[Prompt] | None = None
    ) -> None:
        self.cfg = cfg
        self.names = RunNames.for_run(cfg.run.name)
        self.model = build_model(MODEL, vocab_size=tokenizer.get_vocab_size(), seed=0, dtype=torch.float32)
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.store = open_run_store(cfg)
        self.publisher = WeightPublisher(
            self.store, cfg.run.name, model_config_hash="test", dtype=torch.float32, full_every=50
        )
        self.prompts = prompts or ReverseDigitsTask(num_digits=4, seed=int(uuid.uuid4().int % 10_000)).prompts()

    async def __aenter__(self) -> FakeTrainer:
        self.nc = await connect_nats(self.cfg, name="test-fake-trainer")
        js = self.nc.jetstream()
        await ensure_trajectory_streams(js, self.names, self.cfg.stream)
        await ensure_trainer_consumer(js, self.names)
        await ensure_prompt_queue(js, self.names, self.cfg.stream)
        self.js = js
        self.queue = PromptQueue(js, self.names, self.cfg.stream)
        self.consumer = await TrajectoryConsumer.bind(js, self.names, self.cfg.stream, self.store)
        self.kv = await version_kv(js, self.names)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.close()
        await self.nc.drain()
        self.publisher.close()

    async def publish(self, version: int, *, announce: bool = True) -> None:
        if version > 0:
            with torch.no_grad():
                generator = torch.Generator().manual_seed(version)
                for name, param in self.model.named_parameters():
                    if name.endswith(("lm_head.weight", "q_proj.weight")):
                        param.add_(torch.randn(param.shape, generator=generator) * 0.3)
        tensors = {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        self.versions[version] = tensors
        await asyncio.to_thread(self.publisher.publish, version, tensors)
        if announce:
            await announce_version(self.kv, version)

    async def admit(self, count: int, policy_version: int) -> list[str]:
        prompts = [next(self.prompts) for _ in range(count)]
        for p in prompts:
            await self.queue.admit(queue_prompt(p, policy_version))
        return [p.prompt_id for p in prompts]

    async def groups(self, count: int, timeout_s: float = WAIT_S) -> list[TrajectoryGroup]:
        out: list[TrajectoryGroup] = []

        async def fetched_all() -> bool:
            try:
                deliveries = await self.consumer.fetch(count - len(out), timeout_s=0.5)
            except asyncio.TimeoutError:  # nats-py may raise a bare one that transport does not catch
                return False
            out.extend(d.group for d in deliveries)
            await self.consumer.ack([d.seq for d in deliveries])
            return len(out) == count

        await until(
            fetched_all, what=f"{count} groups", timeout_s=timeout_s, detail=lambda: f"got {len(out)}", poll_s=0
        )
        return out

    async def stored_groups(self) -> int:
        return (await self.js.stream_info(self.names.trajectory_stream)).state.messages

    async def prompt_consumer(self) -> Any:
        """The generators' prompt consumer's info (pending, ack pending, redelivered)."""
        return await self.js.consumer_info(self.names.prompt_stream, self.names.generator_consumer)


@contextlib.asynccontextmanager
async def running_generator(cfg: LeewayConfig, generator_id: str, engine: Any = None) -> AsyncIterator[Any]:
    """A `GeneratorRuntime` with its loop running; stopped (and awaited) on exit."""
    async with GeneratorRuntime.open(cfg, generator_id=generator_id, engine=engine) as rt:
        task = asyncio.create_task(rt.generator.run())
        try:
            yield rt
        finally:
            rt.generator.request_stop()
            await asyncio.wait_for(task, timeout=WAIT_S)
