"""Group preparation for a trainer step: cap, validity, advantages and the disagreement filter."""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeline.rl.batching import (
    DROP_CAP,
    DROP_FILTER,
    REFUSE_ROUTES,
    REFUSE_TOO_LONG,
    REFUSE_VOCAB,
    GroupPolicy,
    ModelLimits,
    check_model_limits,
    prepare_group,
)
from pipeline.rl.step_metrics import reward_metrics, sample_counts, staleness_metrics
from pipeline.wire.trajectory import Sample, TrajectoryGroup

POLICY = GroupPolicy(max_staleness=2)


def _sample(reward: float | None, *, version: int = 5, status: str = "ok", tags: tuple[str, ...] = ()) -> Sample:
    # prompt of 2 tokens (mask 0, version -1) then 3 generated tokens at `version`
    return Sample(
        tokens=np.array([1, 2, 3, 4, 5], dtype=np.int32),
        loss_mask=np.array([0, 0, 1, 1, 1], dtype=np.uint8),
        logprobs=np.array([0, 0, -0.5, -0.5, -0.5], dtype=np.float32),
        versions=np.array([-1, -1, version, version, version], dtype=np.int32),
        reward=reward,
        reward_source="verifier" if reward is not None else "none",
        status=status,
        tags=tags,
    )


def _group(*samples: Sample, group_id: str = "g1") -> TrajectoryGroup:
    return TrajectoryGroup.from_samples(group_id=group_id, prompt_id=group_id, generator_id="gen", samples=samples)


def test_disagreeing_group_trains_with_grpo_advantages() -> None:
    prepared = prepare_group(_group(_sample(1.0), _sample(0.0), _sample(0.5)), version=5, policy=POLICY)
    assert prepared.trainable and prepared.drop_reason is None
    # baseline = mean(1, 0, 0.5) = 0.5
    assert [s.advantage for s in prepared.samples] == [0.5, -0.5, 0.0]
    assert prepared.samples[0].loss_mask.tolist() == [0, 0, 1, 1, 1]


def test_agreeing_group_is_filtered() -> None:
    prepared = prepare_group(_group(_sample(1.0), _sample(1.0)), version=5, policy=POLICY)
    assert not prepared.trainable and prepared.drop_reason == DROP_FILTER and prepared.samples == []


def test_infra_error_is_masked_out_of_loss_and_baseline() -> None:
    group = _group(_sample(1.0), _sample(0.0), _sample(None, status="infra_error"))
    prepared = prepare_group(group, version=5, policy=POLICY)
    assert prepared.trainable
    assert [s.advantage for s in prepared.samples] == [0.5, -0.5, 0.0]  # baseline over the two valid samples
    assert prepared.samples[2].loss_mask.sum() == 0


def test_stale_sample_is_dropped_and_leaves_the_baseline() -> None:
    # trainer at 5, cap 2: version 2 has staleness 3
    group = _group(_sample(1.0), _sample(0.0), _sample(0.0, version=2))
    prepared = prepare_group(group, version=5, policy=POLICY)
    assert prepared.trainable
    assert prepared.kept_by_cap.tolist() == [True, True, False]
    assert [s.advantage for s in prepared.samples] == [0.5, -0.5, 0.0]
    assert prepared.samples[2].loss_mask.sum() == 0


def test_group_entirely_over_the_cap_is_dropped_by_cap() -> None:
    group = _group(_sample(1.0, version=1), _sample(0.0, version=1))
    prepared = prepare_group(group, version=5, policy=POLICY)
    assert not prepared.trainable and prepared.drop_reason == DROP_CAP


def test_cap_that_leaves_no_disagreement_counts_as_cap() -> None:
    group = _group(_sample(1.0), _sample(0.0, version=1))
    prepared = prepare_group(group, version=5, policy=POLICY)
    assert not prepared.trainable and prepared.drop_reason == DROP_CAP


def test_no_cap_in_replay_keeps_old_tokens() -> None:
    group = _group(_sample(1.0, version=1), _sample(0.0, version=1))
    prepared = prepare_group(group, version=50, policy=GroupPolicy(max_staleness=None))
    assert prepared.trainable


