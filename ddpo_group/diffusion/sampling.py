"""Denoising trajectories as token sequences: sampling and re-scoring with a diffusers pipeline.

A trajectory of T DDIM steps is a sequence of T "tokens"; token t is the transition
x_t -> x_{t+1} (t = 0 is the noisiest) with log-probability log pi(x_{t+1} | x_t, c)
from ``ddim_step_with_logprob``. Sampling (``sample_trajectories``) and re-scoring
(``trajectory_log_probs``, ``step_log_prob``) run the same function on the same batch
composition, so re-scoring with unchanged weights reproduces the sampled log-probs
exactly (the PPO ratio is exactly 1).

Works with any ``StableDiffusionPipeline`` (SD 1.x / 2.x, or the tiny one) whose scheduler
is a ``DDIMScheduler``. Classifier-free guidance follows the pipeline:
eps = eps_uncond + w * (eps_cond - eps_uncond) when w > 1, from one UNet call on the
concatenated [uncond, cond] batch.

Precision: the UNet runs in its own dtype (fp16 / bf16 weights, or autocast); its inputs are
cast to it. Everything else is float32: the latents of a trajectory, the guidance combination,
the DDIM step and its log-density (``ddim_step_with_logprob``), the stored ``log_probs``.
"""

from dataclasses import dataclass, fields

import torch
from tqdm.auto import tqdm

from ddpo_group.diffusion.ddim import ddim_step_with_logprob


def _per_row(field):
    """False for a field that describes the whole batch (not indexed, not concatenated)."""
    return field.metadata.get("per_row", True)


@dataclass
class Trajectories:
    """A batch of B denoising trajectories of T steps.

    images (B, 3, H, W) float in [0, 1]; latents (B, T+1, C, h, w) float32: x_0 (noise) ... x_T;
    log_probs (B, T) float32; timesteps (B, T) (int64 for DDIM); prompt_embeds (B, L, D);
    negative_prompt_embeds (B, L, D) or None (no guidance); mask (B, T) float, 0 where
    std_dev_t == 0; prompts list of B str; prompt_ids (B,) int64 (the GRPO group key);
    pooled_prompt_embeds, negative_pooled_prompt_embeds (B, D') or None: the pooled text
    embeddings of families that condition on them (SD3, FLUX; None for SD 1.x / 2.x); sigmas (B, T+1)
    float32: the flow families' noise grid the trajectory was sampled on (None for DDIM), so that
    re-scoring uses the trajectory's own grid whatever the scheduler holds by then.

    Sampled with ``keep_steps=False`` (the forward-process objectives, docs/forward.md) a batch keeps
    only its clean latents: latents (B, 1, C, h, w) = x_T, log_probs and mask (B, 0); timesteps stay (B, T).

    ``index``, ``to`` and ``cat`` carry every declared field, those of subclasses too: a tensor
    field is indexed on dim 0, a dict field value by value, a field declared with
    ``metadata={"per_row": False}`` (a whole-batch view) is kept by ``index`` / ``to`` and dropped by ``cat``.
    """

    images: torch.Tensor
    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None
    mask: torch.Tensor
    prompts: list
    prompt_ids: torch.Tensor
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    sigmas: torch.Tensor | None = None

    def __len__(self):
        return self.latents.shape[0]

    def index(self, idx):
        """The trajectories selected by ``idx`` (int, slice, list or tensor of indices / bool mask on dim 0)."""
        if isinstance(idx, int):
            idx = [idx]
        if isinstance(idx, slice):
            prompts = self.prompts[idx]
        else:
            positions = torch.arange(len(self))[torch.as_tensor(idx).cpu()]
            prompts = [self.prompts[i] for i in positions.tolist()]
            idx = positions

        def select(value):
            return value[idx.to(value.device) if torch.is_tensor(idx) else idx]

        values = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "prompts":
                values[field.name] = prompts
            elif value is None or not _per_row(field):
                values[field.name] = value
            elif isinstance(value, dict):
                values[field.name] = {key: select(v) for key, v in value.items()}
            else:
                values[field.name] = select(value)
        return type(self)(**values)

    def to(self, device):
        """A copy with every per-row tensor on ``device``."""
        values = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, dict) and _per_row(field):
                value = {key: v.to(device) for key, v in value.items()}
            elif torch.is_tensor(value):
                value = value.to(device)
            values[field.name] = value
        return type(self)(**values)

    @classmethod
    def cat(cls, batches):
        """Concatenate several batches along the batch dim (prompt_ids are kept as they are)."""
        values = {}
        for field in fields(cls):
            parts = [getattr(batch, field.name, None) for batch in batches]
            if field.name == "prompts":
                values[field.name] = [prompt for part in parts for prompt in part]
            elif not _per_row(field) or any(part is None for part in parts):
                values[field.name] = None
            elif isinstance(parts[0], dict):
                values[field.name] = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
            else:
                values[field.name] = torch.cat(parts)
        return cls(**values)


