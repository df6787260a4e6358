"""The pure half of the SGLang engine (`sglang_engine.py`): Leeway's records to SGLang's request fields and back,
the weight-update plan, and the custom weight loader SGLang's scheduler runs. Nothing here imports ``sglang``, so
it is unit-tested on any machine (``tests/generator/test_sglang_mapping.py``) against the data shapes read from
SGLang's source (sgl-project/sglang; the commits named are those read):

- requests: ``GenerateReqInput`` fields (``managers/io_struct.py`` @ 001067ff: ``input_ids``, ``sampling_params``,
  ``return_logprob``, ``return_sampling_mask``, ``rid``, ``cache_salt``) and the ``sampling_params`` dict
  (``sampling/sampling_params.py`` @ 00c17caf: ``top_k=-1`` is off, temperature 0 becomes ``top_k=1``,
  ``sampling_seed``). ``ignore_eos`` switches off *every* token stop, ``stop_token_ids`` included, and without it
  SGLang also stops at the model's EOS ids (``Req._check_token_based_finish`` in ``managers/schedule_batch.py``;
  ``ModelConfig._get_hf_eos_token_id``: config.json's and generation_config.json's ``eos_token_id``, united). So a
  request without stop ids sets ``ignore_eos``, and one with stop ids must list every model EOS id (else refused).
- results: ``{"output_ids", "meta_info"}`` with ``meta_info["output_token_logprobs"] = [(logprob, id, text)]``,
  ``finish_reason = {"type": "stop", "matched": id} | {"type": "length", ...} | {"type": "abort", ...}``,
  ``weight_versions = [{"version", "start", "end"}]`` (``utils/weight_versions.py`` @ 19f93835: spans over the
  returned tokens, one ``[0, 0)`` span for none), ``prompt_tokens``, ``cached_tokens``.
- behaviour log-probs: SGLang's ``output_token_logprobs`` are ``log_softmax(logits / T)`` *before* top-k/top-p.
  With ``return_sampling_mask`` (SGLang PR #40932) it also returns ``output_token_sampling_mask`` (the support each
  token was drawn from) and ``output_token_sampling_logprobs`` (default ``selected`` mode: one float per token,
  ``log(p[token] / sum(p over the support))``): the exact behaviour log-prob. A filtered request (top-k or top-p)
  asks for it and fails (`EngineContractError`) when the SGLang build does not return it; an unfiltered one uses
  ``output_token_logprobs``, which then are the sampling distribution's. Greedy records 0 (as the torch engine).
- weights: ``update_weights_from_tensor(load_format=<a --custom-weight-loader path>)`` calls ``loader(model,
  named_tensors)`` in every TP scheduler (``model_executor/model_runner.py``); `leeway_weight_loader` checks each
  tensor's sha256 before anything is written. The expected hashes travel inside the tensor list (one uint8 entry
  named `HASHES_ENTRY` holding JSON), as the loader receives nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.generator.engines.version_spans import EngineContractError, version_label, versions_from_spans
from pipeline.rl.engine_records import GenerateRequest, GenerateResult, SamplingParams
from pipeline.wire.trajectory import FinishReason
from storage.weights_base import tensor_hash

__all__ = [
    "ENGINE",
    "HASHES_ENTRY",
    "LOADER_PATH",
    "ControlCall",
    "WeightHashMismatch",
    "abort_targets",
    "generate_fields",
    "leeway_weight_loader",
    "model_eos_token_ids",
    "prefix_counts",
    "prompt_too_long",
    "result_from_output",
    "weight_update_plan",
    "with_expected_hashes",
]

ENGINE = "sglang"
"""The engine's name in contract errors."""
HASHES_ENTRY = "__leeway_sha256__"
"""Name of the extra uint8 tensor (JSON ``{tensor name: sha256 hex}``) appended to an update's tensor list."""
LOADER_PATH = f"{__name__}.leeway_weight_loader"
"""What SGLang's ``--custom-weight-loader`` and ``load_format`` name: it ``dynamic_import``s this path."""


