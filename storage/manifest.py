"""The weight manifest: the one record that makes a policy version exist, and the store layout.

    <run>/weights/v00000042/manifest.json                 written last, create-only
    <run>/weights/v00000042/part-00000-<publish>.lwd      delta parts (concatenated codec blobs)
    <run>/weights/v00000040/part-00000-<publish>.safetensors   full snapshot shards
    <run>/weights/LATEST                                  {"version": 42, ...}; moves forward by CAS

A sharded publish (several trainer ranks, each storing the tensors it owns) names its parts
`part-s001-00000-<publish>.lwd` (rank, then index) and lists every rank's parts in the one
manifest, which is otherwise the same: subscribers cannot tell the two apart.

Part keys carry the first 12 hex digits of the publisher's `publish_id`, so two publishers racing
for one version never overwrite each other's parts: whichever manifest wins names only its own.

Worked example of a delta manifest (JSON, abridged):

    {"schema": 1, "run": "demo", "version": 42, "kind": "delta", "base_version": 41,
     "parent_version": 41, "anchor_version": 40, "model_config_hash": "9f2c...",
     "publish_id": "5b1e0c...", "published_at": 1767000000.5, "hash_algorithm": "sha256",
     "codec": "lwdc1",
     "tensors": [{"name": "lm_head.weight", "dtype": "bfloat16", "shape": [512, 64], "hash": "ab12..."}],
     "parts": [{"key": "demo/weights/v00000042/part-00000-5b1e0c9d2a31.lwd", "num_bytes": 3120,
                "hash": "77aa...", "tensors": ["lm_head.weight"],
                "entries": [["lm_head.weight", 0, 32768, 0, 3120]]}]}

A delta entry is `[tensor, start_element, end_element, byte_offset, byte_length]`: the codec blob
at those bytes of the part turns elements [start, end) of the base version's tensor into this
version's. `hash` of a tensor is over its raw bits after this version is applied; `hash` of a
part is over the part's bytes, checked before anything is applied. `anchor_version` is the full
snapshot the version's delta chain starts from (itself for a full version); `parent_version` is
the version published before it (for a full snapshot written on resume, possibly an older one).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = [
    "DTYPES",
    "SCHEMA_VERSION",
    "Manifest",
    "ManifestError",
    "PartSpec",
    "TensorSpec",
    "config_hash",
    "latest_key",
    "manifest_key",
    "part_key",
    "parse_version_dir",
    "validate_run",
    "version_prefix",
    "weights_prefix",
]

SCHEMA_VERSION = 1
HASH_ALGORITHM = "sha256"
DELTA_CODEC = "lwdc1"
FULL_CODEC = "safetensors"
DTYPES = ("bfloat16", "float16", "float32")
"""Dtypes the store publishes: what the delta codec can diff bit for bit."""

_RUN_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_VERSION_DIR_RE = re.compile(r"^v(\d{8,})$")
_HEX_RE = re.compile(r"^[0-9a-f]{16,128}$")


class ManifestError(ValueError):
    """A manifest or `LATEST` that is missing fields, truncated, not JSON, or of another run/model."""


def validate_run(run: str) -> str:
    """Run names become key prefixes, so only letters, digits, '-' and '_' are allowed."""
    if not isinstance(run, str) or not _RUN_RE.match(run):
        raise ValueError(f"run name {run!r} must be 1-128 letters, digits, '-' or '_'")
    return run


def weights_prefix(run: str) -> str:
    return f"{run}/weights/"


def version_prefix(run: str, version: int) -> str:
    return f"{run}/weights/v{version:08d}/"


def manifest_key(run: str, version: int) -> str:
    return f"{version_prefix(run, version)}manifest.json"


def latest_key(run: str) -> str:
    return f"{run}/weights/LATEST"


def part_key(run: str, version: int, index: int, publish_id: str, suffix: str, shard: int | None = None) -> str:
    """A part's key; `shard` (a trainer rank of a sharded publish) keeps ranks' part numbers apart."""
    number = f"{index:05d}" if shard is None else f"s{shard:03d}-{index:05d}"
    return f"{version_prefix(run, version)}part-{number}-{publish_id[:12]}.{suffix}"


def parse_version_dir(name: str) -> int | None:
    """`v00000042` -> 42; None for anything else (LATEST, stray keys)."""
    match = _VERSION_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def config_hash(config: Any) -> str:
    """A stable hash of a JSON-able model config, so a subscriber can refuse another model's weights."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as it is after the version is applied."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    hash: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class PartSpec:
    """One stored object of a version: a safetensors shard or a set of delta blobs."""

    key: str
    num_bytes: int
    hash: str
    tensors: tuple[str, ...]
    entries: tuple[tuple[str, int, int, int, int], ...] = ()


