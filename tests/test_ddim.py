"""ddim_step_with_logprob against diffusers' DDIMScheduler.step and torch.distributions.Normal."""

import math

import pytest
import torch
from diffusers import DDIMScheduler

from ddpo_group.diffusion.ddim import ddim_step_with_logprob


def make_scheduler(num_inference_steps=10, **overrides):
    config = {
        "num_train_timesteps": 1000,
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "clip_sample": False,
        "set_alpha_to_one": False,
        "steps_offset": 1,
    }
    config.update(overrides)
    scheduler = DDIMScheduler(**config)
    scheduler.set_timesteps(num_inference_steps)
    return scheduler


def sigma_by_hand(scheduler, t, eta):
    """sigma_t = eta * sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)) in plain Python."""
    a = scheduler.alphas_cumprod.tolist()
    t_prev = t - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    a_t = a[t]
    a_prev = a[t_prev] if t_prev >= 0 else float(scheduler.final_alpha_cumprod)
    return eta * math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))


def diffusers_mean(scheduler, model_output, t, sample, eta):
    """The mean of the step: diffusers' step with zero noise."""
    zeros = torch.zeros_like(sample)
    return scheduler.step(model_output, int(t), sample, eta=eta, variance_noise=zeros).prev_sample


def inputs(dtype=torch.float32, batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 4, 5, 5, generator=g, dtype=dtype)
    model_output = torch.randn(batch, 4, 5, 5, generator=g, dtype=dtype)
    return sample, model_output


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_matches_diffusers_step_with_same_generator(prediction_type, dtype):
    scheduler = make_scheduler(prediction_type=prediction_type)
    sample, model_output = inputs(dtype)
    t = scheduler.timesteps[3]
    expected = scheduler.step(model_output, t, sample, eta=0.7, generator=torch.Generator().manual_seed(5)).prev_sample
    prev_sample, _, _, _ = ddim_step_with_logprob(
        scheduler, model_output, t, sample, eta=0.7, generator=torch.Generator().manual_seed(5)
    )
    assert prev_sample.dtype == dtype
    torch.testing.assert_close(prev_sample, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_mean_and_std_match_diffusers_and_hand_formula(prediction_type):
    scheduler = make_scheduler(prediction_type=prediction_type)
    sample, model_output = inputs()
    t = int(scheduler.timesteps[2])
    _, _, mean, std = ddim_step_with_logprob(scheduler, model_output, t, sample, eta=1.0)
    torch.testing.assert_close(mean, diffusers_mean(scheduler, model_output, t, sample, 1.0), atol=1e-6, rtol=1e-6)
    assert std.shape == (3, 1, 1, 1)
    assert std.flatten().tolist() == pytest.approx([sigma_by_hand(scheduler, t, 1.0)] * 3, rel=1e-5)


def test_variance_noise_gives_mean_plus_sigma_times_noise():
    scheduler = make_scheduler()
    sample, model_output = inputs()
    noise = torch.randn(sample.shape, generator=torch.Generator().manual_seed(1))
    t = int(scheduler.timesteps[4])
    prev_sample, _, mean, _ = ddim_step_with_logprob(scheduler, model_output, t, sample, eta=0.5, variance_noise=noise)
    expected = scheduler.step(model_output, t, sample, eta=0.5, variance_noise=noise).prev_sample
    torch.testing.assert_close(prev_sample, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(prev_sample, mean + sigma_by_hand(scheduler, t, 0.5) * noise, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_prob_is_normal_log_density_averaged_over_non_batch_dims(dtype):
    scheduler = make_scheduler()
    sample, model_output = inputs(dtype)
    t = int(scheduler.timesteps[5])
    prev_sample, log_prob, _, _ = ddim_step_with_logprob(
        scheduler, model_output, t, sample, eta=1.0, generator=torch.Generator().manual_seed(2)
    )
    mean = diffusers_mean(scheduler, model_output, t, sample, 1.0)
    expected = (
        torch.distributions.Normal(mean, sigma_by_hand(scheduler, t, 1.0)).log_prob(prev_sample).mean(dim=(1, 2, 3))
    )
    assert log_prob.shape == (3,)
    assert log_prob.dtype == dtype
    torch.testing.assert_close(log_prob, expected, atol=1e-5, rtol=1e-5)


def test_given_prev_sample_is_scored_not_resampled():
    scheduler = make_scheduler()
    sample, model_output = inputs()
    target = torch.randn(sample.shape, generator=torch.Generator().manual_seed(9))
    t = int(scheduler.timesteps[0])
    prev_sample, log_prob, _, _ = ddim_step_with_logprob(
        scheduler, model_output, t, sample, eta=1.0, prev_sample=target
    )
    assert torch.equal(prev_sample, target)
    mean = diffusers_mean(scheduler, model_output, t, sample, 1.0)
    expected = torch.distributions.Normal(mean, sigma_by_hand(scheduler, t, 1.0)).log_prob(target).mean(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob, expected, atol=1e-5, rtol=1e-5)


def test_scoring_own_sample_reproduces_its_log_prob():
    scheduler = make_scheduler()
    sample, model_output = inputs()
    t = int(scheduler.timesteps[1])
    prev_sample, log_prob, _, _ = ddim_step_with_logprob(
        scheduler, model_output, t, sample, eta=1.0, generator=torch.Generator().manual_seed(0)
    )
    _, rescored, _, _ = ddim_step_with_logprob(scheduler, model_output, t, sample, eta=1.0, prev_sample=prev_sample)
    assert torch.equal(rescored, log_prob)


def test_per_sample_timesteps_match_scalar_steps_row_by_row():
    scheduler = make_scheduler()
    sample, model_output = inputs(batch=3)
    noise = torch.randn(sample.shape, generator=torch.Generator().manual_seed(4))
    timesteps = scheduler.timesteps[[0, 4, 9]]
    prev_sample, log_prob, _mean, std = ddim_step_with_logprob(
        scheduler, model_output, timesteps, sample, eta=1.0, variance_noise=noise
    )
    for i, t in enumerate(timesteps.tolist()):
        expected = scheduler.step(
            model_output[i : i + 1], t, sample[i : i + 1], eta=1.0, variance_noise=noise[i : i + 1]
        )
        torch.testing.assert_close(prev_sample[i : i + 1], expected.prev_sample, atol=1e-6, rtol=1e-6)
        assert std[i].item() == pytest.approx(sigma_by_hand(scheduler, t, 1.0), rel=1e-5)
        row_mean = diffusers_mean(scheduler, model_output[i : i + 1], t, sample[i : i + 1], 1.0)
        expected_lp = torch.distributions.Normal(row_mean, sigma_by_hand(scheduler, t, 1.0)).log_prob(
            prev_sample[i : i + 1]
        )
        assert log_prob[i].item() == pytest.approx(expected_lp.mean().item(), abs=1e-5)


def test_clip_sample_is_applied_like_diffusers():
    scheduler = make_scheduler(clip_sample=True, clip_sample_range=0.5)
    sample, model_output = inputs()
    sample = 4 * sample  # predicted x0 far outside [-0.5, 0.5]
    t = int(scheduler.timesteps[8])
    _, _, mean, _ = ddim_step_with_logprob(scheduler, model_output, t, sample, eta=1.0)
    torch.testing.assert_close(mean, diffusers_mean(scheduler, model_output, t, sample, 1.0), atol=1e-6, rtol=1e-6)
    unclipped = make_scheduler(clip_sample=False)
    _, _, mean_unclipped, _ = ddim_step_with_logprob(unclipped, model_output, t, sample, eta=1.0)
    assert not torch.allclose(mean, mean_unclipped)


def test_thresholding_is_applied_like_diffusers():
    scheduler = make_scheduler(thresholding=True, sample_max_value=2.0)
    sample, model_output = inputs()
    sample = 4 * sample
    t = int(scheduler.timesteps[8])
    _, _, mean, _ = ddim_step_with_logprob(scheduler, model_output, t, sample, eta=1.0)
    torch.testing.assert_close(mean, diffusers_mean(scheduler, model_output, t, sample, 1.0), atol=1e-6, rtol=1e-6)


def test_eta_zero_is_deterministic_ddim_with_zero_log_prob():
    scheduler = make_scheduler()
    sample, model_output = inputs()
    t = int(scheduler.timesteps[3])
    prev_sample, log_prob, mean, std = ddim_step_with_logprob(scheduler, model_output, t, sample, eta=0.0)
    expected = scheduler.step(model_output, t, sample, eta=0.0).prev_sample
    torch.testing.assert_close(prev_sample, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(prev_sample, mean)
    assert torch.equal(std, torch.zeros(3, 1, 1, 1))
    assert torch.equal(log_prob, torch.zeros(3))


def test_step_with_zero_sigma_has_zero_log_prob_not_nan():
    # set_alpha_to_one=True and steps_offset=0: the last step goes to alpha = 1, variance 0.
    scheduler = make_scheduler(set_alpha_to_one=True, steps_offset=0)
    sample, model_output = inputs()
    model_output.requires_grad_(True)
    t = int(scheduler.timesteps[-1])
    assert t == 0
    _, log_prob, _, std = ddim_step_with_logprob(scheduler, model_output, t, sample, eta=1.0)
    assert torch.equal(std, torch.zeros(3, 1, 1, 1))
    assert torch.equal(log_prob, torch.zeros(3))
    log_prob.sum().backward()
    assert torch.isfinite(model_output.grad).all()


def test_gradient_flows_to_model_output_not_to_scored_sample():
    scheduler = make_scheduler()
    sample, model_output = inputs()
    model_output.requires_grad_(True)
    target = torch.randn(sample.shape, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    _, log_prob, _, _ = ddim_step_with_logprob(
        scheduler, model_output, int(scheduler.timesteps[2]), sample, prev_sample=target
    )
    log_prob.sum().backward()
    assert model_output.grad is not None and model_output.grad.abs().sum() > 0
    assert target.grad is None


def test_bad_inputs_raise_value_error_naming_the_argument():
    scheduler = make_scheduler()
    sample, model_output = inputs()
    with pytest.raises(ValueError, match="timestep"):
        ddim_step_with_logprob(scheduler, model_output, torch.tensor([1, 2]), sample)
    with pytest.raises(ValueError, match="eta"):
        ddim_step_with_logprob(scheduler, model_output, 1, sample, eta=-1.0)
    fresh = DDIMScheduler()
    with pytest.raises(ValueError, match="set_timesteps"):
        ddim_step_with_logprob(fresh, model_output, 1, sample)
    scheduler.register_to_config(prediction_type="flow")
    with pytest.raises(ValueError, match="prediction_type"):
        ddim_step_with_logprob(scheduler, model_output, 1, sample)
