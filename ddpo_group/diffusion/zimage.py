"""Z-Image and Z-Image-Turbo (``ZImagePipeline``, family "zimage") as a flow-matching family, with its offline tiny and
full-size random pipelines. Z-Image-Turbo is the same architecture distilled to a few steps without CFG: a preset
(``zimage_turbo``), not another family.

What follows diffusers' ``pipelines/z_image/pipeline_z_image.py`` (0.42) exactly:

- text: Qwen3's chat template (thinking on) around each prompt, padded to ``max_sequence_length`` tokens, the text
  encoder's last-but-one hidden state, and only the valid tokens kept (``pipe._encode_prompt``: a list of (l_i, D)).
  Trajectories store them zero-padded to ``max_sequence_length`` with a 0/1 mask (``Trajectories.extra_cond``:
  ``prompt_embeds_mask``, ``negative_prompt_embeds_mask``), and every model call passes the valid tokens again, so
  batches of different prompts concatenate and the transformer sees what the pipeline gives it;
- latents: (B, C, h, w) noise as ``pipe.prepare_latents`` draws it; the transformer takes a list of (C, 1, h, w) and
  patchifies 2x2 itself; its timestep is ``(1000 - t) / 1000`` (1 - sigma) and its output is minus the velocity;
- grid: ``get_default_z_image_sigmas`` (a linspace from 1 to 1/T) through the scheduler with ``mu`` from
  ``calculate_shift`` (Z-Image's scheduler has dynamic shifting off and shift 3: mu is then unused);
- guidance: the pipeline's ``guidance_scale`` g enables CFG for g > 0 with ``pos + g (pos - neg)``, the conditional
  and the negative rows in one transformer call. Here ``sample.guidance_scale`` is the usual weight w of
  ``neg + w (pos - neg)`` (1: no guidance, as every family here): w = g + 1, computed as ``pos + (w - 1)(pos - neg)``.
  So Z-Image-Turbo's "guidance 0" is w = 1 and the base model's recommended g = 4 is w = 5. The negative prompt is
  ``sample.negative_prompt`` ("" by default, the pipeline's). The pipeline's ``cfg_normalization`` (off) and
  ``cfg_truncation`` (1.0: never) are left at their defaults;
- decode: FLUX.1's VAE, ``z / scaling_factor + shift_factor`` (the flow base's ``_decode``).
"""

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas, retrieve_timesteps

from ddpo_group.diffusion.base import model_dtype, register_family
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.tiny import IMAGE_SIZE, created_in, seeded, tiny_component_configs
from ddpo_group.diffusion.tiny_chat import build_tiny_qwen3_tokenizer, tiny_qwen3_config

# Z-Image's attention projections (its main layers and both refiners)
LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
# Tongyi-MAI/Z-Image-Turbo's scheduler config as public ports write it out (not read from the hub here)
ZIMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


