"""The inference-engine interface: what a generator needs from a sampler, and nothing more.

Tokens in, tokens out: requests carry token ids and results carry token ids, so nothing is
re-tokenized between the sampler and the trainer. Every generated token comes back with

- ``logprobs[i]``: its log-probability under the exact distribution it was drawn from (after
  temperature, top-k and top-p, renormalised over the kept tokens) -- the behaviour log-prob
  ``log mu`` of the importance ratio;
- ``versions[i]``: the policy version of the weights that computed the logits it was sampled from.

Requests stream: `Engine.submit` queues requests and returns one future per request, resolved when that
request finishes (a continuously batching engine finishes short ones first and fills their places with
waiting requests); `Engine.generate` is the blocking form, results in request order.

Weight updates are in-flight: `update_weights` may be called from another thread while `generate`
runs; the new weights take effect between two decode steps, the KV cache computed by the old
weights is kept, and the tokens after the swap carry the new version. `update_weights` returns only after the
tensors were copied, so its caller may mutate them afterwards (the weight subscriber does, on its next pull).

The shape is chosen so an SGLang engine can implement it later: `generate` maps onto ``/generate``
with ``input_ids`` and ``return_logprob`` (behaviour log-probs need ``return_sampling_mask`` /
``output_token_sampling_logprobs``, since SGLang's default log-probs are taken before top-k/top-p);
`update_weights` onto ``/pause_generation`` (``in_place``) + ``/update_weights_from_tensor`` +
``/continue_generation``; per-token versions onto ``meta_info["weight_versions"]`` spans; `abort`
onto ``/abort_request`` with ``abort_all``, whose results finish with reason ``abort`` and keep the
tokens produced so far.

The request and result records live in `pipeline.rl.engine_records` (``pipeline/`` never imports ``actors/``) and
are re-exported here. A rollout needs only the bound `Engine.generate`: `pipeline.rl.engine_records.Generate`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future

import torch

from pipeline.rl.engine_records import GenerateRequest, GenerateResult, SamplingParams
from pipeline.wire.trajectory import FinishReason

__all__ = [
    "Engine",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "NamedTensors",
    "SamplingParams",
    "WeightsRefused",
]

NamedTensors = Mapping[str, torch.Tensor]
"""Hugging Face parameter name -> tensor, as in the weight store's manifests."""


class WeightsRefused(RuntimeError):
    """An engine whose weights cross a process boundary found what arrived different from the version's hashes.

    ``applied`` False: nothing was written, the previous version keeps serving. True: the load failed part way; the
    engine serves nothing (it stays paused) until a later `Engine.load_state` succeeds. Either way the weight sync
    counts it and loads the version again from a full snapshot."""

    def __init__(self, version: int, reason: str, *, applied: bool) -> None:
        super().__init__(f"weights of version {version} refused by the engine: {reason}")
        self.version = version
        self.applied = applied


class Engine(ABC):
    """A sampler holding one copy of the policy weights. Thread-safe: `update_weights` and `abort` may be
    called from other threads while `generate` runs (the generator calls `generate` via
    ``asyncio.to_thread``)."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The policy version of the weights now applied (what the next decode step will use)."""

    @property
    def vocab_size(self) -> int | None:
        """Token ids the model accepts are ``[0, vocab_size)``; None when unknown (ids are then not checked)."""
        return None

    @property
    def max_context_tokens(self) -> int | None:
        """Prompt plus reply tokens the model can attend to; None when unbounded or unknown."""
        return None

    @property
    def prefix_stats(self) -> dict[str, int] | None:
        """Prefix-cache counters since start (``prefix_lookups``, ``prefix_hits``, ``prompt_tokens``,
        ``prefilled_tokens``), or None for an engine that keeps none."""
        return None

    @abstractmethod
    def load_state(self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None = None) -> None:
        """Replace all weights (every parameter must be given), e.g. at start-up or from a full snapshot.
        Same timing rules as `update_weights`."""

    @abstractmethod
    def update_weights(
        self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None = None
    ) -> None:
        """Overwrite the named parameters in place and set the version. A running `generate` sees the new
        weights from its next decode step on (its KV cache is kept); returns once they are applied.

        ``hashes``: the version's manifest hashes of these tensors. An engine that copies the weights into other
        processes checks what arrived against them and raises `WeightsRefused` on a mismatch; an in-process engine
        (the torch engine copies with ``Tensor.copy_``) may ignore them."""

    def close(self) -> None:
        """Release what the engine holds outside this process (engine processes, shared memory); default none."""
        return None

    @abstractmethod
    def generate(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        """Continue every request; results are in request order."""

    def submit(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[Future[GenerateResult]]:
        """Queue requests; each future resolves with its request's result as soon as that request finishes.
        Raises (and queues nothing) when a request is invalid. This default runs one blocking `generate` call
        on a worker thread, so every future resolves at its end; engines that batch continuously override it."""
        futures: list[Future[GenerateResult]] = [Future() for _ in requests]

        def run() -> None:
            try:
                results = self.generate(requests, params)
            except BaseException as exc:
                for future in futures:
                    future.set_exception(exc)
                return
            for future, result in zip(futures, results, strict=True):
                future.set_result(result)

        threading.Thread(target=run, name="engine-generate", daemon=True).start()
        return futures

    @abstractmethod
    def abort(self, request_ids: Collection[str] | None = None) -> None:
        """Make every request in progress (or only those with these ids) finish soon with reason ``abort``
        and the tokens produced so far. Requests submitted afterwards are not affected."""
