"""FLUX.1 (``FluxPipeline``) as a flow-matching family: CLIP (pooled) and T5 text encoders, packed 2x2
latents with position ids, a guidance embedding instead of CFG (FLUX.1-dev), dynamic timestep shifting.
FLUX.1 Kontext (``FluxKontextPipeline``, family "flux_kontext") edits a source image with the same transformer:
the source's VAE latents are appended to the image tokens (``FluxKontextPolicy``).
The step, the sampling loop, LoRA and checkpoints are the flow-matching base's (``flow_policy.py``)."""

import numpy as np
import torch
from diffusers import FluxKontextPipeline, FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

from ddpo_group.diffusion.base import model_dtype, register_family
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.tiny import (
    build_tiny_flux_pipeline,
    build_tiny_t5_tokenizer,
    build_tiny_tokenizer,
    created_in,
    seeded,
)

# FLUX.1-dev's published configs (black-forest-labs/FLUX.1-dev: transformer/, vae/, scheduler/): 19 double-stream and
# 38 single-stream blocks of 24 heads x 128, RoPE axes 16 + 56 + 56, 2x2-packed 16-channel latents (64 inputs),
# text width 4096 (T5-XXL), pooled width 768 (CLIP-L), the guidance embedding of the distilled model
FLUX_DEV_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)
FLUX_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, norm_num_groups=32,
    sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
)
FLUX_SCHEDULER = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096,
)
# offline names -> builders; register_random_flux adds reduced-depth copies
OFFLINE_BUILDERS = {"tiny-flux": build_tiny_flux_pipeline}


@register_family("flux")
class FluxPolicy(FlowMatchingPolicy):
    """FLUX.1 (``FluxPipeline``): CLIP (pooled) and T5 text encoders, packed 2x2 latents with position
    ids, a guidance embedding instead of CFG (FLUX.1-dev), dynamic timestep shifting."""
    shard_blocks = ("transformer_blocks", "single_transformer_blocks")  # dual-stream, then single-stream blocks

    pipeline_class = FluxPipeline
    pipeline_class_names = ("FluxPipeline",)
    offline_models = ("tiny-flux", "random-flux")
    default_max_sequence_length = 512
    patch_multiple = 2

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(FluxPipeline, model, revision, torch_dtype, OFFLINE_BUILDERS)

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


