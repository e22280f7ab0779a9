"""Qwen-Image (``QwenImagePipeline``) as a flow-matching family, and its offline tiny pipeline; Qwen-Image-Edit
(``QwenImageEditPipeline``, family "qwen_image_edit": the same model conditioned on a source image) and
Qwen-Image-Edit-2509 / 2511 (``QwenImageEditPlusPipeline``, family "qwen_image_edit_plus": on several), at the end.
One room, over 600 lines: the three families share the transformer call, the text encoding, the VAE and the tiny
parts, and a family imports no other family's module (docs/architecture.md).

What follows diffusers' ``pipelines/qwenimage/pipeline_qwenimage.py`` (0.42) exactly:

- text: the Qwen2.5-VL chat template (``pipe.prompt_template_encode``) around each prompt, the last
  hidden state of the text encoder, the template's first ``prompt_template_encode_start_idx`` (34)
  tokens dropped, truncated to ``max_sequence_length`` tokens (``pipe.encode_prompt``), with a 0/1
  mask of the valid tokens (``encoder_hidden_states_mask``);
- latents: (B, C, 1, h, w) noise from the generator as ``pipe.prepare_latents`` draws it, packed 2x2
  into (B, h/2 * w/2, 4C) tokens for the transformer with ``img_shapes = [[(1, h/2, w/2)]] * B``;
  the transformer's timestep is ``t / 1000`` in the model's dtype, as the pipeline casts it;
- grid: sigmas ``np.linspace(1, 1/T, T)`` shifted by ``mu = calculate_shift(image_seq_len, ...)`` with
  the scheduler config's base/max sequence lengths and shifts (Qwen-Image's scheduler also has
  ``shift_terminal`` 0.02 and exponential time shift: its last nonzero sigma is 0.02);
- guidance: *true* CFG. ``guidance_scale > 1`` is the pipeline's ``true_cfg_scale``: a second
  transformer call on the negative prompt, ``comb = neg + w (cond - neg)`` rescaled to the norm of
  the conditional prediction, ``comb * ||cond|| / ||comb||`` (norms over the packed channel dim of
  each token). An empty ``negative_prompt`` means ``" "``: the pipeline enables CFG only for a given
  negative prompt and the Qwen-Image model card passes ``" "`` when there is nothing to remove.
  ``guidance_scale <= 1``: one call, no negative prompt (the pipeline's ``true_cfg_scale <= 1``);
- decode: latents de-normalised per channel with the VAE config's ``latents_mean`` / ``latents_std``
  (``z * std + mean``, written as the pipeline does), decoded as one frame of the 3-D VAE.

Our conventions: trajectories store the unpacked (B, C, h, w) float32 latents (packing is a
permutation, so element-wise steps are the same); the prompt embeddings and their masks are padded
with zeros to exactly ``max_sequence_length`` tokens (the pipeline pads to the batch's longest
prompt), so sampling batches of different prompts concatenate (``Trajectories.cat``). The padded
tokens are masked out of the joint attention, and the text RoPE positions of the valid tokens do not
depend on the padded length, so the images are the pipeline's up to float32 rounding. The masks ride
in ``Trajectories.extra_cond`` (``prompt_embeds_mask``, ``negative_prompt_embeds_mask``: int64 0/1).
"""

import numpy as np
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_module
from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps

from ddpo_group.diffusion.base import model_dtype, register_family
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.tiny import IMAGE_SIZE, TOKENIZER_WORDS, bytes_to_unicode, created_in, seeded

# Qwen/Qwen-Image's scheduler/scheduler_config.json, as written out in public trainers (e.g. ostris/ai-toolkit,
# extensions_built_in/diffusion_models/qwen_image/qwen_image.py); not read from the hub here (no access).
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

# the pipeline's limit (check_inputs refuses a longer max_sequence_length)
MAX_SEQUENCE_LENGTH = 1024
EMPTY_NEGATIVE_PROMPT = " "


