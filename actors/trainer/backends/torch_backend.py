"""The `torch` training backend: an HF causal LM with fp32 master weights and AdamW, on CPU or one GPU.

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

import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from actors.trainer.backends.base import (
    LossExtras,
    LossFn,
    MicroBatch,
    MinibatchResult,
    StepResult,
    TrainBatch,
    TrainingBackend,
    mean_or_nan,
    pack_by_token_budget,
    split_minibatches,
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
from pipeline.batching import ModelLimits
from pipeline.config import LeewayConfig

log = logging.getLogger(__name__)

STATE_FORMAT = 1
"""Version of the layout of `state_tensors` / `state_meta`; `load_state` refuses others."""

_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")


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
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 (greedy sampling has no log-prob to correct)")
        if grad_clip <= 0:
            raise ValueError(f"trainer.grad_clip={grad_clip} must be > 0")
        _reject_dropout(model)
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=torch.float32).eval()
        self.grad_clip = float(grad_clip)
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.temperature = float(temperature)
        self.autocast = _default_autocast(self.device) if autocast is None else bool(autocast)
        if gradient_checkpointing:
            _enable_checkpointing(self.model)
        self._setup_forward(packing, fused_kernels, lm_head_chunk_tokens)
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
    def from_config(cls, config: LeewayConfig, model: PreTrainedModel, *, autocast: bool | None = None) -> TorchBackend:
        """The backend of a run: optimizer and packing from ``trainer``, temperature from the sampler."""
        t = config.trainer
        return cls(
            model,
            lr=t.lr,
            betas=t.betas,
            adam_eps=t.adam_eps,
            weight_decay=t.weight_decay,
            grad_clip=t.grad_clip,
            micro_batch_tokens=t.micro_batch_tokens,
            gradient_checkpointing=t.gradient_checkpointing,
            device=t.device,
            autocast=autocast,
            temperature=config.engine.sampling.temperature,
            packing=t.packing,
            fused_kernels=t.fused_kernels,
            lm_head_chunk_tokens=t.lm_head_chunk_tokens,
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
            micro = self._micro_batch(batch, pack)
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
        with self._autocast():
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

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _micro_batch(self, batch: TrainBatch, seq_indices: list[int]) -> MicroBatch:
        """Right-pad the chosen sequences into ``[S, T]`` tensors on the device."""
        seqs = [batch.sequences[i] for i in seq_indices]
        rows, width = len(seqs), max(s.num_tokens for s in seqs)
        has_prox = [s.proximal_logprobs is not None for s in seqs]
        if any(has_prox) and not all(has_prox):
            raise ValueError("proximal_logprobs must be set on every sequence of a batch or on none")
        columns: dict[str, np.ndarray] = {
            "tokens": np.zeros((rows, width), np.int64),
            "attention_mask": np.zeros((rows, width), np.int64),
            "loss_mask": np.zeros((rows, width), np.bool_),
            "behaviour_logprobs": np.zeros((rows, width), np.float32),
            "versions": np.zeros((rows, width), np.int64),
            "advantages": np.zeros((rows, width), np.float32),
        }
        if all(has_prox):
            columns["proximal_logprobs"] = np.zeros((rows, width), np.float32)
        for row, seq in enumerate(seqs):
            n = seq.num_tokens
            columns["tokens"][row, :n] = seq.tokens
            columns["attention_mask"][row, :n] = 1
            columns["loss_mask"][row, :n] = np.asarray(seq.loss_mask) != 0
            columns["behaviour_logprobs"][row, :n] = seq.behaviour_logprobs
            columns["versions"][row, :n] = seq.versions
            columns["advantages"][row, :n] = seq.advantages_per_token()
            if "proximal_logprobs" in columns:
                columns["proximal_logprobs"][row, :n] = seq.proximal_logprobs
        tensors = {k: torch.from_numpy(v).to(self.device) for k, v in columns.items()}
        return MicroBatch(
            seq_indices=tuple(seq_indices), proximal_logprobs=tensors.pop("proximal_logprobs", None), **tensors
        )

    # -- training --------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, num_minibatches: int = 1) -> StepResult:
        start = time.perf_counter()
        chunks = split_minibatches(len(batch.sequences), num_minibatches)
        results: list[MinibatchResult] = []
        micro_stats: list[dict[str, float]] = []
        entropy_sum, fb_s, opt_s = 0.0, 0.0, 0.0
        self.model.train()  # gradient checkpointing only acts in train mode; dropout is rejected at init
        try:
            for mb_index, chunk in enumerate(chunks):
                t0 = time.perf_counter()
                loss, ent, stats = self._accumulate(batch, chunk, loss_fn, mb_index, len(chunks))
                t1 = time.perf_counter()
                grad_norm, skipped = self._optimizer_update()
                opt_s += time.perf_counter() - t1
                fb_s += t1 - t0
                entropy_sum += ent
                micro_stats.extend(stats)
                loss_tokens = sum(batch.sequences[i].num_loss_tokens for i in chunk)
                results.append(
                    MinibatchResult(
                        loss=loss,
                        grad_norm=grad_norm,
                        skipped=skipped,
                        num_micro_batches=len(stats),
                        num_loss_tokens=loss_tokens,
                    )
                )
        finally:
            self.model.eval()
            self.optimizer.zero_grad(set_to_none=True)
        num_loss = batch.num_loss_tokens
        return StepResult(
            loss=sum(r.loss for r in results) / len(results),
            grad_norm=sum(r.grad_norm for r in results) / len(results),
            entropy_mean=mean_or_nan(entropy_sum, num_loss),
            num_loss_tokens=num_loss,
            minibatches=tuple(results),
            micro_stats=tuple(micro_stats),
            forward_backward_s=fb_s,
            optimizer_s=opt_s,
            total_s=time.perf_counter() - start,
        )

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
            micro = self._micro_batch(batch, [chunk[0]] if padding else packs[micro_index])
            logp, entropy = self._forward(micro, with_entropy=True)
            assert entropy is not None
            if padding:  # no sequence left here: a zero loss keeps this rank in the collectives
                (logp.sum() * 0.0).backward()
                continue
            extras = LossExtras(
                entropy=entropy,
                minibatch_index=mb_index,
                num_minibatches=num_minibatches,
                micro_index=micro_index,
                num_micro_batches=num_micro,
                minibatch_seq_indices=tuple(chunk),
                minibatch_loss_tokens=loss_tokens,
            )
            loss, stats = loss_fn(logp, micro, extras)
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                raise ValueError(
                    f"loss_fn must return a scalar tensor as its loss, got {type(loss).__name__} "
                    f"{tuple(getattr(loss, 'shape', ()))}"
                )
            if self.data_parallel and not loss.requires_grad:
                loss = loss + logp.sum() * 0.0  # every rank must run the backward's reduce-scatter
            if loss.requires_grad:
                loss.backward()
            loss_total += float(loss.detach())
            entropy_total += float(entropy[micro.loss_mask].double().sum())
            stats_out.append({k: float(v) for k, v in stats.items()})
        if self.data_parallel:
            loss_total, entropy_total = sum_over_ranks([loss_total, entropy_total])
            gathered = all_gather_bytes(json.dumps(stats_out).encode())
            stats_out = [s for data in gathered for s in json.loads(data)]
        return loss_total, entropy_total, stats_out

    def _optimizer_update(self) -> tuple[float, bool]:
        """Clip, then AdamW; a non-finite norm skips the update (and is reported, not hidden)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # global over ranks
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning("non-finite gradient norm %s: optimizer update skipped", grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

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
        out["rng/torch_cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            for index, state in enumerate(torch.cuda.get_rng_state_all()):
                out[f"rng/torch_cuda_{index}"] = state.cpu()
        return out

    def state_meta(self) -> dict[str, Any]:
        group = self.optimizer.param_groups[0]
        np_state = np.random.get_state(legacy=True)
        assert isinstance(np_state, tuple)
        py_version, py_internal, py_gauss = random.getstate()
        return {
            "state_format": STATE_FORMAT,
            "backend": "torch",
            "optimizer": {
                "lr": group["lr"],
                "betas": list(group["betas"]),
                "eps": group["eps"],
                "weight_decay": group["weight_decay"],
            },
            "numpy_rng": {
                "kind": np_state[0],
                "keys": np_state[1].tolist(),
                "pos": int(np_state[2]),
                "has_gauss": int(np_state[3]),
                "cached_gaussian": float(np_state[4]),
            },
            "python_rng": {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
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
        return ModelLimits(vocab_size=vocab, max_positions=int(positions) if positions else None)

    @torch.no_grad()
    def load_state(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """`tensors` are whole (a sharded checkpoint is assembled first, `actors/trainer/checkpoints.py`);
        data parallel, each rank keeps its rows, so any world size loads any checkpoint."""
        if meta.get("state_format") != STATE_FORMAT or meta.get("backend") != "torch":
            raise ValueError(
                f"checkpoint meta has state_format={meta.get('state_format')!r} "
                f"backend={meta.get('backend')!r}; this backend reads {STATE_FORMAT} 'torch'"
            )
        self._load_model(tensors)
        self._load_optimizer(tensors, meta)
        _load_rng(tensors, meta)

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
        """Rebuild AdamW's state through its own `load_state_dict`, keyed by parameter name on disk.

        Hyperparameters stay those of this backend's config; a difference is logged, so a resume
        with a changed lr is deliberate rather than silent.
        """
        state: dict[int, dict[str, Tensor]] = {}
        params = dict(self.model.named_parameters())
        for index, name in enumerate(self._param_names):
            prefix = f"optimizer/{name}/"
            entry = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            param = params[name]
            if isinstance(param, DTensor):  # moments shaped like the parameter are sharded like it
                _, start, rows = row_range(param)
                entry = {
                    k: _as_shard(v[start : start + rows], param) if v.shape == param.shape else v
                    for k, v in entry.items()
                }
            if entry:
                state[index] = entry
        known = {f"optimizer/{n}/" for n in self._param_names}
        stray = [k for k in tensors if k.startswith("optimizer/") and k[: k.rfind("/") + 1] not in known]
        if stray:
            raise ValueError(f"checkpoint optimizer tensors for unknown parameters: {stray[:5]}")
        current = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
        saved_hp = meta.get("optimizer", {})
        now = self.state_meta()["optimizer"]
        if saved_hp != now:
            log.warning("optimizer hyperparameters differ from the checkpoint's %s; using %s", saved_hp, now)


def _cpu_copy(tensor: Tensor) -> Tensor:
    return tensor.detach().to(device="cpu", copy=True).contiguous()


def _local(tensor: Tensor) -> Tensor:
    """This rank's rows of a sharded tensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _as_shard(rows: Tensor, like: DTensor) -> DTensor:
    """`rows` (this rank's) as a DTensor placed like the parameter `like`."""
    local = rows.to(device=like.to_local().device, dtype=like.dtype).contiguous()
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def _default_autocast(device: torch.device) -> bool:
    """bf16 autocast where it is supported and fast: CUDA with bf16. Never by default on the CPU."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def _enable_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation checkpointing under whichever name this transformers version uses."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _reject_dropout(model: nn.Module) -> None:
    """Dropout makes the recomputed log pi random, biasing every importance ratio: refuse it."""
    config = getattr(model, "config", None)
    for name in _DROPOUT_FIELDS:
        value = getattr(config, name, 0.0)
        if isinstance(value, (int, float)) and value > 0:
            raise ValueError(f"model config {name}={value}: dropout must be 0 for RL training")
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            raise ValueError(f"model module {name} has dropout p={module.p}: dropout must be 0 for RL training")


def _load_rng(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    """Restore torch (CPU, and CUDA when the device count matches), numpy and Python global RNGs."""
    torch.set_rng_state(tensors["rng/torch_cpu"].to(torch.uint8))
    cuda_states = [tensors[k] for k in sorted(_cuda_rng_keys(tensors), key=lambda k: int(k.rsplit("_", 1)[1]))]
    if cuda_states:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            log.warning("checkpoint has %d CUDA RNG states; not restored on this machine", len(cuda_states))
    np_rng = meta["numpy_rng"]
    np.random.set_state(
        (
            np_rng["kind"],
            np.asarray(np_rng["keys"], dtype=np.uint32),
            np_rng["pos"],
            np_rng["has_gauss"],
            np_rng["cached_gaussian"],
        )
    )
    py_rng = meta["python_rng"]
    random.setstate((py_rng["version"], tuple(py_rng["internal"]), py_rng["gauss_next"]))


def _cuda_rng_keys(tensors: Mapping[str, Tensor]) -> Iterator[str]:
    return (k for k in tensors if k.startswith("rng/torch_cuda_"))