def noise_levels(eta, num_steps):
    """Per-step noise levels (T,): `eta` for every step, or a sequence of num_steps values (0: a deterministic step)."""
    if isinstance(eta, (int, float)):
        levels = [float(eta)] * num_steps
    else:
        levels = [float(level) for level in eta]
        if len(levels) != num_steps:
            raise ValueError(f"eta must be a number or one value per step ({num_steps}), got {len(levels)} values")
    if any(not level >= 0 for level in levels):
        raise ValueError(f"eta (noise level) must be >= 0 at every step, got {levels}")
    return levels


def window_noise_levels(eta, num_steps, window_size=0, mode="fixed", start=0, shift_every=1, epoch=0, seed=0):
    """The ODE/SDE window of an epoch (Flow-GRPO-Fast, MixGRPO): eta inside, 0 (an ODE step) outside. (T,) list.

    window_size 0: every step is stochastic. mode "fixed": steps [start, start + size); "random": a start
    drawn per epoch from `seed` (the same on every process); "sliding": start + epoch // shift_every,
    wrapping around the T - size + 1 possible starts (MixGRPO's moving window).
    """
    if not window_size:
        return noise_levels(eta, num_steps)
    if not 0 < window_size <= num_steps:
        raise ValueError(f"config.sample.sde_window_size={window_size} must lie in [0, sample.num_steps={num_steps}]")
    starts = num_steps - window_size + 1
    if mode == "fixed":
        if not 0 <= start < starts:
            raise ValueError(
                f"config.sample.sde_window_start={start} puts the window outside the {num_steps} steps; "
                f"choose a start in [0, {starts - 1}]"
            )
        first = start
    elif mode == "random":
        first = int(torch.randint(starts, (1,), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)))
    elif mode == "sliding":
        first = (start + epoch // max(1, shift_every)) % starts
    else:
        raise ValueError(f"config.sample.sde_window={mode!r} is not one of ['fixed', 'random', 'sliding']")
    return [float(eta) if first <= i < first + window_size else 0.0 for i in range(num_steps)]


def final_latents_only(latents):
    """The step fields of trajectories sampled with keep_steps=False: latents (B, 1, ...) = the clean x_T,
    log_probs and mask (B, 0) (no step carries a density the trainer reads)."""
    empty = torch.zeros(latents.shape[0], 0, device=latents.device, dtype=torch.float32)
    return {"latents": latents.unsqueeze(1), "log_probs": empty, "mask": empty.clone()}


def default_prompt_ids(prompts):
    """(B,) int64: for each prompt, the batch index of the first appearance of the same prompt."""
    first_index = {}
    return torch.tensor([first_index.setdefault(prompt, i) for i, prompt in enumerate(prompts)], dtype=torch.int64)


def model_dtype(module):
    """The dtype a model's inputs are cast to: that of its first floating-point parameter.

    Works through DDP / ``torch.compile`` wrappers and for the reference policy (its ``unet``);
    float32 when the module has no parameters.
    """
    module = getattr(module, "module", module)
    module = getattr(module, "unet", module) if not isinstance(module, torch.nn.Module) else module
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def _predict_noise(unet, latents, timesteps, prompt_embeds, negative_prompt_embeds, guidance_scale):
    """UNet prediction with classifier-free guidance: (B, C, h, w) float32.

    When guidance_scale > 1: one call on cat([x, x]) with cat([uncond, cond]) embeddings,
    then eps_uncond + guidance_scale * (eps_cond - eps_uncond) (the pipeline's expression),
    computed in float32. The UNet's inputs are cast to its dtype.
    """
    dtype = model_dtype(unet)
    if guidance_scale > 1.0:
        if negative_prompt_embeds is None:
            raise ValueError("guidance_scale > 1 needs negative_prompt_embeds (the unconditional embeddings)")
        model_input = torch.cat([latents, latents]).to(dtype)
        noise_pred = unet(
            model_input,
            torch.cat([timesteps, timesteps]),
            encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds]).to(dtype),
            return_dict=False,
        )[0]
        noise_pred_uncond, noise_pred_text = noise_pred.float().chunk(2)
        return noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
    return unet(latents.to(dtype), timesteps, encoder_hidden_states=prompt_embeds.to(dtype), return_dict=False)[0].float()


