"""The training reward ``geneval``: GenEval's detector and rules on every image, against its prompt's record.

    reward_fn = "geneval"
    reward_kwargs = {"geneval": {"score": "partial", "detector": "mask2former"}}

Each prompt's metadata is its GenEval record (``tag``, ``include``, ``exclude``; metadata.py), as a GenEval
``evaluation_metadata.jsonl`` or the generator's records give it. ``score`` picks the reward of an image:

- "partial" (default): Flow-GRPO's partial score, a mean of per-clause terms that can be negative
  (protocol.py: ``flow_grpo_score``; what yifan123/flow_grpo trains on);
- "strict": Flow-GRPO's ``strict_correct`` as 0 / 1 (exact counts, exclude clauses ignored);
- "correct": GenEval's own verdict as 0 / 1 (what the evaluation protocol counts);
- "expected": Flow-GRPO's strict verdict averaged over the detector's scores read as class probabilities, no
  threshold (expected.py): in [0, 1], smooth where the detector is unsure (a finer training reward; the ladder's
  probe, docs/scenes.md).

All are returned in the info (reward_info/geneval/partial_score, strict_correct, correct; expected_strict with
"expected").
``detector``: "mask2former" (transformers Mask2Former + CLIP colours; ``detector_model``, ``clip_model``), or
"shapes" (the exact shapes-world detector, variant tiny_geneval). ``jpeg_quality``: 0 scores the images as
they are; 75 reproduces Flow-GRPO, which JPEG-encodes each image (PIL's default quality 75) to send it to its
reward server. The thresholds are GenEval's (0.3, 0.9 for counting, 16 per class, position margin 0.1).

Every numeric option is checked when the reward is built (``check_options``), before any model loads: threshold
and counting_threshold are scores in [0, 1) (30 for 0.3 would keep no detection and make every reward 0),
max_objects a whole number >= 1, position_margin a finite number >= 0, jpeg_quality 0 or 1..100. The error names
the config field (reward_kwargs.geneval.FIELD), or the option of ``scripts/evaluate.py --protocol geneval``.
"""

from __future__ import annotations

import io
import math
import os

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards.base import RewardError, register_reward, to_uint8_images
from ddpo_group.rewards.geneval.detectors import CLIP_MODEL, MASK2FORMER_MODEL, build_detector
from ddpo_group.rewards.geneval.expected import expected_strict
from ddpo_group.rewards.geneval.metadata import GenEvalFormatError, check_record, check_vocabulary, read_metadata
from ddpo_group.rewards.geneval.protocol import (
    COUNTING_THRESHOLD,
    MAX_OBJECTS,
    POSITION_MARGIN,
    THRESHOLD,
    GenEvalScorer,
)

SCORES = ("partial", "strict", "correct", "expected")
# each score's key in the reward's info (the reward of an image is info[INFO_KEYS[score]])
INFO_KEYS = {"partial": "partial_score", "strict": "strict_correct", "correct": "correct",
             "expected": "expected_strict"}


def records_of(prompts, metadata) -> list[dict]:
    """The checked GenEval record of each prompt: {"prompt": prompt, **its metadata}; one-line error otherwise."""
    records = []
    for i, prompt in enumerate(prompts):
        meta = metadata[i] if metadata is not None and i < len(metadata) and metadata[i] else {}
        try:
            records.append(check_record({**meta, "prompt": prompt}, f"prompt {i} {prompt!r}"))
        except GenEvalFormatError as err:
            raise GenEvalFormatError(f"reward 'geneval': {err} (its prompt record carries no GenEval metadata; use "
                                     "GenEval's evaluation_metadata.jsonl or ddpo_group.rewards.geneval.metadata:"
                                     "training_prompts as the prompt source)") from None
    return records


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_options(options: dict, protocol: bool = False) -> None:
    """ValueError (one line) for a numeric option of the reward outside its range (module docstring); it names
    the config field reward_kwargs.geneval.FIELD, or with `protocol` the option --protocol-option FIELD=VALUE.
    Options not given keep their defaults, which pass."""

    def where(field):
        return f"--protocol-option {field}=VALUE" if protocol else f"config: reward_kwargs.geneval.{field}"

    for field in ("threshold", "counting_threshold"):
        if field in options:
            value = options[field]
            if not (_is_number(value) and math.isfinite(value) and 0 <= value < 1):
                raise ValueError(f"reward 'geneval': {field}={value!r} must be a detection score in [0, 1) "
                                 f"(GenEval: {THRESHOLDS[field]}; a fraction, not a percentage) ({where(field)})")
    if "max_objects" in options:
        value = options["max_objects"]
        if not (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 1):
            raise ValueError(f"reward 'geneval': max_objects={value!r} must be a whole number >= 1 (GenEval: "
                             f"{MAX_OBJECTS} detections kept per class) ({where('max_objects')})")
    if "position_margin" in options:
        value = options["position_margin"]
        if not (_is_number(value) and math.isfinite(value) and value >= 0):
            raise ValueError(f"reward 'geneval': position_margin={value!r} must be a finite number >= 0 (GenEval: "
                             f"{POSITION_MARGIN}, a fraction of the boxes' sizes) ({where('position_margin')})")
    if "jpeg_quality" in options:
        value = options["jpeg_quality"]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 100:
            raise ValueError(f"reward 'geneval': jpeg_quality={value!r} must be 0 (no JPEG) or 1..100 "
                             f"(Flow-GRPO: 75) ({where('jpeg_quality')})")