class WeightHashMismatch(ValueError):
    """A tensor reached SGLang's model with other bits than the version's manifest says; nothing was written."""


# ---- requests ------------------------------------------------------------------------------------------------


def _filtered(params: SamplingParams) -> bool:
    """Whether tokens are drawn from a truncated distribution (top-k or top-p), whose log-probs SGLang reports
    only through its sampling mask."""
    return params.temperature > 0 and (params.top_k > 0 or params.top_p < 1.0)


def _checked_prompt(request: GenerateRequest, vocab_size: int | None) -> list[int]:
    try:
        ids = [int(t) for t in request.input_ids]
    except TypeError:  # a nested list or array: not a flat list of ids
        ids = [-1]
    if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
        raise ValueError(f"request {request.request_id!r}: input_ids must be a flat list of ids in [0, {vocab_size})")
    return ids


def _sampling_params(params: SamplingParams, budget: int, seed: int | None, model_eos_ids: Collection[int]) -> dict:
    """SGLang's ``sampling_params`` dict for one request (its ``SamplingParams`` field names)."""
    stops = list(params.stop_token_ids)
    missing = sorted(set(model_eos_ids) - set(stops))
    if stops and missing:
        raise ValueError(
            f"SamplingParams.stop_token_ids={stops}: SGLang also stops at the model's EOS ids {missing} whenever any "
            "stop id is set (its ignore_eos switches off every stop id); add them to stop_token_ids or set none"
        )
    out: dict[str, Any] = {
        "max_new_tokens": budget,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": 0.0,
        "ignore_eos": not stops,
        "no_stop_trim": True,
    }
    if stops:
        out["stop_token_ids"] = stops
    if seed is not None:
        out["sampling_seed"] = int(seed)
    return out


def generate_fields(
    request: GenerateRequest,
    params: SamplingParams,
    *,
    rid: str,
    max_context_tokens: int,
    vocab_size: int | None,
    model_eos_ids: Collection[int],
    cache_salt: str,
) -> dict[str, Any] | None:
    """``GenerateReqInput`` keyword arguments for one request, or None when the prompt leaves no room for one new
    token (the caller answers `prompt_too_long` without asking the engine). ``cache_salt`` namespaces SGLang's
    prefix cache (the adapter passes the weight version, so a prefix computed by older weights is not reused by a
    request submitted after an update). Raises ValueError for ids outside the vocabulary or unservable stops."""
    prompt = _checked_prompt(request, vocab_size)
    budget = min(request.max_new_tokens or params.max_new_tokens, max_context_tokens - len(prompt))
    sampling = _sampling_params(params, max(budget, 1), request.seed, model_eos_ids)
    if budget < 1:
        return None
    return {
        "input_ids": prompt,
        "sampling_params": sampling,
        "return_logprob": True,
        "return_sampling_mask": _filtered(params),
        "rid": rid,
        "cache_salt": cache_salt,
        "stream": False,
    }


def prompt_too_long(request: GenerateRequest) -> GenerateResult:
    return GenerateResult(
        token_ids=np.empty(0, dtype=np.int32),
        logprobs=np.empty(0, dtype=np.float32),
        versions=np.empty(0, dtype=np.int32),
        finish_reason="prompt_too_long",
        request_id=request.request_id,
    )


def abort_targets(live: Mapping[str, str], request_ids: Collection[str] | None) -> list[str]:
    """The SGLang rids to abort: all live ones, or those carrying one of Leeway's ``request_ids``
    (``live``: rid -> Leeway request id; rids are unique, Leeway's ids need not be)."""
    if request_ids is None:
        return list(live)
    wanted = set(request_ids)
    return [rid for rid, request_id in live.items() if request_id in wanted]


# ---- results -------------------------------------------------------------------------------------------------


