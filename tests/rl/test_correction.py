"""Importance correction: each method against numbers worked out by hand on tiny tensors.

Log-probs are built as logs of chosen ratios so every ``rho`` below is exact by construction:
``behaviour_logp = 0`` and ``logp = log(rho)`` unless a test says otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.rl.correction import corrected_token_loss, importance_ratio

LN = math.log


def _t(values: list[float] | list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _leaf(values: list[float] | list[list[float]]) -> torch.Tensor:
    return _t(values).requires_grad_(True)


def _grad_of_sum(token_loss: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(token_loss.sum(), logp)
    return grad


def test_tis_truncates_the_weight_at_c_and_keeps_every_token() -> None:
    # rho = [1, 3, 0.6], C = 2 -> weight [1, 2, 0.6]; loss = -w * A * logp -> d/dlogp = -w * A
    logp, mu = _leaf([0.0, LN(3), LN(0.6)]), _t([0.0, 0.0, 0.0])
    adv = _t([1.0, 1.0, -1.0])
    out = corrected_token_loss(
        logp,
        mu,
        adv,
        torch.ones(3, dtype=torch.bool),
        staleness=torch.zeros(3, dtype=torch.long),
        method="tis",
        clip_c=2.0,
    )
    torch.testing.assert_close(out.weights, _t([1.0, 2.0, 0.6]))
    torch.testing.assert_close(_grad_of_sum(out.token_loss, logp), _t([-1.0, -2.0, 0.6]))
    assert out.trained_mask.all()
    s = out.stats
    assert s["frac_truncated"] == pytest.approx(1 / 3) and s["frac_masked"] == 0.0
    assert (s["rho_max"], s["weight_max"], s["weight_min"]) == pytest.approx((3.0, 2.0, 0.6))
    # ESS = (1 + 2 + 0.6)^2 / (1 + 4 + 0.36) / 3 = 12.96 / 5.36 / 3
    assert s["ess"] == pytest.approx(12.96 / 5.36 / 3)


def test_mis_masks_tokens_outside_the_ratio_band_out_of_the_trained_set() -> None:
    # rho = [1, 3, 0.6, 0.25], C = 2 -> band [0.5, 2]: tokens 1 (too high) and 3 (too low) are masked.
    # Kept tokens are weighted by rho: w = [1, 0, 0.6, 0]; d/dlogp = -w * A.
    logp, mu = _leaf([0.0, LN(3), LN(0.6), LN(0.25)]), _t([0.0] * 4)
    adv = _t([1.0, 1.0, 1.0, 1.0])
    out = corrected_token_loss(
        logp,
        mu,
        adv,
        torch.ones(4, dtype=torch.bool),
        staleness=torch.zeros(4, dtype=torch.long),
        method="mis",
        clip_c=2.0,
    )
    assert out.trained_mask.tolist() == [True, False, True, False]
    torch.testing.assert_close(out.weights, _t([1.0, 0.0, 0.6, 0.0]))
    torch.testing.assert_close(_grad_of_sum(out.token_loss, logp), _t([-1.0, 0.0, -0.6, 0.0]))
    assert out.stats["frac_masked"] == pytest.approx(0.5)
    assert out.stats["num_trained_tokens"] == 2.0 and out.stats["num_loss_tokens"] == 4.0
    # both tails of the raw ratio are visible even though neither tail was trained
    assert (out.stats["rho_min"], out.stats["rho_max"]) == pytest.approx((0.25, 3.0))


def test_decoupled_ppo_clips_pi_over_prox_with_separate_eps_and_truncates_prox_over_mu() -> None:
    # behaviour weight b = min(prox/mu, 2): prox/mu = [3, 0.5, 1, 1, 1] -> b = [2, 0.5, 1, 1, 1]
    # r = pi/prox = [1.5, 1.25, 0.7, 0.75, 1.2], A = [1, 1, 1, -1, -1], eps_low 0.2, eps_high 0.28:
    #   t0: r A = 1.5  vs clip 1.28 * 1  -> clipped, obj 1.28, no gradient
    #   t1: r A = 1.25 vs clip 1.25      -> inside (a symmetric 0.2 would have clipped), grad -b A r = -0.625
    #   t2: r A = 0.7  vs clip 0.8       -> min is the unclipped 0.7, grad -0.7
    #   t3: r A = -0.75 vs clip -0.8     -> clipped at 1 - eps_low, obj -0.8, no gradient
    #   t4: r A = -1.2 inside the range  -> grad -b A r = +1.2
    mu = _t([0.0] * 5)
    prox = _t([LN(3), LN(0.5), 0.0, 0.0, 0.0])
    logp = (prox + _t([LN(1.5), LN(1.25), LN(0.7), LN(0.75), LN(1.2)])).detach().requires_grad_(True)
    adv = _t([1.0, 1.0, 1.0, -1.0, -1.0])
    out = corrected_token_loss(
        logp,
        mu,
        adv,
        torch.ones(5, dtype=torch.bool),
        staleness=torch.ones(5, dtype=torch.long),
        method="decoupled_ppo",
        proximal_logp=prox,
        clip_c=2.0,
        ppo_eps_low=0.2,
        ppo_eps_high=0.28,
    )
    torch.testing.assert_close(out.weights, _t([2.0, 0.5, 1.0, 1.0, 1.0]))
    torch.testing.assert_close(out.token_loss.detach(), _t([-2 * 1.28, -0.5 * 1.25, -0.7, 0.8, 1.2]))
    torch.testing.assert_close(_grad_of_sum(out.token_loss, logp), _t([0.0, -0.625, -0.7, 0.0, 1.2]))
    assert out.stats["ppo_clip_frac"] == pytest.approx(2 / 5)
    assert out.stats["frac_truncated"] == pytest.approx(1 / 5)


def test_decoupled_ppo_without_a_proximal_equals_tis_weighted_reinforce_on_the_first_update() -> None:
    # pi_prox = pi_theta (one update per step): r = 1 unclipped, gradient = -min(pi/mu, C) * A
    logp, mu, adv = _leaf([LN(3), LN(0.6)]), _t([0.0, 0.0]), _t([1.0, -2.0])
    out = corrected_token_loss(
        logp,
        mu,
        adv,
        torch.ones(2, dtype=torch.bool),
        staleness=torch.zeros(2, dtype=torch.long),
        method="decoupled_ppo",
    )
    torch.testing.assert_close(_grad_of_sum(out.token_loss, logp), _t([-2.0, 1.2]))


def test_none_is_plain_reinforce_whatever_the_ratio() -> None:
    logp, mu, adv = _leaf([LN(3), LN(0.1)]), _t([0.0, 0.0]), _t([0.5, -1.0])
    out = corrected_token_loss(
        logp, mu, adv, torch.ones(2, dtype=torch.bool), staleness=torch.zeros(2, dtype=torch.long), method="none"
    )
    torch.testing.assert_close(_grad_of_sum(out.token_loss, logp), _t([-0.5, 1.0]))
    torch.testing.assert_close(out.weights, _t([1.0, 1.0]))
    assert out.stats["rho_max"] == pytest.approx(3.0)  # still reported, for comparison


def test_sequence_level_ratio_is_the_geometric_mean_over_the_sample_loss_tokens() -> None:
    # sample 0: log rho over loss tokens [ln 2, ln 8] -> mean ln 4 -> rho 4 (C = 2 truncates to 2)
    # sample 1: [ln 0.5, ln 2] -> mean 0 -> rho 1. The third token of each row is a prompt token whose
    # behaviour log-prob is NaN: it must not touch the mean.
    logp = _leaf([[LN(2), LN(8), 0.0], [LN(0.5), LN(2), 0.0]])
    mu = _t([[0.0, 0.0, float("nan")], [0.0, 0.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    torch.testing.assert_close(
        importance_ratio(logp, mu, mask, level="sequence"), _t([[4.0, 4.0, 1.0], [1.0, 1.0, 1.0]])
    )
    out = corrected_token_loss(
        logp,
        mu,
        torch.ones(2, 3, dtype=torch.float64),
        mask,
        staleness=torch.zeros(2, 3, dtype=torch.long),
        method="tis",
        level="sequence",
    )
    torch.testing.assert_close(out.weights, _t([[2.0, 2.0, 0.0], [1.0, 1.0, 0.0]]))
    assert out.stats["frac_truncated"] == pytest.approx(0.5)


def test_sequence_level_mis_masks_a_whole_sample() -> None:
    # sample 0 geometric mean 4 > C -> both its tokens leave the trained set; sample 1 (rho 1) stays
    logp = _leaf([[LN(2), LN(8)], [LN(0.5), LN(2)]])
    out = corrected_token_loss(
        logp,
        torch.zeros(2, 2, dtype=torch.float64),
        torch.ones(2, 2, dtype=torch.float64),
        torch.ones(2, 2, dtype=torch.bool),
        staleness=torch.zeros(2, 2, dtype=torch.long),
        method="mis",
        level="sequence",
    )
    assert out.trained_mask.tolist() == [[False, False], [True, True]]


def test_staleness_decay_multiplies_the_weight_by_gamma_to_the_staleness() -> None:
    # rho = 1, staleness [0, 1, 2], gamma 0.5 -> w = [1, 0.5, 0.25]; A = 1 -> grad = -w
    logp = _leaf([0.0, 0.0, 0.0])
    out = corrected_token_loss(
        logp,
        _t([0.0] * 3),
        _t([1.0] * 3),
        torch.ones(3, dtype=torch.bool),
        staleness=torch.tensor([0, 1, 2]),
        method="tis",
        staleness_decay=0.5,
    )
    torch.testing.assert_close(out.weights, _t([1.0, 0.5, 0.25]))
    torch.testing.assert_close(_grad_of_sum(out.token_loss, logp), _t([-1.0, -0.5, -0.25]))


def test_logp_gap_is_measured_on_fresh_loss_tokens_only() -> None:
    # |log pi - log mu| = [0.1, 0.3, 2.0, 5.0]; staleness [0, 0, 3, 0]; token 3 is not a loss token
    # -> mean over tokens 0 and 1 = 0.2
    logp = _leaf([0.1, -0.3, 2.0, 5.0])
    mask = torch.tensor([True, True, True, False])
    out = corrected_token_loss(logp, _t([0.0] * 4), _t([1.0] * 4), mask, staleness=torch.tensor([0, 0, 3, 0]))
    assert out.stats["logp_gap_fresh"] == pytest.approx(0.2)
    assert out.stats["num_fresh_tokens"] == 2.0


def test_tokens_outside_the_loss_mask_never_reach_loss_stats_or_gradient() -> None:
    # the masked token has a NaN behaviour log-prob and a huge advantage: nothing of it may leak
    logp = _leaf([0.0, LN(3)])
    mu, adv = _t([0.0, float("nan")]), _t([1.0, 1e9])
    mask = torch.tensor([True, False])
    for method in ("tis", "mis", "decoupled_ppo", "none"):
        out = corrected_token_loss(
            logp, mu, adv, mask, staleness=torch.tensor([0, 99]), method=method, staleness_decay=0.9
        )
        grad = _grad_of_sum(out.token_loss, logp)
        torch.testing.assert_close(grad, _t([-1.0, 0.0]))
        assert out.stats["weight_mean"] == 1.0 and out.stats["rho_max"] == 1.0, method


def test_empty_loss_mask_gives_zero_loss_and_nan_ratio_stats() -> None:
    logp = _leaf([0.0, 0.0])
    out = corrected_token_loss(
        logp,
        _t([0.0, 0.0]),
        _t([1.0, 1.0]),
        torch.zeros(2, dtype=torch.bool),
        staleness=torch.zeros(2, dtype=torch.long),
    )
    assert out.token_loss.sum().item() == 0.0
    assert math.isnan(out.stats["rho_mean"]) and out.stats["num_loss_tokens"] == 0.0


def test_bad_config_values_name_the_field() -> None:
    args = (_leaf([0.0]), _t([0.0]), _t([1.0]), torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="correction.method='ppo'"):
        corrected_token_loss(*args, staleness=torch.zeros(1, dtype=torch.long), method="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="correction.clip_c=0.5"):
        corrected_token_loss(*args, staleness=torch.zeros(1, dtype=torch.long), clip_c=0.5)
    with pytest.raises(ValueError, match="correction.staleness_decay=1.5"):
        corrected_token_loss(*args, staleness=torch.zeros(1, dtype=torch.long), staleness_decay=1.5)
    with pytest.raises(ValueError, match="staleness has shape"):
        corrected_token_loss(*args, staleness=torch.zeros(2, dtype=torch.long))
