"""The Stable Diffusion family (UNet, CLIP text encoders, VAE, DDIM) as DiffusionPolicies: SD 1.x / 2.x
(``StableDiffusionPolicy``) and SDXL (``StableDiffusionXLPolicy``, family "sdxl": a second text encoder, pooled
embeddings and the added time ids, through the same step function).

A trajectory of T DDIM steps is T tokens; token t is x_t -> x_{t+1} with the log-probability of
``ddim_step_with_logprob`` (eta > 0). Sampling (``sample_ddim``) and re-scoring (``step_log_prob``)
run the same step function (``_denoise_step``) on the same batch composition, so re-scoring with
unchanged weights reproduces the sampled log-probs exactly. Classifier-free guidance follows the
pipeline: eps = eps_uncond + w (eps_cond - eps_uncond) when w > 1, from one UNet call on the
concatenated [uncond, cond] batch.

Precision: the UNet runs in its own dtype (fp16 / bf16 weights, or autocast); its inputs are cast
to it. The latents of a trajectory, the guidance combination, the DDIM step and its log-density,
and the stored log-probs are float32 (docs/design.md §10).

LoRA sits on the UNet's attention projections and is saved in diffusers' format
(``StableDiffusionPipeline.load_lora_weights`` loads it); a critic reads the latent channels of the
UNet and the hidden size of the text encoder.

One room (over 600 lines): SD 1.x / 2.x and SDXL share one denoising step, its log-density and the family methods
the objectives call on it (the step's flow-time length for GRPO-Guard, the VAE encoding and conditioning for the
preference objectives); split in two files, the step and its callers would be read apart.
"""

import os
from functools import partial

import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline
from tqdm.auto import tqdm

from ddpo_group.diffusion.base import (
    DiffusionPolicy,
    Trajectories,
    conditioning_only,
    default_prompt_ids,
    execution_device,
    final_latents_only,
    model_dtype,
    noise_levels,
    register_family,
)
from ddpo_group.diffusion.ddim import ddim_step_with_logprob, ddim_x0_hat, flow_time_step
from ddpo_group.diffusion.flow_policy import load_pretrained
from ddpo_group.diffusion.loading import FLOW_SCHEDULERS, load_pipeline
from ddpo_group.diffusion.lora import add_lora
from ddpo_group.diffusion.tiny import build_random_sdxl_pipeline, build_tiny_sdxl_pipeline

LORA_TARGET_MODULES = ("to_k", "to_q", "to_v", "to_out.0")


def _added_cond_kwargs(added_cond, dtype):
    """The UNet's ``added_cond_kwargs`` in its dtype (SDXL's pooled text embeddings and time ids), or None."""
    return None if added_cond is None else {key: value.to(dtype) for key, value in added_cond.items()}


