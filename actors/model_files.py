"""The run's model files in the object store: what a generator needs to build the model, carried beside the weights.

A generator must not need the Hub or the trainer's file system: the run's name, NATS and the store are enough,
as for the weights. So a trainer whose model is a checkpoint (a local directory or a Hub id) publishes, before
version 0, the files that describe it, and a generator without that checkpoint builds its model from them:

    <run>/model/config.json, generation_config.json, tokenizer.json, special_tokens_map.json,
                chat_template.jinja, tokenizer_config.json, chat_template.json      (those the checkpoint has)
    <run>/model/manifest.json   {"format": 1, "spec": {"name_or_path", "revision"}, "files": {name: sha256}}

The files are written first and the manifest last (create-only), so a manifest means every file it names is
there. A trainer of the same run that finds a manifest checks it holds the same spec and files and writes
nothing; other files are refused, naming the file (a resumed run with another model). The generator builds the
model from ``config.json`` alone (the weights are version 0's, pulled as always and checked by hash), its
tokenizer from ``tokenizer.json`` and its chat template from the same file the trainer's came from (the first
of ``chat_template.jinja``, ``tokenizer_config.json``, ``chat_template.json`` holding one, as transformers reads
them: `actors.models.chat_template_in`), each file checked against the manifest's sha256. Where
``model.tokenizer`` is not the checkpoint directory, the template files published are that tokenizer's (none
for a tokenizer.json file), never the checkpoint's: the generator then renders with the trainer's template.
A generator whose own ``model.name_or_path`` or ``model.revision`` is not the run's is refused, naming the field.

The store's files are untrusted input to a generator (whoever can write the store can write them), so before
anything is built from them (`fetch_model_files`):
- the manifest names only `actors.models.MODEL_FILES` (no code, no paths: anything else is refused, naming it);
- each file is at most `MAX_MODEL_FILE_BYTES` (`MAX_CONFIG_BYTES` for the two configs) and all together at most
  `MAX_MODEL_FILES_BYTES`, checked by the store's size before a byte is read and by the bytes read (a trainer
  refuses to publish what its generators would refuse);
- ``config.json`` names an architecture transformers has (``model_type``): an ``auto_map`` to the model's own
  code is never followed (every load passes ``trust_remote_code=False``, so no terminal prompt can enable it);
- its dimensions agree with the tensor shapes of the run's newest weight manifest (`check_config_shapes`:
  vocabulary, hidden size and layers exactly, expert counts, then every parameter of the model built on the
  ``meta`` device, which allocates nothing): a config that would allocate more than the weights hold is refused,
  naming the field, before the engine allocates anything. The generator thus waits for version 0 here;
- and those shapes are backed by stored bytes: the newest version's full snapshot must hold, by the store's
  sizes of its parts, at least the bytes its tensors claim (a hostile weight manifest and a matching config
  cannot make a generator allocate what nobody uploaded).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from pipeline.config import LeewayConfig
from storage.objectstore import ObjectNotFound, ObjectStore, PreconditionFailed

if TYPE_CHECKING:
    from storage.manifest import Manifest

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
SPEC_FIELDS = ("name_or_path", "revision")
"""The `model.*` fields a generator must share with the run's trainer."""
MAX_MANIFEST_BYTES = 64 * 1024
"""``manifest.json`` names at most the few `MODEL_FILES` with their digests: a few hundred bytes."""
MAX_MODEL_FILE_BYTES = 64 * 2**20
"""Any one model file (the largest real one is a tokenizer.json of a large vocabulary: ~10-35 MiB)."""
MAX_CONFIG_BYTES = 2**20
"""``config.json`` and ``generation_config.json``: a few KiB in every real checkpoint."""
CONFIG_FILES = ("config.json", "generation_config.json")
MAX_MODEL_FILES_BYTES = 128 * 2**20
"""All of a run's model files together."""
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ModelFilesError(ValueError):
    """The run's model files are missing, damaged, or disagree with this process's config (the field is named)."""


