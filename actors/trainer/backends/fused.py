"""Exact memory and speed savings of the torch backend: a chunked LM head and liger-kernel layers.

Chunked LM head (`chunked_token_logprobs`): the trainer needs, per token, the log-prob of the
chosen next token under ``log_softmax(logits / temperature)`` and the entropy of that distribution,
never the logits themselves. The full ``[tokens, vocab]`` fp32 logits of a 16k-token micro-batch
with a 32k vocabulary are 2 GiB, plus as much again for their gradient. `ChunkedTokenLogprobs`
computes both quantities a chunk of tokens at a time, keeps only the per-token log-sum-exp, and
recomputes each chunk's logits in the backward pass, so at most one chunk's logits exist at any
time. The arithmetic is that of the plain path (same matmul dtype, fp32 softmax), so the results
agree to float rounding.

liger-kernel (`apply_fused_kernels`, optional extra ``gpu``): Triton RoPE, RMSNorm and SwiGLU for
the model families liger supports. Its cross-entropy kernels are not used (the trainer needs
log-probs and entropy, not a loss). It is imported only when asked for.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 4096
"""Tokens per LM-head chunk on CUDA: 4096 x 32k vocabulary x 4 bytes = 512 MiB of fp32 logits at a time."""

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of models whose logits are not ``lm_head(hidden)``; the chunked head refuses them."""


def resolve_chunk_tokens(setting: int | None, device: torch.device) -> int:
    """``trainer.lm_head_chunk_tokens``: None means `DEFAULT_CHUNK_TOKENS` on CUDA and off (0) elsewhere."""
    if setting is None:
        return DEFAULT_CHUNK_TOKENS if device.type == "cuda" else 0
    return int(setting)