def _denoise_step(
    unet,
    scheduler,
    latents_t,
    timesteps_t,
    prompt_embeds,
    negative_prompt_embeds,
    guidance_scale,
    eta,
    latents_next=None,
    generator=None,
    with_log_prob=True,
):
    """The one step function shared by sampling and re-scoring: returns ddim_step_with_logprob's 4-tuple."""
    timesteps_t = torch.as_tensor(timesteps_t, device=latents_t.device)
    if timesteps_t.ndim == 0:
        timesteps_t = timesteps_t.expand(latents_t.shape[0])
    model_input = scheduler.scale_model_input(latents_t, timesteps_t)
    noise_pred = _predict_noise(unet, model_input, timesteps_t, prompt_embeds, negative_prompt_embeds, guidance_scale)
    return ddim_step_with_logprob(
        scheduler, noise_pred, timesteps_t, latents_t, eta=eta, prev_sample=latents_next, generator=generator,
        with_log_prob=with_log_prob,
    )


def step_log_prob(
    unet,
    scheduler,
    latents_t,
    latents_next,
    timesteps_t,
    prompt_embeds,
    negative_prompt_embeds,
    guidance_scale,
    eta,
    num_inference_steps=None,
):
    """Log-probability of the stored step x_t -> x_{t+1} under the current UNet, with autograd.

    Args: latents_t, latents_next (B, C, h, w); timesteps_t (B,) (or a scalar);
    prompt_embeds, negative_prompt_embeds (B, L, D) (negative ones unused when
    guidance_scale <= 1). The DDIM step size is 1000 // T with T the scheduler's
    ``num_inference_steps``: pass ``num_inference_steps`` = T of the sampling run (the
    scheduler is reset to it when it differs), or keep the scheduler as sampling left it.

    Returns: log_prob (B,) = mean over (C, h, w) of log N(x_{t+1}; mu_theta(x_t, t, c), sigma_t^2),
    prev_sample_mean mu_theta (B, C, h, w), std_dev_t sigma_t (B, 1, 1, 1).
    """
    if num_inference_steps is not None and scheduler.num_inference_steps != num_inference_steps:
        scheduler.set_timesteps(num_inference_steps, device=latents_t.device)
    _, log_prob, prev_sample_mean, std_dev_t = _denoise_step(
        unet,
        scheduler,
        latents_t,
        timesteps_t,
        prompt_embeds,
        negative_prompt_embeds,
        guidance_scale,
        eta,
        latents_next=latents_next,
    )
    return log_prob, prev_sample_mean, std_dev_t


def _encode_prompts(pipeline, prompts, negative_prompt, do_cfg, device):
    prompt_embeds, negative_prompt_embeds = pipeline.encode_prompt(
        prompts,
        device,
        1,
        do_cfg,
        negative_prompt=[negative_prompt] * len(prompts) if do_cfg else None,
    )
    return prompt_embeds, (negative_prompt_embeds if do_cfg else None)


