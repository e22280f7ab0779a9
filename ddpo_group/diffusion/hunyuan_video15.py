"""HunyuanVideo 1.5 text-to-video (``HunyuanVideo15Pipeline``, family "hunyuan_video15") as a flow-matching video
family, and its offline tiny pipeline.

What follows diffusers' ``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py`` (0.42):

- text, twice: (1) the Qwen2.5-VL text model's hidden state two layers before the last, of the chat template
  (``pipe.system_message`` as the system turn, the prompt as the user's) padded to ``crop_start +
  max_sequence_length`` tokens, the template's first ``pipe.prompt_template_encode_start_idx`` (108) tokens cropped,
  with the 0/1 mask (``pipe._get_mllm_prompt_embeds``); (2) ByT5's encoding of the prompt's quoted texts
  (``"..."``: the glyphs to render), ``pipe.tokenizer_2_max_length`` tokens, zeros and mask 0 when it quotes none
  (``pipe._get_byt5_prompt_embeds``). Both are fixed-length: batches concatenate. The masks and the ByT5 embeddings
  ride in ``Trajectories.extra_cond``;
- latents (B, C, f, h, w) float32 noise (``pipe.prepare_latents``), f = (F - 1) / 4 + 1 latent frames; the model
  input is [latents; zero condition latents; zero mask] on the channels and zero vision tokens
  (``vision_num_semantic_tokens`` x ``image_embed_dim``: text-to-video), timestep t (sigma * 1000);
- grid: the scheduler's shifted ``np.linspace(1, 0, T + 1)[:-1]`` (FlowMatchEulerDiscreteScheduler, its ``shift``);
- guidance: the pipeline's guider is classifier-free guidance, two transformer calls, ``uncond + w (cond - uncond)``
  with ``w = sample.guidance_scale`` (the guider's own ``guidance_scale`` is not read: the config's is the one a run
  records), the negative prompt "" by default (the pipeline's);
- decode: ``vae.decode(latents / scaling_factor)``, videos (B, F, 3, H, W) in [0, 1], one video per VAE call (the
  VAE's mid-block attention in diffusers 0.42 takes a batch of one: its causal mask does not broadcast over more).

Everything video (``resolution``, ``num_frames``, the critic's sizes, the rewards' frames) is as Wan's (``wan.py``):
samples are videos (B, F, 3, H, W), latents (B, C, f, h, w). The image-to-video pipeline
(``HunyuanVideo15ImageToVideoPipeline``) is not a family here yet.
"""

import os

import numpy as np
import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

from ddpo_group.diffusion.base import model_dtype, register_family, video_frames
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.tiny import IMAGE_SIZE, created_in, seeded
from ddpo_group.diffusion.tiny_chat import build_tiny_chat_tokenizer

DEFAULT_NUM_FRAMES = 121  # HunyuanVideo15Pipeline.__call__'s default
TINY_NUM_FRAMES = 5