def check_chunked_head(model: PreTrainedModel) -> None:
    """Raise ValueError when the model's logits are more than its output embedding applied to the
    final hidden states (soft-capping, scaling), which the chunked head would silently drop."""
    config = model.config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"model config {name}={value}: the chunked LM head computes lm_head(hidden) only; "
                "set trainer.lm_head_chunk_tokens: 0"
            )
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"the chunked LM head needs an nn.Linear output embedding, got {type(head).__name__}")


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(hidden [M, H], weight [V, H], bias [V] | None, targets [M])`` -> ``(logp [M], entropy [M])``.

    ``logp`` is differentiable in ``hidden``, ``weight`` and ``bias``; ``entropy`` is not (the
    trainer's entropy is a detached metric). Matmuls run in ``compute_dtype`` (bf16 under autocast),
    softmax in fp32, as in the plain path.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        inv_temperature: float,
        chunk_tokens: int,
        compute_dtype: torch.dtype,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        w = weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        logp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(logp)
        lse = torch.empty_like(logp)
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = start + chunk_tokens
            logits = _chunk_logits(hidden[start:end], w, b, inv_temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[start:end] = chunk_lse
            logp[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - chunk_lse
            if with_entropy:
                probs = torch.exp(logits - chunk_lse[:, None])
                entropy[start:end] = chunk_lse - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.inv_temperature, ctx.chunk_tokens, ctx.compute_dtype = inv_temperature, chunk_tokens, compute_dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, _grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        cd, inv_t = ctx.compute_dtype, ctx.inv_temperature
        w = weight.to(cd)
        b = None if bias is None else bias.to(cd)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = start + ctx.chunk_tokens
            h = hidden[start:end]
            logits = _chunk_logits(h, w, b, inv_t)
            g = grad_logp[start:end].float()
            # d logp / d logits = onehot(target) - softmax; times 1/T for the tempered logits.
            dlogits = torch.exp(logits - lse[start:end, None]).mul_(-g[:, None])
            dlogits.scatter_add_(-1, targets[start:end, None], g[:, None])
            dlogits = dlogits.mul_(inv_t).to(cd)
            if grad_hidden is not None:
                grad_hidden[start:end] = (dlogits @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (dlogits.t() @ h.to(cd)).float()
            if grad_bias is not None:
                grad_bias += dlogits.float().sum(0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, inv_temperature: float) -> Tensor:
    logits = nn.functional.linear(hidden.to(weight.dtype), weight, bias)
    return logits.float() * inv_temperature if inv_temperature != 1.0 else logits.float()


def chunked_token_logprobs(
    hidden: Tensor,
    head: nn.Linear,
    targets: Tensor,
    *,
    temperature: float,
    chunk_tokens: int,
    compute_dtype: torch.dtype,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """Per-token ``log_softmax(head(hidden) / temperature)[target]`` (with grad) and entropy (detached)."""
    if chunk_tokens < 1:
        raise ValueError(f"trainer.lm_head_chunk_tokens={chunk_tokens} must be >= 1 for the chunked head")
    logp, entropy = ChunkedTokenLogprobs.apply(
        hidden, head.weight, head.bias, targets, 1.0 / temperature, chunk_tokens, compute_dtype, with_entropy
    )
    return logp, (entropy if with_entropy else None)


FusedSetting = Literal["auto", "on", "off"]


def apply_fused_kernels(model: PreTrainedModel, setting: FusedSetting, device: torch.device) -> bool:
    """Patch ``model`` with liger-kernel RoPE, RMSNorm and SwiGLU; returns whether it did.

    ``auto``: only on CUDA, only when liger-kernel is installed and supports the model type.
    ``on``: raises ValueError when any of that is not so (asked for, so never silently off).
    What liger changes beyond this model is narrowed to the RoPE function for CUDA tensors
    (`_contain_module_patch`).
    """
    if setting == "off":
        return False
    if setting not in ("auto", "on"):
        raise ValueError(f"trainer.fused_kernels={setting!r} must be 'auto', 'on' or 'off'")
    strict = setting == "on"
    if device.type != "cuda":
        if strict:
            raise ValueError(f"trainer.fused_kernels: on needs a CUDA device (trainer.device is {device})")
        return False
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        if strict:
            raise ValueError(
                "trainer.fused_kernels: on needs liger-kernel; install the gpu extra (pip install 'leeway[gpu]')"
            ) from err
        log.info("liger-kernel is not installed: fused kernels off")
        return False
    model_type = getattr(model.config, "model_type", None)
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply_fn is None:
        if strict:
            raise ValueError(f"trainer.fused_kernels: on, but liger-kernel does not support model type {model_type!r}")
        log.info("liger-kernel does not support model type %r: fused kernels off", model_type)
        return False
    wanted = {
        "rope": True,
        "rms_norm": True,
        "swiglu": True,
        "cross_entropy": False,
        "fused_linear_cross_entropy": False,
        "model": model,
    }
    accepted = inspect.signature(apply_fn).parameters
    module = sys.modules[type(model).__module__]
    before = dict(vars(module))
    apply_fn(**{k: v for k, v in wanted.items() if k in accepted})
    _contain_module_patch(module, before)
    log.info("liger-kernel RoPE/RMSNorm/SwiGLU applied to the %s model", model_type)
    return True


def _contain_module_patch(module: ModuleType, before: dict[str, Any]) -> None:
    """Narrow liger's process-wide patch of the model family's transformers module.

    Given ``model=``, liger patches that model's norm and MLP modules in place, and also swaps the
    module's classes (so models built later would be fused, even on the CPU where Triton cannot
    run: the classes are put back) and its RoPE function (called by name from every attention
    layer, so it stays patched, but only for CUDA tensors; CPU tensors get the original).
    """
    for name, new in list(vars(module).items()):
        old = before.get(name)
        if old is None or old is new:
            continue
        if isinstance(old, type):
            setattr(module, name, old)
        elif callable(old) and callable(new):
            setattr(module, name, _cuda_only(new, old))


def _cuda_only(fused: Callable[..., Any], plain: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(plain)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()), None)
        return (fused if isinstance(first, Tensor) and first.is_cuda else plain)(*args, **kwargs)

    return dispatch
