"""The shapes world: a procedural text-to-image task that runs offline on a CPU.

Every prompt reads ``"a {size} {color} {shape} on a {background} background"``, for
example ``"a small red circle on a white background"``; with 6 colours, 3 shapes,
3 backgrounds and 2 sizes there are 108 prompts. ``render`` draws the image a prompt
asks for, so the tiny pipeline can be pretrained on (image, prompt) pairs
(``scripts/pretrain_tiny.py``) and rewards can check a generated image against its
prompt programmatically (``ddpo_group.rewards.shapes``).

Geometry. A size is a target *area fraction* of the canvas, the same for every shape,
so that ``small`` and ``big`` are told apart by area alone:

    small: area / size**2 ~ U[0.05, 0.08]      big: area / size**2 ~ U[0.20, 0.30]

    circle    radius r = sqrt(A / pi)
    square    side   s = sqrt(A)                   (axis-aligned)
    triangle  base   b = height h = sqrt(2 A)      (isosceles, apex up)

The shape's bounding box lies fully inside the canvas with a margin of ``size // 16``
pixels (2 at 32x32), so the image border always shows the background. Edges are
anti-aliased by 4x4 supersampling: a border pixel is the coverage-weighted mix of the
shape colour and the background colour.

The vocabulary words are exactly the ones the tiny tokenizer
(``ddpo_group.diffusion.tiny``) has whole-word tokens for; do not rename them.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "magenta": (255, 0, 255),
    "cyan": (0, 255, 255),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
# Shapes drawn only in the scenes world (ddpo_group/data/scenes.py); the 108 prompts above use SHAPES alone.
SCENE_ONLY_SHAPES: tuple[str, ...] = ("diamond", "cross", "ring", "star", "semicircle")
ALL_SHAPES: tuple[str, ...] = SHAPES + SCENE_ONLY_SHAPES
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
}
SIZES: tuple[str, ...] = ("small", "big")

# Area fraction of the canvas covered by the shape: uniform range when jittered, midpoint otherwise.
AREA_FRACTIONS: dict[str, tuple[float, float]] = {"small": (0.05, 0.08), "big": (0.20, 0.30)}

PROMPT_TEMPLATE = "a {size} {color} {shape} on a {background} background"
_SUPERSAMPLE = 4

_PROMPT_RE = re.compile(
    r"^\s*an?\s+(?P<size>\w+)\s+(?P<color>\w+)\s+(?P<shape>\w+)\s+on\s+an?\s+(?P<background>\w+)\s+background\s*\.?\s*$",
    re.IGNORECASE,
)


@dataclasses.dataclass(frozen=True)
class ShapeSpec:
    """What a shapes-world prompt asks for; each field is one vocabulary word."""

    color: str
    shape: str
    background: str
    size: str

    def __post_init__(self):
        for field, value, allowed in (
            ("color", self.color, tuple(COLORS)),
            ("shape", self.shape, SHAPES),
            ("background", self.background, tuple(BACKGROUNDS)),
            ("size", self.size, SIZES),
        ):
            if value not in allowed:
                raise ValueError(f"ShapeSpec.{field}={value!r} is not one of {list(allowed)}")

    @property
    def prompt(self) -> str:
        return prompt_from_spec(self)


def prompt_from_spec(spec: ShapeSpec) -> str:
    """``"a {size} {color} {shape} on a {background} background"`` for ``spec``."""
    return PROMPT_TEMPLATE.format(size=spec.size, color=spec.color, shape=spec.shape, background=spec.background)


def parse_prompt(prompt: str) -> ShapeSpec:
    """Inverse of ``prompt_from_spec`` (case-insensitive, tolerates "an" and a final period).

    Raises ValueError naming the prompt and the template when it does not parse or a word
    is outside the vocabulary.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
    match = _PROMPT_RE.match(prompt)
    if match is None:
        raise ValueError(f"prompt {prompt!r} is not a shapes-world prompt; expected {PROMPT_TEMPLATE!r}")
    words = {key: value.lower() for key, value in match.groupdict().items()}
    try:
        return ShapeSpec(**words)
    except ValueError as err:
        raise ValueError(f"prompt {prompt!r}: {err}") from None