@register_family("hunyuan_video15")
class HunyuanVideo15Policy(FlowMatchingPolicy):
    """HunyuanVideo 1.5 text-to-video (``HunyuanVideo15Pipeline``): Qwen2.5-VL and ByT5 text, zero image and
    condition inputs, CFG with two calls, Euler / SDE steps on the scheduler's shifted grid (module docstring)."""

    pipeline_class = HunyuanVideo15Pipeline
    pipeline_class_names = ("HunyuanVideo15Pipeline",)
    offline_models = ("tiny-hunyuan-video15", "random-hunyuan-video15-480p")
    default_max_sequence_length = 1000  # the pipeline's tokenizer_max_length
    patch_multiple = 1
    video = True
    shard_blocks = ("transformer_blocks",)

    def __init__(self, pipeline):
        # FlowMatchingPolicy.__init__ reads an image pipeline's default_sample_size; this one makes (H, W) videos
        super(FlowMatchingPolicy, self).__init__(pipeline)
        self.sde_type = "sde"
        self.cps_log_prob = "normalized"
        self.flow_grid, self.flow_grid_shift = "pipeline", 3.0
        self.max_sequence_length = getattr(pipeline, "tokenizer_max_length", self.default_max_sequence_length)
        side = getattr(pipeline, "target_size", 480)
        self.height = getattr(pipeline, "default_height", side)
        self.width = getattr(pipeline, "default_width", side)
        self.num_frames = getattr(pipeline, "default_num_frames", DEFAULT_NUM_FRAMES)

    @property
    def resolution(self):
        """The frame side for a square video (config.sample.resolution); the height for another shape."""
        return self.height

    @resolution.setter
    def resolution(self, side):
        self.height = self.width = side

    def configure_frames(self, num_frames):
        """config.sample.num_frames F (0: the model's default): F - 1 must be a multiple of the VAE's temporal factor."""
        if not num_frames:
            return
        self.num_frames = video_frames(num_frames, self.pipeline.vae_scale_factor_temporal, "HunyuanVideo 1.5")

    def _initial_latents(self, batch_size, device, generator):
        return self.pipeline.prepare_latents(
            batch_size, self.latent_channels, self.height, self.width, self.num_frames, torch.float32, device, generator
        )

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        pipeline = load_pretrained(HunyuanVideo15Pipeline, model, revision, torch_dtype,
                                   {"tiny-hunyuan-video15": build_tiny_hunyuan_video15_pipeline,
                                    "random-hunyuan-video15-480p": build_random_hunyuan_video15_pipeline})
        if not isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(f"model {model!r}: a HunyuanVideo15Pipeline with a {type(pipeline.scheduler).__name__}; "
                             "the family samples with FlowMatchEulerDiscreteScheduler (the published one)")
        return pipeline

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, **flow_options):
        if resolution and resolution % self.pipeline.vae_scale_factor_spatial:
            multiple = self.pipeline.vae_scale_factor_spatial
            raise ValueError(f"config.sample.resolution={resolution} must be a multiple of {multiple} for this model")
        FlowMatchingPolicy.configure(self, sde_type=sde_type, max_sequence_length=max_sequence_length,
                                     **flow_options)
        self.max_sequence_length = max_sequence_length or getattr(self.pipeline, "tokenizer_max_length",
                                                                  self.default_max_sequence_length)
        if resolution:
            self.resolution = resolution

    @property
    def latent_channels(self):
        return self.pipeline.num_channels_latents

    def critic_sizes(self):
        frames = (self.num_frames - 1) // self.pipeline.vae_scale_factor_temporal + 1
        return {"latent_channels": self.latent_channels * frames,
                "prompt_dim": self.pipeline.transformer.config.text_embed_dim}

    def _texts(self, prompts, device):
        pipe = self.pipeline
        embeds, mask = pipe._get_mllm_prompt_embeds(
            text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, prompt=list(prompts), device=device,
            tokenizer_max_length=self.max_sequence_length, system_message=pipe.system_message,
            crop_start=pipe.prompt_template_encode_start_idx,
        )
        glyphs, glyph_mask = pipe._get_byt5_prompt_embeds(
            tokenizer=pipe.tokenizer_2, text_encoder=pipe.text_encoder_2, prompt=list(prompts), device=device,
            tokenizer_max_length=pipe.tokenizer_2_max_length,
        )
        return embeds, mask.long(), glyphs, glyph_mask.long()

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        embeds, mask, glyphs, glyph_mask = self._texts(prompts, device)
        cond = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "prompt_embeds_2": glyphs,
                "prompt_embeds_mask_2": glyph_mask}
        if guidance_scale > 1.0:  # the negative prompt ("" by default) encoded once per row, as the pipeline does
            negative = self._texts([negative_prompt or ""] * len(prompts), device)
            cond.update(zip(("negative_prompt_embeds", "negative_prompt_embeds_mask", "negative_prompt_embeds_2",
                             "negative_prompt_embeds_mask_2"), negative))
        return cond

    def _timesteps(self, num_steps, device):
        retrieve_timesteps(self.pipeline.scheduler, num_steps, device,
                           sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])

    def _condition(self, latents, cond, dtype):
        """The model's condition input (zero condition latents and mask: text-to-video) and vision tokens (zeros)."""
        pipe = self.pipeline
        b, c, f, h, w = latents.shape
        image_embeds = torch.zeros(b, pipe.vision_num_semantic_tokens, pipe.vision_states_dim, dtype=dtype,
                                   device=latents.device)
        return latents.new_zeros(b, c + 1, f, h, w), image_embeds

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        dtype = model_dtype(model)
        b = latents.shape[0]
        condition, image_embeds = self._condition(latents, cond, dtype)
        hidden = torch.cat([latents, condition.to(latents.dtype)], dim=1).to(dtype)
        timestep = timesteps.reshape(-1).expand(b).to(dtype)

        def call(prefix):
            return model(hidden_states=hidden, image_embeds=image_embeds, timestep=timestep,
                         encoder_hidden_states=cond[f"{prefix}prompt_embeds"].to(dtype),
                         encoder_attention_mask=cond[f"{prefix}prompt_embeds_mask"].to(dtype),
                         encoder_hidden_states_2=cond[f"{prefix}prompt_embeds_2"].to(dtype),
                         encoder_attention_mask_2=cond[f"{prefix}prompt_embeds_mask_2"].to(dtype),
                         return_dict=False)[0]

        velocity = call("")
        if guidance_scale > 1.0 and cond.get("negative_prompt_embeds") is not None:
            uncond = call("negative_")
            velocity = uncond + guidance_scale * (velocity - uncond)
        return velocity.float()

    def save_trainable(self, module, output_dir, use_lora, state_dict=None):
        """LoRA in diffusers' format (lora/pytorch_lora_weights.safetensors, keys "transformer.<module>.lora_A /
        lora_B.weight") through HunyuanVideo's LoRA writer: diffusers 0.42 gives HunyuanVideo15Pipeline no LoRA
        loader, so a fresh pipeline takes the file with ``pipe.transformer.load_lora_adapter(dir, prefix=
        "transformer", weight_name="pytorch_lora_weights.safetensors")``. Full fine-tuning: transformer/ (the base's)."""
        if not use_lora:
            return super().save_trainable(module, output_dir, use_lora, state_dict)
        from diffusers.loaders.lora_pipeline import HunyuanVideoLoraLoaderMixin
        from peft import get_peft_model_state_dict

        HunyuanVideoLoraLoaderMixin.save_lora_weights(
            os.path.join(output_dir, "lora"), safe_serialization=True,
            transformer_lora_layers=get_peft_model_state_dict(module, state_dict=state_dict),
        )

    def load_trainable(self, module, input_dir, use_lora):
        if not use_lora:
            return super().load_trainable(module, input_dir, use_lora)
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(os.path.join(input_dir, "lora", "pytorch_lora_weights.safetensors"))
        transformer_state = {k.removeprefix("transformer."): v for k, v in state.items() if k.startswith("transformer.")}
        result = set_peft_model_state_dict(module, transformer_state, adapter_name="default")
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"LoRA weights in {input_dir} do not fit the model: {result.unexpected_keys[:3]}")

    def _decode(self, latents):
        vae = self.pipeline.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor
        # one video at a time: diffusers 0.42's VAE mid-block attention broadcasts its causal mask wrongly for a batch
        video = torch.cat([vae.decode(z[i : i + 1], return_dict=False)[0] for i in range(z.shape[0])])
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)