def _predict_noise(unet, latents, timesteps, prompt_embeds, negative_prompt_embeds, guidance_scale, added_cond=None,
                   negative_added_cond=None):
    """UNet prediction with classifier-free guidance: (B, C, h, w) float32.

    When guidance_scale > 1: one call on cat([x, x]) with cat([uncond, cond]) embeddings,
    then eps_uncond + guidance_scale * (eps_cond - eps_uncond) (the pipeline's expression),
    computed in float32. The UNet's inputs are cast to its dtype. added_cond / negative_added_cond:
    SDXL's added conditioning {"text_embeds": (B, D'), "time_ids": (B, 6)} of the conditional and the
    unconditional half (concatenated as the embeddings are); None for SD 1.x / 2.x.
    """
    dtype = model_dtype(unet)
    if guidance_scale > 1.0:
        if negative_prompt_embeds is None:
            raise ValueError("guidance_scale > 1 needs negative_prompt_embeds (the unconditional embeddings)")
        model_input = torch.cat([latents, latents]).to(dtype)
        if added_cond is not None:
            added_cond = {key: torch.cat([negative_added_cond[key], value]) for key, value in added_cond.items()}
        noise_pred = unet(
            model_input,
            torch.cat([timesteps, timesteps]),
            encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds]).to(dtype),
            added_cond_kwargs=_added_cond_kwargs(added_cond, dtype),
            return_dict=False,
        )[0]
        noise_pred_uncond, noise_pred_text = noise_pred.float().chunk(2)
        return noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
    return unet(latents.to(dtype), timesteps, encoder_hidden_states=prompt_embeds.to(dtype),
                added_cond_kwargs=_added_cond_kwargs(added_cond, dtype), return_dict=False)[0].float()


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
    added_cond=None,
    negative_added_cond=None,
    x0_hats=None,
):
    """The one step function shared by sampling and re-scoring: returns ddim_step_with_logprob's 4-tuple.
    x0_hats: a list that gets this step's one-step prediction x0_hat (``ddim_x0_hat``) appended, or None."""
    timesteps_t = torch.as_tensor(timesteps_t, device=latents_t.device)
    if timesteps_t.ndim == 0:
        timesteps_t = timesteps_t.expand(latents_t.shape[0])
    model_input = scheduler.scale_model_input(latents_t, timesteps_t)
    noise_pred = _predict_noise(unet, model_input, timesteps_t, prompt_embeds, negative_prompt_embeds, guidance_scale,
                                added_cond, negative_added_cond)
    if x0_hats is not None:
        x0_hats.append(ddim_x0_hat(scheduler, noise_pred, timesteps_t, latents_t))
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
    added_cond=None,
    negative_added_cond=None,
):
    """Log-probability of the stored step x_t -> x_{t+1} under the current UNet, with autograd.

    Args: latents_t, latents_next (B, C, h, w); timesteps_t (B,) (or a scalar);
    prompt_embeds, negative_prompt_embeds (B, L, D) (negative ones unused when
    guidance_scale <= 1); added_cond, negative_added_cond: SDXL's added conditioning (``_predict_noise``). The DDIM step size is 1000 // T with T the scheduler's
    ``num_inference_steps``: pass ``num_inference_steps`` = T of the sampling run (the
    scheduler is reset to it when it differs), or keep the scheduler as sampling left it.

    Returns: log_prob (B,) = mean over (C, h, w) of log N(x_{t+1}; mu_theta(x_t, t, c), sigma_t^2),
    prev_sample_mean mu_theta (B, C, h, w), std_dev_t sigma_t (B, 1, 1, 1).
    """
    if num_inference_steps is not None and scheduler.num_inference_steps != num_inference_steps:
        scheduler.set_timesteps(num_inference_steps, device=latents_t.device)
    _, log_prob, prev_sample_mean, std_dev_t = _denoise_step(
        unet, scheduler, latents_t, timesteps_t, prompt_embeds, negative_prompt_embeds, guidance_scale, eta,
        latents_next=latents_next, added_cond=added_cond, negative_added_cond=negative_added_cond,
    )
    return log_prob, prev_sample_mean, std_dev_t


def _encode_prompts(pipeline, prompts, negative_prompt, do_cfg, device, height):
    """The conditioning of SD 1.x / 2.x: {"prompt_embeds", "negative_prompt_embeds" (None without CFG)}."""
    prompt_embeds, negative_prompt_embeds = pipeline.encode_prompt(
        prompts,
        device,
        1,
        do_cfg,
        negative_prompt=[negative_prompt] * len(prompts) if do_cfg else None,
    )
    return {"prompt_embeds": prompt_embeds, "negative_prompt_embeds": negative_prompt_embeds if do_cfg else None}


def _added_conds(cond):
    """(added_cond, negative_added_cond) of a conditioning dict: SDXL's pooled embeddings with the time ids
    (``cond["add_time_ids"]``, shared by both halves as the pipeline does), (None, None) without pooled embeddings."""
    pooled = cond.get("pooled_prompt_embeds")
    if pooled is None:
        return None, None
    time_ids = cond["add_time_ids"]
    negative = cond.get("negative_pooled_prompt_embeds")
    return {"text_embeds": pooled, "time_ids": time_ids}, (
        None if negative is None else {"text_embeds": negative, "time_ids": time_ids})


