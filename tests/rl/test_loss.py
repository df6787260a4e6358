"""Loss normalisation, and RL360's step 70: masked samples change neither baseline nor gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.rl.advantages import compute_advantages, valid_mask
from pipeline.rl.correction import corrected_token_loss
from pipeline.rl.loss import aggregate_loss

NUM_TOKENS = 5
VOCAB = 7
FEATURES = 3


def test_constant_normalisation_divides_by_the_fixed_token_budget() -> None:
    # trained tokens carry [1, 2]; the third is not trained -> (1 + 2) / 10
    loss = aggregate_loss(
        torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, True, False]), loss_norm="constant", constant_tokens=10
    )
    assert loss.item() == pytest.approx(0.3)


def test_token_mean_divides_by_the_number_of_trained_tokens() -> None:
    loss = aggregate_loss(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, True, False]), loss_norm="token_mean")
    assert loss.item() == pytest.approx(1.5)


def test_tokens_rejected_by_mis_do_not_count_in_token_mean() -> None:
    # rho = [1, 3, 1, 1] with C = 2: token 1 is masked; A = 1, logp = [0, ln 3, 0, 0]
    # trained losses [-0, -, -0, -0] -> grad of token_mean loss = -w * A / 3 (not / 4)
    logp = torch.tensor([0.0, float(np.log(3.0)), 0.0, 0.0], dtype=torch.float64, requires_grad=True)
    out = corrected_token_loss(
        logp,
        torch.zeros(4, dtype=torch.float64),
        torch.ones(4, dtype=torch.float64),
        torch.ones(4, dtype=torch.bool),
        staleness=torch.zeros(4, dtype=torch.long),
        method="mis",
    )
    aggregate_loss(out.token_loss, out.trained_mask, loss_norm="token_mean").backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-1 / 3, 0.0, -1 / 3, -1 / 3], dtype=torch.float64))


def test_token_mean_over_micro_batches_matches_the_whole_batch_when_given_the_step_count() -> None:
    token_loss = torch.tensor([1.0, 2.0, 3.0, 4.0])
    trained = torch.tensor([True, True, True, False])
    whole = aggregate_loss(token_loss, trained, loss_norm="token_mean")
    parts = sum(
        aggregate_loss(token_loss[s], trained[s], loss_norm="token_mean", num_trained_tokens=3)
        for s in (slice(0, 1), slice(1, 4))
    )
    assert float(parts) == pytest.approx(float(whole)) == pytest.approx(2.0)


def test_a_batch_with_nothing_to_train_gives_a_zero_loss_that_still_backpropagates() -> None:
    x = torch.ones(3, requires_grad=True)
    loss = aggregate_loss(x * 2, torch.zeros(3, dtype=torch.bool), loss_norm="token_mean")
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros(3))


def test_constant_normalisation_without_a_budget_names_the_config_field() -> None:
    with pytest.raises(ValueError, match="advantages.constant_tokens=None"):
        aggregate_loss(torch.ones(2), torch.ones(2, dtype=torch.bool), loss_norm="constant")


# --- step 70 ---------------------------------------------------------------------------------------


def _sample(reward: float | None, status: str = "ok", source: str = "verifier", seed: int = 0) -> dict:
    """One sample: a reward record and random per-token features, tokens and behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(NUM_TOKENS, generator=g, dtype=torch.float64) * 2
    return {
        "reward": reward,
        "status": status,
        "source": source,
        "features": torch.randn(NUM_TOKENS, FEATURES, generator=g, dtype=torch.float64),
        "tokens": torch.randint(VOCAB, (NUM_TOKENS,), generator=g),
        "behaviour_logp": mu,
        "token_mask": torch.tensor([0, 1, 1, 1, 1], dtype=torch.bool),  # first token is the prompt
    }


