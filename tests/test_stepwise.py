"""ddpo_group.algos.stepwise: the per-column losses back-propagated one step at a time give exactly the
gradient of the whole micro-batch loss, written here independently as one autograd graph."""

import types

import pytest
import torch

from ddpo_group.algos.losses import get_policy_loss
from ddpo_group.algos.stepwise import column_loss, grpo_loss

B, K, P = 3, 4, 5


def _setup(seed):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(B, K, P, generator=generator, dtype=torch.float64)
    theta = torch.randn(P, generator=generator, dtype=torch.float64).mul_(0.05).requires_grad_(True)
    ref_theta = torch.randn(P, generator=generator, dtype=torch.float64) * 0.05
    old = (features @ ref_theta).detach() + 0.01 * torch.randn(B, K, generator=generator, dtype=torch.float64)
    advantages = torch.randn(B, K, generator=generator, dtype=torch.float64)
    mask = torch.ones(B, K, dtype=torch.float64)
    mask[1, 3] = 0.0  # a step without density
    return features, theta, ref_theta, old, advantages, mask


def _log_probs(features, theta):
    return features @ theta  # (B, K): a differentiable stand-in for the model's step log-probs


def _kl(features, theta, ref_theta):
    return (features @ (theta - ref_theta)) ** 2  # (B, K): a differentiable per-step KL


@pytest.mark.parametrize("name", ["vanilla", "gspo", "geo_mean"])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_column_losses_sum_to_the_whole_loss_gradient(name, agg_mode):
    features, theta, ref_theta, old, advantages, mask = _setup(0)
    # a clip range that some ratios exceed, so clipping is exercised
    config = types.SimpleNamespace(clip_ratio=0.02, clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio_c=3.0,
                                   loss_agg_mode=agg_mode)
    policy_loss, beta = get_policy_loss(name), 0.3

    # the whole loss, one graph, written without stepwise: policy loss + beta * agg(kl)
    from ddpo_group.algos.losses import agg_loss

    whole_policy, _ = policy_loss(old, _log_probs(features, theta), advantages, mask, config)
    whole = whole_policy + beta * agg_loss(_kl(features, theta, ref_theta), mask, agg_mode)
    (expected,) = torch.autograd.grad(whole, theta)

    base = _log_probs(features, theta).detach()  # every column's current value, no graph
    got = torch.zeros_like(theta)
    for k in range(K):
        live = _log_probs(features[:, k : k + 1], theta)[:, 0]
        kl_k = _kl(features[:, k : k + 1], theta, ref_theta)[:, 0]
        loss_k = column_loss(policy_loss, config, old, base, k, live, advantages, mask, kl=kl_k, beta=beta)
        (grad_k,) = torch.autograd.grad(loss_k, theta)
        got += grad_k
    assert expected.abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_grpo_loss_adds_beta_times_the_aggregated_kl():
    old = torch.zeros(2, 2)
    log_probs = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    kl = torch.tensor([[0.1, 0.3], [0.2, 0.4]])
    config = types.SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                                   loss_agg_mode="token-mean")
    loss, policy, _ = grpo_loss(get_policy_loss("vanilla"), config, old, log_probs, advantages, mask, kl=kl, beta=0.5)
    # ratio 1 everywhere: policy loss = mean(-A) = 0; KL token-mean = 0.25
    assert float(policy) == pytest.approx(0.0)
    assert float(loss) == pytest.approx(0.5 * 0.25)
    no_kl, _, _ = grpo_loss(get_policy_loss("vanilla"), config, old, log_probs, advantages, mask)
    assert float(no_kl) == pytest.approx(0.0)
