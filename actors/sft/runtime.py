"""`leeway sft CONFIG`: supervised fine-tuning into a checkpoint directory that a run then post-trains with RL.

    examples (sft.data, or the task's reference answers)  ──the trainer's backend──►  <output_dir>/
        model.safetensors, config.json, tokenizer (and chat template)   what model.name_or_path loads
        sft.jsonl (loss, lr, tokens/s)   eval.json (the task's eval split)   state/ (for --resume)

The model starts from ``sft.base_model`` (default ``model.name_or_path``) and trains with ``trainer.backend`` on
``trainer.device``, packed without padding, FSDP2 over ``--nproc`` ranks like the trainer
(`actors/trainer/distributed.py`); the tokenizer and chat template are the run's, so the checkpoint speaks the
ids the generators will sample. An existing result is never overwritten silently: `--resume` continues the
saved state, `--fresh` deletes it first, with `leeway run --fresh`'s guards (`actors/launcher/run_dir.py`): only
a real directory holding `SFT_MARKER` (written when this command created it), never the working directory, home,
`/` or a parent of them, never through a link.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from actors.launcher.run_dir import RunDirRefused, check_deletable, mark_new_dir
from actors.sft.examples import (
    ExampleError,
    ExampleSet,
    Renderer,
    examples_from_file,
    examples_from_task,
    within_limits,
)
from actors.sft.export import write_checkpoint
from actors.sft.loop import STATE_DIR, ResumeError, SftLoop
from actors.tools.evaluate import EVAL_FILE
from pipeline.config import LeewayConfig

log = logging.getLogger(__name__)

SFT_MARKER = ".leeway-sft"
"""Written into every sft.output_dir `leeway sft` creates; `--fresh` deletes only a directory holding it."""


def output_dir(cfg: LeewayConfig) -> Path:
    """``sft.output_dir``, or ``runs/<run.name>-sft``."""
    return cfg.sft.output_path or Path("runs") / f"{cfg.run.name}-sft"


def base_config(cfg: LeewayConfig) -> LeewayConfig:
    """The config whose model is the one SFT starts from (``sft.base_model``)."""
    if cfg.sft.base_model is None:
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": cfg.sft.base_model})})


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    """`leeway sft` once its config is loaded (its parser: `actors/sft/command.py`)."""
    from actors.trainer.distributed import RankEnv, launch_ranks

    nproc = args.nproc if args.nproc is not None else cfg.trainer.nproc
    if nproc < 1:
        raise SystemExit(f"leeway sft: --nproc {nproc} must be >= 1")
    rank_env = RankEnv.from_environ()
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        if args.fresh:  # once, here, before any rank looks for state
            try:
                _fresh(output_dir(cfg))
            except RunDirRefused as exc:
                print(f"leeway sft: {exc}", file=sys.stderr, flush=True)
                return 2
        argv = [a for a in args.argv if a != "--fresh"]
        return launch_ranks([sys.executable, "-m", "actors.cli", *argv], nproc, grace_s=cfg.stop_grace_s)
    logging.basicConfig(
        level=cfg.logging.level,
        format=f"%(asctime)s %(name)s{f' rank{rank_env.rank}' if rank_env.distributed else ''} %(levelname)s "
        "%(message)s",
    )
    try:
        return _main(cfg, args, rank_env)
    except (ExampleError, ResumeError) as exc:
        log.error("leeway sft: %s", exc)
        return 2


def _fresh(out: Path) -> None:
    """`--fresh`: delete `out` whole, only past the run directory's guards (`check_deletable`; raises
    `RunDirRefused`, having deleted nothing)."""
    if not (out.exists() or out.is_symlink()):
        return
    if check_deletable(out, marker=SFT_MARKER, command="leeway sft", setting="sft.output_dir"):
        log.info("leeway sft: --fresh: deleting %s", out)
        shutil.rmtree(out)


def _main(cfg: LeewayConfig, args: argparse.Namespace, rank_env: Any) -> int:
    """Refusals, data, model, training and export, then the summary line (rank 0 only)."""
    from actors.models import build_policy_model, load_chat_template_for, load_tokenizer
    from pipeline.tasks import task_for

    out = output_dir(cfg)
    refusal = _refusal(cfg, args, rank_env, out)
    if refusal is not None:
        log.error("leeway sft: %s", refusal)
        return 2
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.run.seed)
    task = task_for(cfg)
    tokenizer = load_tokenizer(cfg, task)
    template = load_chat_template_for(cfg, tokenizer, task)
    skipped: Counter[str] = Counter()
    rows, source = _rows(cfg, task, Renderer(tokenizer, template), skipped)
    model = build_policy_model(base_config(cfg), tokenizer)
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    vocab = model.get_input_embeddings().weight.shape[0]
    kept = within_limits(rows, vocab_size=vocab, max_tokens=int(positions or 1 << 30), skipped=skipped)
    if not kept:
        log.error("leeway sft: no example fits the model (left out: %s)", dict(skipped))
        return 2
    if skipped:
        log.warning("leeway sft: %d examples left out: %s", sum(skipped.values()), dict(skipped))
    loop, last, seconds = _train(
        cfg, args, rank_env, model, ExampleSet(kept, source, skipped), out, tokenizer, template
    )
    if not rank_env.is_leader:
        return 0
    summary: dict[str, Any] = {
        "output_dir": str(out),
        "examples": len(kept),
        "skipped": dict(skipped),
        "steps": loop.total,
        "train_seconds": seconds,
        "final_loss": last.get("loss"),
    }
    if cfg.sft.eval_at_end and not args.no_eval:
        summary["eval"] = _evaluate(cfg, out, task)
    print(json.dumps(summary), flush=True)
    return 0


def _refusal(cfg: LeewayConfig, args: argparse.Namespace, rank_env: Any, out: Path) -> str | None:
    """Why this command must not start (a config without data, a result it would overwrite), or None; a single
    process's `--fresh` deletes the old result here (several ranks: the launcher did, once)."""
    if (cfg.sft.data is None) == (not cfg.sft.from_task):
        return "set exactly one of sft.data (a JSONL/Parquet file) and sft.from_task: true"
    if args.fresh and not rank_env.distributed:
        try:
            _fresh(out)
        except RunDirRefused as exc:
            return str(exc)
    has_state = (out / STATE_DIR).is_dir() and any((out / STATE_DIR).glob("step-*"))
    if not args.resume and (has_state or (out / "model.safetensors").exists()):
        return (
            f"{out} already holds an SFT result or its state: --resume continues it, --fresh deletes it and "
            "starts over (or set sft.output_dir)"
        )
    return None


