"""Value network V(x_t, t, c) and its per-step evaluation (docs/design.md §3, §4)."""

import pytest
import torch
from torch import nn

from ddpo_group.training.critic import ValueNetwork, compute_values, num_parameters


def make_critic(seed=0, randomize_head=False):
    torch.manual_seed(seed)
    critic = ValueNetwork(latent_channels=4, prompt_dim=8, hidden=16, time_embed_dim=16)
    if randomize_head:  # the zero-initialised output layer would make every value 0
        nn.init.normal_(critic.head[-1].weight)
        nn.init.normal_(critic.head[-1].bias)
    return critic


def test_output_shape_is_batch():
    critic = make_critic()
    values = critic(torch.randn(3, 4, 8, 8), torch.tensor([999, 500, 1]), torch.randn(3, 5, 8))
    assert values.shape == (3,)


def test_initial_values_are_zero():
    critic = make_critic()
    values = critic(torch.randn(3, 4, 8, 8), torch.tensor([999, 500, 1]), torch.randn(3, 5, 8))
    assert torch.equal(values, torch.zeros(3))


def test_gradients_reach_every_parameter():
    critic = make_critic()
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.1)
    latents, timesteps, prompts = torch.randn(4, 4, 8, 8), torch.tensor([900, 600, 300, 10]), torch.randn(4, 5, 8)
    targets = torch.tensor([1.0, -1.0, 0.5, 2.0])
    for _ in range(2):  # step 1 moves the zero output layer, step 2 then reaches the layers below
        optimizer.zero_grad()
        loss = ((critic(latents, timesteps, prompts) - targets) ** 2).mean()
        loss.backward()
        optimizer.step()
    for name, parameter in critic.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_scalar_timestep_and_pooled_prompt_match_full_inputs():
    critic = make_critic(randomize_head=True)
    latents, prompts = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 8)
    full = critic(latents, torch.tensor([700, 700]), prompts)
    torch.testing.assert_close(critic(latents, 700, prompts), full)
    torch.testing.assert_close(critic(latents, torch.tensor([700, 700]), prompts.mean(dim=1)), full)


def test_timestep_and_prompt_change_the_value():
    critic = make_critic(randomize_head=True)
    latents, prompts = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 8)
    assert critic(latents, 900, prompts) != critic(latents, 100, prompts)
    assert critic(latents, 900, prompts) != critic(latents, 900, prompts + 1)


@pytest.mark.parametrize("micro_batch_size", [None, 4])
def test_compute_values_matches_per_step_calls(micro_batch_size):
    critic = make_critic(randomize_head=True)
    B, T = 2, 3
    latents = torch.randn(B, T + 1, 4, 8, 8)
    timesteps = torch.tensor([[900, 600, 300], [950, 500, 50]])
    prompts = torch.randn(B, 5, 8)
    values = compute_values(critic, latents, timesteps, prompts, micro_batch_size=micro_batch_size)
    assert values.shape == (B, T)
    with torch.no_grad():
        expected = torch.stack([critic(latents[:, t], timesteps[:, t], prompts) for t in range(T)], dim=1)
    torch.testing.assert_close(values, expected)
    assert not values.requires_grad


def test_compute_values_rejects_mismatched_timesteps():
    with pytest.raises(ValueError, match="timesteps"):
        compute_values(make_critic(), torch.randn(2, 4, 4, 8, 8), torch.zeros(2, 4), torch.randn(2, 5, 8))


def test_forward_rejects_wrong_latent_channels_and_prompt_dim():
    critic = make_critic()
    with pytest.raises(ValueError, match="latents"):
        critic(torch.randn(2, 3, 8, 8), 10, torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="prompt_embeds"):
        critic(torch.randn(2, 4, 8, 8), 10, torch.randn(2, 5, 7))


def test_num_parameters_counts_weights_and_biases():
    linear = nn.Linear(3, 2)  # 3*2 weights + 2 biases
    assert num_parameters(linear) == 8
    linear.bias.requires_grad_(False)
    assert num_parameters(linear, trainable_only=True) == 6


def test_sd_sized_critic_is_under_one_percent_of_the_unet():
    # SD 1.5's UNet has about 860M parameters.
    assert num_parameters(ValueNetwork(latent_channels=4, prompt_dim=768)) < 0.01 * 860e6
