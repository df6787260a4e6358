"""Mixture-of-experts routers of a Hugging Face model: finding them, recording what they chose, replaying a record.

Both roles touch a model's routing at the same seam. In the MoE families Leeway runs (Qwen3-MoE, OLMoE, Mixtral) each
sparse block calls its router as ``gate(hidden [tokens, hidden]) -> (logits, weights, indices)`` and hands
``indices`` and ``weights`` to its experts. So:

- the generator's engine records ``indices`` of every MoE layer for every position whose KV a forward wrote
  (`RouteRecorder`): the routes, ``[positions, layers, top_k]``;
- the trainer replays a record (`RouteReplay`): the router still computes its logits from the trainer's weights, but
  the experts used are the recorded ones, weighted by the trainer's own softmax over the logits at those experts
  (renormalised as the router would), so the gradient still reaches the router. A position with no record keeps
  the trainer's own top-k: the caller counts those (`RouteReplay.unrouted`), the rule is never silent.

A forward hook on the router is the one place that holds for the HF forward (trainer), the engine's own forward
(`actors/generator/engines/slot_runner.py` calls the same router modules) and any kernel behind ``experts``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter")
"""Router modules whose contract is the one above (softmax over experts, top-k, optional renormalisation)."""


@dataclass(frozen=True)
class RouteShape:
    """How one position's routes are laid out: ``layers`` MoE layers x ``top_k`` expert ids, each below
    ``num_experts``. uint8 carries up to 256 experts, uint16 the rest."""

    layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.uint16)

    @property
    def width(self) -> int:
        """Expert ids per position (all layers)."""
        return self.layers * self.top_k


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order; empty for a dense model. Raises for a router of a family whose
    contract is not known to hold (replaying it could silently route wrong)."""
    routers = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ROUTER_CLASSES:
            routers.append(module)
        elif kind.endswith("TopKRouter") or (kind.endswith("Router") and name.endswith("mlp.gate")):
            raise ValueError(
                f"{name}: router {kind} is not one Leeway records or replays ({', '.join(ROUTER_CLASSES)})"
            )
    return routers


def route_shape(model: nn.Module) -> RouteShape | None:
    """The route layout of ``model``, or None for a dense model."""
    routers = moe_routers(model)
    if not routers:
        return None
    top_k = {int(r.top_k) for r in routers}
    experts = {int(r.num_experts) for r in routers}
    if len(top_k) != 1 or len(experts) != 1:
        raise ValueError(f"MoE layers differ in top-k {sorted(top_k)} or experts {sorted(experts)}")
    return RouteShape(layers=len(routers), top_k=top_k.pop(), num_experts=experts.pop())


class RouteRecorder:
    """Records every router's chosen experts while active (`recording`): `take` returns ``[tokens, layers, top_k]``
    for the forwards since the last `take`, tokens in the order the routers saw them (one forward: its flattened
    ``[batch x width]``)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self.shape = route_shape(model)
        self._chunks: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._active = False
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):  # type: ignore[no-untyped-def]
        def record(module: nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
            if self._active:
                self._chunks[layer].append(output[2].detach())

        return record

    @contextmanager
    def recording(self) -> Iterator[RouteRecorder]:
        self._active = True
        try:
            yield self
        finally:
            self._active = False

    def take(self) -> np.ndarray:
        """What was recorded since the last call, ``[tokens, layers, top_k]`` in `RouteShape.dtype`."""
        assert self.shape is not None, "a dense model has no routes"
        chunks, self._chunks = self._chunks, [[] for _ in self.routers]
        if not chunks[0]:
            return np.zeros((0, self.shape.layers, self.shape.top_k), dtype=self.shape.dtype)
        per_layer = [torch.cat(c) for c in chunks]
        return torch.stack(per_layer, dim=1).cpu().numpy().astype(self.shape.dtype)


class RouteCounters:
    """What a replay measured since `reset` (both backends' replays keep these; the trainer turns them into
    ``moe/*`` step metrics): positions x layers compared and agreeing, unrouted positions, expert load."""

    def __init__(self, num_experts: int) -> None:
        self.agree = self.compared = self.unrouted = 0
        self.load = torch.zeros(num_experts, dtype=torch.float64)

    @property
    def agreement(self) -> float:
        return self.agree / self.compared if self.compared else float("nan")

    def reset(self) -> None:
        self.agree = self.compared = self.unrouted = 0
        self.load.zero_()


class RouteReplay(RouteCounters):
    """Routes forwards through recorded experts while `replaying`. ``routes``: ``[tokens, layers, top_k]`` aligned
    with the flattened tokens of the next forward (a batch ``[B, T]`` -> ``B x T`` rows); ``recorded``: ``[tokens]``
    bool, False where a position has no record (the trainer's own top-k is used there and counted).

    Per forward it also measures, over recorded positions, how often the trainer's own top-k (as a set) equals the
    record (`agreement`), and how the used routes load the experts (`expert_load`)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self.shape = route_shape(model)
        super().__init__(self.shape.num_experts if self.shape else 0)
        self._routes: torch.Tensor | None = None
        self._recorded: torch.Tensor | None = None
        self._replay = True
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    @contextmanager
    def replaying(self, routes: torch.Tensor, recorded: torch.Tensor, *, replay: bool = True) -> Iterator[RouteReplay]:
        """``replay`` False: the trainer routes by its own top-k and only the agreement with the record is measured
        (replay off, the baseline of `leeway bench moe`)."""
        self._routes, self._recorded, self._replay = routes, recorded, replay
        try:
            yield self
        finally:
            self._routes = self._recorded = None

    def _hook(self, layer: int):  # type: ignore[no-untyped-def]
        def replay(
            module: nn.Module, args: object, output: tuple[torch.Tensor, ...]
        ) -> tuple[torch.Tensor, ...] | None:
            routes, recorded = self._routes, self._recorded
            if routes is None or recorded is None:
                return None
            logits, weights, own = output
            chosen = routes[:, layer].to(device=own.device, dtype=own.dtype)
            keep = recorded.to(own.device)
            if chosen.shape != own.shape:
                raise ValueError(f"recorded routes {tuple(chosen.shape)} do not match the forward's {tuple(own.shape)}")
            with torch.no_grad():
                same = (own.sort(dim=-1).values == chosen.sort(dim=-1).values).all(dim=-1)
                self.agree += int(same[keep].sum())
                self.compared += int(keep.sum())
                if layer == 0 and self._replay:
                    self.unrouted += int((~keep).sum())
            if not self._replay:
                with torch.no_grad():
                    self.load += torch.bincount(own.reshape(-1).cpu(), minlength=self.load.numel()).double()
                return None
            indices = torch.where(keep[:, None], chosen, own)
            probs = torch.softmax(logits.float(), dim=-1)
            picked = probs.gather(-1, indices)
            if getattr(module, "norm_topk_prob", True):  # Mixtral's router always renormalises
                picked = picked / picked.sum(dim=-1, keepdim=True)
            with torch.no_grad():
                self.load += torch.bincount(indices.reshape(-1).cpu(), minlength=self.load.numel()).double()
            return logits, picked.to(weights.dtype), indices

        return replay
