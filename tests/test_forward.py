"""Forward-process objectives (ddpo_group/algos/forward.py) against computations written here."""

import pytest
import torch

from ddpo_group.algos.forward import matching_log_prob, nft_loss, nft_optimality, weighted_error


def test_nft_loss_equals_the_papers_formula_on_hand_made_tensors():
    prediction = torch.tensor([[1.0, 2.0], [0.0, -1.0]], dtype=torch.float64)
    old = torch.tensor([[0.5, 1.0], [0.0, 1.0]], dtype=torch.float64)
    target = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    r = torch.tensor([0.75, 0.25], dtype=torch.float64)
    beta = 0.5
    expected = []
    for i in range(2):
        plus = [beta * p + (1 - beta) * o for p, o in zip(prediction[i].tolist(), old[i].tolist())]
        minus = [(1 + beta) * o - beta * p for p, o in zip(prediction[i].tolist(), old[i].tolist())]
        plus_err = sum((a - v) ** 2 for a, v in zip(plus, target[i].tolist())) / 2
        minus_err = sum((a - v) ** 2 for a, v in zip(minus, target[i].tolist())) / 2
        expected.append((r[i].item() * plus_err + (1 - r[i].item()) * minus_err) / beta)
    torch.testing.assert_close(nft_loss(prediction, old, target, r, beta), torch.tensor(expected, dtype=torch.float64))


def _gradient(prediction, old, target, r, beta):
    prediction = prediction.clone().requires_grad_(True)
    nft_loss(prediction, old, target, r, beta).sum().backward()
    return prediction.grad


def test_without_signal_the_gradient_vanishes_at_the_old_policy_and_pulls_back_elsewhere():
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(3, 4, 2, generator=generator, dtype=torch.float64)
    target = torch.randn(3, 4, 2, generator=generator, dtype=torch.float64)
    half = torch.full((3,), 0.5, dtype=torch.float64)
    beta = 0.3
    # exactly 0 in exact arithmetic; in float64, beta * p + (1 - beta) * p rounds to p within a few ulp (~1e-16)
    torch.testing.assert_close(_gradient(old, old, target, half, beta), torch.zeros_like(old), rtol=0, atol=1e-15)
    # elsewhere: L = (||e||^2 + beta^2 ||d||^2) / (beta D), so dL/dprediction = 2 beta d / D (D = 8 dims)
    prediction = old + torch.randn(3, 4, 2, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(_gradient(prediction, old, target, half, beta), 2 * beta * (prediction - old) / 8)


def test_at_the_old_policy_positives_pull_towards_the_target_and_negatives_push_away():
    generator = torch.Generator().manual_seed(1)
    old = torch.randn(2, 5, generator=generator, dtype=torch.float64)
    target = torch.randn(2, 5, generator=generator, dtype=torch.float64)
    r = torch.tensor([1.0, 0.0], dtype=torch.float64)
    # gradient at d = 0: 2 (2r - 1) (v_old - v) / D
    expected = 2 * (2 * r[:, None] - 1) * (old - target) / 5
    torch.testing.assert_close(_gradient(old, old, target, r, 0.7), expected)


def test_optimality_maps_clipped_advantages_to_zero_one():
    advantages = torch.tensor([-7.0, -5.0, 0.0, 2.5, 5.0, 9.0])
    assert nft_optimality(advantages, 5.0).tolist() == [0.0, 0.0, 0.5, 0.75, 1.0, 1.0]
    with pytest.raises(ValueError, match="adv_clip_max"):
        nft_optimality(advantages, 0.0)


def test_nft_refuses_a_beta_outside_zero_one():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="beta"):
        nft_loss(x, x, x, torch.ones(1), 0.0)


def test_matching_log_prob_is_minus_the_mean_squared_error_in_float32():
    prediction = torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16)
    target = torch.tensor([[0.0, 1.0]])
    value = matching_log_prob(prediction, target)
    assert value.dtype == torch.float32 and value.tolist() == [-(1.0 + 4.0) / 2]


def test_the_x0_and_adaptive_weightings_are_the_error_of_the_implied_clean_sample():
    # flow matching at sigma = c: x0_hat - x0 = -c (v_hat - v); written out per element in plain Python
    prediction = torch.tensor([[1.0, 3.0], [0.5, -0.5]], dtype=torch.float64)
    target = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    c = torch.tensor([0.5, 0.25], dtype=torch.float64)
    x0_errors = [[-c[i].item() * (p - v) for p, v in zip(prediction[i].tolist(), target[i].tolist())] for i in range(2)]
    mse = [sum(e * e for e in row) / 2 for row in x0_errors]
    mean_abs = [sum(abs(e) for e in row) / 2 for row in x0_errors]
    torch.testing.assert_close(weighted_error(prediction, target, c, "x0"), torch.tensor(mse, dtype=torch.float64))
    torch.testing.assert_close(
        weighted_error(prediction, target, c, "adaptive"), torch.tensor([m / a for m, a in zip(mse, mean_abs)], dtype=torch.float64)
    )
    # the adaptive denominator carries no gradient: d/dp (c^2 (p - v)^2 / 2) / const
    leaf = prediction.clone().requires_grad_(True)
    weighted_error(leaf, target, c, "adaptive").sum().backward()
    expected = torch.tensor(
        [[c[i].item() ** 2 * (p - v) / mean_abs[i] for p, v in zip(prediction[i].tolist(), target[i].tolist())] for i in range(2)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(leaf.grad, expected)
    with pytest.raises(ValueError, match="x0_scale"):
        weighted_error(prediction, target, None, "x0")
    with pytest.raises(ValueError, match="weighting"):
        weighted_error(prediction, target, c, "huber")


def test_nft_with_the_adaptive_weighting_still_vanishes_without_signal_at_the_old_policy():
    torch.manual_seed(0)
    old, target = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    prediction = old.clone().requires_grad_(True)
    half = torch.full((3,), 0.5, dtype=torch.float64)
    nft_loss(prediction, old, target, half, 0.3, x0_scale=torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64),
             weighting="adaptive").sum().backward()
    # zero up to float64 rounding, as for the uniform weighting above: plus and minus are two expressions of
    # the same number at d = 0, so the two terms' gradients, each of order |e| ~ 1, cancel within a few ulp
    torch.testing.assert_close(prediction.grad, torch.zeros_like(old), rtol=0, atol=1e-15)
