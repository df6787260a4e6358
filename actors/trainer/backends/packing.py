"""Packed micro-batches: whole sequences concatenated into one row, no padding, one document each.

The loss_fn contract stays padded (`MicroBatch`, log-probs ``[S, T]``): the backend builds the
padded micro-batch as before, and only the model's forward runs packed::

    padded tokens [S, T] + attention_mask --pack_micro_batch--> input_ids [1, N], position_ids [1, N]
        (N = real tokens; positions restart at 0 per sequence), cu_seqlens [S + 1]
    model(input_ids, position_ids, cu_seq_lens_*) --> per-token values [N]
        --unpack_to_padded--> [S, T] (position 0 and padding 0), what the padded path returns

Every sequence attends only to itself. The backend switches the model to `PACKED_ATTENTION`, an
attention function registered with transformers that reads the ``cu_seq_lens_*`` offsets (the
keywords transformers already passes to flash-attention implementations): torch's varlen flash
attention on CUDA in bf16/fp16, causal ``scaled_dot_product_attention`` per sequence elsewhere
(flex_attention has no CPU backward). Either way attention costs the sum of the squared sequence
lengths, not ``N**2``, and no ``[N, N]`` mask is ever built. Position ids restart at 0, so RoPE and
GPT-2's learned absolute positions see each sequence as if it were alone. (transformers itself also
detects packing from such position ids and builds a document mask for sdpa, eager and flex; the
tests compare the two.)

Whether a model honours all this is checked once at construction (`check_packing`) on a few
tokens, so a checkpoint whose attention ignores the position ids fails loudly instead of letting
sequences see each other.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

PACKED_ATTENTION = "leeway_packed"
"""Name of the attention function registered with transformers for packed rows (see the module docstring)."""


def pack_by_real_tokens(lengths: Sequence[int], budget_tokens: int) -> list[list[int]]:
    """Group sequence indices into packed micro-batches of at most ``budget_tokens`` real tokens.

    First-fit decreasing (longest first, stable, so deterministic): packs end up nearly full, and
    the padded layout handed to the loss_fn is cheap because the longest row comes first. A
    sequence longer than the budget forms a micro-batch of its own; every index appears once.
    """
    if budget_tokens < 1:
        raise ValueError(f"trainer.micro_batch_tokens={budget_tokens} must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    packs: list[list[int]] = []
    used: list[int] = []
    for index in order:
        n = int(lengths[index])
        for p, total in enumerate(used):
            if total + n <= budget_tokens:
                packs[p].append(index)
                used[p] += n
                break
        else:
            packs.append([index])
            used.append(n)
    return packs


@dataclass(frozen=True, eq=False)
class PackedRow:
    """One micro-batch as a single row. ``targets[i]`` is the token after flat position ``i`` in the
    same sequence (0 where the sequence ends); ``has_target`` marks the positions that have one."""

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_length: int
    targets: Tensor
    has_target: Tensor

    def attention_kwargs(self) -> dict[str, Any]:
        """The keywords transformers passes down to flash-style attention functions."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }


def pack_micro_batch(tokens: Tensor, attention_mask: Tensor) -> PackedRow:
    """The packed row of a right-padded ``[S, T]`` micro-batch (each row's real tokens come first)."""
    valid = attention_mask.bool()
    lengths = valid.sum(dim=1)
    flat = tokens[valid]
    positions = (valid.cumsum(dim=1) - 1)[valid]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=tokens.device)
    cu[1:] = lengths.cumsum(0)
    # Row-major order of valid[:, 1:] is the order of the flat positions that have a next token.
    has_target = torch.ones_like(flat, dtype=torch.bool)
    has_target[cu[1:].long() - 1] = False
    targets = torch.zeros_like(flat)
    targets[has_target] = tokens[:, 1:][valid[:, 1:]]
    return PackedRow(
        input_ids=flat[None],
        position_ids=positions[None],
        cu_seqlens=cu,
        max_length=int(lengths.max()),
        targets=targets,
        has_target=has_target,
    )


def unpack_to_padded(values: Tensor, attention_mask: Tensor) -> Tensor:
    """Per-target values (``values[j]`` for the j-th flat position with a target) into ``[S, T]``.

    Token ``t`` of row ``r`` is predicted at its position ``t - 1``; position 0 and padding are 0.
    Differentiable (masked_scatter), so the padded loss back-propagates into the packed forward.
    """
    valid_next = attention_mask[:, 1:].bool()
    body = torch.zeros(valid_next.shape, dtype=values.dtype, device=values.device)
    body = body.masked_scatter(valid_next, values)
    return nn.functional.pad(body, (1, 0))


