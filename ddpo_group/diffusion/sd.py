"""The Stable Diffusion 1.x / 2.x family (UNet, CLIP text encoder, VAE, DDIM) as a DiffusionPolicy.

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
"""

import os

import torch
from diffusers import StableDiffusionPipeline
from tqdm.auto import tqdm

from ddpo_group.diffusion.base import (
    DiffusionPolicy,
    Trajectories,
    default_prompt_ids,
    final_latents_only,
    model_dtype,
    noise_levels,
    register_family,
)
from ddpo_group.diffusion.ddim import ddim_step_with_logprob, ddim_x0_hat
from ddpo_group.diffusion.loading import load_pipeline
from ddpo_group.diffusion.lora import add_lora

LORA_TARGET_MODULES = ("to_k", "to_q", "to_v", "to_out.0")


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
    x0_hats=None,
):
    """The one step function shared by sampling and re-scoring: returns ddim_step_with_logprob's 4-tuple.
    x0_hats: a list that gets this step's one-step prediction x0_hat (``ddim_x0_hat``) appended, or None."""
    timesteps_t = torch.as_tensor(timesteps_t, device=latents_t.device)
    if timesteps_t.ndim == 0:
        timesteps_t = timesteps_t.expand(latents_t.shape[0])
    model_input = scheduler.scale_model_input(latents_t, timesteps_t)
    noise_pred = _predict_noise(unet, model_input, timesteps_t, prompt_embeds, negative_prompt_embeds, guidance_scale)
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
        unet, scheduler, latents_t, timesteps_t, prompt_embeds, negative_prompt_embeds, guidance_scale, eta,
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
    keep_x0_hat=False,
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
            x0_hats=x0_hats,
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
        x0_hat=torch.stack(x0_hats, dim=1) if keep_x0_hat else None,
        **steps,
    )


@register_family("stable_diffusion")
class StableDiffusionPolicy(DiffusionPolicy):
    """SD 1.x / 2.x, the tiny shapes-world model and any StableDiffusionPipeline with a DDIM scheduler."""

    offline_models = ("tiny", "tiny-shapes", "random-sd15")
    pipeline_class_names = ("StableDiffusionPipeline",)

    def __init__(self, pipeline):
        super().__init__(pipeline)
        self.resolution = None

    @classmethod
    def supports(cls, pipeline):
        return isinstance(pipeline, StableDiffusionPipeline)

    @classmethod
    def load(cls, model, revision=None, torch_dtype=None):
        """``load_pipeline``: "tiny", "tiny-shapes", "random-sd15", a directory or a hub id; DDIM scheduler.

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
        for frozen in (pipe.vae, pipe.text_encoder):
            frozen.requires_grad_(False)
            frozen.to(device, dtype=dtype)
        unet = pipe.unet
        if use_lora:
            unet.to(device, dtype=dtype)
            for param in add_lora(unet, lora_rank, alpha=lora_alpha, target_modules=LORA_TARGET_MODULES):
                param.data = param.data.float()  # adapters train in float32 under mixed precision
        else:
            unet.requires_grad_(True)
            unet.to(device, dtype=torch.float32)
        return unet

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
               model=None, show_progress=False, keep_steps=True, keep_x0_hat=False):
        return sample_ddim(
            self.pipeline, prompts, num_inference_steps=num_steps, guidance_scale=guidance_scale, eta=eta,
            generator=generator, prompt_ids=prompt_ids, negative_prompt=negative_prompt, unet=model,
            show_progress=show_progress, height=self.resolution, keep_steps=keep_steps, keep_x0_hat=keep_x0_hat,
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
        )

    def step_log_prob(self, model, batch, rows, step_index, guidance_scale, eta):
        """log pi(x_{t+1} | x_t, c), mean, std of trajectories `rows` of `batch` at their steps `step_index` (b,).

        guidance_scale <= 1: no classifier-free guidance (the negative embeddings are not used).
        """
        latents = batch.latents[rows]
        ar = torch.arange(len(rows), device=latents.device)
        cfg = guidance_scale > 1.0
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
        )

    def save_trainable(self, module, output_dir, use_lora):
        """LoRA: diffusers format (`pipe.load_lora_weights(output_dir/'lora')`); full fine-tuning: unet/."""
        if use_lora:
            from diffusers.utils import convert_state_dict_to_diffusers
            from peft import get_peft_model_state_dict

            StableDiffusionPipeline.save_lora_weights(
                os.path.join(output_dir, "lora"),
                unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(module)),
                safe_serialization=True,
            )
        else:
            module.save_pretrained(os.path.join(output_dir, "unet"), safe_serialization=True)

    def load_trainable(self, module, input_dir, use_lora):
        """The weights `save_trainable` wrote, into `module` (with its LoRA adapter when use_lora)."""
        if use_lora:
            from diffusers.utils import convert_unet_state_dict_to_peft
            from peft import set_peft_model_state_dict

            state, _ = StableDiffusionPipeline.lora_state_dict(os.path.join(input_dir, "lora"))
            unet_state = {k.removeprefix("unet."): v for k, v in state.items() if k.startswith("unet.")}
            result = set_peft_model_state_dict(module, convert_unet_state_dict_to_peft(unet_state), adapter_name="default")
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"LoRA weights in {input_dir} do not fit the model: {result.unexpected_keys[:3]}")
        else:
            from safetensors.torch import load_file

            module.load_state_dict(load_file(os.path.join(input_dir, "unet", "diffusion_pytorch_model.safetensors")))
