"""Batched token sampling on the engine's device: the filtered distribution, and counter-based draws.

- `sampling_logprobs` is the distribution a token is drawn from (temperature, top-k, top-p); the trainer
  mirrors it, so ``log mu`` (recorded here) and ``log pi`` (recomputed there) are comparable.
- `sample_rows` draws one token per row for a whole decode step in one set of tensor ops, by inverse-CDF
  sampling of the filtered distribution. A row's uniform for its generated position ``t`` is an integer
  hash of ``(request seed, t)`` (`seed_key`, `row_uniforms`: counter-based), so a request's tokens depend
  only on its seed, its logits and its position -- not on the batch it shares, its slot, or any RNG
  state -- with no per-request ``torch.Generator`` and no per-row loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pipeline.rl.engine_records import SamplingParams

_M32 = 0xFFFFFFFF
# Multipliers below 2**31: a 32-bit value times one stays below 2**63.
_MUL_A = 0x7FEB352D
_MUL_B = 0x2C1B3C6D
_MUL_C = 0x297A2D39


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs of the distribution tokens are drawn from, ``-inf`` outside its support.

    ``logits``: ``[..., vocab]``. Order: divide by temperature; keep the ``top_k`` largest (ties with the
    k-th value are kept too); keep the smallest prefix of the sorted renormalised distribution whose mass
    reaches ``top_p`` (the most likely token is always kept); renormalise. The trainer applies the same
    function to its recomputed logits so that ``log pi`` and ``log mu`` are comparable.
    """
    logits = logits.float()
    if params.temperature == 0:
        greedy = logits.argmax(dim=-1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter(-1, greedy, 0.0)
    if params.temperature != 1.0:  # x / 1.0 == x exactly: skipping it changes no bit
        logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= params.top_p
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.log_softmax(dim=-1)


def seed_key(seed: int) -> int:
    """A request's 32-bit sampling key, from its 64-bit seed (computed once per request, in plain Python)."""
    return _mix32_int(_mix32_int((seed >> 32) & _M32) ^ (seed & _M32))


def _mix32_int(x: int) -> int:
    """`_mix32_np` on one Python int (the same bits)."""
    x ^= x >> 16
    x = (x * _MUL_A) & _M32
    x ^= x >> 15
    x = (x * _MUL_B) & _M32
    x ^= x >> 16
    x = (x * _MUL_C) & _M32
    return x ^ (x >> 15)


def row_uniforms(keys: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """One uniform in ``(0, 1)`` per row, a pure function of (request `seed_key`, generated position):
    float64 ``[rows]``."""
    mixed = _mix32_np(np.asarray(keys, dtype=np.uint64) ^ (np.asarray(positions, dtype=np.uint64) & np.uint64(_M32)))
    return (mixed.astype(np.float64) + 0.5) / float(1 << 32)


def _mix32_np(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer finaliser on a uint64 array holding 32-bit values (no product leaves 64 bits)."""
    mask = np.uint64(_M32)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(_MUL_A)) & mask
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(_MUL_B)) & mask
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(_MUL_C)) & mask
    return x ^ (x >> np.uint64(15))


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[int], positions: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the filtered distribution it was drawn from.

    ``logits``: ``[rows, vocab]``; ``params[i]``, ``keys[i]`` (`seed_key` of the request's seed) and
    ``positions[i]`` (the index of the generated token) belong to row i. Rows sharing params are filtered
    together (one call of `sampling_logprobs` per distinct params, usually one per step). Returns (token ids
    int64, log-probs float32), on the device.

    Inverse-CDF sampling: the token is the first whose cumulative probability exceeds ``u * total`` (``u``
    from `row_uniforms`); a token outside the support (probability 0) adds nothing to the cumulative sum,
    so it is never the first to exceed it.
    """
    distinct = list({id(p): p for p in params}.values())  # by identity: hashing params per row costs more
    if len(distinct) == 1:
        logprobs = sampling_logprobs(logits, distinct[0])
    else:
        logprobs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for p in distinct:
            rows = torch.tensor([i for i, q in enumerate(params) if q is p], device=logits.device)
            logprobs[rows] = sampling_logprobs(logits[rows], p)
    cdf = logprobs.double().exp_().cumsum_(dim=-1)
    uniforms = torch.from_numpy(row_uniforms(keys, positions)).to(logits.device)
    threshold = (uniforms * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, threshold, right=True).clamp_(max=logits.shape[-1] - 1)
    return tokens[:, 0], logprobs.gather(-1, tokens)[:, 0]
