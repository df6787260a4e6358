"""The generator end to end against the real NATS and S3 (the `stack` fixture), with a test-side fake trainer.

The fake trainer uses the real pieces a trainer uses: `WeightPublisher` + the KV announcement for weights,
the prompt work queue for admission (prompts tagged with `policy_version`), and the trainer's durable
consumer to read groups. Each test has its own run name, so streams, buckets and prefixes never mix.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import orjson
import pytest
import torch

from actors.generator.engines.base import GenerateRequest, GenerateResult, SamplingParams
from actors.generator.engines.torch_engine import TorchEngine, sampling_logprobs
from actors.generator.metrics import GeneratorMetrics, metered, metered_submit
from actors.generator.runtime import GeneratorRuntime, sampling_params
from actors.models import build_model
from pipeline.config import LeewayConfig
from pipeline.rl.staleness import crosses_cap, sync_floor
from pipeline.tasks import Prompt
from pipeline.tasks.char_tokenizer import PAD_ID
from pipeline.wire.announce import generator_metrics_subject
from pipeline.wire.prompt_queue import PromptLease, PromptQueue, queue_prompt
from pipeline.wire.trajectory import TrajectoryGroup, validate_group
from tests.support.builders import REPO
from tests.support.generators import (
    MODEL,
    TOKENIZER,
    WAIT_S,
    FakeTrainer,
    generator_cfg,
    running_generator,
    unique_run,
)
from tests.support.waits import until

# ---- pure pieces --------------------------------------------------------------------------------------


def test_staleness_floor_follows_the_newest_known_and_the_admission_version() -> None:
    assert sync_floor(newest_known=7, max_staleness=2, policy_versions=[3, 8]) == 6
    assert sync_floor(newest_known=5, max_staleness=0, policy_versions=[5]) == 5
    assert sync_floor(newest_known=-1, max_staleness=2, policy_versions=[-1]) == 0
    assert crosses_cap(start_version=3, newest_known=6, max_staleness=2)
    assert not crosses_cap(start_version=4, newest_known=6, max_staleness=2)


def test_prompts_keep_answer_tags_and_admission_version_across_the_queue() -> None:
    prompt = Prompt("reverse-1", text="123>", answer="321", tags=("reverse",), metadata={"difficulty": 2})
    assert prompt.policy_version == -1  # a task's prompt sets no sync floor until the trainer admits it
    back = Prompt.from_json(queue_prompt(prompt, policy_version=7).to_json())
    assert (back.prompt_id, back.text, back.answer, back.tags) == ("reverse-1", "123>", "321", ("reverse",))
    assert back.metadata == {"difficulty": 2} and back.policy_version == 7


def test_idle_fraction_counts_wall_time_without_a_running_generate() -> None:
    now = [0.0]
    metrics = GeneratorMetrics("g", clock=lambda: now[0])
    now[0] = 1.0
    metrics.generate_started()
    now[0] = 4.0
    metrics.generate_finished(num_tokens=300)
    report = metrics.report(version=3, newest_known=4)
    assert report["idle_fraction"] == pytest.approx(0.25) and report["tokens_per_s"] == pytest.approx(75.0)
    now[0] = 6.0  # a window with nothing running
    assert metrics.report(version=3, newest_known=4)["idle_fraction"] == pytest.approx(1.0)


def test_metered_generate_counts_tokens_and_ends_busy_time_even_when_the_engine_fails() -> None:
    now = [0.0]
    metrics = GeneratorMetrics("g", clock=lambda: now[0])

    def generate(requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        now[0] += 2.0
        if not requests:
            raise RuntimeError("engine died")
        ids = np.arange(5, dtype=np.int32)
        return [GenerateResult(ids, np.zeros(5, np.float32), np.zeros(5, np.int32), "stop") for _ in requests]

    counted = metered(generate, metrics)
    assert len(counted([GenerateRequest([1]), GenerateRequest([2])], SamplingParams(max_new_tokens=5))) == 2
    with pytest.raises(RuntimeError, match="engine died"):
        counted([], SamplingParams(max_new_tokens=5))
    now[0] = 8.0
    report = metrics.report(version=0, newest_known=0)
    assert metrics.tokens_generated == 10 and report["idle_fraction"] == pytest.approx(0.5)


def test_metered_submit_keeps_the_engine_busy_until_the_last_request_of_a_call_finishes() -> None:
    """Streaming: results arrive one by one; the call counts as busy (and its tokens count) until the last."""
    now = [0.0]
    metrics = GeneratorMetrics("g", clock=lambda: now[0])
    futures: list[Future[GenerateResult]] = []

    def submit(requests: Sequence[GenerateRequest], params: SamplingParams) -> list[Future[GenerateResult]]:
        futures.extend(Future() for _ in requests)
        return list(futures)

    counted = metered_submit(submit, metrics)
    pending = counted([GenerateRequest([1]), GenerateRequest([2])], SamplingParams(max_new_tokens=5))
    ids = np.arange(3, dtype=np.int32)
    now[0] = 1.0
    pending[0].set_result(GenerateResult(ids, np.zeros(3, np.float32), np.zeros(3, np.int32), "stop"))
    assert metrics.tokens_generated == 0  # the call is still running
    now[0] = 3.0
    pending[1].set_result(GenerateResult(ids[:2], np.zeros(2, np.float32), np.zeros(2, np.int32), "length"))
    now[0] = 6.0
    report = metrics.report(version=0, newest_known=0)
    assert metrics.tokens_generated == 5 and report["idle_fraction"] == pytest.approx(0.5)


def _loss_versions(group: TrajectoryGroup, sample: int) -> np.ndarray:
    s = group.token_slice(sample)
    return group.versions[s][group.loss_mask[s].astype(bool)]


# ---- end to end ---------------------------------------------------------------------------------------


def test_a_generator_started_before_the_trainer_waits_for_version_0_then_publishes_valid_groups(stack) -> None:
    cfg = generator_cfg(stack, unique_run())

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer, running_generator(cfg, "early") as rt:
            reports: list[dict[str, Any]] = []

            async def on_report(msg: Any) -> None:
                reports.append(orjson.loads(msg.data))

            await trainer.nc.subscribe(generator_metrics_subject(trainer.names), cb=on_report)
            prompt_ids = await trainer.admit(3, policy_version=0)
            admitted_at_s = time.time()
            # the generator's next report, made after the prompts were queued: running, nothing taken
            await until(lambda: any(r["time_s"] > admitted_at_s for r in reports), what="a report after the admission")
            report = next(r for r in reports if r["time_s"] > admitted_at_s)
            assert (report["version"], report["newest_known_version"], report["rollouts_in_flight"]) == (-1, -1, 0)
            info = await trainer.prompt_consumer()
            assert (info.num_pending, info.num_ack_pending) == (3, 0), "a prompt was taken before version 0"
            assert rt.weights.engine_version == -1 and await trainer.stored_groups() == 0
            await trainer.publish(0)
            groups = await trainer.groups(3)
            assert sorted(g.group_id for g in groups) == sorted(prompt_ids)
            for group in groups:
                validate_group(group)
                assert group.prompt_id == group.group_id and group.generator_id == "early"
                assert group.num_samples == cfg.advantages.group_size
                assert set(group.status) <= {"ok", "truncated", "format_error"}
                assert set(group.reward_source) == {"verifier"} and not np.isnan(group.reward).any()
                assert all((_loss_versions(group, i) == 0).all() for i in range(group.num_samples))
            await until(
                lambda: bool(reports) and reports[-1]["groups_published"] == 3,
                what="a report of 3 groups published",
                timeout_s=10,
            )
            report = reports[-1]
            assert report["generator_id"] == "early" and report["version"] == 0 and report["weight_pulls"] == 1
            assert report["tokens_generated"] > 0 and 0.0 <= report["idle_fraction_total"] <= 1.0
            await until(lambda: rt.generator.metrics.groups_published == 3, what="3 groups published")
            info = await trainer.js.consumer_info(trainer.names.prompt_stream, trainer.names.generator_consumer)
            assert info.num_pending == 0

    asyncio.run(main())


class _HoldAtStep:
    """An `on_decode_step` hook: holds the first generate call at decode step `step` until released,
    then slows the remaining steps so an in-flight pull lands mid-sequence."""

    def __init__(self, step: int = 3, slow_s: float = 0.03) -> None:
        self.step, self.slow_s = step, slow_s
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, step: int) -> None:
        if step == self.step and not self.reached.is_set():
            self.reached.set()
            self.release.wait(WAIT_S)
        elif self.reached.is_set() and step > self.step:
            time.sleep(self.slow_s)


class _AbortNotingEngine(TorchEngine):
    """The real engine, noting (`aborted`) when the generator tells it to abort."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aborted = threading.Event()

    def abort(self, request_ids: Collection[str] | None = None) -> None:
        super().abort(request_ids)
        self.aborted.set()