def all_specs() -> list[ShapeSpec]:
    """The 108 specs in a fixed order: size, colour, shape, background (outermost first)."""
    return [
        ShapeSpec(color=color, shape=shape, background=background, size=size)
        for size, color, shape, background in itertools.product(SIZES, COLORS, SHAPES, BACKGROUNDS)
    ]


def shapes_prompts() -> list[dict]:
    """All 108 prompts as dicts ``{"prompt", "color", "shape", "background", "size"}``."""
    return [{"prompt": spec.prompt, **dataclasses.asdict(spec)} for spec in all_specs()]


def shape_coverage(shape: str, area: float, center: tuple[float, float], size: int, supersample: int = _SUPERSAMPLE,
                   window: int | None = None) -> np.ndarray:
    """Anti-aliased coverage mask of a shape, float64 (size, size) in [0, 1].

    ``area`` is in pixels, ``center`` = (cx, cy) in pixel coordinates (pixel (i, j) spans [j, j+1) x [i, i+1)):
    the centre of the bounding box for circle, square and triangle, the centroid for the scene-only shapes
    (``scene_shape_inside``). Coverage of a pixel = the fraction of its ``supersample**2`` sub-pixel centres
    inside the shape. ``window``: a half-width in pixels; only the pixels within it of the centre are computed
    (the same values), the rest are 0 (for shapes known to fit in it: faster on a large canvas).
    """
    if shape not in ALL_SHAPES:
        raise ValueError(f"shape={shape!r} is not one of {list(ALL_SHAPES)}")
    cx, cy = center
    if window is None:
        rows = cols = slice(0, size)
    else:
        rows = slice(max(0, int(cy) - window), min(size, int(cy) + window + 1))
        cols = slice(max(0, int(cx) - window), min(size, int(cx) + window + 1))
    y, x = np.meshgrid((np.arange(rows.start * supersample, rows.stop * supersample) + 0.5) / supersample,
                       (np.arange(cols.start * supersample, cols.stop * supersample) + 0.5) / supersample, indexing="ij")
    if shape == "circle":
        radius = np.sqrt(area / np.pi)
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= radius**2
    elif shape == "square":
        half = np.sqrt(area) / 2
        inside = (np.abs(x - cx) <= half) & (np.abs(y - cy) <= half)
    elif shape == "triangle":
        side = np.sqrt(2 * area)
        top, bottom = cy - side / 2, cy + side / 2
        # half-width grows linearly from 0 at the apex to side/2 at the base
        half_width = (y - top) / side * (side / 2)
        inside = (y >= top) & (y <= bottom) & (np.abs(x - cx) <= half_width)
    else:
        inside = scene_shape_inside(shape, area, x - cx, y - cy)
    height, width = rows.stop - rows.start, cols.stop - cols.start
    coverage = inside.reshape(height, supersample, width, supersample).mean(axis=(1, 3))
    if window is None:
        return coverage
    full = np.zeros((size, size))
    full[rows, cols] = coverage
    return full


RING_INNER = 0.55  # inner radius / outer radius of a ring
STAR_INNER = 0.5  # inner radius / outer radius of the five-pointed star