# ---------------------------------------------------------------------------------------------------
# The offline tiny pipeline

CHAT_TEMPLATE = (  # ChatML, the format of Qwen2.5's template (no tools, no images)
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_tokenizer():
    """The tiny chat tokenizer (``tiny_chat``) with ChatML's markers and template; the words of the pipeline's system
    message that are not shapes-world words are spelled out byte by byte (its system turn is a few hundred tokens,
    cropped as Qwen's 108 are)."""
    return build_tiny_chat_tokenizer(CHAT_TEMPLATE, ("<|im_start|>", "<|im_end|>"), ("You", "helpful", "assistant", "video"))


def build_tiny_hunyuan_video15_pipeline(seed=0):
    """A HunyuanVideo15Pipeline with random weights drawn from ``seed`` (CPU, float32), built offline.

    transformer HunyuanVideo15Transformer3DModel: 4-channel latents (input 2 x 4 + 1 with the zero condition and
                mask), patch 1, 2 blocks and 1 refiner block of 2 heads x 8 (rope axes 4 + 2 + 2), text widths 32
                (Qwen) and 16 (ByT5), vision width 8
    text        Qwen2.5-VL's text model (3 layers of width 32) with the tiny Qwen2 tokenizer and a ChatML template;
                a 1-layer T5 encoder of width 16 with ByT5's byte tokenizer (no files)
    vae         AutoencoderKLHunyuanVideo15: block_out_channels (8, 16, 16), spatial factor 4, temporal factor 2
                (5 frames of 32 x 32 <-> 4 x 3 x 8 x 8 latents)
    scheduler   FlowMatchEulerDiscreteScheduler, shift 5.0; guider ClassifierFreeGuidance(guidance_scale 6.0)
    The pipeline's text lengths are made small on the instance (Qwen 32 tokens after a crop of the tiny template's
    own system turn, ByT5 16, 4 vision tokens); a pipeline saved and loaded again gets diffusers' defaults back.
    Default video: 5 frames of 32 x 32. The global torch RNG state is left unchanged; same seed -> same weights.
    """
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    tokenizer = _tiny_tokenizer()
    tokenizer_2 = ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
            num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=32, text_embed_2_dim=16,
            image_embed_dim=8, rope_axes_dim=(4, 2, 2), target_size=IMAGE_SIZE, task_type="t2v",
        )
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1, spatial_compression_ratio=4,
            temporal_compression_ratio=2,
        )
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=2048, pad_token_id=0, bos_token_id=0, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        ))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
        ))
    pipeline = HunyuanVideo15Pipeline(
        text_encoder=text_encoder.eval(), tokenizer=tokenizer, transformer=transformer.eval(), vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    # the tiny template's system turn and "<|im_start|>user\n" are the cropped tokens, as 108 are with Qwen's tokenizer
    marked = tokenizer.apply_chat_template(
        [{"role": "system", "content": pipeline.system_message}, {"role": "user", "content": "<|endoftext|>"}],
        add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"]
    pipeline.prompt_template_encode_start_idx = list(marked).index(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    pipeline.tokenizer_max_length = 32
    pipeline.tokenizer_2_max_length = 16
    pipeline.vision_num_semantic_tokens = 4
    pipeline.default_height = pipeline.default_width = IMAGE_SIZE
    pipeline.default_num_frames = TINY_NUM_FRAMES
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def build_random_hunyuan_video15_pipeline(seed=0, torch_dtype=torch.float32):
    """HunyuanVideo 1.5's architecture with random weights: the transformer and VAE of diffusers'
    HunyuanVideo15Transformer3DModel / AutoencoderKLHunyuanVideo15 default configs (54 blocks of 16 heads x 128, text
    widths 3584 and 1472, vision 1152; the 16 x 16 x 4 VAE with 32 channels), task "t2v", created in `torch_dtype`;
    the text encoders at their real widths but 3 layers (Qwen2.5-VL 7B's text model, 3584) and 1 layer (ByT5, 1472),
    with the tiny tokenizers and diffusers' text lengths (1000 Qwen tokens, 256 ByT5, 729 vision tokens). Default 480
    x 480, 33 frames. For benchmarks/gpu_check.py: its numbers are HunyuanVideo 1.5's cost, its videos mean nothing."""
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    tokenizer = _tiny_tokenizer()
    tokenizer_2 = ByT5Tokenizer()
    with seeded(seed), created_in(torch_dtype):
        transformer = HunyuanVideo15Transformer3DModel(task_type="t2v")
        vae = AutoencoderKLHunyuanVideo15()
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer), hidden_size=3584, intermediate_size=256, num_hidden_layers=3,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4096, pad_token_id=0,
            bos_token_id=0, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        ))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=1472, d_kv=64, d_ff=256, num_layers=1, num_heads=6,
            pad_token_id=0, eos_token_id=1,
        ))
    pipeline = HunyuanVideo15Pipeline(
        text_encoder=text_encoder.eval(), tokenizer=tokenizer, transformer=transformer.eval(), vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    marked = tokenizer.apply_chat_template(
        [{"role": "system", "content": pipeline.system_message}, {"role": "user", "content": "<|endoftext|>"}],
        add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"]
    pipeline.prompt_template_encode_start_idx = list(marked).index(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    pipeline.default_height = pipeline.default_width = 480
    pipeline.default_num_frames = 33
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# ---------------------------------------------------------------------------------------------------
# Image-to-video: the conditioning image rides in the trajectories as an editing family's source does


@register_family("hunyuan_video15_i2v")
class HunyuanVideo15ImageToVideoPolicy(HunyuanVideo15Policy):
    """HunyuanVideo 1.5 image-to-video (``HunyuanVideo15ImageToVideoPipeline``): the text-to-video family conditioned
    on one image per prompt, as diffusers' ``pipeline_hunyuan_video1_5_image2video.py`` (0.42) does: the image's
    SigLIP last hidden state (``pipe._get_image_embeds``) as the vision tokens, its VAE latent (``pipe.
    _get_image_latents``: the encoder's mode times ``scaling_factor``) as the first latent frame of the condition
    input, the later frames 0, the mask 1 on the first frame. Both ride in ``Trajectories.extra_cond``
    (``image_embeds``, ``image_latents``), so re-scoring is exact. The image must have the sampled size
    (``sample.resolution``, square): the pipeline picks its size from the image's aspect-ratio bucket and crops to it;
    here the video has the image's size, which the pipeline's bucket keeps for a square image at ``target_size``.
    A mean-flow transformer (``use_meanflow``: the step-distilled checkpoints, whose model also reads the next
    timestep) is refused."""

    pipeline_class = HunyuanVideo15ImageToVideoPipeline
    pipeline_class_names = ("HunyuanVideo15ImageToVideoPipeline",)
    offline_models = ("tiny-hunyuan-video15-i2v",)
    conditions_on_images = True
    anchor_refusal = "it animates a source image and its rewards read the image, which the anchor's reward calls lack"

    def __init__(self, pipeline):
        super().__init__(pipeline)
        if pipeline.transformer.config.get("use_meanflow"):
            raise ValueError("config.pretrained.model: a HunyuanVideo 1.5 image-to-video transformer with use_meanflow "
                             "(a step-distilled checkpoint) is not supported; use the 480p / 720p i2v model")

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        pipeline = load_pretrained(HunyuanVideo15ImageToVideoPipeline, model, revision, torch_dtype,
                                   {"tiny-hunyuan-video15-i2v": build_tiny_hunyuan_video15_i2v_pipeline})
        if not isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(f"model {model!r}: a HunyuanVideo15ImageToVideoPipeline with a "
                             f"{type(pipeline.scheduler).__name__}; the family samples with FlowMatchEulerDiscreteScheduler")
        return pipeline

    def prepare(self, device, dtype, use_lora, lora_rank=4, lora_alpha=None):
        """The text-to-video family's, and the image encoder frozen in `dtype`."""
        image_encoder = self.pipeline.image_encoder
        image_encoder.requires_grad_(False)
        image_encoder.to(device, dtype=dtype)
        return super().prepare(device, dtype, use_lora, lora_rank, lora_alpha)

    def _check_source_images(self, source_images, batch_size):
        name = type(self.pipeline).__name__
        if source_images is None:
            raise ValueError(f"{name} animates an image: every prompt needs one (the prompt record's field "
                             "'source_image'; docs/editing.md)")
        shape = (batch_size, 3, self.height, self.width)
        if tuple(source_images.shape) != shape:
            raise ValueError(f"source_images must be (B, 3, H, W) = {shape} (the field 'source_image' at "
                             f"config.sample.resolution), got {tuple(source_images.shape)}")
        return source_images.float()

    def _encode_edit(self, prompts, negative_prompt, guidance_scale, device, source_images):
        from PIL import Image

        pipe = self.pipeline
        cond = self._encode(prompts, negative_prompt, guidance_scale, device)
        # the pipeline reads PIL images: the sources' 8-bit pixels (a source read from a PNG is exactly these)
        pixels = (source_images.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        images = [Image.fromarray(p, mode="RGB") for p in pixels]
        embeds = [pipe._get_image_embeds(image_encoder=pipe.image_encoder, feature_extractor=pipe.feature_extractor,
                                         image=image, device=device) for image in images]
        latents = [pipe._get_image_latents(vae=pipe.vae, image_processor=pipe.video_processor, image=image,
                                           height=self.height, width=self.width, device=device) for image in images]
        cond["image_embeds"] = torch.cat(embeds).float()
        cond["image_latents"] = torch.cat(latents).float()  # (B, C, 1, h, w)
        return cond

    def _condition(self, latents, cond, dtype):
        b, c, f, h, w = latents.shape
        condition = latents.new_zeros(b, c + 1, f, h, w)
        condition[:, :c, :1] = cond["image_latents"].to(latents.dtype)
        condition[:, c, 0] = 1.0
        return condition, cond["image_embeds"].to(dtype)


def build_tiny_hunyuan_video15_i2v_pipeline(seed=0):
    """A HunyuanVideo15ImageToVideoPipeline with random weights drawn from ``seed`` (CPU, float32), built offline: the
    tiny text-to-video pipeline's parts (``build_tiny_hunyuan_video15_pipeline``, the transformer with task "i2v") and
    a 1-layer SigLIP vision model of width 8 on 28 px (2 x 2 patches of 14: 4 vision tokens) with its image processor.
    Default video: 5 frames of 32 x 32 (``target_size`` 32: a square image keeps its size). The global torch RNG state
    is left unchanged; same seed -> same weights."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    base = build_tiny_hunyuan_video15_pipeline(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        transformer = HunyuanVideo15Transformer3DModel.from_config({**base.transformer.config, "task_type": "i2v"})
        image_encoder = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14,
        ))
    pipeline = HunyuanVideo15ImageToVideoPipeline(
        text_encoder=base.text_encoder, tokenizer=base.tokenizer, transformer=transformer.eval(), vae=base.vae,
        scheduler=base.scheduler, text_encoder_2=base.text_encoder_2, tokenizer_2=base.tokenizer_2, guider=base.guider,
        image_encoder=image_encoder.eval(), feature_extractor=SiglipImageProcessor(size={"height": 28, "width": 28}),
    )
    for name in ("prompt_template_encode_start_idx", "tokenizer_max_length", "tokenizer_2_max_length",
                 "default_height", "default_width", "default_num_frames"):
        setattr(pipeline, name, getattr(base, name))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
