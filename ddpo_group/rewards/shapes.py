"""Rewards of the shapes world: does the image show what the prompt asks for?

Each reward reads the requested colour, shape, background and size from the prompt
(``ddpo_group.data.shapes.parse_prompt``; the metadata fields ``color``/``shape``/
``background``/``size`` when the prompt does not parse) and scores every image in [0, 1],
1 = matches the prompt. Pixels are RGB in [0, 1]; distances are Euclidean divided by
sqrt(3), so they lie in [0, 1].

Foreground. With b the requested background colour, a pixel p is foreground with weight

    w(p) = clip((|p - b| / sqrt(3) - 0.10) / 0.15, 0, 1)      (0 below 0.10, 1 above 0.25)

Registered rewards (``fn(images (B,3,H,W), prompts, metadata) -> (rewards (B,), info)``):

- ``shapes_color``: with c the requested colour and v = c - b, a pixel is explained as a
  mix b + a v of background and colour, a = clip(<p - b, v> / |v|^2, 0, 1), with residual
  r = |p - b - a v| / sqrt(3) (so anti-aliased edges still match); match = clip(1 - r / 0.25, 0, 1);
  score = (sum w * match / sum w) * clip(mean(w) / 0.02, 0, 1) (the second term: there is a
  foreground at all).
- ``shapes_area``: f = mean(w) must lie in the size's range (small [0.035, 0.11], big
  [0.15, 0.42]); score = clip(1 - d / ln 1.5, 0, 1) with d = max(0, ln(lo / f), ln(f / hi)),
  i.e. 1 inside the range and 0 a factor of 1.5 outside it.
- ``shapes_background``: mean over the border ring (``max(1, H // 16)`` pixels wide, where
  the shape never is) of clip(1 - |p - b| / sqrt(3) / 0.2, 0, 1).
- ``shapes_shape``: soft IoU = sum min(w, t) / sum max(w, t) of the foreground with a circle,
  a square and a triangle template of the same area and centroid;
  score = clip(0.5 + (IoU_requested - max IoU_other) / 0.08, 0, 1), times the presence term.
- ``shapes_alignment``: the product color * area * background * shape: about 1 only when
  every attribute matches, about 0 when any attribute is wrong (a GenEval-style
  all-attributes score, soft so that partial progress still earns reward). It is the
  reward the README's tiny demo optimises.

Difficulty differs by prompt: small shapes, triangles and low-contrast pairs (yellow or
cyan on white, anything on gray) are the hard ones for the tiny model.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ddpo_group.rewards.base import register_reward
from ddpo_group.data.shapes import BACKGROUNDS, COLORS, SHAPES, ShapeSpec, parse_prompt, shape_coverage

FG_LOW, FG_HIGH = 0.10, 0.25
COLOR_TOLERANCE = 0.25
MIN_FOREGROUND = 0.02
AREA_RANGES = {"small": (0.035, 0.11), "big": (0.15, 0.42)}
BACKGROUND_TOLERANCE = 0.2
SHAPE_MARGIN = 0.08
AREA_FALLOFF = math.log(1.5)

_SQRT3 = math.sqrt(3.0)
_SPEC_FIELDS = ("color", "shape", "background", "size")


def specs_from_prompts(prompts, metadata=None) -> list[ShapeSpec]:
    """The requested ShapeSpec of each prompt (metadata fields as fallback)."""
    specs = []
    for i, prompt in enumerate(prompts):
        try:
            specs.append(parse_prompt(prompt))
        except ValueError:
            meta = metadata[i] if metadata is not None and i < len(metadata) and metadata[i] else {}
            if all(field in meta for field in _SPEC_FIELDS):
                specs.append(ShapeSpec(**{field: meta[field] for field in _SPEC_FIELDS}))
            else:
                raise ValueError(
                    f"shapes reward: prompt {prompt!r} (index {i}) is not a shapes-world prompt and its metadata "
                    f"lacks {list(_SPEC_FIELDS)}; use prompts from ddpo_group.data.shapes.shapes_prompts()"
                ) from None
    return specs


def _rgb(table, names, like: torch.Tensor) -> torch.Tensor:
    """(B, 3, 1, 1) colours in [0, 1] for a list of vocabulary names."""
    values = torch.tensor([table[name] for name in names], dtype=like.dtype, device=like.device) / 255.0
    return values[:, :, None, None]


def _check_images(images) -> torch.Tensor:
    images = torch.as_tensor(images)
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape (B, 3, H, W), got {tuple(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"images must be float in [0, 1], got dtype {images.dtype}")
    # the scores are numpy / CPU work: images may arrive on any device and in any float dtype
    return images.detach().to("cpu", torch.float64).clamp(0.0, 1.0)


def foreground_weight(images: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """w = clip((|p - b| / sqrt(3) - 0.10) / 0.15, 0, 1); images (B,3,H,W), background (B,3,1,1) -> (B,H,W)."""
    dist = (images - background).norm(dim=1) / _SQRT3
    return ((dist - FG_LOW) / (FG_HIGH - FG_LOW)).clamp(0.0, 1.0)


def presence(weight: torch.Tensor) -> torch.Tensor:
    """clip(mean(w) / 0.02, 0, 1): 0 for an empty image, 1 once 2% of the pixels are foreground. (B,H,W) -> (B,)."""
    return (weight.mean(dim=(1, 2)) / MIN_FOREGROUND).clamp(0.0, 1.0)


def color_scores(images, specs: list[ShapeSpec]) -> torch.Tensor:
    """Soft colour match of the foreground (module docstring); images (B,3,H,W) -> (B,) float64."""
    images = _check_images(images)
    background = _rgb(BACKGROUNDS, [s.background for s in specs], images)
    direction = _rgb(COLORS, [s.color for s in specs], images) - background
    offset = images - background
    alpha = ((offset * direction).sum(dim=1, keepdim=True) / direction.pow(2).sum(dim=1, keepdim=True)).clamp(0.0, 1.0)
    residual = (offset - alpha * direction).norm(dim=1) / _SQRT3
    match = (1.0 - residual / COLOR_TOLERANCE).clamp(0.0, 1.0)
    weight = foreground_weight(images, background)
    total = weight.sum(dim=(1, 2))
    mean_match = (weight * match).sum(dim=(1, 2)) / total.clamp_min(1e-12)
    return torch.where(total > 0, mean_match, torch.zeros_like(total)) * presence(weight)


def area_fractions(images, specs: list[ShapeSpec]) -> torch.Tensor:
    """Foreground area fraction f = mean(w); images (B,3,H,W) -> (B,) float64."""
    images = _check_images(images)
    background = _rgb(BACKGROUNDS, [s.background for s in specs], images)
    return foreground_weight(images, background).mean(dim=(1, 2))


def area_scores(images, specs: list[ShapeSpec]) -> torch.Tensor:
    """clip(1 - d / ln 1.5, 0, 1), d = log-distance of f to the size's range; (B,3,H,W) -> (B,)."""
    fraction = area_fractions(images, specs).clamp_min(1e-12)
    low = torch.tensor([AREA_RANGES[s.size][0] for s in specs], dtype=fraction.dtype)
    high = torch.tensor([AREA_RANGES[s.size][1] for s in specs], dtype=fraction.dtype)
    distance = torch.maximum(torch.log(low / fraction), torch.log(fraction / high)).clamp_min(0.0)
    return (1.0 - distance / AREA_FALLOFF).clamp(0.0, 1.0)


