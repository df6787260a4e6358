"""Group advantages: who counts in the baseline, GRPO vs RLOO, when a group trains."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.rl.advantages import compute_advantages, is_valid_sample, valid_mask


def _group(*samples: tuple[float | None, str, str]) -> tuple[list[float | None], np.ndarray]:
    """(reward, status, reward_source) per sample -> (rewards, valid)."""
    rewards = [r for r, _, _ in samples]
    return rewards, valid_mask(rewards, [s for _, s, _ in samples], [src for _, _, src in samples])


def test_infra_failures_and_missing_rewards_stay_out_of_the_baseline() -> None:
    # rewards [1, 0, None, 1]; the None is an infra_error -> valid [T, T, F, T]
    # baseline = (1 + 0 + 1) / 3 = 2/3 -> advantages [1/3, -2/3, 0, 1/3]
    rewards, valid = _group(
        (1.0, "ok", "verifier"),
        (0.0, "format_error", "verifier"),
        (None, "infra_error", "none"),
        (1.0, "truncated", "verifier"),
    )
    assert valid.tolist() == [True, True, False, True]
    adv, trainable = compute_advantages(rewards, valid)
    assert trainable
    np.testing.assert_allclose(adv, [1 / 3, -2 / 3, 0.0, 1 / 3])


def test_an_invalid_sample_with_a_zero_reward_does_not_drag_the_baseline() -> None:
    # aborted with reward 0 is still invalid: baseline over [1, 0, 1] only = 2/3, not (1+0+1+0)/4 = 1/2
    rewards, valid = _group(
        (1.0, "ok", "verifier"), (0.0, "ok", "verifier"), (0.0, "aborted", "verifier"), (1.0, "ok", "verifier")
    )
    adv, _ = compute_advantages(rewards, valid)
    np.testing.assert_allclose(adv, [1 / 3, -2 / 3, 0.0, 1 / 3])


def test_a_reward_not_written_by_a_verifier_is_not_trusted() -> None:
    assert not is_valid_sample(status="ok", reward_source="none", reward=0.0)
    assert is_valid_sample(status="format_error", reward_source="verifier", reward=0.0)
    assert is_valid_sample(status="truncated", reward_source="verifier", reward=0.0)
    assert not is_valid_sample(status="ok", reward_source="verifier", reward=None)


def test_unknown_status_and_non_finite_verifier_reward_are_rejected() -> None:
    with pytest.raises(ValueError, match="status='timeout'"):
        is_valid_sample(status="timeout", reward_source="verifier", reward=1.0)
    with pytest.raises(ValueError, match="not finite"):
        is_valid_sample(status="ok", reward_source="verifier", reward=float("nan"))


def test_rloo_baseline_is_the_mean_of_the_other_valid_samples() -> None:
    # valid rewards [1, 0, 1] (sample 2 invalid):
    #   sample 0: baseline (0 + 1) / 2 = 1/2 -> +1/2 ; sample 1: (1 + 1) / 2 = 1 -> -1 ; sample 3: +1/2
    rewards, valid = [1.0, 0.0, 0.0, 1.0], np.array([True, True, False, True])
    adv, trainable = compute_advantages(rewards, valid, estimator="rloo")
    assert trainable
    np.testing.assert_allclose(adv, [0.5, -1.0, 0.0, 0.5])


def test_group_whose_valid_samples_agree_does_not_train() -> None:
    # the only disagreeing reward (0) belongs to an infra failure
    adv, trainable = compute_advantages([1.0, 0.0, 1.0], [True, False, True])
    assert not trainable
    np.testing.assert_array_equal(adv, [0.0, 0.0, 0.0])


def test_group_with_fewer_than_two_valid_samples_does_not_train() -> None:
    adv, trainable = compute_advantages([1.0, None, None], [True, False, False], estimator="rloo")
    assert not trainable
    np.testing.assert_array_equal(adv, [0.0, 0.0, 0.0])


def test_std_normalisation_uses_the_valid_samples_only() -> None:
    # valid [1, 0, 1, 0]: mean 1/2, population std 1/2 -> advantages +-1 ; the invalid 5.0 is ignored
    adv, _ = compute_advantages([1.0, 0.0, 5.0, 1.0, 0.0], [True, True, False, True, True], std_normalize=True)
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 1.0, -1.0], rtol=1e-5)


def test_valid_sample_without_a_reward_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="sample 1 is marked valid"):
        compute_advantages([1.0, None], [True, True])
