"""The DDIM scheduler step as a Gaussian policy: sample x_{t+1} and return its log-probability.

A denoising step of DDIM with eta > 0 (Song et al., 2020, eq. 12 and 16) is the Gaussian

    x_{t+1} ~ N(mu_theta(x_t, t, c), sigma_t^2 I),
    sigma_t = eta * sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)),

where a_t = alphas_cumprod[t] and a_prev = alphas_cumprod[t - T_train // T] (or the
scheduler's final_alpha_cumprod when that index is negative). The mean is diffusers'
``DDIMScheduler.step`` without its noise term:

    x0_hat = predicted original sample (from epsilon, v or x0 prediction, clipped or
             thresholded as the scheduler config says)
    eps_hat = predicted noise
    mu = sqrt(a_prev) * x0_hat + sqrt(1 - a_prev - sigma_t^2) * eps_hat

This is ddpo-pytorch's ``ddim_step_with_logprob``, extended to per-sample timesteps,
all prediction types and clip_sample / thresholding. Pure math: no I/O, no trainer.

Precision (docs/design.md §10): the schedule terms, the mean, the std and the log-density are
computed in float32, or in the input's dtype when that is wider (float64), whatever dtype the
UNet ran in. In bfloat16, 1 - alpha_t / alpha_prev rounds to 0 for close timesteps (sigma = 0:
a step without density) and (x - mu)^2 / (2 sigma^2) loses every digit that PPO's ratio needs.
"""

import torch
from diffusers.utils.torch_utils import randn_tensor

from ddpo_group.diffusion.gaussian import gaussian_log_prob, left_broadcast, step_dtype

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


def _scheduler_alphas(scheduler, timestep, batch_size, device, dtype):
    """alpha_prod_t, alpha_prod_t_prev (B,) of diffusers' DDIM for a scalar or (B,) timestep."""
    if scheduler.num_inference_steps is None:
        raise ValueError(
            "scheduler.num_inference_steps is None: call scheduler.set_timesteps(num_inference_steps) "
            "before ddim_step_with_logprob"
        )
    timestep = torch.as_tensor(timestep, device="cpu").long()
    if timestep.ndim == 0:
        timestep = timestep.expand(batch_size)
    elif timestep.shape != (batch_size,):
        raise ValueError(f"timestep must be a scalar or have shape (B,) = ({batch_size},), got {tuple(timestep.shape)}")
    prev_timestep = timestep - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    alphas_cumprod = scheduler.alphas_cumprod.cpu()
    alpha_prod_t = alphas_cumprod.gather(0, timestep)
    alpha_prod_t_prev = torch.where(
        prev_timestep >= 0,
        alphas_cumprod.gather(0, prev_timestep.clamp(min=0)),
        torch.as_tensor(scheduler.final_alpha_cumprod, dtype=alphas_cumprod.dtype),
    )
    return alpha_prod_t.to(device=device, dtype=dtype), alpha_prod_t_prev.to(device=device, dtype=dtype)


def flow_time_step(scheduler, timesteps, num_inference_steps):
    """(B,) float32 length in flow time of DDIM steps from `timesteps` (B,) on a T = num_inference_steps grid.

    x_t / (sqrt(a) + sqrt(1 - a)) is the flow-matching latent at sigma(a) = sqrt(1 - a) / (sqrt(a) + sqrt(1 - a))
    (a = alphas_cumprod) and the DDIM ODE is that latent's flow ODE, so a step from a_t to a_prev (the scheduler's
    own, as `ddim_step_with_logprob` takes it) has dt = sigma(a_t) - sigma(a_prev) > 0.
    """
    if scheduler.num_inference_steps != num_inference_steps:
        scheduler.set_timesteps(num_inference_steps)
    alpha, alpha_prev = _scheduler_alphas(scheduler, timesteps, len(timesteps), "cpu", torch.float64)

    def sigma(a):
        return (1 - a).sqrt() / (a.sqrt() + (1 - a).sqrt())

    return (sigma(alpha) - sigma(alpha_prev)).float()


