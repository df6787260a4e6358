"""Routing replay (R3) on megatron-core's MoE routers: the sampler's experts, the trainer's gate weights.

megatron-core 0.16.1 computes a router's top-k in one place, ``topk_routing_with_score_function``
(``megatron/core/transformer/moe/moe_utils.py``), and asks ``router.router_replay.get_replay_topk(scores,
topk, num_groups, group_topk, default_compute_topk)`` for it when the router has one. Its own
``RouterReplay`` (``moe_enable_routing_replay``) replays every token and keeps its instances in a
class-level list; Leeway installs `_LayerReplay` objects there instead, which keep the trainer's own
top-k where a position has no record and measure the agreement, with no global state.

The gate weights follow from the scores gathered at the replayed experts, exactly as the router
computes them for its own choice: with ``moe_router_pre_softmax=False`` (Qwen3's ``norm_topk_prob``)
the scores are logits and the router's softmax over the k gathered logits is the renormalised
softmax; with ``True`` they are the full softmax's values. The gradient reaches the router either way.

Token order: megatron's hidden states are ``[T, S, h]``, so the router sees the tokens of a micro-batch
``[S, T]`` flattened position-major (row ``t * S + s``); `layer_routes` reorders ``MicroBatch.routes``
``[S, T, L, K]`` to match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from actors.moe import RouteCounters

TopK = Callable[..., tuple[Tensor, Tensor]]


def layer_routes(routes: Tensor, routed: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    """MoE layer ``layer``'s recorded experts ``[T*S, K]`` and record mask ``[T*S]`` from ``routes``
    ``[S, T, L, K]`` and ``routed`` ``[S, T]``, in the order megatron's router sees the tokens."""
    chosen = routes[:, :, layer].transpose(0, 1).reshape(-1, routes.shape[-1])
    return chosen, routed.transpose(0, 1).reshape(-1)


def replay_topk(scores: Tensor, own: Tensor, chosen: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """(scores at the experts used, experts used ``[N, K]``): ``chosen`` where ``keep``, else ``own``."""
    indices = torch.where(keep[:, None], chosen.to(own.dtype), own)
    return scores.gather(1, indices), indices


class MegatronRouteReplay(RouteCounters):
    """Replays recorded routes on every MoE router of one pipeline stage while `replaying`; counts like
    `actors.moe.RouteReplay` (``agree`` / ``compared`` over recorded positions, ``unrouted`` positions
    that had none, ``load`` per expert of the routes used)."""

    def __init__(self, model: nn.Module, *, layer_offset: int, num_experts: int) -> None:
        self.num_experts = num_experts
        self._routes: Tensor | None = None
        self._routed: Tensor | None = None
        self._replay = True
        super().__init__(num_experts)
        routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
        for local, router in enumerate(routers):
            router.router_replay = _LayerReplay(self, layer_offset + local)

    @contextmanager
    def replaying(
        self, routes: Tensor | None, routed: Tensor | None, valid: Tensor, *, replay: bool = True
    ) -> Iterator[MegatronRouteReplay]:
        """Route the next forwards of micro-batches shaped like ``valid`` ``[S, T]`` (True on real tokens).
        ``routes`` None: no position has a record. ``replay`` False: own top-k, agreement measured."""
        if routes is None or routed is None:
            routes = torch.zeros(*valid.shape, 0, 0, dtype=torch.int64, device=valid.device)
            routed = torch.zeros_like(valid, dtype=torch.bool)
        if routes.shape[:2] != valid.shape or routed.shape != valid.shape:
            raise ValueError(f"MicroBatch.routes {tuple(routes.shape)} / routed {tuple(routed.shape)} do not match "
                             f"the tokens {tuple(valid.shape)}")  # fmt: skip
        if replay:
            self.unrouted += int((valid & ~routed).sum())
        self._routes, self._routed, self._replay = routes, routed & valid, replay
        try:
            yield self
        finally:
            self._routes = self._routed = None

    def topk(self, layer: int, scores: Tensor, topk: int, own_topk: TopK, *args: object) -> tuple[Tensor, Tensor]:
        values, own = own_topk(scores, topk, *args)
        if self._routes is None or self._routed is None:
            return values, own
        if self._routes.shape[-1] == 0:  # no record in this micro-batch: own top-k (counted)
            chosen, keep = own, torch.zeros(own.shape[0], dtype=torch.bool, device=own.device)
        else:
            chosen, keep = layer_routes(self._routes.to(own.device), self._routed.to(own.device), layer)
            if chosen.shape != own.shape:
                raise ValueError(f"MicroBatch.routes give {tuple(chosen.shape)} experts per token in MoE layer "
                                 f"{layer}, the router chose {tuple(own.shape)}")  # fmt: skip
            if chosen.numel() and int(chosen.max()) >= self.num_experts:
                raise ValueError(f"MicroBatch.routes name expert {int(chosen.max())} of {self.num_experts}")
        with torch.no_grad():
            same = (own.sort(dim=-1).values == chosen.to(own.dtype).sort(dim=-1).values).all(dim=-1)
            self.agree += int(same[keep].sum())
            self.compared += int(keep.sum())
        if self._replay:
            values, own = replay_topk(scores, own, chosen, keep)
        self.load += torch.bincount(own.reshape(-1).cpu(), minlength=self.num_experts).double()
        return values, own


class _LayerReplay:
    """What megatron-core's router calls as ``router_replay`` (duck-typed on its ``RouterReplay``)."""

    def __init__(self, owner: MegatronRouteReplay, layer: int) -> None:
        self.owner = owner
        self.layer = layer

    def get_replay_topk(
        self, scores: Tensor, topk: int, num_groups: int | None, group_topk: int | None, default_compute_topk: TopK
    ) -> tuple[Tensor, Tensor]:
        return self.owner.topk(self.layer, scores, topk, default_compute_topk, num_groups, group_topk)


__all__ = ["MegatronRouteReplay", "layer_routes", "replay_topk"]
