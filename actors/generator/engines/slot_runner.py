"""Forward passes over a preallocated slot KV cache, with the HF model's own weights.

The engine keeps one sequence per *slot*; a slot's keys and values live at ``[:, slot, :, position]`` of a
cache allocated once (``[layers, 2, slots, kv_heads, max_len, head_dim]``: keys, then values), so
nothing is allocated as sequences grow and a finished slot is reused by the next request at once.

Two operations, each one batched forward:

- ``prefill(prompts, slot_groups)``: run each distinct prompt once (right-padded, causal), write its K/V
  into the first slot of its group and copy it to the group's other slots (shared-prefix prefill: the
  G samples of a prompt prefill it once). Returns the logits of each prompt's last position.
- ``decode(slots, tokens, positions)``: feed one token per slot at its position, write that K/V and
  attend over the slot's cache up to it. Runs densely over slots ``[0, n)`` (the engine hands out the
  lowest free slots, so the active ones are packed); slots in that range with no token are fed a dummy
  token at position 0, which is harmless because a free slot's cache is rewritten by its next prefill.

`FastSlotRunner` re-implements the forward for the Llama family (Llama, Mistral without sliding window,
Qwen2 = Llama + qkv bias, Qwen3 = + q/k norms per head, Qwen3-MoE = Qwen3 + sparse MoE blocks, OLMoE = Llama +
q/k norms over the whole projection, before the heads are split, + sparse MoE blocks) and GPT-2, calling the HF
submodules (norms, projections, MLPs, routers, experts, rotary embedding) so it reads the very Parameter tensors
the engine updates in place. On CUDA its decode step of a dense model is captured in CUDA graphs
(`actors/generator/engines/cuda_graphs.py`), one per bucket of (dense batch size, attended length).
`HFSlotRunner` is the fallback for any other model: one HF forward per slot with a ``DynamicCache`` each --
correct, keeps the cache across weight swaps, but slow.

Routes (mixture-of-experts models): every operation records, through `actors.moe.RouteRecorder` (hooks on the
routers the forward calls), the experts each MoE layer chose for each position the operation wrote, and leaves
them in `SlotRunner.routes`: one ``[positions, layers, top_k]`` array per row of the call (per prompt for
``prefill``, per slot for ``decode``, per suffix for ``extend``), padding and idle-slot rows dropped. A MoE decode
step is never captured in a CUDA graph: hooks do not run on a graph's replay, and the experts' dispatch reads
the routes on the host. A dense model records nothing (`SlotRunner.recorder` is None).
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from actors.generator.engines.cuda_graphs import DecodeGraphs
from actors.moe import RouteRecorder, route_shape

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "olmoe")
"""``config.model_type`` values `FastSlotRunner` runs as Llama-like decoders (RMSNorm, RoPE, gated MLP or sparse
MoE block, GQA)."""


class SlotRunner(ABC):
    """Forward passes over ``num_slots`` sequences of at most ``max_len`` tokens each (see the module docstring)."""

    supports_extend = False
    """Whether `extend` (a suffix after positions a slot already holds: prefix reuse) is implemented."""

    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int) -> None:
        self.model = model
        self.num_slots = num_slots
        self.max_len = max_len
        self.device = next(model.parameters()).device
        self.recorder = RouteRecorder(model) if route_shape(model) is not None else None
        """Records the routers of a MoE model during each operation; None for a dense model."""
        self.routes: list[np.ndarray] = []
        """MoE: the routes of the last operation, one ``[positions, layers, top_k]`` array per row of its call."""

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        if self.recorder is None:
            yield
            return
        with self.recorder.recording():
            yield

    def _keep_routes(self, width: int, rows: Sequence[tuple[int, int]]) -> None:
        """Cut what the last forward recorded (a ``[batch, width]`` input, flattened row-major) to ``rows``:
        (batch row, its first n tokens) for each row of the call, in the call's order."""
        if self.recorder is None:
            return
        flat = self.recorder.take()
        grid = flat.reshape(-1, width, *flat.shape[1:])
        self.routes = [grid[row, :n] for row, n in rows]

    @abstractmethod
    def prefill(self, prompts: Sequence[Sequence[int]], slot_groups: Sequence[Sequence[int]]) -> torch.Tensor:
        """Prompt ``i`` into every slot of ``slot_groups[i]``; float logits of each prompt's last token,
        ``[len(prompts), vocab]``."""

    @abstractmethod
    def decode(
        self,
        slots: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        idle_positions: Mapping[int, int] | None = None,
    ) -> torch.Tensor:
        """Token ``tokens[i]`` at ``positions[i]`` of slot ``slots[i]``; float logits ``[len(slots), vocab]``.
        ``idle_positions``: where a slot that is not decoding but whose cache must be kept (a parked prefix) may
        take a dummy write, when a dense decode covers it (default: position 0)."""

    def extend(self, slots: Sequence[int], suffixes: Sequence[Sequence[int]], starts: Sequence[int]) -> torch.Tensor:
        """Suffix ``suffixes[i]`` at positions ``starts[i]..`` of slot ``slots[i]``, whose cache already holds the
        positions before; float logits of each suffix's last token."""
        raise NotImplementedError(f"{type(self).__name__} cannot extend a cached prefix")


