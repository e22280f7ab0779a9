"""FLUX.2 [dev] (``Flux2Pipeline``, family "flux2") and FLUX.2 [klein] (``Flux2KleinPipeline``, family "flux2_klein")
as flow-matching families, with their offline tiny and full-size random pipelines.

What follows diffusers' ``pipelines/flux2/pipeline_flux2.py`` and ``pipeline_flux2_klein.py`` (0.42) exactly:

- text: dev runs a Mistral-3 chat (the pipeline's system message, then the prompt) through
  ``Mistral3ForConditionalGeneration``; klein runs Qwen3's chat template (thinking off) through ``Qwen3ForCausalLM``.
  Both pad every prompt to ``max_sequence_length`` tokens and stack three hidden layers ((10, 20, 30) for dev,
  (9, 18, 27) for klein) into (B, L, 3 D) embeddings (``pipe.encode_prompt``); the transformer gets no text mask.
  Text position ids are (0, 0, 0, l) (``_prepare_text_ids``).
- latents: the VAE's 32 channels patchified 2x2: noise is drawn as (B, 4 C, h/2, w/2) (``pipe.prepare_latents``) and
  each position is one token of 4 C channels with position ids (0, i, j, 0). Trajectories store this (B, 4 C, h/2, w/2)
  layout (packing is a reshape, so element-wise steps are the same).
- grid: sigmas ``linspace(1, 1/T, T)`` shifted by ``mu = compute_empirical_mu(image tokens, T)`` (FLUX.2's empirical
  shift, which depends on the number of steps too); the transformer's timestep is ``t / 1000``.
- guidance: dev has a guidance embedding (``guidance_scale``, no CFG, one call). Klein has none: ``guidance_scale > 1``
  is true CFG, ``neg + w (cond - neg)`` with the negative prompt (the pipeline always uses ""; here
  ``sample.negative_prompt``, "" by default), unless the pipeline's ``is_distilled`` (FLUX.2-klein-4B / 9B, the
  step-distilled ones): then guidance is ignored, as the pipeline does.
- decode: the tokens' batch-norm statistics undone (``z * sqrt(running_var + eps) + running_mean``), unpatchified,
  decoded by ``AutoencoderKLFlux2``.

Not supported: the pipelines' reference images (multi-reference editing) and caption upsampling (dev's
``caption_upsample_temperature``); sampling is text-to-image only.
"""

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline
from diffusers import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

from ddpo_group.diffusion.base import model_dtype, register_family
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.tiny import IMAGE_SIZE, created_in, seeded
from ddpo_group.diffusion.tiny_chat import (
    build_tiny_mistral_tokenizer,
    build_tiny_qwen3_tokenizer,
    tiny_mistral3_config,
    tiny_qwen3_config,
)

# FLUX.1's attention projections (the double-stream blocks) and the single-stream blocks' fused QKV + MLP input
LORA_TARGET_MODULES = (
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "to_qkv_mlp_proj",
)
# the pipelines' limit on text tokens (tokenizer_max_length)
MAX_SEQUENCE_LENGTH = 512


