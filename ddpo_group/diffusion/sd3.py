"""SD3 / SD3.5 (``StableDiffusion3Pipeline``) as a flow-matching family: CLIP-L, CLIP-G (pooled) and
T5 text encoders, classifier-free guidance, the scheduler's (optionally dynamically shifted) grid.
The step, the sampling loop, LoRA and checkpoints are the flow-matching base's (``flow_policy.py``)."""

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

from ddpo_group.diffusion.base import model_dtype, register_family
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.tiny import build_tiny_sd3_pipeline


@register_family("sd3")
class StableDiffusion3Policy(FlowMatchingPolicy):
    """SD3 / SD3.5 (``StableDiffusion3Pipeline``): CLIP-L, CLIP-G (pooled) and T5 (optional) text
    encoders, classifier-free guidance, VAE with shift_factor."""

    pipeline_class = StableDiffusion3Pipeline
    pipeline_class_names = ("StableDiffusion3Pipeline",)
    offline_models = ("tiny-sd3",)
    default_max_sequence_length = 256
    patch_multiple = 2

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(StableDiffusion3Pipeline, model, revision, torch_dtype, {"tiny-sd3": build_tiny_sd3_pipeline})

    @property
    def latent_channels(self):
        return self.pipeline.transformer.config.in_channels

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        cfg = guidance_scale > 1.0
        embeds, negative, pooled, negative_pooled = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=device, do_classifier_free_guidance=cfg,
            negative_prompt=[negative_prompt] * len(prompts) if cfg else None,
            max_sequence_length=self.max_sequence_length,
        )
        cond = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if cfg:
            cond.update(negative_prompt_embeds=negative, negative_pooled_prompt_embeds=negative_pooled)
        return cond

    def _initial_latents(self, batch_size, device, generator):
        pipe = self.pipeline
        return pipe.prepare_latents(
            batch_size, pipe.transformer.config.in_channels, self.resolution, self.resolution, torch.float32, device,
            generator,
        )

    def _timesteps(self, num_steps, device):
        pipe, kwargs = self.pipeline, {}
        if pipe.scheduler.config.get("use_dynamic_shifting", None):
            side = self.resolution // pipe.vae_scale_factor // pipe.transformer.config.patch_size
            kwargs["mu"] = self._shift_mu(side, default_max_shift=1.16)
        retrieve_timesteps(pipe.scheduler, num_steps, device, **kwargs)

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        dtype = model_dtype(model)
        cfg = guidance_scale > 1.0 and cond.get("negative_prompt_embeds") is not None
        if cfg:
            latents = torch.cat([latents, latents])
            timesteps = torch.cat([timesteps, timesteps])
            embeds = torch.cat([cond["negative_prompt_embeds"], cond["prompt_embeds"]])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], cond["pooled_prompt_embeds"]])
        else:
            embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        velocity = model(
            hidden_states=latents.to(dtype), timestep=timesteps, encoder_hidden_states=embeds.to(dtype),
            pooled_projections=pooled.to(dtype), return_dict=False,
        )[0].float()
        if cfg:
            uncond, text = velocity.chunk(2)
            return uncond + guidance_scale * (text - uncond)
        return velocity
