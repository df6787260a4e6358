"""`leeway bench trainer`: the training backend against a plain Hugging Face loop, same model, batch and optimizer.

    config (--config, --model, --device, --backend, --set) ─► build_policy_model (same spec and seed, twice)
      ├─► plain loop: padded micro-batches in batch order, HF ``labels`` loss, AdamW
      └─► build_backend (as the trainer builds it) ─► train_step(batch, CorrectedObjective)
    each: --warmup unmeasured steps, then --steps measured ones

On the CPU the two alternate step by step, so a busy neighbour slows both alike. On CUDA the plain
loop runs to the end first and is freed (see `_measure`: memory, and liger-kernel's RoPE patch).

The batch is ``--sequences`` random sequences with lengths drawn uniformly from
``[--min-tokens, --max-tokens]`` (seeded); the first quarter of each is prompt, the rest is trained.
Both contenders see the same batch, the same micro-batch token budget (the plain loop packs
consecutive sequences while ``rows x longest`` fits it) and the same autocast (bf16 on CUDA). A step
is timed from its start to its end with the device synchronised; ``step_s`` is the median over the
measured steps of the backend, and the headline is the same-run ratio ``trainer_vs_plain``.

MFU convention: ``6 * N * tokens_per_s / peak``, with ``N`` the parameters that multiply activations
(everything except the input and position embedding tables, which are lookups; the LM head counts),
``tokens_per_s`` the real (unpadded) tokens of the batch per second, and the peak the device's dense
bf16 FLOP/s from `PEAK_FLOPS`. Attention's ``seq**2`` FLOPs are not counted, as in the issue's figures.
On the CPU, or on a GPU not in the table, ``mfu`` is null. ``padding_fraction`` is the share of
padding in the plain loop's micro-batches (what packing saves). ``max_memory_gib`` is the backend's
peak CUDA memory allocated during its steps, or the process's peak resident memory on the CPU.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from actors.cli_args import add_set_argument, positive_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from actors.trainer.backends import TrainBatch
    from pipeline.config import LeewayConfig

DEFAULT_CONFIG = "configs/demo.yaml"
PEAK_FLOPS: dict[str, float] = {
    "H100": 989e12,
    "H200": 989e12,
    "GH200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
}
"""Dense bf16 peak FLOP/s per device, matched against ``torch.cuda.get_device_name`` (longest name first)."""
CUDA_SIZES = {"sequences": 32, "min_tokens": 512, "max_tokens": 2048, "micro_batch_tokens": 16384}
"""The default batch on CUDA: the issue's 32 sequences of 512-2048 tokens, 16k tokens per micro-batch."""
CPU_SIZES = {"sequences": 32, "min_tokens": 32, "max_tokens": 128}
"""The default batch on the CPU: short enough for the demo's tiny model to finish well within a minute."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help="config the backend is built from (default: the CPU demo)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model spec: a preset, the GPU shape llama-1.4b, or a local checkpoint directory "
        "(default: the config's model.name_or_path, the demo's tiny-gpt2-2x64)",
    )
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: trainer.device)")
    parser.add_argument(
        "--backend", default=None, help="training backend, e.g. torch or megatron (default: trainer.backend)"
    )
    parser.add_argument(
        "--sequences",
        type=positive_int,
        default=None,
        help=f"sequences per step (default: {CUDA_SIZES['sequences']} on CUDA and on the CPU)",
    )
    parser.add_argument(
        "--min-tokens",
        type=positive_int,
        default=None,
        help=f"shortest sequence (default: {CUDA_SIZES['min_tokens']} on CUDA, {CPU_SIZES['min_tokens']} on the CPU)",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help=f"longest sequence (default: {CUDA_SIZES['max_tokens']} on CUDA, {CPU_SIZES['max_tokens']} on the CPU; "
        "never past the model's context)",
    )
    parser.add_argument(
        "--micro-batch-tokens",
        type=positive_int,
        default=None,
        help=f"token budget of a micro-batch, both contenders (default: {CUDA_SIZES['micro_batch_tokens']} on CUDA, "
        "trainer.micro_batch_tokens on the CPU)",
    )
    parser.add_argument("--steps", type=positive_int, default=3, help="measured optimizer steps per contender")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (allocator, kernels)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch's lengths and tokens")
    add_set_argument(parser, help="config override, e.g. trainer.packing=false (repeatable)")


def _progress(message: str) -> None:
    print(f"[bench trainer] {message}", file=sys.stderr, flush=True)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of ``device`` from `PEAK_FLOPS`; None on the CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS[key]
    return None


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that multiply activations: all but embedding tables (see the module docstring)."""
    lookups = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in lookups)


