"""The step reward gain (ddpo_group/algos/step_gain.py, docs/critic.md): r[i, k] = R(decode(x0_hat(x_k))), r[i, T] = R_i,
g[i, k] = r[i, k+1] - r[i, k], advantages the per-prompt normalisation of g step by step. Expected values are written
out by hand or computed by plain-Python loops; the flow x0_hat and the anchor by a direct transformer call, the VAE
and the reward."""

import dataclasses

import pytest
import torch

from ddpo_group.algos.advantages import get_adv_estimator
from ddpo_group.algos.step_gain import compute_step_gain_advantages, step_reward_gains
from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.training.critic_designs import anchor_values, check_critic_config
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy
from ddpo_group.diffusion.policy import load_policy
from ddpo_group.training.trainer import Trainer
from helpers import cheap, make_config, read_metrics

EPS = 1e-6


def brightness(images, prompts, metadata):
    """A reward: the mean pixel of each image (CombinedReward's return shape)."""
    return images.float().mean(dim=(1, 2, 3)).double(), {}, {}


def step_gain_plain(step_rewards, rewards, prompt_ids, mask, norm_by_std, eps=EPS):
    """The module docstring's formula with plain Python loops: gains, then per (step, prompt group) over the valid
    trajectories (A - mean) / (population std + eps) (or A - mean); a group with one valid trajectory: mean 0, std 1."""
    B, T = len(step_rewards), len(step_rewards[0])
    r = [list(step_rewards[i]) + [rewards[i]] for i in range(B)]
    gains = [[r[i][k + 1] - r[i][k] for k in range(T)] for i in range(B)]
    out = [[0.0] * T for _ in range(B)]
    for k in range(T):
        for i in range(B):
            if not mask[i][k]:
                continue
            group = [gains[j][k] for j in range(B) if prompt_ids[j] == prompt_ids[i] and mask[j][k]]
            if len(group) == 1:
                mean, std = 0.0, 1.0
            else:
                mean = sum(group) / len(group)
                std = (sum((g - mean) ** 2 for g in group) / len(group)) ** 0.5
            out[i][k] = (gains[i][k] - mean) / (std + eps) if norm_by_std else gains[i][k] - mean
    return out


def test_two_trajectories_by_hand():
    # r = [[0.2, 0.5], [0.4, 0.4]], R = [1.0, 0.0]: gains [0.3, 0.5] and [0.0, -0.4]
    step_rewards = torch.tensor([[0.2, 0.5], [0.4, 0.4]], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    mask = torch.ones(2, 2)
    torch.testing.assert_close(step_reward_gains(step_rewards, rewards),
                               torch.tensor([[0.3, 0.5], [0.0, -0.4]], dtype=torch.float64))
    # step 0: mean 0.15, deviations +-0.15, std 0.15; step 1: mean 0.05, deviations +-0.45, std 0.45
    plain, _ = compute_step_gain_advantages(step_rewards, rewards, [7, 7], mask, norm_by_std=False)
    torch.testing.assert_close(plain, torch.tensor([[0.15, 0.45], [-0.15, -0.45]], dtype=torch.float64))
    normed, returns = compute_step_gain_advantages(step_rewards, rewards, [7, 7], mask, norm_by_std=True)
    expected = torch.tensor([[0.15 / (0.15 + EPS), 0.45 / (0.45 + EPS)], [-0.15 / (0.15 + EPS), -0.45 / (0.45 + EPS)]],
                            dtype=torch.float64)
    torch.testing.assert_close(normed, expected)
    torch.testing.assert_close(returns, expected)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_groups_of_two_and_three_with_masked_steps_match_plain_python(norm_by_std):
    g = torch.Generator().manual_seed(3)
    step_rewards = torch.rand(5, 4, generator=g, dtype=torch.float64)
    rewards = torch.rand(5, generator=g, dtype=torch.float64)
    prompt_ids = [0, 0, 1, 1, 1]
    # trajectory 1 has no density at step 1 (group 0 has one valid trajectory there: mean 0, std 1), trajectory 4
    # none at step 3; step 0 has none anywhere (an ODE step before the SDE window)
    mask = [[0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 0]]
    advantages, _ = compute_step_gain_advantages(step_rewards, rewards, torch.tensor(prompt_ids), torch.tensor(mask),
                                                 norm_by_std=norm_by_std)
    expected = step_gain_plain(step_rewards.tolist(), rewards.tolist(), prompt_ids, mask, norm_by_std)
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64))
    assert advantages[:, 0].abs().max() == 0 and advantages[1, 1] == 0 and advantages[4, 3] == 0


