"""The process groups of a Megatron-core run: torch.distributed from the launcher's env, then TP/PP/DP.

A rank started by ``leeway trainer --nproc N`` finds ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in its environment (or an already initialised default group) and joins it; a
process without them is a world of one (an in-memory store, no port). Megatron-core keeps its
groups in module globals (``megatron.core.parallel_state``), so one process holds one layout:
asking for another one later is an error rather than a silent re-use.

Layout (megatron-core's default order ``tp-cp-ep-dp-pp``)::

    world = tensor_parallel_size x data_parallel_size x pipeline_parallel_size
    ranks 0..tp-1 share one model replica's shards (one TP group), the next tp ranks the next replica
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the layout (sizes and ranks within each group)."""

    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    pp_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline, stage by stage (each stage's rank with this TP rank)."""
    dp_size: int
    dp_rank: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def init_process_group(device: torch.device) -> None:
    """Join the launcher's group (env://), or make a world of one; no-op if one exists."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend=backend, init_method="env://")
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def init_model_parallel(tp_size: int, pp_size: int) -> ParallelLayout:
    """Create (or check) megatron-core's groups; raises ValueError when the world does not divide."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if tp_size < 1 or pp_size < 1 or world % (tp_size * pp_size):
        raise ValueError(
            f"megatron.tensor_parallel_size={tp_size} x megatron.pipeline_parallel_size={pp_size} "
            f"must divide the world size {world} (data parallel takes the rest)"
        )
    if ps.model_parallel_is_initialized():
        found = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if found != (tp_size, pp_size):
            raise ValueError(
                f"this process already holds a megatron layout tp x pp = {found}, not {(tp_size, pp_size)}"
            )
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size)
    return ParallelLayout(
        world_size=world,
        rank=dist.get_rank(),
        tp_size=tp_size,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=pp_size,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_ranks=tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
    )


__all__ = ["ParallelLayout", "init_model_parallel", "init_process_group"]
