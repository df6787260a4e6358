"""A plain-PyTorch inference engine over a Hugging Face causal LM: continuous batching over a slot KV cache.

Requests stream in (`TorchEngine.submit`, or the blocking `generate` built on it) and are served by one
decode loop (on an engine thread, or in a `generate` caller's thread when none runs); each request owns
a *slot* of a preallocated KV cache (`actors/generator/engines/slot_runner.py`) from admission to its
finish:

    step i:  abort check -> [hook(i)] -> lock model -> apply pending weights (version V)
             -> decode: one token for every running slot            (one batched forward; a CUDA graph on GPU)
             -> admit waiting requests into free slots, prefill them (one forward per step; a prompt shared
                by G requests is prefilled once and its K/V copied to the G slots)
             -> unlock -> sample every row at once (`actors/generator/engines/sampling.py`)
             -> rows that stopped or ran out of budget finish: their result is delivered, their slot is free
                for the next step's admissions.

Invariants
- The log-prob recorded for a token is ``sampling_logprobs(logits, params)[token]``: its log-prob
  under the exact distribution it was drawn from (temperature, then top-k, then top-p over the
  renormalised top-k distribution, renormalised again). Greedy decoding (temperature 0) records 0.
- The version recorded for a token is the version of the weights applied when the logits it was
  sampled from were computed. Weights change only between two steps (under the model lock), and the
  KV cache of earlier positions is kept, so after a swap at step ``k`` a running row's cache holds its
  earlier positions from the old weights and everything later from the new ones.
- `update_weights` returns only after its tensors have been copied into the model (a version applied by
  the decode loop signals its waiter after the copy), so a caller may mutate its tensors afterwards.
- A request's tokens depend only on its prompt, its seed and the weights: token ``t`` is drawn by
  inverse-CDF sampling with a uniform that hashes (request seed, t), whatever the batch or the slot.
- `abort` finishes every request submitted before it (running or waiting; or only those with the given
  request ids) with reason ``abort`` and the tokens produced so far; requests submitted afterwards are
  not affected.
- A prompt that leaves no room for one new token in ``max_len`` finishes at once with reason
  ``prompt_too_long`` and no tokens; the other requests of the call are unaffected.

Prefix reuse (multi-turn episodes): a finished request that asked for it (`GenerateRequest.keep_prefix`) leaves
its slot holding the keys and values of its prompt and reply (all but the last sampled token, which was never
fed), *parked* under those ids, up to
``prefix_cache_slots`` slots, least recently parked first out, and only while no new request needs the slot.
A request whose prompt starts with a parked slot's ids (the longest such) takes that slot and computes only
its new tokens (`SlotRunner.extend`). A weight update drops every parked slot, so a request's tokens still
depend only on its prompt, its seed and the weights; unless ``prefix_across_updates`` keeps them (a later turn then
attends to keys and values of the earlier weights, as an in-flight update does within a request, and computes only
its new positions: the route versions say which weights computed each). `prefix_stats` counts lookups, hits, prompt tokens and
prefilled tokens (a prompt shared by a group counts once), and the positions of a dropped prefix (a weight update,
eviction) that a later prompt extending it had computed again (``recomputed_prefix_tokens``).

Routes (mixture-of-experts models): each request's result carries, for every position its forwards computed (the
prompt from ``routes_start``, then each fed token; the last sampled token is never fed), the experts every MoE
layer chose there (`GenerateResult.routes`) and the version of the weights of that forward (``route_versions``:
the version of its step). The G requests of a prompt prefilled once share its routes. A prefix hit starts at the
cached length (``routes_start``: the earlier turn carried the prefix's routes); a prompt that extends a dropped
prefix is computed, and routed, from 0 under the current weights, which ``recomputed_prefix_tokens`` counts.
A dense model records none (``routes`` None).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from actors.generator.engines.base import (
    Engine,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    NamedTensors,
    SamplingParams,
)
from actors.generator.engines.parked_prefixes import ParkedPrefixes
from actors.generator.engines.sampling import sample_rows, sampling_logprobs, seed_key
from actors.generator.engines.slot_runner import SlotRunner, build_slot_runner

__all__ = ["TorchEngine", "sampling_logprobs"]

log = logging.getLogger(__name__)

APPLY_POLL_S = 0.01
"""How long `update_weights` waits for the model lock before checking whether the decode loop applied its
tensors already (the loop re-takes the lock at once, so the waiter cannot rely on winning it)."""
DEFAULT_MAX_SLOTS = 64
"""Default number of sequences decoded at once (KV-cache slots)."""
DEFAULT_MAX_LEN = 4096
"""Default prompt-plus-reply limit: the model's context, but at most this (the KV cache is allocated up front,
``max_slots x max_len`` positions, so a 32k-context checkpoint would otherwise reserve many GiB)."""


@dataclass(eq=False)
class _Request:
    """A submitted request, waiting for a slot or running in one."""

    request: GenerateRequest
    prompt: list[int]
    params: SamplingParams
    seed: int
    budget: int
    epoch: int
    future: Future[GenerateResult]
    submitted_s: float
    key: int = 0
    """`seed_key` of the seed: what the sampling noise of each position hashes."""
    slot: int = -1
    cached: int = 0
    """Leading prompt positions its slot already held when admitted (a prefix hit); 0 = prefilled in full."""
    aborted: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: list[np.ndarray] | None = None
    """MoE: the routes of each forward that computed some of its positions, in position order (the first chunk
    is empty: it gives an empty result its shape); None for a dense model."""
    route_versions: list[int] = field(default_factory=list)
    """The weights version of each chunk of ``routes``."""

    def add_routes(self, routes: np.ndarray, version: int) -> None:
        assert self.routes is not None
        self.routes.append(routes)
        self.route_versions.append(version)

    def result(self, reason: FinishReason) -> GenerateResult:
        routes = versions = None
        if self.routes is not None:
            routes = np.concatenate(self.routes)
            versions = np.repeat(np.asarray(self.route_versions, dtype=np.int32), [len(r) for r in self.routes])
        return GenerateResult(
            token_ids=np.asarray(self.tokens, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            finish_reason=reason,
            request_id=self.request.request_id,
            gen_s=time.perf_counter() - self.submitted_s,
            routes=routes,
            route_versions=versions,
            routes_start=self.cached,
        )


@dataclass(eq=False)
class _Update:
    """One `update_weights` call: done is set after its tensors were copied (or the copy failed)."""

    tensors: dict[str, torch.Tensor]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class TorchEngine(Engine):
    """`Engine` over an in-process HF causal LM (see the module docstring).

    ``max_slots`` sequences run at once, each at most ``max_len`` tokens (prompt + reply; default: the model's
    ``max_position_embeddings``, at most `DEFAULT_MAX_LEN`). ``cuda_graphs``: capture the decode step on CUDA. ``fast_forward=False``
    forces the generic (slow) HF path, e.g. to test it. ``on_decode_step(i)`` is called on the decode loop's
    thread before step ``i`` of a busy period (``i = 0``: the step that prefills the first requests), outside the
    model lock, so it may call `update_weights` or `abort`; tests use it to act at an exact step. Torch
    thread counts are left as the caller configured them.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        seed: int = 0,
        version: int = 0,
        on_decode_step: Callable[[int], None] | None = None,
        max_slots: int = DEFAULT_MAX_SLOTS,
        max_len: int | None = None,
        cuda_graphs: bool = True,
        fast_forward: bool = True,
        prefix_cache_slots: int | None = None,
        prefix_across_updates: bool = False,
    ) -> None:
        self._model = model.eval()
        self._device = next(model.parameters()).device
        self._tensors = dict(model.state_dict(keep_vars=True))
        self._vocab_size = int(model.get_input_embeddings().weight.shape[0])
        if not 0 <= pad_token_id < self._vocab_size:
            raise ValueError(f"pad_token_id={pad_token_id} is outside the vocabulary [0, {self._vocab_size})")
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        positions: int | None = getattr(model.config, "max_position_embeddings", None)
        max_len = max_len or min(positions or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN)
        if positions is not None and max_len > positions:
            if hasattr(model.config, "n_positions"):  # learned absolute positions: there is no embedding past them
                raise ValueError(f"max_len={max_len} exceeds the model's max_position_embeddings={positions}")
            log.warning(
                "max_len=%d exceeds the model's max_position_embeddings=%d (rotary positions)", max_len, positions
            )
        self._max_len = max_len
        self._runner: SlotRunner = build_slot_runner(
            model, max_slots, max_len, cuda_graphs=cuda_graphs, fast=fast_forward
        )
        self._version = version
        self._rng = torch.Generator().manual_seed(seed)
        self._model_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: list[_Update] = []
        self._on_decode_step = on_decode_step
        # The scheduler's state, guarded by _lock: waiting requests, slots, the abort epoch, the loop thread.
        self._lock = threading.Lock()
        self._waiting: deque[_Request] = deque()
        self._slots: list[_Request | None] = [None] * max_slots
        self._epoch = 0
        self._loop: threading.Thread | None = None
        limit = max_slots if prefix_cache_slots is None else min(prefix_cache_slots, max_slots)
        self._parked = ParkedPrefixes(limit if self._runner.supports_extend else 0)
        self._prefix_across_updates = prefix_across_updates
        self._stats = {
            "prefix_lookups": 0,
            "prefix_hits": 0,
            "prompt_tokens": 0,
            "prefilled_tokens": 0,
            "recomputed_prefix_tokens": 0,
        }
        shape = self._runner.recorder.shape if self._runner.recorder is not None else None
        self._no_routes = None if shape is None else np.zeros((0, shape.layers, shape.top_k), dtype=shape.dtype)

    @property
    def version(self) -> int:
        return self._version

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context_tokens(self) -> int:
        return self._max_len

    @property
    def max_slots(self) -> int:
        return self._runner.num_slots

    @property
    def prefix_stats(self) -> dict[str, int]:
        """Prefix-reuse counters since start: ``prefix_lookups``, ``prefix_hits``, ``prompt_tokens`` (admitted
        requests' prompts), ``prefilled_tokens`` (positions actually computed for them) and
        ``recomputed_prefix_tokens`` (positions of a kept prefix that was dropped, by a weight update or an
        eviction, before a prompt extending it came: computed, and for a MoE model routed, again from 0)."""
        with self._lock:
            return dict(self._stats)

    @property
    def model(self) -> PreTrainedModel:
        """The wrapped model (read-only use: write weights through `update_weights`)."""
        return self._model

    @property
    def runner(self) -> SlotRunner:
        """The forward-pass runner (tests check which one a model got)."""
        return self._runner

    # ---- weights -------------------------------------------------------------------------------

    def load_state(self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None = None) -> None:
        missing = sorted(set(self._tensors) - set(named_tensors))
        if missing:
            raise ValueError(f"load_state(version={version}): {len(missing)} tensors missing, e.g. {missing[:3]}")
        self.update_weights(named_tensors, version)

    def update_weights(
        self, named_tensors: NamedTensors, version: int, hashes: Mapping[str, str] | None = None
    ) -> None:
        self._validate(named_tensors, version)
        update = _Update(dict(named_tensors), version)
        with self._pending_lock:
            self._pending.append(update)
        while not update.done.is_set():
            if self._model_lock.acquire(timeout=APPLY_POLL_S):
                try:
                    self._apply_pending_locked()
                finally:
                    self._model_lock.release()
        if update.error is not None:
            raise update.error

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
        """Copy pending updates into the model in order; the caller holds the model lock, so no forward runs.

        Each update's waiter is released only after the copy finished (on CUDA: after the device finished
        it), so it may reuse or mutate its tensors as soon as `update_weights` returns."""
        with self._pending_lock:
            updates, self._pending = self._pending, []
        try:
            with torch.no_grad():
                for update in updates:
                    for name, tensor in update.tensors.items():
                        self._copy_tensor(self._tensors[name], tensor)
                    self._version = update.version
                if updates and not self._prefix_across_updates:
                    with self._lock:  # keys and values of other weights are not reused (module docstring)
                        self._parked.drop_all()
                if self._device.type == "cuda":
                    torch.cuda.synchronize(self._device)
        except BaseException as exc:
            for update in updates:
                update.error = exc
            raise
        finally:
            for update in updates:
                update.done.set()

    def _copy_tensor(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """One tensor of an update into the model (a method, so a test can slow it down)."""
        target.copy_(source)

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[Future[GenerateResult]]:
        """Queue requests for the decode loop (started on an engine thread if none runs); each future resolves
        when its request finishes.

        Raises ValueError (and queues nothing) when a prompt holds ids outside the vocabulary."""
        futures = self._enqueue(requests, params)
        with self._lock:
            if self._waiting and self._loop is None:
                self._loop = threading.Thread(target=self._run_loop, name="torch-engine", daemon=True)
                self._loop.start()
        return futures

    def generate(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        """`submit` and wait. When no decode loop runs, the calling thread runs it (until no request is left,
        its own or others'), which saves the hand-over to an engine thread on every call."""
        futures = self._enqueue(requests, params)
        with self._lock:
            drive = bool(self._waiting) and self._loop is None
            if drive:
                self._loop = threading.current_thread()
        if drive:
            self._run_loop()
        return [future.result() for future in futures]

    def _enqueue(self, requests: Sequence[GenerateRequest], params: SamplingParams) -> list[Future[GenerateResult]]:
        now = time.perf_counter()
        prompts = [self._checked_prompt(r) for r in requests]
        futures: list[Future[GenerateResult]] = []
        refused: list[_Request] = []
        with self._lock:
            drawn = torch.randint(0, 2**62, (len(requests),), generator=self._rng).tolist()
            for request, prompt, fallback_seed in zip(requests, prompts, drawn, strict=True):
                seed = request.seed if request.seed is not None else fallback_seed
                budget = min(request.max_new_tokens or params.max_new_tokens, self._max_len - len(prompt))
                entry = _Request(request, prompt, params, seed, budget, self._epoch, Future(), now, seed_key(seed))
                if self._no_routes is not None:
                    entry.routes = []
                    entry.add_routes(self._no_routes, self._version)
                entry.future.set_running_or_notify_cancel()
                futures.append(entry.future)
                if budget < 1:
                    refused.append(entry)
                else:
                    self._waiting.append(entry)
        _deliver([(entry, "prompt_too_long") for entry in refused])
        return futures

    def abort(self, request_ids: Collection[str] | None = None) -> None:
        with self._lock:
            if request_ids is None:
                self._epoch += 1
                return
            ids = set(request_ids)
            for entry in [*self._waiting, *self._slots]:
                if entry is not None and entry.request.request_id in ids:
                    entry.aborted = True

    def _checked_prompt(self, request: GenerateRequest) -> list[int]:
        try:
            ids = [int(t) for t in request.input_ids]
        except TypeError:  # a nested list or array: not a flat list of ids
            ids = [-1]
        if min(ids) < 0 or max(ids) >= self._vocab_size:
            raise ValueError(
                f"request {request.request_id!r}: input_ids must be a flat list of ids in [0, {self._vocab_size})"
            )
        return ids

    # ---- the decode loop -----------------------------------------------------------------------

    def _run_loop(self) -> None:
        """Steps until no request is waiting or running, on the engine thread or a `generate` caller's thread
        (whichever claimed `_loop`); a later submit or generate starts it again."""
        step = 0
        while True:
            finished: list[tuple[_Request, FinishReason]] = []
            with self._lock:
                finished += self._take_aborted()
                idle = not self._waiting and not any(self._slots)
                if idle:
                    self._loop = None
            _deliver(finished)  # outside the lock: a future's callbacks may submit again
            if idle:
                return
            if self._on_decode_step is not None:
                self._on_decode_step(step)
            try:
                _deliver(self._step())
            except Exception as exc:  # the engine broke: every request it holds fails with the error
                self._fail_all(exc)
            except BaseException as exc:
                self._fail_all(exc)
                with self._lock:
                    self._loop = None
                raise
            step += 1

    def _take_aborted(self) -> list[tuple[_Request, FinishReason]]:
        """Requests submitted before the latest `abort`; caller holds the scheduler lock."""
        out: list[tuple[_Request, FinishReason]] = []
        for slot, entry in enumerate(self._slots):
            if entry is not None and (entry.aborted or entry.epoch < self._epoch):
                self._slots[slot] = None
                out.append((entry, "abort"))
        keep: deque[_Request] = deque()
        for entry in self._waiting:
            if entry.aborted or entry.epoch < self._epoch:
                out.append((entry, "abort"))
            else:
                keep.append(entry)
        self._waiting = keep
        return out

    def _step(self) -> list[tuple[_Request, FinishReason]]:
        """One decode step of the running rows and the prefill of newly admitted ones; returns who finished."""
        with self._model_lock:
            self._apply_pending_locked()
            version = self._version
            with self._lock:
                running = [entry for entry in self._slots if entry is not None]
                admitted = self._admit()
                # a parked slot inside the dense decode takes its dummy write past its prefix, not over it; so
                # does a prefix hit admitted now, whose extend reads that prefix right after this decode
                idle = {slot: len(ids) for slot, ids in self._parked.slots.items()}
                idle.update({entry.slot: entry.cached for entry in admitted if entry.cached})
            logits, rows = self._forwards(running, admitted, idle, version)
        tokens, logprobs = sample_rows(
            logits,
            [e.params for e in rows],
            [e.key for e in rows],
            [len(e.tokens) for e in rows],
        )
        finished: list[tuple[_Request, FinishReason]] = []
        for entry, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            entry.tokens.append(token)
            entry.logprobs.append(logprob)
            entry.versions.append(version)
            if token in entry.params.stop_token_ids:
                finished.append((entry, "stop"))
            elif len(entry.tokens) >= entry.budget:
                finished.append((entry, "length"))
        with self._lock:
            for entry, _ in finished:
                if self._slots[entry.slot] is entry:
                    self._slots[entry.slot] = None
                    if entry.request.keep_prefix:
                        self._parked.park(entry.slot, (*entry.prompt, *entry.tokens[:-1]))
        return finished

    def _forwards(
        self, running: list[_Request], admitted: list[_Request], idle: dict[int, int], version: int
    ) -> tuple[torch.Tensor, list[_Request]]:
        """The step's forwards, under the model lock: one decode of the running rows, one prefill of the distinct
        new prompts, one extend of the prefix hits. Returns their logits and the request of each row; a MoE
        model's routes go to the requests whose positions each forward computed, with ``version``."""
        logits, rows = [], []
        if running:
            logits.append(
                self._runner.decode(
                    [e.slot for e in running],
                    [e.tokens[-1] for e in running],
                    [len(e.prompt) + len(e.tokens) - 1 for e in running],
                    idle_positions=idle,
                )
            )
            self._file_routes([[e] for e in running], version)
            rows += running
        hits = [entry for entry in admitted if entry.cached]
        groups: dict[tuple[int, ...], list[_Request]] = {}
        for entry in admitted:
            if not entry.cached:
                groups.setdefault(tuple(entry.prompt), []).append(entry)
        if groups:
            prompt_logits = self._runner.prefill(
                [list(p) for p in groups], [[e.slot for e in group] for group in groups.values()]
            )
            index = torch.tensor(
                [g for g, group in enumerate(groups.values()) for _ in group], device=prompt_logits.device
            )
            logits.append(prompt_logits[index])
            self._file_routes(list(groups.values()), version)  # a group's slots share its prompt's routes
            rows += [entry for group in groups.values() for entry in group]
        if hits:
            logits.append(
                self._runner.extend(
                    [e.slot for e in hits], [e.prompt[e.cached :] for e in hits], [e.cached for e in hits]
                )
            )
            self._file_routes([[e] for e in hits], version)
            rows += hits
        if admitted:
            with self._lock:
                self._stats["prompt_tokens"] += sum(len(e.prompt) for e in admitted)
                self._stats["prefilled_tokens"] += sum(len(p) for p in groups)
                self._stats["prefilled_tokens"] += sum(len(e.prompt) - e.cached for e in hits)
        return torch.cat(logits), rows

    def _file_routes(self, owners: list[list[_Request]], version: int) -> None:
        """The last runner call's routes, row ``i`` to every request of ``owners[i]`` (MoE models only)."""
        if self._no_routes is None:
            return
        for entries, routes in zip(owners, self._runner.routes, strict=True):
            for entry in entries:
                entry.add_routes(routes, version)

    def _admit(self) -> list[_Request]:
        """Waiting requests into free slots, caller holding the lock: a parked slot holding the longest prefix of
        the prompt, else the lowest free slot that is not parked (keeps the running slots packed), else the least
        recently parked one."""
        admitted = []
        while self._waiting:
            new = self._waiting[0]
            slot, cached = self._prefix_slot(new.prompt)
            if slot is None:
                free = [i for i, entry in enumerate(self._slots) if entry is None]
                unparked = [i for i in free if i not in self._parked.slots]
                slot = unparked[0] if unparked else next(iter(self._parked.slots), None)
                if slot is None:
                    break
                self._parked.evict(slot)
            self._waiting.popleft()
            new.slot, new.cached = slot, cached
            self._slots[slot] = new
            admitted.append(new)
        return admitted

    def _prefix_slot(self, prompt: list[int]) -> tuple[int | None, int]:
        """(parked slot, cached length) of the longest parked ids that begin ``prompt`` and leave a token to
        compute; (None, 0) when none do. Counts the lookup, the hit and a recomputed dropped prefix; caller holds
        the lock."""
        if not self._parked.limit:
            return None, 0
        self._stats["prefix_lookups"] += 1
        slot, cached, recomputed = self._parked.take_longest(prompt)
        self._stats["recomputed_prefix_tokens"] += recomputed
        self._stats["prefix_hits"] += slot is not None
        return slot, cached

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._parked.drop_all()  # a forward failed half-way: no cache content is trusted
            entries = [e for e in self._slots if e is not None] + list(self._waiting)
            self._slots = [None] * len(self._slots)
            self._waiting.clear()
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(exc)


def _deliver(finished: list[tuple[_Request, FinishReason]]) -> None:
    """Resolve each future with its result, or with the error that building the result raised (the request has
    left its slot by now: a caller waiting on it must not wait forever)."""
    for entry, reason in finished:
        if entry.future.done():
            continue
        try:
            result = entry.result(reason)
        except Exception as exc:
            log.exception("request %r: its result could not be built", entry.request.request_id)
            entry.future.set_exception(exc)
            continue
        entry.future.set_result(result)
