"""Qwen-Image-Edit-2509 / 2511 (``QwenImageEditPlusPipeline``, family "qwen_image_edit_plus"): Qwen-Image-Edit
with several source images per prompt, and its offline tiny pipeline.

What follows diffusers' ``pipelines/qwenimage/pipeline_qwenimage_edit_plus.py`` (0.42) exactly:

- text: the edit chat template with ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` for each source
  k = 1..K before the prompt, run through the pipeline's ``processor`` with the K condition images (each resized
  to about 384 x 384 pixels, ``CONDITION_IMAGE_SIZE``, at its aspect ratio), so the Qwen2.5-VL encoder reads every
  source; the template's first ``prompt_template_encode_start_idx`` (64) tokens are dropped. The pipeline takes
  one prompt per call (``batch_size > 1`` is refused there): here every row is encoded alone, as that call does,
  and zero-padded to ``sample.max_sequence_length`` as Qwen-Image's embeddings are. The negative prompt (" " when
  empty) is encoded with each row's own sources;
- latents: each source's VAE encoder mode of 2 x - 1, normalised per channel, kept in
  ``Trajectories.extra_cond["image_latents"]`` (B, K, C, h, w) float32; packed 2 x 2 and appended to the target's
  tokens in source order with ``img_shapes = [[(1, h/2, w/2)] + [(1, h_k/2, w_k/2)] * K]``; the velocity is the
  first N tokens' output; grid, true CFG with norm rescaling and decode are Qwen-Image's.

The pipeline resizes each source to about 1024 x 1024 pixels for the VAE; here every source must have the sampled
resolution (``sample.resolution``) and is used at that size, as for Qwen-Image-Edit (docs/editing.md). A prompt
record names its sources in the field ``source_images`` (a list of paths; ``source_image`` counts as one), the
same number for every prompt of a run, 1 to ``max_source_images`` (3: the Qwen-Image-Edit-2509 model card's
"1 to 3 input images"); the rewards see them as ``metadata["source_images"]`` (data/edit_sources.py).
"""

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_module

from ddpo_group.diffusion.base import model_dtype, register_family
from ddpo_group.diffusion.flow_policy import load_pretrained
from ddpo_group.diffusion.qwen_image import (
    EMPTY_NEGATIVE_PROMPT,
    QWEN_IMAGE_SCHEDULER_CONFIG,
    QwenImageEditPolicy,
    _tiny_qwen_parts,
    build_tiny_qwen_edit_processor,
    tiny_qwen_text_encoder_config,
)
from ddpo_group.diffusion.tiny import IMAGE_SIZE

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
    offline_models = ("tiny-qwen-image-edit-plus",)
    max_source_images = 3  # Qwen-Image-Edit-2509's model card: 1 to 3 input images

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        return load_pretrained(QwenImageEditPlusPipeline, model, revision, torch_dtype,
                               {"tiny-qwen-image-edit-plus": build_tiny_qwen_image_edit_plus_pipeline})

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

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        pipe = self.pipeline
        dtype = model_dtype(model)
        b, c, h, w = latents.shape
        tokens = [pipe._pack_latents(latents, b, c, h, w).to(dtype)]
        shapes = [(1, h // 2, w // 2)]
        sources = cond["image_latents"]  # (b, K, C, h', w'): the sources' tokens follow the target's, in order
        for k in range(sources.shape[1]):
            sh, sw = sources.shape[3:]
            tokens.append(pipe._pack_latents(sources[:, k], b, c, sh, sw).to(dtype))
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


def build_tiny_qwen_image_edit_plus_pipeline(seed=0):
    """A QwenImageEditPlusPipeline with random weights drawn from ``seed`` (CPU, float32), built offline: the tiny
    Qwen-Image-Edit's parts (``build_tiny_qwen_image_edit_pipeline``: the tiny Qwen-Image transformer and VAE, a
    Qwen2.5-VL text encoder of 2 x 32 text layers whose 1-block vision tower reads each source at 56 x 56 pixels,
    4 merged tokens, the processor ``build_tiny_qwen_edit_processor``). Default image 32 x 32. The global torch RNG
    state is left unchanged; same seed -> same weights (those of the tiny Qwen-Image-Edit of that seed)."""
    from transformers import Qwen2_5_VLConfig

    processor = build_tiny_qwen_edit_processor()
    tokenizer = processor.tokenizer
    base = tiny_qwen_text_encoder_config(len(tokenizer)).to_dict()
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2_5_VLConfig(text_config=base["text_config"], vision_config=base["vision_config"], **ids)
    transformer, vae, text_encoder = _tiny_qwen_parts(seed, config)
    pipeline = QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG), vae=vae.eval(),
        text_encoder=text_encoder.eval(), tokenizer=tokenizer, processor=processor, transformer=transformer.eval(),
    )
    if pipeline.prompt_template_encode != EDIT_PLUS_TEMPLATE:
        raise RuntimeError("QwenImageEditPlusPipeline's prompt template changed: update EDIT_PLUS_TEMPLATE")
    pipeline.default_sample_size = IMAGE_SIZE // pipeline.vae_scale_factor
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