def ddim_step_with_logprob(
    scheduler,
    model_output,
    timestep,
    sample,
    eta=1.0,
    prev_sample=None,
    generator=None,
    variance_noise=None,
    with_log_prob=True,
):
    """One DDIM step x_t -> x_{t+1} (diffusers' "prev sample") with its Gaussian log-probability.

    Args:
        scheduler: a diffusers ``DDIMScheduler`` after ``set_timesteps``.
        model_output: (B, C, H, W) UNet output (after classifier-free guidance).
        timestep: scalar int / 0-dim tensor, or a (B,) tensor of scheduler timesteps.
        sample: (B, C, H, W) current latents x_t.
        eta: DDIM noise weight (0 = deterministic DDIM, 1 = DDPM-like).
        prev_sample: optional (B, C, H, W) x_{t+1} to score instead of drawing one.
        generator: torch.Generator (or list of B) for the noise, drawn as diffusers does
            (``randn_tensor(model_output.shape, generator)``, only when eta > 0), so the
            same generator gives the same sample as ``DDIMScheduler.step``.
        variance_noise: optional (B, C, H, W) standard normal noise to use instead of drawing.
        with_log_prob: False skips the density (log_prob is None): a sampler whose trainer reads no log-probs.

    Formula (see the module docstring): x_{t+1} = mu + sigma_t * z with z ~ N(0, I), and
    log_prob = mean over non-batch dims of log N(x_{t+1}; mu, sigma_t^2); 0 where sigma_t = 0.

    Returns:
        prev_sample (B, C, H, W), log_prob (B,), prev_sample_mean (B, C, H, W),
        std_dev_t (B, 1, 1, 1). All in float32, or in ``sample``'s dtype when it is wider
        (float64); ``model_output``, ``sample`` and ``prev_sample`` may be float16 / bfloat16.
    """
    prediction_type = scheduler.config.prediction_type
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"scheduler.config.prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if prev_sample is not None and (generator is not None or variance_noise is not None):
        raise ValueError("pass prev_sample (to score it) or generator / variance_noise (to draw one), not both")

    dtype = step_dtype(sample.dtype)
    sample = sample.to(dtype)
    model_output = model_output.to(dtype)
    batch_size = sample.shape[0]
    alpha_prod_t, alpha_prod_t_prev = _scheduler_alphas(scheduler, timestep, batch_size, sample.device, dtype)
    alpha_prod_t = left_broadcast(alpha_prod_t, sample.shape)
    alpha_prod_t_prev = left_broadcast(alpha_prod_t_prev, sample.shape)
    beta_prod_t = 1 - alpha_prod_t

    if prediction_type == "epsilon":
        pred_original_sample = (sample - beta_prod_t ** (0.5) * model_output) / alpha_prod_t ** (0.5)
        pred_epsilon = model_output
    elif prediction_type == "sample":
        pred_original_sample = model_output
        pred_epsilon = (sample - alpha_prod_t ** (0.5) * pred_original_sample) / beta_prod_t ** (0.5)
    else:
        pred_original_sample = (alpha_prod_t**0.5) * sample - (beta_prod_t**0.5) * model_output
        pred_epsilon = (alpha_prod_t**0.5) * model_output + (beta_prod_t**0.5) * sample

    if scheduler.config.thresholding:
        pred_original_sample = scheduler._threshold_sample(pred_original_sample)
    elif scheduler.config.clip_sample:
        clip_range = scheduler.config.clip_sample_range
        pred_original_sample = pred_original_sample.clamp(-clip_range, clip_range)

    beta_prod_t_prev = 1 - alpha_prod_t_prev
    variance = (beta_prod_t_prev / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
    std_dev_t = eta * variance ** (0.5)

    pred_sample_direction = (1 - alpha_prod_t_prev - std_dev_t**2) ** (0.5) * pred_epsilon
    prev_sample_mean = alpha_prod_t_prev ** (0.5) * pred_original_sample + pred_sample_direction

    if prev_sample is None:
        if eta > 0:
            if variance_noise is None:
                variance_noise = randn_tensor(
                    model_output.shape, generator=generator, device=model_output.device, dtype=dtype
                )
            prev_sample = prev_sample_mean + std_dev_t * variance_noise.to(dtype)
        else:
            prev_sample = prev_sample_mean
    prev_sample = prev_sample.to(dtype)

    log_prob = gaussian_log_prob(prev_sample, prev_sample_mean, std_dev_t) if with_log_prob else None
    std_dev_t = std_dev_t[(slice(None),) + (slice(0, 1),) * (sample.ndim - 1)]
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


def ddim_x0_hat(scheduler, model_output, timesteps, x_t):
    """The one-step prediction of the clean latent from a DDPM/DDIM model output, float32 (B, C, h, w).

    epsilon:      x0_hat = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t)      (Tweedie's formula)
    v_prediction: x0_hat = sqrt(abar_t) x_t - sqrt(1 - abar_t) v
    sample:       x0_hat = model_output
    abar_t = scheduler.alphas_cumprod[t], t (B,) or a scalar. No clipping (the scheduler's clip_sample is a
    sampling choice, not part of the prediction). The anchor critic reads it (ddpo_group/training/critic_designs.py).
    """
    x_t, model_output = x_t.float(), model_output.float()
    timesteps = torch.as_tensor(timesteps, device="cpu").long().reshape(-1)
    abar = scheduler.alphas_cumprod.cpu().float()[timesteps].to(x_t.device)
    abar = abar.expand(x_t.shape[0]).reshape(-1, *([1] * (x_t.dim() - 1)))
    prediction_type = scheduler.config.prediction_type
    if prediction_type == "epsilon":
        return (x_t - (1 - abar).sqrt() * model_output) / abar.sqrt()
    if prediction_type == "v_prediction":
        return abar.sqrt() * x_t - (1 - abar).sqrt() * model_output
    if prediction_type == "sample":
        return model_output
    raise ValueError(f"scheduler.config.prediction_type={prediction_type!r} has no x0 prediction")