@register_family("qwen_image")
class QwenImagePolicy(FlowMatchingPolicy):
    """Qwen-Image (``QwenImagePipeline``): a Qwen2.5-VL text encoder with a chat template and a token mask,
    packed 2x2 latents of a 3-D VAE with per-channel mean / std, true CFG with norm rescaling, the
    scheduler's dynamically shifted grid. The step, the sampling loop, LoRA and checkpoints are the
    flow-matching base's (``flow_policy.py``)."""
    shard_blocks = ("transformer_blocks",)  # the MMDiT's dual-stream blocks

    pipeline_class = QwenImagePipeline
    pipeline_class_names = ("QwenImagePipeline",)
    offline_models = ("tiny-qwen-image",)
    default_max_sequence_length = 512  # QwenImagePipeline.__call__'s default
    # the pipeline's encode_prompt pads to the batch's longest prompt, so a row's numbers may depend on its
    # neighbours: the text-embedding cache (text_cache.py) never serves this family
    text_rows_independent = False
    patch_multiple = 2

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(
            QwenImagePipeline, model, revision, torch_dtype, {"tiny-qwen-image": build_tiny_qwen_image_pipeline}
        )

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, **flow_options):
        if max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise ValueError(
                f"config.sample.max_sequence_length={max_sequence_length}: Qwen-Image takes at most "
                f"{MAX_SEQUENCE_LENGTH} text tokens"
            )
        super().configure(sde_type=sde_type, max_sequence_length=max_sequence_length, resolution=resolution, **flow_options)

    @property
    def latent_channels(self):
        return self.pipeline.transformer.config.in_channels // 4

    def _encode_fixed(self, prompts, device, **image):
        """The pipeline's prompt embeddings (B, l, D) and mask, zero-padded to max_sequence_length tokens (`image`:
        Qwen-Image-Edit's source images, which its text encoder reads too)."""
        length = self.max_sequence_length
        embeds, mask = self.pipeline.encode_prompt(prompt=list(prompts), device=device, max_sequence_length=length, **image)
        if mask is None:  # encode_prompt returns None when every token is valid
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        pad = length - embeds.shape[1]
        if pad < 0:  # Qwen-Image-Edit's image and text tokens are not truncated
            raise ValueError(f"config.sample.max_sequence_length={length} is shorter than a prompt's {embeds.shape[1]} "
                             "image and text tokens: raise it")
        embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], pad, embeds.shape[2])], dim=1)
        mask = torch.cat([mask.long(), mask.new_zeros(mask.shape[0], pad, dtype=torch.long)], dim=1)
        return embeds, mask

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        embeds, mask = self._encode_fixed(prompts, device)
        cond = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if guidance_scale > 1.0:  # true CFG: the negative prompt is encoded once and shared by the rows
            negative, negative_mask = self._encode_fixed([negative_prompt or EMPTY_NEGATIVE_PROMPT], device)
            cond["negative_prompt_embeds"] = negative.repeat(len(prompts), 1, 1)
            cond["negative_prompt_embeds_mask"] = negative_mask.repeat(len(prompts), 1)
        return cond

    def _initial_latents(self, batch_size, device, generator):
        pipe = self.pipeline
        packed = pipe.prepare_latents(
            batch_size, self.latent_channels, self.resolution, self.resolution, torch.float32, device, generator
        )
        return pipe._unpack_latents(packed, self.resolution, self.resolution, pipe.vae_scale_factor).squeeze(2)

    def _timesteps(self, num_steps, device):
        pipe = self.pipeline
        side = self.resolution // pipe.vae_scale_factor // 2
        mu = self._shift_mu(side)
        retrieve_timesteps(pipe.scheduler, num_steps, device, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        pipe = self.pipeline
        dtype = model_dtype(model)
        b, c, h, w = latents.shape
        tokens = [pipe._pack_latents(latents, b, c, h, w).to(dtype)]
        shapes = [(1, h // 2, w // 2)]
        # Qwen-Image-Edit: the source's tokens follow the target's ((b, C, h', w')); Edit-Plus: several sources,
        # (b, K, C, h', w'), their tokens in order
        sources = cond.get("image_latents")
        if sources is not None:
            for source in (sources.unbind(1) if sources.dim() == 5 else (sources,)):
                sh, sw = source.shape[2:]
                tokens.append(pipe._pack_latents(source, b, c, sh, sw).to(dtype))
                shapes.append((1, sh // 2, sw // 2))
        packed = torch.cat(tokens, dim=1)
        img_shapes = [shapes] * b
        timestep = timesteps.to(dtype) / 1000

        def call(embeds, mask):
            return model(
                hidden_states=packed, timestep=timestep, guidance=None, encoder_hidden_states_mask=mask,
                encoder_hidden_states=embeds.to(dtype), img_shapes=img_shapes, return_dict=False,
            )[0][:, : (h // 2) * (w // 2)].float()

        velocity = call(cond["prompt_embeds"], cond["prompt_embeds_mask"])
        if guidance_scale > 1.0 and cond.get("negative_prompt_embeds") is not None:
            negative = call(cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"])
            combined = negative + guidance_scale * (velocity - negative)
            velocity = combined * (
                torch.norm(velocity, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
            )
        scale = pipe.vae_scale_factor
        return pipe._unpack_latents(velocity, h * scale, w * scale, scale).squeeze(2)

    def _decode(self, latents):
        vae = self.pipeline.vae
        z_dim = vae.config.z_dim
        latents = latents.unsqueeze(2).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        images = vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


# ---------------------------------------------------------------------------------------------------
# The offline tiny pipeline

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# the words of QwenImagePipeline.prompt_template_encode: with them the template's prefix is 34 tokens,
# the pipeline's prompt_template_encode_start_idx, as with Qwen2.5-VL's own tokenizer
TEMPLATE_WORDS = (
    "Describe", "the", "image", "by", "detailing", "color", "shape", "size", "texture", "quantity", "text",
    "spatial", "relationships", "of", "objects", "and", "background",
)  # fmt: skip
LINE_START_WORDS = ("system", "user", "assistant", "Describe")


def tiny_qwen_tokenizer_vocab(words=TOKENIZER_WORDS):
    """(vocab dict token -> id, merges list of pairs) of a tiny byte-level BPE in Qwen2's style.

    Ids: 0 <|endoftext|> (also pad), 1 <|im_start|>, 2 <|im_end|>, then the 256 byte characters, then
    the words: each word of `words` and of the template after a space ("Ġred": one token), and the
    words that start a line of the template bare ("system"). A word is built by merges from its left
    end ("Ġ r" -> "Ġr", "Ġr e" -> "Ġre", "Ġre d" -> "Ġred"); the space-led words' merges all rank
    before the bare words' merges and their left sides start with "Ġ", so they fire only at a word's
    start and every listed "Ġword" is one token.
    """
    byte_to_char = bytes_to_unicode()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in byte_to_char.values():
        vocab[char] = len(vocab)
    merges, seen = [], set()

    def add(word):
        chars = [byte_to_char[b] for b in word.encode("utf-8")]
        piece = chars[0]
        for char in chars[1:]:
            if (piece, char) not in seen:
                seen.add((piece, char))
                merges.append((piece, char))
            piece += char
            vocab.setdefault(piece, len(vocab))

    for word in sorted(set(words) | set(TEMPLATE_WORDS)):
        add(" " + word)
    for word in LINE_START_WORDS:
        add(word)
    return vocab, merges


def build_tiny_qwen_tokenizer(words=TOKENIZER_WORDS):
    """A Qwen2Tokenizer (Qwen2's pre-tokenizer regex and byte-level BPE) built in memory from the tiny vocab."""
    from transformers import Qwen2Tokenizer

    vocab, merges = tiny_qwen_tokenizer_vocab(words)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.model_max_length = MAX_SEQUENCE_LENGTH + 64
    return tokenizer


def tiny_qwen_text_encoder_config(vocab_size):
    """A Qwen2_5_VLConfig of a 2-layer, 32-wide text model (mrope sections 2+3+3 of the 8 rotary pairs of a
    16-dim head) with a 1-block, 16-wide vision tower (the class needs one; text-only prompts never run it)."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=0, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0],
        ),
        # vision token ids outside the tiny vocab: no text prompt contains them
        image_token_id=vocab_size, video_token_id=vocab_size + 1, vision_start_token_id=vocab_size + 2,
        vision_end_token_id=vocab_size + 3,
    )


def _tiny_qwen_parts(seed, text_encoder_config):
    """The random tiny transformer, VAE and Qwen2.5-VL text encoder of the tiny Qwen-Image pipelines (text-to-image
    and edit), drawn in that order from `seed` with the global torch RNG state left unchanged."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=32, axes_dims_rope=(2, 2, 4),
        )
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, False],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
        )
        text_encoder = Qwen2_5_VLForConditionalGeneration(text_encoder_config)
    return transformer, vae, text_encoder


def build_tiny_qwen_image_pipeline(seed=0):
    """A QwenImagePipeline with random weights drawn from ``seed`` (CPU, float32), built offline.

    transformer QwenImageTransformer2DModel: 4x8x8 latents packed 2x2 into 16 tokens of 16, 2 dual-stream
                blocks of 2 heads x 8 (rope axes 2+2+4), joint_attention_dim 32 (the text width)
    text        Qwen2_5_VLForConditionalGeneration: 2 text layers of width 32 (2 heads, 1 KV head), a
                1-block vision tower of width 16; tokenizer ``build_tiny_qwen_tokenizer`` (in memory)
    vae         AutoencoderKLQwenImage: base_dim 8, z_dim 4, dim_mult (1, 2, 2), one res block, no temporal
                downsampling: scale factor 4, 32x32 images <-> 4x8x8 latents; made-up per-channel
                latents_mean / latents_std (not 0 / 1, so the de-normalisation is exercised)
    scheduler   FlowMatchEulerDiscreteScheduler with Qwen-Image's config (QWEN_IMAGE_SCHEDULER_CONFIG)
    Default image: 32x32 (``default_sample_size`` 8 x VAE factor 4). The global torch RNG state is left
    unchanged. Same seed -> same weights.
    """
    tokenizer = build_tiny_qwen_tokenizer()
    transformer, vae, text_encoder = _tiny_qwen_parts(seed, tiny_qwen_text_encoder_config(len(tokenizer)))
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG), vae=vae.eval(),
        text_encoder=text_encoder.eval(), tokenizer=tokenizer, transformer=transformer.eval(),
    )
    pipeline.default_sample_size = IMAGE_SIZE // pipeline.vae_scale_factor
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# ---------------------------------------------------------------------------------------------------
# Qwen-Image-Edit: the source image conditions twice, through the text encoder's vision tower and as latent tokens


@register_family("qwen_image_edit")
class QwenImageEditPolicy(QwenImagePolicy):
    """Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen-Image's transformer, VAE, grid and true CFG, conditioned on
    a source image as diffusers' pipeline does (pipelines/qwenimage/pipeline_qwenimage_edit.py, 0.42):

    - text: the edit chat template with ``<|vision_start|><|image_pad|><|vision_end|>`` before the prompt, run
      through the pipeline's ``processor`` with the source image, so the Qwen2.5-VL encoder reads the image's
      vision tokens and the text; its first ``prompt_template_encode_start_idx`` (64) tokens are dropped; the
      embeddings (image tokens and text) and their mask are zero-padded to ``sample.max_sequence_length`` as
      Qwen-Image's are. The negative prompt (" " when empty) is encoded with each row's own source;
    - latents: the source's VAE encoder mode of 2 x - 1, normalised per channel ((z - mean) / std), kept in
      ``Trajectories.extra_cond["image_latents"]`` (B, C, h, w) float32; packed and appended to the target's
      tokens with ``img_shapes = [[(1, h/2, w/2), (1, h/2, w/2)]]``; the velocity is the first N tokens' output.

    The pipeline resizes the source to about 1024 x 1024 pixels for both paths; here the source must have the
    sampled resolution (``sample.resolution``) and is used at that size (so an edit is compared with its source
    pixel for pixel)."""

    pipeline_class = QwenImageEditPipeline
    pipeline_class_names = ("QwenImageEditPipeline",)
    offline_models = ("tiny-qwen-image-edit",)
    conditions_on_images = True
    anchor_refusal = "it edits images and its rewards read the source image, which the anchor's reward calls lack"

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(QwenImageEditPipeline, model, revision, torch_dtype,
                               {"tiny-qwen-image-edit": build_tiny_qwen_image_edit_pipeline})

    def _initial_latents(self, batch_size, device, generator):
        pipe = self.pipeline  # the edit pipeline's prepare_latents takes the source first: None draws the noise alone
        packed, _ = pipe.prepare_latents(
            None, batch_size, self.latent_channels, self.resolution, self.resolution, torch.float32, device, generator
        )
        return pipe._unpack_latents(packed, self.resolution, self.resolution, pipe.vae_scale_factor).squeeze(2)

    def _encode_edit(self, prompts, negative_prompt, guidance_scale, device, source_images):
        from PIL import Image

        # the processor reads PIL images: the sources' 8-bit pixels (a source read from a PNG is exactly these)
        pixels = (source_images.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        pil = [Image.fromarray(p, mode="RGB") for p in pixels]
        embeds, mask = self._encode_fixed(prompts, device, image=pil)
        cond = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if guidance_scale > 1.0:
            negative, negative_mask = self._encode_fixed([negative_prompt or EMPTY_NEGATIVE_PROMPT] * len(prompts),
                                                         device, image=pil)
            cond.update(negative_prompt_embeds=negative, negative_prompt_embeds_mask=negative_mask)
        vae = self.pipeline.vae
        images = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255).to(device)
        latents = vae.encode((2 * images - 1).unsqueeze(2).to(vae.dtype)).latent_dist.mode()[:, :, 0].float()
        shape = (1, vae.config.z_dim, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=device).view(shape)
        std = torch.tensor(vae.config.latents_std, device=device).view(shape)
        cond["image_latents"] = (latents - mean) / std
        return cond


EDIT_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# pieces of the edit template that Qwen2.5-VL's tokenizer keeps whole: with them the template's prefix before the
# image is 64 tokens, the pipeline's prompt_template_encode_start_idx
EDIT_TEMPLATE_PIECES = ("color", "'s", "),")


def build_tiny_qwen_edit_processor():
    """A Qwen2VLProcessor built in memory: the tiny Qwen2 tokenizer with the vision tokens and the edit template's
    words, and a Qwen2-VL image processor (PIL backend) that resizes every image to 56 x 56 pixels: 4 x 4 patches
    of 14, merged 2 x 2 into 4 image tokens. No video processor (it needs torchvision; text-and-image prompts
    never use it)."""
    import re

    from transformers import Qwen2Tokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    prefix = EDIT_TEMPLATE.split("<|vision_start|>")[0]
    words = sorted(set(re.findall(r"[A-Za-z]+", prefix)) - {"im", "start", "end", "s"}) + ["("]
    vocab, merges = tiny_qwen_tokenizer_vocab(tuple(TOKENIZER_WORDS) + tuple(words))
    byte_to_char, seen = bytes_to_unicode(), set(merges)
    for piece in EDIT_TEMPLATE_PIECES:  # whole pieces, merged from the left, ranked after every word's merges
        chars = [byte_to_char[b] for b in piece.encode("utf-8")]
        built = chars[0]
        for char in chars[1:]:
            if (built, char) not in seen:
                seen.add((built, char))
                merges.append((built, char))
            built += char
            vocab.setdefault(built, len(vocab))
    for token in EDIT_SPECIAL_TOKENS:
        vocab.setdefault(token, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *EDIT_SPECIAL_TOKENS]})
    tokenizer.model_max_length = MAX_SEQUENCE_LENGTH + 128

    class TinyQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None  # transformers' video processor class needs torchvision; images never reach it
            return super().check_argument_for_proper_class(argument_name, argument)

    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                               temporal_patch_size=2)
    return TinyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


# QwenImageEditPipeline's prompt template (diffusers 0.42), for the tiny tokenizer's vocabulary
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _tiny_qwen_edit_pipeline(pipeline_class, template, seed):
    """The tiny Qwen-Image-Edit parts of ``seed`` (transformer, VAE, a Qwen2.5-VL text encoder with a 1-block vision
    tower, the tiny processor) in `pipeline_class`, whose prompt template must be `template`."""
    from transformers import Qwen2_5_VLConfig

    processor = build_tiny_qwen_edit_processor()
    tokenizer = processor.tokenizer
    base = tiny_qwen_text_encoder_config(len(tokenizer)).to_dict()
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2_5_VLConfig(text_config=base["text_config"], vision_config=base["vision_config"], **ids)
    transformer, vae, text_encoder = _tiny_qwen_parts(seed, config)
    pipeline = pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG), vae=vae.eval(),
        text_encoder=text_encoder.eval(), tokenizer=tokenizer, processor=processor, transformer=transformer.eval(),
    )
    if pipeline.prompt_template_encode != template:
        raise RuntimeError(f"{pipeline_class.__name__}'s prompt template changed: update the module's template")
    pipeline.default_sample_size = IMAGE_SIZE // pipeline.vae_scale_factor
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def build_tiny_qwen_image_edit_pipeline(seed=0):
    """A QwenImageEditPipeline with random weights drawn from ``seed`` (CPU, float32), built offline: the tiny
    Qwen-Image transformer and VAE (``build_tiny_qwen_image_pipeline``'s architecture), a Qwen2.5-VL text encoder of
    the same 2 x 32 text layers whose 1-block vision tower now reads the source (its image / vision token ids are
    the tokenizer's), the processor ``build_tiny_qwen_edit_processor``. Default image 32 x 32. The global torch RNG
    state is left unchanged."""
    return _tiny_qwen_edit_pipeline(QwenImageEditPipeline, EDIT_TEMPLATE, seed)