@dataclass(frozen=True)
class Manifest:
    """Everything a subscriber needs to fetch, apply and verify one version (see the module docstring)."""

    run: str
    version: int
    kind: Literal["full", "delta"]
    base_version: int | None
    parent_version: int | None
    anchor_version: int
    model_config_hash: str
    publish_id: str
    published_at: float
    tensors: tuple[TensorSpec, ...]
    parts: tuple[PartSpec, ...]
    schema: int = SCHEMA_VERSION
    hash_algorithm: str = HASH_ALGORITHM
    codec: str = DELTA_CODEC
    holder: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    """The publishing trainer's run lease token (host, pid, since_s, holder id, lease revision and epoch); None in
    manifests written before it existed. For people and tools: subscribers do not check it."""

    @property
    def num_bytes(self) -> int:
        """Bytes a subscriber downloads to apply this version."""
        return sum(p.num_bytes for p in self.parts)

    def tensor_map(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    def to_json(self) -> bytes:
        data = asdict(self)
        data["parts"] = [{**p, "entries": [list(e) for e in p["entries"]]} for p in data["parts"]]
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, key: str) -> Manifest:
        """Parse and check a manifest; every defect raises `ManifestError` naming `key` and the field."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{key}: not valid JSON ({len(data)} bytes; truncated?): {exc}") from None
        try:
            manifest = _build(raw)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"{key}: invalid manifest: {type(exc).__name__}: {exc}") from None
        _check(manifest, key)
        return manifest


def _int(value: Any, field: str, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{field} must be a non-negative integer, got {value!r}")
    return value


def _str(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a string, got {type(value).__name__}")
    return value


def _build(raw: dict[str, Any]) -> Manifest:
    if not isinstance(raw, dict):
        raise TypeError(f"top level must be an object, got {type(raw).__name__}")
    if raw.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"schema {raw.get('schema')!r} not supported (this reader knows {SCHEMA_VERSION})")
    tensors = tuple(
        TensorSpec(
            name=_str(t["name"], "tensors[].name"),
            dtype=_str(t["dtype"], "tensors[].dtype"),
            shape=tuple(_int(d, "tensors[].shape") for d in t["shape"]),  # type: ignore[misc]
            hash=_str(t["hash"], "tensors[].hash"),
        )
        for t in raw["tensors"]
    )
    parts = tuple(
        PartSpec(
            key=_str(p["key"], "parts[].key"),
            num_bytes=_int(p["num_bytes"], "parts[].num_bytes"),  # type: ignore[arg-type]
            hash=_str(p["hash"], "parts[].hash"),
            tensors=tuple(_str(n, "parts[].tensors") for n in p["tensors"]),
            entries=tuple(
                (_str(e[0], "entries[].tensor"), *(_int(x, "entries[]") for x in e[1:]))  # type: ignore[misc]
                for e in p.get("entries", [])
            ),
        )
        for p in raw["parts"]
    )
    return Manifest(
        run=_str(raw["run"], "run"),
        version=_int(raw["version"], "version"),  # type: ignore[arg-type]
        kind=raw["kind"],
        base_version=_int(raw["base_version"], "base_version", allow_none=True),
        parent_version=_int(raw["parent_version"], "parent_version", allow_none=True),
        anchor_version=_int(raw["anchor_version"], "anchor_version"),  # type: ignore[arg-type]
        model_config_hash=_str(raw["model_config_hash"], "model_config_hash"),
        publish_id=_str(raw["publish_id"], "publish_id"),
        published_at=float(raw["published_at"]),
        tensors=tensors,
        parts=parts,
        hash_algorithm=_str(raw["hash_algorithm"], "hash_algorithm"),
        codec=_str(raw["codec"], "codec"),
        holder=_holder(raw.get("holder")),
    )


def _holder(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"holder must be an object or null, got {type(value).__name__}")
    return value


def _check(m: Manifest, key: str) -> None:
    """Cross-field invariants, so a subscriber can trust every name, range and offset it reads."""

    def bad(msg: str) -> ManifestError:
        return ManifestError(f"{key}: {msg}")

    if m.kind not in ("full", "delta"):
        raise bad(f"kind must be 'full' or 'delta', got {m.kind!r}")
    if m.hash_algorithm != HASH_ALGORITHM:
        raise bad(f"hash_algorithm {m.hash_algorithm!r} not supported")
    if m.codec != (FULL_CODEC if m.kind == "full" else DELTA_CODEC):
        raise bad(f"codec {m.codec!r} does not match kind {m.kind!r}")
    if m.kind == "delta" and (m.base_version is None or m.base_version >= m.version):
        raise bad(f"delta version {m.version} needs a base_version below it, got {m.base_version!r}")
    if m.kind == "full" and (m.base_version is not None or m.anchor_version != m.version):
        raise bad("a full snapshot has no base_version and is its own anchor")
    if m.anchor_version > m.version:
        raise bad(f"anchor_version {m.anchor_version} is newer than version {m.version}")
    specs = m.tensor_map()
    if len(specs) != len(m.tensors):
        raise bad("duplicate tensor names")
    for t in m.tensors:
        if t.dtype not in DTYPES:
            raise bad(f"tensor {t.name!r} has unsupported dtype {t.dtype!r}")
        if not _HEX_RE.match(t.hash):
            raise bad(f"tensor {t.name!r} hash is not a hex digest")
    covered: set[str] = set()
    ranges: dict[str, list[tuple[int, int]]] = {}
    prefix = version_prefix(m.run, m.version)
    for p in m.parts:
        if not p.key.startswith(prefix) or not _HEX_RE.match(p.hash):
            raise bad(f"part {p.key!r} is outside {prefix} or has no hex hash")
        unknown = set(p.tensors) - specs.keys()
        if unknown:
            raise bad(f"part {p.key!r} names unknown tensors {sorted(unknown)[:3]}")
        covered.update(p.tensors)
        for name, start, end, offset, length in p.entries:
            if name not in p.tensors or not start <= end <= specs[name].numel or offset + length > p.num_bytes:
                raise bad(f"part {p.key!r} entry for {name!r} [{start}, {end}) @ {offset}+{length} is out of range")
            ranges.setdefault(name, []).append((start, end))
    for name, spans in ranges.items():  # entries are applied in parallel, so they must not overlap
        spans.sort()
        if any(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False)):
            raise bad(f"delta entries for tensor {name!r} overlap")
    if m.kind == "full" and covered != specs.keys():
        raise bad(f"full snapshot parts miss tensors {sorted(specs.keys() - covered)[:3]}")
