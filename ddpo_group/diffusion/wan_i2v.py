"""Wan image-to-video (``WanImageToVideoPipeline``) as a Flow-GRPO policy: Wan 2.1 I2V (one transformer, a CLIP
image encoder) and Wan 2.2 A14B I2V (two experts, no image encoder; ``wan_moe.py``'s expert handling).

The conditioning image is the first frame. It rides in the trajectories as an editing family's source image
does (docs/editing.md): the prompt file's record carries ``source_image``, ``sample(..., source_images=...)``
encodes it once and ``Trajectories.extra_cond`` keeps the encoding, so re-scoring reads exactly what sampling
read. As ``WanImageToVideoPipeline.__call__`` conditions:

- ``image_condition`` (B, T' + C, f, h, w) float32: the VAE's mode of the video [image, 0, ..., 0] (F frames in
  [-1, 1]) normalised by the VAE config's latents mean / std, after T' mask channels (T' the VAE's temporal
  factor: 1 on the first frame's T' sub-frames, 0 elsewhere); the transformer reads the latents and it
  concatenated on the channels (16 + 4 + 16 = 36 for Wan);
- ``image_embeds`` (B, 257, 1280) (Wan 2.1 I2V only, whose transformer has ``image_dim``): the CLIP vision
  encoder's penultimate hidden states of the image, the second cross-attention's keys and values.

The flow steps act on the C latent channels only (the noise is drawn as the pipeline draws it, before the VAE
encodes the image); decoding is ``WanPolicy``'s. Wan 2.2 TI2V-5B's image-to-video (``expand_timesteps``: the first
latent frame replaced by the image's, a timestep per token) is refused in one line.
"""

import numpy as np
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline
from diffusers.utils.torch_utils import randn_tensor

from ddpo_group.diffusion.base import register_family
from ddpo_group.diffusion.flow_policy import load_pretrained
from ddpo_group.diffusion.tiny import IMAGE_SIZE, TOKENIZER_WORDS, build_tiny_t5_tokenizer, created_in, seeded
from ddpo_group.diffusion.wan import TINY_NUM_FRAMES, _umt5_encoder, keep_fp32_modules, to_flow_euler
from ddpo_group.diffusion.wan_moe import (
    TINY_BOUNDARY_RATIO,
    WAN22_A14B_TRANSFORMER,
    WanExpertsPolicy,
    tiny_expert,
)

# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers transformer/config.json: 40 blocks of 40 heads x 128, FFN 13824, in 36
# channels (16 latents + 4 mask + 16 image), CLIP image width 1280 into a second cross-attention (added_kv 5120)
WAN21_I2V_14B_TRANSFORMER = dict(
    WAN22_A14B_TRANSFORMER, in_channels=36, image_dim=1280, added_kv_proj_dim=5120,
)
# its image_encoder/config.json: CLIP ViT-H/14 vision tower (1280 wide, 32 layers of 16 heads, 224 px, patch 14)
CLIP_VIT_H_14 = dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=16, num_hidden_layers=32,
                     image_size=224, patch_size=14, hidden_act="gelu")
# Wan-AI/Wan2.2-I2V-A14B-Diffusers: two experts of 36 input channels, no image encoder, boundary_ratio 0.9
WAN22_I2V_A14B_BOUNDARY_RATIO = 0.9


