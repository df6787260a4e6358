"""The `megatron` training backend: megatron-core's `GPTModel` behind `TrainingBackend`, HF weights in and out.

How a step runs on one rank (layout in `parallel`; ``tp x pp`` ranks hold one replica's shards)::

    HF model --hf_to_megatron, shard(tp_rank)--> GPTModel shards (fp32 masters) + AdamW on them
    train_step: minibatch --pack by token budget--> micro-batches; pack i goes to data-parallel rank i % dp
      micro-batch --GPTModel stages--> vocab-parallel logits [S, T, V/tp] / temperature  (last stage)
                  --vocab_parallel_cross_entropy--> log-probs [S, T] --loss_fn--> loss --backward
      grads: all-reduce SUM over data parallel (each pack counted once; loss_fn already normalises)
      global norm over TP x PP: sharded params once per TP rank, replicated ones once --> clip --> AdamW
    export_weights / state_tensors: all-gather the TP shards, broadcast each stage's --> full Megatron
      tensors on every rank (--> HF names)

Decisions the trainer relies on, beyond those of the torch backend (same precision, tempering,
micro-batch packing and dropout rule; see `actors/trainer/backends/torch_backend.py`):
- Checkpoint tensors are the full, unsharded Megatron tensors (model and AdamW moments), identical
  on every rank: a checkpoint written by any rank resumes any rank, and a resume may change the TP
  size. Writing them costs one all-gather per checkpoint.
- The vocabulary is padded to a multiple of the TP size with zero rows; the padded logits are set
  to -inf before the log-softmax, so they carry no probability.
- The optimizer is torch's AdamW over the local shards rather than megatron-core's distributed
  optimizer (whose grad buffers assume CUDA in 0.16.1); with the norm computed as above the update
  equals the unsharded one.
- Pipeline parallel runs one micro-batch at a time through the stages (`stages.py`); the last
  stage computes log-probs and calls loss_fn, and its results reach every rank. A model with tied
  embeddings is refused with pipeline parallel > 1.
- A Qwen3-MoE model runs megatron-core's `MoELayer` (per-expert MLPs, ``allgather`` dispatcher, no
  auxiliary loss) with tensor parallel 1; expert parallelism is not built. ``moe.routing_replay``
  routes each position through ``MicroBatch.routes`` (`replay`); a position without a record keeps
  the router's own top-k and is counted in ``route_replay.unrouted``.
- Not built: packed (THD) micro-batches, liger kernels, the chunked LM head and activation
  checkpointing. ``trainer.packing``, ``fused_kernels`` and ``lm_head_chunk_tokens`` are never read
  here; `pipeline/config.py` (`backend_conflicts`) refuses at load the values that ask for them
  (``fused_kernels: on``, a positive chunk) and warns about the others. Activation checkpointing
  is refused here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PreTrainedModel

from actors.moe import route_shape
from actors.trainer.backends.base import (
    LossExtras,
    LossFn,
    MicroBatch,
    StepResult,
    TrainBatch,
    TrainingBackend,
    backend_options,
    bf16_autocast,
    check_loss,
    check_options,
    default_autocast,
    pack_by_token_budget,
    padded_micro_batch,
    reject_dropout,
    step_unless_non_finite,
    train_minibatches,
)
from actors.trainer.backends.checkpoint_state import (
    adamw_hyperparameters,
    check_state_meta,
    load_adamw_state,
    load_rng,
    rng_meta,
    rng_tensors,
    saved_moments,
)
from actors.trainer.backends.megatron import cpu_compat
from actors.trainer.backends.megatron.convert import (
    ModelShape,
    hf_to_megatron,
    megatron_to_hf,
    shard,
    shard_rule,
    unshard,
)
from actors.trainer.backends.megatron.model import build_gpt_model, local_name, transformer_engine_available
from actors.trainer.backends.megatron.parallel import init_model_parallel, init_process_group
from actors.trainer.backends.megatron.replay import MegatronRouteReplay
from actors.trainer.backends.megatron.stages import Stages, all_gather_json
from pipeline.config import LeewayConfig
from pipeline.rl.batching import ModelLimits

STATE_FORMAT = 1
"""Version of the layout of `state_tensors` / `state_meta`; `load_state` refuses others."""


class MegatronBackend(TrainingBackend):
    """AdamW on a megatron-core `GPTModel` converted from an HF model; see the module docstring."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        use_transformer_engine: bool | None = None,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        micro_batch_tokens: int = 8192,
        device: str | torch.device = "cpu",
        autocast: bool | None = None,
        temperature: float = 1.0,
        gradient_checkpointing: bool = False,
        routing_replay: bool = False,
        seed: int = 0,
    ) -> None:
        check_options(temperature, grad_clip)
        if gradient_checkpointing:
            raise ValueError("trainer.gradient_checkpointing: not built for trainer.backend=megatron; set it false")
        reject_dropout(model)
        self.device = _rank_device(torch.device(device))
        cpu_compat.apply()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_process_group(self.device)
        self.layout = init_model_parallel(tensor_parallel_size, pipeline_parallel_size)
        if self.device.type == "cuda":  # megatron-core's CUDA RNG tracker needs its states even without dropout
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        self.shape = ModelShape.from_hf_config(model.config)
        _check_pipeline(self.shape, pipeline_parallel_size)
        _check_moe(self.shape, tensor_parallel_size, routing_replay)
        self.routing_replay = bool(routing_replay)
        self._layer_offset = self.layout.pp_rank * (self.shape.num_layers // pipeline_parallel_size)
        self.stages = Stages(self.layout, self.device, self.shape.hidden)
        use_te = self.device.type == "cuda" and transformer_engine_available()
        self.use_transformer_engine = use_te if use_transformer_engine is None else bool(use_transformer_engine)
        if self.use_transformer_engine and self.device.type != "cuda":
            raise ValueError("megatron.use_transformer_engine=true needs trainer.device cuda")
        self.grad_clip = float(grad_clip)
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.temperature = float(temperature)
        self.autocast = default_autocast(self.device) if autocast is None else bool(autocast)
        rows = model.get_input_embeddings().num_embeddings
        routes = route_shape(model)
        self._limits = ModelLimits(
            vocab_size=min(self.shape.vocab_size, int(rows)),
            max_positions=self.shape.max_positions,
            routes=None if routes is None else (routes.layers, routes.top_k, routes.num_experts),
        )
        self._hf_names = list(model.state_dict())
        self.model = build_gpt_model(
            self.shape,
            tp_size=self.layout.tp_size,
            pp_size=self.layout.pp_size,
            pp_rank=self.layout.pp_rank,
            use_transformer_engine=self.use_transformer_engine,
        )
        self._load_full(hf_to_megatron(self.shape, {k: v.float() for k, v in model.state_dict().items()}))
        self.model.to(self.device).eval()
        self.route_replay = (
            MegatronRouteReplay(self.model, layer_offset=self._layer_offset, num_experts=self.shape.num_experts)
            if self.shape.is_moe
            else None
        )
        """Routes and agreement counters of this stage's MoE layers (`replay`); None for a dense model."""
        self._params = {self._global_name(n): p for n, p in self.model.named_parameters() if p.requires_grad}
        """This rank's parameters under the whole model's local-spec names (layer indices across stages)."""
        self.optimizer = torch.optim.AdamW(
            list(self._params.values()), lr=lr, betas=tuple(betas), eps=adam_eps, weight_decay=weight_decay
        )
        local_vocab = self.shape.padded_vocab(self.layout.tp_size) // self.layout.tp_size
        first = self.layout.tp_rank * local_vocab
        self._padded_columns = torch.arange(first, first + local_vocab, device=self.device) >= self.shape.vocab_size

    @classmethod
    def from_config(
        cls, config: LeewayConfig, model: PreTrainedModel, *, autocast: bool | None = None, **overrides: Any
    ) -> MegatronBackend:
        """The backend of a run: the options every backend reads (`backend_options`), then the parallel sizes
        and layer spec from ``megatron``."""
        m = config.megatron
        return cls(
            model,
            **(backend_options(config) | overrides),
            tensor_parallel_size=m.tensor_parallel_size,
            pipeline_parallel_size=m.pipeline_parallel_size,
            use_transformer_engine=None if m.use_transformer_engine == "auto" else m.use_transformer_engine,
            autocast=autocast,
            routing_replay=config.moe.routing_replay,
            seed=config.run.seed,
        )

    # -- groups ----------------------------------------------------------------------------------

    @property
    def _tp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group()

    @property
    def _dp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    @property
    def _model_parallel_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_model_parallel_group()

    def _global_name(self, name: str) -> str:
        """A parameter name of this stage's module (TE or local spec) as the whole model's local-spec name."""
        name = local_name(name)
        if self._layer_offset and name.startswith("decoder.layers."):
            _, _, index, rest = name.split(".", 3)
            name = f"decoder.layers.{int(index) + self._layer_offset}.{rest}"
        return name

    def _my_packs(self, packs: list[list[int]]) -> list[tuple[int, list[int]]]:
        """(index, pack) of the packs this data-parallel rank computes."""
        dp = self.layout.dp_size
        return [(i, p) for i, p in enumerate(packs) if i % dp == self.layout.dp_rank]

    # -- forward ---------------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> list[np.ndarray]:
        lengths = [s.num_tokens for s in batch.sequences]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        flat = torch.zeros(int(offsets[-1]), dtype=torch.float32, device=self.device)
        for _, pack in self._my_packs(pack_by_token_budget(lengths, self.micro_batch_tokens)):
            micro = padded_micro_batch(batch, pack, self.device)
            _, output = self._stage_forward(micro, requires_grad=False)
            if self.layout.last_stage:
                logp, _ = self._logprobs_of(output, micro, with_entropy=False)
                for row, index in enumerate(pack):
                    flat[offsets[index] : offsets[index + 1]] = logp[row, : lengths[index]].float()
        self.stages.from_last(flat)
        if self.layout.dp_size > 1:  # every token is computed by exactly one data-parallel rank
            dist.all_reduce(flat, group=self._dp_group)
        flat = flat.cpu()
        return [flat[offsets[i] : offsets[i + 1]].numpy().copy() for i in range(len(lengths))]

    def _stage_forward(self, micro: MicroBatch, *, requires_grad: bool) -> tuple[Tensor | None, Tensor]:
        """This stage's forward: (input received from the previous stage or None, output). The output is
        the vocabulary-parallel logits ``[S, T, V/tp]`` on the last stage; elsewhere the hidden states,
        already sent on to the next stage."""
        rows, width = micro.tokens.shape
        hidden = self.stages.receive_input(rows, width, requires_grad=requires_grad)
        if hidden is not None:
            self.model.set_input_tensor(hidden)
        positions = torch.arange(width, device=self.device).expand(rows, width)
        with bf16_autocast(self.device, self.autocast), self._routing(micro):
            output = self.model(
                input_ids=micro.tokens,
                position_ids=positions,
                attention_mask=cpu_compat.causal_mask(width, self.device),
            )
        if not self.layout.last_stage:
            output = output.float()
            self.stages.send_output(output)
        return hidden, output

    def _routing(self, micro: MicroBatch) -> contextlib.AbstractContextManager[object]:
        """The MoE routers' replay of ``micro``'s routes (``moe.routing_replay``; off: agreement only)."""
        if self.route_replay is None:
            return contextlib.nullcontext()
        routes, routed = micro.routes, micro.routed
        valid = micro.attention_mask.bool()
        return self.route_replay.replaying(routes, routed, valid, replay=self.routing_replay)

    def _logprobs_of(self, logits: Tensor, micro: MicroBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probs ``[S, T]`` (position 0 and padding 0) and, optionally, detached entropy ``[S, T]``
        of the last stage's logits."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits[:, :-1].float() / self.temperature
        logits = logits.masked_fill(self._padded_columns, -math.inf)
        valid = micro.attention_mask[:, 1:].bool()
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = torch.nn.functional.pad(torch.where(valid, self._entropy(logits), 0.0), (1, 0))
        # vocab_parallel_cross_entropy overwrites its input (exp in place): the entropy is taken first.
        token_logp = -vocab_parallel_cross_entropy(logits, micro.tokens[:, 1:])
        logp = torch.nn.functional.pad(torch.where(valid, token_logp, 0.0), (1, 0))
        return logp, entropy

    def _entropy(self, logits: Tensor) -> Tensor:
        """Entropy of the softmax over vocabulary-parallel logits (padded columns are -inf)."""
        top = logits.max(dim=-1).values
        if self.layout.tp_size > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self._tp_group)
        shifted = logits - top[..., None]
        weights = shifted.exp()
        sums = torch.stack([weights.sum(-1), (weights * torch.where(weights > 0, shifted, 0.0)).sum(-1)])
        if self.layout.tp_size > 1:
            dist.all_reduce(sums, group=self._tp_group)
        return sums[0].log() - sums[1] / sums[0]

    # -- training --------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, num_minibatches: int = 1) -> StepResult:
        def accumulate(chunk: list[int], mb_index: int, num: int) -> tuple[float, float, list[dict[str, float]], int]:
            return self._accumulate(batch, chunk, loss_fn, mb_index, num)

        return train_minibatches(batch, num_minibatches, self.model, self.optimizer, accumulate, self._optimizer_update)

    def _accumulate(
        self, batch: TrainBatch, chunk: list[int], loss_fn: LossFn, mb_index: int, num_minibatches: int
    ) -> tuple[float, float, list[dict[str, float]], int]:
        """Forward and backward this rank's micro-batches of one minibatch, then sum the gradients,
        losses, entropies and stats over data parallel. Returns (loss, entropy sum, stats, micro-batches)."""
        packs = pack_by_token_budget([batch.sequences[i].num_tokens for i in chunk], self.micro_batch_tokens)
        loss_tokens = sum(batch.sequences[i].num_loss_tokens for i in chunk)
        totals = torch.zeros(2, dtype=torch.float64)
        stats_out: list[dict[str, float]] = []
        for micro_index, pack in self._my_packs(packs):
            micro = padded_micro_batch(batch, [chunk[i] for i in pack], self.device)
            hidden, output = self._stage_forward(micro, requires_grad=True)
            if not self.layout.last_stage:
                torch.autograd.backward(output, self.stages.receive_output_grad(output))
                if hidden is not None:
                    self.stages.send_input_grad(hidden)
                continue
            logp, entropy = self._logprobs_of(output, micro, with_entropy=True)
            assert entropy is not None
            extras = LossExtras(
                entropy=entropy,
                minibatch_index=mb_index,
                num_minibatches=num_minibatches,
                micro_index=micro_index,
                num_micro_batches=len(packs),
                minibatch_seq_indices=tuple(chunk),
                minibatch_loss_tokens=loss_tokens,
            )
            loss, stats = loss_fn(logp, micro, extras)
            loss = check_loss(loss)
            if loss.requires_grad:
                loss.backward()
            if hidden is not None:
                self.stages.send_input_grad(hidden)
            totals[0] += float(loss.detach())
            totals[1] += float(entropy[micro.loss_mask].double().sum())
            stats_out.append({k: float(v) for k, v in stats.items()})
        totals = self.stages.from_last(totals.to(self.device))
        if self.layout.pp_size > 1:
            stats_out = all_gather_json(stats_out, self.stages.group, self.device)[-1]
        if self.layout.dp_size > 1:
            self._all_reduce_grads()
            dist.all_reduce(totals, group=self._dp_group)
            stats_out = [
                s for rank_stats in all_gather_json(stats_out, self._dp_group, self.device) for s in rank_stats
            ]
        return float(totals[0]), float(totals[1]), stats_out, len(packs)

    def _all_reduce_grads(self) -> None:
        """Sum gradients over data parallel; a rank without a micro-batch contributes zeros."""
        grads = []
        for param in self._params.values():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self._dp_group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def _optimizer_update(self) -> tuple[float, bool]:
        """Clip by the global norm (as ``clip_grad_norm_`` would on the unsharded model), then AdamW."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        grads = [p.grad for p in self._params.values() if p.grad is not None]
        counted = [
            p.grad for p in self._params.values() if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)
        ]
        square = torch.zeros((), dtype=torch.float32, device=self.device)
        for grad in counted:
            square += grad.float().pow(2).sum()
        if self.layout.tp_size * self.layout.pp_size > 1:
            dist.all_reduce(square, group=self._model_parallel_group)
        grad_norm = float(square.sqrt())

        def clip() -> None:  # only for a finite norm
            torch._foreach_mul_(grads, min(self.grad_clip / (grad_norm + 1e-6), 1.0))

        return step_unless_non_finite(self.optimizer, grad_norm, clip)

    # -- weights and checkpoint state ------------------------------------------------------------

    def _gather(self, name: str, tensor: Tensor) -> Tensor:
        """The full tensor ``name`` (a Megatron local name) from this TP group's shards, on the CPU."""
        tensor = tensor.detach()
        if tensor.dim() == 0:  # AdamW's step count
            return tensor.to(device="cpu", copy=True)
        if self.layout.tp_size == 1:
            return unshard(self.shape, name, [tensor.to(device="cpu", copy=True)])
        pieces = [torch.empty_like(tensor) for _ in range(self.layout.tp_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self._tp_group)
        return unshard(self.shape, name, [p.cpu() for p in pieces])

    @torch.no_grad()
    def _full_model(self) -> dict[str, Tensor]:
        return self.stages.gather({name: self._gather(name, p) for name, p in self._params.items()})

    @torch.no_grad()
    def _load_full(self, full: Mapping[str, Tensor]) -> None:
        """Load full Megatron tensors (local names): this rank's shards, strictly by name and shape."""
        local = shard(self.shape, full, self.layout.tp_rank, self.layout.tp_size)
        params = {self._global_name(n): p for n, p in self.model.named_parameters()}
        missing = sorted(set(params) - set(local))
        extra = sorted(set(local) - set(params)) if self.layout.pp_size == 1 else []
        if missing or extra:
            raise ValueError(f"megatron model tensors do not match: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, param in params.items():
            if local[name].shape != param.shape:
                raise ValueError(
                    f"tensor model/{name} has shape {tuple(local[name].shape)}, the model has {tuple(param.shape)}"
                )
            param.copy_(local[name])

    @torch.no_grad()
    def export_weights(self, dtype: torch.dtype) -> dict[str, Tensor]:
        """HF-named tensors, identical on every rank (each rank joins the all-gather)."""
        hf = megatron_to_hf(self.shape, self._full_model(), self._hf_names)
        return {
            name: t.to(dtype=dtype if t.is_floating_point() else t.dtype, copy=True).contiguous()
            for name, t in hf.items()
        }

    @torch.no_grad()
    def state_tensors(self) -> dict[str, Tensor]:
        """Full tensors gathered over TP; with several ranks, each keeps only its rows of them
        (`_checkpoint_rows`), so the ranks' files together hold each tensor once."""
        out = {f"model/{n}": t for n, t in self._full_model().items()}
        moments = {}
        for name, param in self._params.items():
            for key, value in self.optimizer.state.get(param, {}).items():
                moments[f"optimizer/{name}/{key}"] = self._gather(name, value)
        out.update(self.stages.gather(moments))
        for key, (_, start, count) in self._checkpoint_rows().items():
            out[key] = out[key][start : start + count].clone()
        return out | rng_tensors()

    def state_meta(self) -> dict[str, Any]:
        return {
            "state_format": STATE_FORMAT,
            "backend": "megatron",
            "family": self.shape.family,
            "tensor_parallel_size": self.layout.tp_size,
            "optimizer": adamw_hyperparameters(self.optimizer),
            **rng_meta(),
            "shards": self._checkpoint_rows(),
        }

    def _checkpoint_rows(self) -> dict[str, list[int]]:
        """``{tensor key: [rows, first row, rows here]}`` of the checkpoint tensors this rank writes
        (the layout `actors/trainer/checkpoints.py` assembles): the full tensor's rows split like
        ``torch.chunk`` over the world. Empty in a world of one."""
        world, rank = self.layout.world_size, self.layout.rank
        if world == 1:
            return {}
        out = {}
        for name, param in self._params.items():
            rows = self._full_rows(name, param)
            chunk = -(-rows // world)
            start = min(rank * chunk, rows)
            entry = [rows, start, max(0, min(rows, start + chunk) - start)]
            out[f"model/{name}"] = entry
            for key, value in self.optimizer.state.get(param, {}).items():
                if value.dim() > 0:
                    out[f"optimizer/{name}/{key}"] = entry
        if self.layout.pp_size > 1:  # every rank writes rows of every stage's tensors
            out = {k: v for stage in all_gather_json(out, self.stages.group, self.device) for k, v in stage.items()}
        return out

    def _full_rows(self, name: str, param: Tensor) -> int:
        """Rows of the full (unsharded, vocabulary unpadded) tensor of the local parameter ``param``."""
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            return self.shape.vocab_size
        if shard_rule(self.shape, name) in ("rows", "gated_rows"):
            return param.shape[0] * self.layout.tp_size
        return param.shape[0]

    def model_limits(self) -> ModelLimits:
        return self._limits

    @torch.no_grad()
    def load_state(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """Restore a checkpoint of this backend (any TP size: the tensors are full); ValueError on a mismatch."""
        check_state_meta(meta, "megatron", STATE_FORMAT)
        self._load_full({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
        self._load_optimizer(tensors, meta)
        load_rng(tensors, meta)

    def _load_optimizer(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """Shard the saved AdamW moments like their parameters and hand them to AdamW."""
        state: dict[int, dict[str, Tensor]] = {}
        for index, name in enumerate(self._params):
            entry = saved_moments(tensors, name)
            if entry:
                state[index] = {
                    key: value if value.dim() == 0 else self._shard_like(name, value) for key, value in entry.items()
                }
        load_adamw_state(self.optimizer, state, tensors, meta, self._params)

    def _shard_like(self, name: str, full: Tensor) -> Tensor:
        local = shard(self.shape, {name: full}, self.layout.tp_rank, self.layout.tp_size)[name]
        return local.to(self.device)


def _rank_device(device: torch.device) -> torch.device:
    """``cuda`` without an index means this rank's GPU (``LOCAL_RANK``) under a launcher."""
    import os

    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def _check_pipeline(shape: ModelShape, pp_size: int) -> None:
    """Stages hold whole, equal shares of the layers; a tied LM head would need its gradient shared
    between the first and the last stage, which is not built."""
    if shape.num_layers % pp_size:
        raise ValueError(f"megatron.pipeline_parallel_size={pp_size} must divide the model's {shape.num_layers} layers")
    if pp_size > 1 and shape.tied_embeddings:
        raise ValueError(
            f"megatron.pipeline_parallel_size={pp_size}: a model with tied embeddings needs pipeline_parallel_size 1"
        )


def _check_moe(shape: ModelShape, tp_size: int, routing_replay: bool) -> None:
    """What the MoE path has been built and checked for: tensor parallel 1 (expert and tensor
    parallelism of the experts are not built), and replay only where there are routers."""
    if routing_replay and not shape.is_moe:
        raise ValueError(f"moe.routing_replay=true: the {shape.family} model has no MoE layers; set it false")
    if shape.is_moe and tp_size > 1:
        raise ValueError(
            f"megatron.tensor_parallel_size={tp_size}: the megatron backend runs MoE models with tensor "
            "parallel 1 only (expert parallelism is not built); use data or pipeline parallel"
        )


__all__ = ["MegatronBackend"]
