"""The SGLang engine's pure parts (`sglang_requests.py`, `server_args`) against SGLang's data shapes, without SGLang.

The field sets and answer dicts below are copied from SGLang's source (sgl-project/sglang: ``io_struct.py`` @
001067ff, ``sampling_params.py`` @ 00c17caf, ``weight_versions.py`` @ 19f93835, and its sampling-mask tests); the
adapter that sends them (`SglangEngine`) needs a CUDA machine with SGLang and is not run here.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.generator.engines.sglang_engine import server_args
from actors.generator.engines.sglang_requests import (
    HASHES_ENTRY,
    LOADER_PATH,
    WeightHashMismatch,
    abort_targets,
    generate_fields,
    leeway_weight_loader,
    model_eos_token_ids,
    prefix_counts,
    prompt_too_long,
    result_from_output,
    weight_update_plan,
    with_expected_hashes,
)
from actors.generator.engines.version_spans import EngineContractError
from pipeline.rl.engine_records import GenerateRequest, SamplingParams

SGLANG_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}  # fmt: skip
"""``SamplingParams``' API fields in SGLang's ``sampling/sampling_params.py``."""
GENERATE_REQ_FIELDS = {
    "rid", "input_ids", "sampling_params", "return_logprob", "return_sampling_mask", "cache_salt", "stream",
}  # fmt: skip
"""The ``GenerateReqInput`` fields (``managers/io_struct.py``) the adapter sets."""


def _fields(request: GenerateRequest, params: SamplingParams, **overrides: object) -> dict | None:
    kwargs: dict = {"rid": "r-1", "max_context_tokens": 16, "vocab_size": 100, "model_eos_ids": {2}, "cache_salt": "v3"}
    kwargs.update(overrides)
    return generate_fields(request, params, **kwargs)


def _answer(output_ids: list[int], **meta: object) -> dict:
    """An SGLang generate answer: ``output_ids`` and ``meta_info`` with ``(logprob, id, text)`` per token."""
    info: dict = {
        "output_token_logprobs": [(-0.5 - i, t, None) for i, t in enumerate(output_ids)],
        "weight_versions": [{"version": "3", "start": 0, "end": len(output_ids)}],
        "finish_reason": {"type": "length", "length": len(output_ids)},
        "prompt_tokens": 4,
        "cached_tokens": 0,
    }
    info.update(meta)
    return {"output_ids": output_ids, "meta_info": info}


# ---- requests ------------------------------------------------------------------------------------------------


def test_request_maps_onto_generate_req_input_fields() -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=(2, 7))
    fields = _fields(GenerateRequest([1, 5, 6], seed=42, request_id="a"), params)
    assert fields is not None and set(fields) == GENERATE_REQ_FIELDS
    assert fields["input_ids"] == [1, 5, 6] and fields["rid"] == "r-1" and fields["cache_salt"] == "v3"
    assert fields["return_logprob"] is True and fields["return_sampling_mask"] is True and fields["stream"] is False
    sampling = fields["sampling_params"]
    assert set(sampling) <= SGLANG_SAMPLING_FIELDS
    assert sampling == {
        "max_new_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.0,
        "ignore_eos": False,
        "no_stop_trim": True,
        "stop_token_ids": [2, 7],
        "sampling_seed": 42,
    }


def test_unfiltered_request_turns_filters_off_and_stops_nowhere_without_stop_ids() -> None:
    fields = _fields(GenerateRequest([1, 2, 3], max_new_tokens=4), SamplingParams(max_new_tokens=50))
    assert fields is not None
    sampling = fields["sampling_params"]
    assert sampling["top_k"] == -1 and sampling["top_p"] == 1.0 and sampling["max_new_tokens"] == 4
    assert sampling["ignore_eos"] is True and "stop_token_ids" not in sampling and "sampling_seed" not in sampling
    assert fields["return_sampling_mask"] is False  # the full distribution: output_token_logprobs are exact
    greedy = _fields(GenerateRequest([1]), SamplingParams(max_new_tokens=4, temperature=0.0, top_k=3))
    assert greedy is not None and greedy["return_sampling_mask"] is False


def test_budget_is_clipped_to_the_context_and_a_full_prompt_is_prompt_too_long() -> None:
    params = SamplingParams(max_new_tokens=100)
    fields = _fields(GenerateRequest(list(range(10))), params)
    assert fields is not None and fields["sampling_params"]["max_new_tokens"] == 6
    assert _fields(GenerateRequest(list(range(16)), request_id="long"), params) is None
    result = prompt_too_long(GenerateRequest(list(range(16)), request_id="long"))
    assert result.finish_reason == "prompt_too_long" and result.request_id == "long"
    assert len(result.token_ids) == len(result.logprobs) == len(result.versions) == 0


def test_bad_prompts_and_unservable_stops_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="request 'x': input_ids must be a flat list of ids in \\[0, 100\\)"):
        _fields(GenerateRequest([1, 100], request_id="x"), SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"stop_token_ids=\[7\]: SGLang also stops at the model's EOS ids \[2\]"):
        _fields(GenerateRequest([1]), SamplingParams(max_new_tokens=2, stop_token_ids=(7,)))


def test_abort_targets_every_live_rid_or_those_of_the_named_requests() -> None:
    live = {"a-1": "a", "a-2": "a", "b-1": "b"}
    assert abort_targets(live, None) == ["a-1", "a-2", "b-1"]
    assert abort_targets(live, ["a"]) == ["a-1", "a-2"]
    assert abort_targets(live, ["zzz"]) == []


# ---- results -------------------------------------------------------------------------------------------------


def test_answer_across_an_update_becomes_tokens_logprobs_and_two_versions() -> None:
    answer = _answer(
        [7, 9, 2],
        weight_versions=[{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}],
        finish_reason={"type": "stop", "matched": 2},
        cached_tokens=3,
    )
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(2,))
    result = result_from_output(answer, params, request_id="q", gen_s=0.25)
    assert result.token_ids.dtype == np.int32 and result.token_ids.tolist() == [7, 9, 2]
    assert result.logprobs.dtype == np.float32 and result.logprobs.tolist() == [-0.5, -1.5, -2.5]
    assert result.versions.dtype == np.int32 and result.versions.tolist() == [3, 4, 4]
    assert (result.finish_reason, result.request_id, result.gen_s) == ("stop", "q", 0.25)
    assert result.extra == {"cached_tokens": 3}


def test_filtered_sampling_records_the_support_normalised_logprobs() -> None:
    # what SGLang's sampling-mask test checks: log(p[token] / sum(p over the mask)), not output_token_logprobs
    support = [math.log(0.4 / 0.7), math.log(0.3 / 0.7)]
    answer = _answer([3, 4], output_token_sampling_mask=[[3, 4], [4, 3]], output_token_sampling_logprobs=support)
    params = SamplingParams(max_new_tokens=2, top_k=2)
    assert result_from_output(answer, params).logprobs.tolist() == pytest.approx(support)
    with pytest.raises(EngineContractError, match="needs output_token_sampling_logprobs"):
        result_from_output(_answer([3, 4]), params)
    outside = _answer([3, 4], output_token_sampling_mask=[[3], [3]], output_token_sampling_logprobs=support)
    with pytest.raises(EngineContractError, match="outside the sampling mask"):
        result_from_output(outside, params)
    support_mode = _answer([3, 4], output_token_sampling_logprobs=[[-0.1, -2.0], [-0.3, -1.0]])
    with pytest.raises(EngineContractError, match="scalar log-probs"):
        result_from_output(support_mode, params)


def test_greedy_records_zero_whatever_the_engine_reports() -> None:
    result = result_from_output(_answer([5, 6]), SamplingParams(max_new_tokens=2, temperature=0.0))
    assert result.logprobs.tolist() == [0.0, 0.0]


def test_abort_keeps_tokens_so_far_and_an_empty_abort_has_its_degenerate_span() -> None:
    aborted = _answer([5, 6], finish_reason={"type": "abort", "message": "Abort request", "status_code": 200})
    assert result_from_output(aborted, SamplingParams(max_new_tokens=9)).finish_reason == "abort"
    empty = result_from_output(
        _answer([], weight_versions=[{"version": "3", "start": 0, "end": 0}], finish_reason={"type": "abort"}),
        SamplingParams(max_new_tokens=9, top_p=0.5),
    )
    assert empty.finish_reason == "abort" and len(empty.token_ids) == len(empty.versions) == 0


@pytest.mark.parametrize(
    ("ids", "meta", "match"),
    [
        ([5, 2], {"finish_reason": {"type": "stop", "matched": "NaN happened"}}, "not on a stop token id"),
        ([5, 6], {"finish_reason": {"type": "stop", "matched": 2}}, "not the last returned token"),
        ([5, 9], {"finish_reason": {"type": "stop", "matched": 9}}, "not a requested stop id"),
        ([5], {"finish_reason": None}, "is not stop, length or abort"),
        ([5], {"output_token_logprobs": [(-0.1, 6, None)]}, "do not name the 1 returned tokens"),
        ([5, 6], {"weight_versions": [{"version": "3", "start": 0, "end": 1}]}, "cover 1 of 2"),
        ([5], {"weight_versions": [{"version": "default", "start": 0, "end": 1}]}, "'default' is not a policy"),
    ],
)
def test_answers_outside_the_contract_fail_the_request(ids: list[int], meta: dict, match: str) -> None:
    with pytest.raises(EngineContractError, match=match):
        result_from_output(_answer(ids, **meta), SamplingParams(max_new_tokens=4, stop_token_ids=(2,)))


def test_prefix_counts_come_from_cached_tokens() -> None:
    assert prefix_counts({"prompt_tokens": 10, "cached_tokens": 7}) == {
        "prefix_lookups": 1,
        "prefix_hits": 1,
        "prompt_tokens": 10,
        "prefilled_tokens": 3,
    }
    assert prefix_counts({"prompt_tokens": 4, "cached_tokens": 0})["prefix_hits"] == 0


def test_model_eos_ids_unite_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert model_eos_token_ids(tmp_path) == {2, 9}
    assert model_eos_token_ids(tmp_path / "absent") == frozenset()


# ---- weights -------------------------------------------------------------------------------------------------


class _Model(torch.nn.Module):
    """The one fake: an SGLang model's ``load_weights`` (HF names in, copied into the parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 2, bias=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)