def _engine(hook: _HoldAtStep) -> _AbortNotingEngine:
    model = build_model(MODEL, vocab_size=TOKENIZER.get_vocab_size(), seed=123, dtype=torch.float32)
    return _AbortNotingEngine(model, pad_token_id=PAD_ID, seed=7, version=-1, on_decode_step=hook)


def _reference_logprobs(
    trainer: FakeTrainer, cfg: LeewayConfig, tokens: np.ndarray, loss_mask: np.ndarray, versions: np.ndarray
) -> np.ndarray:
    """Behaviour log-probs recomputed outside the engine: the old version's weights up to the swap, then the
    new version's on top of the KV cache the old weights computed (the engine keeps its cache)."""
    params = sampling_params(cfg, TOKENIZER)
    start = int(np.flatnonzero(loss_mask)[0])
    models = {}
    for v in set(versions[start:].tolist()):
        models[v] = build_model(MODEL, vocab_size=TOKENIZER.get_vocab_size(), seed=0, dtype=torch.float32)
        models[v].load_state_dict(trainer.versions[v])
    ids = torch.as_tensor(np.array(tokens), dtype=torch.long)[None]
    kwarg = "cache" if "cache" in inspect.signature(models[versions[-1]].forward).parameters else "past_key_values"
    generated = versions[start:]
    out = np.zeros(len(generated), np.float32)
    cache = None
    position = 0  # tokens [0, position) are in the cache
    with torch.no_grad():
        for v in sorted(set(generated.tolist())):
            rows = np.flatnonzero(generated == v)
            first, last = int(rows[0]), int(rows[-1])
            # logits of generated token i come from the forward of input position start + i - 1
            upto = start + last
            result = models[v](input_ids=ids[:, position:upto], use_cache=True, **{kwarg: cache})
            logits = result.logits[0, start + first - 1 - position : upto - position]
            cache, position = getattr(result, kwarg), upto
            chosen = torch.as_tensor(np.array(tokens[start + first : start + last + 1]), dtype=torch.long)[:, None]
            out[first : last + 1] = sampling_logprobs(logits, params).gather(-1, chosen)[:, 0].numpy()
    return out