def test_the_gains_telescope_to_the_final_reward_minus_the_first_prediction():
    g = torch.Generator().manual_seed(0)
    step_rewards, rewards = torch.randn(6, 5, generator=g), torch.randn(6, generator=g)
    gains = step_reward_gains(step_rewards, rewards)
    torch.testing.assert_close(gains.sum(dim=1), rewards - step_rewards[:, 0])
    torch.testing.assert_close(gains[:, -1], rewards - step_rewards[:, -1])  # the last step's "after" is R


def test_the_registered_estimator_declares_and_reads_the_step_rewards():
    estimator = get_adv_estimator("step_gain")
    assert estimator.needs_step_rewards and not estimator.needs_values
    assert not any(get_adv_estimator(name).needs_step_rewards for name in ("grpo", "rloo", "gae", "group_ppo", "ddpo"))
    step_rewards, rewards = torch.tensor([[0.2, 0.5], [0.4, 0.4]]), torch.tensor([1.0, 0.0])
    adv, _ = estimator(rewards=rewards, prompt_ids=[0, 0], mask=torch.ones(2, 2), step_rewards=step_rewards,
                       norm_by_std=False, gamma=1.0, lam=0.95)
    torch.testing.assert_close(adv, torch.tensor([[0.15, 0.45], [-0.15, -0.45]]))
    with pytest.raises(ValueError, match="needs `step_rewards`"):
        estimator(rewards=rewards, prompt_ids=[0, 0], mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="step_rewards must have the shape of mask"):
        estimator(rewards=rewards, prompt_ids=[0, 0], mask=torch.ones(2, 3), step_rewards=step_rewards)


def sd3_policy():
    policy = load_policy("tiny-sd3")
    policy.configure(max_sequence_length=16)
    policy.prepare("cpu", torch.float32, use_lora=False)
    return policy


def hand_velocity(policy, batch, k, guidance_scale):
    """The SD3 transformer's velocity at the stored x_k with classifier-free guidance, called directly."""
    transformer = policy.pipeline.transformer
    x, t = batch.latents[:, k], batch.timesteps[:, k]
    with torch.no_grad():
        text = transformer(hidden_states=x, timestep=t, encoder_hidden_states=batch.prompt_embeds,
                           pooled_projections=batch.pooled_prompt_embeds).sample
        uncond = transformer(hidden_states=x, timestep=t, encoder_hidden_states=batch.negative_prompt_embeds,
                             pooled_projections=batch.negative_pooled_prompt_embeds).sample
    return uncond + guidance_scale * (text - uncond)


def test_flow_sampling_keeps_x_minus_sigma_v_and_the_same_latents():
    policy = sd3_policy()
    prompts = ["a red circle", "a blue square"]
    kept = policy.sample(prompts, num_steps=3, guidance_scale=4.5, eta=0.7, generator=torch.Generator().manual_seed(1),
                         keep_x0_hat=True)
    plain = policy.sample(prompts, num_steps=3, guidance_scale=4.5, eta=0.7, generator=torch.Generator().manual_seed(1))
    assert plain.x0_hat is None
    assert kept.x0_hat.shape == (2, 3, *kept.latents.shape[2:]) and kept.x0_hat.dtype == torch.float32
    assert torch.equal(kept.latents, plain.latents) and torch.equal(kept.log_probs, plain.log_probs)
    for k in range(3):
        sigma = kept.sigmas[:, k].reshape(-1, 1, 1, 1)
        expected = kept.latents[:, k] - sigma * hand_velocity(policy, kept, k, 4.5)
        torch.testing.assert_close(kept.x0_hat[:, k], expected, rtol=1e-5, atol=1e-5)


def test_the_anchor_of_a_flow_family_is_the_reward_of_the_hand_decoded_prediction():
    policy = sd3_policy()
    prompts = ["a red circle", "a blue square"]
    kept = policy.sample(prompts, num_steps=3, guidance_scale=4.5, eta=0.7, generator=torch.Generator().manual_seed(2),
                         keep_x0_hat=True)
    vae = policy.pipeline.vae
    expected = torch.zeros(2, 3)
    for k in range(3):
        x0 = kept.latents[:, k] - kept.sigmas[:, k].reshape(-1, 1, 1, 1) * hand_velocity(policy, kept, k, 4.5)
        with torch.no_grad():
            images = (vae.decode(x0 / vae.config.scaling_factor + vae.config.shift_factor).sample / 2 + 0.5).clamp(0, 1)
        expected[:, k] = brightness(images, prompts, None)[0].float()
    calls = []
    handle = policy.pipeline.transformer.register_forward_hook(lambda *args: calls.append(1))
    try:
        stored = anchor_values(policy, policy.pipeline.transformer, kept, brightness, prompts, [{}, {}], 4.5)
    finally:
        handle.remove()
    assert calls == []  # the anchor read what sampling predicted: no model call
    torch.testing.assert_close(stored, expected, rtol=1e-4, atol=1e-5)
    # without the stored x0_hat: one model call per step asked for (x_k - sigma_k v from batch.sigmas); 0 elsewhere
    fresh = anchor_values(policy, policy.pipeline.transformer, dataclasses.replace(kept, x0_hat=None), brightness,
                          prompts, [{}, {}], 4.5, steps=[0, 2])
    torch.testing.assert_close(fresh[:, [0, 2]], expected[:, [0, 2]], rtol=1e-4, atol=1e-5)
    assert torch.equal(fresh[:, 1], torch.zeros(2))


