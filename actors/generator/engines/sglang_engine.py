"""`Engine` over SGLang's in-process ``sglang.Engine`` (``engine.kind: sglang``), for CUDA machines with SGLang.

NOT RUN: SGLang does not install on the CPU machines this was written on (its wheel pins a CUDA torch and CUDA
kernels). The request, result, abort and weight-update mapping lives in `sglang_requests` and is unit-tested there
against SGLang's data shapes; this class only wires those pure parts to SGLang and has never executed.

    caller threads                      engine thread (private asyncio loop)          SGLang (children: scheduler
    submit(requests) ─► validate, map ─► tokenizer_manager.generate_request ──────────► per TP rank, detokenizer)
                       concurrent futures ◄── result_from_output(output) ◄────────────
    update_weights ──► hash + serialize ─► pause(in_place) ─► update_weights_from_tensor(leeway_weight_loader)
                       (blocks until applied)  ─► update_weight_version(label) ─► continue_generation
    abort(ids) ──────► abort_request(rid) for requests SGLang holds; cancel those not yet sent

SGLang's calls are coroutines on its ``TokenizerManager`` (the ``sglang.Engine`` wrappers run them with
``loop.run_until_complete``, which a thread-safe engine cannot share), so they all run on one private event loop;
``sglang.Engine`` itself is built in the caller's thread (it installs signal handlers from the main thread). SGLang
starts its children with ``spawn``: the launching module needs a main guard. The API calls used were read at
sgl-project/sglang 001067ff (``entrypoints/engine.py``, ``managers/io_struct.py``) and the tokenizer's control
mixin (``update_weights_from_tensor`` runs at once while paused; ``update_weight_version`` reaches the scheduler,
which stamps every live request's version span).

Semantics against the contract (``base.py``):
- per-token versions come from SGLang's spans; an in-place pause keeps the running requests' KV cache.
- prefixes: SGLang's radix cache, salted with the weight version at submission, so a request submitted after an
  update never reuses keys and values computed by older weights (a request already waiting may).
- a weight update is refused by `leeway_weight_loader` when a tensor's sha256 differs from the one sent; whether
  SGLang's scheduler survives that exception (rather than exiting) was not verifiable here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from actors.generator.engines.base import Engine, GenerateRequest, GenerateResult, NamedTensors, SamplingParams
from actors.generator.engines.sglang_requests import (
    LOADER_PATH,
    ControlCall,
    abort_targets,
    generate_fields,
    model_eos_token_ids,
    prefix_counts,
    prompt_too_long,
    result_from_output,
    weight_update_plan,
    with_expected_hashes,
)
from actors.generator.engines.version_spans import version_label

__all__ = ["SglangEngine", "server_args"]


def server_args(
    model_path: str | Path,
    *,
    version: int,
    seed: int,
    dtype: str,
    tp_size: int,
    mem_fraction_static: float | None,
    max_running_requests: int | None,
    context_length: int | None,
    sampling_mask_max_tokens: int | None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``sglang.Engine(**kwargs)`` (``ServerArgs`` fields): token ids in and out (no tokenizer), Leeway's loader
    allowed, the starting weights labelled with their version. ``extra`` passes any other ``ServerArgs`` field."""
    args: dict[str, Any] = {
        "model_path": str(model_path),
        "skip_tokenizer_init": True,
        "trust_remote_code": False,  # never a checkpoint's own code (the run's model files are untrusted)
        "custom_weight_loader": [LOADER_PATH],
        "weight_version": version_label(version),
        "random_seed": seed,
        "dtype": dtype,
        "tp_size": tp_size,
        "log_level": "error",
    }
    optional = {
        "mem_fraction_static": mem_fraction_static,
        "max_running_requests": max_running_requests,
        "context_length": context_length,
        "sampling_mask_max_tokens": sampling_mask_max_tokens,
    }
    args.update({k: v for k, v in optional.items() if v is not None})
    for key, value in (extra or {}).items():
        if key in args and args[key] != value:
            raise ValueError(f"engine.sglang.extra.{key}: set by Leeway ({args[key]!r}), cannot be overridden")
        args[key] = value
    return args


