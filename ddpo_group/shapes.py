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


def shape_coverage(shape: str, area: float, center: tuple[float, float], size: int, supersample: int = _SUPERSAMPLE) -> np.ndarray:
    """Anti-aliased coverage mask of a shape, float64 (size, size) in [0, 1].

    ``area`` is in pixels, ``center`` = (cx, cy) the centre of the bounding box in pixel
    coordinates (pixel (i, j) spans [j, j+1) x [i, i+1)). Coverage of a pixel = the
    fraction of its ``supersample**2`` sub-pixel centres inside the shape.
    """
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is not one of {list(SHAPES)}")
    fine = size * supersample
    coords = (np.arange(fine) + 0.5) / supersample
    y, x = np.meshgrid(coords, coords, indexing="ij")
    cx, cy = center
    if shape == "circle":
        radius = np.sqrt(area / np.pi)
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= radius**2
    elif shape == "square":
        half = np.sqrt(area) / 2
        inside = (np.abs(x - cx) <= half) & (np.abs(y - cy) <= half)
    else:
        side = np.sqrt(2 * area)
        top, bottom = cy - side / 2, cy + side / 2
        # half-width grows linearly from 0 at the apex to side/2 at the base
        half_width = (y - top) / side * (side / 2)
        inside = (y >= top) & (y <= bottom) & (np.abs(x - cx) <= half_width)
    return inside.reshape(size, supersample, size, supersample).mean(axis=(1, 3))


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
