"""Forward-process objectives (ddpo_group/algos/forward.py) against computations written here."""

import pytest
import torch

from ddpo_group.algos.forward import matching_log_prob, nft_loss, nft_optimality


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
