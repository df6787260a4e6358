"""`leeway bench transport`: trajectory groups through the Arrow codec, against orjson, and through JetStream.

    make_groups ─► encode_group / decode_group            (arrow_*_mbps, arrow_bytes_per_token)
               ─► orjson.dumps / loads of the same lists  (orjson_*_mbps, json_bytes_per_token)
               ─► TrajectoryPublisher ─► nats-server (loopback, file store) ─► TrajectoryConsumer (decode, ack)
                                                          (jetstream_groups_per_s, jetstream_mbps)

Every `*_mbps` counts the same raw bytes: 13 per token (int32 id, uint8 mask, float32 log-prob, int32
version), so the ratios compare work done, not bytes moved. `jetstream_wire_mbps` counts message bytes.
The workload: token ids uniform over a 151,936-token vocabulary (the worst case for compression),
log-probs mostly near 0 (70% of tokens confident, -Exp(0.02); the rest -Exp(1.5)), a 256-1,024-token
prompt, and one or two policy-version changes inside each completion.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import numpy as np
import orjson

from infra import nats_server
from pipeline.wire.codec import decode_group, encode_group
from pipeline.wire.trajectory import Sample, TrajectoryGroup

VOCAB_SIZE = 151_936
RAW_BYTES_PER_TOKEN = 13
CONFIDENT_FRACTION = 0.7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per sample (prompt + completion)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per group (one group = one message)")
    parser.add_argument("--groups", type=int, default=32, help="distinct groups generated for the codec runs")
    parser.add_argument("--repeats", type=int, default=5, help="codec passes over all groups; the median is kept")
    parser.add_argument("--jetstream-groups", type=int, default=512, help="groups sent through JetStream")
    parser.add_argument("--nats-url", default=None, help="use this server instead of starting nats-server locally")
    parser.add_argument("--seed", type=int, default=0)


# --- workload ---------------------------------------------------------------------------------------------------


def _sample(rng: np.random.Generator, num_tokens: int, base_version: int) -> Sample:
    prompt = int(rng.integers(min(256, num_tokens // 4), max(min(1024, num_tokens // 2), 2)))
    gen = num_tokens - prompt
    mask = np.r_[np.zeros(prompt, np.uint8), np.ones(gen, np.uint8)]
    scale = np.where(rng.random(gen) < CONFIDENT_FRACTION, 0.02, 1.5)
    logprobs = np.r_[np.zeros(prompt), -rng.exponential(scale)].astype(np.float32)
    versions = np.r_[np.full(prompt, -1), np.full(gen, base_version)].astype(np.int32)
    for cut in sorted(rng.integers(prompt, num_tokens, int(rng.integers(1, 3)))):
        versions[cut:] += 1
    return Sample(
        tokens=rng.integers(0, VOCAB_SIZE, num_tokens).astype(np.int32),
        loss_mask=mask,
        logprobs=logprobs,
        versions=versions,
        reward=float(rng.random() < 0.5),
        reward_source="verifier",
        status="ok",
        finish_reason="stop",
        tags=("bench",),
        gen_start_s=time.time() - 10,
        gen_end_s=time.time(),
    )


def make_groups(num_groups: int, group_size: int, num_tokens: int, seed: int = 0) -> list[TrajectoryGroup]:
    """The bench workload (see the module docstring); deterministic for a seed."""
    rng = np.random.default_rng(seed)
    return [
        TrajectoryGroup.from_samples(
            group_id=f"bench-{seed}-{i}",
            prompt_id=f"p-{i}",
            generator_id="bench",
            samples=[_sample(rng, num_tokens, 10 + i // 4) for _ in range(group_size)],
        )
        for i in range(num_groups)
    ]


def as_json_lists(group: TrajectoryGroup) -> dict:
    """The same group the way a JSON pipeline carries it: one object per sample with Python lists."""
    samples = []
    for i in range(group.num_samples):
        s = group.sample(i)
        samples.append(
            {
                "trajectory_id": s.trajectory_id,
                "tokens": s.tokens.tolist(),
                "loss_mask": s.loss_mask.tolist(),
                "logprobs": s.logprobs.tolist(),
                "versions": s.versions.tolist(),
                "min_version": int(group.min_version[i]),
                "max_version": int(group.max_version[i]),
                "reward": s.reward,
                "reward_source": s.reward_source,
                "status": s.status,
                "finish_reason": s.finish_reason,
                "tags": list(s.tags),
                "gen_start_s": s.gen_start_s,
                "gen_end_s": s.gen_end_s,
            }
        )
    return {
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "generator_id": group.generator_id,
        "samples": samples,
    }


def _median_seconds(fn, items: list, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for item in items:
            fn(item)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def codec_stats(groups: list[TrajectoryGroup], repeats: int) -> dict[str, float]:
    tokens = sum(g.num_tokens for g in groups)
    raw_mb = tokens * RAW_BYTES_PER_TOKEN / 1e6
    encoded = [encode_group(g) for g in groups]
    lists = [as_json_lists(g) for g in groups]
    dumped = [orjson.dumps(x) for x in lists]
    out = {
        "arrow_encode_mbps": raw_mb / _median_seconds(encode_group, groups, repeats),
        "arrow_decode_mbps": raw_mb / _median_seconds(lambda b: decode_group(b, validate=False), encoded, repeats),
        "arrow_decode_validated_mbps": raw_mb / _median_seconds(decode_group, encoded, repeats),
        "orjson_dumps_mbps": raw_mb / _median_seconds(orjson.dumps, lists, max(1, repeats // 2)),
        "orjson_loads_mbps": raw_mb / _median_seconds(orjson.loads, dumped, max(1, repeats // 2)),
        "orjson_loads_to_numpy_mbps": raw_mb / _median_seconds(_orjson_to_numpy, dumped, max(1, repeats // 2)),
        "arrow_bytes_per_token": sum(map(len, encoded)) / tokens,
        "json_bytes_per_token": sum(map(len, dumped)) / tokens,
    }
    out["decode_speedup_vs_orjson"] = out["arrow_decode_mbps"] / out["orjson_loads_mbps"]
    out["decode_speedup_vs_orjson_to_numpy"] = out["arrow_decode_mbps"] / out["orjson_loads_to_numpy_mbps"]
    return out


def _orjson_to_numpy(data: bytes) -> None:
    """What a trainer fed JSON has to do before it can use a group: parse, then build arrays."""
    for s in orjson.loads(data)["samples"]:
        np.asarray(s["tokens"], np.int32), np.asarray(s["loss_mask"], np.uint8)
        np.asarray(s["logprobs"], np.float32), np.asarray(s["versions"], np.int32)


# --- JetStream end to end ------------------------------------------------------------------------------------------


async def jetstream_stats(url: str, groups: list[TrajectoryGroup], num_groups: int) -> dict[str, float]:
    """Publish `num_groups` (acked) while a durable consumer decodes, validates and acks them; wall time of both."""
    from pipeline.config import StreamConfig
    from pipeline.wire.consumer import TrajectoryConsumer, ensure_trainer_consumer
    from pipeline.wire.jetstream import connect
    from pipeline.wire.names import RunNames
    from pipeline.wire.trajectories import TrajectoryPublisher, ensure_trajectory_streams

    names = RunNames.for_run(f"bench-{int(time.time() * 1000)}")
    stream = StreamConfig(max_bytes=4 * 1024**3)
    pub_nc, sub_nc = await connect(url, name="bench-pub"), await connect(url, name="bench-sub")
    try:
        js_pub, js_sub = pub_nc.jetstream(timeout=10), sub_nc.jetstream(timeout=10)
        await ensure_trajectory_streams(js_pub, names, stream)
        await ensure_trainer_consumer(js_pub, names)
        consumer = await TrajectoryConsumer.bind(js_sub, names, stream)
        publisher = TrajectoryPublisher(js_pub, names, stream)
        to_send = [
            dataclasses.replace(
                groups[i % len(groups)],
                group_id=f"{names.run}-{i}",
                trajectory_ids=tuple(f"{names.run}-{i}:{j}" for j in range(groups[i % len(groups)].num_samples)),
            )
            for i in range(num_groups)
        ]
        tokens = sum(g.num_tokens for g in to_send)
        received = 0
        wire = 0

        async def consume() -> None:
            nonlocal received, wire
            while received < num_groups:
                batch = await consumer.fetch(timeout_s=5.0)
                if not batch:
                    raise RuntimeError(f"consumer stalled after {received} of {num_groups} groups")
                wire += sum(len(d.msg.data) for d in batch)
                received += len(batch)
                await consumer.ack([d.seq for d in batch])

        start = time.perf_counter()
        await asyncio.gather(publisher.publish_many(to_send), consume())
        elapsed = time.perf_counter() - start
        await js_pub.delete_stream(names.trajectory_stream)
        await js_pub.delete_stream(names.dead_letter_stream)
    finally:
        await pub_nc.close()
        await sub_nc.close()
    return {
        "jetstream_groups_per_s": num_groups / elapsed,
        "jetstream_mbps": tokens * RAW_BYTES_PER_TOKEN / 1e6 / elapsed,
        "jetstream_wire_mbps": wire / 1e6 / elapsed,
        "jetstream_groups": num_groups,
    }


def run(args: argparse.Namespace) -> dict:
    groups = make_groups(args.groups, args.group_size, args.tokens, args.seed)
    result: dict = {"tokens_per_sample": args.tokens, "group_size": args.group_size, "groups": args.groups}
    result.update(codec_stats(groups, args.repeats))
    if args.nats_url:
        result.update(asyncio.run(jetstream_stats(args.nats_url, groups, args.jetstream_groups)))
    else:
        with nats_server.run() as server:
            result.update(asyncio.run(jetstream_stats(server.url, groups, args.jetstream_groups)))
    result["targets"] = {
        "decode_speedup_vs_orjson>=20": result["decode_speedup_vs_orjson"] >= 20,
        "arrow_bytes_per_token<=7": result["arrow_bytes_per_token"] <= 7,
        "jetstream_mbps>=200": result["jetstream_mbps"] >= 200,
    }
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