def build_slot_runner(
    model: PreTrainedModel, num_slots: int, max_len: int, *, cuda_graphs: bool = True, fast: bool = True
) -> SlotRunner:
    """`FastSlotRunner` when the model's family is supported (and ``fast``), else `HFSlotRunner`."""
    if fast and FastSlotRunner.supports(model):
        return FastSlotRunner(model, num_slots, max_len, cuda_graphs=cuda_graphs)
    return HFSlotRunner(model, num_slots, max_len)


class FastSlotRunner(SlotRunner):
    """The slot cache and a hand-written forward over the HF modules' weights (Llama family, GPT-2)."""

    supports_extend = True

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        cfg = model.config
        kind = getattr(cfg, "model_type", "")
        if kind == "gpt2":
            return not getattr(cfg, "add_cross_attention", False)
        if kind not in LLAMA_FAMILY:
            return False
        if kind == "mistral":
            return getattr(cfg, "sliding_window", None) is None
        return not getattr(cfg, "use_sliding_window", False)

    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int, *, cuda_graphs: bool) -> None:
        super().__init__(model, num_slots, max_len)
        cfg = model.config
        self._gpt2 = cfg.model_type == "gpt2"
        if self._gpt2:
            self._base = model.transformer
            self._blocks = list(self._base.h)
            self._heads = self._kv_heads = int(cfg.n_head)
            self._head_dim = int(cfg.n_embd) // self._heads
        else:
            self._base = model.model
            self._blocks = list(self._base.layers)
            attn = self._blocks[0].self_attn
            self._heads = int(cfg.num_attention_heads)
            self._kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self._heads)
            self._head_dim = int(attn.head_dim)
        norm = getattr(self._blocks[0].self_attn, "q_norm", None) if not self._gpt2 else None
        self._full_qk_norm = norm is not None and norm.weight.shape[0] != self._head_dim
        """OLMoE: q/k norms over the whole projection (before the head split), not per head (Qwen3)."""
        self._clip_qkv: float | None = getattr(cfg, "clip_qkv", None)
        self._scales = [float(self._attention(block).scaling) for block in self._blocks]
        self._gpt2_blocks = [_Gpt2Block.of(block) for block in self._blocks] if self._gpt2 else []
        dtype = next(model.parameters()).dtype
        shape = (len(self._blocks), 2, num_slots, self._kv_heads, max_len, self._head_dim)
        self.cache = torch.zeros(shape, dtype=dtype, device=self.device)
        """Keys (``[:, 0]``) and values (``[:, 1]``) in one tensor, so one write stores both; each plane keeps
        ``[slots, kv_heads, positions, head_dim]`` contiguous, so attention reads a slice without a copy."""
        self.key_index = torch.arange(max_len, device=self.device)
        self.row_index = torch.arange(num_slots, device=self.device)
        self._graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda" and self.recorder is None:
            self._graphs = DecodeGraphs(self.decode_dense, num_slots=num_slots, max_len=max_len, device=self.device)

    def _attention(self, block: torch.nn.Module) -> Any:
        return block.attn if self._gpt2 else block.self_attn

    # ---- the two operations -------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], slot_groups: Sequence[Sequence[int]]) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[*p, *[0] * (width - len(p))] for p in prompts], dtype=torch.long, device=self.device)
        positions = self.key_index[:width].expand(len(prompts), width)
        first = torch.tensor([group[0] for group in slot_groups], device=self.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        causal = None
        if self.device.type != "cuda":  # [group x width, width]: -inf above the diagonal, per query head of a group
            causal = torch.full((width, width), float("-inf"), dtype=self.cache.dtype).triu_(1)
            causal = causal.repeat(self._heads // self._kv_heads, 1)
        with self._recording():
            hidden = self._forward(
                ids, positions, lambda layer, q, kv: self._prefill_attend(layer, q, kv, first, causal)
            )
        self._keep_routes(width, [(row, len(p)) for row, p in enumerate(prompts)])
        logits = self._head(hidden[torch.arange(len(prompts), device=self.device), last])
        for group, prompt in zip(slot_groups, prompts, strict=True):
            if len(group) > 1:
                others = torch.tensor(list(group[1:]), device=self.device)
                n = len(prompt)
                self.cache[:, :, others, :, :n] = self.cache[:, :, group[0] : group[0] + 1, :, :n]
        return logits.float()

    @torch.inference_mode()
    def decode(
        self,
        slots: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        idle_positions: Mapping[int, int] | None = None,
    ) -> torch.Tensor:
        width = max(slots) + 1
        dense_tokens = [0] * width
        dense_positions = [0] * width
        for slot, position in (idle_positions or {}).items():
            if slot < width:
                dense_positions[slot] = min(position, self.max_len - 1)
        for slot, token, position in zip(slots, tokens, positions, strict=True):
            dense_tokens[slot], dense_positions[slot] = token, position
        token_t = torch.tensor(dense_tokens, dtype=torch.long, device=self.device)
        position_t = torch.tensor(dense_positions, dtype=torch.long, device=self.device)
        if self._graphs is not None:
            logits = self._graphs.run(token_t, position_t, max(positions) + 1)
        else:
            with self._recording():
                logits = self.decode_dense(token_t, position_t, max(positions) + 1)
            self._keep_routes(1, [(slot, 1) for slot in slots])
        if list(slots) == list(range(width)):  # the common case: every slot up to the last one is running
            return logits.float()
        return logits[torch.tensor(list(slots), device=self.device)].float()

    @torch.inference_mode()
    def extend(self, slots: Sequence[int], suffixes: Sequence[Sequence[int]], starts: Sequence[int]) -> torch.Tensor:
        """Each suffix is right-padded to the longest; its keys and values are written at its own positions only,
        and its queries attend over the slot's cache up to themselves (the cached prefix, then causally)."""
        n, width = len(slots), max(len(s) for s in suffixes)
        ids = torch.tensor([[*s, *[0] * (width - len(s))] for s in suffixes], dtype=torch.long, device=self.device)
        start = torch.tensor(list(starts), device=self.device)
        positions = (start[:, None] + self.key_index[None, :width]).clamp_(max=self.max_len - 1)
        kv_len = max(b + len(s) for b, s in zip(starts, suffixes, strict=True))
        visible = (self.key_index[None, None, :kv_len] <= positions[:, :, None])[:, None]  # [n, 1, width, keys]
        rows = torch.tensor(list(slots), device=self.device)

        def attend(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            for row, (slot, begin, suffix) in enumerate(zip(slots, starts, suffixes, strict=True)):
                self.cache[layer][:, slot, :, begin : begin + len(suffix)] = kv[row, :, :, : len(suffix)]
            keys, values = self.cache[layer, 0, rows, :, :kv_len], self.cache[layer, 1, rows, :, :kv_len]
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=visible, scale=self._scales[layer], enable_gqa=self._heads != self._kv_heads
            )

        with self._recording():
            hidden = self._forward(ids, positions, attend)
        self._keep_routes(width, [(row, len(s)) for row, s in enumerate(suffixes)])
        last = torch.tensor([len(s) - 1 for s in suffixes], device=self.device)
        return self._head(hidden[torch.arange(n, device=self.device), last]).float()

    def decode_dense(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One token for each slot ``[0, n)`` (``n = len(tokens)``), attending over the first ``kv_len`` cache
        positions; static shapes given (n, kv_len), so CUDA graphs capture it as is."""
        n = tokens.shape[0]
        rows = self.row_index[:n]
        mask = (self.key_index[None, :kv_len] <= positions[:, None])[:, None, None, :]
        bias = None
        if self.device.type != "cuda":  # [n * kv_heads, 1, kv_len]: 0 where a key is visible, -inf elsewhere
            hidden_keys = torch.zeros((n, kv_len), dtype=self.cache.dtype).masked_fill_(~mask[:, 0, 0], float("-inf"))
            bias = hidden_keys.repeat_interleave(self._kv_heads, dim=0)[:, None, :]

        def attend(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            self.cache[layer][:, rows, :, positions] = kv[:, :, :, 0]  # advanced dims first: [n, 2, heads, dim]
            keys, values = self.cache[layer, 0, :n, :, :kv_len], self.cache[layer, 1, :n, :, :kv_len]
            if self.device.type == "cuda":
                return F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=self._scales[layer], enable_gqa=self._heads != self._kv_heads
                )
            assert bias is not None
            return self._small_attention(q, keys, values, bias, self._scales[layer])

        hidden = self._forward(tokens[:, None], positions[:, None], attend)
        return self._head(hidden[:, 0])

    def _small_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """One query per row in plain matmuls: on the CPU this beats SDPA's kernels (built for long queries)
        several times over for decode. Query heads are grouped onto their KV head (GQA) by a view, not a copy;
        ``bias`` (``[slots x kv_heads, 1, keys]``) is 0 where a key is visible and -inf elsewhere (built once
        per step)."""
        n, _, _, dim = q.shape
        rows = n * self._kv_heads
        grouped = q.reshape(rows, self._heads // self._kv_heads, dim)
        keys, values = keys.reshape(rows, -1, dim), values.reshape(rows, -1, dim)  # views: slots and heads merge
        scores = torch.baddbmm(bias, grouped, keys.transpose(1, 2), alpha=scale)
        return torch.bmm(scores.softmax(dim=-1), values).view(n, self._heads, 1, dim)

    # ---- the model --------------------------------------------------------------------------------

    def _prefill_attend(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor, first: torch.Tensor, causal: torch.Tensor | None
    ) -> torch.Tensor:
        width = kv.shape[3]
        self.cache[layer][:, first, :, :width] = kv.transpose(0, 1)
        k, v = kv.unbind(1)
        if causal is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self._scales[layer], enable_gqa=self._heads != self._kv_heads
            )
        # CPU: plain batched matmuls beat SDPA's kernels on the short prompts of RL tasks.
        batch, _, _, dim = q.shape
        rows = batch * self._kv_heads
        grouped = q.reshape(rows, -1, dim)  # a KV head's query heads, one after another: [group x width, dim]
        scores = torch.baddbmm(causal, grouped, k.reshape(rows, width, dim).transpose(1, 2), alpha=self._scales[layer])
        out = torch.bmm(scores.softmax(dim=-1), v.reshape(rows, width, dim))
        return out.view(batch, self._heads, width, dim)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: Any) -> torch.Tensor:
        """Hidden states after the final norm, ``[batch, tokens, hidden]``; ``attend(layer, q, kv)`` does the
        cache write and the attention (q: ``[batch, heads, tokens, head_dim]``; kv: keys and values stacked,
        ``[batch, 2, kv_heads, tokens, head_dim]``)."""
        batch, width = ids.shape
        # Hidden states stay 2-D ([batch x tokens, hidden]) between the attentions: every projection is one addmm.
        if self._gpt2:
            flat_ids, flat_positions = ids.reshape(-1), positions.reshape(-1)
            hidden = F.embedding(flat_ids, self._base.wte.weight) + F.embedding(flat_positions, self._base.wpe.weight)
            for layer, w in enumerate(self._gpt2_blocks):
                qkv = torch.addmm(w.c_attn[1], F.layer_norm(hidden, *w.ln_1), w.c_attn[0])
                qkv = qkv.view(batch, width, 3, self._heads, self._head_dim).permute(0, 2, 3, 1, 4)
                out = attend(layer, qkv[:, 0], qkv[:, 1:]).transpose(1, 2).reshape(batch * width, -1)
                hidden = hidden + torch.addmm(w.c_proj[1], out, w.c_proj[0])
                x = w.act(torch.addmm(w.c_fc[1], F.layer_norm(hidden, *w.ln_2), w.c_fc[0]))
                hidden = hidden + torch.addmm(w.mlp_proj[1], x, w.mlp_proj[0])
            return F.layer_norm(hidden, *_norm_args(self._base.ln_f)).view(batch, width, -1)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        hidden = self._base.embed_tokens(ids.reshape(-1))
        cos, sin = self._base.rotary_emb(hidden, positions)
        for layer, block in enumerate(self._blocks):
            attn = block.self_attn
            q, k, v = self._qkv(attn, block.input_layernorm(hidden))
            q = q.view(batch, width, self._heads, self._head_dim)
            k = k.view(batch, width, self._kv_heads, self._head_dim)
            v = v.view(batch, width, self._kv_heads, self._head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm") and not self._full_qk_norm:  # Qwen3, Qwen3-MoE: per head
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            out = attend(layer, q, torch.stack((k, v), dim=1)).transpose(1, 2).reshape(batch * width, -1)
            hidden = hidden + _linear(attn.o_proj, out)
            hidden = hidden + _mlp(block.mlp, block.post_attention_layernorm(hidden))
        return self._base.norm(hidden).view(batch, width, -1)

    def _qkv(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k, v projections of ``x`` (``[tokens, hidden]``), with OLMoE's whole-projection norms and clip."""
        q, k, v = _linear(attn.q_proj, x), _linear(attn.k_proj, x), _linear(attn.v_proj, x)
        if self._full_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        if self._clip_qkv is not None:
            q, k, v = (t.clamp(-self._clip_qkv, self._clip_qkv) for t in (q, k, v))
        return q, k, v

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


class HFSlotRunner(SlotRunner):
    """Any HF causal LM: one ``DynamicCache`` and one batch-1 forward per slot (the slow, general path)."""

    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int) -> None:
        super().__init__(model, num_slots, max_len)
        self._caches: list[DynamicCache | None] = [None] * num_slots
        self._cache_kwarg = "cache" if "cache" in _forward_params(model) else "past_key_values"

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], slot_groups: Sequence[Sequence[int]]) -> torch.Tensor:
        logits, routes = [], []
        for prompt, group in zip(prompts, slot_groups, strict=True):
            ids = torch.as_tensor(list(prompt), dtype=torch.long, device=self.device)[None]
            for index, slot in enumerate(group):
                cache = DynamicCache(config=self.model.config)
                with self._recording():
                    out = self.model(input_ids=ids, use_cache=True, **{self._cache_kwarg: cache})
                self._keep_routes(len(prompt), [(0, len(prompt))])
                routes += self.routes if index == 0 else []  # the group's slots compute the same routes
                self._caches[slot] = cache
            logits.append(out.logits[0, -1].float())
        self.routes = routes
        return torch.stack(logits)

    @torch.inference_mode()
    def decode(
        self,
        slots: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        idle_positions: Mapping[int, int] | None = None,
    ) -> torch.Tensor:
        logits, routes = [], []
        for slot, token, position in zip(slots, tokens, positions, strict=True):
            ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
            pos = torch.tensor([[position]], dtype=torch.long, device=self.device)
            cache = {self._cache_kwarg: self._caches[slot]}
            with self._recording():
                out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **cache)
            self._keep_routes(1, [(0, 1)])
            routes += self.routes
            logits.append(out.logits[0, -1].float())
        self.routes = routes
        return torch.stack(logits)


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def _mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """A decoder block's MLP on ``[tokens, hidden]`` rows: a gated MLP, or a sparse MoE block (its router, then
    its experts on the routed rows: the block's own forward wants ``[batch, tokens, hidden]``)."""
    if hasattr(mlp, "gate_proj"):
        return _linear(mlp.down_proj, _activation(mlp.act_fn)(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))
    if hasattr(mlp, "experts"):
        _, weights, experts = mlp.gate(x)
        return mlp.experts(x, experts, weights)
    return mlp(x)


