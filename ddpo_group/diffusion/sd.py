"""The Stable Diffusion 1.x / 2.x family (UNet, CLIP text encoder, VAE, DDIM) as a DiffusionPolicy.

A step is the DDIM Gaussian of ``ddim_step_with_logprob`` (eta > 0), sampled and re-scored by
``ddpo_group.diffusion.sampling``; LoRA sits on the UNet's attention projections and is saved in
diffusers' format (``StableDiffusionPipeline.load_lora_weights`` loads it); a critic reads the
latent channels of the UNet and the hidden size of the text encoder.
"""

import os

import torch
from diffusers import StableDiffusionPipeline

from ddpo_group.diffusion.loading import load_pipeline
from ddpo_group.diffusion.lora import add_lora
from ddpo_group.diffusion.policy import DiffusionPolicy, register_family
from ddpo_group.diffusion.sampling import _predict_noise, sample_trajectories, step_log_prob

LORA_TARGET_MODULES = ("to_k", "to_q", "to_v", "to_out.0")


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

    def configure(self, sde_type="", max_sequence_length=0, resolution=0):
        if sde_type:
            raise ValueError(
                f"config.sample.sde_type={sde_type!r} needs a flow-matching model (SD3, FLUX); "
                f"{type(self.pipeline).__name__} steps with DDIM (its noise is sample.eta): set sample.sde_type=''"
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
               model=None, show_progress=False, keep_steps=True):
        return sample_trajectories(
            self.pipeline, prompts, num_inference_steps=num_steps, guidance_scale=guidance_scale, eta=eta,
            generator=generator, prompt_ids=prompt_ids, negative_prompt=negative_prompt, unet=model,
            show_progress=show_progress, height=self.resolution, keep_steps=keep_steps,
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
