"""Trainer state <-> files of bytes: safetensors for tensors, JSON for the rest; nothing is pickled.

`encode_checkpoint` turns ``{"<group>/<name>": tensor}`` plus a JSON-safe meta dict into one
``<group>.safetensors`` per group (keys without the group prefix, so ``model.safetensors`` reads as
an ordinary HF weight file) and a ``meta.json`` that lists every tensor file with its size and
sha256. `decode_checkpoint` checks those hashes before it trusts a byte. The trainer writes the
files under ``<run>/checkpoints/v00000040/<attempt>/`` and its manifest last, so a checkpoint exists
only once complete; this module does no I/O.

Example::

    files = encode_checkpoint(backend.state_tensors(), {"backend": backend.state_meta(), "trainer": {...}})
    # {"model.safetensors": b"...", "optimizer.safetensors": b"...", "rng.safetensors": b"...", "meta.json": b"..."}
    tensors, meta = decode_checkpoint(files)
    backend.load_state(tensors, meta["backend"])
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

CHECKPOINT_FORMAT = 1
"""Version of the file layout; `decode_checkpoint` refuses other versions."""

META_FILE = "meta.json"
TENSOR_SUFFIX = ".safetensors"
_GROUP_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class CheckpointError(ValueError):
    """Checkpoint files that cannot be decoded: missing, corrupt or of another format; the message names the file."""


def encode_checkpoint(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> dict[str, bytes]:
    """Encode tensors keyed ``<group>/<name>`` and a JSON-safe ``meta`` into named files of bytes.

    Raises ValueError for a key without a valid group prefix, or for meta that JSON cannot hold
    exactly (NaN/inf, non-string keys, objects) -- rather than write a checkpoint that resumes wrong.
    """
    groups: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        group, sep, name = key.partition("/")
        if not sep or not name or not _GROUP_RE.match(group):
            raise ValueError(f"checkpoint tensor key {key!r} must be '<group>/<name>' with a lowercase group")
        groups.setdefault(group, {})[name] = tensor.detach().to("cpu").contiguous()
    files: dict[str, bytes] = {}
    listing: dict[str, dict[str, Any]] = {}
    for group, named in sorted(groups.items()):
        data = st_save(dict(sorted(named.items())), metadata={"format": "pt", "group": group})
        files[group + TENSOR_SUFFIX] = data
        listing[group + TENSOR_SUFFIX] = {"num_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _check_json_safe(meta, "meta")
    header = {"checkpoint_format": CHECKPOINT_FORMAT, "files": listing, "meta": meta}
    files[META_FILE] = json.dumps(header, sort_keys=True, allow_nan=False).encode()
    return files


def decode_checkpoint(files: Mapping[str, bytes]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Inverse of `encode_checkpoint`: ``(tensors keyed <group>/<name>, meta)``.

    Every tensor file listed in ``meta.json`` must be present with the recorded size and sha256;
    anything else raises CheckpointError naming the file. Unlisted extra files are ignored (the
    trainer's manifest may sit next to them).
    """
    if META_FILE not in files:
        raise CheckpointError(f"checkpoint has no {META_FILE} (files: {sorted(files)})")
    try:
        header = json.loads(files[META_FILE])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{META_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(header, dict) or header.get("checkpoint_format") != CHECKPOINT_FORMAT:
        found = header.get("checkpoint_format") if isinstance(header, dict) else None
        raise CheckpointError(f"{META_FILE}: checkpoint_format={found!r}, expected {CHECKPOINT_FORMAT}")
    tensors: dict[str, Tensor] = {}
    for file_name, expected in header["files"].items():
        data = files.get(file_name)
        if data is None:
            raise CheckpointError(f"checkpoint file {file_name} is listed in {META_FILE} but missing")
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != expected["num_bytes"] or digest != expected["sha256"]:
            raise CheckpointError(
                f"checkpoint file {file_name}: {len(data)} bytes sha256 {digest}, "
                f"{META_FILE} says {expected['num_bytes']} bytes sha256 {expected['sha256']}"
            )
        group = file_name.removesuffix(TENSOR_SUFFIX)
        for name, tensor in st_load(data).items():
            tensors[f"{group}/{name}"] = tensor
    return tensors, header["meta"]


def _check_json_safe(value: Any, path: str) -> None:
    """Refuse what JSON cannot round-trip exactly: NaN/inf, non-str keys, arbitrary objects (tuples become lists)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"checkpoint {path} = {value}: JSON cannot hold NaN or infinity")
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"checkpoint {path} has key {key!r} of type {type(key).__name__}; keys must be str")
            _check_json_safe(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_json_safe(item, f"{path}[{index}]")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ValueError(f"checkpoint {path} is a {type(value).__name__}; meta must be JSON-safe")


__all__ = ["CHECKPOINT_FORMAT", "CheckpointError", "decode_checkpoint", "encode_checkpoint"]
