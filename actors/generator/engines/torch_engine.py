"""A plain-PyTorch inference engine over a Hugging Face causal LM: batched decoding with a KV cache.

Used by the CPU demo and the tests; SGLang takes its place on GPUs behind the same `Engine` interface.

One `generate` call decodes all its requests as one batch:

    prefill: left-padded prompts, attention mask, position ids = (mask.cumsum - 1)  -> logits of token 0
    step i:  [hook(i)] -> lock model -> apply pending weights -> forward last token -> unlock
             -> sample token i of every unfinished row from the filtered distribution

Invariants
- The log-prob recorded for a token is ``sampling_logprobs(logits, params)[token]``: its log-prob
  under the exact distribution it was drawn from (temperature, then top-k, then top-p over the
  renormalised top-k distribution, renormalised again). Greedy decoding (temperature 0) records 0.
- The version recorded for a token is the version of the weights applied when the logits it was
  sampled from were computed. Weights change only between two forward passes (under the model lock),
  and the KV cache of earlier positions is kept, so after a swap at step ``k`` the cache holds
  positions ``< prompt_len + k - 1`` from the old weights and everything later from the new ones.
- Rows that finish early keep being fed a pad token until the whole batch is done; their outputs
  after the finish are ignored and never returned.
- Each request samples from its own ``torch.Generator`` (seeded by the request or by the engine's
  generator), so a request's tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from actors.generator.engines.base import (
    Engine,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    NamedTensors,
    SamplingParams,
)

APPLY_POLL_S = 0.01
"""How long `update_weights` waits for the model lock before checking whether a running decode loop
applied its tensors already (the loop re-takes the lock at once, so the waiter cannot rely on winning it)."""


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs of the distribution tokens are drawn from, ``-inf`` outside its support.

    ``logits``: ``[..., vocab]``. Order: divide by temperature; keep the ``top_k`` largest (ties with the
    k-th value are kept too); keep the smallest prefix of the sorted renormalised distribution whose mass
    reaches ``top_p`` (the most likely token is always kept); renormalise. The trainer applies the same
    function to its recomputed logits so that ``log pi`` and ``log mu`` are comparable.
    """
    logits = logits.float()
    if params.temperature == 0:
        greedy = logits.argmax(dim=-1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter(-1, greedy, 0.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= params.top_p
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.log_softmax(dim=-1)


class TorchEngine(Engine):
    """`Engine` over an in-process HF causal LM.

    ``on_decode_step(i)`` is called before the forward pass that produces the logits of generated token
    ``i`` (``i = 0`` is the prefill), outside the model lock, so it may call `update_weights`; tests use it
    to swap weights at an exact step. Torch thread counts are left as the caller configured them.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        seed: int = 0,
        version: int = 0,
        on_decode_step: Callable[[int], None] | None = None,
    ) -> None:
        self._model = model.eval()
        self._device = next(model.parameters()).device
        self._tensors = dict(model.state_dict(keep_vars=True))
        self._vocab_size = int(model.get_input_embeddings().weight.shape[0])
        if not 0 <= pad_token_id < self._vocab_size:
            raise ValueError(f"pad_token_id={pad_token_id} is outside the vocabulary [0, {self._vocab_size})")
        self._pad_token_id = pad_token_id
        self._max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        forward_params = inspect.signature(model.forward).parameters
        # transformers 5 names the cache argument `cache`; 4.x calls it `past_key_values`.
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._logits_kwarg = "logits_to_keep" if "logits_to_keep" in forward_params else None
        self._version = version
        self._rng = torch.Generator().manual_seed(seed)
        self._rng_lock = threading.Lock()
        self._model_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_version: int | None = None
        self._abort_events: set[threading.Event] = set()
        self._on_decode_step = on_decode_step

    @property
    def version(self) -> int:
        return self._version

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context_tokens(self) -> int | None:
        return self._max_positions

    @property
    def model(self) -> PreTrainedModel:
        """The wrapped model (read-only use: write weights through `update_weights`)."""
        return self._model

    # ---- weights -------------------------------------------------------------------------------

    def load_state(self, named_tensors: NamedTensors, version: int) -> None:
        missing = sorted(set(self._tensors) - set(named_tensors))
        if missing:
            raise ValueError(f"load_state(version={version}): {len(missing)} tensors missing, e.g. {missing[:3]}")
        self.update_weights(named_tensors, version)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        self._validate(named_tensors, version)
        with self._pending_lock:
            self._pending.update(named_tensors)
            self._pending_version = version
        while True:
            if self._model_lock.acquire(timeout=APPLY_POLL_S):
                try:
                    self._apply_pending_locked()
                finally:
                    self._model_lock.release()
                return
            with self._pending_lock:
                if self._pending_version is None:  # a running decode loop applied it
                    return

    def _validate(self, named_tensors: NamedTensors, version: int) -> None:
        if version < self._version:
            raise ValueError(f"weight version {version} is older than the engine's version {self._version}")
        for name, tensor in named_tensors.items():
            target = self._tensors.get(name)
            if target is None:
                raise ValueError(f"weights of version {version}: unknown tensor {name!r}")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"weights of version {version}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )

    def _apply_pending_locked(self) -> None:
        """Copy pending tensors into the model; caller holds the model lock, so no forward is running."""
        with self._pending_lock:
            pending, version = self._pending, self._pending_version
            self._pending, self._pending_version = {}, None
        if version is None:
            return
        with torch.no_grad():
            for name, tensor in pending.items():
                self._tensors[name].copy_(tensor)
        self._version = version

    # ---- generation ----------------------------------------------------------------------------

    def abort(self) -> None:
        for event in list(self._abort_events):
            event.set()

    def generate(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        if not requests:
            return []
        aborted = threading.Event()
        self._abort_events.add(aborted)
        try:
            return self._generate(list(requests), params, aborted)
        finally:
            self._abort_events.discard(aborted)

    def _generate(
        self, requests: list[GenerateRequest], params: SamplingParams, aborted: threading.Event
    ) -> list[GenerateResult]:
        start = time.perf_counter()
        prompts = [self._prompt_tensor(r) for r in requests]
        budgets = [self._budget(r, len(p), params) for r, p in zip(requests, prompts, strict=True)]
        generators = [self._row_generator(r) for r in requests]
        stop_ids = set(params.stop_token_ids)
        rows = _Rows(len(requests))
        for row, budget in enumerate(budgets):
            if budget < 1:
                rows.finish(row, "length")

        input_ids, mask, positions = self._left_pad(prompts)
        cache = DynamicCache(config=self._model.config)
        step = 0
        while not rows.all_done():
            if aborted.is_set():
                rows.finish_all("abort")
                break
            if self._on_decode_step is not None:
                self._on_decode_step(step)
            logits, version = self._forward(input_ids, mask, positions, cache)
            logprobs = sampling_logprobs(logits, params)
            next_ids = torch.full((len(requests), 1), self._pad_token_id, dtype=torch.long, device=self._device)
            for row in rows.active():
                token = _sample(logprobs[row], generators[row])
                rows.append(row, token, float(logprobs[row, token]), version)
                next_ids[row, 0] = token
                if token in stop_ids:
                    rows.finish(row, "stop")
                elif rows.num_tokens(row) >= budgets[row]:
                    rows.finish(row, "length")
            input_ids = next_ids
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            step += 1
        gen_s = time.perf_counter() - start
        return [rows.result(row, requests[row].request_id, gen_s) for row in range(len(requests))]

    def _prompt_tensor(self, request: GenerateRequest) -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(request.input_ids, dtype=np.int64), device=self._device)
        if ids.ndim != 1 or int(ids.min()) < 0 or int(ids.max()) >= self._vocab_size:
            raise ValueError(
                f"request {request.request_id!r}: input_ids must be a flat list of ids in [0, {self._vocab_size})"
            )
        return ids

    def _budget(self, request: GenerateRequest, prompt_len: int, params: SamplingParams) -> int:
        """New tokens this row may produce: its own or the params' budget, cut to the model's context."""
        budget = request.max_new_tokens or params.max_new_tokens
        if self._max_positions is not None:
            budget = min(budget, self._max_positions - prompt_len)
        return budget

    def _row_generator(self, request: GenerateRequest) -> torch.Generator:
        if request.seed is None:
            with self._rng_lock:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        else:
            seed = request.seed
        return torch.Generator(device=self._device).manual_seed(seed)

    def _left_pad(self, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self._pad_token_id, dtype=torch.long, device=self._device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=self._device)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        return input_ids, mask, positions

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> tuple[torch.Tensor, int]:
        """Logits of the last position, and the version of the weights that computed them."""
        kwargs: dict[str, object] = {self._cache_kwarg: cache}
        if self._logits_kwarg is not None:
            kwargs[self._logits_kwarg] = 1
        with self._model_lock:
            self._apply_pending_locked()
            version = self._version
            with torch.inference_mode():
                out = self._model(
                    input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
                )
        return out.logits[:, -1, :].float(), version


def _sample(logprobs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a row of `sampling_logprobs` (never a token outside its support)."""
    return int(torch.multinomial(logprobs.exp(), 1, generator=generator))


class _Rows:
    """Per-row accumulation of tokens, log-probs and versions while a batch decodes."""

    def __init__(self, num_rows: int) -> None:
        self._tokens: list[list[int]] = [[] for _ in range(num_rows)]
        self._logprobs: list[list[float]] = [[] for _ in range(num_rows)]
        self._versions: list[list[int]] = [[] for _ in range(num_rows)]
        self._finish: list[FinishReason | None] = [None] * num_rows

    def active(self) -> list[int]:
        return [row for row, reason in enumerate(self._finish) if reason is None]

    def all_done(self) -> bool:
        return all(reason is not None for reason in self._finish)

    def num_tokens(self, row: int) -> int:
        return len(self._tokens[row])

    def append(self, row: int, token: int, logprob: float, version: int) -> None:
        self._tokens[row].append(token)
        self._logprobs[row].append(logprob)
        self._versions[row].append(version)

    def finish(self, row: int, reason: FinishReason) -> None:
        self._finish[row] = reason

    def finish_all(self, reason: FinishReason) -> None:
        for row in self.active():
            self._finish[row] = reason

    def result(self, row: int, request_id: str, gen_s: float) -> GenerateResult:
        reason = self._finish[row]
        assert reason is not None, "result() before the row finished"
        return GenerateResult(
            token_ids=np.asarray(self._tokens[row], dtype=np.int32),
            logprobs=np.asarray(self._logprobs[row], dtype=np.float32),
            versions=np.asarray(self._versions[row], dtype=np.int32),
            finish_reason=reason,
            request_id=request_id,
            gen_s=gen_s,
        )