def test_a_version_published_mid_generation_switches_versions_inside_sequences_with_exact_logprobs(stack) -> None:
    cfg = generator_cfg(stack, unique_run(), "engine.sampling.max_new_tokens=40")
    hook = _HoldAtStep()

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer, running_generator(cfg, "in-flight", _engine(hook)) as rt:
            await trainer.admit(2, policy_version=0)
            await trainer.publish(0)
            assert await asyncio.to_thread(hook.reached.wait, WAIT_S)
            await trainer.publish(1)
            await until(lambda: rt.weights.newest_known >= 1, what="version 1 known")
            hook.release.set()
            groups = await trainer.groups(2)
            switched = 0
            for group in groups:
                for i in range(group.num_samples):
                    s = group.token_slice(i)
                    versions = _loss_versions(group, i)
                    assert (np.diff(versions) >= 0).all() and set(versions.tolist()) <= {0, 1}
                    switched += int(versions[0] == 0 and versions[-1] == 1)
                    loss = group.loss_mask[s].astype(bool)
                    expected = _reference_logprobs(trainer, cfg, group.tokens[s], group.loss_mask[s], group.versions[s])
                    np.testing.assert_allclose(group.logprobs[s][loss], expected, atol=2e-4)
            assert switched >= 1, "no sequence spans the weight swap"
            assert rt.weights.engine_version == 1

    asyncio.run(main())