@dataclass(frozen=True)
class ModelFiles:
    spec: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    """File name -> sha256 of its bytes."""

    def to_json(self) -> bytes:
        return orjson.dumps(
            {"format": MANIFEST_FORMAT, "spec": self.spec, "files": self.files}, option=orjson.OPT_SORT_KEYS
        )

    @classmethod
    def parse(cls, data: bytes, key: str) -> ModelFiles:
        try:
            raw = orjson.loads(data)
            if raw["format"] != MANIFEST_FORMAT:
                raise ModelFilesError(f"{key}: format {raw['format']!r}, this build reads {MANIFEST_FORMAT}")
            files = {str(k): str(v) for k, v in raw["files"].items()}
            spec = dict(raw["spec"])
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ModelFilesError(f"{key}: not a model files manifest ({exc})") from exc
        check_names(files, key)
        return cls(spec=spec, files=files)


def check_names(files: Mapping[str, str], key: str) -> None:
    """Refuse a manifest naming any file but the known model files (a path, code, anything else), or a digest
    that is not a sha256, naming the file; ``config.json`` must be there."""
    from actors.models import MODEL_FILES

    for name, digest in files.items():
        if name not in MODEL_FILES:
            raise ModelFilesError(
                f"{key}: names the file {name!r}, which is not one of the model files a generator reads "
                f"({', '.join(MODEL_FILES)}); refusing the run's model files"
            )
        if not _SHA256_RE.match(digest):
            raise ModelFilesError(f"{key}: the digest of {name} is not a sha256 hex digest: {digest[:80]!r}")
    if "config.json" not in files:
        raise ModelFilesError(f"{key}: names no config.json")


def file_cap(name: str) -> int:
    """The most bytes the model file `name` may hold (`MAX_CONFIG_BYTES` or `MAX_MODEL_FILE_BYTES`)."""
    return MAX_CONFIG_BYTES if name in CONFIG_FILES else MAX_MODEL_FILE_BYTES


def check_sizes(sizes: Mapping[str, int], where: str) -> None:
    """Refuse a file over its cap (`file_cap`) or files over `MAX_MODEL_FILES_BYTES` together, naming them."""
    for name, size in sorted(sizes.items()):
        if size > file_cap(name):
            raise ModelFilesError(
                f"{where}{name}: {size} bytes, over the cap of {file_cap(name)} bytes for a model file"
            )
    if sum(sizes.values()) > MAX_MODEL_FILES_BYTES:
        raise ModelFilesError(
            f"{where}: the model files hold {sum(sizes.values())} bytes together, over the cap of "
            f"{MAX_MODEL_FILES_BYTES} bytes ({', '.join(f'{n}: {b}' for n, b in sorted(sizes.items()))})"
        )


def model_prefix(run: str) -> str:
    return f"{run}/model/"


def spec_of(cfg: LeewayConfig) -> dict[str, Any]:
    return {name: getattr(cfg.model, name) for name in SPEC_FIELDS}


def publish_model_files(store: ObjectStore, cfg: LeewayConfig) -> ModelFiles | None:
    """The trainer's part: publish the checkpoint's model files under ``<run>/model/`` (see the module docstring);
    None for a preset, which every process builds from its name."""
    from actors.models import CHAT_TEMPLATE_FILES, MODEL_FILES, checkpoint_dir, tokenizer_path

    directory = checkpoint_dir(cfg)
    if directory is None:
        return None
    blobs = {name: (directory / name).read_bytes() for name in MODEL_FILES if (directory / name).is_file()}
    tokenizer = tokenizer_path(cfg)
    if tokenizer is not None and not (tokenizer.is_dir() and tokenizer.resolve() == directory.resolve()):
        # the trainer's template is model.tokenizer's (or the task's), and so must the generators' be
        blobs = {name: data for name, data in blobs.items() if name not in CHAT_TEMPLATE_FILES}
    blobs.update(_configured_files(cfg, tokenizer))
    if "config.json" not in blobs:
        raise ModelFilesError(f"model.name_or_path = {cfg.model.name_or_path!r}: no config.json in {directory}")
    check_sizes({name: len(data) for name, data in blobs.items()}, f"{cfg.model.name_or_path}/")
    mine = ModelFiles(spec_of(cfg), {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()})
    prefix = model_prefix(cfg.run.name)
    existing = _read_manifest(store, prefix)
    if existing is not None:
        _check_same(existing, mine, prefix)
        return existing
    for name, data in blobs.items():
        try:
            store.put_if_absent(prefix + name, data)
        except PreconditionFailed:  # an earlier try of this trainer wrote it: it must hold the same bytes
            if hashlib.sha256(store.get(prefix + name)).hexdigest() != mine.files[name]:
                raise ModelFilesError(
                    f"{prefix}{name} already holds another file; purge the run or use another run.name"
                ) from None
    try:
        store.put_if_absent(prefix + "manifest.json", mine.to_json())
    except PreconditionFailed:
        existing = _read_manifest(store, prefix)
        assert existing is not None
        _check_same(existing, mine, prefix)
        return existing
    log.info("published the model's files under %s: %s", prefix, ", ".join(sorted(blobs)))
    return mine


