"""Built-in rewards of DDPO: JPEG (in)compressibility."""

from __future__ import annotations

import io

import numpy as np

from ddpo_group.rewards.base import register_reward, to_pil_images


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
