"""`leeway export CONFIG [--version V] --to DIR [--dtype D]`: a published policy version as a Hugging Face checkpoint.

    store: <run>/weights/v<A> (full) ─► v<A+1> (delta) ─► ... ─► v<V>      every tensor's sha256 checked per version
           <run>/model/* (a checkpoint run's files)  or  the preset the config names
        ──► <DIR's parent>/.<DIR>.leeway-export-<id>/   model*.safetensors (+ index), config.json,
                                                        generation_config.json, tokenizer files, leeway.json
        ──rename──► DIR

The weights are rebuilt from the store alone: the newest full snapshot at or before V and the deltas after it,
pulled by the generators' own code (`storage.subscriber.WeightSubscriber`, one version at a time, so each step is
reported), so the exported tensors are version V's bit for bit in the dtype they were published in (``--dtype``
converts). `actors/tools/export_sources.py` supplies the model config, tokenizer and chat template as the run used
them; `actors/tools/hf_checkpoint.py` writes the directory. ``leeway.json`` names the run, the version, the step
that published it (from ``<run.dir>/metrics.jsonl``, null when that file does not have it), the chain and every
tensor's and file's sha256.

Refused, with a message naming what is missing and nothing written into DIR: a version the store does not hold, a
chain the store lacks (a manifest or part pruned or damaged: the version and tensor are named), and a DIR that holds
anything but an earlier `leeway export` (which is replaced whole). The checkpoint is assembled in a directory beside
DIR and renamed into place at the end, so a failure leaves DIR as it was.

`leeway run` ends by running this command into ``<run.dir>/final/``; ``trainer.export_every`` runs it for every N-th
version into ``<run.dir>/exports/v<V>/`` (`actors/trainer/export_every.py`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.cli_args import WithConfig, add_config_arguments
from actors.tools.export_weights import ExportError
from pipeline.config import LeewayConfig

log = logging.getLogger(__name__)

INFO_FILE = "leeway.json"
"""What marks a directory as a `leeway export`: run, version, step, chain and hashes."""
INFO_FORMAT = 1
DTYPE_CHOICES = ("bfloat16", "float16", "float32")

Say = Callable[[str], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`leeway export`'s description, flags and handler."""
    parser.description = (
        "Writes one published policy version of the run as a Hugging Face checkpoint directory that "
        "AutoModelForCausalLM.from_pretrained, AutoTokenizer, vLLM and SGLang load: model.safetensors (sharded past "
        "--max-shard-size, with model.safetensors.index.json), config.json, generation_config.json listing every "
        "stop token, the tokenizer files and chat template the run used, and leeway.json (run, version, step, "
        "hashes). The weights come from the run's store alone: the newest full snapshot at or before the version "
        "and the deltas after it, every tensor checked against each version's manifest hash. DIR must be new, "
        "empty, or an earlier leeway export (replaced whole); nothing is left in it when the export fails."
    )
    add_config_arguments(parser)
    parser.add_argument("--version", type=int, default=None, help="the published version to export (default: LATEST)")
    parser.add_argument("--to", required=True, metavar="DIR", help="the checkpoint directory to write")
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default=None, help="write the weights in this dtype (default: as published)"
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file before the weights are split into shards with an index (default: 5GB)",
    )
    parser.set_defaults(handler=WithConfig(main))


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    # A stop (the launcher's second Ctrl-C, a trainer closing its background exports) unwinds like an error: the
    # staging directory beside DIR is removed by `export_version`'s cleanup instead of being left half written.
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return _main(cfg, args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    from actors.servers import ServerError, open_run_store, resolve_servers

    out = Path(args.to)
    try:
        check_destination(out)
        store = open_run_store(cfg, resolve_servers(cfg, nats=False))
    except (ExportError, ServerError) as exc:
        print(f"leeway export: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        info = export_version(
            cfg, store, out, version=args.version, dtype=args.dtype, max_shard_size=args.max_shard_size, say=_say
        )
    except ExportError as exc:
        print(f"leeway export: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        store.close()
    print(
        f"leeway export: version {info['version']} of run {info['run']!r} written to {out} "
        f"({info['dtype']}, {len(info['files'])} files); load it with AutoModelForCausalLM.from_pretrained({str(out)!r})",
        flush=True,
    )
    return 0


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _say(text: str) -> None:
    print(f"leeway export: {text}", file=sys.stderr, flush=True)


def check_destination(out: Path) -> None:
    """DIR may be new, empty, or an earlier export holding only its own files; anything else is refused."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--to {out} is a file, not a directory")
    if not out.is_dir():
        return
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    info = read_info(out)
    if info is None:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ExportError(
            f"--to {out} holds other files ({shown}) and no {INFO_FILE}: leeway export writes only into a new or "
            "empty directory, or over an earlier leeway export"
        )
    foreign = sorted(set(names) - set(info.get("files", {})) - {INFO_FILE})
    if foreign:
        raise ExportError(
            f"--to {out} is an earlier leeway export with other files added ({', '.join(foreign[:5])}); "
            "move them out first, or export elsewhere"
        )


def read_info(directory: Path) -> dict[str, Any] | None:
    """The directory's `leeway.json`, or None when it has none (or it is not one of ours)."""
    try:
        info = json.loads((directory / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("format") == INFO_FORMAT else None


def export_version(
    cfg: LeewayConfig,
    store: Any,
    out: Path,
    *,
    version: int | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    say: Say = log.info,
) -> dict[str, Any]:
    """Write version `version` (default: LATEST) of the run into `out`; returns what `leeway.json` holds.
    `ExportError` names what is missing; `out` is then as it was."""
    from actors.model_files import ModelFilesError
    from actors.tools.export_sources import run_model_sources
    from actors.tools.export_weights import pull_version
    from actors.tools.hf_checkpoint import write_checkpoint
    from storage.weights_base import TORCH_DTYPES

    started = time.monotonic()
    check_destination(out)
    tensors, manifest, chain = pull_version(store, cfg, version, say)
    published_dtype = manifest.tensors[0].dtype if manifest.tensors else cfg.model.dtype
    if dtype is not None and dtype != published_dtype:
        tensors = {name: t.to(TORCH_DTYPES[dtype]) for name, t in tensors.items()}
    try:
        sources = run_model_sources(cfg, store)
    except ModelFilesError as exc:
        raise ExportError(f"the run's model files: {exc}") from exc
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.leeway-export-{uuid.uuid4().hex[:12]}"
    try:
        say(f"writing version {manifest.version} as a Hugging Face checkpoint into {out}")
        write_checkpoint(
            staging,
            tensors,
            sources.config,
            sources.tokenizer,
            sources.template,
            max_shard_size=max_shard_size,
            files=sources.files,
            generation=sources.generation,
        )
        info = {
            "format": INFO_FORMAT,
            "run": cfg.run.name,
            "version": manifest.version,
            "step": step_of(cfg.run.run_dir / "metrics.jsonl", manifest.version),
            "model": {"name_or_path": cfg.model.name_or_path, "revision": cfg.model.revision},
            "published_dtype": published_dtype,
            "dtype": dtype or published_dtype,
            "chain": list(chain),
            "model_config_hash": manifest.model_config_hash,
            "publish_id": manifest.publish_id,
            "published_at": manifest.published_at,
            "tensor_hashes": {t.name: t.hash for t in manifest.tensors},
            "files": {p.name: _file_hash(p) for p in sorted(staging.iterdir()) if p.is_file()},
        }
        (staging / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
        _swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"version {manifest.version} exported to {out} in {time.monotonic() - started:.1f} s")
    return info


def step_of(metrics: Path, version: int) -> int | None:
    """The trainer step that published `version` (its metrics.jsonl record), 0 for version 0, else None."""
    if version == 0:
        return 0
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("version") == version and isinstance(record.get("step"), int):
            return int(record["step"])
    return None


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _swap_in(staging: Path, out: Path) -> None:
    """Put the finished `staging` at `out`; an earlier export there (or an empty directory) is replaced whole."""
    if not out.exists():
        staging.rename(out)
        return
    check_destination(out)  # nothing foreign appeared meanwhile
    old = out.parent / f".{out.name}.leeway-old-{uuid.uuid4().hex[:12]}"
    out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)