def fetch_model_files(store: ObjectStore, cfg: LeewayConfig, into: Path, *, wait_s: float, poll_s: float = 1.0) -> Path:
    """The generator's part: wait up to `wait_s` for the run's manifest, check that this config's spec is the
    run's, fetch every file (its name known, its size capped, checked by sha256), check ``config.json`` against the
    run's newest weight manifest (waiting for one within the same `wait_s`), then write the files into `into` and
    return that directory. Raises `ModelFilesError` naming the file, cap or field, having built nothing."""
    prefix = model_prefix(cfg.run.name)
    deadline = time.monotonic() + wait_s
    said = False
    while (manifest := _read_manifest(store, prefix)) is None:
        if time.monotonic() >= deadline:
            raise ModelFilesError(
                f"no model files under {prefix} after {wait_s:.0f} s: the run's trainer publishes them before "
                f"version 0 (is it running? model.name_or_path = {cfg.model.name_or_path!r} is not on this machine)"
            )
        if not said:
            log.info("waiting for the run's model files under %s (published by its trainer)", prefix)
            said = True
        time.sleep(poll_s)
    mine = spec_of(cfg)
    for name in SPEC_FIELDS:
        if manifest.spec.get(name) != mine[name]:
            raise ModelFilesError(
                f"model.{name} = {mine[name]!r}, but run {cfg.run.name!r} trains {manifest.spec.get(name)!r}: "
                f"start this generator with the run's model.{name}"
            )
    blobs = _fetch_files(store, prefix, manifest)
    config = parse_model_config(blobs["config.json"], f"{prefix}config.json")
    shapes = _newest_weight_shapes(store, cfg.run.name, deadline, poll_s)
    check_config_shapes(config, shapes, f"{prefix}config.json")
    into.mkdir(parents=True, exist_ok=True)
    for name, data in blobs.items():
        (into / name).write_bytes(data)
    log.info("built the model from the run's files under %s: %s", prefix, ", ".join(sorted(manifest.files)))
    return into


def _fetch_files(store: ObjectStore, prefix: str, manifest: ModelFiles) -> dict[str, bytes]:
    """Every file the manifest names, its size checked before a byte is read (`check_sizes`), never more than its
    cap read, its sha256 the manifest's."""
    sizes: dict[str, int] = {}
    for name in sorted(manifest.files):
        try:
            sizes[name] = store.size(prefix + name)
        except ObjectNotFound:
            raise ModelFilesError(f"{prefix}{name}: named by the manifest but missing") from None
    check_sizes(sizes, prefix)
    blobs: dict[str, bytes] = {}
    for name, digest in sorted(manifest.files.items()):
        try:
            data = store.get_range(prefix + name, 0, file_cap(name) + 1)
        except ObjectNotFound:
            raise ModelFilesError(f"{prefix}{name}: named by the manifest but missing") from None
        check_sizes({**sizes, name: len(data)}, prefix)  # replaced since its size was read
        if hashlib.sha256(data).hexdigest() != digest:
            raise ModelFilesError(f"{prefix}{name}: sha256 differs from the manifest's; the store copy is damaged")
        blobs[name] = data
    return blobs