# ---------------------------------------------------------------------------------------------------
# Qwen-Image-Edit-2509 / 2511 (QwenImageEditPlusPipeline, family "qwen_image_edit_plus"): several source images per
# prompt, issue 46 (docs/next_families.md). What follows diffusers' pipelines/qwenimage/pipeline_qwenimage_edit_plus.py
# (0.42) exactly:
#
# - text: the edit chat template with ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` for each source
#   k = 1..K before the prompt, run through the pipeline's ``processor`` with the K condition images (each resized
#   to about 384 x 384 pixels, ``CONDITION_IMAGE_SIZE``, at its aspect ratio), so the Qwen2.5-VL encoder reads every
#   source; the template's first ``prompt_template_encode_start_idx`` (64) tokens are dropped. The pipeline takes
#   one prompt per call (``batch_size > 1`` is refused there): here every row is encoded alone, as that call does,
#   and zero-padded to ``sample.max_sequence_length`` as Qwen-Image's embeddings are. The negative prompt (" " when
#   empty) is encoded with each row's own sources;
# - latents: each source's VAE encoder mode of 2 x - 1, normalised per channel, kept in
#   ``Trajectories.extra_cond["image_latents"]`` (B, K, C, h, w) float32; packed 2 x 2 and appended to the target's
#   tokens in source order with ``img_shapes = [[(1, h/2, w/2)] + [(1, h_k/2, w_k/2)] * K]``; the velocity is the
#   first N tokens' output; grid, true CFG with norm rescaling and decode are Qwen-Image's.
#
# The pipeline resizes each source to about 1024 x 1024 pixels for the VAE; here every source must have the sampled
# resolution (``sample.resolution``) and is used at that size, as for Qwen-Image-Edit (docs/editing.md). A prompt
# record names its sources in the field ``source_images`` (a list of paths; ``source_image`` counts as one), the
# same number for every prompt of a run, 1 to ``max_source_images`` (3: the Qwen-Image-Edit-2509 model card's
# "1 to 3 input images"); the rewards see them as ``metadata["source_images"]`` (data/edit_sources.py).