def mean_pixel(images, prompts, metadata):
    """A reward of images (B, 3, H, W) or videos (B, F, 3, H, W): the mean pixel."""
    return images.float().flatten(1).mean(dim=1).double(), {}, {}


@pytest.mark.parametrize("model, guidance_scale", [("tiny", 3.0), ("tiny-sdxl", 3.0), ("tiny-flux", 3.5),
                                                   ("tiny-qwen-image", 4.0), ("tiny-wan", 4.0)])
def test_each_familys_kept_prediction_is_its_predict_x0_and_the_anchor_decodes_it(model, guidance_scale):
    policy = load_policy(model)
    if isinstance(policy, FlowMatchingPolicy):  # a short text (T5 / Qwen's encoder), as the tiny flow variants
        policy.configure(max_sequence_length=16)
    module = policy.prepare("cpu", torch.float32, use_lora=False)
    prompts = ["a red circle", "a blue square"]
    kept = policy.sample(prompts, num_steps=2, guidance_scale=guidance_scale, eta=0.7,
                         generator=torch.Generator().manual_seed(4), keep_x0_hat=True)
    assert kept.x0_hat.shape == (2, 2, *kept.latents.shape[2:])
    rows = torch.arange(2)
    with torch.no_grad():
        for k in range(2):
            torch.testing.assert_close(kept.x0_hat[:, k], policy.predict_x0(module, kept, rows, k, guidance_scale),
                                       rtol=1e-4, atol=1e-4)
        decoded = policy.decode(kept.latents[:, -1])
    torch.testing.assert_close(decoded, kept.images.float(), rtol=1e-5, atol=1e-5)  # the decode sampling made
    values = anchor_values(policy, module, kept, mean_pixel, prompts, [{}, {}], guidance_scale)
    with torch.no_grad():
        expected = torch.stack([mean_pixel(policy.decode(kept.x0_hat[:, k]), prompts, None)[0] for k in range(2)], 1)
    torch.testing.assert_close(values, expected.float())


@pytest.mark.parametrize("family", ["stable_diffusion", "sdxl", "sd3", "flux", "qwen_image", "wan"])
def test_every_family_with_an_anchor_passes_the_check(family):
    config = make_config("/nonexistent", algorithm__adv_estimator="gae", critic__kind="anchor")
    check_critic_config(config, True, family)
    check_critic_config(make_config("/nonexistent", algorithm__adv_estimator="step_gain"), False, family, True)


@pytest.mark.parametrize("family", ["flux_kontext", "qwen_image_edit"])
def test_an_editing_family_has_no_anchor_and_no_step_gain(family):
    config = make_config("/nonexistent", algorithm__adv_estimator="gae", critic__kind="anchor")
    with pytest.raises(ConfigError, match=f"config.critic.kind='anchor' .* the {family} family has no anchor"):
        check_critic_config(config, True, family)
    config = make_config("/nonexistent", algorithm__adv_estimator="step_gain")
    with pytest.raises(ConfigError, match=f"config.algorithm.adv_estimator='step_gain' .* the {family} family has no"):
        check_critic_config(config, False, family, True)


def test_step_gain_with_rewards_normalised_one_by_one_is_refused_before_a_model_loads(tmp_path):
    config = make_config(tmp_path, **cheap(algorithm__adv_estimator="step_gain",
                                           reward_aggregation="normalize_then_sum"))
    config.reward_weights = {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5}
    with pytest.raises(ConfigError, match="reward_aggregation='normalize_then_sum' with 2 rewards.*sum_then_normalize"):
        Trainer(config)
    assert not (tmp_path / "r").exists()


def test_step_gain_with_a_group_wise_reward_is_refused_before_a_model_loads(tmp_path):
    import os

    from helpers import ROOT

    plugin = os.path.join(ROOT, "tests", "group_reward_plugin.py")
    config = make_config(tmp_path, **cheap(algorithm__adv_estimator="step_gain", reward_fn=f"{plugin}:brightness_rank"))
    with pytest.raises(ConfigError, match="brightness_rank' scores whole prompt groups.*use per-image rewards"):
        Trainer(config)
    assert not (tmp_path / "r").exists()


