"""The base of the flow-matching families (SD3 / SD3.5 in sd3.py, FLUX.1 in flux.py, Qwen-Image in qwen_image.py):
SDE steps with log-probs.

A trajectory is T steps of ``sde_step_with_logprob`` (``ddpo_group.diffusion.flow``) on the
pipeline's own timestep grid (or DanceGRPO's, ``sample.flow_grid="dance"``); step i uses the noise level eta_i (the trainer's ODE/SDE window:
eta_i = 0 outside it, an ODE step with mask 0). The same ``_velocity`` call serves sampling and
re-scoring, so re-scoring with unchanged weights in the sampling layout is exact, and with noise
0 the images are the pipeline's (``pipeline(...)`` with the same generator).

Stored per trajectory: float32 latents x_0..x_T, unpacked (B, C, h, w) also for FLUX (packed
(B, N, 4C) only for the model call: element-wise steps give the same values), timesteps (float,
sigma * 1000), prompt embeddings and pooled embeddings (and the negative ones for SD3's CFG).
FLUX.1-dev has no CFG: ``guidance_scale`` is its distilled guidance embedding.
"""

import inspect
import json
import math
import os

import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from tqdm.auto import tqdm

from ddpo_group.diffusion.base import (
    DiffusionPolicy,
    Trajectories,
    conditioning_only,
    default_prompt_ids,
    execution_device,
    final_latents_only,
    noise_levels,
)
from ddpo_group.diffusion.flow import (
    CPS_LOG_PROBS,
    FLOW_GRIDS,
    SDE_TYPES,
    check_sigma_grid,
    dance_sigmas,
    sde_step_with_logprob,
)
from ddpo_group.diffusion.lora import add_lora


def flow_x0_hat(latents, velocity, sigma):
    """The flow model's one-step prediction of the clean sample, x0_hat = x - sigma v (x_sigma = (1 - sigma) x0 +
    sigma eps, v = eps - x0), float32 of the shape of `latents` (B, C, ...); sigma (B,)."""
    x = latents.float()
    return x - sigma.float().reshape((-1,) + (1,) * (x.dim() - 1)) * velocity.float()

# Attention projections of the joint (MM-DiT) blocks: image stream and text stream, as Flow-GRPO targets.
LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def load_pretrained(pipeline_class, model, revision, torch_dtype, offline_builders, absent_components=()):
    """`pipeline_class` from an offline name (`offline_builders`: name -> builder), a directory or a hub id;
    ValueError naming the model and the offline choices when it cannot be loaded. A builder that takes
    ``torch_dtype`` (the full-size random architectures) creates its weights in it: no float32 copy first.
    `absent_components`: optional components that a local directory may lack (save_pretrained leaves a None
    component out of model_index.json, and from_pretrained then refuses the directory): loaded as None."""
    if model in offline_builders:
        build = offline_builders[model]
        takes_dtype = "torch_dtype" in inspect.signature(build).parameters
        return (build(torch_dtype=torch_dtype) if takes_dtype else build()).to(dtype=torch_dtype)
    local = os.path.isdir(os.path.expanduser(model))
    local_files_only = local or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    absent = {}
    index = os.path.join(os.path.expanduser(model), "model_index.json")
    if local and os.path.isfile(index):
        with open(index) as f:
            listed = json.load(f)
        absent = {name: None for name in absent_components if listed.get(name) in (None, [None, None])}
    try:
        pipeline = pipeline_class.from_pretrained(
            os.path.expanduser(model), revision=revision, dtype=torch_dtype, local_files_only=local_files_only, **absent
        )
    except Exception as err:
        raise ValueError(
            f"model {model!r}: could not load a {pipeline_class.__name__} ({type(err).__name__}: {err}); offline, use "
            f"one of {sorted(offline_builders)} or a local directory written by save_pretrained"
        ) from err
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# The conditioning fields of Trajectories; any other key of `_encode`'s dict is kept in Trajectories.extra_cond.
COND_FIELDS = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")