def _newest_weight_shapes(store: ObjectStore, run: str, deadline: float, poll_s: float) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in the run's newest weight manifest, waiting until `deadline` for one (the trainer
    publishes version 0 right after the model files)."""
    from storage.manifest import Manifest, manifest_key
    from storage.weights_base import read_latest

    said = False
    while True:
        version = read_latest(store, run)
        if version is not None:
            key = manifest_key(run, version)
            try:
                manifest = Manifest.from_json(store.get(key), key=key)
            except ObjectNotFound:
                manifest = None  # pruned since LATEST was read: read LATEST again
            if manifest is not None and _check_stored_bytes(store, run, manifest):
                return {t.name: t.shape for t in manifest.tensors}
        if time.monotonic() >= deadline:
            raise ModelFilesError(
                f"{run}/weights/: no published version to check the model's config.json against; the run's "
                "trainer publishes version 0 right after the model files (is it running?)"
            )
        if not said:
            log.info("waiting for the run's version 0 to check the model files against its tensor shapes")
            said = True
        time.sleep(poll_s)


def _check_stored_bytes(store: ObjectStore, run: str, manifest: Manifest) -> bool:
    """Refuse weights whose manifest claims more tensor bytes than its full snapshot (the anchor) holds in the
    store, by the store's own sizes: the config is checked against these shapes, so a hostile manifest that
    claimed huge tensors would otherwise let a matching config allocate them. A full snapshot is plain
    safetensors, so an honest one holds at least its tensors' bytes. False: the anchor was pruned meanwhile."""
    from storage.manifest import Manifest, manifest_key
    from storage.weights_base import TORCH_DTYPES

    key = manifest_key(run, manifest.anchor_version)
    try:
        anchor = (
            manifest if manifest.anchor_version == manifest.version else Manifest.from_json(store.get(key), key=key)
        )
        stored = sum(store.size(part.key) for part in anchor.parts)
    except ObjectNotFound:
        return False
    claimed = sum(t.numel * TORCH_DTYPES[t.dtype].itemsize for t in manifest.tensors)
    if claimed > stored:
        raise ModelFilesError(
            f"{key}: its tensors claim {claimed} bytes, but its parts in the store hold {stored}; refusing weights "
            "(and a config.json matching them) that the store does not hold"
        )
    return True


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
"""The layer index in a tensor name (``model.layers.3.mlp...``, GPT-2's ``transformer.h.3...``)."""
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "embed_in.weight", "word_embeddings.weight")
"""Name endings of the input embedding, ``[vocab_size, hidden_size]``."""
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def parse_model_config(data: bytes, where: str) -> Any:
    """The transformers config of the run's ``config.json`` (`actors.models.config_from_dict`: an architecture
    transformers has, no ``auto_map`` followed); `ModelFilesError` naming the file and field."""
    from actors.models import config_from_dict

    try:
        return config_from_dict(orjson.loads(data), where)
    except orjson.JSONDecodeError as exc:
        raise ModelFilesError(f"{where}: not JSON ({exc})") from exc
    except ValueError as exc:
        raise ModelFilesError(str(exc)) from exc


