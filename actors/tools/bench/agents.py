"""`leeway bench agents`: multi-turn episodes through the generator's endpoint against the same episodes driven
directly on the engine, in the same run.

    config (--config, --set: the agent demo by default)
      └─► build_engine (as a generator builds it), its own weights as version 0
            ├─► endpoint: `open_endpoint` on 127.0.0.1; --episodes concurrent episodes, each --turns chat turns
            │   through the real `openai.AsyncOpenAI` on a session of its own (bridged turns)
            │   from a harness process of its own (`agents_harness`), as a real harness runs
            └─► direct: the same episodes, the same seeds, each turn's ids (first render, then bridge) handed
                to `Engine.submit` without HTTP, JSON or the client

Each episode starts with a user message of random digits and, after every reply, appends the reply and a new
user message. Turn ``t`` of episode ``e`` samples with seed ``e * 1000 + t``, so both passes sample the same
ids (``same_ids``; ``differing_turns`` counts the turns that did not: the two passes batch the turns
differently, and where a turn's uniform falls within float32 rounding of a bucket edge of its distribution, a
different batch or a prefix reused in one pass and prefilled in the other can pick the neighbouring token;
about one turn in a thousand on the defaults); every turn samples exactly ``--max-tokens`` tokens (stop tokens off, ``ignore_eos``), so
both passes do the same work. Keys: ``episodes``, ``turns``, ``turns_per_s`` and ``tokens_per_s`` (endpoint; sampled
tokens), ``direct_turns_per_s``, ``endpoint_vs_direct`` (turns/s ratio), ``p50_turn_latency_ms`` and
``p99_turn_latency_ms`` (endpoint, request to response), ``generator_cpu_ms_per_turn`` and
``direct_cpu_ms_per_turn`` (the generator process's CPU time per turn through the endpoint and direct: their
difference is what serving costs the generator), ``harness_cpu_ms_per_turn`` (the client process's), ``retokenized_tokens`` (sampled ids the next turn's
``prompt_token_ids`` does not hold exactly at their place: drift, must be 0), and from the engine's prefix cache, where it has
one, ``prefix_hit_rate`` and ``prefill_tokens_with_reuse_vs_without`` (prefilled over prompt tokens of the
endpoint pass); null where the engine keeps no such counters.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import orjson

from actors.cli_args import add_set_argument, positive_int

if TYPE_CHECKING:
    from actors.generator.engines.base import Engine

DEFAULT_CONFIG = "configs/agent.yaml"
DEFAULT_EPISODES = 32
DEFAULT_TURNS = 6
DEFAULT_MAX_TOKENS = 8
"""Sampled tokens per turn: more than the agent demo's three, and six turns of it still fit the tiny presets'
128 positions; a larger model takes more (``--max-tokens``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="config the engine and endpoint are built from")
    parser.add_argument("--episodes", type=positive_int, default=DEFAULT_EPISODES, help="concurrent episodes")
    parser.add_argument("--turns", type=positive_int, default=DEFAULT_TURNS, help="chat turns per episode")
    parser.add_argument("--digits", type=positive_int, default=3, help="digits in each user message")
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=DEFAULT_MAX_TOKENS,
        help="tokens every turn samples; stop tokens are off (ignore_eos), so both passes do the same work",
    )
    parser.add_argument(
        "--engine",
        choices=("torch", "vllm"),
        default=None,
        help="the engine served (default: the config's engine.kind)",
    )
    add_set_argument(parser, help="config override, e.g. --set engine.max_slots=64 (repeatable)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pipeline.config import load_config

    overrides = [*args.overrides, *([f"engine.kind={args.engine}"] if args.engine else [])]
    cfg = load_config(args.config, overrides)
    torch.set_num_threads(cfg.engine.torch_threads)
    return asyncio.run(_bench(cfg, args.episodes, args.turns, args.digits, args.max_tokens))


async def _bench(cfg: Any, episodes: int, turns: int, digits: int, max_tokens: int) -> dict[str, Any]:
    from actors.generator.runtime import build_engine
    from actors.models import load_tokenizer
    from pipeline.tasks import task_for

    task = task_for(cfg)
    tokenizer = load_tokenizer(cfg, task)
    engine = build_engine(cfg, tokenizer, "bench-agents")
    try:
        return await _bench_engine(cfg, engine, task, tokenizer, episodes, turns, digits, max_tokens)
    finally:
        engine.close()


async def _bench_engine(
    cfg: Any, engine: Engine, task: Any, tokenizer: Any, episodes: int, turns: int, digits: int, max_tokens: int
) -> dict[str, Any]:
    from actors.generator.runtime import open_endpoint, sampling_params
    from actors.models import build_policy_model

    policy = build_policy_model(cfg, tokenizer)  # the seeded initialisation every engine of the run starts from
    engine.load_state({name: t.detach().contiguous() for name, t in policy.state_dict().items()}, 0)
    sampling = sampling_params(cfg, tokenizer)
    service, endpoint, api_key = await open_endpoint(cfg, engine, tokenizer, task, sampling)
    if service.template is None:
        raise SystemExit(f"{cfg.task.name}: no chat template for this model; set model.chat_template")
    scripts = [[_digits(e, t, digits) for t in range(turns)] for e in range(episodes)]
    try:
        await _direct(service, scripts, max_tokens)  # warm-up: both passes start with warm caches and threads
        stats_before = _prefix_counters(engine)
        cpu = time.process_time()
        harness = await _harness(
            {
                "url": endpoint.url,
                "api_key": api_key,
                "model": cfg.run.name,
                "scripts": scripts,
                "max_tokens": max_tokens,
            }
        )
        endpoint_cpu_s = time.process_time() - cpu
        endpoint_s = harness["elapsed_s"]
        latencies = harness["latencies_s"]
        stats_after = _prefix_counters(engine)
        drift = sum(_drift(run["prompts"], run["sampled"]) for run in harness["episodes"])
        endpoint_ids = [run["sampled"] for run in harness["episodes"]]
        started, cpu = time.perf_counter(), time.process_time()
        direct_ids = await _direct(service, scripts, max_tokens)
        direct_s, direct_cpu_s = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await endpoint.stop()
    total_turns = episodes * turns
    sampled = sum(len(ids) for episode in endpoint_ids for ids in episode)
    result: dict[str, Any] = {
        "episodes": episodes,
        "turns": turns,
        "turns_per_s": total_turns / endpoint_s,
        "tokens_per_s": sampled / endpoint_s,
        "direct_turns_per_s": total_turns / direct_s,
        "endpoint_vs_direct": direct_s / endpoint_s,
        "p50_turn_latency_ms": 1000 * statistics.median(latencies),
        "p99_turn_latency_ms": 1000 * statistics.quantiles(latencies, n=100)[98] if len(latencies) > 1 else None,
        "generator_cpu_ms_per_turn": 1000 * endpoint_cpu_s / total_turns,
        "direct_cpu_ms_per_turn": 1000 * direct_cpu_s / total_turns,
        "harness_cpu_ms_per_turn": 1000 * harness["cpu_s"] / total_turns,
        "retokenized_tokens": drift,
        "same_ids": endpoint_ids == direct_ids,
        "differing_turns": sum(
            a != b for ea, eb in zip(endpoint_ids, direct_ids, strict=True) for a, b in zip(ea, eb, strict=True)
        ),
        "prefix_hit_rate": None,
        "prefill_tokens_with_reuse_vs_without": None,
    }
    if stats_before is not None and stats_after is not None:
        delta = {k: stats_after[k] - stats_before[k] for k in stats_after}
        result["prefix_hit_rate"] = delta["prefix_hits"] / delta["prefix_lookups"] if delta["prefix_lookups"] else None
        result["prefill_tokens_with_reuse_vs_without"] = (
            delta["prefilled_tokens"] / delta["prompt_tokens"] if delta["prompt_tokens"] else None
        )
    return result


def _digits(episode: int, turn: int, digits: int) -> str:
    rng = random.Random(f"bench-agents-{episode}-{turn}")
    return "".join(rng.choice("0123456789") for _ in range(digits)) + ">"


async def _harness(spec: dict[str, Any]) -> dict[str, Any]:
    """The endpoint pass, from a process of its own (`agents_harness`): the client's own CPU (the `openai`
    client builds and parses every request in Python) is not taken from the generator's interpreter."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "actors.tools.bench.agents_harness",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(orjson.dumps(spec))
    if proc.returncode != 0:
        raise RuntimeError(f"bench agents: the harness process exited {proc.returncode}: {err.decode()[-2000:]}")
    return orjson.loads(out)


async def _direct(service: Any, scripts: list[list[str]], max_tokens: int) -> list[list[list[int]]]:
    """The same episodes without HTTP: first turn rendered, later turns bridged, ids straight to the engine."""
    from dataclasses import replace

    from actors.generator.engines.base import GenerateRequest

    template = service.template
    params = replace(service.sampling, max_new_tokens=max_tokens, stop_token_ids=())

    async def episode(index: int, script: list[str]) -> list[list[int]]:
        ids: list[int] = []
        sampled = []
        for turn, text in enumerate(script):
            message = {"role": "user", "content": text}
            if not ids:
                ids = template.render([message])
            else:
                ended = ids[-1] == template.eos_id
                ids = ids + template.bridge([message], ended_with_eos=ended)
            request = GenerateRequest(
                ids, seed=index * 1000 + turn, request_id=f"direct-{index}-{turn}", keep_prefix=True
            )
            (future,) = service.engine.submit([request], params)
            result = await asyncio.wrap_future(future)
            sampled.append(result.token_ids.tolist())
            ids = ids + sampled[-1]
        return sampled

    return list(await asyncio.gather(*(episode(e, s) for e, s in enumerate(scripts))))


def _drift(prompts: list[list[int]], sampled: list[list[int]]) -> int:
    """Sampled ids not fed back exactly: turn ``t``'s ids must sit right after turn ``t``'s prompt in the prompt of
    turn ``t + 1`` (what the endpoint returned as ``prompt_token_ids``)."""
    wrong = 0
    for t in range(len(prompts) - 1):
        at = len(prompts[t])
        fed_back = prompts[t + 1][at : at + len(sampled[t])]
        wrong += sum(a != b for a, b in zip(fed_back, sampled[t], strict=False)) + len(sampled[t]) - len(fed_back)
    return wrong


def _prefix_counters(engine: Engine) -> dict[str, int] | None:
    stats = engine.prefix_stats
    if stats is None:
        return None
    keys = ("prefix_hits", "prefix_lookups", "prefilled_tokens", "prompt_tokens")
    return {k: int(stats[k]) for k in keys}
