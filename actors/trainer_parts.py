"""The pieces the trainer loop is wired from: model, weight publisher, prompt feed, metrics log, replay flags.

Each is built from the run's config here, so that `actors/trainer.py` reads as the loop alone and
`storage/` never has to know the config (it must not import `pipeline/`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import logging
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from pipeline.config import LeewayConfig
from pipeline.tasks import Prompt, Task, load_prompts

log = logging.getLogger("leeway.trainer")


# ---- model and weights ---------------------------------------------------------------------------------


def build_policy_model(cfg: LeewayConfig, task: Task) -> Any:
    """The trainable model (fp32, on the CPU), built exactly as the generator builds its engine's model.

    The tokenizer comes from `actors.generator.load_tokenizer` (``model.tokenizer``, else the task's,
    else the built-in char tokenizer), so both sides agree on the vocabulary and special tokens.
    """
    from actors.generator import load_tokenizer, special_token_id
    from actors.models import build_model

    tokenizer = load_tokenizer(cfg, task)
    vocab_size = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else len(tokenizer)
    return build_model(
        cfg.model.name_or_path,
        vocab_size=vocab_size,
        seed=cfg.run.seed,
        pad_token_id=special_token_id(tokenizer, ("<pad>", "<|pad|>")) or 0,
        bos_token_id=special_token_id(tokenizer, ("<bos>", "<s>")),
        eos_token_id=special_token_id(tokenizer, ("<eos>", "</s>")),
    )


def build_weight_publisher(cfg: LeewayConfig, store: Any, model: Any) -> Any:
    """A `storage.weights.WeightPublisher` for the run, from ``weights.*`` and ``model.dtype``."""
    from storage.manifest import config_hash
    from storage.weights import TORCH_DTYPES, WeightPublisher

    w = cfg.weights
    return WeightPublisher(
        store,
        cfg.run.name,
        model_config_hash=config_hash(model.config.to_dict()),
        dtype=TORCH_DTYPES[cfg.model.dtype],
        full_every=w.full_every,
        keep_versions=w.keep_versions,
        grace_s=w.grace_s,
        part_bytes=w.part_bytes,
        parallelism=w.parallelism,
    )


# ---- prompts -------------------------------------------------------------------------------------------


def admitted_prompt_id(prompt_id: str, index: int) -> str:
    """The id a prompt is admitted under: unique per run even when a task cycles its prompts."""
    return f"{prompt_id}.{index}"


class PromptFeed:
    """The run's prompts in admission order: the task's deterministic stream (or `task.prompts_file`,
    cycled), the i-th renamed `admitted_prompt_id(id, i)`. Built at `start` = prompts already
    admitted, so a resumed trainer re-admits exactly the ids it admitted after its checkpoint
    (the queue deduplicates them by `Nats-Msg-Id`) and then continues."""

    def __init__(self, cfg: LeewayConfig, task: Task, start: int) -> None:
        source: Iterator[Prompt]
        if cfg.task.prompts_file is not None:
            rows = load_prompts(cfg.task.prompts_file)
            if not rows:
                raise ValueError(f"task.prompts_file = {cfg.task.prompts_file!r}: no prompts")
            source = itertools.cycle(rows)
        else:
            source = task.prompts()
        self._prompts = itertools.islice(source, start, None)
        self.next_index = start

    def take(self, count: int) -> list[Prompt]:
        out = []
        for prompt in itertools.islice(self._prompts, count):
            out.append(replace(prompt, prompt_id=admitted_prompt_id(prompt.prompt_id, self.next_index)))
            self.next_index += 1
        return out


# ---- metrics -------------------------------------------------------------------------------------------


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
    }


class MetricsLog:
    """One JSON object per step in `path` (flushed per line), plus TensorBoard / W&B when configured."""

    def __init__(self, cfg: LeewayConfig, path: Path) -> None:
        self.path = path
        self._jsonl = cfg.logging.metrics_jsonl
        self._tb: Any = None
        self._wandb: Any = None
        path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ValueError("logging.tensorboard = true needs the tensorboard package installed") from exc
            self._tb = SummaryWriter(str(path.parent / "tb"))
        if cfg.logging.wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise ValueError(
                    f"logging.wandb_project = {cfg.logging.wandb_project!r} needs wandb installed"
                ) from exc
            self._wandb = wandb.init(
                project=cfg.logging.wandb_project, name=cfg.run.name, config=cfg.model_dump(mode="json"), resume="allow"
            )
        self._file = open(path, "ab") if self._jsonl else None  # closed in close()

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            self._file.flush()
        step = int(record["step"])
        if self._tb is not None:
            for key, value in _scalars(record).items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(_scalars(record), step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def roll_back_metrics(path: Path, step: int) -> int:
    """On resume: move the records of steps after `step` (whose training was lost) to
    `metrics.rolled_back.jsonl` next to `path`; a torn last line (killed mid-write) goes there too.
    Returns how many lines moved."""
    if not path.exists():
        return 0
    kept, rolled_back = [], []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            keep = int(orjson.loads(line)["step"]) <= step
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            keep = False
        (kept if keep else rolled_back).append(line)
    if rolled_back:
        with open(path.with_name("metrics.rolled_back.jsonl"), "ab") as handle:
            handle.write(b"".join(line + b"\n" for line in rolled_back))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in kept))
    tmp.replace(path)
    return len(rolled_back)


def replay_metrics_path(cfg: LeewayConfig) -> Path:
    """`<run.dir>/replays/<UTC start time>/metrics.jsonl`: each replay keeps its own record."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    return cfg.run.run_dir / "replays" / stamp / "metrics.jsonl"


# ---- replay flags --------------------------------------------------------------------------------------


def replay_selection(args: argparse.Namespace) -> Any:
    """The `leeway trainer --replay` selection flags (shared with `leeway replay`) as a `ReplaySelection`."""
    from actors.replay import selection_from_args

    if args.from_seq is None and args.since is None and args.min_version is None:
        raise ValueError("leeway trainer --replay needs --from-seq N, --since TIME or --min-version V")
    return selection_from_args(args)