class FlowMatchingPolicy(DiffusionPolicy):
    """What every flow-matching family shares: the step, the sampling loop, LoRA, checkpoints.

    A family subclasses it (``sd3.py``, ``flux.py``) and provides: ``pipeline_class``,
    ``pipeline_class_names``, ``offline_models``, ``default_max_sequence_length``, ``patch_multiple``,
    ``load`` (classmethod), ``latent_channels`` (property), ``_encode(prompts, negative_prompt,
    guidance_scale, device) -> cond dict`` (prompt_embeds, and the negative / pooled embeddings it
    has; any other per-row tensor it needs is carried in ``Trajectories.extra_cond``),
    ``_initial_latents(batch_size, device, generator)`` (B, C, h, w) float32,
    ``_timesteps(num_steps, device)`` (sets the scheduler's grid) and
    ``_velocity(model, latents, timesteps, cond, guidance_scale)`` float32; ``_decode`` when its VAE
    is not diffusers' AutoencoderKL with scaling and shift factors. An image-editing family also sets
    ``conditions_on_images = True`` and provides ``_encode_source(images) -> cond dict`` of its source images
    (or ``_encode_edit`` when its text encoder reads the image too); ``sample(..., source_images=...)`` calls it
    (docs/editing.md).
    """

    pipeline_class = None
    default_max_sequence_length = 256
    supports_flow_grpo_kl = True
    lora_target_modules = LORA_TARGET_MODULES  # the attention projections LoRA wraps (a family names its own)
    anchor_refusal = None  # x0_hat = x_t - sigma v from the step's own velocity (sample(..., keep_x0_hat=True))

    def __init__(self, pipeline):
        super().__init__(pipeline)
        self.sde_type = "sde"
        self.cps_log_prob = "normalized"
        self.flow_grid, self.flow_grid_shift = "pipeline", 3.0
        self.max_sequence_length = self.default_max_sequence_length
        self.resolution = self.default_resolution()

    def default_resolution(self):
        """The side in pixels sampled when config.sample.resolution is 0: the pipeline's default."""
        return self.pipeline.default_sample_size * self.pipeline.vae_scale_factor

    @classmethod
    def supports(cls, pipeline):
        return isinstance(pipeline, cls.pipeline_class)

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, cps_log_prob="normalized",
                  flow_grid="pipeline", flow_grid_shift=3.0):
        if sde_type and sde_type not in SDE_TYPES:
            raise ValueError(f"config.sample.sde_type={sde_type!r} is not one of {list(SDE_TYPES)} (or '' for 'sde')")
        if cps_log_prob not in CPS_LOG_PROBS:
            raise ValueError(f"config.sample.cps_log_prob={cps_log_prob!r} is not one of {list(CPS_LOG_PROBS)}")
        if cps_log_prob != "normalized" and sde_type != "cps":
            raise ValueError(f"config.sample.cps_log_prob={cps_log_prob!r} is the log-prob of sample.sde_type='cps'; "
                             f"sample.sde_type={sde_type!r}: set sample.cps_log_prob='normalized'")
        if flow_grid not in FLOW_GRIDS:
            raise ValueError(f"config.sample.flow_grid={flow_grid!r} is not one of {list(FLOW_GRIDS)}")
        if not (math.isfinite(float(flow_grid_shift)) and float(flow_grid_shift) > 0):
            raise ValueError(f"config.sample.flow_grid_shift={flow_grid_shift} must be > 0 (DanceGRPO's shift; 1: none)")
        self.sde_type = sde_type or "sde"
        self.cps_log_prob = cps_log_prob
        self.flow_grid, self.flow_grid_shift = flow_grid, float(flow_grid_shift)
        self.max_sequence_length = max_sequence_length or self.default_max_sequence_length
        if resolution:
            multiple = self.pipeline.vae_scale_factor * self.patch_multiple
            if resolution % multiple:
                raise ValueError(f"config.sample.resolution={resolution} must be a multiple of {multiple} for this model")
            self.resolution = resolution

    def prepare(self, device, dtype, use_lora, lora_rank=4, lora_alpha=None):
        """Text encoders and VAE frozen in `dtype`; LoRA on the frozen transformer's attention projections
        (adapters float32), or the whole transformer trained in float32. Returns the transformer."""
        pipe = self.pipeline
        for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            frozen = getattr(pipe, name, None)
            if frozen is not None:
                frozen.requires_grad_(False)
                frozen.to(device, dtype=dtype)
        transformer = pipe.transformer
        if use_lora:
            transformer.to(device, dtype=dtype)
            for param in add_lora(transformer, lora_rank, alpha=lora_alpha, target_modules=self.lora_target_modules):
                param.data = param.data.float()
        else:
            transformer.requires_grad_(True)
            transformer.to(device, dtype=torch.float32)
        return transformer

    @property
    def trainable_module(self):
        return self.pipeline.transformer

    @trainable_module.setter
    def trainable_module(self, module):
        self.pipeline.transformer = module

    def critic_sizes(self):
        return {"latent_channels": self.latent_channels, "prompt_dim": self.pipeline.transformer.config.joint_attention_dim}

    def _shift_mu(self, patches_per_side, default_max_shift=1.15):
        """diffusers' resolution-dependent timestep shift (``calculate_shift``'s mu) for an image of
        patches_per_side ** 2 tokens, from the scheduler's config (the family's defaults where it has none)."""
        config = self.pipeline.scheduler.config
        return calculate_shift(
            patches_per_side * patches_per_side, config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5), config.get("max_shift", default_max_shift),
        )

    def _set_timesteps(self, num_steps, device):
        """The trajectory's model timesteps (T,) and sigma grid (T + 1,) float32: the pipeline's (its scheduler's,
        set here) or, with flow_grid="dance", DanceGRPO's (``dance_sigmas``; the model sees sigma * 1000)."""
        if self.flow_grid == "dance":
            sigmas = dance_sigmas(num_steps, self.flow_grid_shift).to(device, torch.float32)
            return sigmas[:-1] * self.pipeline.scheduler.config.num_train_timesteps, sigmas
        # Set on every call: the scheduler is the pipeline's, and a pipeline() call or an evaluation in between may
        # have set another grid of the same length (another shift or size); setting it is a linspace per batch.
        self._timesteps(num_steps, device)
        scheduler = self.pipeline.scheduler
        return scheduler.timesteps, scheduler.sigmas.detach().to(device, torch.float32)

    @torch.no_grad()
    def sample(self, prompts, num_steps, guidance_scale, eta, generator=None, prompt_ids=None, negative_prompt="",
               model=None, show_progress=False, keep_steps=True, source_images=None, initial_generator=None,
               keep_x0_hat=False):
        """B trajectories of `num_steps` SDE steps; eta: the noise level a, or one per step (0: an ODE step).

        keep_steps=False: only the clean latents are kept and no log-prob is computed (``Trajectories``).
        source_images: (B, 3, H, W) float in [0, 1], an editing family's source image per prompt (``_encode_edit``
        puts its encoding into the conditioning, kept in ``Trajectories.extra_cond``).
        initial_generator: the initial noise's generator (or list of B), when not ``generator``'s.
        keep_x0_hat: also keep each step's one-step prediction of the clean sample x0_hat = x_k - sigma_k v_k from
        the step's own velocity, float32 (``Trajectories.x0_hat`` (B, T, C, ...); the anchor machinery reads it)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts must hold at least one prompt")
        prompt_ids = default_prompt_ids(prompts) if prompt_ids is None else torch.as_tensor(prompt_ids, dtype=torch.int64)
        model = self.trainable_module if model is None else model
        device = execution_device(self.pipeline)
        batch_size = len(prompts)
        levels = noise_levels(eta, num_steps)
        if self.conditions_on_images or source_images is not None:
            sources = self._check_source_images(source_images, batch_size).to(device)
            cond = self._encode_edit(prompts, negative_prompt, guidance_scale, device, sources)
        else:
            cond = self._encode_text(prompts, negative_prompt, guidance_scale, device)
        latents = self._initial_latents(batch_size, device, generator if initial_generator is None else initial_generator)
        timesteps, sigmas = self._set_timesteps(num_steps, device)
        check_sigma_grid(sigmas.unsqueeze(0))  # once: the steps below then do not read their sigmas back from the device
        grid = sigmas.unsqueeze(0).repeat(batch_size, 1)
        all_latents, log_probs, stds = [latents], [], []
        x0_hats = [] if keep_x0_hat else None
        for i, t in enumerate(tqdm(timesteps, disable=not show_progress, desc="sampling", leave=False)):
            velocity = self._velocity(model, latents, t.expand(batch_size), cond, guidance_scale)
            if keep_x0_hat:
                x0_hats.append(flow_x0_hat(latents, velocity, grid[:, i]))
            latents, log_prob, _, std = sde_step_with_logprob(
                self.pipeline.scheduler, velocity, t, latents, noise_level=levels[i], sde_type=self.sde_type,
                generator=generator if levels[i] > 0 else None, sigmas=(grid[:, i], grid[:, i + 1], grid[:, 1]),
                with_log_prob=keep_steps, cps_log_prob=self.cps_log_prob, check_sigmas=False,
            )
            if keep_steps:
                all_latents.append(latents)
                log_probs.append(log_prob)
                stds.append(std.reshape(batch_size))
        steps = final_latents_only(latents) if not keep_steps else {
            "latents": torch.stack(all_latents, dim=1),
            "log_probs": torch.stack(log_probs, dim=1),
            "mask": (torch.stack(stds, dim=1) > 0).to(torch.float32),
        }
        return Trajectories(
            images=self._decode(latents),
            timesteps=timesteps.float().unsqueeze(0).repeat(batch_size, 1),
            prompt_embeds=cond["prompt_embeds"],
            negative_prompt_embeds=cond.get("negative_prompt_embeds"),
            **steps,
            prompts=prompts,
            prompt_ids=prompt_ids,
            pooled_prompt_embeds=cond.get("pooled_prompt_embeds"),
            negative_pooled_prompt_embeds=cond.get("negative_pooled_prompt_embeds"),
            sigmas=grid,
            extra_cond={name: value for name, value in cond.items() if name not in COND_FIELDS} or None,
            x0_hat=torch.stack(x0_hats, dim=1) if keep_x0_hat else None,
        )

    def _encode_edit(self, prompts, negative_prompt, guidance_scale, device, source_images):
        """An editing family's conditioning: the text's (``_encode``) and its source images' (``_encode_source``:
        name -> (B, ...), kept in extra_cond); a family whose text encoder reads the image too overrides this."""
        return {**self._encode_text(prompts, negative_prompt, guidance_scale, device), **self._encode_source(source_images)}

    def _encode_text(self, prompts, negative_prompt, guidance_scale, device):
        """``_encode`` through the text-embedding cache (config.sample.text_embedding_cache, text_cache.py)."""
        return self._cached_text(lambda rows: self._encode(rows, negative_prompt, guidance_scale, device), prompts,
                                 negative_prompt, float(guidance_scale), self.max_sequence_length, self.resolution,
                                 str(device))

    def _encode_source(self, source_images):
        raise NotImplementedError

    def _check_source_images(self, source_images, batch_size):
        """(B, 3, resolution, resolution) float32 source images, or a ValueError naming the field."""
        if not self.conditions_on_images:
            raise ValueError(f"{type(self.pipeline).__name__} does not edit images: sample it without source_images")
        if source_images is None:
            raise ValueError(f"{type(self.pipeline).__name__} edits an image: every prompt needs a source image "
                             "(the prompt record's field 'source_image'; docs/editing.md)")
        side = self.resolution
        if tuple(source_images.shape) != (batch_size, 3, side, side):
            raise ValueError(f"source_images must be (B, 3, H, W) = ({batch_size}, 3, {side}, {side}) (the field "
                             f"'source_image' at config.sample.resolution), got {tuple(source_images.shape)}")
        return source_images.float()

    @staticmethod
    def _rows_cond(batch, rows):
        """The text conditioning of trajectories `rows` of `batch` (None where the batch has none), with the
        family's own conditioning tensors (``batch.extra_cond``): the dict `_encode` returned, for these rows."""
        cond = {name: None if getattr(batch, name) is None else getattr(batch, name)[rows] for name in COND_FIELDS}
        cond.update({name: value[rows] for name, value in (batch.extra_cond or {}).items()})
        return cond

    def forward_noise(self, x0, noise, timesteps):
        """Rectified flow's forward process: sigma = t / num_train_timesteps, x_t = (1 - sigma) x0 + sigma eps,
        target the velocity eps - x0, x0_scale sigma (x0_hat = x_t - sigma v). float32."""
        x0, noise = x0.float(), noise.float()
        sigma = torch.as_tensor(timesteps, device=x0.device).float() / self.pipeline.scheduler.config.num_train_timesteps
        s = sigma.reshape((-1,) + (1,) * (x0.dim() - 1))
        return (1 - s) * x0 + s * noise, noise - x0, sigma

    def predict(self, model, x_t, timesteps, batch, rows, guidance_scale):
        """The transformer's velocity for x_t (CFG or FLUX's guidance embedding as in sampling), float32."""
        cond = self._rows_cond(batch, rows)
        return self._velocity(model, x_t, torch.as_tensor(timesteps, device=x_t.device), cond, guidance_scale)

    def predict_x0(self, model, batch, rows, step_index, guidance_scale):
        """x0_hat = x_k - sigma_k v(x_k) (b, C, ...) float32 of the stored x_k (k = step_index) of `rows`, sigma_k
        from the trajectories' own grid (batch.sigmas), as sampling with keep_x0_hat=True keeps it."""
        if batch.sigmas is None:
            raise ValueError("these trajectories carry no sigma grid (batch.sigmas): sample them with a flow policy")
        x_k, t_k = batch.latents[rows, step_index], batch.timesteps[rows, step_index]
        sigma = batch.sigmas[rows, step_index].to(x_k.device)
        return flow_x0_hat(x_k, self.predict(model, x_k, t_k, batch, rows, guidance_scale), sigma)

    def decode(self, latents):
        """Images (B, 3, H, W) in [0, 1] float32 of clean latents (videos for a video family), as sampling decodes
        x_T (``_decode``)."""
        return self._decode(latents)

    @torch.no_grad()
    def encode_images(self, images):
        """Clean latents (B, C, h, w) float32 of images (B, 3, H, W) in [0, 1]: ``_decode`` inverted,
        (posterior mean - shift_factor) * scaling_factor (an image family's unpacked latent layout)."""
        if self.video or self.conditions_on_images:
            raise NotImplementedError(f"{type(self).__name__} does not encode offline images: an image family does")
        vae = self.pipeline.vae
        pixels = (images.to(execution_device(self.pipeline), torch.float32) * 2 - 1).to(vae.dtype)
        latents = vae.encode(pixels).latent_dist.mean.float()
        return (latents - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor

    @torch.no_grad()
    def conditioning(self, prompts, guidance_scale):
        """The text conditioning of `prompts` as sampling encodes it (``conditioning_only``)."""
        if self.conditions_on_images:
            raise NotImplementedError(f"{type(self).__name__} edits images: its conditioning needs a source image")
        cond = self._encode_text(list(prompts), "", guidance_scale, execution_device(self.pipeline))
        extra = {name: value for name, value in cond.items() if name not in COND_FIELDS}
        return conditioning_only(prompts, cond, extra)

    def step_log_prob(self, model, batch, rows, step_index, guidance_scale, eta):
        """log pi(x_{t+1} | x_t, c), mean, std of trajectories `rows` at their steps `step_index` (b,), noise level eta.

        The step's sigmas come from the trajectories' own grid (batch.sigmas), never from the scheduler's."""
        if batch.sigmas is None:
            raise ValueError("these trajectories carry no sigma grid (batch.sigmas): sample them with a flow policy")
        latents = batch.latents[rows]
        ar = torch.arange(len(rows), device=latents.device)
        timesteps = batch.timesteps[rows][ar, step_index]
        grid = batch.sigmas[rows].to(latents.device)
        cond = self._rows_cond(batch, rows)
        velocity = self._velocity(model, latents[ar, step_index], timesteps, cond, guidance_scale)
        _, log_prob, mean, std = sde_step_with_logprob(
            self.pipeline.scheduler, velocity, timesteps, latents[ar, step_index], noise_level=eta,
            sde_type=self.sde_type, prev_sample=latents[ar, step_index + 1],
            sigmas=(grid[ar, step_index], grid[ar, step_index + 1], grid[:, 1]), cps_log_prob=self.cps_log_prob,
        )
        return log_prob, mean, std

    def flow_grpo_kl_std(self, batch, rows, step_index, std):
        """Flow-GRPO's std of the KL term (its train_sd3.py: ||mu - mu_ref||^2 / (2 std_dev_t^2), mean over dims):
        the noise level g of the step before the sqrt|dt| factor, std / sqrt(sigma - sigma') for "sde" and
        "dance" (std = g sqrt|dt|); gaussian_kl with it is the exact KL times |dt|. For "cps", FlowCPS's KL
        (its train_sd3.py) has no divisor, mean over dims of (mu - mu_ref)^2: the std 1 / sqrt(2) (0 where the
        step has no density), i.e. the exact KL times 2 std^2. (b, 1, ..., 1) like `std`."""
        if self.sde_type == "cps":
            return torch.where(std > 0, torch.full_like(std, math.sqrt(0.5)), torch.zeros_like(std))
        grid = batch.sigmas[rows].to(std.device)
        ar = torch.arange(len(rows), device=std.device)
        dt = (grid[ar, step_index] - grid[ar, step_index + 1]).to(std.dtype)
        return std / dt.sqrt().reshape((-1,) + (1,) * (std.dim() - 1))

    def step_dt(self, batch, rows, step_index):
        """(b,) float32 sigma_t - sigma_{t+1} of the trajectories' own grid (batch.sigmas) at their steps."""
        grid = batch.sigmas[rows]
        ar = torch.arange(len(rows), device=grid.device)
        step_index = step_index.to(grid.device)
        return (grid[ar, step_index] - grid[ar, step_index + 1]).float()

    def _decode(self, latents):
        vae = self.pipeline.vae
        latents = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)  # SD's VAEs have no shift
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def save_trainable(self, module, output_dir, use_lora, state_dict=None):
        """LoRA in diffusers' format (`pipe.load_lora_weights(output_dir/'lora')`); full fine-tuning: transformer/."""
        if use_lora:
            from peft import get_peft_model_state_dict

            type(self.pipeline).save_lora_weights(
                os.path.join(output_dir, "lora"),
                transformer_lora_layers=get_peft_model_state_dict(module, state_dict=state_dict),
                safe_serialization=True,
            )
        else:
            module.save_pretrained(os.path.join(output_dir, "transformer"), safe_serialization=True)

    def load_trainable(self, module, input_dir, use_lora):
        if use_lora:
            from peft import set_peft_model_state_dict

            state = type(self.pipeline).lora_state_dict(os.path.join(input_dir, "lora"))
            state = state[0] if isinstance(state, tuple) else state
            transformer_state = {k.removeprefix("transformer."): v for k, v in state.items() if k.startswith("transformer.")}
            result = set_peft_model_state_dict(module, transformer_state, adapter_name="default")
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"LoRA weights in {input_dir} do not fit the model: {result.unexpected_keys[:3]}")
        else:
            from safetensors.torch import load_file

            module.load_state_dict(load_file(os.path.join(input_dir, "transformer", "diffusion_pytorch_model.safetensors")))
