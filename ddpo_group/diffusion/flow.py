"""A rectified-flow step as a Gaussian policy: sample x_{t+1} and return its log-probability.

For a flow-matching model (SD3 / SD3.5, FLUX; diffusers' ``FlowMatchEulerDiscreteScheduler``)
the model output is a velocity v, x_sigma = (1 - sigma) x0 + sigma eps. With sigma = sigmas[i],
sigma' = sigmas[i+1] < sigma, dt = sigma' - sigma < 0 and the model's estimates

    x0_hat = x - sigma v,      eps_hat = x + (1 - sigma) v,

the deterministic Euler (ODE) step of the pipeline is x + v dt. Three stochastic steps of the
same marginals have a Gaussian density N(mean, std^2 I) (docs/flow.md), a = noise level:

    sde   (Flow-GRPO)    g = a sqrt(sigma / (1 - sigma))   (at sigma = 1: sigmas[1] in the denominator)
                         mean = x (1 + g^2 dt / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) dt
                         std  = g sqrt(-dt)
    cps   (coefficients-preserving sampling)
                         std  = sigma' sin(a pi / 2)
                         mean = (1 - sigma') x0_hat + sqrt(sigma'^2 - std^2) eps_hat
    dance (DanceGRPO)    constant diffusion: the sde drift with a in place of g, std = a sqrt(-dt)

With a = 0 every type is the ODE step (std 0: no density, mask 0). ``log_prob`` is the Gaussian
log-density of the next sample, averaged over non-batch dims, as for DDIM (``gaussian_log_prob``);
``cps_log_prob="flow_grpo"`` gives FlowCPS / Flow-GRPO's cps form instead, -mean (x' - mean)^2 (constants and
the 1 / (2 std^2) factor dropped: its log-ratios are 2 std^2 times the normalised ones). ``dance_sigmas``
is DanceGRPO's grid. Step math in float32, or in the input's dtype when wider. Pure math: no I/O, no trainer.
"""

import math

import torch

from ddpo_group.diffusion.gaussian import gaussian_log_prob, left_broadcast, step_dtype

SDE_TYPES = ("sde", "cps", "dance")
# sample.cps_log_prob: "normalized" (the Gaussian log-density per dimension, ours) or "flow_grpo" (FlowCPS's)
CPS_LOG_PROBS = ("normalized", "flow_grpo")
# sample.flow_grid: "pipeline" (the pipeline's own sigmas) or "dance" (DanceGRPO's shifted linspace, dance_sigmas)
FLOW_GRIDS = ("pipeline", "dance")


def dance_sigmas(num_steps, shift):
    """DanceGRPO's sigma grid of `num_steps` steps, float64 (num_steps + 1,), from 1 down to 0: the uniform
    grid t_i = 1 - i / num_steps, then the time shift sigma = s t / (1 + (s - 1) t) with s = `shift` (> 0)."""
    shift = float(shift)
    if not math.isfinite(shift) or shift <= 0:
        raise ValueError(f"the grid's shift must be a finite number > 0, got {shift}")
    t = torch.linspace(1.0, 0.0, int(num_steps) + 1, dtype=torch.float64)
    return shift * t / (1 + (shift - 1) * t)


def check_sigma_grid(grid):
    """ValueError unless every row of `grid` ((B, N) sigmas, N >= 2, any device) never goes up and has every sigma
    but the last > 0: the steps of a flow trajectory. Reading the values waits for the device."""
    grid = torch.as_tensor(grid).detach()
    if bool((grid[:, 1:] > grid[:, :-1]).any()) or bool((grid[:, :-1] <= 0).any()):
        raise ValueError("sigmas: a flow step goes from sigma > 0 to sigma_next <= sigma")


def _sigmas(scheduler, timestep, batch_size, device, dtype):
    """sigma, sigma' (B,) and sigmas[1] of the scheduler's grid for a scalar or (B,) timestep."""
    sigmas = getattr(scheduler, "sigmas", None)
    timesteps = getattr(scheduler, "timesteps", None)
    if sigmas is None or timesteps is None or not hasattr(scheduler.config, "shift"):
        raise ValueError(
            f"sde_step_with_logprob needs a flow-matching scheduler (FlowMatchEulerDiscreteScheduler), "
            f"got {type(scheduler).__name__}"
        )
    if len(timesteps) == 0 or len(sigmas) != len(timesteps) + 1:
        raise ValueError("the scheduler has no timesteps: call scheduler.set_timesteps(num_inference_steps) first")
    timestep = torch.as_tensor(timestep).detach().to("cpu", torch.float64)
    if timestep.ndim == 0:
        timestep = timestep.expand(batch_size)
    elif timestep.shape != (batch_size,):
        raise ValueError(f"timestep must be a scalar or have shape (B,) = ({batch_size},), got {tuple(timestep.shape)}")
    grid = timesteps.detach().to("cpu", torch.float64)
    distance = (timestep[:, None] - grid[None, :]).abs()
    index = distance.argmin(dim=1)
    if bool((distance.gather(1, index[:, None]) > 1e-3 * grid.abs().max().clamp(min=1.0)).any()):
        raise ValueError(f"timestep {timestep.tolist()} is not on the scheduler's grid {grid.tolist()}")
    sigmas = sigmas.detach().to("cpu", torch.float64)
    sigma, sigma_next = sigmas[index], sigmas[index + 1]
    return (
        sigma.to(device=device, dtype=dtype),
        sigma_next.to(device=device, dtype=dtype),
        float(sigmas[1]) if len(sigmas) > 1 else 0.0,
    )


