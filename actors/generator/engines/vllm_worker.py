"""What runs inside vLLM's worker processes: Leeway's worker extension (vLLM's ``worker_extension_cls``), called by
the vLLM engine adapter through ``collective_rpc``.

A weight update reaches the workers as one safetensors file the generator staged (shared memory where it fits):
every worker maps it, checks each tensor's sha256 against the hashes the generator sent (the version's manifest
hashes), and only when all of them match hands the tensors to vLLM's in-place reload
(``model_runner.reload_weights``: the model's own ``load_weights`` name mapping and packing, then the per-layer
post-processing that re-packs CPU kernels). A file that does not match is refused before one weight is written, so
the engine keeps serving the previous version. What the worker loaded is reported back as hashes, so the adapter
(and the contract tests) compare the engine's weights with the trainer's version bit for bit.

This module is imported by vLLM in its worker processes; it imports nothing of Leeway's beyond the store's hash.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors import safe_open

from storage.weights_base import tensor_hash

__all__ = ["LeewayWorkerExtension"]


def _sha256(tensor: torch.Tensor) -> str:
    """The manifest's hash of a tensor wherever it lives (`storage.weights_base.tensor_hash` wants a contiguous CPU one)."""
    return tensor_hash(tensor.detach().cpu().contiguous())


class LeewayWorkerExtension:
    """Mixed into vLLM's worker class; its methods see ``self.model_runner`` (vLLM's) and are called by name."""

    model_runner: Any

    def leeway_load_weights(self, path: str, hashes: dict[str, str], check: bool) -> dict[str, Any]:
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
        except Exception as exc:
            return {"ok": False, "stage": "load", "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True, "hashes": loaded}

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
