"""The trainer's per-step metrics: one JSON line per step (TensorBoard / W&B when configured), and the
resume-time roll-back of records whose training was lost."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from pipeline.config import LeewayConfig

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
    }


class MetricsLog:
    """One JSON object per step in `path` (flushed per line), plus TensorBoard / W&B when configured.

    The file is always written: the live view, `leeway fleet status`, the resume roll-back and the
    run-directory guard of `leeway run` read it, so it is not optional (TensorBoard and W&B are extras).
    """

    def __init__(self, cfg: LeewayConfig, path: Path) -> None:
        self.path = path
        self._tb: SummaryWriter | None = None
        self._wandb: Any = None  # a wandb run; wandb is optional, so it stays untyped here
        path.parent.mkdir(parents=True, exist_ok=True)
        # tensorboard and wandb are optional packages: imported only when the config asks for them
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
        self._file = open(path, "ab")  # closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._file.flush()
        step = int(record["step"])
        if self._tb is not None:
            for key, value in _scalars(record).items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(_scalars(record), step=step)

    def close(self) -> None:
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