# QwenImageEditPlusPipeline's prompt template (diffusers 0.42): the sources' vision tokens go before the prompt
EDIT_PLUS_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)


@register_family("qwen_image_edit_plus")
class QwenImageEditPlusPolicy(QwenImageEditPolicy):
    """Qwen-Image-Edit-2509 / 2511 (``QwenImageEditPlusPipeline``): Qwen-Image-Edit's model and steps conditioned on
    K source images per prompt (module docstring). ``sample(..., source_images=...)`` takes (B, K, 3, H, W) float
    in [0, 1] (or (B, 3, H, W): K = 1)."""

    pipeline_class = QwenImageEditPlusPipeline
    pipeline_class_names = ("QwenImageEditPlusPipeline",)
    offline_models = ("tiny-qwen-image-edit-plus", "random-qwen-image-edit-plus")
    max_source_images = 3  # Qwen-Image-Edit-2509's model card: 1 to 3 input images

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(QwenImageEditPlusPipeline, model, revision, torch_dtype,
                               {"tiny-qwen-image-edit-plus": build_tiny_qwen_image_edit_plus_pipeline,
                                "random-qwen-image-edit-plus": build_random_qwen_image_edit_plus_pipeline})

    def _check_source_images(self, source_images, batch_size):
        """(B, K, 3, resolution, resolution) float32, 1 <= K <= max_source_images, or a ValueError naming the field."""
        name = type(self.pipeline).__name__
        if source_images is None:
            raise ValueError(f"{name} edits images: every prompt needs 1 to {self.max_source_images} source images "
                             "(the prompt record's field 'source_images'; docs/editing.md)")
        if source_images.dim() == 4:
            source_images = source_images.unsqueeze(1)
        side = self.resolution
        if source_images.dim() != 5 or tuple(source_images.shape[:1]) + tuple(source_images.shape[2:]) != (
                batch_size, 3, side, side):
            raise ValueError(f"source_images must be (B, K, 3, H, W) = ({batch_size}, K, 3, {side}, {side}) (the field "
                             f"'source_images' at config.sample.resolution), got {tuple(source_images.shape)}")
        if not 1 <= source_images.shape[1] <= self.max_source_images:
            raise ValueError(f"field 'source_images': {source_images.shape[1]} source images per prompt; {name} takes "
                             f"1 to {self.max_source_images}")
        return source_images.float()

    def _encode_edit(self, prompts, negative_prompt, guidance_scale, device, source_images):
        from PIL import Image

        pipe = self.pipeline
        # the processor reads PIL images: the sources' 8-bit pixels (a source read from a PNG is exactly these)
        pixels = (source_images.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2).cpu().numpy()
        side = self.resolution
        # the pipeline's condition images: each source resized to about CONDITION_IMAGE_SIZE pixels (square here)
        width, height = plus_module.calculate_dimensions(plus_module.CONDITION_IMAGE_SIZE, 1.0)
        rows = [[pipe.image_processor.resize(Image.fromarray(p, mode="RGB"), height, width) for p in row]
                for row in pixels]
        parts = [self._encode_fixed([prompt], device, image=row) for prompt, row in zip(prompts, rows)]
        cond = {"prompt_embeds": torch.cat([p[0] for p in parts]), "prompt_embeds_mask": torch.cat([p[1] for p in parts])}
        if guidance_scale > 1.0:
            negative = negative_prompt or EMPTY_NEGATIVE_PROMPT
            parts = [self._encode_fixed([negative], device, image=row) for row in rows]
            cond.update(negative_prompt_embeds=torch.cat([p[0] for p in parts]),
                        negative_prompt_embeds_mask=torch.cat([p[1] for p in parts]))
        vae = pipe.vae
        b, k = pixels.shape[:2]
        images = (torch.from_numpy(pixels).permute(0, 1, 4, 2, 3).float() / 255).to(device).reshape(b * k, 3, side, side)
        latents = vae.encode((2 * images - 1).unsqueeze(2).to(vae.dtype)).latent_dist.mode()[:, :, 0].float()
        shape = (1, vae.config.z_dim, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=device).view(shape)
        std = torch.tensor(vae.config.latents_std, device=device).view(shape)
        latents = (latents - mean) / std
        cond["image_latents"] = latents.reshape(b, k, *latents.shape[1:])
        return cond