def _norm_args(module: Any) -> tuple[Any, ...]:
    """``F.layer_norm``'s arguments after the input, from a ``LayerNorm`` module."""
    return (module.normalized_shape, module.weight, module.bias, module.eps)


@dataclass(frozen=True)
class _Gpt2Block:
    """One GPT-2 block's Parameters, looked up once: the very tensors the engine updates in place, minus the
    module attribute lookups of every step."""

    ln_1: tuple[Any, ...]
    c_attn: tuple[torch.Tensor, torch.Tensor]
    c_proj: tuple[torch.Tensor, torch.Tensor]
    ln_2: tuple[Any, ...]
    c_fc: tuple[torch.Tensor, torch.Tensor]
    mlp_proj: tuple[torch.Tensor, torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, block: Any) -> _Gpt2Block:
        attn, mlp = block.attn, block.mlp
        return cls(
            ln_1=_norm_args(block.ln_1),
            c_attn=(attn.c_attn.weight, attn.c_attn.bias),
            c_proj=(attn.c_proj.weight, attn.c_proj.bias),
            ln_2=_norm_args(block.ln_2),
            c_fc=(mlp.c_fc.weight, mlp.c_fc.bias),
            mlp_proj=(mlp.c_proj.weight, mlp.c_proj.bias),
            act=_activation(mlp.act),
        )


def _activation(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation as a plain function when its type is known (saves a module call per layer and step)."""
    name = type(module).__name__
    if name in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh"):
        return functools.partial(F.gelu, approximate="tanh")
    if name in ("SiLUActivation", "SiLU"):
        return F.silu
    return module


def _forward_params(model: PreTrainedModel) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)