def _decode(vae, latents):
    """Images (B, 3, H, W) in [0, 1] of clean latents: x / scaling_factor (de-normalised with the VAE config's
    latents_mean / latents_std where it has them, as SDXL's pipeline does), decoded in the VAE's dtype."""
    mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
    if mean is not None and std is not None:
        shape = (1, len(mean), 1, 1)
        latents = (latents * torch.tensor(std, device=latents.device).view(shape) / vae.config.scaling_factor
                   + torch.tensor(mean, device=latents.device).view(shape))
    else:
        latents = latents / vae.config.scaling_factor
    images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def sample_ddim(
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
    encode=None,
    keep_x0_hat=False,
    initial_generator=None,
):
    """Sample B = len(prompts) trajectories x_0 -> x_T with their per-step log-probabilities.

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
        encode: (prompts, negative_prompt, do_cfg, device, height) -> conditioning dict (default
            ``_encode_prompts``; SDXL's adds pooled embeddings and ``add_time_ids``, kept in ``extra_cond``).
        initial_generator: the initial noise's generator (or list of B), when not ``generator``'s (a group
            sharing its initial noise: sample.group_noise="shared").
        keep_x0_hat: also keep each step's one-step prediction x0_hat (B, T, C, h, w) from the step's own model
            call (``Trajectories.x0_hat``; the anchor critic reads it).

    Returns: Trajectories (see its docstring), no autograd graph.
    """
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
    device = execution_device(pipeline)
    batch_size = len(prompts)
    do_cfg = guidance_scale > 1.0

    height = height or pipeline.unet.config.sample_size * pipeline.vae_scale_factor
    cond = (encode or partial(_encode_prompts, pipeline))(prompts, negative_prompt, do_cfg, device, height)
    prompt_embeds, negative_prompt_embeds = cond["prompt_embeds"], cond["negative_prompt_embeds"]
    added_cond, negative_added_cond = _added_conds(cond)

    scheduler.set_timesteps(num_inference_steps, device=device)
    timesteps = scheduler.timesteps
    width = height
    levels = noise_levels(eta, len(timesteps))
    # float32 latents whatever the model dtype: the trajectory is the policy's data (module docstring)
    latents = pipeline.prepare_latents(
        batch_size, pipeline.unet.config.in_channels, height, width, torch.float32, device,
        generator if initial_generator is None else initial_generator,
    )

    all_latents = [latents]
    all_log_probs = []
    all_stds = []
    x0_hats = [] if keep_x0_hat else None
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
            added_cond=added_cond,
            negative_added_cond=negative_added_cond,
            x0_hats=x0_hats,
        )
        if keep_steps:
            all_latents.append(latents)
            all_log_probs.append(log_prob)
            all_stds.append(std_dev_t.reshape(batch_size))

    images = _decode(pipeline.vae, latents)

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
        pooled_prompt_embeds=cond.get("pooled_prompt_embeds"),
        negative_pooled_prompt_embeds=cond.get("negative_pooled_prompt_embeds"),
        extra_cond={"add_time_ids": cond["add_time_ids"]} if "add_time_ids" in cond else None,
        x0_hat=torch.stack(x0_hats, dim=1) if keep_x0_hat else None,
        **steps,
    )


