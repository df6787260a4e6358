"""Routing replay (R3) around the torch backend's forwards, and the ``moe/...`` metrics of a step.

A mixture-of-experts model's routers pick experts per position. The sampler recorded its picks with each sample
(`TrainSequence.routes`); under ``moe.routing_replay`` every forward the backend runs for a micro-batch (the training
forward and `TrainingBackend.logprobs`) goes through `actors.moe.RouteReplay` with those routes, laid out as the
model sees the tokens::

    padded  [S, T] tokens          -> routes [S, T, L, K] -> reshape  [S x T, L, K]   (padding: not routed)
    packed  one row of real tokens -> routes [S, T, L, K] -> routes[attention_mask]  [N, L, K]
                                      (the row-major order `pack_micro_batch` flattens tokens in)

Rule for a position without a recorded route (route version -1, or a sequence without routes): the trainer's own
top-k routes it and the position is counted in ``moe/unrouted_positions``. The last position of a sequence is not
counted: the sampler never fed it (it has no route by construction) and its output feeds no log-prob. Replay off,
the same hooks only measure how often the trainer's own top-k agrees with the record.

With gradient checkpointing the forward runs again inside the backward, so the context must span both (the
backend holds it around the micro-batch's forward and backward); the counters then see each forward twice, which
leaves every ratio unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from actors.moe import RouteReplay, route_shape
from actors.trainer.backends.base import MicroBatch


class MicroBatchRouting:
    """The model's `RouteReplay` hooks, fed per micro-batch (`around`), and the step's counters (`take_metrics`).

    Raises at construction for ``replay`` on a dense model (there is nothing to replay: a config error, named)."""

    def __init__(self, model: nn.Module, *, replay: bool, packed: bool) -> None:
        self.shape = route_shape(model)
        if replay and self.shape is None:
            raise ValueError(
                f"moe.routing_replay: true, but the model ({type(model).__name__}) has no mixture-of-experts router "
                "to replay; set moe.routing_replay: false for a dense model"
            )
        self.replay = replay
        self.packed = packed
        self.hooks = RouteReplay(model) if self.shape is not None else None
        self.unrouted = 0

    @property
    def is_moe(self) -> bool:
        return self.hooks is not None

    def reset(self) -> None:
        self.unrouted = 0
        if self.hooks is not None:
            self.hooks.reset()

    @contextmanager
    def around(self, micro: MicroBatch, *, count: bool = True) -> Iterator[None]:
        """Replay (or measure against) ``micro``'s routes in the forwards run inside; a dense model, or a micro-batch
        without routes under replay off, runs untouched. ``count`` False: counters are restored afterwards (a
        rank's filler micro-batch, `TorchBackend._accumulate`)."""
        hooks = self.hooks
        if hooks is None or (micro.routes is None and not self.replay):
            yield
            return
        routes, routed = self._flat(micro)
        saved = (hooks.agree, hooks.compared, hooks.unrouted, hooks.load.clone(), self.unrouted)
        has_next = nn.functional.pad(micro.attention_mask[:, 1:].bool(), (0, 1))
        micro_routed = micro.routed if micro.routed is not None else torch.zeros_like(has_next)
        self.unrouted += int((has_next & ~micro_routed.bool()).sum())
        try:
            with hooks.replaying(routes, routed, replay=self.replay):
                yield
        finally:
            if not count:
                hooks.agree, hooks.compared, hooks.unrouted, load, self.unrouted = saved
                hooks.load.copy_(load)

    def _flat(self, micro: MicroBatch) -> tuple[Tensor, Tensor]:
        """Routes ``[tokens, L, K]`` and recorded ``[tokens]`` in the order the model sees the tokens."""
        assert self.shape is not None
        mask = micro.attention_mask.bool()
        if micro.routes is None or micro.routed is None:
            rows = int(mask.sum()) if self.packed else mask.numel()
            empty = torch.zeros(rows, self.shape.layers, self.shape.top_k, dtype=torch.long, device=mask.device)
            return empty, torch.zeros(rows, dtype=torch.bool, device=mask.device)
        got = tuple(micro.routes.shape[2:])
        if got != (self.shape.layers, self.shape.top_k):
            raise ValueError(
                f"routes have [layers, top_k] = {list(got)}, the model routes {self.shape.layers} layers x top-"
                f"{self.shape.top_k}: the samples were recorded by another model"
            )
        if int(micro.routes.max()) >= self.shape.num_experts:
            raise ValueError(f"routes name expert {int(micro.routes.max())}, the model has {self.shape.num_experts}")
        if self.packed:
            return micro.routes[mask], micro.routed[mask]
        return micro.routes.reshape(-1, *got), micro.routed.reshape(-1)

    def counters(self) -> list[float]:
        """[agree, compared, unrouted, *expert load] for a sum over ranks (`metrics_from`)."""
        if self.hooks is None:
            return []
        return [float(self.hooks.agree), float(self.hooks.compared), float(self.unrouted), *self.hooks.load.tolist()]

    @staticmethod
    def metrics_from(counters: list[float]) -> dict[str, float]:
        """``moe/routing_agreement`` (recorded positions x layers where the trainer's own top-k set equals the
        record; NaN with none recorded), ``moe/unrouted_positions``, ``moe/expert_load_max_over_mean`` (experts'
        use summed over layers; 1.0 = perfectly balanced, NaN when nothing was routed)."""
        if not counters:
            return {}
        agree, compared, unrouted, load = counters[0], counters[1], counters[2], counters[3:]
        mean_load = sum(load) / len(load) if load else 0.0
        return {
            "moe/routing_agreement": agree / compared if compared else math.nan,
            "moe/recorded_position_layers": compared,
            "moe/unrouted_positions": unrouted,
            "moe/expert_load_max_over_mean": max(load) / mean_load if mean_load else math.nan,
        }