def build_tiny_qwen_image_edit_plus_pipeline(seed=0):
    """A QwenImageEditPlusPipeline with random weights drawn from ``seed`` (CPU, float32), built offline: the tiny
    Qwen-Image-Edit's parts (``build_tiny_qwen_image_edit_pipeline``: the tiny Qwen-Image transformer and VAE, a
    Qwen2.5-VL text encoder of 2 x 32 text layers whose 1-block vision tower reads each source at 56 x 56 pixels,
    4 merged tokens, the processor ``build_tiny_qwen_edit_processor``). Default image 32 x 32. The global torch RNG
    state is left unchanged; same seed -> same weights (those of the tiny Qwen-Image-Edit of that seed)."""
    return _tiny_qwen_edit_pipeline(QwenImageEditPlusPipeline, EDIT_PLUS_TEMPLATE, seed)


def build_random_qwen_image_edit_plus_pipeline(seed=0, torch_dtype=torch.float32, num_layers=60):
    """Qwen-Image-Edit-2509's architecture with random weights: the transformer and VAE of diffusers'
    QwenImageTransformer2DModel / AutoencoderKLQwenImage default configs (Qwen-Image's: 60 dual-stream blocks of 24
    heads x 128, text width 3584, rope axes 16 + 56 + 56; 20.43B parameters; the 16-channel VAE), created in
    `torch_dtype`; the Qwen2.5-VL text encoder at its real widths but 1 text layer (7B's width 3584, 28 heads, 4 KV
    heads, a 256-wide MLP) and a 1-block vision tower of Qwen2.5-VL 7B's width 1280 (16 heads, out 3584), with the
    tiny edit processor's tokenizer and a Qwen2-VL image processor of the real patching (14 px patches merged 2 x 2,
    up to 28 x 28 x 1280 pixels). `num_layers` fewer transformer blocks: a reduced model, for a CPU check of the
    code path only. Default image 1024 x 1024. For benchmarks/gpu_check.py: its numbers are Qwen-Image-Edit-2509's
    cost, its images mean nothing."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = build_tiny_qwen_edit_processor()
    processor.image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14,
                                                         merge_size=2, temporal_patch_size=2)
    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=3584, intermediate_size=256, num_hidden_layers=1,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4096, bos_token_id=0,
            eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        ),
        vision_config=dict(depth=1, hidden_size=1280, intermediate_size=256, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
        **ids,
    )
    with seeded(seed), created_in(torch_dtype):
        transformer = QwenImageTransformer2DModel(num_layers=num_layers)
        vae = AutoencoderKLQwenImage()
        text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    pipeline = QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG), vae=vae.eval(),
        text_encoder=text_encoder.eval(), tokenizer=tokenizer, processor=processor, transformer=transformer.eval(),
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
