"""Shapes-world scenes for GenEval: several shapes in one image, an exact detector and colour classifier for
them, and the GenEval records of the tiny model's task (variant ``tiny_geneval``).

Vocabulary. The shapes world keeps its own words in GenEval's places: the classes are its shapes (circle,
square, triangle) instead of the 80 COCO classes, the colours its six (red, green, blue, yellow, magenta, cyan)
instead of GenEval's ten. The rules of ``protocol.py`` read classes and colours as plain strings, so nothing
else changes; the tiny model's tokenizer knows only these words (``ddpo_group/data/shapes.py``).

Scene. ``render_scene`` draws each ``SceneObject`` over a flat background with the shapes world's
anti-aliased coverage (``ddpo_group.data.shapes.shape_coverage``), later objects over earlier ones.

Detector (``ShapesDetector``), exact on rendered scenes (objects 2 px apart, as the scenes world places them):

1. background b = the per-channel median of the 1-pixel border;
2. segmentation, colour-agnostic (``shape_segments``, the default): a pixel is foreground when it lies at least half
   the nearest palette colour's distance from b; each 4-connected foreground region takes its own colour c (the
   median of its core pixels, those most covered by their nearest palette colour) and its mask is the region's pixels
   with alpha = <p - b, c - b> / |c - b|^2 >= 0.5 (or covered by another palette colour, as a red star's yellow
   tips), so a generated object whose hue wanders (a violet star with magenta tips) is one object, as it is to an eye
   and to GenEval's Mask2Former. ``segmentation="palette"`` (issue 42's and issue 53's first detector): a pixel
   belongs to palette colour c when alpha_c >= 0.5 and the residual |p - b - alpha v| / (255 sqrt 3) <= 0.15
   (v = c - b), the smallest residual winning, one object per region of one colour. On rendered scenes the two give
   the same objects (``tests/test_shapes_detector_segmentation.py``);
3. each region (mask) with at least ``min_area`` pixels (``MIN_AREA`` = 40, half the scenes world's smallest
   object; smaller ones are fragments) is an object: its box (x1, y1, x2 + 1, y2 + 1) of the pixel extents;
4. its template overlaps: for each shape, the soft IoU of the template of the same area and centroid with the
   object's coverage (its colour's share alpha, clipped to [0, 1], on the mask grown by one pixel),
   ``shape_overlaps``, as the shapes world's own ``shapes_shape`` reward compares shapes;
5. its scores (``calibrated_scores``): score(c) = q softmax_c(IoU / T), T = 0.025, q = clip((max IoU - 0.4) /
   0.3, 0, 1); the object is reported under every shape it scores >= 0.05 for, as mmdetection's Mask2Former
   (GenEval's detector) reports its top query-class pairs. On rendered scenes the true shape scores > 0.98 and
   no other >= 0.05; on generated blobs a near-tie scores about 0.5 for each of the two shapes, which GenEval's
   0.3 keeps and its counting threshold 0.9 drops. Measured calibration and the reward's flip rate:
   docs/scenes.md, "The detector's score". ``confidence="unit", segmentation="palette"`` is issue 42's detector
   (the best shape alone, score 1, fragments from 4 px).

What the colour-agnostic segmentation gives up: two generated objects that touch are one region (the palette
segmentation split them when their colours differed), and a blob of no palette colour counts as an object
(named by its nearest colour). The first is the limit of a detector without learned instance boundaries
(Mask2Former separates touching objects; this one does not); the second is what GenEval's detector does, which
finds objects whatever their colour.

Colour classifier (``ShapesColorClassifier``): the per-channel median of the object's mask pixels, the nearest
palette colour (Euclidean). On a generated image both are heuristics, as any detector is.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from ddpo_group.rewards.geneval.protocol import Detection
from ddpo_group.data.shapes import ALL_SHAPES, BACKGROUNDS, COLORS, SHAPES, parse_prompt, shape_coverage

ALPHA_MIN = 0.5
RESIDUAL_MAX = 0.15
TINY_GENEVAL_PROMPTS = "geneval_shapes_squares.jsonl"
CONFIDENCES = ("calibrated", "unit")
SEGMENTATIONS = ("shape", "palette")
FOREGROUND_MIN = 0.5  # of the nearest palette colour's distance from the background: a pixel that far is foreground
CORE_SHARE = 0.9  # an object's colour: the median of its pixels covered at least this share of its most covered one
MIN_AREA = 40  # px: half the scenes world's smallest object (AREA_RANGE 80 px); rendered objects keep >= 72
TEMPERATURE = 0.025  # of the softmax over template overlaps: the least NLL of the true class (docs/scenes.md)
QUALITY_RANGE = (0.4, 0.7)  # best template overlap at which the shape quality q starts to rise, reaches 1
PALETTE = np.asarray(list(COLORS.values()), dtype=np.float64)  # (K, 3) in the order of list(COLORS)
REPORT_MIN = 0.05  # (object, class) pairs scored below this are not reported (under every threshold of GenEval)


def calibrated_scores(overlaps: dict, temperature: float = TEMPERATURE,
                      quality_range: tuple[float, float] = QUALITY_RANGE) -> dict[str, float]:
    """{shape: score in [0, 1]} of one object from its template overlaps ({shape: soft IoU}, ``shape_overlaps``):

        score(c) = q * softmax_c(IoU / T),   q = clip((max IoU - b0) / (b1 - b0), 0, 1)

    with T = ``TEMPERATURE``, (b0, b1) = ``QUALITY_RANGE``. The softmax is the probability that the object is of
    class c given how much better c's template fits than the others' (a near-tie splits it: a blob between a
    circle and a semicircle is about 0.5 of each, as Mask2Former's query splits its class probability); q is
    how much the object looks like any shape at all (1 from a best overlap of 0.7 on, 0 at 0.4 and below).
    A rendered object (best overlap >= 0.97, lead >= 0.149 over every other class) scores > 1 - 7 e^-5.96 = 0.98
    for its class, above GenEval's counting threshold 0.9."""
    names = list(overlaps)
    values = np.asarray([overlaps[name] for name in names], dtype=np.float64)
    weights = np.exp((values - values.max()) / temperature)
    low, high = quality_range
    quality = float(np.clip((values.max() - low) / (high - low), 0.0, 1.0))
    return {name: quality * float(w) for name, w in zip(names, weights / weights.sum())}


@dataclasses.dataclass(frozen=True)
class SceneObject:
    """A shape of `color` with bounding-box centre (cx, cy) in pixels and `area` in pixels."""

    shape: str
    color: str
    center: tuple[float, float]
    area: float


def render_scene(objects, background: str = "white", size: int = 64) -> np.ndarray:
    """The scene as uint8 (size, size, 3): image = coverage * colour + (1 - coverage) * image, object by object."""
    image = np.broadcast_to(np.asarray(BACKGROUNDS[background], dtype=np.float64), (size, size, 3)).copy()
    for obj in objects:
        if obj.shape not in ALL_SHAPES or obj.color not in COLORS:
            raise ValueError(f"scene object {obj}: shape must be one of {list(ALL_SHAPES)}, colour one of {list(COLORS)}")
        coverage = shape_coverage(obj.shape, obj.area, obj.center, size)[..., None]
        image = coverage * np.asarray(COLORS[obj.color], dtype=np.float64) + (1.0 - coverage) * image
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected components of a bool (H, W) mask, each as a bool mask, in raster order of first pixel.

    Each pixel starts with its own raster index as label and takes the smallest label of its 4-neighbours in
    the mask until nothing changes: a component ends labelled by its first pixel's index (vectorised: a
    component of diameter d converges in about d rounds)."""
    height, width = mask.shape
    big = height * width
    labels = np.where(mask, np.arange(big).reshape(height, width), big)
    while True:
        smallest = labels.copy()
        smallest[1:] = np.minimum(smallest[1:], labels[:-1])
        smallest[:-1] = np.minimum(smallest[:-1], labels[1:])
        smallest[:, 1:] = np.minimum(smallest[:, 1:], labels[:, :-1])
        smallest[:, :-1] = np.minimum(smallest[:, :-1], labels[:, 1:])
        smallest = np.where(mask, smallest, big)
        if np.array_equal(smallest, labels):
            break
        labels = smallest
    return [labels == first for first in np.unique(labels[mask])]


def palette_labels(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(labels int (H, W): index into the palette ``list(COLORS)`` or -1 for background, alpha float (K, H, W):
    each colour's share of each pixel, 0 where the pixel is not a mix of that colour and the background)."""
    pixels = image.astype(np.float64)
    background = _background(pixels)
    best = np.full(image.shape[:2], np.inf)
    labels = np.full(image.shape[:2], -1)
    alphas = np.zeros((len(COLORS),) + image.shape[:2])
    offset = pixels - background
    for k, name in enumerate(COLORS):
        direction = np.asarray(COLORS[name], dtype=np.float64) - background
        norm2 = float(direction @ direction)
        if norm2 < 1e-6:  # the colour is the background's: nothing of it can be seen
            continue
        alpha = offset @ direction / norm2
        residual = np.linalg.norm(offset - alpha[..., None] * direction, axis=-1) / (255 * math.sqrt(3))
        alphas[k] = np.where(residual <= RESIDUAL_MAX, np.clip(alpha, 0.0, 1.0), 0.0)
        take = (alpha >= ALPHA_MIN) & (residual <= RESIDUAL_MAX) & (residual < best)
        best[take] = residual[take]
        labels[take] = k
    return labels, alphas


