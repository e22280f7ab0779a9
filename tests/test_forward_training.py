"""Forward-process training (train.objective nft / awm, docs/forward.md) on the three tiny families.

The families' forward processes and predictions are checked against formulas and model calls written
here; a run of each objective on each family trains, samples without per-step latents, is exactly
on-policy in its first window, and resumes to the same weights as a run that never stopped.
"""

import os

import pytest
import torch
from safetensors.torch import load_file

from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.diffusion.policy import load_policy
from ddpo_group.training.trainer import Trainer, train
from tests.helpers import make_config, read_metrics

PROMPTS = ["a red square", "a blue circle"]
FAMILIES = {"tiny": ("", 0), "tiny-sd3": ("sde", 16), "tiny-flux": ("sde", 16)}


def _policy(model):
    policy = load_policy(model)
    sde_type, length = FAMILIES[model]
    policy.configure(sde_type=sde_type, max_sequence_length=length)
    policy.prepare("cpu", torch.float32, use_lora=False)
    return policy


@pytest.fixture(scope="module")
def policies():
    return {model: _policy(model) for model in FAMILIES}


def test_the_ddpm_forward_process_and_target_follow_the_beta_schedule():
    policy = _policy("tiny")
    config = policy.pipeline.scheduler.config
    assert config.beta_schedule == "scaled_linear" and config.prediction_type == "epsilon"
    # abar_t = prod_{s <= t} (1 - beta_s), beta = linspace(sqrt(beta_start), sqrt(beta_end), N)^2 (float64 here)
    betas = torch.linspace(config.beta_start**0.5, config.beta_end**0.5, config.num_train_timesteps, dtype=torch.float64) ** 2
    abar = torch.cumprod(1 - betas, 0)
    generator = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 8, 8, generator=generator), torch.randn(3, 4, 8, 8, generator=generator)
    timesteps = torch.tensor([1, 500, 999])
    x_t, target, scale = policy.forward_noise(x0, noise, timesteps)
    a = abar[timesteps].reshape(3, 1, 1, 1)
    torch.testing.assert_close(x_t.double(), a.sqrt() * x0.double() + (1 - a).sqrt() * noise.double(), rtol=0, atol=1e-6)
    assert torch.equal(target, noise)
    torch.testing.assert_close(scale.double(), ((1 - abar[timesteps]) / abar[timesteps]).sqrt(), rtol=1e-5, atol=0)
    # the x0 implied by the true target is x0: x0_hat = x_t - c sqrt(abar) eps / sqrt(abar) ... = (x_t - sqrt(1 - abar) eps) / sqrt(abar)
    x0_hat = (x_t.double() - (1 - a).sqrt() * target.double()) / a.sqrt()
    torch.testing.assert_close(x0_hat, x0.double(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_the_flow_forward_process_interpolates_and_its_target_is_the_velocity(policies, model):
    policy = policies[model]
    generator = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 4, 8, 8, generator=generator)
    timesteps = torch.tensor([1000.0, 250.0])
    x_t, target, scale = policy.forward_noise(x0, noise, timesteps)
    sigma = torch.tensor([1.0, 0.25]).reshape(2, 1, 1, 1)
    torch.testing.assert_close(x_t, (1 - sigma) * x0 + sigma * noise)
    torch.testing.assert_close(target, noise - x0)
    torch.testing.assert_close(scale, torch.tensor([1.0, 0.25]))


def test_the_sd_prediction_is_the_unets_output_with_the_pipelines_guidance(policies):
    policy = policies["tiny"]
    unet = policy.trainable_module
    batch = policy.sample(PROMPTS, 4, 3.0, 1.0, generator=torch.Generator().manual_seed(2), keep_steps=False)
    x_t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    timesteps = torch.tensor([751, 251])
    rows = torch.arange(2)
    with torch.no_grad():
        cond = unet(x_t, timesteps, encoder_hidden_states=batch.prompt_embeds).sample
        uncond = unet(x_t, timesteps, encoder_hidden_states=batch.negative_prompt_embeds).sample
        torch.testing.assert_close(policy.predict(unet, x_t, timesteps, batch, rows, 1.0), cond)
        # one call on the concatenated batch against two separate calls: equal up to float32 rounding
        torch.testing.assert_close(policy.predict(unet, x_t, timesteps, batch, rows, 3.0), uncond + 3.0 * (cond - uncond),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_sampling_without_steps_keeps_the_clean_latents_and_the_same_images(policies, model):
    policy = policies[model]
    guidance, eta = (3.0, 1.0) if model == "tiny" else (4.5, 0.7)
    full = policy.sample(PROMPTS, 4, guidance, eta, generator=torch.Generator().manual_seed(4))
    light = policy.sample(PROMPTS, 4, guidance, eta, generator=torch.Generator().manual_seed(4), keep_steps=False)
    assert light.latents.shape == (2, 1) + tuple(full.latents.shape[2:])
    assert light.log_probs.shape == light.mask.shape == (2, 0)
    assert torch.equal(light.latents[:, 0], full.latents[:, -1]) and torch.equal(light.images, full.images)
    assert torch.equal(light.timesteps, full.timesteps)


def _run_config(tmp_path, variant, objective, run_name, **overrides):
    values = dict(num_epochs=2, save_freq=1, log_images_every=0, train__objective=objective,
                  train__use_reference_model=False, train__use_kl_loss=False, train__beta=0.0,
                  forward__num_timesteps=3, forward__weighting="adaptive" if objective == "nft" else "uniform",
                  train__learning_rate=1e-3)
    if objective == "awm":
        values["train__clip_range"] = 0.2
    values.update(overrides)
    return make_config(tmp_path, variant=variant, run_name=run_name, **values)


def _weights(checkpoint):
    found = {}
    for name in ("unet", "transformer"):
        path = os.path.join(checkpoint, name, "diffusion_pytorch_model.safetensors")
        if os.path.exists(path):
            found.update(load_file(path))
    found.update({f"old.{k}": v for k, v in load_file(os.path.join(checkpoint, "old_model.safetensors")).items()})
    return found


@pytest.mark.parametrize("variant", ["test", "tiny_sd3", "tiny_flux"])
@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_a_forward_run_trains_is_on_policy_first_and_resumes_exactly(tmp_path, variant, objective):
    straight = train(_run_config(tmp_path, variant, objective, "straight"))
    rows = read_metrics(straight)
    assert [row["epoch"] for row in rows] == [0, 1]
    first = rows[0]
    assert first["train/global_step"] == 2 and first["train/skipped_steps"] == 0
    # the old (sampling) model starts as the policy: the first window's predictions are the same numbers
    assert first["forward/first_window_max_abs_deviation"] == 0.0
    assert first["forward/old_decay"] == pytest.approx(0.002)  # 0.001 per optimizer step, 2 steps
    assert first["train/unet_calls"] == 2 * 3  # 2 micro-batches x 3 timesteps
    assert rows[1]["forward/first_window_max_abs_deviation"] > 0  # then it lags: d = 0.002 keeps a trace
    if objective == "awm":
        assert first["approx_kl"] == pytest.approx(first["approx_kl"]) and "clipfrac" in first
    start = _weights(os.path.join(straight, "checkpoints", "checkpoint_1"))
    end = _weights(os.path.join(straight, "checkpoints", "checkpoint_2"))
    assert any(not torch.equal(start[k], end[k]) for k in start if not k.startswith("old."))

    stopped = train(_run_config(tmp_path, variant, objective, "stopped", num_epochs=1))
    resumed = train(_run_config(tmp_path, variant, objective, "stopped", resume_from=stopped))
    again = _weights(os.path.join(resumed, "checkpoints", "checkpoint_2"))
    assert set(again) == set(end) and all(torch.equal(again[k], end[k]) for k in end)
    assert read_metrics(resumed)[1]["loss"] == rows[1]["loss"]


def test_the_epoch_batch_of_a_forward_objective_holds_no_per_step_latents(tmp_path):
    trainer = Trainer(_run_config(tmp_path, "test", "nft", "batch"))
    samples = trainer.sample_epoch(0, {})
    assert samples.latents.shape[1] == 1 and samples.log_probs.shape[1] == 0
    assert samples.mask.shape == (len(samples.prompts), 1)


def test_deterministic_sampling_is_allowed_for_forward_objectives_only(tmp_path):
    check_config(_run_config(tmp_path, "test", "nft", "a", sample__eta=0.0))
    with pytest.raises(ConfigError, match="sample.eta"):
        check_config(make_config(tmp_path, variant="test", sample__eta=0.0))


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(algorithm__adv_estimator="gae"), "algorithm.adv_estimator"),
        (dict(train__skip_last_steps=1), "train.skip_last_steps"),
        (dict(forward__num_timesteps=9), "forward.num_timesteps"),
        (dict(forward__nft_beta=0.0), "forward.nft_beta"),
        (dict(forward__weighting="huber"), "forward.weighting"),
        (dict(forward__old_decay_max=1.0), "forward.old_decay_max"),
        (dict(train__objective="sft"), "train.objective"),
    ],
)
def test_bad_forward_settings_are_named(tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        check_config(_run_config(tmp_path, "test", "nft", "bad", **overrides))


def test_awm_refuses_a_policy_loss_that_couples_steps(tmp_path):
    with pytest.raises(ConfigError, match="train.policy_loss"):
        check_config(_run_config(tmp_path, "test", "awm", "bad", train__policy_loss="gspo"))