def build_random_flux_pipeline(seed=0, torch_dtype=torch.float32, num_layers=None, num_single_layers=None):
    """FLUX.1-dev's architecture with random weights, built offline (the model name "random-flux"): for speed,
    memory and exactness checks on a GPU (benchmarks/gpu_check.py); its images mean nothing.

    transformer ``FLUX_DEV_TRANSFORMER`` (the published config, 11.9B parameters; ``num_layers`` /
                ``num_single_layers`` fewer blocks for a copy that fits a smaller GPU: ``register_random_flux``)
    vae         the 16-channel ``FLUX_VAE``; scheduler FLUX.1's dynamic shifting (``FLUX_SCHEDULER``)
    text        small: a 2-layer CLIPTextModel of CLIP-L's width 768 (the pooled input) with the tiny CLIP
                tokenizer, a 1-layer T5 encoder of T5-XXL's width 4096 (64 heads x 64, d_ff 10240) with the tiny
                word-level tokenizer: the transformer sees the real widths and max_sequence_length text tokens
    Weights in ``torch_dtype`` on the CPU; the global torch RNG state is left unchanged.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = build_tiny_tokenizer(model_max_length=77), build_tiny_t5_tokenizer()
    transformer_config = dict(FLUX_DEV_TRANSFORMER)
    transformer_config.update({k: v for k, v in (("num_layers", num_layers), ("num_single_layers", num_single_layers)) if v})
    with seeded(seed), created_in(torch_dtype):  # no float32 copy of 12B weights first
        transformer = FluxTransformer2DModel(**transformer_config).eval()
        vae = AutoencoderKL(**FLUX_VAE).eval()
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
            num_attention_heads=12, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )).eval()
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=4096, d_kv=64, d_ff=10240, num_layers=1, num_heads=64,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )).eval()
    pipeline = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, text_encoder_2=text_encoder_2.to(torch_dtype), tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


OFFLINE_BUILDERS["random-flux"] = build_random_flux_pipeline


def register_random_flux(num_layers, num_single_layers):
    """An offline name for FLUX.1-dev's architecture with fewer blocks (``num_layers`` double-stream, ``num_single_layers``
    single-stream), for a GPU that cannot hold the 12B transformer and its activations; returns the name."""
    name = f"random-flux-{num_layers}x{num_single_layers}"
    if name not in OFFLINE_BUILDERS:
        def build(seed=0, torch_dtype=torch.float32):
            return build_random_flux_pipeline(seed, torch_dtype, num_layers, num_single_layers)

        OFFLINE_BUILDERS[name] = build
        FluxPolicy.offline_models = FluxPolicy.offline_models + (name,)
    return name


@register_family("flux_kontext")
class FluxKontextPolicy(FluxPolicy):
    """FLUX.1 Kontext (``FluxKontextPipeline``): FLUX.1-dev's transformer, text encoders, guidance embedding and grid,
    conditioned on a source image as diffusers' pipeline does (pipelines/flux/pipeline_flux_kontext.py, 0.42):

    - the source (B, 3, H, W) in [0, 1] is encoded once per batch: VAE encoder mode (``sample_mode="argmax"``) of
      2 x - 1, then (z - shift_factor) * scaling_factor: image_latents (B, C, h, w) float32, kept in
      ``Trajectories.extra_cond["image_latents"]`` so that re-scoring reads the sampled condition back;
    - at every step the packed target tokens and the packed source tokens are concatenated along the sequence
      ([x_t ; z_src], N + N_src tokens) with position ids (0, i, j) for the target and (1, i, j) for the source,
      and the velocity is the output's first N tokens;
    - the grid's shift is the target's token count (the source's tokens do not enter it), as in the pipeline.

    The source image must have the sampled resolution (the pipeline resizes to Kontext's preferred sizes and
    allows another size; here the edit and its source are compared pixel for pixel, so it is refused instead).
    Guidance is FLUX.1-dev's embedding (Kontext-dev: 2.5 by default); the pipeline's true CFG with a negative
    prompt is not used."""

    pipeline_class = FluxKontextPipeline
    pipeline_class_names = ("FluxKontextPipeline",)
    offline_models = ("tiny-flux-kontext",)
    conditions_on_images = True
    anchor_refusal = "it edits images and its rewards read the source image, which the anchor's reward calls lack"

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(FluxKontextPipeline, model, revision, torch_dtype,
                               {"tiny-flux-kontext": build_tiny_flux_kontext_pipeline})

    def _initial_latents(self, batch_size, device, generator):
        pipe = self.pipeline  # Kontext's prepare_latents takes the source first: None draws the noise alone
        packed, _, _, _ = pipe.prepare_latents(
            None, batch_size, self.latent_channels, self.resolution, self.resolution, torch.float32, device, generator
        )
        return pipe._unpack_latents(packed, self.resolution, self.resolution, pipe.vae_scale_factor)

    def _encode_source(self, source_images):
        vae = self.pipeline.vae
        latents = vae.encode((2 * source_images - 1).to(vae.dtype)).latent_dist.mode()
        latents = (latents.float() - vae.config.shift_factor) * vae.config.scaling_factor
        return {"image_latents": latents}

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        pipe = self.pipeline
        dtype = model_dtype(model)
        b, c, h, w = latents.shape
        source = cond["image_latents"]
        sh, sw = source.shape[2:]
        tokens = torch.cat([pipe._pack_latents(latents, b, c, h, w), pipe._pack_latents(source, b, c, sh, sw)], dim=1)
        target_ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, dtype)
        source_ids = pipe._prepare_latent_image_ids(b, sh // 2, sw // 2, latents.device, dtype)
        source_ids[..., 0] = 1  # the source's tokens sit in another "frame" of the RoPE positions
        embeds = cond["prompt_embeds"]
        text_ids = torch.zeros(embeds.shape[1], 3, device=latents.device, dtype=dtype)
        config = getattr(model, "config", None) or pipe.transformer.config
        guidance = torch.full([b], guidance_scale, device=latents.device, dtype=torch.float32) if config.guidance_embeds else None
        velocity = model(
            hidden_states=tokens.to(dtype), timestep=timesteps.to(torch.float32) / 1000, guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(dtype), encoder_hidden_states=embeds.to(dtype),
            txt_ids=text_ids, img_ids=torch.cat([target_ids, source_ids]), return_dict=False,
        )[0][:, : (h // 2) * (w // 2)]
        return pipe._unpack_latents(velocity.float(), self.resolution, self.resolution, pipe.vae_scale_factor)


def build_tiny_flux_kontext_pipeline(seed=0):
    """A FluxKontextPipeline of the tiny FLUX pipeline's parts (``build_tiny_flux_pipeline(seed)``: 32 px images,
    4x8x8 latents, 1 double + 1 single block, guidance embedding; CLIP and T5 built in memory), CPU, float32."""
    flux = build_tiny_flux_pipeline(seed)
    pipeline = FluxKontextPipeline(
        scheduler=flux.scheduler, vae=flux.vae, text_encoder=flux.text_encoder, tokenizer=flux.tokenizer,
        text_encoder_2=flux.text_encoder_2, tokenizer_2=flux.tokenizer_2, transformer=flux.transformer,
    )
    pipeline.default_sample_size = flux.default_sample_size
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