def scene_shape_inside(shape: str, area: float, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Whether the points at offsets (dx, dy) from the centroid lie inside a scene-only shape of ``area`` pixels
    (image y grows downwards). Each shape's size follows from its area:

        diamond     half-diagonal h, |dx| + |dy| <= h,                       area = 2 h^2
        cross       arms of half-length L and half-width w = L / 3 (a plus),  area = 8 L w - 4 w^2 = 20 L^2 / 9
        ring        outer radius R, inner radius RING_INNER R,               area = pi R^2 (1 - RING_INNER^2)
        star        five points up, radii alternating R and STAR_INNER R every 36 degrees,
                                                                             area = 5 R (STAR_INNER R) sin 36deg
        semicircle  radius R, flat side down, centroid 4 R / (3 pi) above it, area = pi R^2 / 2
    """
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= np.sqrt(area / 2)
    if shape == "cross":
        arm = np.sqrt(9 * area / 20)
        half_width = arm / 3
        return ((np.abs(dx) <= half_width) & (np.abs(dy) <= arm)) | ((np.abs(dy) <= half_width) & (np.abs(dx) <= arm))
    if shape == "ring":
        outer = np.sqrt(area / (np.pi * (1 - RING_INNER**2)))
        r2 = dx**2 + dy**2
        return (r2 <= outer**2) & (r2 >= (RING_INNER * outer) ** 2)
    if shape == "star":
        outer = np.sqrt(area / (5 * STAR_INNER * np.sin(np.pi / 5)))
        # polar angle from the upward axis, folded into one 72-degree sector symmetric about a point
        angle = np.mod(np.arctan2(dx, -dy) + np.pi / 5, 2 * np.pi / 5) - np.pi / 5
        r = np.hypot(dx, dy)
        # the edge from the point (R, 0) to the notch (STAR_INNER R, 36deg): inside when on the centre's side
        px, py = r * np.cos(np.abs(angle)), r * np.sin(np.abs(angle))
        ax, ay = outer, 0.0
        bx, by = STAR_INNER * outer * np.cos(np.pi / 5), STAR_INNER * outer * np.sin(np.pi / 5)
        cross_z = (bx - ax) * (py - ay) - (by - ay) * (px - ax)
        return cross_z >= 0
    if shape == "semicircle":
        radius = np.sqrt(2 * area / np.pi)
        flat = 4 * radius / (3 * np.pi)  # the flat side lies this far below the centroid
        return (dy <= flat) & (dx**2 + (dy - flat) ** 2 <= radius**2)
    raise ValueError(f"shape={shape!r} is not one of {list(SCENE_ONLY_SHAPES)}")


def shape_extent(shape: str, area: float) -> float:
    """Side of the (square) bounding box of a shape of ``area`` pixels."""
    if shape == "circle":
        return 2 * np.sqrt(area / np.pi)
    if shape == "square":
        return float(np.sqrt(area))
    if shape == "triangle":
        return float(np.sqrt(2 * area))
    raise ValueError(f"shape={shape!r} is not one of {list(SHAPES)}")


def render(spec: ShapeSpec, size: int = 32, rng: np.random.Generator | None = None) -> np.ndarray:
    """Draw ``spec`` as an RGB image, np.uint8 (size, size, 3).

    image = coverage * colour + (1 - coverage) * background, rounded to uint8.
    Without ``rng`` the shape is centred with the midpoint area of its size class; with
    ``rng`` the area fraction is drawn from ``AREA_FRACTIONS[spec.size]`` and the centre
    uniformly among positions that keep the bounding box ``size // 16`` pixels from the border.
    """
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    if size < 16:
        raise ValueError(f"size={size} is too small; use size >= 16")
    low, high = AREA_FRACTIONS[spec.size]
    fraction = (low + high) / 2 if rng is None else rng.uniform(low, high)
    area = fraction * size * size
    half_extent = shape_extent(spec.shape, area) / 2
    margin = size // 16
    lo, hi = margin + half_extent, size - margin - half_extent
    if rng is None:
        center = (size / 2, size / 2)
    else:
        center = (rng.uniform(lo, hi), rng.uniform(lo, hi))
    coverage = shape_coverage(spec.shape, area, center, size)[..., None]
    color = np.asarray(COLORS[spec.color], dtype=np.float64)
    background = np.asarray(BACKGROUNDS[spec.background], dtype=np.float64)
    image = coverage * color + (1.0 - coverage) * background
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def sample_dataset(n: int, seed: int, size: int = 32) -> tuple[np.ndarray, list[str]]:
    """``n`` random (image, prompt) pairs, reproducible from ``seed``.

    Specs are drawn uniformly from the 108 prompts and rendered with position and area
    jitter. Returns (images np.uint8 (n, size, size, 3), prompts list[str] of length n).
    """
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rng = np.random.default_rng(seed)
    specs = all_specs()
    choice = rng.integers(0, len(specs), size=n)
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    prompts = []
    for i, k in enumerate(choice):
        images[i] = render(specs[k], size=size, rng=rng)
        prompts.append(specs[k].prompt)
    return images, prompts