def _background(pixels: np.ndarray) -> np.ndarray:
    """The per-channel median of the 1-pixel border of float (H, W, 3) pixels."""
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    return np.median(border, axis=0)


def shape_segments(image: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Colour-agnostic segmentation (the default, ``segmentation="shape"``): [(mask bool (H, W), coverage float
    (H, W), colour float (3,))] of one uint8 image, in raster order of the regions' first pixels.

    1. foreground: pixels whose distance from the background b is at least FOREGROUND_MIN of the nearest palette
       colour's distance from b (so every pixel a palette colour covers by half or more is foreground);
    2. each 4-connected region of the foreground gets its own colour c: the per-channel median of its core, the
       pixels whose coverage of their nearest palette colour (``_palette_coverage``) is at least CORE_SHARE of the
       region's highest (a rendered object's full-coverage pixels);
    3. its coverage alpha = <p - b, c - b> / |c - b|^2, clipped to [0, 1], and where a pixel is at least
       CORE_SHARE covered by a palette colour other than c's nearest, that coverage if larger (a yellow tip of a red
       star is the star's; a rendered object has no such pixel); its mask the region's pixels with alpha >=
       ALPHA_MIN, split into 4-connected pieces.

    On a rendered object c is its palette colour and the mask and coverage are ``palette_labels``' exactly; a
    generated object whose pixels wander between hues (a violet star, magenta at its tips) stays one object,
    which labelling pixels by palette colour cut into pieces too small to count (docs/scenes.md, "A shape is a
    shape in any hue"). The core is measured in coverage, not in distance from b: a red star with yellow tips on
    black has its tips 1.41 times as far from b as its body (yellow lights two channels), and a core of the
    farthest pixels made it a yellow object that covered its own red body by half, lost under ALPHA_MIN
    (docs/scenes.md, "A star with yellow tips")."""
    pixels = np.asarray(image).astype(np.float64)
    background = _background(pixels)
    reach = np.linalg.norm(PALETTE - background, axis=1)
    offset = pixels - background
    distance = np.linalg.norm(offset, axis=-1)
    coverage, nearest = _palette_coverage(pixels, distance, reach)
    segments = []
    for region in _components(distance >= FOREGROUND_MIN * float(reach[reach > 1e-3].min())):
        share = coverage[region]
        color = np.median(pixels[region][share >= CORE_SHARE * share.max()], axis=0)
        direction = color - background
        alpha = np.clip(offset @ direction / float(direction @ direction), 0.0, 1.0)
        # a pixel of another palette colour is the object's too (a yellow tip of a red star); none on a rendered one
        other = (coverage >= CORE_SHARE) & (nearest != np.argmin(np.linalg.norm(PALETTE - color, axis=1)))
        alpha = np.where(other, np.maximum(alpha, np.minimum(coverage, 1.0)), alpha) * _dilate(region)
        for piece in _components(region & (alpha >= ALPHA_MIN)):
            segments.append((piece, alpha, color))
    return segments


def _palette_coverage(pixels: np.ndarray, distance: np.ndarray, reach: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(coverage float (H, W), nearest int (H, W)) of float pixels (H, W, 3) given their distance (H, W) from the
    background b and each palette colour's distance from b (`reach`, (K,)): a pixel's distance over that of the
    palette colour nearest to it (its index into PALETTE): 1 for a pixel of a palette colour, whichever colour, alpha
    for a rendered mix alpha c + (1 - alpha) b with alpha >= 0.5 (whose nearest palette colour is c). A palette
    colour equal to b is never nearest."""
    gaps = np.linalg.norm(pixels[..., None, :] - PALETTE, axis=-1)
    nearest = np.argmin(np.where(reach > 1e-3, gaps, np.inf), axis=-1)
    return distance / reach[nearest], nearest


def _dilate(mask: np.ndarray) -> np.ndarray:
    grown = mask.copy()
    grown[1:] |= mask[:-1]
    grown[:-1] |= mask[1:]
    grown[:, 1:] |= mask[:, :-1]
    grown[:, :-1] |= mask[:, 1:]
    return grown


def shape_overlaps(weight: np.ndarray) -> dict[str, float]:
    """{shape: soft IoU of its template (same area and centroid) with `weight` (H, W)}, over the shapes of both
    worlds (``shapes.ALL_SHAPES``), in that order: IoU = sum min(w, t) / sum max(w, t); the triangle's centroid
    lies h / 6 below its box centre (apex up), the scene-only shapes are drawn about their centroid."""
    height, width = weight.shape
    size = max(height, width)
    area = float(weight.sum())
    rows, cols = np.mgrid[0:height, 0:width] + 0.5
    cy, cx = float((weight * rows).sum() / area), float((weight * cols).sum() / area)
    overlaps = {}
    for shape in ALL_SHAPES:
        center_y = cy - math.sqrt(2 * area) / 6 if shape == "triangle" else cy
        # every shape of this area lies within sqrt(area) + 2 px of its centroid: only that window is drawn
        template = shape_coverage(shape, area, (cx, center_y), size, window=int(math.sqrt(area)) + 3)[:height, :width]
        overlaps[shape] = float(np.minimum(weight, template).sum() / np.maximum(weight, template).sum())
    return overlaps


def classify_shape(weight: np.ndarray) -> str:
    """The shape whose template has the highest soft IoU with `weight` (H, W) (``shape_overlaps``; a tie goes to
    the first shape of ``shapes.ALL_SHAPES``)."""
    overlaps = shape_overlaps(weight)
    return max(overlaps, key=overlaps.get)


class ShapesDetector:
    """The shapes-world detector (module docstring); classes = the shapes. confidence: "calibrated" (the scores of
    ``calibrated_scores``, fragments under ``min_area`` = MIN_AREA px dropped) or "unit" (issue 42's detector: every
    object 1.0, min_area 4 by default). segmentation: "shape" (``shape_segments``: an object is a region that
    stands out from the background, whatever its hue) or "palette" (issue 42's and issue 53's first detector:
    pixels labelled by the nearest palette colour within RESIDUAL_MAX, one object per region of one colour)."""

    classes = ALL_SHAPES

    def __init__(self, min_area: int | None = None, confidence: str = "calibrated", segmentation: str = "shape"):
        if confidence not in CONFIDENCES:
            raise ValueError(f"ShapesDetector: confidence={confidence!r} is not one of {list(CONFIDENCES)}")
        if segmentation not in SEGMENTATIONS:
            raise ValueError(f"ShapesDetector: segmentation={segmentation!r} is not one of {list(SEGMENTATIONS)}")
        self.confidence, self.segmentation = confidence, segmentation
        self.min_area = (MIN_AREA if confidence == "calibrated" else 4) if min_area is None else min_area

    def _segments(self, image: np.ndarray):
        """[(mask, coverage, palette index)] of one image, by ``self.segmentation``."""
        if self.segmentation == "shape":
            return [(mask, alpha, int(np.argmin(np.linalg.norm(PALETTE - color, axis=1))))
                    for mask, alpha, color in shape_segments(image)]
        labels, alphas = palette_labels(image)
        return [(mask, alphas[k], k) for k in range(len(COLORS)) for mask in _components(labels == k)]

    def objects(self, image) -> list[dict]:
        """The objects of one image uint8 (H, W, 3), in segmentation order: dicts with "color" (the nearest palette
        index), "area" (mask pixels), "overlaps" ({shape: soft IoU}), "box", "mask" and "scores" ({shape: score}:
        ``calibrated_scores`` of the pairs scored >= REPORT_MIN, or {best shape: 1.0} for "unit")."""
        found = []
        for mask, alpha, color in self._segments(np.asarray(image)):
            area = int(mask.sum())
            if area < self.min_area:
                continue
            ys, xs = np.nonzero(mask)
            box = (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))
            overlaps = shape_overlaps(alpha * _dilate(mask))
            if self.confidence == "unit":
                scores = {max(overlaps, key=overlaps.get): 1.0}
            else:
                scores = {name: p for name, p in calibrated_scores(overlaps).items() if p >= REPORT_MIN}
            found.append({"color": color, "area": area, "overlaps": overlaps, "box": box, "mask": mask,
                          "scores": scores})
        return found

    def detect(self, images) -> list[dict]:
        """images uint8 (B, H, W, 3) -> per image {shape: [Detection(box, score, mask)]}: an object appears under
        every shape it scores >= REPORT_MIN for (one object may be a 0.5 circle and a 0.5 semicircle: mmdetection's
        Mask2Former, which GenEval runs, keeps its top query-class pairs, one query under several classes)."""
        results = []
        for image in np.asarray(images):
            found: dict[str, list] = {}
            for obj in self.objects(image):
                for shape, score in obj["scores"].items():
                    found.setdefault(shape, []).append(Detection(obj["box"], score, obj["mask"]))
            results.append(found)
        return results