@register_family("wan_i2v")
class WanI2VPolicy(WanExpertsPolicy):
    """Wan image-to-video (module docstring): a ``WanPolicy`` whose sample takes one conditioning image per prompt
    (``conditions_on_images``), with one transformer (Wan 2.1 I2V) or two experts (Wan 2.2 A14B I2V)."""

    pipeline_class = WanImageToVideoPipeline
    pipeline_class_names = ("WanImageToVideoPipeline",)
    offline_models = ("tiny-wan-i2v", "tiny-wan22-i2v", "random-wan21-i2v-14b", "random-wan22-i2v-a14b")
    conditions_on_images = True
    anchor_refusal = "it animates a source image and its rewards read it, which the anchor's reward calls lack"

    @classmethod
    def supports(cls, pipeline):
        return isinstance(pipeline, WanImageToVideoPipeline)

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        builders = {"tiny-wan-i2v": build_tiny_wan_i2v_pipeline, "tiny-wan22-i2v": build_tiny_wan22_i2v_pipeline,
                    "random-wan21-i2v-14b": build_random_wan21_i2v_pipeline,
                    "random-wan22-i2v-a14b": build_random_wan22_i2v_pipeline}
        pipeline = to_flow_euler(load_pretrained(WanImageToVideoPipeline, model, revision, torch_dtype, builders,
                                                 absent_components=("image_encoder", "image_processor",
                                                                    "transformer_2")))
        for expert in (pipeline.transformer, getattr(pipeline, "transformer_2", None)):
            if expert is not None:
                keep_fp32_modules(expert)
        return pipeline

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, **flow_options):
        if self.pipeline.config.get("expand_timesteps"):
            raise ValueError("config.pretrained.model: Wan 2.2 TI2V-5B's image-to-video (expand_timesteps) is not "
                             "supported; use it for text-to-video (WanPipeline) or Wan 2.1 / 2.2 A14B I2V")
        super().configure(sde_type=sde_type, max_sequence_length=max_sequence_length, resolution=resolution,
                          **flow_options)

    @property
    def latent_channels(self):
        """The C channels the flow steps act on (the VAE's z_dim; the transformer reads C + T' + C)."""
        return self.pipeline.vae.config.z_dim

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        """WanPolicy's text conditioning through WanPipeline's T5 encoding: WanImageToVideoPipeline's own calls
        ``ftfy.fix_text`` without checking that ftfy is installed (diffusers 0.42), WanPipeline's only when it is
        (the two agree on text ftfy leaves unchanged, e.g. plain ASCII)."""
        def text(prompt):
            return WanPipeline._get_t5_prompt_embeds(self.pipeline, prompt=prompt, device=device,
                                                     max_sequence_length=self.max_sequence_length)

        cond = {"prompt_embeds": text(list(prompts))}
        if guidance_scale > 1.0:
            cond["negative_prompt_embeds"] = text([negative_prompt or ""] * len(prompts))
        return cond

    def _check_source_images(self, source_images, batch_size):
        if source_images is None:
            raise ValueError(f"{type(self.pipeline).__name__} makes a video from an image: every prompt needs its "
                             "first frame (the prompt record's field 'source_image'; docs/wan.md)")
        if (self.height, self.width) != (self.resolution, self.resolution):
            raise ValueError(f"the conditioning image must be square: this policy makes {self.height}x{self.width} "
                             "videos; set config.sample.resolution")
        return super()._check_source_images(source_images, batch_size)

    def _encode_source(self, source_images):
        """{"image_condition": (B, T' + C, f, h, w) float32[, "image_embeds": (B, L, D)]} of the first frames
        (B, 3, H, W) in [0, 1], as WanImageToVideoPipeline's prepare_latents and encode_image make them."""
        pipe = self.pipeline
        vae = pipe.vae
        device = source_images.device
        batch, _, height, width = source_images.shape
        frames = self.num_frames
        temporal = pipe.vae_scale_factor_temporal
        image = (source_images.float() * 2 - 1).unsqueeze(2)  # the video processor's [-1, 1]
        video = torch.cat([image, image.new_zeros(batch, 3, frames - 1, height, width)], dim=2)
        encoded = vae.encode(video.to(vae.dtype)).latent_dist.mode().to(device, torch.float32)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(device, torch.float32)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(device, torch.float32)
        encoded = (encoded - mean) * inverse_std
        latent_frames, h, w = encoded.shape[2:]
        mask = torch.zeros(batch, 1, frames, h, w)
        mask[:, :, 0] = 1
        mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(batch, -1, temporal, h, w).transpose(1, 2).to(device)
        cond = {"image_condition": torch.cat([mask, encoded], dim=1)}
        if getattr(pipe, "image_encoder", None) is not None and pipe.transformer.config.image_dim is not None:
            pixels = (source_images.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
            from PIL import Image

            images = [Image.fromarray(np.asarray(p)) for p in pixels]
            cond["image_embeds"] = torch.cat([pipe.encode_image(img, device) for img in images]).float()
        return cond

    def _initial_latents(self, batch_size, device, generator):
        """Noise (B, C, f, h, w) float32 drawn as WanImageToVideoPipeline.prepare_latents draws it."""
        pipe = self.pipeline
        shape = (batch_size, self.latent_channels, (self.num_frames - 1) // pipe.vae_scale_factor_temporal + 1,
                 self.height // pipe.vae_scale_factor_spatial, self.width // pipe.vae_scale_factor_spatial)
        return randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)

    def _model_input(self, latents, cond):
        return torch.cat([latents, cond["image_condition"].to(latents.device)], dim=1)

    def _model_kwargs(self, cond, dtype):
        embeds = cond.get("image_embeds")
        return {} if embeds is None else {"encoder_hidden_states_image": embeds.to(dtype)}


# ---------------------------------------------------------------------------------------------------
# Offline pipelines: the tiny twins (tests, the tiny_wan_i2v variants) and the published architectures (GPU check)


def _tiny_vae():
    return AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0], scale_factor_temporal=2,
        scale_factor_spatial=4,
    ).eval()