def _rows(cfg: LeewayConfig, task: Any, renderer: Renderer, skipped: Counter[str]) -> tuple[list[Any], str]:
    """The examples (`sft.data`'s rows, or the task's reference answers) and where they came from."""
    settings = cfg.sft
    if settings.from_task:
        rows = examples_from_task(
            task,
            renderer,
            task_name=cfg.task.name,
            system_prompt=cfg.task.system_prompt,
            max_examples=settings.max_examples,
            skipped=skipped,
        )
        return rows, f"task {cfg.task.name}"
    assert settings.data is not None
    return examples_from_file(settings.data, renderer, max_examples=settings.max_examples), settings.data


def _train(
    cfg: LeewayConfig,
    args: argparse.Namespace,
    rank_env: Any,
    model: Any,
    examples: ExampleSet,
    out: Path,
    tokenizer: Any,
    template: Any,
) -> tuple[SftLoop, dict[str, Any], float]:
    """Every rank: the steps on the backend, then the weights exported (rank 0 writes the checkpoint directory)."""
    from actors.trainer.backends import build_backend
    from actors.trainer.distributed import join_rank_group, leave_rank_group

    settings = cfg.sft
    model_config = model.config
    if rank_env.distributed:
        join_rank_group(rank_env, cfg.trainer.device, cfg.trainer.dist_timeout_s)
    try:
        backend = build_backend(cfg, model, lr=settings.lr, grad_clip=settings.grad_clip, temperature=1.0)
        loop = SftLoop(
            settings,
            backend,
            examples,
            out,
            seed=cfg.run.seed,
            rank=rank_env.rank,
            world_size=rank_env.world_size,
            barrier=_barrier if rank_env.distributed else (lambda: None),
        )
        if rank_env.is_leader:
            mark_new_dir(out, SFT_MARKER, "leeway sft")
            log.info(
                "leeway sft: %d examples from %s (%d tokens, %d to learn), %d steps of %d into %s",
                len(examples.examples),
                examples.source,
                sum(e.num_tokens for e in examples.examples),
                sum(e.num_loss_tokens for e in examples.examples),
                loop.total,
                settings.batch_examples,
                out,
            )
        if args.resume:
            loop.resume()
        started = time.perf_counter()
        last = loop.train()
        seconds = time.perf_counter() - started
        weights = backend.export_weights(torch.float32)  # every rank: a collective when sharded
        if rank_env.is_leader:
            written = write_checkpoint(out, weights, model_config, tokenizer, template)
            log.info("leeway sft: wrote %s to %s", ", ".join(written), out)
        loop.save_state()  # the finished state: --resume of a done run has nothing left to do
        backend.close()
    finally:
        if rank_env.distributed:
            leave_rank_group()
    return loop, last, seconds


def _evaluate(cfg: LeewayConfig, out: Path, task: Any) -> dict[str, Any] | None:
    from actors.tools.evaluate import evaluate_checkpoint

    prompts = task.eval_prompts()
    if not prompts:
        log.warning("leeway sft: task %r has no eval split: no evaluation at the end", cfg.task.name)
        return None
    torch.set_num_threads(cfg.engine.torch_threads)
    result = evaluate_checkpoint(cfg, out, task=task, prompts=prompts)
    (out / EVAL_FILE).write_text(json.dumps(result, indent=2) + "\n")
    log.info("leeway sft: eval pass@1 %s over %d held-out prompts", result.get("pass@1"), result.get("prompts"))
    return result


def _barrier() -> None:
    torch.distributed.barrier()
