"""The `torch` training backend: an HF causal LM with fp32 master weights and AdamW, on the CPU or a GPU.

One process trains alone; several ranks (`leeway trainer --nproc N`, torchrun) shard the model with
FSDP2 and each trains its share of every minibatch (`actors/trainer/backends/data_parallel.py`).

Decisions the trainer relies on:
- Master weights and optimizer state are fp32. Autocast (bf16) is on by default only on a CUDA
  device that supports bf16; on the CPU it is off, so CPU runs are deterministic and checkpoint
  resume is bit-exact. Logits are cast to fp32 before the log-softmax either way.
- Log-probs are those of the tempered policy, ``log_softmax(logits / temperature)``, matching the
  generator's sampling temperature (top-k/top-p cannot be recomputed here; see `docs/design.md`,
  "Importance correction").
- Micro-batches hold whole sequences (a sequence longer than ``micro_batch_tokens`` goes alone).
  Packed (the default; `actors/trainer/backends/packing.py`) the model sees them as one row of at
  most ``micro_batch_tokens`` real tokens with per-sequence positions and attention; unpacked, as
  right-padded rows of at most ``micro_batch_tokens`` padded tokens. The loss_fn gets the padded
  ``[S, T]`` layout either way, and how sequences are grouped changes the gradient only by float
  rounding. The LM head may run chunked (`actors/trainer/backends/fused.py`), never holding the
  whole micro-batch's logits; same numbers. Packing switches this model to the packed attention
  function; liger-kernel (``fused_kernels``, CUDA) patches its modules.
- Dropout would make the recomputed ``log pi`` random; a model with dropout > 0 is rejected.
- The caller sets ``torch.set_num_threads``; this module never touches process-wide settings
  except the RNG states it checkpoints and restores, and liger-kernel's patch of the model
  family's RoPE function in transformers (a trainer process holds one model).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
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
from actors.trainer.backends.data_parallel import (
    all_gather_bytes,
    is_data_parallel,
    max_over_ranks,
    row_range,
    shard_model,
    split_by_tokens,
    sum_over_ranks,
)
from actors.trainer.backends.fused import (
    FusedSetting,
    apply_fused_kernels,
    check_chunked_head,
    chunked_token_logprobs,
    resolve_chunk_tokens,
)
from actors.trainer.backends.packing import (
    check_packing,
    pack_by_real_tokens,
    pack_micro_batch,
    unpack_to_padded,
    use_packed_attention,
)
from actors.trainer.backends.routing import MicroBatchRouting
from pipeline.config import LeewayConfig
from pipeline.rl.batching import ModelLimits

STATE_FORMAT = 1
"""Version of the layout of `state_tensors` / `state_meta`; `load_state` refuses others."""


class TorchBackend(TrainingBackend):
    """AdamW on an HF causal LM; see the module docstring for the numerical decisions."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        micro_batch_tokens: int = 8192,
        gradient_checkpointing: bool = False,
        device: str | torch.device = "cpu",
        autocast: bool | None = None,
        temperature: float = 1.0,
        packing: bool = True,
        fused_kernels: FusedSetting = "auto",
        lm_head_chunk_tokens: int | None = None,
        routing_replay: bool = False,
    ) -> None:
        check_options(temperature, grad_clip)
        reject_dropout(model)
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=torch.float32).eval()
        self.grad_clip = float(grad_clip)
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.temperature = float(temperature)
        self.autocast = default_autocast(self.device) if autocast is None else bool(autocast)
        if gradient_checkpointing:
            _enable_checkpointing(self.model)
        self._setup_forward(packing, fused_kernels, lm_head_chunk_tokens)
        self.routing = MicroBatchRouting(self.model, replay=routing_replay, packed=self.packing)
        """Routing replay and the ``moe/...`` metrics of a mixture-of-experts model (`moe.routing_replay`)."""
        self.data_parallel = is_data_parallel()
        """Inside a process group of several ranks: FSDP2-sharded, each rank trains its share (`data_parallel`)."""
        if self.data_parallel:
            shard_model(self.model)
        self._param_names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(
            [params[n] for n in self._param_names], lr=lr, betas=tuple(betas), eps=adam_eps, weight_decay=weight_decay
        )

    @classmethod
    def from_config(
        cls, config: LeewayConfig, model: PreTrainedModel, *, autocast: bool | None = None, **overrides: Any
    ) -> TorchBackend:
        """The backend of a run: the options every backend reads (`backend_options`), then packing, liger
        kernels and the chunked LM head, which only this backend reads, and `moe.routing_replay`."""
        t = config.trainer
        return cls(
            model,
            **(backend_options(config) | overrides),
            autocast=autocast,
            packing=t.packing,
            fused_kernels=t.fused_kernels,
            lm_head_chunk_tokens=t.lm_head_chunk_tokens,
            routing_replay=config.moe.routing_replay,
        )

    # -- forward ---------------------------------------------------------------------------------

    def _setup_forward(self, packing: bool, fused_kernels: FusedSetting, lm_head_chunk_tokens: int | None) -> None:
        """Packing, liger kernels and the chunked LM head (`actors/trainer/backends/packing.py`,
        `actors/trainer/backends/fused.py`); runs before any FSDP2 sharding."""
        self.fused_kernels = apply_fused_kernels(self.model, fused_kernels, self.device)
        self.lm_head_chunk_tokens = resolve_chunk_tokens(lm_head_chunk_tokens, self.device)
        if self.lm_head_chunk_tokens and is_data_parallel():
            if lm_head_chunk_tokens:
                raise ValueError(
                    "trainer.lm_head_chunk_tokens > 0 is not supported with several ranks yet (the LM head is "
                    "sharded); set it to 0 or null"
                )
            self.lm_head_chunk_tokens = 0
        if self.lm_head_chunk_tokens:
            check_chunked_head(self.model)
        self.packing = bool(packing)
        if self.packing:
            use_packed_attention(self.model)
            check_packing(self.model, self.device)

    def _packs(self, lengths: list[int]) -> list[list[int]]:
        """Micro-batches of sequence indices: by real tokens when packed, by padded size otherwise."""
        if self.packing:
            return pack_by_real_tokens(lengths, self.micro_batch_tokens)
        return pack_by_token_budget(lengths, self.micro_batch_tokens)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> list[np.ndarray]:
        out: list[np.ndarray] = [np.empty(0, np.float32)] * len(batch.sequences)
        lengths = [s.num_tokens for s in batch.sequences]
        for pack in self._packs(lengths):
            micro = padded_micro_batch(batch, pack, self.device)
            with self.routing.around(micro, count=False):
                logp, _ = self._forward(micro, with_entropy=False)
            for row, index in enumerate(pack):
                out[index] = logp[row, : lengths[index]].float().cpu().numpy()
        return out

    def _forward(self, micro: MicroBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probs ``[S, T]`` (position 0 and padding 0) and, optionally, detached entropy ``[S, T]``.

        Packed, the model sees one row of real tokens; padded, the ``[S, T]`` rows. Either way only
        positions that predict a real token reach the LM head's softmax, and the values come back
        in the padded layout of the loss_fn contract.
        """
        if self.packing:
            packed = pack_micro_batch(micro.tokens, micro.attention_mask)
            inputs: dict[str, Any] = {
                "input_ids": packed.input_ids,
                "position_ids": packed.position_ids,
                **packed.attention_kwargs(),
            }
            targets, keep = packed.targets, packed.has_target
        else:
            inputs = {"input_ids": micro.tokens, "attention_mask": micro.attention_mask}
            targets = nn.functional.pad(micro.tokens[:, 1:], (0, 1)).reshape(-1)
            keep = nn.functional.pad(micro.attention_mask[:, 1:].bool(), (0, 1)).reshape(-1)
        token_logp, token_entropy = self._token_logprobs(inputs, targets, keep, with_entropy)
        logp = unpack_to_padded(token_logp, micro.attention_mask)
        entropy = None if token_entropy is None else unpack_to_padded(token_entropy, micro.attention_mask)
        return logp, entropy

    def _token_logprobs(
        self, inputs: dict[str, Any], targets: Tensor, keep: Tensor, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``log_softmax(logits / T)[target]`` (grad) and entropy (detached) at the ``keep`` positions
        of the flattened input, through the chunked LM head or the model's own logits."""
        with bf16_autocast(self.device, self.autocast):
            if self.lm_head_chunk_tokens:
                hidden = self.model.base_model(**inputs, use_cache=False).last_hidden_state
                hidden = hidden.reshape(-1, hidden.shape[-1])[keep]
                return chunked_token_logprobs(
                    hidden,
                    self.model.get_output_embeddings(),
                    targets[keep],
                    temperature=self.temperature,
                    chunk_tokens=self.lm_head_chunk_tokens,
                    compute_dtype=torch.bfloat16 if self.autocast else torch.float32,
                    with_entropy=with_entropy,
                )
            logits = self.model(**inputs, use_cache=False).logits
        logits = logits.reshape(-1, logits.shape[-1])[keep].float() / self.temperature
        log_norm = torch.logsumexp(logits, dim=-1)
        token_logp = logits.gather(-1, targets[keep, None]).squeeze(-1) - log_norm
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return token_logp, entropy

    # -- training --------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, num_minibatches: int = 1) -> StepResult:
        def accumulate(chunk: list[int], mb_index: int, num: int) -> tuple[float, float, list[dict[str, float]], int]:
            loss, entropy, stats = self._accumulate(batch, chunk, loss_fn, mb_index, num)
            return loss, entropy, stats, len(stats)

        self.routing.reset()
        result = train_minibatches(
            batch, num_minibatches, self.model, self.optimizer, accumulate, self._optimizer_update
        )
        counters = self.routing.counters()
        if self.data_parallel and counters:
            counters = sum_over_ranks(counters)
        return replace(result, moe=self.routing.metrics_from(counters))

    def _accumulate(
        self, batch: TrainBatch, chunk: list[int], loss_fn: LossFn, mb_index: int, num_minibatches: int
    ) -> tuple[float, float, list[dict[str, float]]]:
        """Forward and backward every micro-batch of one minibatch; returns (summed loss, summed
        entropy over loss tokens, per-micro-batch stats). Gradients accumulate in ``.grad``.

        Data parallel: this rank takes its share of `chunk` (`split_by_tokens`) and runs as many
        micro-batches as the busiest rank, the extra ones with a zero loss (FSDP2's collectives need
        every rank in every forward and backward); loss, entropy and stats come back summed or
        gathered over ranks, so every rank returns the one-rank answer."""
        lengths = {i: batch.sequences[i].num_tokens for i in chunk}
        loss_tokens = sum(batch.sequences[i].num_loss_tokens for i in chunk)  # the whole minibatch's
        mine = list(chunk)
        if self.data_parallel:
            world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
            mine = split_by_tokens(chunk, [lengths[i] for i in chunk], world)[rank]
        packs = [[mine[i] for i in p] for p in self._packs([lengths[i] for i in mine])]
        num_micro = max_over_ranks(len(packs)) if self.data_parallel else len(packs)
        loss_total, entropy_total, stats_out = 0.0, 0.0, []
        for micro_index in range(num_micro):
            padding = micro_index >= len(packs)
            micro = padded_micro_batch(batch, [chunk[0]] if padding else packs[micro_index], self.device)
            extras = LossExtras(
                entropy=torch.empty(0),
                minibatch_index=mb_index,
                num_minibatches=num_minibatches,
                micro_index=micro_index,
                num_micro_batches=num_micro,
                minibatch_seq_indices=tuple(chunk),
                minibatch_loss_tokens=loss_tokens,
            )
            # Around forward and backward: a checkpointed forward runs again inside the backward.
            with self.routing.around(micro, count=not padding):
                done = self._micro_step(micro, extras, loss_fn, padding)
            if done is not None:
                loss_total += done[0]
                entropy_total += done[1]
                stats_out.append(done[2])
        if self.data_parallel:
            loss_total, entropy_total = sum_over_ranks([loss_total, entropy_total])
            gathered = all_gather_bytes(json.dumps(stats_out).encode())
            stats_out = [s for data in gathered for s in json.loads(data)]
        return loss_total, entropy_total, stats_out

    def _micro_step(
        self, micro: MicroBatch, extras: LossExtras, loss_fn: LossFn, padding: bool
    ) -> tuple[float, float, dict[str, float]] | None:
        """Forward and backward of one micro-batch: (loss, entropy summed over loss tokens, stats), None for a
        filler micro-batch (no sequence left on this rank: a zero loss keeps it in the collectives)."""
        logp, entropy = self._forward(micro, with_entropy=True)
        assert entropy is not None
        if padding:
            (logp.sum() * 0.0).backward()
            return None
        loss, stats = loss_fn(logp, micro, replace(extras, entropy=entropy))
        loss = check_loss(loss)
        if self.data_parallel and not loss.requires_grad:
            loss = loss + logp.sum() * 0.0  # every rank must run the backward's reduce-scatter
        if loss.requires_grad:
            loss.backward()
        entropy_sum = float(entropy[micro.loss_mask].double().sum())
        return float(loss.detach()), entropy_sum, {k: float(v) for k, v in stats.items()}

    def _optimizer_update(self) -> tuple[float, bool]:
        """Clip, then AdamW; a non-finite norm skips the update (and is reported, not hidden)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # global over ranks
        return step_unless_non_finite(self.optimizer, grad_norm)

    # -- weights and checkpoint state ------------------------------------------------------------

    @torch.no_grad()
    def export_weights(self, dtype: torch.dtype) -> dict[str, Tensor]:
        return self.export_weights_owned(dtype, None)

    @torch.no_grad()
    def export_weights_owned(self, dtype: torch.dtype, names: Collection[str] | None) -> dict[str, Tensor]:
        """Data parallel: every rank gathers every sharded tensor (a collective, in `state_dict` order)
        and keeps the `names` it publishes; one rank keeps everything with ``names=None``."""
        out = {}
        for name, tensor in self.model.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if names is not None and name not in names:
                continue
            target = dtype if full.is_floating_point() else full.dtype
            out[name] = full.detach().to(device="cpu", dtype=target, copy=True).contiguous()
        return out

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.model.state_dict().items()}

    @torch.no_grad()
    def state_tensors(self) -> dict[str, Tensor]:
        """Data parallel: this rank's rows of every sharded tensor (`state_meta` says which rows)."""
        params = dict(self.model.named_parameters())
        out = {f"model/{n}": _cpu_copy(_local(p)) for n, p in params.items()}
        for name in self._param_names:
            for key, value in self.optimizer.state.get(params[name], {}).items():
                out[f"optimizer/{name}/{key}"] = _cpu_copy(_local(value))
        return out | rng_tensors()

    def state_meta(self) -> dict[str, Any]:
        return {
            "state_format": STATE_FORMAT,
            "backend": "torch",
            "optimizer": adamw_hyperparameters(self.optimizer),
            **rng_meta(),
            "shards": self._shard_rows(),
        }

    def _shard_rows(self) -> dict[str, list[int]]:
        """``{tensor key: [global rows, first row, rows here]}`` of every dim-0 sharded state tensor."""
        if not self.data_parallel:
            return {}
        params = dict(self.model.named_parameters())
        rows = {f"model/{n}": list(row_range(p)) for n, p in params.items() if isinstance(p, DTensor)}
        for name in self._param_names:
            for key, value in self.optimizer.state.get(params[name], {}).items():
                if isinstance(value, DTensor):
                    rows[f"optimizer/{name}/{key}"] = list(row_range(value))
        return rows

    def model_limits(self) -> ModelLimits:
        """Vocabulary: the smaller of the config's and the embedding rows (a resized embedding wins).
        Context: ``max_position_embeddings`` (GPT-2's ``n_positions`` answers to that name too)."""
        config = self.model.config
        rows = self.model.get_input_embeddings().num_embeddings
        vocab = min(int(getattr(config, "vocab_size", rows) or rows), int(rows))
        positions = getattr(config, "max_position_embeddings", None)
        shape = route_shape(self.model)
        return ModelLimits(
            vocab_size=vocab,
            max_positions=int(positions) if positions else None,
            routes=None if shape is None else (shape.layers, shape.top_k, shape.num_experts),
        )

    @torch.no_grad()
    def load_state(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """`tensors` are whole (a sharded checkpoint is assembled first, `actors/trainer/checkpoints.py`);
        data parallel, each rank keeps its rows, so any world size loads any checkpoint."""
        check_state_meta(meta, "torch", STATE_FORMAT)
        self._load_model(tensors)
        self._load_optimizer(tensors, meta)
        load_rng(tensors, meta)

    def _load_model(self, tensors: Mapping[str, Tensor]) -> None:
        params = dict(self.model.named_parameters())
        saved = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        if saved.keys() != params.keys():
            missing, extra = sorted(params.keys() - saved.keys()), sorted(saved.keys() - params.keys())
            raise ValueError(
                f"checkpoint model tensors do not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for name, param in params.items():
            if saved[name].shape != param.shape:
                raise ValueError(
                    f"checkpoint tensor model/{name} has shape {tuple(saved[name].shape)}, "
                    f"the model has {tuple(param.shape)}"
                )
            if isinstance(param, DTensor):
                _, start, rows = row_range(param)
                param.to_local().copy_(saved[name][start : start + rows])
            else:
                param.copy_(saved[name])

    def _load_optimizer(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """AdamW's state keyed by parameter name on disk; data parallel, moments shaped like their
        parameter are sharded like it."""
        state: dict[int, dict[str, Tensor]] = {}
        params = dict(self.model.named_parameters())
        for index, name in enumerate(self._param_names):
            entry = saved_moments(tensors, name)
            param = params[name]
            if isinstance(param, DTensor):
                _, start, rows = row_range(param)
                entry = {
                    k: _as_shard(v[start : start + rows], param) if v.shape == param.shape else v
                    for k, v in entry.items()
                }
            if entry:
                state[index] = entry
        load_adamw_state(self.optimizer, state, tensors, meta, self._param_names)


def _cpu_copy(tensor: Tensor) -> Tensor:
    return tensor.detach().to(device="cpu", copy=True).contiguous()


def _local(tensor: Tensor) -> Tensor:
    """This rank's rows of a sharded tensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _as_shard(rows: Tensor, like: DTensor) -> DTensor:
    """`rows` (this rank's) as a DTensor placed like the parameter `like`."""
    local = rows.to(device=like.to_local().device, dtype=like.dtype).contiguous()
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def _enable_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation checkpointing under whichever name this transformers version uses."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