def _finish_reason(meta: Mapping[str, Any], token_ids: np.ndarray, stop_ids: Collection[int]) -> FinishReason:
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, Mapping) else None
    if kind in ("length", "abort"):
        return kind
    if kind != "stop":
        raise EngineContractError(f"{ENGINE}: finish_reason {finish!r} is not stop, length or abort")
    matched = finish.get("matched")
    if not isinstance(matched, int) or isinstance(matched, bool):  # a string match: none is requested ("NaN happened")
        raise EngineContractError(f"{ENGINE}: stopped on {matched!r}, not on a stop token id")
    if matched not in stop_ids or not len(token_ids) or int(token_ids[-1]) != matched:
        raise EngineContractError(
            f"{ENGINE}: stopped on token {matched}, which is not the last returned token or not a requested stop id"
        )
    return "stop"


def _logprobs(meta: Mapping[str, Any], token_ids: np.ndarray, params: SamplingParams) -> np.ndarray:
    n = len(token_ids)
    if params.temperature == 0 or n == 0:
        return np.zeros(n, dtype=np.float32)
    if _filtered(params):
        values = meta.get("output_token_sampling_logprobs")
        if values is None:
            raise EngineContractError(
                f"{ENGINE}: top-k/top-p sampling needs output_token_sampling_logprobs (return_sampling_mask, SGLang "
                "PR #40932); this SGLang returned none, so the behaviour log-probs are unknown"
            )
        masks = meta.get("output_token_sampling_mask")
        if masks is not None and any(int(t) not in m for t, m in zip(token_ids, masks, strict=False)):
            raise EngineContractError(f"{ENGINE}: a sampled token lies outside the sampling mask it was drawn from")
    else:
        entries = meta.get("output_token_logprobs") or []
        values = [entry[0] for entry in entries]
    if len(values) != n or not all(isinstance(v, (int, float)) for v in values):
        raise EngineContractError(f"{ENGINE}: {len(values)} scalar log-probs came back for {n} tokens")
    return np.asarray(values, dtype=np.float32)


def result_from_output(
    output: Mapping[str, Any], params: SamplingParams, *, request_id: str = "", gen_s: float = 0.0
) -> GenerateResult:
    """Leeway's result from one SGLang generate answer (see the module docstring for the fields)."""
    meta = output.get("meta_info") or {}
    raw_ids = output.get("output_ids")
    if raw_ids is None:
        raw_ids = meta.get("output_ids", [])
    token_ids = np.asarray(raw_ids, dtype=np.int32).reshape(-1)
    entries = meta.get("output_token_logprobs") or []
    if len(entries) != len(token_ids) or any(int(e[1]) != int(t) for e, t in zip(entries, token_ids, strict=False)):
        raise EngineContractError(f"{ENGINE}: output_token_logprobs do not name the {len(token_ids)} returned tokens")
    spans = meta.get("weight_versions")
    if spans is not None:
        spans = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans]
    return GenerateResult(
        token_ids=token_ids,
        logprobs=_logprobs(meta, token_ids, params),
        versions=versions_from_spans(spans, len(token_ids), engine=ENGINE),
        finish_reason=_finish_reason(meta, token_ids, params.stop_token_ids),
        request_id=request_id,
        gen_s=gen_s,
        extra={"cached_tokens": int(meta.get("cached_tokens") or 0)},
    )


def prefix_counts(meta: Mapping[str, Any]) -> dict[str, int]:
    """One answer's share of `Engine.prefix_stats` (SGLang's radix cache reports ``cached_tokens``)."""
    prompt = int(meta.get("prompt_tokens") or 0)
    cached = int(meta.get("cached_tokens") or 0)
    return {
        "prefix_lookups": 1,
        "prefix_hits": int(cached > 0),
        "prompt_tokens": prompt,
        "prefilled_tokens": prompt - cached,
    }


