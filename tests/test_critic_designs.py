"""Critic designs (ddpo_group/training/critic_designs.py, docs/critic.md): the Tweedie anchor, the anchor + residual, the
critic's own lambda. Expected values are computed here by hand: diffusers' own DDIM step for x0_hat, a direct
UNet call, VAE decode and reward call for the anchor, the trajectory's reward for Monte-Carlo targets."""

import types

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler

from ddpo_group.config.check import ConfigError
from ddpo_group.training.critic_designs import (
    anchor_values,
    check_critic_config,
    critic_lambda,
    critic_returns,
    critic_targets,
    ddim_x0_hat,
)
from ddpo_group.diffusion.policy import load_policy
from ddpo_group.training.trainer import Trainer
from helpers import cheap, make_config, read_metrics


def brightness(images, prompts, metadata):
    """A reward: the mean pixel of each image (CombinedReward's return shape)."""
    return images.float().mean(dim=(1, 2, 3)).double(), {}, {}


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_x0_hat_is_the_ddim_schedulers_predicted_original_sample(prediction_type):
    scheduler = DDIMScheduler(num_train_timesteps=1000, prediction_type=prediction_type, clip_sample=False)
    scheduler.set_timesteps(10)
    g = torch.Generator().manual_seed(0)
    x_t, output = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    for t in scheduler.timesteps[[0, 4, 9]]:
        expected = scheduler.step(output, t, x_t, eta=0.0).pred_original_sample
        torch.testing.assert_close(ddim_x0_hat(scheduler, output, t, x_t), expected, rtol=1e-5, atol=1e-5)


def hand_anchor(policy, batch, prompts, guidance_scale, k):
    """R(decode(x0_hat(x_k))) by hand: CFG noise prediction, Tweedie's formula, VAE decode, the reward."""
    pipe = policy.pipeline
    x = batch.latents[:, k].float()
    t = batch.timesteps[:, k]
    with torch.no_grad():
        cond = pipe.unet(x, t, encoder_hidden_states=batch.prompt_embeds).sample
        if guidance_scale > 1:
            uncond = pipe.unet(x, t, encoder_hidden_states=batch.negative_prompt_embeds).sample
            cond = uncond + guidance_scale * (cond - uncond)
        abar = pipe.scheduler.alphas_cumprod[t].float().reshape(-1, 1, 1, 1)
        x0 = (x - (1 - abar).sqrt() * cond) / abar.sqrt()
        images = (pipe.vae.decode(x0 / pipe.vae.config.scaling_factor).sample / 2 + 0.5).clamp(0, 1)
    return brightness(images, prompts, None)[0].float()


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_anchor_value_is_the_reward_of_the_hand_decoded_tweedie_prediction(guidance_scale):
    policy = load_policy("tiny")
    policy.prepare("cpu", torch.float32, use_lora=False)
    prompts = ["a red circle", "a blue square"]
    batch = policy.sample(prompts, num_steps=3, guidance_scale=guidance_scale, eta=1.0,
                          generator=torch.Generator().manual_seed(1))
    values = anchor_values(policy, policy.pipeline.unet, batch, brightness, prompts, [{}, {}], guidance_scale,
                           steps=[0, 2])
    assert values.shape == (2, 3)
    for k in (0, 2):
        torch.testing.assert_close(values[:, k], hand_anchor(policy, batch, prompts, guidance_scale, k),
                                   rtol=1e-4, atol=1e-5)
    assert torch.equal(values[:, 1], torch.zeros(2))  # a step not asked for costs nothing and is 0


def test_sampling_keeps_the_x0_hat_of_its_own_model_calls_and_the_anchor_reads_it():
    policy = load_policy("tiny")
    policy.prepare("cpu", torch.float32, use_lora=False)
    prompts = ["a red circle", "a blue square"]
    kept = policy.sample(prompts, num_steps=3, guidance_scale=3.0, eta=1.0, generator=torch.Generator().manual_seed(1),
                         keep_x0_hat=True)
    plain = policy.sample(prompts, num_steps=3, guidance_scale=3.0, eta=1.0, generator=torch.Generator().manual_seed(1))
    assert plain.x0_hat is None and kept.x0_hat.shape == (2, 3, *kept.latents.shape[2:])
    torch.testing.assert_close(kept.latents, plain.latents)  # keeping it changes nothing of the trajectory
    calls = []
    handle = policy.pipeline.unet.register_forward_hook(lambda *args: calls.append(1))
    try:
        values = anchor_values(policy, policy.pipeline.unet, kept, brightness, prompts, [{}, {}], 3.0)
    finally:
        handle.remove()
    assert calls == []  # no model call: the anchor reads what sampling predicted
    for k in range(3):
        torch.testing.assert_close(values[:, k], hand_anchor(policy, kept, prompts, 3.0, k), rtol=1e-4, atol=1e-5)


def test_monte_carlo_targets_with_critic_lambda_one():
    rewards = torch.tensor([0.3, -1.0, 2.0])
    values = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
    returns = critic_returns(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, rewards[:, None] * mask)  # every valid step's target is R_i
    # lam 0: the one-step TD target V(x_{t+1}) (R at the last step)
    td = critic_returns(rewards, values, torch.ones(3, 4), gamma=1.0, lam=0.0)
    torch.testing.assert_close(td[:, :3], values[:, 1:])
    torch.testing.assert_close(td[:, 3], rewards)