def test_abort_in_flight_naks_a_batch_that_crosses_the_cap_and_redoes_it_with_fresh_weights(stack) -> None:
    cfg = generator_cfg(
        stack,
        unique_run(),
        "engine.sampling.max_new_tokens=40",
        "staleness.max_staleness=0",
        "staleness.abort_in_flight=true",
    )
    hook = _HoldAtStep()

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer, running_generator(cfg, "aborter", _engine(hook)) as rt:
            prompt_ids = await trainer.admit(2, policy_version=0)
            await trainer.publish(0)
            assert await asyncio.to_thread(hook.reached.wait, WAIT_S)
            await trainer.publish(1)
            await until(lambda: rt.weights.newest_known >= 1, what="version 1 known")
            hook.release.set()
            groups = await trainer.groups(2)
            assert sorted(g.group_id for g in groups) == sorted(prompt_ids)
            for group in groups:
                assert all((_loss_versions(group, i) == 1).all() for i in range(group.num_samples))
                assert "aborted" not in group.status
            assert rt.generator.metrics.groups_aborted == 2
            assert await trainer.stored_groups() == 2

    asyncio.run(main())


def test_a_late_generator_catches_up_through_the_delta_chain_and_syncs_past_the_cap_before_a_rollout(stack) -> None:
    cfg = generator_cfg(
        stack, unique_run(), "weights.announce=false", "generator.poll_interval_s=60", "staleness.max_staleness=1"
    )

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer:
            for version in range(4):
                await trainer.publish(version, announce=False)
            async with running_generator(cfg, "late") as rt:
                await until(lambda: rt.weights.engine_version == 3, what="the engine at version 3")
                first = rt.weights.last_pull
                assert first is not None and first.full  # newest snapshot (v0) + the deltas after it
                for version in range(4, 7):
                    await trainer.publish(version, announce=False)
                assert rt.weights.newest_known == 3  # polls every 60 s, no doorbell: it cannot know yet
                await trainer.admit(2, policy_version=6)
                groups = await trainer.groups(2)
                second = rt.weights.last_pull
                assert second is not None and second.version == 6 and not second.full
                assert second.num_bytes < first.num_bytes
                for group in groups:
                    assert all((_loss_versions(group, i) >= 5).all() for i in range(group.num_samples))
                assert rt.generator.metrics.versions_behind_at_pull.max == 4

    asyncio.run(main())


async def _take_until(
    queue: PromptQueue, wanted: Callable[[PromptLease], bool], proc: subprocess.Popen[bytes]
) -> list[PromptLease]:
    """Take prompts (as a generator would, never heartbeating them) until one is `wanted`; all of them."""
    taken: list[PromptLease] = []

    async def took_it() -> bool:
        assert proc.poll() is None, f"the victim exited with {proc.returncode}"
        taken.extend(await queue.take(max_prompts=2, timeout_s=0.5))
        return any(wanted(lease) for lease in taken)

    await until(took_it, what="a wanted prompt", detail=lambda: f"{len(taken)} taken", poll_s=0)
    return taken


PROCESS_START_S = 180.0
"""Generous bound on a generator process starting (torch imported, engine built) and taking a prompt: seconds
on an idle machine, over a minute on 2 cores busy with other test runs; the wait ends when it happens."""