class _Flux2Base(FlowMatchingPolicy):
    """What FLUX.2 [dev] and [klein] share: patchified latents as tokens, FLUX.2's empirical shift, the decode."""

    shard_blocks = ("transformer_blocks", "single_transformer_blocks")  # double-stream, then single-stream blocks
    lora_target_modules = LORA_TARGET_MODULES
    default_max_sequence_length = MAX_SEQUENCE_LENGTH  # the pipelines' default
    patch_multiple = 2

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, **flow_options):
        if max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise ValueError(f"config.sample.max_sequence_length={max_sequence_length}: FLUX.2 takes at most "
                             f"{MAX_SEQUENCE_LENGTH} text tokens")
        super().configure(sde_type=sde_type, max_sequence_length=max_sequence_length, resolution=resolution, **flow_options)

    @property
    def latent_channels(self):
        """The channels of a stored latent: the transformer's 4 C patchified channels."""
        return self.pipeline.transformer.config.in_channels

    def _text(self, prompts, device):
        embeds, _ = self.pipeline.encode_prompt(prompt=list(prompts), device=device,
                                                max_sequence_length=self.max_sequence_length)
        return embeds

    def _initial_latents(self, batch_size, device, generator):
        pipe = self.pipeline
        packed, _ = pipe.prepare_latents(
            batch_size, self.latent_channels // 4, self.resolution, self.resolution, torch.float32, device, generator
        )
        side = self.resolution // (pipe.vae_scale_factor * 2)
        return packed.permute(0, 2, 1).reshape(batch_size, self.latent_channels, side, side)

    def _timesteps(self, num_steps, device):
        pipe = self.pipeline
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if getattr(pipe.scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        side = self.resolution // (pipe.vae_scale_factor * 2)
        mu = compute_empirical_mu(image_seq_len=side * side, num_steps=num_steps)
        retrieve_timesteps(pipe.scheduler, num_steps, device, sigmas=sigmas, mu=mu)

    def _call(self, model, latents, timesteps, embeds, guidance):
        """The transformer's output tokens for latents (B, 4C, h, w) as (B, 4C, h, w) float32."""
        pipe = self.pipeline
        dtype = model_dtype(model)
        b, c, h, w = latents.shape
        tokens = latents.reshape(b, c, h * w).permute(0, 2, 1)
        out = model(
            hidden_states=tokens.to(dtype), timestep=timesteps.to(torch.float32) / 1000, guidance=guidance,
            encoder_hidden_states=embeds.to(dtype), txt_ids=pipe._prepare_text_ids(embeds).to(latents.device),
            img_ids=pipe._prepare_latent_ids(latents).to(latents.device), return_dict=False,
        )[0][:, : h * w]
        return out.float().permute(0, 2, 1).reshape(b, c, h, w)

    def _decode(self, latents):
        vae = self.pipeline.vae
        latents = latents.to(vae.dtype)
        shape = (1, -1, 1, 1)
        mean = vae.bn.running_mean.view(shape).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(shape) + vae.config.batch_norm_eps).to(latents.device, latents.dtype)
        latents = self.pipeline._unpatchify_latents(latents * std + mean)
        images = vae.decode(latents, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


@register_family("flux2")
class Flux2Policy(_Flux2Base):
    """FLUX.2 [dev] (``Flux2Pipeline``): a Mistral-3 text encoder (three stacked hidden layers), patchified 32-channel
    latents, FLUX.2's empirical shift, a guidance embedding instead of CFG (module docstring)."""

    pipeline_class = Flux2Pipeline
    pipeline_class_names = ("Flux2Pipeline",)
    offline_models = ("tiny-flux2", "random-flux2")

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(Flux2Pipeline, model, revision, torch_dtype,
                               {"tiny-flux2": build_tiny_flux2_pipeline, "random-flux2": build_random_flux2_pipeline})

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        if negative_prompt:
            raise ValueError(f"config.sample.negative_prompt={negative_prompt!r}: FLUX.2 [dev] has no classifier-free "
                             "guidance, so a negative prompt would be ignored; set sample.negative_prompt=''")
        return {"prompt_embeds": self._text(prompts, device)}

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        config = getattr(model, "config", None) or self.pipeline.transformer.config
        guidance = None
        if config.guidance_embeds:
            guidance = torch.full([latents.shape[0]], guidance_scale, device=latents.device, dtype=torch.float32)
        return self._call(model, latents, timesteps, cond["prompt_embeds"], guidance)


@register_family("flux2_klein")
class Flux2KleinPolicy(_Flux2Base):
    """FLUX.2 [klein] (``Flux2KleinPipeline``): a Qwen3 text encoder (three stacked hidden layers), FLUX.2's latents and
    shift, no guidance embedding: true CFG with a negative prompt for guidance_scale > 1, none for the step-distilled
    checkpoints (``is_distilled``) (module docstring)."""

    pipeline_class = Flux2KleinPipeline
    pipeline_class_names = ("Flux2KleinPipeline",)
    offline_models = ("tiny-flux2-klein", "random-flux2-klein-4b")

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(Flux2KleinPipeline, model, revision, torch_dtype, {
            "tiny-flux2-klein": build_tiny_flux2_klein_pipeline,
            "random-flux2-klein-4b": build_random_flux2_klein_pipeline,
        })

    def _cfg(self, guidance_scale):
        return guidance_scale > 1.0 and not self.pipeline.config.is_distilled

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        cond = {"prompt_embeds": self._text(prompts, device)}
        if self._cfg(guidance_scale):  # encoded once, shared by the rows
            cond["negative_prompt_embeds"] = self._text([negative_prompt], device).repeat(len(prompts), 1, 1)
        return cond

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        velocity = self._call(model, latents, timesteps, cond["prompt_embeds"], None)
        if self._cfg(guidance_scale) and cond.get("negative_prompt_embeds") is not None:
            negative = self._call(model, latents, timesteps, cond["negative_prompt_embeds"], None)
            velocity = negative + guidance_scale * (velocity - negative)
        return velocity


# ---------------------------------------------------------------------------------------------------
# Offline pipelines: tokenizers and text encoders built in memory from configs

def _tiny_flux2_vae():
    """AutoencoderKLFlux2 of 2 blocks (scale factor 2), 4 latent channels (16 patchified), made-up batch-norm
    statistics (not 0 / 1, so the decode's de-normalisation is exercised)."""
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=IMAGE_SIZE,
    )
    vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, 16))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, 16))
    return vae.eval()