@register_family("stable_diffusion")
class StableDiffusionPolicy(DiffusionPolicy):
    """SD 1.x / 2.x, the tiny shapes-world model and any StableDiffusionPipeline with a DDIM scheduler."""
    shard_blocks = ("down_blocks", "mid_block", "up_blocks")  # the UNet's resolution levels

    offline_models = ("tiny", "tiny-shapes", "tiny-scenes", "random-sd15")
    pipeline_class_names = ("StableDiffusionPipeline",)
    anchor_refusal = None  # the DDIM Tweedie prediction (ddim_x0_hat), kept by sample_ddim(keep_x0_hat=True)

    def __init__(self, pipeline):
        super().__init__(pipeline)
        self.resolution = None

    @classmethod
    def supports(cls, pipeline):  # a flow-matching scheduler makes it the sd_flow family's (sd_flow.py)
        return isinstance(pipeline, StableDiffusionPipeline) and type(pipeline.scheduler).__name__ not in FLOW_SCHEDULERS

    @classmethod
    def check_config(cls, config):
        """SD steps with DDIM: no flow-matching SDE, time grid or Flow-GRPO KL (ValueError naming the field)."""
        sample, model = config.sample, config.pretrained.model
        if sample.sde_type:
            raise ValueError(
                f"config.sample.sde_type={sample.sde_type!r} needs a flow-matching model (SD3, FLUX); "
                f"config.pretrained.model={model!r} steps with DDIM (its noise is sample.eta): set sample.sde_type=''"
            )
        # (sample.cps_log_prob needs sde_type="cps", which the check above refuses)
        if sample.flow_grid != "pipeline":
            raise ValueError(
                f"config.sample.flow_grid={sample.flow_grid!r} needs a flow-matching model (SD3, FLUX); config.pretrained."
                f"model={model!r} steps with DDIM: set sample.flow_grid='pipeline'"
            )
        if config.train.kl_type == "flow_grpo":
            raise ValueError(
                f"config.train.kl_type='flow_grpo' is Flow-GRPO's KL of a flow-matching step; "
                f"config.pretrained.model={model!r} steps with DDIM: use train.kl_type='gaussian'"
            )

    @classmethod
    def load(cls, model, revision=None, torch_dtype=None):
        """``load_pipeline``: "tiny", "tiny-shapes", "tiny-scenes", "random-sd15", a directory or a hub id; DDIM scheduler.

        Loaded in float32 whatever torch_dtype says: `prepare` casts the frozen parts, and a fully
        fine-tuned UNet keeps float32 master weights.
        """
        return load_pipeline(model, revision=revision)

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, cps_log_prob="normalized",
                  flow_grid="pipeline", flow_grid_shift=3.0):
        flow = {"sde_type": (sde_type, ""), "cps_log_prob": (cps_log_prob, "normalized"), "flow_grid": (flow_grid, "pipeline")}
        for field, (value, default) in flow.items():
            if value != default:
                raise ValueError(
                    f"config.sample.{field}={value!r} needs a flow-matching model (SD3, FLUX); "
                    f"{type(self.pipeline).__name__} steps with DDIM (its noise is sample.eta): set sample.{field}={default!r}"
                )
        if max_sequence_length:
            raise ValueError(
                f"config.sample.max_sequence_length={max_sequence_length} applies to T5 text encoders (SD3, FLUX); "
                "SD 1.x/2.x's CLIP has a fixed length: set it to 0"
            )
        multiple = self.pipeline.vae_scale_factor * 2 ** (len(self.pipeline.unet.config.block_out_channels) - 1)
        if resolution and resolution % multiple:
            raise ValueError(f"config.sample.resolution={resolution} must be a multiple of {multiple} for this model")
        self.resolution = resolution or None

    def prepare(self, device, dtype, use_lora, lora_rank=4, lora_alpha=None):
        """VAE and text encoder frozen in `dtype`; LoRA on a frozen `dtype` UNet (adapters float32), or the whole
        UNet trained in float32 (autocast runs it in `dtype`). Returns the UNet."""
        pipe = self.pipeline
        for frozen in (pipe.vae, pipe.text_encoder, getattr(pipe, "text_encoder_2", None)):
            if frozen is not None:
                frozen.requires_grad_(False)
                frozen.to(device, dtype=self._frozen_dtype(frozen, dtype))
        unet = pipe.unet
        if use_lora:
            unet.to(device, dtype=dtype)
            for param in add_lora(unet, lora_rank, alpha=lora_alpha, target_modules=LORA_TARGET_MODULES):
                param.data = param.data.float()  # adapters train in float32 under mixed precision
        else:
            unet.requires_grad_(True)
            unet.to(device, dtype=torch.float32)
        return unet

    def _frozen_dtype(self, module, dtype):
        """The dtype a frozen part is kept in: `dtype`, except a VAE that asks for float32 decoding in float16
        (SDXL's ``force_upcast``: its fp16 decode overflows; the pipeline upcasts it the same way)."""
        if module is self.pipeline.vae and dtype == torch.float16 and getattr(module.config, "force_upcast", False):
            return torch.float32
        return dtype

    def _encode(self, prompts, negative_prompt, do_cfg, device, height):
        """The conditioning dict of `prompts` (``sample_ddim``'s ``encode``)."""
        return _encode_prompts(self.pipeline, prompts, negative_prompt, do_cfg, device, height)

    def _encode_text(self, prompts, negative_prompt, do_cfg, device, height):
        """``_encode`` through the text-embedding cache (config.sample.text_embedding_cache, text_cache.py)."""
        return self._cached_text(lambda rows: self._encode(rows, negative_prompt, do_cfg, device, height), prompts,
                                 negative_prompt, bool(do_cfg), height, str(device))

    @staticmethod
    def _rows_added_conds(batch, rows, cfg):
        """(added_cond, negative_added_cond) of trajectories `rows` (SDXL's; (None, None) for SD 1.x / 2.x)."""
        if batch.pooled_prompt_embeds is None:
            return None, None
        cond = {"pooled_prompt_embeds": batch.pooled_prompt_embeds[rows],
                "negative_pooled_prompt_embeds": batch.negative_pooled_prompt_embeds[rows] if cfg else None,
                "add_time_ids": batch.extra_cond["add_time_ids"][rows]}
        return _added_conds(cond)

    @property
    def trainable_module(self):
        return self.pipeline.unet

    @trainable_module.setter
    def trainable_module(self, module):
        self.pipeline.unet = module

    def critic_sizes(self):
        return {
            "latent_channels": self.pipeline.unet.config.in_channels,
            "prompt_dim": self.pipeline.text_encoder.config.hidden_size,
        }

    def sample(self, prompts, num_steps, guidance_scale, eta, generator=None, prompt_ids=None, negative_prompt="",
               model=None, show_progress=False, keep_steps=True, keep_x0_hat=False, initial_generator=None):
        return sample_ddim(
            self.pipeline, prompts, num_inference_steps=num_steps, guidance_scale=guidance_scale, eta=eta,
            generator=generator, prompt_ids=prompt_ids, negative_prompt=negative_prompt, unet=model,
            show_progress=show_progress, height=self.resolution, keep_steps=keep_steps, encode=self._encode_text,
            keep_x0_hat=keep_x0_hat, initial_generator=initial_generator,
        )

    def forward_noise(self, x0, noise, timesteps):
        """DDPM's forward process (``scheduler.add_noise``): x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, float32.

        The target is what the UNet predicts (scheduler.config.prediction_type): eps, the velocity
        sqrt(abar) eps - sqrt(1 - abar) x0 (``scheduler.get_velocity``) or x0; x0_scale c is
        sqrt((1 - abar) / abar), sqrt(1 - abar) or 1 respectively (x0_hat - x0 = -c (prediction - target)).
        """
        scheduler = self.pipeline.scheduler
        x0, noise = x0.float(), noise.float()
        timesteps = torch.as_tensor(timesteps, device=x0.device).long()
        abar = scheduler.alphas_cumprod.to(device=x0.device, dtype=torch.float32)[timesteps]
        x_t = scheduler.add_noise(x0, noise, timesteps)
        prediction_type = scheduler.config.prediction_type
        if prediction_type == "epsilon":
            return x_t, noise, ((1 - abar) / abar).sqrt()
        if prediction_type == "v_prediction":
            return x_t, scheduler.get_velocity(x0, noise, timesteps), (1 - abar).sqrt()
        if prediction_type == "sample":
            return x_t, x0, torch.ones_like(abar)
        raise ValueError(f"scheduler.config.prediction_type={prediction_type!r} has no forward-process target")

    def predict(self, model, x_t, timesteps, batch, rows, guidance_scale):
        """The UNet's output (eps, v or x0: its prediction_type) with CFG when guidance_scale > 1, float32."""
        cfg = guidance_scale > 1.0
        timesteps = torch.as_tensor(timesteps, device=x_t.device)
        model_input = self.pipeline.scheduler.scale_model_input(x_t, timesteps)
        return _predict_noise(
            model, model_input, timesteps, batch.prompt_embeds[rows],
            batch.negative_prompt_embeds[rows] if cfg else None, guidance_scale if cfg else 1.0,
            *self._rows_added_conds(batch, rows, cfg),
        )

    def predict_x0(self, model, batch, rows, step_index, guidance_scale):
        """x0_hat (b, C, h, w) float32 of the stored x_k (k = step_index) of `rows`: ``ddim_x0_hat`` of the UNet's
        output (Tweedie's formula for eps-prediction), as sampling with keep_x0_hat=True keeps it."""
        x_k, t_k = batch.latents[rows, step_index], batch.timesteps[rows, step_index]
        prediction = self.predict(model, x_k, t_k, batch, rows, guidance_scale)
        return ddim_x0_hat(self.pipeline.scheduler, prediction, t_k, x_k)

    def decode(self, latents):
        """Images (B, 3, H, W) in [0, 1] float32 of clean latents, as sampling decodes x_T (``_decode``)."""
        return _decode(self.pipeline.vae, latents)

    @torch.no_grad()
    def encode_images(self, images):
        """Clean latents (B, C, h, w) float32 of images (B, 3, H, W) in [0, 1]: ``_decode`` inverted, the VAE
        posterior's mean times scaling_factor (normalised by latents_mean / latents_std where the VAE has them)."""
        vae = self.pipeline.vae
        pixels = (images.to(execution_device(self.pipeline), torch.float32) * 2 - 1).to(vae.dtype)
        latents = vae.encode(pixels).latent_dist.mean.float()
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            shape = (1, len(mean), 1, 1)
            return ((latents - torch.tensor(mean, device=latents.device).view(shape)) * vae.config.scaling_factor
                    / torch.tensor(std, device=latents.device).view(shape))
        return latents * vae.config.scaling_factor

    @torch.no_grad()
    def conditioning(self, prompts, guidance_scale):
        """The text conditioning of `prompts` as sampling encodes it (``conditioning_only``)."""
        pipe = self.pipeline
        height = self.resolution or pipe.unet.config.sample_size * pipe.vae_scale_factor
        cond = self._encode_text(list(prompts), "", guidance_scale > 1.0, execution_device(pipe), height)
        extra = {"add_time_ids": cond["add_time_ids"]} if "add_time_ids" in cond else None
        return conditioning_only(prompts, cond, extra)

    def step_log_prob(self, model, batch, rows, step_index, guidance_scale, eta):
        """log pi(x_{t+1} | x_t, c), mean, std of trajectories `rows` of `batch` at their steps `step_index` (b,).

        guidance_scale <= 1: no classifier-free guidance (the negative embeddings are not used).
        """
        latents = batch.latents[rows]
        ar = torch.arange(len(rows), device=latents.device)
        cfg = guidance_scale > 1.0
        added_cond, negative_added_cond = self._rows_added_conds(batch, rows, cfg)
        return step_log_prob(
            model,
            self.pipeline.scheduler,
            latents[ar, step_index],
            latents[ar, step_index + 1],
            batch.timesteps[rows][ar, step_index],
            batch.prompt_embeds[rows],
            batch.negative_prompt_embeds[rows] if cfg else None,
            guidance_scale if cfg else 1.0,
            eta,
            num_inference_steps=batch.timesteps.shape[1],
            added_cond=added_cond,
            negative_added_cond=negative_added_cond,
        )

    def step_dt(self, batch, rows, step_index):
        """(b,) the DDIM steps' length in flow time (``ddim.flow_time_step``): grpo_guard's weight is 1 / dt."""
        ar = torch.arange(len(rows), device=batch.timesteps.device)
        timesteps = batch.timesteps[rows][ar, step_index.to(ar.device)]
        return flow_time_step(self.pipeline.scheduler, timesteps, batch.timesteps.shape[1]).to(step_index.device)

    def save_trainable(self, module, output_dir, use_lora, state_dict=None):
        """LoRA: diffusers format (`pipe.load_lora_weights(output_dir/'lora')`); full fine-tuning: unet/."""
        if use_lora:
            from diffusers.utils import convert_state_dict_to_diffusers
            from peft import get_peft_model_state_dict

            type(self.pipeline).save_lora_weights(
                os.path.join(output_dir, "lora"),
                unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(module, state_dict=state_dict)),
                safe_serialization=True,
            )
        else:
            module.save_pretrained(os.path.join(output_dir, "unet"), safe_serialization=True)

    def load_trainable(self, module, input_dir, use_lora):
        """The weights `save_trainable` wrote, into `module` (with its LoRA adapter when use_lora)."""
        if use_lora:
            from diffusers.utils import convert_unet_state_dict_to_peft
            from peft import set_peft_model_state_dict

            state, _ = type(self.pipeline).lora_state_dict(os.path.join(input_dir, "lora"))
            unet_state = {k.removeprefix("unet."): v for k, v in state.items() if k.startswith("unet.")}
            result = set_peft_model_state_dict(module, convert_unet_state_dict_to_peft(unet_state), adapter_name="default")
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"LoRA weights in {input_dir} do not fit the model: {result.unexpected_keys[:3]}")
        else:
            from safetensors.torch import load_file

            module.load_state_dict(load_file(os.path.join(input_dir, "unet", "diffusion_pytorch_model.safetensors")))