def test_a_generator_killed_mid_rollout_leaves_its_prompt_to_another_and_no_partial_group(stack, tmp_path) -> None:
    cfg = generator_cfg(
        stack, unique_run(), "stream.prompt_ack_wait_s=2", "generator.heartbeat_s=0.3", "generator.concurrency=1"
    )
    config_path = tmp_path / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    argv = [
        sys.executable,
        "-m",
        "actors.cli",
        "generator",
        str(config_path),
        "--set",
        "generator.id=victim",
        "--set",
        "task.name=tests.support.tasks:slow_reverse_digits",
        "--set",
        "generator.heartbeat_s=0.3",
        "--set",
        "generator.verifier_timeout_s=300",
    ]
    log_path = tmp_path / "victim.log"

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer:
            await trainer.publish(0)
            (prompt_id,) = await trainer.admit(1, policy_version=0)
            with open(log_path, "wb") as log:
                victim = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            try:

                async def victim_holds_the_prompt() -> bool:
                    assert victim.poll() is None, "the victim exited:\n" + log_path.read_text()[-3000:]
                    return (await trainer.prompt_consumer()).num_ack_pending == 1

                await until(
                    victim_holds_the_prompt,
                    what="the victim generator to take the prompt",
                    timeout_s=PROCESS_START_S,
                    detail=lambda: log_path.read_text()[-3000:],
                    poll_s=0.1,
                )
                # a probe taken after the victim's prompt and never heartbeated: when the queue hands it out
                # again, its ack wait ran out, and so did the victim's prompt's, which only heartbeats held
                (probe_id,) = await trainer.admit(1, policy_version=0)
                first = await _take_until(trainer.queue, lambda lease: True, victim)
                assert [lease.prompt.prompt_id for lease in first] == [probe_id]
                again = await _take_until(trainer.queue, lambda lease: lease.prompt.prompt_id == probe_id, victim)
                assert [(lease.prompt.prompt_id, lease.num_delivered) for lease in again] == [(probe_id, 2)], (
                    "the victim's prompt was handed out again while its generator heartbeated it"
                )
                assert (await trainer.prompt_consumer()).num_ack_pending == 2  # the victim's and the probe
                await again[0].done()
                assert await trainer.stored_groups() == 0
            finally:
                victim.kill()
                victim.wait()
            async with running_generator(cfg, "rescuer"):
                (group,) = await trainer.groups(1)
            assert group.group_id == prompt_id and group.generator_id == "rescuer"
            assert group.num_samples == cfg.advantages.group_size
            assert await trainer.stored_groups() == 1

    asyncio.run(main())


def test_shutdown_aborts_a_batch_that_outlives_the_grace_and_hands_its_prompts_to_another_generator(stack) -> None:
    cfg = generator_cfg(stack, unique_run(), "engine.sampling.max_new_tokens=40")
    hook = _HoldAtStep()

    async def main() -> None:
        async with FakeTrainer(cfg) as trainer:
            prompt_ids = await trainer.admit(2, policy_version=0)
            await trainer.publish(0)
            engine = _engine(hook)
            async with GeneratorRuntime.open(cfg, generator_id="stopping", engine=engine) as rt:
                rt.generator.shutdown_grace_s = 0.3
                run = asyncio.create_task(rt.generator.run())
                assert await asyncio.to_thread(hook.reached.wait, WAIT_S)
                rt.generator.request_stop()
                # past the grace the running batch is aborted: release the held decode step only then
                assert await asyncio.to_thread(engine.aborted.wait, WAIT_S), "the engine was never told to abort"
                hook.release.set()
                await asyncio.wait_for(run, timeout=WAIT_S)
                assert rt.generator.metrics.groups_aborted == 2 and await trainer.stored_groups() == 0
            async with running_generator(cfg, "second"):
                groups = await trainer.groups(2)
            assert sorted(g.group_id for g in groups) == sorted(prompt_ids)
            assert {g.generator_id for g in groups} == {"second"}

    asyncio.run(main())