def _tiny_flux2_transformer(joint_attention_dim, guidance_embeds):
    return Flux2Transformer2DModel(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=joint_attention_dim, timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2),
        guidance_embeds=guidance_embeds,
    ).eval()


def _finish(pipeline, sample_size):
    pipeline.default_sample_size = sample_size
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def build_tiny_flux2_pipeline(seed=0):
    """A Flux2Pipeline with random weights drawn from ``seed`` (CPU, float32), built offline ("tiny-flux2").

    transformer Flux2Transformer2DModel: 1 double + 1 single block of 2 heads x 8 (rope axes 2+2+2+2), 16 input
                channels (4 latent channels patchified 2x2), guidance embedding (as FLUX.2 [dev]), text width 48
    text        Mistral3ForConditionalGeneration: 30 text layers of width 16 (the pipeline stacks layers 10, 20, 30:
                48 = 3 x 16) and a 1-block vision tower; tokenizer ``tiny_chat.build_tiny_mistral_tokenizer``
    vae         ``_tiny_flux2_vae``: scale factor 2, 32 x 32 images <-> 4 x 16 x 16 latents = 16 x 8 x 8 tokens
    scheduler   FlowMatchEulerDiscreteScheduler (FLUX.2's grid comes from the pipeline's empirical mu)
    Default image 32 x 32. The global torch RNG state is left unchanged; same seed -> same weights.
    """
    from transformers import Mistral3ForConditionalGeneration

    tokenizer = build_tiny_mistral_tokenizer(SYSTEM_MESSAGE)
    with seeded(seed):
        transformer = _tiny_flux2_transformer(48, guidance_embeds=True)
        vae = _tiny_flux2_vae()
        text_encoder = Mistral3ForConditionalGeneration(tiny_mistral3_config(len(tokenizer))).eval()
    pipeline = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    return _finish(pipeline, IMAGE_SIZE // pipeline.vae_scale_factor)


def build_tiny_flux2_klein_pipeline(seed=0, is_distilled=False):
    """A Flux2KleinPipeline with random weights drawn from ``seed`` (CPU, float32), built offline ("tiny-flux2-klein"):
    the tiny FLUX.2 transformer without a guidance embedding (klein has none) and ``_tiny_flux2_vae``; text: a 27-layer
    Qwen3ForCausalLM of width 16 (klein stacks layers 9, 18, 27) with ``tiny_chat.build_tiny_qwen3_tokenizer``.
    is_distilled: the pipeline's flag of the step-distilled checkpoints (no CFG). Default image 32 x 32; the global RNG
    state is left unchanged."""
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tiny_qwen3_tokenizer()
    with seeded(seed):
        transformer = _tiny_flux2_transformer(48, guidance_embeds=False)
        vae = _tiny_flux2_vae()
        text_encoder = Qwen3ForCausalLM(tiny_qwen3_config(len(tokenizer))).eval()
    pipeline = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae,
                                  text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                                  is_distilled=is_distilled)
    return _finish(pipeline, IMAGE_SIZE // pipeline.vae_scale_factor)


# ---------------------------------------------------------------------------------------------------
# Full-size random pipelines (benchmarks/gpu_check.py --arch flux2 / flux2-klein): the published transformers

# FLUX.2 [dev] (black-forest-labs/FLUX.2-dev, 32B): diffusers' Flux2Transformer2DModel defaults are its config: 8 double
# and 48 single blocks of 48 heads x 128, 128 input channels, text width 15360 = 3 x Mistral Small 3.1's 5120
FLUX2_DEV_TRANSFORMER = dict(
    in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128, num_attention_heads=48,
    joint_attention_dim=15360, guidance_embeds=True,
)
# FLUX.2 [klein] 4B (black-forest-labs/FLUX.2-klein-4B): 5 double and 20 single blocks of 24 heads x 128, text width
# 7680 = 3 x Qwen3-4B's 2560, no guidance embedding (as public re-implementations describe it, e.g. filipstrand/mflux
# and antirez-style C ports; not read from the hub here)
FLUX2_KLEIN_4B_TRANSFORMER = dict(
    in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=7680, guidance_embeds=False,
)
FLUX2_VAE = dict(latent_channels=32)  # AutoencoderKLFlux2's defaults are FLUX.2's VAE


def _random_flux2(pipeline_class, transformer_config, text_encoder, seed, torch_dtype, **extra):
    """A `pipeline_class` of the published transformer, FLUX.2's VAE and a small text encoder of the real width."""
    klein = pipeline_class is Flux2KleinPipeline
    tokenizer = build_tiny_qwen3_tokenizer() if klein else build_tiny_mistral_tokenizer(SYSTEM_MESSAGE)
    with seeded(seed), created_in(torch_dtype):
        transformer = Flux2Transformer2DModel(**transformer_config).eval()
        vae = AutoencoderKLFlux2(**FLUX2_VAE).eval()
        encoder = text_encoder(len(tokenizer)).eval()
    pipeline = pipeline_class(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae,
                              text_encoder=encoder, tokenizer=tokenizer, transformer=transformer, **extra)
    return _finish(pipeline, 128)


def build_random_flux2_pipeline(seed=0, torch_dtype=torch.float32):
    """FLUX.2 [dev]'s transformer (``FLUX2_DEV_TRANSFORMER``) and VAE with random weights ("random-flux2"), for speed and
    memory checks on a GPU; text: a 30-layer Mistral-3 of Mistral Small's width 5120 with 4 heads x 32 and a 64-wide MLP
    (the transformer sees the real text width), the tiny tokenizer. Its images mean nothing."""
    from transformers import Mistral3ForConditionalGeneration

    def encoder(vocab):
        return Mistral3ForConditionalGeneration(tiny_mistral3_config(vocab, 5120, 30, 4, 32, 64))

    return _random_flux2(Flux2Pipeline, FLUX2_DEV_TRANSFORMER, encoder, seed, torch_dtype)


def build_random_flux2_klein_pipeline(seed=0, torch_dtype=torch.float32):
    """FLUX.2 [klein] 4B's transformer (``FLUX2_KLEIN_4B_TRANSFORMER``) and FLUX.2's VAE with random weights
    ("random-flux2-klein-4b"), the base (not step-distilled) model: CFG applies; text: a 27-layer Qwen3 of Qwen3-4B's
    width 2560 with 4 heads x 32 and a 64-wide MLP. Its images mean nothing."""
    from transformers import Qwen3ForCausalLM

    def encoder(vocab):
        return Qwen3ForCausalLM(tiny_qwen3_config(vocab, 2560, 27, 4, 32, 64))

    return _random_flux2(Flux2KleinPipeline, FLUX2_KLEIN_4B_TRANSFORMER, encoder, seed, torch_dtype, is_distilled=False)