def check_config_shapes(config: Any, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Refuse a config whose model is not the one the weights (`shapes`: tensor name -> shape) fit, naming the
    field, without allocating anything: first the vocabulary and hidden size against the input embedding and the
    layer count against the layers the tensors name (each bounds what the build below costs), the expert counts
    against the tensors' dimensions, then every parameter of the model built on the ``meta`` device."""
    embedding = next((s for n, s in shapes.items() if n.endswith(_EMBEDDINGS) and len(s) == 2), None)
    if embedding is None:
        raise ModelFilesError(f"{where}: the run's weights hold no input embedding ({', '.join(_EMBEDDINGS)})")
    layers = len({m[1] for name in shapes if (m := _LAYER_RE.search(name))})
    for setting, held in (("vocab_size", embedding[0]), ("hidden_size", embedding[1]), ("num_hidden_layers", layers)):
        value = getattr(config, setting, None)
        if value != held:
            raise ModelFilesError(
                f"{where}: {_name(config, setting)} = {value!r}, but the run's weights hold {held}; refusing to build "
                "a model the weights do not fit"
            )
    dims = {d for shape in shapes.values() for d in shape}
    dims.add(len({m[1] for name in shapes if (m := _EXPERT_RE.search(name))}))
    for setting in EXPERT_FIELDS:
        value = getattr(config, setting, None)
        if value is not None and value not in dims:
            raise ModelFilesError(
                f"{where}: {setting} = {value!r}, but no tensor of the run's weights has that many experts"
            )
    _check_parameters(config, shapes, where)


def _check_parameters(config: Any, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Every parameter of the model `config` builds (on the ``meta`` device: no memory) has a tensor of its shape
    in the weights; a mismatch names the config fields whose values make it."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as exc:  # untrusted input: whatever transformers raises building it is a bad config
        raise ModelFilesError(f"{where}: transformers cannot build its model: {type(exc).__name__}: {exc}") from exc
    for name, parameter in model.named_parameters():
        built, held = tuple(parameter.shape), shapes.get(name)
        if held is None:
            raise ModelFilesError(f"{where}: its model has a parameter {name} {built} the run's weights do not hold")
        if built != held:
            fields = [
                f"{_name(config, k)} = {v}"
                for k, v in sorted(config.to_dict().items())
                if isinstance(v, int) and not isinstance(v, bool) and v > 1 and v in built and v not in held
            ]
            raise ModelFilesError(
                f"{where}: {', '.join(fields) or 'its dimensions'} give {name} {list(built)}, but the run's weights "
                f"hold {list(held)}; refusing to build a model the weights do not fit"
            )


def _name(config: Any, setting: str) -> str:
    """`setting` as ``config.json`` spells it (GPT-2's ``n_embd`` for ``hidden_size``)."""
    return dict(getattr(config, "attribute_map", {})).get(setting, setting)


def _configured_files(cfg: LeewayConfig, path: Path | None) -> dict[str, bytes]:
    """The tokenizer and chat template this trainer uses (`path`: `model.tokenizer` on this machine), where the
    config names them apart from the checkpoint: they are what the generators must use too."""
    from actors.models import CHAT_TEMPLATE_FILES
    from pipeline.chat.template import load_chat_template

    out: dict[str, bytes] = {}
    if path is not None:
        out["tokenizer.json"] = (path / "tokenizer.json" if path.is_dir() else path).read_bytes()
        if path.is_dir():
            out.update({name: (path / name).read_bytes() for name in CHAT_TEMPLATE_FILES if (path / name).is_file()})
    if cfg.model.chat_template is not None:
        out["chat_template.jinja"] = load_chat_template(cfg.model.chat_template).encode()
    return out


def local_config(cfg: LeewayConfig, directory: Path) -> LeewayConfig:
    """`cfg` with the tokenizer and chat template it names read from the fetched `directory` (the run's copies)."""
    model = cfg.model
    update: dict[str, Any] = {}
    if model.tokenizer is not None and (directory / "tokenizer.json").is_file():
        update["tokenizer"] = str(directory)
    if model.chat_template is not None and (directory / "chat_template.jinja").is_file():
        update["chat_template"] = str(directory / "chat_template.jinja")
    return cfg.model_copy(update={"model": model.model_copy(update=update)}) if update else cfg


def needs_model_files(cfg: LeewayConfig) -> bool:
    """True for a generator whose checkpoint is not on this machine: it builds the model from the run's files."""
    from actors.models import is_preset

    return not is_preset(cfg.model.name_or_path) and not Path(cfg.model.name_or_path).is_dir()


def _read_manifest(store: ObjectStore, prefix: str) -> ModelFiles | None:
    key = prefix + "manifest.json"
    try:
        data = store.get_range(key, 0, MAX_MANIFEST_BYTES + 1)
    except ObjectNotFound:
        return None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ModelFilesError(f"{key}: over the cap of {MAX_MANIFEST_BYTES} bytes for a model files manifest")
    return ModelFiles.parse(data, key)


def _check_same(existing: ModelFiles, mine: ModelFiles, prefix: str) -> None:
    for name in SPEC_FIELDS:
        if existing.spec.get(name) != mine.spec.get(name):
            raise ModelFilesError(
                f"{prefix}manifest.json: the run was started with model.{name} = {existing.spec.get(name)!r}, "
                f"this trainer has {mine.spec.get(name)!r}"
            )
    for name in sorted(set(existing.files) | set(mine.files)):
        if existing.files.get(name) != mine.files.get(name):
            raise ModelFilesError(
                f"{prefix}{name}: the run's copy differs from this trainer's checkpoint (another model under the "
                "same run.name); purge the run or use another run.name"
            )
