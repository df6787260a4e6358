"""The engine records a rollout speaks in: `SamplingParams`, `GenerateRequest`, `GenerateResult`, and `Generate`,
the blocking call that turns requests into results.

They are defined here, at the rollout's edge, so that ``pipeline/`` needs no import from ``actors/``; the engine
itself (`actors/generator/engines/base.py`) re-exports them, and a rollout only needs its `Generate` callable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.wire.trajectory import FinishReason


@dataclass(frozen=True)
class SamplingParams:
    """How to draw tokens. ``temperature == 0`` means greedy decoding (each token's log-prob is then 0:
    it was drawn from a point mass). ``top_k == 0`` and ``top_p == 1.0`` switch those filters off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True)
class GenerateRequest:
    """One sequence to continue. ``seed`` fixes this request's sampling stream independently of the
    rest of the batch (None: drawn from the engine's generator); ``max_new_tokens`` overrides the
    sampling params' budget for this request (a later turn of a multi-turn episode has less room);
    ``keep_prefix`` asks the engine to keep the finished sequence's KV cache for a next turn that extends it
    (multi-turn episodes; a single-turn rollout has no next turn)."""

    input_ids: Sequence[int] | np.ndarray
    seed: int | None = None
    max_new_tokens: int | None = None
    request_id: str = ""
    keep_prefix: bool = False

    def __post_init__(self) -> None:
        if len(self.input_ids) == 0:
            raise ValueError(f"GenerateRequest {self.request_id!r}: input_ids is empty")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(
                f"GenerateRequest {self.request_id!r}: max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )


@dataclass
class GenerateResult:
    """The continuation of one request; the three arrays have one entry per generated token.

    Example (prompt ``[1, 5, 6]``, stop token 2, a weight swap before the second decode step)::

        token_ids = [7, 9, 2]          # int32, the stop token included
        logprobs  = [-0.3, -1.2, -0.1] # float32, behaviour log-probs
        versions  = [0, 1, 1]          # int32
        finish_reason = "stop"
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason
    request_id: str = ""
    gen_s: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)
    routes: np.ndarray | None = None
    """MoE models: ``[positions, layers, top_k]`` (uint8, or uint16 past 256 experts), the experts each MoE layer chose
    in the forward that wrote that position's KV, for positions ``routes_start, routes_start + 1, ...`` of
    prompt + generated tokens; every position this request computed (the prompt from ``routes_start``, each fed
    token), so a prefix served from cache is not included. The last generated token was never fed: it has none.
    None for a dense model or an engine that records none."""
    route_versions: np.ndarray | None = None
    """int32, one per row of ``routes``: the policy version of the weights of the forward that chose them."""
    routes_start: int = 0
    """The first position ``routes`` covers: 0 when the whole prompt was computed, the cached length when a kept
    prefix was reused (its routes came with the earlier turn)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert len(self.logprobs) == n and len(self.versions) == n, "per-token arrays must align"
        if self.routes is not None:
            assert self.route_versions is not None and len(self.route_versions) == len(self.routes), (
                "routes and route_versions must align"
            )


Generate = Callable[[Sequence[GenerateRequest], SamplingParams], list[GenerateResult]]
"""A blocking generate call: results in request order (`Engine.generate`, or a wrapper that meters it)."""
