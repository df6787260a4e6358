"""CUDA graphs of the decode step, one per bucket of (dense batch size, attended cache length).

A decode step of a small model is a few hundred kernel launches; replaying a captured graph removes the
launch and Python overhead per step. Shapes must be static inside a graph, so the dense batch width is
rounded up to a bucket (powers of two, capped at the number of slots) and the attended length to a power
of two (capped at ``max_len``); padding rows are dummy slots (see `actors/generator/engines/slot_runner.py`)
and padding keys are masked. Graphs are captured lazily, the first time a bucket is needed (a few hundred
milliseconds each), under the engine's model lock like every forward.

Weights: a graph reads the model's Parameter tensors by address, so the engine's in-place weight copies
(`TorchEngine.update_weights`) are seen by every later replay; nothing is re-captured on a swap. The
inputs (token ids, positions) are copied into static buffers before each replay; the output logits
buffer is the graph's own and is consumed (sampled) before the next replay. Each graph has its own memory
pool, so no replay can overwrite another bucket's output.

The cache knows nothing of the runner that owns it: it gets the dense decode step as a callable, with the
slot count, the longest sequence and the device that size its buffers and buckets, so `slot_runner.py`
imports this module and not the reverse.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DenseDecode = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``decode(tokens [n], positions [n], kv_len) -> logits [n, vocab]`` for the dense slots ``[0, n)``, with
static shapes for a given ``(n, kv_len)`` (`FastSlotRunner.decode_dense` in `slot_runner.py`)."""

MIN_KV_BUCKET = 64
"""Smallest attended length a graph is captured for."""
WARMUP_RUNS = 2
"""Eager runs on a side stream before a capture (lets lazy initialisation happen outside the graph)."""


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class DecodeGraphs:
    """Captured `decode` calls, keyed by bucket; `run` replays the one that fits.

    ``num_slots`` bounds the batch bucket and sizes the static input buffers, ``max_len`` bounds the
    length bucket, and ``device`` is the CUDA device every graph is captured and replayed on.
    """

    def __init__(self, decode: DenseDecode, *, num_slots: int, max_len: int, device: torch.device) -> None:
        self._decode = decode
        self._num_slots = num_slots
        self._max_len = max_len
        self._device = device
        self._tokens = torch.zeros(num_slots, dtype=torch.long, device=device)
        self._positions = torch.zeros(num_slots, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def buckets(self, width: int, kv_len: int) -> tuple[int, int]:
        """The (batch, length) bucket a step of ``width`` dense rows attending ``kv_len`` positions runs in."""
        batch = min(self._num_slots, _next_power_of_two(width))
        length = min(self._max_len, max(MIN_KV_BUCKET, _next_power_of_two(kv_len)))
        return batch, length

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` of one decode step (the graph's output buffer, valid until the next run)."""
        width = tokens.shape[0]
        batch, length = self.buckets(width, kv_len)
        self._tokens.zero_()
        self._positions.zero_()
        self._tokens[:width].copy_(tokens)
        self._positions[:width].copy_(positions)
        key = (batch, length)
        with torch.cuda.device(self._device):  # the engine thread's current device may be another one
            if key not in self._graphs:
                self._graphs[key] = self._capture(batch, length)
            graph, logits = self._graphs[key]
            graph.replay()
        return logits[:width]

    def _capture(self, batch: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self._device
        tokens, positions = self._tokens[:batch], self._positions[:batch]
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(WARMUP_RUNS):
                self._decode(tokens, positions, length)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._decode(tokens, positions, length)
        return graph, logits
