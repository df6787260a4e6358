"""The parts of a backend's checkpoint state that do not depend on how it holds its model.

Both backends write the same RNG tensors (``rng/...``), the same JSON for the numpy and Python RNGs
and AdamW's hyperparameters, and restore AdamW through its own ``load_state_dict``; only the model
and moment tensors differ (FSDP2 rows, Megatron TP shards). Keeping these in one place keeps the two
backends' checkpoints alike, so `actors/trainer/checkpoints.py` reads either the same way.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger(__name__)


def check_state_meta(meta: Mapping[str, Any], backend: str, state_format: int) -> None:
    """ValueError unless `meta` was written by `backend` in `state_format`."""
    if meta.get("state_format") != state_format or meta.get("backend") != backend:
        raise ValueError(
            f"checkpoint meta has state_format={meta.get('state_format')!r} "
            f"backend={meta.get('backend')!r}; this backend reads {state_format} {backend!r}"
        )


def rng_tensors() -> dict[str, Tensor]:
    """The torch CPU RNG state and, where CUDA is up, every device's."""
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/torch_cuda_{index}"] = state.cpu()
    return out


def rng_meta() -> dict[str, Any]:
    """The numpy and Python global RNG states, JSON-safe."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "numpy_rng": {
            "kind": np_state[0],
            "keys": np_state[1].tolist(),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python_rng": {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
    }


def load_rng(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    """Restore torch (CPU, and CUDA when the device count matches), numpy and Python global RNGs."""
    torch.set_rng_state(tensors["rng/torch_cpu"].to(torch.uint8))
    cuda_keys = sorted((k for k in tensors if k.startswith("rng/torch_cuda_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    cuda_states = [tensors[k] for k in cuda_keys]
    if cuda_states:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            log.warning("checkpoint has %d CUDA RNG states; not restored on this machine", len(cuda_states))
    np_rng = meta["numpy_rng"]
    np.random.set_state(
        (
            np_rng["kind"],
            np.asarray(np_rng["keys"], dtype=np.uint32),
            np_rng["pos"],
            np_rng["has_gauss"],
            np_rng["cached_gaussian"],
        )
    )
    py_rng = meta["python_rng"]
    random.setstate((py_rng["version"], tuple(py_rng["internal"]), py_rng["gauss_next"]))


def adamw_hyperparameters(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    group = optimizer.param_groups[0]
    return {
        "lr": group["lr"],
        "betas": list(group["betas"]),
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
    }


def saved_moments(tensors: Mapping[str, Tensor], name: str) -> dict[str, Tensor]:
    """The saved AdamW state of parameter `name` (``optimizer/<name>/<key>``), by key."""
    prefix = f"optimizer/{name}/"
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def load_adamw_state(
    optimizer: torch.optim.Optimizer,
    state: dict[int, dict[str, Tensor]],
    tensors: Mapping[str, Tensor],
    meta: Mapping[str, Any],
    names: Collection[str],
) -> None:
    """Hand `state` (parameter index -> moments, already placed like the parameters) to AdamW's
    `load_state_dict`. Saved moments of a parameter not in `names` are a ValueError. Hyperparameters
    stay those of the running config; a difference is logged, so a resume with a changed lr is
    deliberate rather than silent."""
    known = {f"optimizer/{n}/" for n in names}
    stray = [k for k in tensors if k.startswith("optimizer/") and k[: k.rfind("/") + 1] not in known]
    if stray:
        raise ValueError(f"checkpoint optimizer tensors for unknown parameters: {stray[:5]}")
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    saved_hp, now = meta.get("optimizer", {}), adamw_hyperparameters(optimizer)
    if saved_hp != now:
        log.warning("optimizer hyperparameters differ from the checkpoint's %s; using %s", saved_hp, now)