def test_reward_metrics_are_before_the_filter() -> None:
    trained = prepare_group(_group(_sample(1.0, tags=("a",)), _sample(0.0)), version=5, policy=POLICY)
    filtered = prepare_group(_group(_sample(1.0), _sample(1.0), group_id="g2"), version=5, policy=POLICY)
    failed = prepare_group(
        _group(_sample(None, status="infra_error"), _sample(0.0), group_id="g3"), version=5, policy=POLICY
    )
    metrics = reward_metrics([trained, filtered, failed])
    assert metrics["reward/unfiltered_mean"] == (1 + 0 + 1 + 1 + 0) / 5
    assert metrics["reward/kept_mean"] == 0.5
    assert metrics["reward/tag/a"] == 1.0
    assert metrics["infra/failure_rate"] == 1 / 6
    counts = sample_counts([trained, filtered, failed])
    assert counts == {
        "samples/trained": 2,
        "samples/masked": 0,
        "samples/dropped_by_cap": 0,
        "samples/dropped_by_filter": 4,
    }


def test_staleness_metrics_count_loss_tokens() -> None:
    prepared = prepare_group(_group(_sample(1.0, version=4), _sample(0.0, version=5)), version=5, policy=POLICY)
    metrics = staleness_metrics([prepared], 5)
    assert metrics["staleness/min"] == 0 and metrics["staleness/max"] == 1
    assert metrics["staleness/mean"] == 0.5
    assert metrics["staleness/hist"] == {"0": 3, "1": 3}


def _with_tokens(tokens: list[int]) -> Sample:
    n = len(tokens)
    return Sample(
        tokens=np.array(tokens, dtype=np.int32),
        loss_mask=np.r_[np.zeros(2, np.uint8), np.ones(n - 2, np.uint8)],
        logprobs=np.r_[np.zeros(2, np.float32), np.full(n - 2, -0.5, np.float32)],
        versions=np.r_[np.full(2, -1, np.int32), np.full(n - 2, 5, np.int32)],
        reward=1.0,
        reward_source="verifier",
        status="ok",
    )


def test_the_door_refuses_token_ids_past_the_vocabulary_naming_sample_and_value() -> None:
    limits = ModelLimits(vocab_size=21, max_positions=8)
    assert check_model_limits(_group(_sample(1.0), _with_tokens([1, 2, 20, 3])), limits) is None
    refusal = check_model_limits(_group(_sample(1.0), _with_tokens([1, 2, 3, 21, 4])), limits)
    assert refusal is not None and refusal.reason == REFUSE_VOCAB
    assert "sample 1" in refusal.detail and "token id 21 at position 3" in refusal.detail and "21" in refusal.detail


def test_the_door_refuses_samples_longer_than_the_context() -> None:
    limits = ModelLimits(vocab_size=21, max_positions=8)
    assert check_model_limits(_group(_with_tokens([1] * 8)), limits) is None
    refusal = check_model_limits(_group(_sample(0.0), _with_tokens([1] * 9)), limits)
    assert refusal is not None and refusal.reason == REFUSE_TOO_LONG
    assert "sample 1" in refusal.detail and "9 tokens > the model's context of 8" in refusal.detail
    assert check_model_limits(_group(_with_tokens([1] * 9)), ModelLimits(vocab_size=21, max_positions=None)) is None


def _routed(sample: Sample, top: int) -> Sample:
    n = len(sample.tokens)
    routes = np.arange(n * 2 * 2).reshape(n, 2, 2) % top
    return dataclasses.replace(
        sample, routes=routes.astype(np.uint8), route_versions=np.r_[np.full(n - 1, 5), -1].astype(np.int32)
    )


def test_a_moe_groups_routes_reach_its_train_sequences_and_the_door_checks_their_layout() -> None:
    group = _group(_routed(_sample(1.0), 8), _routed(_sample(0.0), 8))
    prepared = prepare_group(group, version=5, policy=POLICY)
    assert prepared.trainable
    for i, seq in enumerate(prepared.samples):
        np.testing.assert_array_equal(seq.routes, group.routes[group.token_slice(i)])
        assert seq.route_versions.tolist() == [5, 5, 5, 5, -1]
    limits = ModelLimits(vocab_size=100, max_positions=None, routes=(2, 2, 8))
    assert check_model_limits(group, limits) is None
    other_layout = check_model_limits(group, ModelLimits(vocab_size=100, max_positions=None, routes=(3, 2, 8)))
    assert other_layout is not None and other_layout.reason == REFUSE_ROUTES
    dense = check_model_limits(group, ModelLimits(vocab_size=100, max_positions=None))
    assert dense is not None and dense.reason == REFUSE_ROUTES and "dense" in dense.detail
    past = check_model_limits(_group(_sample(1.0), _routed(_sample(0.0), 12)), limits)
    assert (
        past is not None and past.reason == REFUSE_ROUTES and "sample 1" in past.detail and "8 experts" in past.detail
    )
    assert check_model_limits(_group(_sample(1.0)), limits) is None  # a dense group for a MoE model: nothing to replay
