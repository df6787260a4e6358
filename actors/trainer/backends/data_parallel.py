"""FSDP2 data parallelism for the `torch` backend: sharding, the batch split, and byte collectives.

Every rank holds the same model, sharded with `torch.distributed.fsdp.fully_shard` per decoder
layer and at the root (parameters become `DTensor`s split on dim 0), and the same full batch.
`TorchBackend.train_step` then works on this rank's share of every minibatch:

```
  minibatch (global order) ──split_by_tokens──► rank r's sequences (longest first to the lightest rank)
  loss_fn sees extras.minibatch_loss_tokens of the WHOLE minibatch, so each rank's loss is its part of
  the one-rank loss; FSDP2 sums the ranks' gradients (divide factor 1, not the default mean)
  ──► the same gradient as one rank, up to float summation order; the clip norm is the global one.
```

Collectives must be entered by every rank the same number of times: each rank runs as many
micro-batches per minibatch as the rank with the most (`max_over_ranks`), padding with a micro-batch
whose loss is multiplied by zero. Nothing here pickles: byte payloads travel as uint8 tensors
(`broadcast_bytes`, `all_gather_bytes`), never through torch.distributed's ``*_object_list``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = [
    "all_gather_bytes",
    "broadcast_bytes",
    "is_data_parallel",
    "max_over_ranks",
    "row_range",
    "shard_model",
    "split_by_tokens",
    "sum_over_ranks",
]


def is_data_parallel() -> bool:
    """True inside a process group of more than one rank (then the backend shards its model)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _comm_device() -> torch.device:
    """Gloo moves CPU tensors, NCCL CUDA ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def shard_model(model: nn.Module) -> None:
    """`fully_shard` every decoder layer, then the root; gradients are summed over ranks, not averaged.

    The decoder layers are the entries of the first `nn.ModuleList` found (HF causal LMs keep them
    in ``model.layers`` or ``transformer.h``); a model without one is sharded at the root only.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    layers = next((m for m in model.modules() if isinstance(m, nn.ModuleList)), None)
    for layer in layers if layers is not None else ():
        fully_shard(layer)
    fully_shard(model)
    gloo = dist.get_backend() == "gloo"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if gloo:
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def split_by_tokens(indices: Sequence[int], lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Deal `indices` to ranks by token count: longest first to the rank with the fewest tokens so far.

    Deterministic (ties go to the lower rank, equal lengths keep their order), every index once, and
    each rank's list keeps the minibatch's order, so every rank computes the same split by itself.
    """
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(indices)), key=lambda i: -lengths[i]):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += lengths[i]
    return [[indices[i] for i in sorted(share)] for share in shares]


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise sum of float64 values over all ranks (every rank gets the result)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


def max_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """`data` from rank `src` to every rank (others pass None): a length, then a uint8 tensor."""
    device = _comm_device()
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    n = int(size.item())
    if dist.get_rank() == src:
        assert data is not None
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        buf = buf.to(device)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=device)
    if n:
        dist.broadcast(buf, src)
    return bytes(buf.cpu().numpy().tobytes())


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank (padded to the longest, then trimmed)."""
    device = _comm_device()
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    if longest == 0:
        return [b""] * world
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bufs, mine.to(device))
    return [bytes(b.cpu().numpy()[:n].tobytes()) for b, n in zip(bufs, lengths, strict=True)]


def row_range(tensor: Tensor) -> tuple[int, int, int]:
    """(global rows, first row, rows here) of a dim-0 sharded DTensor, or of a plain tensor (all rows).

    FSDP2 splits dim 0 like `torch.chunk`: ceil(n / world) rows per rank, the last ranks fewer or none.
    """
    if not isinstance(tensor, DTensor):
        rows = tensor.shape[0] if tensor.dim() else 1
        return rows, 0, rows
    total = tensor.shape[0]
    world, rank = tensor.device_mesh.size(), tensor.device_mesh.get_local_rank()
    chunk = -(-total // world)
    start = min(rank * chunk, total)
    rows = max(0, min(total, start + chunk) - start)
    local = tensor.to_local()
    if local.shape[0] != rows:
        raise RuntimeError(f"DTensor shard has {local.shape[0]} rows, expected {rows} of {total} on rank {rank}")
    return total, start, rows