class SglangEngine(Engine):
    """`Engine` over ``sglang.Engine`` (see the module docstring); ``model_path`` holds the run's version-0
    checkpoint (HF layout). ``tensor_names``, when given, are the checkpoint's parameter names: `load_state`
    requires all of them and `update_weights` refuses others."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        version: int = 0,
        seed: int = 0,
        dtype: str = "auto",
        tp_size: int = 1,
        mem_fraction_static: float | None = None,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        sampling_mask_max_tokens: int | None = None,
        extra_server_args: Mapping[str, Any] | None = None,
        tensor_names: Collection[str] | None = None,
    ) -> None:
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"):
            raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang's log-probs would ignore the temperature")
        import sglang  # lazily: the module must import where SGLang does not
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer

        self._io, self._serializer = io_struct, MultiprocessingSerializer
        if "return_sampling_mask" not in getattr(io_struct.GenerateReqInput, "__dataclass_fields__", {}):
            raise RuntimeError("this SGLang has no return_sampling_mask (PR #40932): behaviour log-probs are unknown")
        args = server_args(
            model_path,
            version=version,
            seed=seed,
            dtype=dtype,
            tp_size=tp_size,
            mem_fraction_static=mem_fraction_static,
            max_running_requests=max_running_requests,
            context_length=context_length,
            sampling_mask_max_tokens=sampling_mask_max_tokens,
            extra=extra_server_args,
        )
        self._engine = sglang.Engine(**args)
        self._tm = self._engine.tokenizer_manager
        self._tp_size = tp_size
        self._version = version
        self._eos_ids = model_eos_token_ids(model_path)
        self._names = frozenset(tensor_names) if tensor_names is not None else None
        self._lock = threading.Lock()
        self._live: dict[str, str] = {}
        """rid -> Leeway request id of every request submitted and not finished."""
        self._tasks: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()
        """rids aborted before their task first ran (engine thread only, like `_tasks`)."""
        self._stats = {"prefix_lookups": 0, "prefix_hits": 0, "prompt_tokens": 0, "prefilled_tokens": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-engine", daemon=True)
        self._thread.start()

    # ---- properties ----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def vocab_size(self) -> int:
        return int(self._tm.model_config.vocab_size)

    @property
    def max_context_tokens(self) -> int:
        return int(self._tm.context_len)

    @property
    def prefix_stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    # ---- requests ------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        return [future.result() for future in self.submit(requests, params)]

    def submit(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[Future[GenerateResult]]:
        """Validate and map every request first (a bad one raises and nothing is queued), then queue them all."""
        salt = f"v{self._version}"
        mapped = []
        for request in requests:
            rid = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:16]}"
            fields = generate_fields(
                request,
                params,
                rid=rid,
                max_context_tokens=self.max_context_tokens,
                vocab_size=self.vocab_size,
                model_eos_ids=self._eos_ids,
                cache_salt=salt,
            )
            mapped.append((request, rid, fields))
        futures: list[Future[GenerateResult]] = []
        for request, rid, fields in mapped:
            if fields is None:
                future: Future[GenerateResult] = Future()
                future.set_result(prompt_too_long(request))
            else:
                with self._lock:
                    self._live[rid] = request.request_id
                future = asyncio.run_coroutine_threadsafe(self._run(request, rid, fields, params), self._loop)
            futures.append(future)
        return futures

    async def _run(
        self, request: GenerateRequest, rid: str, fields: dict[str, Any], params: SamplingParams
    ) -> GenerateResult:
        started = asyncio.get_running_loop().time()
        self._tasks[rid] = asyncio.current_task()  # type: ignore[assignment]
        unsent = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
        try:
            if rid in self._aborted:
                raise asyncio.CancelledError
            obj = self._io.GenerateReqInput(**fields)
            output = await self._tm.generate_request(obj, None).__anext__()
        except asyncio.CancelledError:  # aborted before SGLang held it: no tokens
            return result_from_output(unsent, params, request_id=request.request_id)
        finally:
            self._aborted.discard(rid)
            self._tasks.pop(rid, None)
            with self._lock:
                self._live.pop(rid, None)
        elapsed = asyncio.get_running_loop().time() - started
        result = result_from_output(output, params, request_id=request.request_id, gen_s=elapsed)
        with self._lock:
            for key, value in prefix_counts(output.get("meta_info") or {}).items():
                self._stats[key] += value
        return result

    def abort(self, request_ids: Collection[str] | None = None) -> None:
        with self._lock:
            rids = abort_targets(self._live, request_ids)
        if rids:
            asyncio.run_coroutine_threadsafe(self._abort(rids), self._loop).result()

    async def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            if rid in self._tm.rid_to_state:  # SGLang holds it: it finishes with reason abort and its tokens so far
                self._tm.abort_request(rid=rid)
            elif (task := self._tasks.get(rid)) is not None:
                task.cancel()
            else:
                with self._lock:
                    if rid in self._live:  # its task has not started yet
                        self._aborted.add(rid)

    # ---- weights -------------------------------------------------------------------------------

    def load_state(self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None = None) -> None:
        if self._names is not None and (missing := sorted(self._names - named_tensors.keys())):
            raise ValueError(f"load_state(version={version}): {len(missing)} tensors missing, e.g. {missing[:3]}")
        self.update_weights(named_tensors, version, hashes)

    def update_weights(
        self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None = None
    ) -> None:
        """Returns once SGLang's schedulers loaded the tensors (hash-checked by the loader) and labelled them."""
        if version < self._version:
            raise ValueError(f"weight version {version} is older than the engine's version {self._version}")
        if self._names is not None and (unknown := sorted(named_tensors.keys() - self._names)):
            raise ValueError(f"weights of version {version}: unknown tensors, e.g. {unknown[:3]}")
        payload = with_expected_hashes(named_tensors, hashes)
        serialized = [self._serializer.serialize(payload) for _ in range(self._tp_size)]
        pause, apply, resume = weight_update_plan(version, serialized)
        asyncio.run_coroutine_threadsafe(self._update(pause, apply, resume), self._loop).result()
        self._version = version

    async def _update(self, pause: ControlCall, apply: list[ControlCall], resume: ControlCall) -> None:
        await self._call(pause)
        try:
            for call in apply:
                await self._call(call)
        finally:
            await self._call(resume)

    async def _call(self, call: ControlCall) -> None:
        answer = await getattr(self._tm, call.method)(getattr(self._io, call.request)(**call.fields))
        if isinstance(answer, tuple) and answer and answer[0] is False:
            raise RuntimeError(f"sglang {call.method} failed: {answer[1] if len(answer) > 1 else answer}")

    def close(self) -> None:
        """Stop SGLang's children and the engine thread."""
        with contextlib.suppress(Exception):
            self._engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
