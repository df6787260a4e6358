"""Schema v1 invariants of TrajectoryGroup: what from_samples accepts and the errors it names."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.wire.codec import encode_group
from pipeline.wire.headers import H_ROUTE_BYTES
from pipeline.wire.jetstream import DeadLetterError
from pipeline.wire.trajectories import decode_payload, group_headers
from pipeline.wire.trajectory import (
    Sample,
    TrajectoryGroup,
    TrajectoryValidationError,
    validate_group,
)


def _sample(prompt_len: int = 3, gen_len: int = 4, versions: tuple[int, ...] = (6, 6, 7, 7), **kw) -> Sample:
    n = prompt_len + gen_len
    mask = np.r_[np.zeros(prompt_len, np.uint8), np.ones(gen_len, np.uint8)]
    fields = dict(
        tokens=np.arange(100, 100 + n, dtype=np.int32),
        loss_mask=mask,
        logprobs=np.r_[np.zeros(prompt_len), -np.linspace(0.01, 2.3, gen_len)].astype(np.float32),
        versions=np.r_[np.full(prompt_len, -1), np.array(versions[:gen_len])].astype(np.int32),
        reward=1.0,
        reward_source="verifier",
        status="ok",
        finish_reason="stop",
        tags=("math",),
    )
    fields.update(kw)
    return Sample(**fields)


def _group(samples: list[Sample] | None = None, **kw) -> TrajectoryGroup:
    args = dict(group_id="g-1", prompt_id="p-1", generator_id="gen-0")
    args.update(kw)
    return TrajectoryGroup.from_samples(samples=samples if samples is not None else [_sample(), _sample()], **args)


def test_docstring_example_lines_up_tokens_masks_and_versions():
    g = _group([_sample()])
    assert g.offsets.tolist() == [0, 7]
    assert g.versions.tolist() == [-1, -1, -1, 6, 6, 7, 7]
    assert (g.min_version[0], g.max_version[0]) == (6, 7)
    assert (g.group_min_version, g.group_max_version) == (6, 7)
    assert g.trajectory_ids == ("g-1:0",)


def test_sample_round_trips_as_views():
    g = _group([_sample(), _sample(prompt_len=5, gen_len=2, reward=None, reward_source="none")])
    s = g.sample(1)
    assert len(s.tokens) == 7 and s.reward is None and s.reward_source == "none"
    assert np.shares_memory(s.tokens, g.tokens)


def test_sample_without_loss_tokens_has_version_range_minus_one():
    g = _group([_sample(gen_len=0), _sample()])
    assert g.min_version.tolist() == [-1, 6]
    assert g.group_min_version == 6


@pytest.mark.parametrize("column", ["loss_mask", "logprobs", "versions"])
def test_disagreeing_lengths_name_sample_and_column(column):
    bad = dataclasses.replace(_sample(), **{column: getattr(_sample(), column)[:-1]})
    with pytest.raises(TrajectoryValidationError) as info:
        _group([_sample(), bad])
    assert info.value.sample == 1 and info.value.column == column


def test_version_must_be_minus_one_exactly_where_mask_is_zero():
    s = _sample()
    v = s.versions.copy()
    v[0] = 3
    with pytest.raises(TrajectoryValidationError, match="non-loss token at position 0") as info:
        _group([dataclasses.replace(s, versions=v)])
    assert info.value.column == "versions"
    v = s.versions.copy()
    v[4] = -1
    with pytest.raises(TrajectoryValidationError, match="loss token at position 4"):
        _group([dataclasses.replace(s, versions=v)])


def test_reward_only_from_verifier():
    with pytest.raises(TrajectoryValidationError, match="reward_source is 'none'") as info:
        _group([_sample(reward=0.5, reward_source="none")])
    assert info.value.column == "reward"
    with pytest.raises(TrajectoryValidationError, match="missing"):
        _group([_sample(reward=None, reward_source="verifier")])


@pytest.mark.parametrize("field,value", [("status", "great"), ("reward_source", "judge")])
def test_enums_are_checked(field, value):
    with pytest.raises(TrajectoryValidationError) as info:
        _group([_sample(**{field: value})])
    assert info.value.column == field


def test_trajectory_ids_unique():
    with pytest.raises(TrajectoryValidationError, match="duplicate") as info:
        _group([_sample(trajectory_id="t"), _sample(trajectory_id="t")])
    assert info.value.sample == 1


@pytest.mark.parametrize("group_id", ["", "a/b", "../x", " x", "x" * 201])
def test_group_ids_are_safe_keys(group_id):
    with pytest.raises(TrajectoryValidationError):
        _group(group_id=group_id)


def test_bad_logprobs_and_masks_and_token_ids():
    s = _sample()
    lp = s.logprobs.copy()
    lp[5] = np.nan
    with pytest.raises(TrajectoryValidationError, match="log-prob"):
        _group([dataclasses.replace(s, logprobs=lp)])
    lp[5] = 0.5
    with pytest.raises(TrajectoryValidationError, match="log-prob"):
        _group([dataclasses.replace(s, logprobs=lp)])
    mask = s.loss_mask.copy()
    mask[0] = 2
    with pytest.raises(TrajectoryValidationError, match="0 or 1"):
        _group([dataclasses.replace(s, loss_mask=mask)])
    tok = s.tokens.copy()
    tok[1] = -5
    with pytest.raises(TrajectoryValidationError, match="negative token id"):
        _group([dataclasses.replace(s, tokens=tok)])


def test_lossy_dtypes_are_refused():
    with pytest.raises(TrajectoryValidationError, match="cannot be stored"):
        _group([_sample(tokens=np.arange(7, dtype=np.float64))])
    with pytest.raises(TrajectoryValidationError, match="out of range"):
        _group([_sample(tokens=np.full(7, 2**40, dtype=np.int64))])


def test_empty_group_is_refused():
    with pytest.raises(TrajectoryValidationError, match="at least one sample"):
        _group([])


def test_min_version_column_must_match_tokens():
    g = _group()
    tampered = dataclasses.replace(g, min_version=np.array([5, 6], dtype=np.int32))
    with pytest.raises(TrajectoryValidationError, match="disagrees") as info:
        validate_group(tampered)
    assert info.value.sample == 0 and info.value.column == "min_version"


def test_a_moe_groups_headers_carry_its_route_bytes_and_the_body_must_agree() -> None:
    n = 40
    routed = dataclasses.replace(
        _moe_free_sample(n),
        routes=np.random.default_rng(0).integers(0, 8, (n, 4, 2)).astype(np.uint8),
        route_versions=np.zeros(n, np.int32),
    )
    group = TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=[routed])
    headers, body = group_headers(group), encode_group(group)
    assert headers[H_ROUTE_BYTES] == "8"
    np.testing.assert_array_equal(decode_payload(headers, body).routes, routed.routes)
    without = {k: v for k, v in headers.items() if k != H_ROUTE_BYTES}
    with pytest.raises(DeadLetterError) as info:  # routes its headers do not announce
        decode_payload(without, body)
    assert info.value.reason in ("too_large", "header_mismatch")
    with pytest.raises(DeadLetterError) as info:
        decode_payload({**headers, H_ROUTE_BYTES: str(1 << 20)}, body)
    assert info.value.reason == "bad_headers"
    dense = TrajectoryGroup.from_samples(group_id="d", prompt_id="p", generator_id="x", samples=[_moe_free_sample(n)])
    assert H_ROUTE_BYTES not in group_headers(dense)


def _moe_free_sample(n: int) -> Sample:
    mask = np.r_[np.zeros(4, np.uint8), np.ones(n - 4, np.uint8)]
    return Sample(
        tokens=np.arange(n, dtype=np.int32),
        loss_mask=mask,
        logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
        versions=np.where(mask == 1, 0, -1).astype(np.int32),
        reward=1.0,
        reward_source="verifier",
    )