def model_eos_token_ids(model_dir: str | Path) -> frozenset[int]:
    """The EOS ids SGLang stops at for this checkpoint: ``eos_token_id`` of config.json and generation_config.json
    (an int or a list), united, as ``ModelConfig._get_hf_eos_token_id`` does."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        if value is not None:
            ids.update([int(value)] if isinstance(value, int) else (int(v) for v in value))
    return frozenset(ids)


# ---- weights -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ControlCall:
    """One control-plane call: ``await tokenizer_manager.<method>(<request>(**fields))``, ``request`` naming a
    class of ``sglang.srt.managers.io_struct``."""

    method: str
    request: str
    fields: dict[str, Any] = field(default_factory=dict)


def weight_update_plan(
    version: int, serialized_per_rank: list[Any]
) -> tuple[ControlCall, list[ControlCall], ControlCall]:
    """(pause, apply, resume) for one update: pause in place (running requests keep their KV cache), load the
    tensors through `leeway_weight_loader` (no cache flush: SGLang refuses it while requests sit in the running
    batch; the adapter salts the prefix cache per version instead), label the new weights so SGLang stamps every
    live request's version span, then continue. The caller runs ``resume`` whether or not ``apply`` succeeded."""
    pause = ControlCall("pause_generation", "PauseGenerationReqInput", {"mode": "in_place"})
    apply = [
        ControlCall(
            "update_weights_from_tensor",
            "UpdateWeightsFromTensorReqInput",
            {
                "serialized_named_tensors": serialized_per_rank,
                "load_format": LOADER_PATH,
                "flush_cache": False,
                "abort_all_requests": False,
            },
        ),
        ControlCall(
            "update_weight_version",
            "UpdateWeightVersionReqInput",
            {"new_version": version_label(version), "abort_all_requests": False},
        ),
    ]
    return pause, apply, ControlCall("continue_generation", "ContinueGenerationReqInput")


def with_expected_hashes(
    named_tensors: Mapping[str, torch.Tensor], expected: Mapping[str, str] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The tensor list to send: every tensor (contiguous, on the CPU, as the store holds them) and, last, the
    `HASHES_ENTRY` carrying each one's expected hash (the manifest's when given, else its `tensor_hash`)."""
    if HASHES_ENTRY in named_tensors:
        raise ValueError(f"weights: tensor name {HASHES_ENTRY!r} is reserved")
    pairs = [(name, t.detach().contiguous()) for name, t in named_tensors.items()]
    digests = {name: expected[name] if expected is not None else tensor_hash(t) for name, t in pairs}
    hashes = json.dumps(digests, sort_keys=True).encode()
    return [*pairs, (HASHES_ENTRY, torch.frombuffer(bytearray(hashes), dtype=torch.uint8))]


def _split_expected_hashes(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    weights: list[tuple[str, torch.Tensor]] = []
    expected: dict[str, str] | None = None
    for name, tensor in named_tensors:
        if name == HASHES_ENTRY:
            expected = json.loads(bytes(tensor.detach().cpu().numpy().tobytes()).decode())
        else:
            weights.append((name, tensor))
    if expected is None:
        raise WeightHashMismatch(f"weight update without {HASHES_ENTRY}: refusing unverifiable tensors")
    return weights, expected


def leeway_weight_loader(model: Any, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader (``--custom-weight-loader`` `LOADER_PATH`): verify every tensor's sha256
    against the hashes sent with it, then hand them to ``model.load_weights``. A mismatch, a tensor without a hash
    or a hash without its tensor raises `WeightHashMismatch` before anything is written."""
    weights, expected = _split_expected_hashes(named_tensors)
    names = {name for name, _ in weights}
    if names != expected.keys():
        odd = sorted(names ^ expected.keys())
        raise WeightHashMismatch(f"weight update: tensors and hashes differ, e.g. {odd[:3]}")
    for name, tensor in weights:
        got = tensor_hash(tensor.detach().to("cpu").contiguous())
        if got != expected[name]:
            raise WeightHashMismatch(f"weight update: tensor {name!r} arrived with sha256 {got}, sent {expected[name]}")
    model.load_weights(weights)