@torch.no_grad()
def sample_trajectories(
    pipeline,
    prompts,
    num_inference_steps,
    guidance_scale,
    eta,
    generator=None,
    prompt_ids=None,
    negative_prompt="",
    unet=None,
    show_progress=False,
    height=None,
    keep_steps=True,
):
    """Sample B = len(prompts) trajectories x_0 -> x_T with their per-step log-probabilities.

    Any supported pipeline: a flow-matching one (SD3, FLUX) is sampled by its family's policy
    (``ddpo_group.diffusion.flow_policy``), with eta the noise level of its SDE steps.

    Steps, in the pipeline's order (so eta = 0 reproduces ``pipeline(prompts, ...)``):
    encode prompts (``pipeline.encode_prompt``, negative prompt for CFG); draw x_0 with
    ``pipeline.prepare_latents`` and ``generator``; for each scheduler timestep t_k,
    x_{k+1}, log_prob_k = ddim_step_with_logprob(eps_cfg(x_k, t_k), ...) (noise from
    ``generator``); images = clamp(vae.decode(x_T / scaling_factor) / 2 + 0.5, 0, 1).

    Args:
        pipeline: a diffusers StableDiffusionPipeline with a DDIMScheduler.
        prompts: list of B strings (a str is one prompt).
        num_inference_steps: T.
        guidance_scale: CFG weight w (no CFG, no negative embeddings when w <= 1).
        eta: DDIM eta (> 0 for a stochastic policy; 0 gives mask 0 everywhere), or one value per step.
        generator: torch.Generator (or list of B) for the initial noise and the step noise.
        prompt_ids: optional (B,) group keys; default ``default_prompt_ids(prompts)``.
        negative_prompt: the unconditional prompt for CFG.
        unet: optional module used instead of ``pipeline.unet`` (e.g. DDP-wrapped).
        show_progress: tqdm bar over the steps.
        height: image side in pixels (None: the UNet's sample size x the VAE scale factor).
        keep_steps: False keeps only the clean latents x_T and computes no log-probability (the
            forward-process objectives read nothing else; ``Trajectories``' docstring).

    Returns: Trajectories (see its docstring), no autograd graph.
    """
    if not _is_ddim_family(pipeline):
        from ddpo_group.diffusion.policy import policy_for

        return policy_for(pipeline).sample(
            prompts, num_inference_steps, guidance_scale, eta, generator=generator, prompt_ids=prompt_ids,
            negative_prompt=negative_prompt, model=unet, show_progress=show_progress, keep_steps=keep_steps,
        )
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    if prompt_ids is None:
        prompt_ids = default_prompt_ids(prompts)
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.int64)
    if prompt_ids.shape != (len(prompts),):
        raise ValueError(f"prompt_ids must have shape (B,) = ({len(prompts)},), got {tuple(prompt_ids.shape)}")
    unet = pipeline.unet if unet is None else unet
    scheduler = pipeline.scheduler
    device = pipeline._execution_device
    batch_size = len(prompts)
    do_cfg = guidance_scale > 1.0

    prompt_embeds, negative_prompt_embeds = _encode_prompts(pipeline, prompts, negative_prompt, do_cfg, device)

    scheduler.set_timesteps(num_inference_steps, device=device)
    timesteps = scheduler.timesteps
    height = height or pipeline.unet.config.sample_size * pipeline.vae_scale_factor
    width = height
    levels = noise_levels(eta, len(timesteps))
    # float32 latents whatever the model dtype: the trajectory is the policy's data (module docstring)
    latents = pipeline.prepare_latents(
        batch_size, pipeline.unet.config.in_channels, height, width, torch.float32, device, generator
    )

    all_latents = [latents]
    all_log_probs = []
    all_stds = []
    for i, t in enumerate(tqdm(timesteps, disable=not show_progress, desc="sampling", leave=False)):
        latents, log_prob, _, std_dev_t = _denoise_step(
            unet,
            scheduler,
            latents,
            t.expand(batch_size),
            prompt_embeds,
            negative_prompt_embeds,
            guidance_scale,
            levels[i],
            generator=generator,
            with_log_prob=keep_steps,
        )
        if keep_steps:
            all_latents.append(latents)
            all_log_probs.append(log_prob)
            all_stds.append(std_dev_t.reshape(batch_size))

    vae = pipeline.vae
    images = vae.decode((latents / vae.config.scaling_factor).to(vae.dtype), return_dict=False)[0]
    images = (images.float() / 2 + 0.5).clamp(0, 1)

    steps = final_latents_only(latents) if not keep_steps else {
        "latents": torch.stack(all_latents, dim=1),
        "log_probs": torch.stack(all_log_probs, dim=1),
        "mask": (torch.stack(all_stds, dim=1) > 0).to(torch.float32),
    }
    return Trajectories(
        images=images,
        timesteps=timesteps.to(torch.int64).unsqueeze(0).repeat(batch_size, 1),
        prompt_embeds=prompt_embeds,
        negative_prompt_embeds=negative_prompt_embeds,
        prompts=prompts,
        prompt_ids=prompt_ids,
        **steps,
    )