def test_step_gain_with_a_forward_objective_is_refused(tmp_path):
    config = make_config(tmp_path, variant="tiny_nft", algorithm__adv_estimator="step_gain")
    with pytest.raises(ConfigError, match="adv_estimator='step_gain' credits the reverse-process steps"):
        check_config(config)


@pytest.mark.parametrize("variant, model_attr", [("test", "unet"), ("tiny_sd3", "transformer")])
def test_one_epoch_of_step_gain_trains_on_the_gains_of_the_kept_predictions(tmp_path, variant, model_attr):
    config = make_config(tmp_path, variant=variant, **cheap(algorithm__adv_estimator="step_gain",
                                                             train__adv_clip_max=100.0))
    trainer = Trainer(config)
    seen, calls = {}, []
    step_rewards, compute_advantages = trainer.advantages.step_rewards, trainer.compute_advantages

    def recording_step_rewards(samples, policy, model, metrics):
        handle = getattr(trainer.policy.pipeline, model_attr).register_forward_hook(lambda *args: calls.append(1))
        try:
            seen["step_rewards"] = step_rewards(samples, policy, model, metrics)
        finally:
            handle.remove()
        return seen["step_rewards"]

    def recording_advantages(samples, metrics):
        compute_advantages(samples, metrics)
        seen["samples"] = samples

    trainer.advantages.step_rewards = recording_step_rewards
    trainer.compute_advantages = recording_advantages
    run_dir = trainer.run()
    samples, r = seen["samples"], seen["step_rewards"]
    B, T = 4, 2  # sample.batch_size, sample.num_steps
    assert samples.x0_hat is not None and samples.x0_hat.shape[:2] == (B, T)
    assert calls == []  # the step rewards decoded sampling's own predictions: no model call
    expected = step_gain_plain(r.tolist(), samples.rewards.tolist(), samples.prompt_ids.tolist(),
                               samples.mask.tolist(), norm_by_std=True)
    torch.testing.assert_close(samples.advantages.double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)
    row = read_metrics(run_dir)[0]
    assert row["train/step_reward_decodes"] == B * T
    assert len(row["steps/step_reward"]) == T and len(row["steps/step_gain"]) == T
    assert row["steps/step_reward"] == pytest.approx(r.double().mean(dim=0).tolist(), rel=1e-5, abs=1e-6)
    assert row["train/skipped_steps"] == 0 and row["train/global_step"] >= 1


@pytest.mark.slow
def test_two_processes_score_their_own_steps_and_normalise_the_gathered_gains(tmp_path):
    """torchrun, two CPU processes (gloo): each rank decodes and scores its own trajectories' steps; the gains are
    normalised over the gathered batch, whose prompt groups span both ranks."""
    import os
    import subprocess

    from helpers import PYTHON, ROOT, free_port, read_dump, subprocess_env

    command = [os.path.join(os.path.dirname(PYTHON), "torchrun"), "--nproc_per_node", "2", "--master_port",
               str(free_port()), "scripts/train.py", "--config", "config/grpo.py:test", "--config.num_epochs=1",
               "--config.debug_dump=True", "--config.reward_fn=jpeg_compressibility", "--config.sample.num_steps=2",
               "--config.train.use_reference_model=False", "--config.train.use_kl_loss=False",
               "--config.log_images_every=0", "--config.run_name=r", "--config.algorithm.adv_estimator=step_gain",
               "--config.train.adv_clip_max=100.0", f"--config.logdir={tmp_path}"]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    dumps = [read_dump(str(tmp_path / "r"), rank=rank) for rank in (0, 1)]
    gathered = {key: dumps[0][key] + dumps[1][key] for key in ("step_rewards", "rewards", "prompt_ids", "mask")}
    assert set(dumps[0]["prompt_ids"]) & set(dumps[1]["prompt_ids"])  # a group spans both ranks
    expected = step_gain_plain(gathered["step_rewards"], gathered["rewards"], gathered["prompt_ids"],
                               gathered["mask"], norm_by_std=True)
    for rank, dump in enumerate(dumps):
        torch.testing.assert_close(torch.tensor(dump["advantages"], dtype=torch.float64),
                                   torch.tensor(expected[rank * 4 : (rank + 1) * 4], dtype=torch.float64),
                                   rtol=1e-4, atol=1e-4)
    row = read_metrics(str(tmp_path / "r"))[0]
    assert row["train/step_reward_decodes"] == 4 * 2  # per process: its 4 trajectories x 2 steps
    all_step_rewards = torch.tensor(gathered["step_rewards"], dtype=torch.float64)
    assert row["steps/step_reward"] == pytest.approx(all_step_rewards.mean(dim=0).tolist(), rel=1e-5, abs=1e-6)
