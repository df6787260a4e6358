"""The SFT loop: the trainer's backend fed with examples instead of scored groups, and its exact-resume state.

A step takes the next ``sft.batch_examples`` examples of an order drawn from ``run.seed`` per epoch (so step ``s``
always takes the same examples, and resuming needs only the step number), hands them to `TrainingBackend.train_step`
as `TrainSequence` records whose ``loss_mask`` covers the assistant's tokens, and minimises their mean negative
log-likelihood per assistant token (the backend's log-probs at temperature 1). The learning rate follows
`Schedule`: linear warm-up, then cosine or linear decay to ``min_lr_ratio * lr`` at the last step, or constant.

State (``<output_dir>/state/step-<N>/``): each rank's backend checkpoint (weights, AdamW, RNG: safetensors and
JSON, `actors/trainer/backends/checkpoint.py`) under ``rank-<R>/``, then ``progress.json`` written by rank 0 last
(a directory without it is incomplete and ignored). The two newest are kept.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from actors.sft.examples import ExampleSet
from actors.trainer.backends import LossExtras, MicroBatch, TrainBatch, TrainingBackend, TrainSequence
from actors.trainer.backends.checkpoint import decode_checkpoint, encode_checkpoint
from actors.trainer.metrics_log import roll_back_metrics
from pipeline.config_sections import SftConfig

log = logging.getLogger(__name__)

STATE_DIR = "state"
PROGRESS_FILE = "progress.json"
METRICS_FILE = "sft.jsonl"
KEEP_STATES = 2
STATE_FORMAT = 1


class ResumeError(ValueError):
    """Saved state that does not belong to this run (other data, steps or ranks); the message says which."""


@dataclass(frozen=True)
class Schedule:
    """The learning rate of update ``step`` (1-based) of ``total`` (see the module docstring)."""

    lr: float
    total: int
    warmup: int = 0
    kind: str = "cosine"
    min_ratio: float = 0.1

    def lr_at(self, step: int) -> float:
        if self.warmup and step <= self.warmup:
            return self.lr * step / self.warmup
        if self.kind == "constant":
            return self.lr
        span = max(1, self.total - self.warmup)
        done = min(1.0, (step - self.warmup) / span)
        shape = 0.5 * (1.0 + math.cos(math.pi * done)) if self.kind == "cosine" else 1.0 - done
        return self.lr * (self.min_ratio + (1.0 - self.min_ratio) * shape)


def total_steps(settings: SftConfig, num_examples: int) -> int:
    if settings.max_steps is not None:
        return settings.max_steps
    return max(1, math.ceil(settings.epochs * num_examples / settings.batch_examples))


def batch_indices(num_examples: int, batch: int, step: int, seed: int) -> list[int]:
    """The examples of step ``step`` (0-based): positions ``step*batch ..`` of the epochs' orders laid end to end."""
    out = []
    for position in range(step * batch, (step + 1) * batch):
        epoch, offset = divmod(position, num_examples)
        out.append(int(_epoch_order(num_examples, seed, epoch)[offset]))
    return out


_ORDERS: dict[tuple[int, int, int], np.ndarray] = {}


def _epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    key = (num_examples, seed, epoch)
    if key not in _ORDERS:
        if len(_ORDERS) > 4:
            _ORDERS.clear()
        _ORDERS[key] = np.random.default_rng([seed, epoch]).permutation(num_examples)
    return _ORDERS[key]