def test_weight_update_plan_pauses_in_place_loads_labels_and_continues() -> None:
    pause, apply, resume = weight_update_plan(5, [b"rank0", b"rank1"])
    assert (pause.method, pause.request, pause.fields) == (
        "pause_generation",
        "PauseGenerationReqInput",
        {"mode": "in_place"},
    )
    load, label = apply
    assert (load.method, load.request) == ("update_weights_from_tensor", "UpdateWeightsFromTensorReqInput")
    assert load.fields == {
        "serialized_named_tensors": [b"rank0", b"rank1"],
        "load_format": LOADER_PATH,
        "flush_cache": False,
        "abort_all_requests": False,
    }
    assert (label.method, label.request) == ("update_weight_version", "UpdateWeightVersionReqInput")
    assert label.fields == {"new_version": "5", "abort_all_requests": False}
    assert (resume.method, resume.request, resume.fields) == ("continue_generation", "ContinueGenerationReqInput", {})


def test_loader_path_is_what_sglang_dynamic_import_resolves() -> None:
    module, _, attr = LOADER_PATH.rpartition(".")
    assert getattr(importlib.import_module(module), attr) is leeway_weight_loader
    args = server_args("/m", version=3, seed=1, dtype="bfloat16", tp_size=2, mem_fraction_static=0.5,
                       max_running_requests=None, context_length=None, sampling_mask_max_tokens=64)  # fmt: skip
    assert args["custom_weight_loader"] == [LOADER_PATH] and args["skip_tokenizer_init"] is True
    assert args["weight_version"] == "3" and args["sampling_mask_max_tokens"] == 64
    assert "max_running_requests" not in args
    with pytest.raises(ValueError, match="engine.sglang.extra.skip_tokenizer_init"):
        server_args("/m", version=0, seed=0, dtype="auto", tp_size=1, mem_fraction_static=None,
                    max_running_requests=None, context_length=None, sampling_mask_max_tokens=None,
                    extra={"skip_tokenizer_init": False})  # fmt: skip
    assert args["trust_remote_code"] is False  # a checkpoint's own code never runs, nor can extra turn it on
    with pytest.raises(ValueError, match="engine.sglang.extra.trust_remote_code"):
        server_args("/m", version=0, seed=0, dtype="auto", tp_size=1, mem_fraction_static=None,
                    max_running_requests=None, context_length=None, sampling_mask_max_tokens=None,
                    extra={"trust_remote_code": True})  # fmt: skip


def test_loader_writes_verified_tensors() -> None:
    model = _Model()
    new = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    leeway_weight_loader(model, with_expected_hashes({"proj.weight": new}))
    assert torch.equal(model.proj.weight.detach(), new)


def test_loader_refuses_a_changed_tensor_before_writing_anything() -> None:
    model = _Model()
    before = model.proj.weight.detach().clone()
    payload = with_expected_hashes({"proj.weight": torch.ones(2, 3)})
    assert payload[-1][0] == HASHES_ENTRY
    payload[0][1][0, 0] = 2.0  # a bit flipped between the store and the engine
    with pytest.raises(WeightHashMismatch, match="'proj.weight' arrived with sha256"):
        leeway_weight_loader(model, payload)
    with pytest.raises(WeightHashMismatch, match="without __leeway_sha256__"):
        leeway_weight_loader(model, payload[:-1])
    with pytest.raises(WeightHashMismatch, match="tensors and hashes differ"):
        leeway_weight_loader(model, [("extra.weight", torch.ones(1)), *with_expected_hashes({})])
    assert torch.equal(model.proj.weight.detach(), before)
    with pytest.raises(ValueError, match="reserved"):
        with_expected_hashes({HASHES_ENTRY: torch.ones(1)})
