"""Pipeline stages: what one stage sends its neighbours, and how whole-model tensors reach every rank.

The schedule is the simplest correct one, one micro-batch at a time through every stage (no
interleaving, so stages idle while the others work: pipeline parallel here is for models that do
not fit one rank, not for speed)::

    stage 0 ──hidden [T, S, h]──► stage 1 ──► ... ──► last stage: logits -> log-probs -> loss_fn -> backward
    stage 0 ◄──grad of its output── stage 1 ◄── ... ◄──────────────── grad of the last stage's input

Every rank of a stage holds the same micro-batch (every rank gets the whole batch), so a receiver
knows the shape it waits for. Transfers are point-to-point between the stages' ranks of the same TP
rank (`ParallelLayout.pp_ranks`); tensors cross as fp32. Nothing is pickled: names and shapes travel
as JSON bytes in uint8 tensors (`all_gather_json`).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from actors.trainer.backends.megatron.parallel import ParallelLayout


class Stages:
    """This rank's place in its pipeline: receive, send, and gather across stages."""

    def __init__(self, layout: ParallelLayout, device: torch.device, hidden: int) -> None:
        from megatron.core import parallel_state as ps

        self.layout = layout
        self.device = device
        self.hidden = hidden
        self.group = ps.get_pipeline_model_parallel_group()

    def _prev(self) -> int:
        return self.layout.pp_ranks[self.layout.pp_rank - 1]

    def _next(self) -> int:
        return self.layout.pp_ranks[self.layout.pp_rank + 1]

    def receive_input(self, rows: int, width: int, *, requires_grad: bool) -> Tensor | None:
        """The previous stage's hidden states ``[T, S, h]`` (None on the first stage)."""
        if self.layout.first_stage:
            return None
        hidden = torch.empty(width, rows, self.hidden, dtype=torch.float32, device=self.device)
        dist.recv(hidden, src=self._prev())
        return hidden.requires_grad_(requires_grad)

    def send_output(self, output: Tensor) -> None:
        dist.send(output.detach().float().contiguous(), dst=self._next())

    def receive_output_grad(self, output: Tensor) -> Tensor:
        grad = torch.empty(output.shape, dtype=torch.float32, device=self.device)
        dist.recv(grad, src=self._next())
        return grad

    def send_input_grad(self, hidden: Tensor) -> None:
        grad = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)
        dist.send(grad.contiguous(), dst=self._prev())

    def from_last(self, tensor: Tensor) -> Tensor:
        """The last stage's ``tensor`` on every stage (the others pass zeros of the same shape)."""
        if self.layout.pp_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def gather(self, mine: dict[str, Tensor]) -> dict[str, Tensor]:
        """Every stage's named CPU tensors on every rank of the pipeline, stage order."""
        if self.layout.pp_size == 1:
            return mine
        listing = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in mine.items()]
        out: dict[str, Tensor] = {}
        for stage, entries in enumerate(all_gather_json(listing, self.group, self.device)):
            for name, shape, dtype in entries:
                if stage == self.layout.pp_rank:
                    buffer = mine[name].to(self.device)
                else:
                    buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                dist.broadcast(buffer, src=self.layout.pp_ranks[stage], group=self.group)
                out[name] = buffer.cpu()
        return out


def all_gather_json(value: Any, group: dist.ProcessGroup, device: torch.device) -> list[Any]:
    """Every rank's JSON-safe ``value`` (rank order), carried as bytes in tensors: nothing is pickled."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    padded = padded.to(device)
    pieces = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded, group=group)
    return [json.loads(bytes(p[: int(s.item())].cpu().tolist())) for p, s in zip(pieces, sizes, strict=True)]


__all__ = ["Stages", "all_gather_json"]