def background_scores(images, specs: list[ShapeSpec]) -> torch.Tensor:
    """Mean over the border ring of clip(1 - |p - b| / sqrt(3) / 0.2, 0, 1); (B,3,H,W) -> (B,)."""
    images = _check_images(images)
    background = _rgb(BACKGROUNDS, [s.background for s in specs], images)
    height, width = images.shape[-2:]
    ring = torch.ones(height, width, dtype=torch.bool)
    border = max(1, height // 16)
    ring[border : height - border, border : width - border] = False
    match = (1.0 - (images - background).norm(dim=1) / _SQRT3 / BACKGROUND_TOLERANCE).clamp(0.0, 1.0)
    return match[:, ring].mean(dim=1)


def template_ious(weight: np.ndarray) -> dict[str, float]:
    """Soft IoU of a foreground mask (H, W) with each shape template of the same area and centroid.

    The circle and square are centred on the centroid; the triangle's centroid lies h/6 below
    its bounding-box centre (apex up). IoU = sum min(w, t) / sum max(w, t).
    """
    height, width = weight.shape
    if height != width:
        raise ValueError(f"images must be square for shapes_shape, got {height}x{width}")
    area = float(weight.sum())
    if area <= 0:
        return {shape: 0.0 for shape in SHAPES}
    rows, cols = np.mgrid[0:height, 0:width] + 0.5
    cy, cx = float((weight * rows).sum() / area), float((weight * cols).sum() / area)
    ious = {}
    for shape in SHAPES:
        center_y = cy - math.sqrt(2 * area) / 6 if shape == "triangle" else cy
        template = shape_coverage(shape, area, (cx, center_y), height)
        ious[shape] = float(np.minimum(weight, template).sum() / np.maximum(weight, template).sum())
    return ious


def shape_scores(images, specs: list[ShapeSpec]) -> tuple[torch.Tensor, list[dict]]:
    """clip(0.5 + (IoU_req - max IoU_other) / 0.08, 0, 1) * presence; (B,3,H,W) -> ((B,), per-image IoUs)."""
    images = _check_images(images)
    background = _rgb(BACKGROUNDS, [s.background for s in specs], images)
    weight = foreground_weight(images, background)
    scores, all_ious = [], []
    for w, spec in zip(weight.cpu().numpy(), specs):
        ious = template_ious(w)
        other = max(iou for shape, iou in ious.items() if shape != spec.shape)
        scores.append(min(1.0, max(0.0, 0.5 + (ious[spec.shape] - other) / SHAPE_MARGIN)))
        all_ious.append(ious)
    return torch.tensor(scores, dtype=torch.float64) * presence(weight), all_ious


def alignment_components(images, prompts, metadata=None) -> dict[str, np.ndarray]:
    """All four component scores, each np.float64 (B,)."""
    images, specs = _checked_specs(images, prompts, metadata)
    return {
        "color": color_scores(images, specs).cpu().numpy(),
        "area": area_scores(images, specs).cpu().numpy(),
        "background": background_scores(images, specs).cpu().numpy(),
        "shape": shape_scores(images, specs)[0].cpu().numpy(),
    }


def _checked_specs(images, prompts, metadata) -> tuple[torch.Tensor, list[ShapeSpec]]:
    images = _check_images(images)
    specs = specs_from_prompts(prompts, metadata)
    if len(specs) != images.shape[0]:
        raise ValueError(f"got {images.shape[0]} images but {len(specs)} prompts; pass one prompt per image")
    return images, specs


@register_reward("shapes_color")
def shapes_color(images, prompts, metadata=None):
    """Foreground colour match (module docstring); (B,3,H,W) [0,1] -> (np.float64 (B,), {})."""
    images, specs = _checked_specs(images, prompts, metadata)
    return color_scores(images, specs).cpu().numpy(), {}


@register_reward("shapes_area")
def shapes_area(images, prompts, metadata=None):
    """Foreground area in the size's range; (B,3,H,W) [0,1] -> (np.float64 (B,), {"area_fraction"})."""
    images, specs = _checked_specs(images, prompts, metadata)
    return area_scores(images, specs).cpu().numpy(), {"area_fraction": area_fractions(images, specs).cpu().numpy()}


@register_reward("shapes_background")
def shapes_background(images, prompts, metadata=None):
    """Border ring matches the background colour; (B,3,H,W) [0,1] -> (np.float64 (B,), {})."""
    images, specs = _checked_specs(images, prompts, metadata)
    return background_scores(images, specs).cpu().numpy(), {}


@register_reward("shapes_shape")
def shapes_shape(images, prompts, metadata=None):
    """Template-IoU shape match; (B,3,H,W) [0,1] -> (np.float64 (B,), {"iou_circle", "iou_square", "iou_triangle"})."""
    images, specs = _checked_specs(images, prompts, metadata)
    scores, ious = shape_scores(images, specs)
    return scores.cpu().numpy(), {f"iou_{shape}": np.array([iou[shape] for iou in ious]) for shape in SHAPES}


@register_reward("shapes_alignment")
def shapes_alignment(images, prompts, metadata=None):
    """color * area * background * shape, np.float64 (B,); info holds the four components."""
    components = alignment_components(images, prompts, metadata)
    return components["color"] * components["area"] * components["background"] * components["shape"], components
