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
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pipeline.config import LeewayConfig
from storage.objectstore import ObjectNotFound, ObjectStore, PreconditionFailed

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
SPEC_FIELDS = ("name_or_path", "revision")
"""The `model.*` fields a generator must share with the run's trainer."""


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
            return cls(spec=dict(raw["spec"]), files=files)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelFilesError(f"{key}: not a model files manifest ({exc})") from exc


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
    run's, fetch every file into `into` (checked by sha256) and return that directory."""
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
    into.mkdir(parents=True, exist_ok=True)
    for name, digest in sorted(manifest.files.items()):
        try:
            data = store.get(prefix + name)
        except ObjectNotFound:
            raise ModelFilesError(f"{prefix}{name}: named by the manifest but missing") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise ModelFilesError(f"{prefix}{name}: sha256 differs from the manifest's; the store copy is damaged")
        (into / name).write_bytes(data)
    log.info("built the model from the run's files under %s: %s", prefix, ", ".join(sorted(manifest.files)))
    return into


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
    try:
        return ModelFiles.parse(store.get(prefix + "manifest.json"), prefix + "manifest.json")
    except ObjectNotFound:
        return None


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