def packed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: varlen flash attention over ``cu_seq_lens_q`` on CUDA in
    bf16/fp16, causal sdpa per sequence elsewhere, plain causal sdpa without offsets.

    Without offsets (the padded fallback, right-padded rows) a causal mask alone is exact for every
    real token, which is all the trainer reads. ``query`` is ``[1, heads, N, head_dim]``.
    """
    if dropout:
        raise ValueError("packed attention does not implement dropout (the trainer rejects dropout anyway)")
    cu = kwargs.get("cu_seq_lens_q")
    gqa = query.shape[1] != key.shape[1]
    if cu is None:
        out = nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got a batch of {query.shape[0]}")
    varlen = _varlen_call(query, key, scaling, gqa)
    if varlen is not None:
        max_len = int(kwargs["max_length_q"])
        dtype = _attention_dtype(query)
        q, k, v = (t[0].transpose(0, 1).to(dtype).contiguous() for t in (query, key, value))
        if gqa and "enable_gqa" not in varlen.keywords:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return varlen(q, k, v, cu, cu, max_len, max_len)[None], None
    # Elsewhere (CPU, fp32): causal sdpa per sequence; exact, and sum(len**2) work rather than N**2.
    lengths = (cu[1:] - cu[:-1]).tolist()
    parts = [
        nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _attention_dtype(query: Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's on CUDA (RoPE may have promoted q and k to fp32)."""
    if query.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return query.dtype


@functools.cache
def _varlen_parameters() -> frozenset[str] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_call(query: Tensor, key: Tensor, scaling: float | None, gqa: bool) -> functools.partial[Tensor] | None:
    """torch's causal varlen flash attention with this call's options, or None where it cannot run
    (not CUDA, not bf16/fp16, a head size or softmax scale this torch version's API cannot take).

    The API moved between torch versions (``is_causal`` before 2.11, ``window_size`` after), so
    the keywords are read off its signature.
    """
    params = _varlen_parameters()
    head_dim = query.shape[-1]
    if params is None or query.device.type != "cuda" or head_dim > 256 or head_dim % 8:
        return None
    if _attention_dtype(query) not in (torch.bfloat16, torch.float16):
        return None
    from torch.nn.attention.varlen import varlen_attn

    options: dict[str, Any] = {}
    if "window_size" in params:
        options["window_size"] = (-1, 0)
    elif "is_causal" in params:
        options["is_causal"] = True
    else:
        return None
    if scaling is not None and abs(scaling - head_dim**-0.5) > 1e-9 * head_dim**-0.5:
        if "scale" not in params:
            return None
        options["scale"] = scaling
    if gqa and "enable_gqa" in params:
        options["enable_gqa"] = True
    return functools.partial(varlen_attn, **options)


def use_packed_attention(model: PreTrainedModel) -> None:
    """Switch ``model`` to `PACKED_ATTENTION` (no mask is built for it: the offsets are the mask).

    Needs transformers' attention interface (>= 4.48; 5.x is what the project runs); older
    versions get a clear error rather than a model that ignores the offsets.
    """
    try:
        from transformers import AttentionInterface
    except ImportError as err:
        raise ValueError(
            "trainer.packing: true needs transformers' AttentionInterface (transformers >= 4.48); "
            "upgrade it or set trainer.packing: false"
        ) from err
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(PACKED_ATTENTION)
    else:
        model.config._attn_implementation = PACKED_ATTENTION


@torch.no_grad()
def check_packing(model: PreTrainedModel, device: torch.device) -> None:
    """Raise ValueError when packed logits differ from those of each sequence alone (a model whose
    attention or positions ignore the position ids would otherwise leak across sequences)."""
    vocab = model.get_input_embeddings().num_embeddings
    lengths = (3, 2)
    seqs = [torch.arange(1, n + 1, device=device) % vocab for n in lengths]
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device=device)
    mask = torch.zeros_like(tokens)
    for row, seq in enumerate(seqs):
        tokens[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    packed = pack_micro_batch(tokens, mask)
    got = model(
        input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **packed.attention_kwargs()
    ).logits[0]
    offset = 0
    for seq in seqs:
        alone = model(input_ids=seq[None], use_cache=False).logits[0]
        part = got[offset : offset + len(seq)]
        offset += len(seq)
        if not torch.allclose(part.float(), alone.float(), atol=1e-3, rtol=1e-3):
            raise ValueError(
                f"model {type(model).__name__} (attention {model.config._attn_implementation!r}) does not honour "
                "packed position ids: sequences would see each other; set trainer.packing: false"
            )