@register_family("zimage")
class ZImagePolicy(FlowMatchingPolicy):
    """Z-Image / Z-Image-Turbo (``ZImagePipeline``): a Qwen3 text encoder's valid tokens, a single-stream DiT with
    refiners that patchifies itself, 1 - sigma as its time, minus the velocity as its output, CFG in one call with the
    pipeline's ``pos + g (pos - neg)`` (module docstring: ``sample.guidance_scale`` = g + 1)."""

    shard_blocks = ("noise_refiner", "context_refiner", "layers")
    lora_target_modules = LORA_TARGET_MODULES
    pipeline_class = ZImagePipeline
    pipeline_class_names = ("ZImagePipeline",)
    offline_models = ("tiny-zimage", "random-zimage")
    default_max_sequence_length = 512  # the pipeline's default
    patch_multiple = 2

    def __init__(self, pipeline):
        if isinstance(pipeline, ZImagePipeline) and not hasattr(pipeline, "default_sample_size"):
            pipeline.default_sample_size = 1024 // pipeline.vae_scale_factor  # the pipeline's default: 1024 px
        super().__init__(pipeline)

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(ZImagePipeline, model, revision, torch_dtype,
                               {"tiny-zimage": build_tiny_zimage_pipeline, "random-zimage": build_random_zimage_pipeline})

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, **flow_options):
        limit = self.pipeline.transformer.config.axes_lens[0] // 2
        if max_sequence_length > limit:
            raise ValueError(f"config.sample.max_sequence_length={max_sequence_length}: this Z-Image transformer's "
                             f"positions allow at most {limit} text tokens")
        super().configure(sde_type=sde_type, max_sequence_length=max_sequence_length, resolution=resolution, **flow_options)

    @property
    def latent_channels(self):
        return self.pipeline.transformer.config.in_channels

    def critic_sizes(self):
        return {"latent_channels": self.latent_channels, "prompt_dim": self.pipeline.transformer.config.cap_feat_dim}

    def _text(self, prompts, device):
        """The valid tokens' embeddings of each prompt, zero-padded to max_sequence_length: (B, L, D), (B, L) int64."""
        length = self.max_sequence_length
        embeds = self.pipeline._encode_prompt(prompt=list(prompts), device=device, max_sequence_length=length)
        padded = embeds[0].new_zeros(len(embeds), length, embeds[0].shape[-1])
        mask = torch.zeros(len(embeds), length, dtype=torch.long, device=padded.device)
        for i, tokens in enumerate(embeds):
            padded[i, : len(tokens)] = tokens
            mask[i, : len(tokens)] = 1
        return padded, mask

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        embeds, mask = self._text(prompts, device)
        cond = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if guidance_scale > 1.0:  # the negative prompt is encoded once and shared by the rows
            negative, negative_mask = self._text([negative_prompt], device)
            cond["negative_prompt_embeds"] = negative.repeat(len(prompts), 1, 1)
            cond["negative_prompt_embeds_mask"] = negative_mask.repeat(len(prompts), 1)
        return cond

    def _initial_latents(self, batch_size, device, generator):
        return self.pipeline.prepare_latents(
            batch_size, self.latent_channels, self.resolution, self.resolution, torch.float32, device, generator
        )

    def _timesteps(self, num_steps, device):
        pipe = self.pipeline
        side = self.resolution // pipe.vae_scale_factor // 2
        config = pipe.scheduler.config
        mu = calculate_shift(side * side, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        retrieve_timesteps(pipe.scheduler, num_steps, device, sigmas=get_default_z_image_sigmas(num_steps), mu=mu)

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        dtype = model_dtype(model)
        b = latents.shape[0]
        time = (1000 - timesteps.to(torch.float32)) / 1000

        def valid(embeds, mask):
            return [e[m.bool()].to(dtype) for e, m in zip(embeds, mask)]

        caps = valid(cond["prompt_embeds"], cond["prompt_embeds_mask"])
        x = latents.to(dtype)
        cfg = guidance_scale > 1.0 and cond.get("negative_prompt_embeds") is not None
        if cfg:  # one call of the conditional and the negative rows, as the pipeline batches them
            caps = caps + valid(cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"])
            x, time = x.repeat(2, 1, 1, 1), time.repeat(2)
        out = model(list(x.unsqueeze(2).unbind(dim=0)), time, caps, return_dict=False)[0]
        out = torch.stack([o.float() for o in out], dim=0).squeeze(2)
        if cfg:
            positive, negative = out[:b], out[b:]
            out = positive + (guidance_scale - 1.0) * (positive - negative)
        return -out


# ---------------------------------------------------------------------------------------------------
# Offline pipelines


def build_tiny_zimage_pipeline(seed=0):
    """A ZImagePipeline with random weights drawn from ``seed`` (CPU, float32), built offline ("tiny-zimage").

    transformer ZImageTransformer2DModel: 4-channel latents patchified 2x2 by the model, width 32 (2 heads x 16, rope
                axes 4 + 6 + 6), 2 main layers and 1 layer in each refiner, caption width 16
    text        a 3-layer Qwen3Model of width 16 (the pipeline reads the last but one hidden state) with
                ``tiny_chat.build_tiny_qwen3_tokenizer`` (Qwen3's chat template, in memory)
    vae         the tiny AutoencoderKL of the tiny FLUX.1 pipeline (scale factor 4, scaling 1.5305, shift 0.0609)
    scheduler   Z-Image-Turbo's (``ZIMAGE_SCHEDULER``)
    Default image 32 x 32 (``default_sample_size`` 8). The global torch RNG state is left unchanged.
    """
    from transformers import Qwen3Model

    tokenizer = build_tiny_qwen3_tokenizer()
    configs = tiny_component_configs(vocab_size=len(tokenizer))
    with seeded(seed):
        transformer = ZImageTransformer2DModel(
            in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
            axes_dims=[4, 6, 6], axes_lens=[256, 32, 32],
        ).eval()
        vae = AutoencoderKL(**dict(configs["vae"], scaling_factor=1.5305, shift_factor=0.0609)).eval()
        text_encoder = Qwen3Model(tiny_qwen3_config(len(tokenizer), num_hidden_layers=3)).eval()
    pipeline = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipeline.default_sample_size = IMAGE_SIZE // pipeline.vae_scale_factor
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# Z-Image (Tongyi-MAI/Z-Image and Z-Image-Turbo, 6B): diffusers' ZImageTransformer2DModel defaults are its config, 30
# layers of width 3840 (30 heads), 2 refiner layers each, caption width 2560 (Qwen3-4B); the VAE is FLUX.1's
ZIMAGE_TRANSFORMER = dict(in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30,
                          cap_feat_dim=2560)
# FLUX.1's VAE (black-forest-labs/FLUX.1-dev vae/), which Z-Image uses
ZIMAGE_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, norm_num_groups=32,
    sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
)


def build_random_zimage_pipeline(seed=0, torch_dtype=torch.float32):
    """Z-Image's transformer (``ZIMAGE_TRANSFORMER``, 6B) and FLUX.1's 16-channel VAE with random weights
    ("random-zimage"), for speed and memory checks on a GPU; text: a 3-layer Qwen3 of Qwen3-4B's width 2560 with 4 heads
    x 32 and a 64-wide MLP, the tiny tokenizer. Default image 1024 px. Its images mean nothing."""
    from transformers import Qwen3Model

    tokenizer = build_tiny_qwen3_tokenizer()
    with seeded(seed), created_in(torch_dtype):
        transformer = ZImageTransformer2DModel(**ZIMAGE_TRANSFORMER).eval()
        vae = AutoencoderKL(**ZIMAGE_VAE).eval()
        text_encoder = Qwen3Model(tiny_qwen3_config(len(tokenizer), 2560, 3, 4, 32, 64)).eval()
    pipeline = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipeline.default_sample_size = 128
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