def _tiny_i2v(seed, two_experts):
    tokenizer = build_tiny_t5_tokenizer(TOKENIZER_WORDS)
    in_channels = 4 + 2 + 4  # latents, the mask's temporal-factor channels, the image's latents
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = _tiny_vae()
        text_encoder = _umt5_encoder(len(tokenizer), d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8).eval()
        image_encoder = image_processor = None
        if not two_experts:
            from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

            image_encoder = CLIPVisionModel(CLIPVisionConfig(
                hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=2, image_size=32,
                patch_size=8, projection_dim=16,
            )).eval()
            image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    image = {} if two_experts else {"image_dim": 16, "added_kv_proj_dim": 16}
    extra = {"transformer_2": tiny_expert(seed + 2, in_channels), "boundary_ratio": TINY_BOUNDARY_RATIO} if two_experts else {}
    pipeline = WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        image_processor=image_processor, image_encoder=image_encoder,
        transformer=tiny_expert(seed + 1, in_channels, **image), **extra,
    )
    pipeline.default_height = pipeline.default_width = IMAGE_SIZE
    pipeline.default_num_frames = TINY_NUM_FRAMES
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def build_tiny_wan_i2v_pipeline(seed=0):
    """A Wan 2.1-style WanImageToVideoPipeline with random weights from `seed`, built offline (CPU, float32): the
    tiny Wan's UMT5, VAE (4 latent channels, factors 4 / 2) and transformer sizes, its input 10 channels (4 latents
    + 2 mask + 4 image), a 2-layer CLIP vision tower (16 wide, 32 px, patch 8) into a second cross-attention
    (image_dim 16). 5 frames of 32x32. The global RNG state is left unchanged."""
    return _tiny_i2v(seed, two_experts=False)


def build_tiny_wan22_i2v_pipeline(seed=0):
    """``build_tiny_wan_i2v_pipeline`` as Wan 2.2 A14B I2V: no image encoder, two experts of 10 input channels
    (high noise, low noise) with the tiny MoE's boundary_ratio 0.7 (t >= 700: the first)."""
    return _tiny_i2v(seed, two_experts=True)


def _random_i2v(torch_dtype, seed, two_experts):
    tokenizer = build_tiny_t5_tokenizer(TOKENIZER_WORDS)
    with seeded(seed), created_in(torch_dtype):
        vae = AutoencoderKLWan()
        text_encoder = _umt5_encoder(len(tokenizer), d_model=4096, d_ff=256, num_layers=1, num_heads=64, d_kv=64)
        from diffusers import WanTransformer3DModel

        if two_experts:
            config = dict(WAN22_A14B_TRANSFORMER, in_channels=36)
            parts = {"transformer": WanTransformer3DModel(**config), "transformer_2": WanTransformer3DModel(**config),
                     "boundary_ratio": WAN22_I2V_A14B_BOUNDARY_RATIO}
        else:
            from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

            parts = {"transformer": WanTransformer3DModel(**WAN21_I2V_14B_TRANSFORMER),
                     "image_encoder": CLIPVisionModel(CLIPVisionConfig(**CLIP_VIT_H_14)).eval(),
                     "image_processor": CLIPImageProcessor(size={"shortest_edge": 224},
                                                           crop_size={"height": 224, "width": 224})}
    pipeline = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **parts)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def build_random_wan21_i2v_pipeline(seed=0, torch_dtype=torch.float32):
    """Wan 2.1 I2V 14B (480P)'s architecture with random weights (``WAN21_I2V_14B_TRANSFORMER``, the CLIP ViT-H/14
    vision tower, the Wan VAE), a 1-layer UMT5 of the real width. For benchmarks/gpu_check.py: the cost only."""
    return _random_i2v(torch_dtype, seed, two_experts=False)


def build_random_wan22_i2v_pipeline(seed=0, torch_dtype=torch.float32):
    """Wan 2.2 A14B I2V's architecture with random weights: two 14B experts of 36 input channels, boundary 0.9."""
    return _random_i2v(torch_dtype, seed, two_experts=True)