@register_family("sdxl")
class StableDiffusionXLPolicy(StableDiffusionPolicy):
    """SDXL (``StableDiffusionXLPipeline``) with a DDIM scheduler: SD's DDIM steps, log-probs, CFG and LoRA, with
    SDXL's conditioning. Two CLIP text encoders whose penultimate hidden states are concatenated per token
    (prompt_embeds (B, 77, 768 + 1280)), the second one's projected pooled output (pooled_prompt_embeds (B, 1280))
    and the six "added time ids" (original size, crop top-left, target size: (H, W, 0, 0, H, W) at the sampled
    resolution, as the pipeline's defaults) enter the UNet as ``added_cond_kwargs``; the time ids ride in
    ``Trajectories.extra_cond["add_time_ids"]`` (B, 6) float32 and the pooled embeddings in the pooled fields, so
    re-scoring feeds the UNet exactly what sampling fed it. CFG follows the pipeline: an empty negative prompt is
    the zero embedding (pooled too) when the pipeline's ``force_zeros_for_empty_prompt`` is set (SDXL base's
    config), the unconditional half shares the time ids. The VAE stays float32 under fp16 when its config says
    ``force_upcast`` (SDXL's VAE overflows in fp16; madebyollin/sdxl-vae-fp16-fix does not, and says so)."""

    offline_models = ("tiny-sdxl", "random-sdxl")
    pipeline_class_names = ("StableDiffusionXLPipeline",)

    @classmethod
    def supports(cls, pipeline):
        return isinstance(pipeline, StableDiffusionXLPipeline)

    @classmethod
    def load(cls, model, revision=None, torch_dtype=None):
        """"tiny-sdxl", "random-sdxl", a directory written by save_pretrained or a hub id
        (e.g. "stabilityai/stable-diffusion-xl-base-1.0"), in `torch_dtype`; the scheduler becomes DDIM."""
        builders = {"tiny-sdxl": build_tiny_sdxl_pipeline, "random-sdxl": build_random_sdxl_pipeline}
        pipeline = load_pretrained(StableDiffusionXLPipeline, model, revision, torch_dtype, builders)
        pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def critic_sizes(self):
        return {"latent_channels": self.pipeline.unet.config.in_channels,
                "prompt_dim": self.pipeline.unet.config.cross_attention_dim}

    def _encode(self, prompts, negative_prompt, do_cfg, device, height):
        """prompt_embeds (B, L, D1 + D2), pooled_prompt_embeds (B, D2) (and the negative ones with CFG) from
        ``pipeline.encode_prompt``; add_time_ids (B, 6) float32 from ``pipeline._get_add_time_ids``."""
        pipe = self.pipeline
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=prompts, device=device, num_images_per_prompt=1, do_classifier_free_guidance=do_cfg,
            negative_prompt=[negative_prompt] * len(prompts) if negative_prompt else None,
        )
        projection_dim = (pipe.text_encoder_2.config.projection_dim if pipe.text_encoder_2 is not None
                          else int(pooled.shape[-1]))
        time_ids = pipe._get_add_time_ids((height, height), (0, 0), (height, height), dtype=torch.float32,
                                          text_encoder_projection_dim=projection_dim)
        return {
            "prompt_embeds": embeds, "negative_prompt_embeds": negative if do_cfg else None,
            "pooled_prompt_embeds": pooled, "negative_pooled_prompt_embeds": negative_pooled if do_cfg else None,
            "add_time_ids": time_ids.to(device).repeat(len(prompts), 1),
        }