THRESHOLDS = {"threshold": THRESHOLD, "counting_threshold": COUNTING_THRESHOLD}


def jpeg_roundtrip(images: np.ndarray, quality: int) -> np.ndarray:
    """uint8 (B, H, W, 3) encoded as JPEG at `quality` with PIL and decoded again."""
    out = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
        out.append(np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")))
    return np.stack(out)


@register_reward("geneval")
class GenEvalReward:
    """GenEval reward (module docstring): (B, 3, H, W) in [0, 1] -> (float64 (B,), info)."""

    check_options = staticmethod(check_options)  # the protocol finds it through the registry

    def __init__(self, score: str = "partial", detector: str = "mask2former", detector_model: str = MASK2FORMER_MODEL,
                 clip_model: str = CLIP_MODEL, clip_tokenizer=None, threshold: float = THRESHOLD,
                 counting_threshold: float = COUNTING_THRESHOLD, max_objects: int = MAX_OBJECTS,
                 position_margin: float = POSITION_MARGIN, jpeg_quality: int = 0, device=None):
        if score not in SCORES:
            raise ValueError(f"reward 'geneval': score={score!r} is not one of {list(SCORES)} "
                             "(config: reward_kwargs.geneval.score)")
        check_options({"threshold": threshold, "counting_threshold": counting_threshold, "max_objects": max_objects,
                       "position_margin": position_margin, "jpeg_quality": jpeg_quality})
        self.score_name = score
        self.jpeg_quality = jpeg_quality
        found, colors = build_detector(detector, detector_model, clip_model, clip_tokenizer, device=device)
        self.scorer = GenEvalScorer(found, colors, threshold, counting_threshold, max_objects, position_margin,
                                    expected=expected_strict if score == "expected" else None)

    @classmethod
    def check_prompts(cls, prompts, source: str = "", **_) -> None:
        """ValueError naming the file and line (a .jsonl prompt file, read by ``metadata.read_metadata``) or the
        prompt of the first record that is not a GenEval record (an unknown tag, a missing 'include', ...); run by
        the config check before any model loads. `prompts`: PromptRecords."""
        if source.endswith(".jsonl") and os.path.isfile(source):
            try:
                read_metadata(source)
            except GenEvalFormatError as err:
                raise ValueError(f"reward 'geneval': {err}") from None
            return
        records_of([getattr(r, "prompt", r) for r in prompts], [getattr(r, "metadata", {}) for r in prompts])

    def check_ready(self) -> None:
        for part in (self.scorer.detector, self.scorer.color_classifier):
            if hasattr(part, "check_ready"):
                part.check_ready()

    def results(self, images, prompts, metadata) -> list[dict]:
        """The protocol's per-image result dicts (protocol.GenEvalScorer.score) of a reward batch."""
        records = records_of(prompts, metadata)
        check_vocabulary(records, self.scorer.detector.classes, self.scorer.color_classifier.colors, "reward 'geneval'")
        pixels = to_uint8_images(torch.as_tensor(images))
        if self.jpeg_quality:
            pixels = jpeg_roundtrip(pixels, self.jpeg_quality)
        return self.scorer.score(pixels, records)

    def __call__(self, images, prompts, metadata):
        try:
            results = self.results(images, prompts, metadata)
        except GenEvalFormatError as err:
            raise RewardError(str(err), reward="geneval") from None
        info = {
            "partial_score": np.array([r["partial_score"] for r in results], dtype=np.float64),
            "strict_correct": np.array([r["strict_correct"] for r in results], dtype=np.float64),
            "correct": np.array([r["correct"] for r in results], dtype=np.float64),
        }
        if self.score_name == "expected":
            info["expected_strict"] = np.array([r["expected_strict"] for r in results], dtype=np.float64)
        return info[INFO_KEYS[self.score_name]].copy(), info
