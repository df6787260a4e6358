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


EVAL_LOG = "eval.jsonl"
"""The evaluator's results (`leeway eval --follow`), one JSON line per evaluated version, beside metrics.jsonl."""


def eval_scalars(record: dict[str, Any]) -> dict[str, float]:
    """One eval.jsonl record as ``eval/*`` scalars: ``eval/version``, ``eval/mean_reward``, ``eval/pass@1``,
    ``eval/pass@k``, ``eval/prompts``, ``eval/by_tag/<tag>``, ``eval/status/<status>``; a skipped version has none."""
    if "skipped" in record:
        return {}
    flat: dict[str, Any] = {f"eval/{k}": v for k, v in record.items() if not isinstance(v, dict)}
    for key in ("by_tag", "statuses"):
        name = "status" if key == "statuses" else key
        flat.update({f"eval/{name}/{k}": v for k, v in (record.get(key) or {}).items()})
    flat.pop("eval/temperature", None)
    flat.pop("eval/samples_per_prompt", None)
    return _scalars(flat)


class ScalarSinks:
    """TensorBoard (under `tb_dir`) and W&B, each when the config asks for it: the optional places scalars go
    beside a JSONL file. The trainer writes its steps into `<run.dir>/tb`; the evaluator its versions into
    `<run.dir>/tb/eval` and a W&B run of its own in the trainer's group (TensorBoard shows the two side by side)."""

    def __init__(self, cfg: LeewayConfig, tb_dir: Path, *, job_type: str = "train") -> None:
        self._tb: SummaryWriter | None = None
        self._wandb: Any = None  # a wandb run; wandb is optional, so it stays untyped here
        # tensorboard and wandb are optional packages: imported only when the config asks for them
        if cfg.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ValueError("logging.tensorboard = true needs the tensorboard package installed") from exc
            self._tb = SummaryWriter(str(tb_dir))
        if cfg.logging.wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise ValueError(
                    f"logging.wandb_project = {cfg.logging.wandb_project!r} needs wandb installed"
                ) from exc
            name = cfg.run.name if job_type == "train" else f"{cfg.run.name}-{job_type}"
            self._wandb = wandb.init(
                project=cfg.logging.wandb_project,
                name=name,
                group=cfg.run.name,
                job_type=job_type,
                config=cfg.model_dump(mode="json"),
                resume="allow",
            )

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class MetricsLog:
    """One JSON object per step in `path` (flushed per line), plus TensorBoard / W&B when configured.

    The file is always written: the live view, `leeway fleet status`, the resume roll-back and the
    run-directory guard of `leeway run` read it, so it is not optional (TensorBoard and W&B are extras).

    With `eval_path` (the run's eval.jsonl, written by the evaluator in another process), each step's record
    also carries the ``eval/*`` scalars of the newest evaluation that appeared since the step before (its
    ``eval/version`` says which policy was evaluated), so metrics.jsonl has the held-out curve too; TensorBoard
    and W&B get those from the evaluator itself, at the evaluated version, including the last one, which lands
    after the trainer's last step.
    """

    def __init__(self, cfg: LeewayConfig, path: Path, *, eval_path: Path | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._sinks = ScalarSinks(cfg, path.parent / "tb")
        self._eval_path = eval_path
        self._eval_offset = 0
        self._file = open(path, "ab")  # closed in close()

    def write(self, record: dict[str, Any]) -> None:
        record = {**record, **self._new_eval()}
        self._file.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._file.flush()
        self._sinks.log({k: v for k, v in _scalars(record).items() if not k.startswith("eval/")}, int(record["step"]))

    def _new_eval(self) -> dict[str, float]:
        """The scalars of the newest complete eval.jsonl line past what was read before (a line still being
        written waits for the next step)."""
        if self._eval_path is None or not self._eval_path.exists():
            return {}
        with self._eval_path.open("rb") as f:
            f.seek(self._eval_offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._eval_offset += len(complete)
        newest: dict[str, float] = {}
        for line in complete.splitlines():
            try:
                scalars = eval_scalars(orjson.loads(line))
            except (orjson.JSONDecodeError, TypeError, AttributeError):  # a torn line from a killed evaluator
                continue
            newest = scalars or newest
        return newest

    def close(self) -> None:
        self._file.close()
        self._sinks.close()


def roll_back_metrics(path: Path, step: int) -> int:
    """On resume: move the records of steps after `step` (whose training was lost) to
    `<stem>.rolled_back.jsonl` next to `path` (`metrics.rolled_back.jsonl` for the trainer's log); a torn last line
    (killed mid-write) goes there too.
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
        with open(path.with_name(f"{path.stem}.rolled_back.jsonl"), "ab") as handle:
            handle.write(b"".join(line + b"\n" for line in rolled_back))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in kept))
    tmp.replace(path)
    return len(rolled_back)


def replay_metrics_path(cfg: LeewayConfig) -> Path:
    """`<run.dir>/replays/<UTC start time>/metrics.jsonl`: each replay keeps its own record."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    return cfg.run.run_dir / "replays" / stamp / "metrics.jsonl"