def sde_step_with_logprob(
    scheduler,
    model_output,
    timestep,
    sample,
    noise_level=0.7,
    sde_type="sde",
    prev_sample=None,
    generator=None,
    sigmas=None,
    with_log_prob=True,
    cps_log_prob="normalized",
    check_sigmas=True,
):
    """One flow-matching step x_t -> x_{t+1} with its Gaussian log-probability (module docstring).

    Args:
        scheduler: a ``FlowMatchEulerDiscreteScheduler`` after ``set_timesteps``.
        model_output: velocity v, shape of ``sample`` (any float dtype).
        timestep: scalar or (B,) timesteps from ``scheduler.timesteps`` (sigma * num_train_timesteps).
        sample: x_t, (B, ...) latents (unpacked (B, C, h, w) or packed (B, N, D)).
        noise_level: a >= 0 (<= 1 for "cps"); 0 gives the pipeline's deterministic ODE step.
        sde_type: "sde" (Flow-GRPO), "cps" or "dance" (DanceGRPO).
        prev_sample: x_{t+1} to score instead of drawing one.
        generator: torch.Generator for the noise (``randn_tensor``), when drawing.
        sigmas: (sigma, sigma_next, sigma_1), each (B,): the step's own grid values (sigma_1 = the grid's
            second sigma, used in the sde step's denominator at sigma = 1). Trajectories store their grid and
            pass it here, so re-scoring never reads the scheduler, whose grid a later ``set_timesteps`` (an
            evaluation, another pipeline call) may have changed. None: looked up on the scheduler's grid.
        with_log_prob: False skips the density (log_prob is None): a sampler whose trainer reads no log-probs.
        cps_log_prob: "normalized" (the Gaussian log-density per dimension) or, with sde_type="cps" only,
            "flow_grpo": -mean over dimensions of (prev_sample - mean)^2 (FlowCPS / Flow-GRPO's cps), 0 where
            std = 0. Same samples, same means and stds; only the log-prob (and so the ratio's scale) differs.
        check_sigmas: check the given `sigmas` (``check_sigma_grid``); False for a caller that checked its whole
            grid once (the sampler), as reading them back waits for the device in every step.

    Returns:
        prev_sample, log_prob (B,) (0 where std = 0), prev_sample_mean, std_dev_t (B, 1, ...) the
        Gaussian std. All float32 (or the input's dtype when wider).
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    noise_level = float(noise_level)
    if not math.isfinite(noise_level) or noise_level < 0:
        raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level}")
    if sde_type == "cps" and noise_level > 1:
        raise ValueError(f"noise_level must lie in [0, 1] for sde_type='cps' (std = sigma' sin(a pi / 2)), got {noise_level}")
    if cps_log_prob not in CPS_LOG_PROBS:
        raise ValueError(f"cps_log_prob must be one of {CPS_LOG_PROBS}, got {cps_log_prob!r}")
    if cps_log_prob == "flow_grpo" and sde_type != "cps":
        raise ValueError(f"cps_log_prob='flow_grpo' is the log-prob of sde_type='cps'; got sde_type={sde_type!r}")
    if prev_sample is not None and generator is not None:
        raise ValueError("pass prev_sample (to score it) or generator (to draw one), not both")

    dtype = step_dtype(sample.dtype)
    x = sample.to(dtype)
    v = model_output.to(dtype)
    if sigmas is None:
        sigma, sigma_next, sigma_1 = _sigmas(scheduler, timestep, x.shape[0], x.device, dtype)
        sigma_1 = torch.full((x.shape[0],), sigma_1, device=x.device, dtype=dtype)
    else:
        sigma, sigma_next, sigma_1 = (torch.as_tensor(v).to(device=x.device, dtype=dtype).reshape(-1) for v in sigmas)
        if not sigma.shape == sigma_next.shape == sigma_1.shape == (x.shape[0],):
            raise ValueError(f"sigmas must be three (B,) = ({x.shape[0]},) tensors, got "
                             f"{[tuple(v.shape) for v in (sigma, sigma_next, sigma_1)]}")
        if check_sigmas:  # reading the values waits for the device: a caller that checked its grid once skips it
            check_sigma_grid(torch.stack([sigma, sigma_next], dim=1))
    sigma = left_broadcast(sigma, x.shape)
    sigma_next = left_broadcast(sigma_next, x.shape)
    sigma_1 = left_broadcast(sigma_1, x.shape)
    dt = sigma_next - sigma
    a = noise_level

    if sde_type == "cps":
        std = sigma_next * math.sin(a * math.pi / 2)
        x0_hat = x - sigma * v
        eps_hat = x + (1 - sigma) * v
        mean = (1 - sigma_next) * x0_hat + torch.sqrt((sigma_next**2 - std**2).clamp(min=0)) * eps_hat
    else:
        if sde_type == "sde":
            denominator = 1 - torch.where(sigma == 1, sigma_1, sigma)
            g = a * torch.sqrt(sigma / denominator)
        else:
            g = torch.full_like(sigma, a)
        mean = x * (1 + g**2 * dt / (2 * sigma)) + v * (1 + g**2 * (1 - sigma) / (2 * sigma)) * dt
        std = g * torch.sqrt(-dt)

    if prev_sample is None:
        from diffusers.utils.torch_utils import randn_tensor  # here: the config check (training/rollout.py) imports this module's constants

        noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=dtype)
        prev_sample = mean + std * noise if a > 0 else mean
    prev_sample = prev_sample.to(dtype)
    if not with_log_prob:
        log_prob = None
    elif cps_log_prob == "flow_grpo":
        squared = (prev_sample.detach() - mean) ** 2
        log_prob = -torch.where(std > 0, squared, torch.zeros_like(squared)).mean(dim=tuple(range(1, x.ndim)))
    else:
        log_prob = gaussian_log_prob(prev_sample, mean, std)
    std = std[(slice(None),) + (slice(0, 1),) * (x.ndim - 1)]
    return prev_sample, log_prob, mean, std