def _step(groups: list[list[dict]], weight: torch.Tensor, *, loss_norm: str) -> tuple[torch.Tensor, list[np.ndarray]]:
    """What the trainer does for one step: baselines per group, mask, correct, aggregate. Returns loss, advantages."""
    samples, advantages, valid = [], [], []
    for group in groups:
        group_valid = valid_mask(
            [s["reward"] for s in group], [s["status"] for s in group], [s["source"] for s in group]
        )
        adv, _ = compute_advantages([s["reward"] for s in group], group_valid)
        samples += group
        advantages.append(adv)
        valid.append(group_valid)
    features = torch.stack([s["features"] for s in samples])
    logp = torch.log_softmax(features @ weight, dim=-1).gather(
        -1, torch.stack([s["tokens"] for s in samples])[..., None]
    )[..., 0]
    # as `prepare_group` does: an invalid sample's loss mask is all zeros
    mask = torch.stack([s["token_mask"] for s in samples]) & torch.from_numpy(np.concatenate(valid))[:, None]
    adv_tokens = torch.from_numpy(np.concatenate(advantages))[:, None].expand(-1, NUM_TOKENS)
    out = corrected_token_loss(
        logp,
        torch.stack([s["behaviour_logp"] for s in samples]),
        adv_tokens,
        mask,
        staleness=torch.zeros_like(mask, dtype=torch.long),
        method="tis",
    )
    # budget: batch_groups (2) * group_size (4) * max_new_tokens (4), the same whatever failed; token_mean
    # divides by the minibatch's loss tokens, as `CorrectedObjective` does
    loss = aggregate_loss(
        out.token_loss,
        out.trained_mask,
        loss_norm=loss_norm,
        constant_tokens=2 * 4 * 4,
        num_trained_tokens=int(mask.sum()),
    )
    return loss, advantages


@pytest.mark.parametrize("loss_norm", ["constant", "token_mean"])
def test_step_70_masked_samples_change_neither_baseline_nor_gradient(loss_norm: str) -> None:
    # group A rewards [1, 0, 1, 1] -> baseline 3/4; group B [0, 1, 0, 0] -> baseline 1/4.
    # The failure burst adds to A an infra_error (no reward), an aborted sample scored 0 and a sample
    # whose reward no verifier wrote, plus a whole group of infra failures. RL360 counted such samples
    # at reward 0 in the baseline and in the denominator (x0.59 on the gradient, +0.31 on advantages).
    group_a = [_sample(1.0, seed=1), _sample(0.0, "format_error", seed=2), _sample(1.0, seed=3), _sample(1.0, seed=4)]
    group_b = [_sample(0.0, seed=5), _sample(1.0, "truncated", seed=6), _sample(0.0, seed=7), _sample(0.0, seed=8)]
    failures_in_a = [
        _sample(None, "infra_error", "none", seed=9),
        _sample(0.0, "aborted", seed=10),
        _sample(0.0, "ok", "none", seed=11),
    ]
    failed_group = [_sample(None, "infra_error", "none", seed=12 + i) for i in range(4)]

    weight_clean = torch.randn(FEATURES, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    weight_burst = weight_clean.detach().clone()
    weight_clean.requires_grad_(True)
    weight_burst.requires_grad_(True)

    loss_clean, adv_clean = _step([group_a, group_b], weight_clean, loss_norm=loss_norm)
    loss_burst, adv_burst = _step([group_a + failures_in_a, group_b, failed_group], weight_burst, loss_norm=loss_norm)
    loss_clean.backward()
    loss_burst.backward()

    np.testing.assert_allclose(adv_clean[0], [0.25, -0.75, 0.25, 0.25])
    np.testing.assert_array_equal(adv_burst[0][:4], adv_clean[0])  # same baseline
    np.testing.assert_array_equal(adv_burst[0][4:], [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(adv_burst[2], np.zeros(4))
    torch.testing.assert_close(loss_burst, loss_clean, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(weight_burst.grad, weight_clean.grad, rtol=1e-12, atol=0.0)
    assert weight_clean.grad.abs().sum() > 0


def test_step_70_counting_failures_as_wrong_answers_would_move_the_gradient() -> None:
    # the same burst scored as verifier zeros (RL360's behaviour): proves the test above can fail
    group_a = [_sample(1.0, seed=1), _sample(0.0, seed=2), _sample(1.0, seed=3), _sample(1.0, seed=4)]
    scored_as_zero = [_sample(0.0, seed=9), _sample(0.0, seed=10)]
    weights = [
        torch.randn(FEATURES, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_(
            True
        )
        for _ in range(2)
    ]
    _step([group_a], weights[0], loss_norm="token_mean")[0].backward()
    _step([group_a + scored_as_zero], weights[1], loss_norm="token_mean")[0].backward()
    assert not torch.allclose(weights[0].grad, weights[1].grad)