def sft_loss(logprobs: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
    """Mean negative log-likelihood per assistant token of the whole step (every micro-batch divides by the
    minibatch's count, so their sum is the step's mean)."""
    nll = -(logprobs * micro.loss_mask).sum()
    return nll / max(1, extras.minibatch_loss_tokens), {"nll_sum": float(nll.detach())}


class SftLoop:
    """Steps, state and metrics of one SFT run on one rank (rank 0 writes the shared files)."""

    def __init__(
        self,
        settings: SftConfig,
        backend: TrainingBackend,
        examples: ExampleSet,
        out_dir: Path,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.examples = examples
        self.out_dir = out_dir
        self.seed = seed
        self.rank, self.world_size, self.barrier = rank, world_size, barrier
        self.total = total_steps(settings, len(examples.examples))
        self.schedule = Schedule(
            settings.lr, self.total, settings.warmup_steps, settings.schedule, settings.min_lr_ratio
        )
        self.fingerprint = examples.fingerprint()
        self.step = 0

    # ---- state ---------------------------------------------------------------------------------

    def state_root(self) -> Path:
        return self.out_dir / STATE_DIR

    def newest_state(self) -> tuple[int, Path] | None:
        """The newest complete state (its progress.json written), or None."""
        found = []
        for path in self.state_root().glob("step-*"):
            if (path / PROGRESS_FILE).is_file() and path.name[5:].isdigit():
                found.append((int(path.name[5:]), path))
        return max(found) if found else None

    def save_state(self) -> Path:
        final = self.state_root() / f"step-{self.step:08d}"
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        self.barrier()
        files = encode_checkpoint(self.backend.state_tensors(), {"backend": self.backend.state_meta()})
        mine = partial / f"rank-{self.rank}"
        mine.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (mine / name).write_bytes(data)
        self.barrier()
        if self.rank == 0:
            progress = {
                "format": STATE_FORMAT,
                "step": self.step,
                "total_steps": self.total,
                "world_size": self.world_size,
                "examples": len(self.examples.examples),
                "fingerprint": self.fingerprint,
            }
            (partial / PROGRESS_FILE).write_text(json.dumps(progress))
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            for _, old in sorted(self._states())[:-KEEP_STATES]:
                shutil.rmtree(old, ignore_errors=True)
        self.barrier()
        return final

    def _states(self) -> list[tuple[int, Path]]:
        return [
            (int(p.name[5:]), p)
            for p in self.state_root().glob("step-*")
            if p.name[5:].isdigit() and (p / PROGRESS_FILE).is_file()
        ]

    def resume(self) -> int:
        """Load the newest state; returns its step (0 when there is none). `ResumeError` when it is another run's."""
        newest = self.newest_state()
        if newest is None:
            return 0
        step, path = newest
        progress = json.loads((path / PROGRESS_FILE).read_text())
        for key, mine in (("fingerprint", self.fingerprint), ("world_size", self.world_size)):
            if progress.get(key) != mine:
                what = "the examples (sft.data / sft.from_task / the task)" if key == "fingerprint" else "--nproc"
                raise ResumeError(
                    f"{path}: saved over other {what} than this run's ({key} {progress.get(key)!r} != {mine!r}); "
                    "start over with --fresh, or use another sft.output_dir"
                )
        files = {p.name: p.read_bytes() for p in (path / f"rank-{self.rank}").iterdir()}
        tensors, meta = decode_checkpoint(files)
        self.backend.load_state(tensors, meta["backend"])
        self.step = step
        if self.rank == 0 and (moved := roll_back_metrics(self.out_dir / METRICS_FILE, step)):
            log.info("sft: moved %d records of steps after %d to sft.rolled_back.jsonl", moved, step)
        log.info("sft: resumed from %s (step %d of %d)", path, step, self.total)
        return step

    # ---- training ------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Steps from `self.step` to the total; returns the last logged record."""
        examples = self.examples.examples
        started = time.perf_counter()
        window_tokens, window_start = 0, started
        last: dict[str, Any] = {}
        bar = _progress_bar(self.total, self.step) if self.rank == 0 else None
        metrics = (self.out_dir / METRICS_FILE).open("a") if self.rank == 0 else None
        try:
            while self.step < self.total:
                chosen = batch_indices(len(examples), self.settings.batch_examples, self.step, self.seed)
                batch = TrainBatch(tuple(_sequence(examples[i]) for i in chosen))
                lr = self.schedule.lr_at(self.step + 1)
                self.backend.set_learning_rate(lr)
                result = self.backend.train_step(batch, sft_loss)
                self.step += 1
                window_tokens += batch.num_tokens
                now = time.perf_counter()
                if bar is not None:
                    bar.set_postfix(
                        loss=f"{result.loss:.4f}", tok_s=f"{window_tokens / max(now - window_start, 1e-9):.0f}"
                    )
                    bar.update(1)
                if self.step % self.settings.log_every == 0 or self.step == self.total:
                    last = {
                        "step": self.step,
                        "total_steps": self.total,
                        "loss": result.loss,
                        "grad_norm": result.grad_norm,
                        "lr": lr,
                        "loss_tokens": result.num_loss_tokens,
                        "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                        "elapsed_s": now - started,
                    }
                    window_tokens, window_start = 0, now
                    if metrics is not None:
                        metrics.write(json.dumps(last) + "\n")
                        metrics.flush()
                    if bar is None and self.rank == 0:
                        log.info(
                            "sft step %d/%d loss %.4f lr %.2e %.0f tok/s",
                            self.step,
                            self.total,
                            result.loss,
                            lr,
                            last["tokens_per_s"],
                        )
                if self.step % self.settings.checkpoint_every == 0 and self.step < self.total:
                    self.save_state()
        finally:
            if bar is not None:
                bar.close()
            if metrics is not None:
                metrics.close()
        return last


def _sequence(example: Any) -> TrainSequence:
    n = example.num_tokens
    return TrainSequence(
        tokens=example.tokens,
        loss_mask=example.loss_mask.astype(np.int8),
        behaviour_logprobs=np.zeros(n, np.float32),
        versions=np.full(n, -1, np.int64),
        advantage=1.0,
        sample_id=example.example_id,
    )


def _progress_bar(total: int, initial: int) -> Any:
    """A tqdm bar on a terminal (loss and tokens/s in its postfix); None elsewhere (log lines instead)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="sft", unit="step", file=sys.stderr, dynamic_ncols=True)