def trajectory_log_probs(
    pipeline,
    trajectories,
    guidance_scale,
    eta,
    step_indices=None,
    return_means=False,
    unet=None,
    micro_batch_size=None,
):
    """Re-score stored steps with the current weights: log pi_theta(x_{k+1} | x_k, c) for k in step_indices.

    One UNet call per (step, micro-batch); never B * T samples at once. With the default
    ``micro_batch_size=None`` each call holds the whole batch of B, as in sampling, so with
    unchanged weights the result equals ``trajectories.log_probs`` exactly.
    Autograd follows the caller's grad mode.

    Args:
        step_indices: None (all T steps), a (K,) list / tensor of step indices shared by the
            batch, or a (B, K) tensor of per-trajectory step indices.
        return_means: also return the means mu_theta (B, K, C, h, w) and std_dev_t (B, K, 1, 1, 1).
        unet: optional module used instead of ``pipeline.unet``.
        micro_batch_size: trajectories per UNet call (None: all B).

    Returns: log_probs (B, K) [, means, stds].

    A flow-matching pipeline is re-scored by its family's ``step_log_prob`` (eta: the noise level).
    """
    if not _is_ddim_family(pipeline):
        return _flow_trajectory_log_probs(pipeline, trajectories, guidance_scale, eta, step_indices, return_means, unet,
                                          micro_batch_size)
    unet = pipeline.unet if unet is None else unet
    scheduler = pipeline.scheduler
    batch_size, num_steps = trajectories.timesteps.shape
    if step_indices is None:
        step_indices = torch.arange(num_steps)
    step_indices = torch.as_tensor(step_indices, dtype=torch.int64, device=trajectories.latents.device)
    if step_indices.ndim == 1:
        step_indices = step_indices.unsqueeze(0).expand(batch_size, -1)
    if step_indices.ndim != 2 or step_indices.shape[0] != batch_size:
        raise ValueError(
            f"step_indices must have shape (K,) or (B, K) with B = {batch_size}, got {tuple(step_indices.shape)}"
        )
    if step_indices.shape[1] == 0:
        raise ValueError("step_indices must select at least one step")
    if step_indices.min() < 0 or step_indices.max() >= num_steps:
        raise ValueError(f"step_indices must lie in [0, T) = [0, {num_steps})")
    micro_batch_size = batch_size if micro_batch_size is None else micro_batch_size
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")

    rows = torch.arange(batch_size, device=step_indices.device)
    log_probs, means, stds = [], [], []
    for k in range(step_indices.shape[1]):
        step = step_indices[:, k]
        step_log_probs, step_means, step_stds = [], [], []
        for start in range(0, batch_size, micro_batch_size):
            sel = rows[start : start + micro_batch_size]
            negative = trajectories.negative_prompt_embeds
            log_prob, mean, std = step_log_prob(
                unet,
                scheduler,
                trajectories.latents[sel, step[sel]],
                trajectories.latents[sel, step[sel] + 1],
                trajectories.timesteps[sel, step[sel]],
                trajectories.prompt_embeds[sel],
                None if negative is None else negative[sel],
                guidance_scale,
                eta,
                num_inference_steps=num_steps,
            )
            step_log_probs.append(log_prob)
            if return_means:
                step_means.append(mean)
                step_stds.append(std)
        log_probs.append(torch.cat(step_log_probs))
        if return_means:
            means.append(torch.cat(step_means))
            stds.append(torch.cat(step_stds))
    log_probs_out = torch.stack(log_probs, dim=1)
    if return_means:
        return log_probs_out, torch.stack(means, dim=1), torch.stack(stds, dim=1)
    return log_probs_out


def _is_ddim_family(pipeline):
    from diffusers import StableDiffusionPipeline

    return isinstance(pipeline, StableDiffusionPipeline)


def _flow_trajectory_log_probs(pipeline, trajectories, guidance_scale, eta, step_indices, return_means, model,
                               micro_batch_size):
    from ddpo_group.diffusion.policy import policy_for

    policy = policy_for(pipeline)
    model = policy.trainable_module if model is None else model
    batch_size, num_steps = trajectories.timesteps.shape
    step_indices = torch.arange(num_steps) if step_indices is None else torch.as_tensor(step_indices, dtype=torch.int64)
    if step_indices.ndim == 1:
        step_indices = step_indices.unsqueeze(0).expand(batch_size, -1)
    micro_batch_size = micro_batch_size or batch_size
    rows = torch.arange(batch_size, device=trajectories.latents.device)
    log_probs, means, stds = [], [], []
    for k in range(step_indices.shape[1]):
        parts = [
            policy.step_log_prob(model, trajectories, rows[i : i + micro_batch_size],
                                 step_indices[i : i + micro_batch_size, k].to(rows.device), guidance_scale, eta)
            for i in range(0, batch_size, micro_batch_size)
        ]
        log_probs.append(torch.cat([p[0] for p in parts]))
        means.append(torch.cat([p[1] for p in parts]))
        stds.append(torch.cat([p[2] for p in parts]))
    if return_means:
        return torch.stack(log_probs, 1), torch.stack(means, 1), torch.stack(stds, 1)
    return torch.stack(log_probs, 1)
