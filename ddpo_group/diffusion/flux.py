"""FLUX.1 (``FluxPipeline``) as a flow-matching family: CLIP (pooled) and T5 text encoders, packed 2x2
latents with position ids, a guidance embedding instead of CFG (FLUX.1-dev), dynamic timestep shifting.
The step, the sampling loop, LoRA and checkpoints are the flow-matching base's (``flow_policy.py``)."""

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

from ddpo_group.diffusion.base import model_dtype, register_family
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.tiny import build_tiny_flux_pipeline


@register_family("flux")
class FluxPolicy(FlowMatchingPolicy):
    """FLUX.1 (``FluxPipeline``): CLIP (pooled) and T5 text encoders, packed 2x2 latents with position
    ids, a guidance embedding instead of CFG (FLUX.1-dev), dynamic timestep shifting."""

    pipeline_class = FluxPipeline
    pipeline_class_names = ("FluxPipeline",)
    offline_models = ("tiny-flux",)
    default_max_sequence_length = 512
    patch_multiple = 2

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(FluxPipeline, model, revision, torch_dtype, {"tiny-flux": build_tiny_flux_pipeline})

    @property
    def latent_channels(self):
        return self.pipeline.transformer.config.in_channels // 4

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=device, max_sequence_length=self.max_sequence_length
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def _initial_latents(self, batch_size, device, generator):
        pipe = self.pipeline
        packed, _ = pipe.prepare_latents(
            batch_size, self.latent_channels, self.resolution, self.resolution, torch.float32, device, generator
        )
        return pipe._unpack_latents(packed, self.resolution, self.resolution, pipe.vae_scale_factor)

    def _timesteps(self, num_steps, device):
        pipe = self.pipeline
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if getattr(pipe.scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        side = self.resolution // pipe.vae_scale_factor // 2
        mu = self._shift_mu(side)
        retrieve_timesteps(pipe.scheduler, num_steps, device, sigmas=sigmas, mu=mu)

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        pipe = self.pipeline
        dtype = model_dtype(model)
        b, c, h, w = latents.shape
        packed = pipe._pack_latents(latents, b, c, h, w)
        image_ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, dtype)
        embeds = cond["prompt_embeds"]
        text_ids = torch.zeros(embeds.shape[1], 3, device=latents.device, dtype=dtype)
        guidance = None
        config = getattr(model, "config", None) or pipe.transformer.config
        if config.guidance_embeds:
            guidance = torch.full([b], guidance_scale, device=latents.device, dtype=torch.float32)
        velocity = model(
            hidden_states=packed.to(dtype), timestep=timesteps.to(torch.float32) / 1000, guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(dtype), encoder_hidden_states=embeds.to(dtype),
            txt_ids=text_ids, img_ids=image_ids, return_dict=False,
        )[0]
        return pipe._unpack_latents(velocity.float(), self.resolution, self.resolution, pipe.vae_scale_factor)
