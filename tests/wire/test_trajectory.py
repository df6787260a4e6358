"""Schema v1 invariants of TrajectoryGroup: what from_samples accepts and the errors it names."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

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
