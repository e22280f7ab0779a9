"""SD3 / SD3.5 (``StableDiffusion3Pipeline``) as a flow-matching family: CLIP-L, CLIP-G (pooled) and
T5 text encoders, classifier-free guidance, the scheduler's (optionally dynamically shifted) grid.
The step, the sampling loop, LoRA and checkpoints are the flow-matching base's (``flow_policy.py``)."""

import json
import os

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

from ddpo_group.diffusion.base import model_dtype, register_family
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.loading import load_tiny_scenes_sd3
from ddpo_group.diffusion.tiny import (PRETRAIN_LOG, build_tiny_sd3_pipeline, build_tiny_tokenizer, created_in,
                                      seeded)

# SD3.5-Medium's published configs (stabilityai/stable-diffusion-3.5-medium: transformer/, vae/, scheduler/):
# MMDiT-X of 24 joint blocks of 24 heads x 64, the first 13 with the extra image self-attention, RMS QK norm,
# 16 latent channels, 2x2 patches, text width 4096 (T5), pooled width 2048 (the two CLIP projections)
SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
# the 16-channel VAE of SD3 / SD3.5 (8x down-sampling, no quant convs) with its two latent constants
SD3_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, norm_num_groups=32,
    sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
)


@register_family("sd3")
class StableDiffusion3Policy(FlowMatchingPolicy):
    """SD3 / SD3.5 (``StableDiffusion3Pipeline``): CLIP-L, CLIP-G (pooled) and T5 (optional) text
    encoders, classifier-free guidance, VAE with shift_factor."""
    shard_blocks = ("transformer_blocks",)  # the MM-DiT's joint blocks

    pipeline_class = StableDiffusion3Pipeline
    pipeline_class_names = ("StableDiffusion3Pipeline",)
    offline_models = ("tiny-sd3", "tiny-scenes-sd3", "random-sd35")
    default_max_sequence_length = 256
    patch_multiple = 2

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        builders = {"tiny-sd3": build_tiny_sd3_pipeline, "tiny-scenes-sd3": load_tiny_scenes_sd3,
                    "random-sd35": build_random_sd35_pipeline}
        return load_pretrained(StableDiffusion3Pipeline, model, revision, torch_dtype, builders,
                               absent_components=("text_encoder_3", "tokenizer_3"))

    @property
    def latent_channels(self):
        return self.pipeline.transformer.config.in_channels

    def __init__(self, pipeline):
        super().__init__(pipeline)
        # a model trained here without T5 saw as many zero T5 tokens as it has CLIP tokens (trained_text_length)
        self.default_max_sequence_length = trained_text_length(pipeline) or self.default_max_sequence_length
        self.max_sequence_length = self.default_max_sequence_length

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


def trained_text_length(pipeline) -> int | None:
    """The zero T5 tokens a pipeline made by ``ddpo-group pretrain --world scenes --arch sd3`` was trained with, or
    None for any other pipeline (diffusers' 256 then stands).

    Without T5, SD3's pipeline feeds ``max_sequence_length`` zero T5 tokens after the CLIP tokens. The scenes
    pretraining (``cli/pretrain.flow_text_embeddings``) fed as many as the CLIP tokenizer's length (16); with 256 at
    sampling the joint attention weighs 256 copies of one zero token against the 16 the model learned with, and the
    prompt's own tokens count for less (docs/scenes.md, "The flow base's text tokens"). The pipeline's folder says
    what made it: its pretrain_log.json (``text_tokens``; a log from before that field: the tokenizer's length).
    """
    if getattr(pipeline, "text_encoder_3", None) is not None:
        return None
    folder = getattr(pipeline.config, "_name_or_path", None)
    path = os.path.join(folder, PRETRAIN_LOG) if isinstance(folder, str) and folder else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            log = json.load(f)
    except (OSError, ValueError):
        return None  # not a log this project wrote: the pipeline's default
    if not isinstance(log, dict) or (log.get("world"), log.get("arch")) != ("scenes", "sd3"):
        return None
    length = log.get("text_tokens", pipeline.tokenizer.model_max_length)
    return int(length) if isinstance(length, int) and length > 0 else None


def build_random_sd35_pipeline(seed=0, torch_dtype=torch.float32, num_layers=None):
    """SD3.5-Medium's architecture with random weights, built offline (the model name "random-sd35"): for speed,
    memory and exactness checks on a GPU (benchmarks/gpu_check.py); its images mean nothing.

    transformer ``SD35_MEDIUM_TRANSFORMER`` (the published config; ``num_layers`` fewer joint blocks for a
                smaller copy), the 16-channel ``SD3_VAE``, SD3's scheduler (shift 3)
    text        small: two CLIPTextModelWithProjection of SD3's widths (768 and 1280, projections 768 and 1280:
                pooled 2048, as the real ones) with 2 layers each, the tiny in-memory CLIP tokenizer (77 tokens);
                no T5 (SD3 then feeds zero T5 embeddings of max_sequence_length tokens: the transformer sees as
                many text tokens as with T5)
    Weights in ``torch_dtype`` on the CPU; the global torch RNG state is left unchanged.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tokenizer = build_tiny_tokenizer(model_max_length=77)
    transformer_config = dict(SD35_MEDIUM_TRANSFORMER)
    if num_layers:
        transformer_config["num_layers"] = num_layers
        transformer_config["dual_attention_layers"] = tuple(i for i in range(13) if i < num_layers)

    def clip(width, heads):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=4 * width, num_hidden_layers=2,
            num_attention_heads=heads, max_position_embeddings=77, projection_dim=width, hidden_act="gelu",
            bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )).to(torch_dtype).eval()

    with seeded(seed):
        with created_in(torch_dtype):  # no float32 copy of 2.5B weights first
            transformer = SD3Transformer2DModel(**transformer_config).eval()
            vae = AutoencoderKL(**SD3_VAE).eval()
        text_encoder, text_encoder_2 = clip(768, 12), clip(1280, 20)
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
        tokenizer_2=build_tiny_tokenizer(model_max_length=77), text_encoder_3=None, tokenizer_3=None,
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