def test_residual_targets_and_critic_lambda():
    returns, values, anchor = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 0.7]]), torch.tensor([[0.25, 0.5]])
    assert critic_targets(returns, values, None) == (returns, values)
    targets, old = critic_targets(returns, values, anchor)
    torch.testing.assert_close(targets, torch.tensor([[0.75, 1.5]]))
    torch.testing.assert_close(old, torch.tensor([[0.25, 0.2]]))
    config = make_config("/nonexistent", algorithm__lam=0.9)
    assert critic_lambda(config) == 0.9
    config.critic.lam = 1.0
    assert critic_lambda(config) == 1.0


@pytest.mark.parametrize("overrides, family, needs_values, words", [
    ({"critic__kind": "tweedie"}, None, True, "critic.kind='tweedie'"),
    ({"critic__lam": 1.5}, None, True, "critic.lam=1.5"),
    ({"critic__kind": "anchor"}, None, False, "critic.kind='anchor' needs an estimator with a critic"),
    ({"critic__lam": 1.0}, None, False, "critic.lam=1.0 needs an estimator with a critic"),
    ({"critic__kind": "anchor", "critic__warmup_epochs": 2}, None, True, "critic.warmup_epochs=2"),
    ({"critic__kind": "anchor_residual"}, "flux_kontext", True, "the flux_kontext family has no anchor"),
])
def test_critic_config_errors_name_the_field(overrides, family, needs_values, words):
    config = make_config("/nonexistent", **overrides)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(".", r"\.")):
        check_critic_config(config, needs_values, family)
    check_critic_config(make_config("/nonexistent"), needs_values, family)  # the defaults pass


def test_anchor_residual_with_monte_carlo_targets_trains(tmp_path):
    """gae with critic.kind='anchor_residual' and critic.lam=1: the network regresses R - anchor at every step."""
    config = make_config(tmp_path, **cheap(algorithm__adv_estimator="gae", critic__kind="anchor_residual",
                                           critic__lam=1.0, sample__guidance_scale=1.0))
    trainer = Trainer(config)
    seen = {}
    compute_advantages = trainer.compute_advantages

    def recording(samples, metrics):
        compute_advantages(samples, metrics)
        # the anchor by hand with the sampling weights (before this epoch's update), the trainer's reward
        records = [trainer.prompts[int(i)] for i in samples.prompt_ids]
        batch = types.SimpleNamespace(latents=samples.latents, timesteps=samples.timesteps,
                                      prompt_embeds=samples.prompt_embeds, negative_prompt_embeds=None,
                                      pooled_prompt_embeds=None, negative_pooled_prompt_embeds=None, extra_cond=None)
        seen["anchor"] = anchor_values(trainer.policy, trainer.trainable_module, batch, trainer.reward_fn,
                                       [r.prompt for r in records], [r.metadata for r in records], 1.0)
        seen["samples"] = samples

    trainer.compute_advantages = recording
    trainer.run()
    samples, anchor = seen["samples"], seen["anchor"]
    assert samples.x0_hat is not None  # sampled with each step's prediction kept: the anchor made no model call
    expected = (samples.rewards[:, None] - anchor) * samples.mask  # Monte-Carlo target minus the anchor
    torch.testing.assert_close(samples.returns * samples.mask, expected, rtol=1e-4, atol=1e-4)
    assert not torch.equal(anchor[:, 0], anchor[:, 1])
    assert "critic/value_loss" in read_metrics(trainer.run_dir)[0]


def test_anchor_alone_builds_no_network(tmp_path):
    config = make_config(tmp_path, **cheap(algorithm__adv_estimator="gae", critic__kind="anchor"))
    trainer = Trainer(config)
    assert trainer.critic is None
    trainer.run()
    row = read_metrics(trainer.run_dir)[0]
    assert "critic/value_mean" in row and "time/critic_anchor" in row and "critic/value_loss" not in row


def test_variance_decomposition_statistics_by_hand():
    from helpers import load_script

    vd = load_script("benchmarks/variance_decomposition.py")
    rewards = np.array([0.0, 1.0, 2.0, 4.0])
    pid = np.array([0, 0, 1, 1])
    # prompt 0: var(0, 1) = 0.5; prompt 1: var(2, 4) = 2 (ddof 1)
    assert vd.within_prompt_variance(rewards, pid) == pytest.approx(1.25)
    share, se = vd.bootstrap_share(np.array([0.25, 0.25, 0.5, 0.5]), rewards, pid, n_boot=50)
    assert share == pytest.approx(0.375 / 1.25) and se >= 0
    # V = r + a prompt constant explains everything within prompts, nothing of the prompts' means raw
    values = rewards + np.array([5.0, 5.0, -5.0, -5.0])
    assert vd.explained_variance(values, rewards, pid, within=True) == pytest.approx(1.0)
    assert vd.explained_variance(values, rewards, pid, within=False) < 0
    assert vd.within_corr2(2 * rewards, rewards, rewards, pid) == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("spec", ["critic_window:critic.kind=anchor_residual:algorithm.lam=0.5",
                                  "critic_everywhere:critic.kind=anchor",
                                  "critic_window:critic.warmup_epochs=3:critic.lam=1.0"])
def test_study_methods_are_valid_configs(spec, tmp_path):
    from helpers import load_script

    from ddpo_group.config.check import check_config

    bench = load_script("benchmarks/bench_training.py")
    config = bench.build_method_config(spec, "tiny-shapes", 40, str(tmp_path / "r"), common_variant="tiny", seed=42,
                                       eval_freq=5)
    check_config(config)
    check_critic_config(config, True, "stable_diffusion")
    assert config.group_ppo.max_group_size == 1 and config.critic.train_steps == "all"