def make_batch(lengths: list[int], vocab: int, seed: int) -> TrainBatch:
    """Random tokens; the first quarter of each sequence is prompt, the rest trained with a random advantage."""
    from actors.trainer.backends import TrainBatch, TrainSequence

    rng = np.random.default_rng(seed + 1)
    seqs = []
    for n in lengths:
        mask = np.zeros(n, np.uint8)
        mask[max(1, n // 4) :] = 1
        seqs.append(
            TrainSequence(
                tokens=rng.integers(0, vocab, n).astype(np.int32),
                loss_mask=mask,
                behaviour_logprobs=np.where(mask == 1, -float(np.log(vocab)), 0.0).astype(np.float32),
                versions=np.where(mask == 1, 0, -1).astype(np.int32),
                advantage=float(rng.normal()),
            )
        )
    return TrainBatch(tuple(seqs))


def plain_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive sequences, in batch order, while ``rows x longest`` fits the budget (one at least)."""
    packs: list[list[int]] = []
    longest = 0
    for index, n in enumerate(lengths):
        if packs and (len(packs[-1]) + 1) * max(longest, n) <= budget:
            packs[-1].append(index)
            longest = max(longest, n)
        else:
            packs.append([index])
            longest = n
    return packs


def padding_fraction(lengths: list[int], packs: list[list[int]]) -> float:
    padded = sum(len(p) * max(lengths[i] for i in p) for p in packs)
    return 1.0 - sum(lengths) / padded


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(steps: dict[str, Callable[[], None]], device: torch.device, warmup: int, rounds: int) -> dict[str, float]:
    """Median seconds per contender: ``warmup`` unmeasured calls each, then ``rounds`` rounds that
    call every contender once in turn (so load from other processes hits them alike)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
            _progress(f"{name} step {index + 1}/{rounds}: {times[name][-1]:.3f} s")
    return {name: statistics.median(values) for name, values in times.items()}


def _plain_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    packs: list[list[int]],
    device: torch.device,
    autocast: bool,
    grad_clip: float,
) -> None:
    """One step of the textbook loop: padded micro-batches, HF's shifted cross-entropy, clip, AdamW."""
    seqs = batch.sequences
    total = sum(int(s.loss_mask[1:].sum()) for s in seqs)
    for pack in packs:
        width = max(seqs[i].num_tokens for i in pack)
        ids = torch.zeros(len(pack), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for row, i in enumerate(pack):
            n = seqs[i].num_tokens
            ids[row, :n] = torch.from_numpy(seqs[i].tokens.astype(np.int64))
            mask[row, :n] = 1
            trained = torch.from_numpy(seqs[i].loss_mask != 0)
            labels[row, :n] = torch.where(trained, ids[row, :n], -100)
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        context = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else _null()
        with context:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        tokens = int((labels[:, 1:] != -100).sum())
        (loss * (tokens / max(1, total))).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _config(args: argparse.Namespace) -> LeewayConfig:
    from pipeline.config import load_config

    overrides = list(args.overrides)
    if args.model is not None:
        overrides.append(f"model.name_or_path={args.model}")
    if args.device is not None:
        overrides.append(f"trainer.device={args.device}")
    if args.backend is not None:
        overrides.append(f"trainer.backend={args.backend}")
    base = load_config(args.config, overrides)
    device = torch.device(base.trainer.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {base.trainer.device}: torch sees no CUDA device here")
    budget = args.micro_batch_tokens or (CUDA_SIZES["micro_batch_tokens"] if device.type == "cuda" else None)
    if budget is not None:
        overrides.append(f"trainer.micro_batch_tokens={budget}")
    return load_config(args.config, overrides)


def _lengths(args: argparse.Namespace, device: torch.device, context: int) -> list[int]:
    sizes = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    count = args.sequences or sizes["sequences"]
    low = min(args.min_tokens or sizes["min_tokens"], context)
    high = min(args.max_tokens or sizes["max_tokens"], context)
    if low > high:
        raise ValueError(f"--min-tokens {low} is above --max-tokens {high}")
    if high < 2:
        raise ValueError("sequences need at least 2 tokens (one prompt token, one trained)")
    low = max(low, 2)
    return np.random.default_rng(args.seed).integers(low, high + 1, count).tolist()


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _plain_contender(
    cfg: LeewayConfig,
    model: PreTrainedModel,
    batch: TrainBatch,
    packs: list[list[int]],
    device: torch.device,
    autocast: bool,
) -> Callable[[], None]:
    """One step of the plain loop (fp32 weights, AdamW with the trainer's settings), ready to time."""
    t = cfg.trainer
    model = model.to(device=device, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=tuple(t.betas), eps=t.adam_eps, weight_decay=t.weight_decay
    )
    return lambda: _plain_step(model, optimizer, batch, packs, device, autocast, t.grad_clip)


def _backend_contender(cfg: LeewayConfig, model: PreTrainedModel, batch: TrainBatch) -> Callable[[], None]:
    """One ``train_step`` of the backend built as the trainer builds it, with the trainer's objective."""
    from actors.trainer.backends import build_backend
    from actors.trainer.objective import CorrectedObjective

    backend = build_backend(cfg, model)
    objective = CorrectedObjective(cfg.correction, cfg.advantages, version=0, constant_tokens=batch.num_loss_tokens)
    return lambda: backend.train_step(batch, objective)  # type: ignore[func-returns-value]


def _measure(
    cfg: LeewayConfig,
    first: PreTrainedModel,
    build: Callable[[], PreTrainedModel],
    batch: TrainBatch,
    packs: list[list[int]],
    device: torch.device,
    args: argparse.Namespace,
) -> tuple[float, float, float]:
    """(plain step s, backend step s, peak memory GiB); ``first`` is the plain loop's model, ``build``
    makes the backend's (the same weights: same spec and seed).

    On the CPU both contenders live at once and alternate, step by step. On CUDA the plain loop
    runs to the end first and is freed: two 1.4B models with AdamW state would crowd the device,
    and liger-kernel (``trainer.fused_kernels``) patches transformers' Llama RoPE for every CUDA
    model of the process, which would fuse the baseline too.
    """
    autocast = device.type == "cuda" and torch.cuda.is_bf16_supported()  # the backend's default rule
    if device.type != "cuda":
        plain = _plain_contender(cfg, first, batch, packs, device, autocast)
        backend = _backend_contender(cfg, build(), batch)
        times = _timed({"plain": plain, "backend": backend}, device, args.warmup, args.steps)
        return times["plain"], times["backend"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB
    plain = _plain_contender(cfg, first, batch, packs, device, autocast)
    plain_s = _timed({"plain": plain}, device, args.warmup, args.steps)["plain"]
    del plain  # with it the optimizer state; the weights go back to the CPU
    first.to("cpu")
    _release(device)
    backend = _backend_contender(cfg, build(), batch)
    torch.cuda.reset_peak_memory_stats(device)
    step_s = _timed({"backend": backend}, device, args.warmup, args.steps)["backend"]
    return plain_s, step_s, torch.cuda.max_memory_allocated(device) / 2**30


def run(args: argparse.Namespace) -> dict[str, Any]:
    from actors.models import build_policy_model, load_tokenizer
    from pipeline.tasks import task_for

    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    cfg = _config(args)
    device = torch.device(cfg.trainer.device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.trainer.torch_threads)
    tokenizer = load_tokenizer(cfg, task_for(cfg))
    model = build_policy_model(cfg, tokenizer)
    vocab = model.get_input_embeddings().num_embeddings
    context = int(getattr(model.config, "max_position_embeddings", 0) or getattr(model.config, "n_positions", 0))
    lengths = _lengths(args, device, context)
    batch = make_batch(lengths, vocab, args.seed)
    tokens = sum(lengths)
    params = matmul_params(model)
    peak = peak_flops(device)
    _progress(
        f"{cfg.model.name_or_path} ({params / 1e6:.1f}M matmul params) on {device}, {len(lengths)} sequences, "
        f"{tokens} tokens, micro-batch budget {cfg.trainer.micro_batch_tokens}, backend {cfg.trainer.backend}"
    )

    packs = plain_micro_batches(lengths, cfg.trainer.micro_batch_tokens)
    plain_s, step_s, max_memory = _measure(
        cfg, model, lambda: build_policy_model(cfg, tokenizer), batch, packs, device, args
    )
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    tokens_per_s = tokens / step_s
    plain_tokens_per_s = tokens / plain_s
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": cfg.model.name_or_path,
        "params": params,
        "world_size": world_size,
        "tokens_per_step": tokens,
        "padding_fraction": round(padding_fraction(lengths, packs), 4),
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": None if peak is None else 6 * params * tokens_per_s / (peak * world_size),
        "plain_tokens_per_s": plain_tokens_per_s,
        "plain_mfu": None if peak is None else 6 * params * plain_tokens_per_s / (peak * world_size),
        "trainer_vs_plain": tokens_per_s / plain_tokens_per_s,
        "max_memory_gib": max_memory,
    }
