"""Every adjustment megatron-core needs to run on a machine without CUDA, in one place.

Each patch names what it works around and the megatron-core version it was checked against
(`CHECKED_VERSION`, the version the ``megatron`` extra pins). `apply` is idempotent and, when CUDA is
available, only defines the Transformer Engine names a TE-less megatron-core leaves undefined
(`_define_missing_te_names`), so GPU runs otherwise use megatron-core unchanged. A newer megatron-core may have
moved or fixed the patched functions: `apply` refuses to patch a version it was not checked with
rather than patch blindly.

The attention mask is the one CPU need that is not a patch: with ``attention_mask=None`` the local
``DotProductAttention`` builds its causal mask with ``device="cuda"``
(``megatron.core.transformer.utils.get_default_causal_mask``); the backend always passes an
explicit mask built by `causal_mask` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import version

import torch

CHECKED_VERSION = "0.16.1"
"""The megatron-core version every patch below was checked against."""

_applied = False


def apply() -> None:
    """Patch megatron-core for a CUDA-less process (no-op with CUDA, or when already applied)."""
    global _applied
    if _applied:
        return
    _define_missing_te_names()
    if torch.cuda.is_available():
        return
    found = version("megatron-core")
    if found != CHECKED_VERSION:
        raise RuntimeError(
            f"megatron-core {found} is installed; the CPU adjustments in this module were checked against "
            f"{CHECKED_VERSION} only (install the `megatron` extra, or re-check them for {found})"
        )
    _patch_global_memory_buffer()
    _patch_rng_tracker_fork()
    _patch_rotary_embedding()
    _patch_router_gating()
    _applied = True


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """The mask the local attention expects: bool ``[1, 1, s, s]``, True where a query may not look."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def _patch_global_memory_buffer() -> None:
    """0.16.1: ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on
    ``torch.cuda.current_device()``; the local ``DotProductAttention`` takes its ``baddbmm`` input
    from it. On the CPU it allocates on the CPU, with the same reuse-by-(name, dtype) behaviour."""
    from functools import reduce
    from operator import mul

    from megatron.core.utils import GlobalMemoryBuffer

    def get_tensor(
        self: GlobalMemoryBuffer,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    ) -> torch.Tensor:
        required = reduce(mul, tensor_shape, 1)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < required:
            buffer = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, requires_grad=False)
        return buffer[:required].view(*tensor_shape)

    GlobalMemoryBuffer.get_tensor = get_tensor


def _patch_rng_tracker_fork() -> None:
    """0.16.1: ``CudaRNGStatesTracker.fork`` (entered around attention dropout) reads and sets the
    CUDA RNG state. Leeway refuses dropout (a random recomputed log pi would bias every importance
    ratio), so on the CPU the fork has nothing to protect and becomes a plain context."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    @contextlib.contextmanager
    def fork(self: CudaRNGStatesTracker, name: str = "model-parallel-rng") -> Iterator[None]:
        yield

    CudaRNGStatesTracker.fork = fork


def _patch_rotary_embedding() -> None:
    """0.16.1: ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` when it
    finds it on the CPU. On the CPU the frequencies stay where they are; the rest of the body is
    0.16.1's (non-interleaved ``cat(freqs, freqs)``, interleaved ``stack``), shaped ``[s, 1, 1, d]``."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def get_emb(self: RotaryEmbedding, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    RotaryEmbedding.get_emb = get_emb


def _define_missing_te_names() -> None:
    """0.16.1, with or without CUDA: ``moe_utils`` imports ``te_general_gemm`` and the fused MoE kernels only
    when Transformer Engine imports, but ``RouterGatingLinearFunction.forward`` (``moe_utils.py`` line 1192)
    tests ``te_general_gemm is not None`` unconditionally: without TE every MoE router raises NameError.
    Defining the missing names as None selects the plain ``torch.mm`` path megatron-core wrote for it."""
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE:
        return
    for name in ("te_general_gemm", "fused_topk_with_score_function", "fused_permute", "fused_unpermute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"):  # fmt: skip
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _patch_router_gating() -> None:
    """0.16.1: ``Router.gating`` (``moe/router.py`` line 88) moves a router weight it finds on the CPU to
    ``torch.cuda.current_device()``. On the CPU the weight stays; the rest is 0.16.1's body."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    from megatron.core.transformer.moe.router import Router

    def gating(self: Router, input: torch.Tensor) -> torch.Tensor:
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return router_gating_linear(input, self.weight, self.bias, router_dtype)

    Router.gating = gating


__all__ = ["CHECKED_VERSION", "apply", "causal_mask"]
