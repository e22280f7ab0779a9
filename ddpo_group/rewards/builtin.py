"""Built-in rewards of DDPO: JPEG (in)compressibility, and image conversion helpers."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards.registry import register_reward


def to_uint8_images(images) -> np.ndarray:
    """(B, 3, H, W) float in [0, 1] -> (B, H, W, 3) uint8, as round(clamp(255 * x, 0, 255)).

    Accepts a torch tensor or a numpy array; this is the quantization ddpo-pytorch
    applies before any PIL-based reward.
    """
    images = torch.as_tensor(images)
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape (B, 3, H, W), got {tuple(images.shape)}")
    images = (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)
    return images.permute(0, 2, 3, 1).cpu().numpy()


def to_pil_images(images) -> list[Image.Image]:
    """(B, 3, H, W) float in [0, 1] -> list of B RGB PIL images (see `to_uint8_images`)."""
    return [Image.fromarray(image) for image in to_uint8_images(images)]


def jpeg_size_kb(images, quality: int = 95) -> np.ndarray:
    """Size in kB (bytes / 1000) of each image saved as JPEG at `quality`; shape (B,)."""
    sizes = []
    for image in to_pil_images(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return np.array(sizes, dtype=np.float64)


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(images, prompts, metadata):
    """DDPO's incompressibility reward: r = JPEG size (quality 95) in kB; shape (B,)."""
    return jpeg_size_kb(images), {}


@register_reward("jpeg_compressibility")
def jpeg_compressibility(images, prompts, metadata):
    """DDPO's compressibility reward: r = -JPEG size (quality 95) in kB; shape (B,)."""
    return -jpeg_size_kb(images), {}