class ShapesColorClassifier:
    """The colour of a detected shape: the median of its mask pixels, the nearest palette colour."""

    colors = tuple(COLORS)

    def classify(self, image, detections, classname) -> list[str]:
        palette = PALETTE
        names = []
        for detection in detections:
            pixels = np.asarray(image, dtype=np.float64)[detection.mask] if detection.mask is not None else None
            if pixels is None or not len(pixels):
                x1, y1, x2, y2 = (int(round(v)) for v in detection.box[:4])
                pixels = np.asarray(image, dtype=np.float64)[y1:y2, x1:x2].reshape(-1, 3)
            median = np.median(pixels, axis=0)
            names.append(self.colors[int(np.argmin(np.linalg.norm(palette - median, axis=1)))])
        return names


def shapes_world_records(prompts: str = "shapes_squares.txt") -> list[dict]:
    """GenEval records of shapes-world prompts (the tags one object can show): a small shape asks for the shape
    (single_object: include {shape, 1}), a big one for the shape in its colour (colors: include {shape, 1,
    colour}). `prompts`: a shapes-world prompt file (ddpo_group/assets/prompts) or path."""
    from ddpo_group.data.prompts import load_prompts

    records = []
    for record in load_prompts(prompts):
        spec = parse_prompt(record.prompt)
        clause = {"class": spec.shape, "count": 1}
        if spec.size == "big":
            clause["color"] = spec.color
        records.append({"tag": "colors" if spec.size == "big" else "single_object", "include": [clause],
                        "prompt": record.prompt})
    return records


def tiny_geneval_prompts_path() -> str:
    """The shipped records of variant tiny_geneval (shapes_world_records of the 36 square prompts)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets",
                        "prompts", TINY_GENEVAL_PROMPTS)
