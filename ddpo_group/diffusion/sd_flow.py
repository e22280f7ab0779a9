"""Stable Diffusion's UNet as a flow-matching model: a ``StableDiffusionPipeline`` whose scheduler is
``FlowMatchEulerDiscreteScheduler`` (the UNet predicts the velocity noise - x0 at the timestep sigma x 1000, as the
rectified-flow UNets fine-tuned from SD 1.x do, and as the scenes world's ``tiny-scenes-flow`` was pretrained:
``ddpo-group pretrain --world scenes --arch sd-flow``, docs/scenes.md "A UNet trained by flow matching").

The step, the sampling loop, the log-probs and Flow-GRPO's KL are the flow-matching base's (``flow_policy.py``);
the conditioning, the trainable module, LoRA and checkpoints are Stable Diffusion's (``sd.py``): one CLIP text
encoder's last hidden states, classifier-free guidance on an empty negative prompt, LoRA on the UNet's attention
projections. The pipeline class is the one the ``stable_diffusion`` family loads; the scheduler tells them apart
(``scheduler_class_names``; ``policy.family_for_model`` reads model_index.json's scheduler entry).
"""

import torch
from diffusers import StableDiffusionPipeline
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from ddpo_group.diffusion.base import register_family
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.loading import FLOW_SCHEDULERS, shipped_dir
from ddpo_group.diffusion.sd import LORA_TARGET_MODULES, StableDiffusionPolicy, _encode_prompts, _predict_noise
from ddpo_group.diffusion.tiny import build_tiny_pipeline, sd3_flow_scheduler


def is_flow_unet(pipeline) -> bool:
    """A StableDiffusionPipeline with a flow-matching scheduler (this family's, not ``stable_diffusion``'s)."""
    return isinstance(pipeline, StableDiffusionPipeline) and type(pipeline.scheduler).__name__ in FLOW_SCHEDULERS


def build_tiny_sd_flow_pipeline(seed=0):
    """The tiny random StableDiffusionPipeline (``tiny.build_tiny_pipeline``: 32-px images) with SD3's flow scheduler
    (FlowMatchEulerDiscreteScheduler, shift 3.0) in place of DDIM: this family's seconds-long tests and smoke runs."""
    pipeline = build_tiny_pipeline(seed)
    pipeline.scheduler = sd3_flow_scheduler()
    return pipeline


def load_tiny_scenes_flow(torch_dtype=torch.float32):
    """The shipped flow-matching scenes UNet "tiny-scenes-flow" (ddpo_group/assets/tiny_scenes_flow)."""
    pipeline = StableDiffusionPipeline.from_pretrained(
        str(shipped_dir("tiny-scenes-flow")), dtype=torch_dtype, safety_checker=None, feature_extractor=None,
        image_encoder=None, requires_safety_checker=False, local_files_only=True,
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@register_family("sd_flow")
class StableDiffusionFlowPolicy(FlowMatchingPolicy):
    """A StableDiffusionPipeline with a FlowMatchEulerDiscreteScheduler: the flow-matching step on SD's UNet."""

    shard_blocks = StableDiffusionPolicy.shard_blocks
    pipeline_class = StableDiffusionPipeline
    pipeline_class_names = ("StableDiffusionPipeline",)
    scheduler_class_names = FLOW_SCHEDULERS
    offline_models = ("tiny-sd-flow", "tiny-scenes-flow")
    default_max_sequence_length = 0  # CLIP's fixed length: no T5 tokens to count
    lora_target_modules = LORA_TARGET_MODULES

    @classmethod
    def supports(cls, pipeline):
        return is_flow_unet(pipeline)

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        pipeline = load_pretrained(StableDiffusionPipeline, model, revision, torch_dtype,
                                   {"tiny-sd-flow": build_tiny_sd_flow_pipeline, "tiny-scenes-flow": load_tiny_scenes_flow},
                                   absent_components=("safety_checker", "feature_extractor", "image_encoder"))
        if not is_flow_unet(pipeline):
            raise ValueError(f"model {model!r}: its scheduler is {type(pipeline.scheduler).__name__}, not "
                             "FlowMatchEulerDiscreteScheduler; a DDIM-stepped UNet is the stable_diffusion family's")
        return pipeline

    @property
    def patch_multiple(self):  # the UNet halves the latent side at each level but the last
        return 2 ** (len(self.pipeline.unet.config.block_out_channels) - 1)

    def default_resolution(self):  # StableDiffusionPipeline has no default_sample_size
        return self.pipeline.unet.config.sample_size * self.pipeline.vae_scale_factor

    @property
    def latent_channels(self):
        return self.pipeline.unet.config.in_channels

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, cps_log_prob="normalized",
                  flow_grid="pipeline", flow_grid_shift=3.0):
        if max_sequence_length:
            raise ValueError(f"config.sample.max_sequence_length={max_sequence_length} applies to T5 text encoders "
                             "(SD3, FLUX); this UNet's CLIP has a fixed length: set it to 0")
        super().configure(sde_type, 0, resolution, cps_log_prob, flow_grid, flow_grid_shift)

    prepare = StableDiffusionPolicy.prepare
    _frozen_dtype = StableDiffusionPolicy._frozen_dtype
    trainable_module = StableDiffusionPolicy.trainable_module
    critic_sizes = StableDiffusionPolicy.critic_sizes
    save_trainable = StableDiffusionPolicy.save_trainable
    load_trainable = StableDiffusionPolicy.load_trainable

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        return _encode_prompts(self.pipeline, prompts, negative_prompt, guidance_scale > 1.0, device, None)

    def _initial_latents(self, batch_size, device, generator):
        side = self.resolution // self.pipeline.vae_scale_factor
        return randn_tensor((batch_size, self.latent_channels, side, side), generator=generator, device=device,
                            dtype=torch.float32)

    def _timesteps(self, num_steps, device):
        retrieve_timesteps(self.pipeline.scheduler, num_steps, device)

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        cfg = guidance_scale > 1.0 and cond.get("negative_prompt_embeds") is not None
        return _predict_noise(model, latents, timesteps, cond["prompt_embeds"], cond.get("negative_prompt_embeds"),
                              guidance_scale if cfg else 1.0)
