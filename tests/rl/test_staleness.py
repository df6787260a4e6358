"""The staleness cap policies and the staleness stats, on tiny hand-made version arrays."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.rl.staleness import (
    admissible_prompts,
    apply_staleness_cap,
    crosses_cap,
    decay_weight,
    staleness_stats,
    sync_floor,
)


def _sample(versions: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Versions with -1 on prompt/tool tokens; the loss mask is where a version is set."""
    v = np.array(versions, dtype=np.int32)
    return v, (v >= 0).astype(np.uint8)


def _batch(*samples: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    pairs = [_sample(s) for s in samples]
    return [v for v, _ in pairs], [m for _, m in pairs]


def test_drop_trajectory_drops_a_sample_with_any_token_over_the_cap() -> None:
    # V = 5, K = 2: sample 0 staleness [3, 2, 2, 1] -> token 0 over the cap -> dropped (4 tokens removed)
    #               sample 1 staleness [1, 0]       -> kept untouched
    versions, masks = _batch([-1, -1, 2, 3, 3, -1, 4], [-1, 4, 5])
    d = apply_staleness_cap(versions, masks, current_version=5, max_staleness=2, policy="drop_trajectory")
    assert d.keep.tolist() == [False, True]
    assert not d.loss_masks[0].any()
    np.testing.assert_array_equal(d.loss_masks[1], masks[1].astype(bool))
    assert (d.num_dropped, d.num_stale_tokens, d.num_removed_tokens) == (1, 1, 4)
    assert d.frac_dropped == 0.5


def test_mask_tokens_zeroes_only_the_stale_tokens() -> None:
    versions, masks = _batch([-1, -1, 2, 3, 3, -1, 4])
    d = apply_staleness_cap(versions, masks, current_version=5, max_staleness=2, policy="mask_tokens")
    assert d.keep.tolist() == [True]
    assert d.loss_masks[0].astype(int).tolist() == [0, 0, 0, 1, 1, 0, 1]
    assert (d.num_dropped, d.num_stale_tokens, d.num_removed_tokens) == (0, 1, 1)


def test_a_sample_whose_loss_tokens_are_all_stale_counts_as_dropped_under_mask_tokens() -> None:
    versions, masks = _batch([-1, 0, 1], [-1, 5])
    d = apply_staleness_cap(versions, masks, current_version=5, max_staleness=1, policy="mask_tokens")
    assert d.keep.tolist() == [False, True]
    assert d.num_dropped == 1


def test_a_sample_without_loss_tokens_is_not_counted_as_dropped_by_the_cap() -> None:
    versions, masks = _batch([-1, -1])
    d = apply_staleness_cap(versions, masks, current_version=9, max_staleness=0, policy="drop_trajectory")
    assert d.keep.tolist() == [True] and d.num_dropped == 0


def test_tokens_at_exactly_the_cap_are_trained() -> None:
    versions, masks = _batch([3, 3])
    for policy in ("drop_trajectory", "mask_tokens"):
        d = apply_staleness_cap(versions, masks, current_version=5, max_staleness=2, policy=policy)
        assert d.keep.tolist() == [True] and d.num_removed_tokens == 0


def test_a_loss_token_without_a_version_or_from_the_future_is_an_error() -> None:
    with pytest.raises(ValueError, match="sample 0: a loss token has version -1"):
        apply_staleness_cap([np.array([-1, 2])], [np.array([1, 1])], current_version=3, max_staleness=1)
    with pytest.raises(ValueError, match="token version 4 is newer than the trainer's version 3"):
        apply_staleness_cap([np.array([4])], [np.array([1])], current_version=3, max_staleness=1)
    with pytest.raises(ValueError, match="staleness.policy='keep'"):
        apply_staleness_cap(
            [np.array([1])],
            [np.array([1])],
            current_version=3,
            max_staleness=1,
            policy="keep",  # type: ignore[arg-type]
        )


def test_staleness_stats_cover_loss_tokens_only() -> None:
    # V = 5: sample 0 loss versions [2, 3, 3, 4] -> staleness [3, 2, 2, 1], spans 4 - 2 + 1 = 3 versions
    #        sample 1 loss versions [5]          -> staleness [0], spans 1 ; sample 2 has no loss tokens
    versions, masks = _batch([-1, -1, 2, 3, 3, -1, 4], [-1, 5], [-1])
    s = staleness_stats(versions, masks, current_version=5)
    assert (s.min, s.max, s.num_tokens) == (0, 3, 5)
    assert s.mean == pytest.approx(8 / 5)
    assert s.histogram == {0: 1, 1: 1, 2: 2, 3: 1}
    assert s.versions_spanned.tolist() == [3, 1, 0]


def test_staleness_stats_of_an_empty_batch_are_none() -> None:
    s = staleness_stats([], [], current_version=0)
    assert (s.min, s.mean, s.max, s.histogram, s.num_tokens) == (None, None, None, {}, 0)


# ---- admission, the path the trainer takes (`admissible_prompts` from its counters) -------------------


def test_admission_allows_k_plus_one_steps_of_groups_at_the_start() -> None:
    assert admissible_prompts(steps=0, max_staleness=2, batch_groups=4, outstanding=0, trained=0) == 12
    assert admissible_prompts(steps=0, max_staleness=0, batch_groups=4, outstanding=4, trained=0) == 0


def test_a_discarded_group_returns_its_admission_slot() -> None:
    # 12 admitted, 4 consumed in a step: 3 trained, 1 filtered. The filtered one is neither outstanding
    # nor trained, so one more prompt may enter besides the step's batch_groups.
    after_step = admissible_prompts(steps=1, max_staleness=2, batch_groups=4, outstanding=8, trained=3)
    assert after_step == 16 - 8 - 3 == 5


def test_admission_never_goes_negative_and_names_bad_counts() -> None:
    assert admissible_prompts(steps=0, max_staleness=0, batch_groups=1, outstanding=5, trained=0) == 0
    with pytest.raises(ValueError, match="outstanding"):
        admissible_prompts(steps=0, max_staleness=0, batch_groups=1, outstanding=-1, trained=0)
    with pytest.raises(ValueError, match="trainer.batch_groups"):
        admissible_prompts(steps=0, max_staleness=0, batch_groups=0, outstanding=0, trained=0)


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_admission_keeps_in_order_consumption_inside_the_cap(max_staleness: int) -> None:
    """Simulate the loop: admit at V with the trainer's counters, consume FIFO, one version per step."""
    batch, queue, trained, version = 4, [], 0, 0
    for _ in range(30):
        count = admissible_prompts(
            steps=version, max_staleness=max_staleness, batch_groups=batch, outstanding=len(queue), trained=trained
        )
        queue.extend([version] * count)
        step, queue = queue[:batch], queue[batch:]
        assert max(version - admitted_at for admitted_at in step) <= max_staleness
        trained += len(step)
        version += 1


def test_sync_floor_and_abort_rule() -> None:
    assert sync_floor(newest_known=7, max_staleness=2, policy_versions=[3, 8]) == 6
    assert sync_floor(newest_known=-1, max_staleness=0, policy_versions=[-1]) == 0
    assert sync_floor(newest_known=4, max_staleness=0, policy_versions=[]) == 4
    assert not crosses_cap(start_version=3, newest_known=5, max_staleness=2)
    assert crosses_cap(start_version=3, newest_known=6, max_staleness=2)


def test_decay_weight_is_gamma_to_the_staleness() -> None:
    np.testing.assert_allclose(decay_weight(np.array([0.0, 1.0, 3.0]), 0.5), [1.0, 0.5, 0.125])
