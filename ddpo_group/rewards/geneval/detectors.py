"""The detector and colour-classifier interface of GenEval, and its transformers implementations.

    detector.classes                      the class names it finds (GenEval's vocabulary), or None before loading
    detector.check_ready()                loads the model; RewardNotReadyError (one line) if it cannot
    detector.detect(images)               uint8 (B, H, W, 3) -> B dicts {class: [protocol.Detection]}
    classifier.colors                     the colour names it can answer
    classifier.check_ready()
    classifier.classify(image, detections, classname) -> one colour name per detection

``Mask2FormerDetector``: ``transformers.Mask2FormerForUniversalSegmentation`` (default
facebook/mask2former-swin-small-coco-instance, the architecture of GenEval's mmdetection checkpoint
mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco), post-processed as mmdetection's Mask2Former does for
instances: p = softmax(class logits) without the "no object" column, shape (Q, C); the top 100 (query, class)
pairs of p; each pair's mask = its query's mask logits upsampled to the processed input, cropped to the
unpadded image and resized (bilinear) to the original size, binary where logit > 0; score = p x (mean
sigmoid of the mask inside the binary mask); box = the binary mask's extent (x1, y1, x2 + 1, y2 + 1).

``ClipColorClassifier``: zero-shot CLIP (default openai/clip-vit-large-patch14, GenEval's ViT-L/14 with OpenAI
weights) over GenEval's ten colours; a colour's text embedding is the normalised mean of the normalised
embeddings of its three templates ("a photo of a {c} {class}", "a photo of a {c}-colored {class}", "a photo
of a {c} object"); the image is the object's mask composited onto flat grey #999 and cropped to its box
(rounded to whole pixels, as PIL's crop), then CLIP's preprocessing; the colour with the highest cosine wins.

docs/geneval.md says where these can differ from GenEval's own mmdetection / open_clip pipeline.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch
import torch.nn.functional as F

from ddpo_group.rewards.base import RewardNotReadyError
from ddpo_group.rewards.clip_models import clip_preprocess, image_features, load_clip_model, load_tokenizer, text_features
from ddpo_group.rewards.geneval.protocol import Detection
from ddpo_group.rewards.geneval.vocabulary import COCO_CLASSES, COLOR_TEMPLATES, COLORS, geneval_class_name

MASK2FORMER_MODEL = "facebook/mask2former-swin-small-coco-instance"
CLIP_MODEL = "openai/clip-vit-large-patch14"
GREY = (0x99, 0x99, 0x99)
MAX_PER_IMAGE = 100


def _require(module: str, extra: str = "geneval"):
    try:
        return __import__(module)
    except ImportError as exc:
        raise RewardNotReadyError(f"reward 'geneval' needs the package {module!r} ({exc}); install it with: "
                                  f"pip install 'ddpo-group[{extra}]'", reward="geneval") from exc


def _missing_local_path(spec) -> bool:
    """A model given as a local path (absolute, ./ or ../, or ~) that does not exist."""
    return isinstance(spec, str) and spec.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(spec))


def check_model_path(spec, field: str) -> None:
    """RewardNotReadyError naming `field` when `spec` is a local path that does not exist (before any loading)."""
    if _missing_local_path(spec):
        raise RewardNotReadyError(f"reward 'geneval': {field}={spec!r} does not exist; give a local copy of the model "
                                  f"or its hub id (config: reward_kwargs.geneval.{field})", reward="geneval")


class Mask2FormerDetector:
    """GenEval's instance-segmentation detector through transformers (module docstring)."""

    def __init__(self, model=MASK2FORMER_MODEL, processor=None, device=None, dtype=torch.float32,
                 max_per_image: int = MAX_PER_IMAGE, batch_size: int = 8):
        check_model_path(model if isinstance(model, str) else None, "detector_model")
        self.model_spec = model
        self.processor_spec = processor
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.max_per_image = max_per_image
        self.batch_size = batch_size
        self.model = None
        self.processor = None
        self.labels: tuple[str, ...] = ()
        self._lock = threading.Lock()

    @property
    def classes(self):
        """GenEval names of the model's labels; COCO's 80 before the model is loaded."""
        return self.labels or COCO_CLASSES

    def check_ready(self) -> None:
        with self._lock:
            if self.model is not None:
                return
            transformers = _require("transformers")
            _require("scipy")  # transformers' Mask2Former module needs it to build the model
            model = self.model_spec
            processor = self.processor_spec if self.processor_spec is not None else self.model_spec
            if not isinstance(processor, (str, os.PathLike)) and not callable(processor):
                raise ValueError("Mask2FormerDetector: a model given as an object needs processor= (an image "
                                 "processor or the path of its preprocessor_config.json's directory)")
            from ddpo_group.rewards.clip_models import check_reward_hub

            # the hub asked once per distinct id (the reward's processor is its detector_model's)
            for spec in dict.fromkeys(spec for spec in (model, processor) if isinstance(spec, str)):
                check_reward_hub(spec, "geneval", "detector_model")
            try:
                if isinstance(model, (str, os.PathLike)):
                    model = transformers.Mask2FormerForUniversalSegmentation.from_pretrained(model)
                if isinstance(processor, (str, os.PathLike)):
                    processor = _load_processor(transformers, processor)
            except (OSError, ValueError) as exc:
                raise RewardNotReadyError(
                    f"reward 'geneval': cannot load the Mask2Former detector {self.model_spec!r} ({' '.join(str(exc).split())[:200]}); "
                    f"download it with `hf download {MASK2FORMER_MODEL}` while online, or set "
                    "reward_kwargs.geneval.detector_model=/path/to/local/dir", reward="geneval") from exc
            self.labels = tuple(geneval_class_name(model.config.id2label[i]) for i in range(model.config.num_labels))
            self.processor = processor
            self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def detect(self, images) -> list[dict]:
        self.check_ready()
        images = np.asarray(images)
        results = []
        for start in range(0, len(images), self.batch_size):
            chunk = images[start : start + self.batch_size]
            inputs = self.processor(images=list(chunk), return_tensors="pt")
            outputs = self.model(pixel_values=inputs["pixel_values"].to(self.device, self.dtype))
            pixel_mask = inputs.get("pixel_mask")
            for k, image in enumerate(chunk):
                valid = (int(pixel_mask[k].any(dim=1).sum()), int(pixel_mask[k].any(dim=0).sum())) if pixel_mask is not None \
                    else tuple(inputs["pixel_values"].shape[-2:])
                results.append(self._instances(outputs.class_queries_logits[k].float(),
                                               outputs.masks_queries_logits[k].float(),
                                               tuple(inputs["pixel_values"].shape[-2:]), valid, image.shape[:2]))
        return results

    def _instances(self, class_logits, mask_logits, padded, valid, original) -> dict:
        """mmdetection's instance post-processing of one image (module docstring): {class: [Detection]}."""
        probs = class_logits.softmax(dim=-1)[:, :-1]  # (Q, C): the last column is "no object"
        num_classes = probs.shape[1]
        scores, flat = probs.flatten().topk(min(self.max_per_image, probs.numel()))
        queries, labels = flat // num_classes, flat % num_classes
        masks = F.interpolate(mask_logits[queries][None], size=padded, mode="bilinear", align_corners=False)
        masks = masks[:, :, : valid[0], : valid[1]]
        masks = F.interpolate(masks, size=original, mode="bilinear", align_corners=False)[0]
        binary = masks > 0
        mask_scores = (masks.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
        scores = (scores * mask_scores).cpu().numpy()
        binary = binary.cpu().numpy()
        found: dict[str, list] = {}
        for label, score, mask in zip(labels.tolist(), scores, binary):
            ys, xs = np.nonzero(mask)
            box = (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)) if len(xs) else (0.0,) * 4
            found.setdefault(self.labels[label], []).append(Detection(box, float(score), mask))
        return found


def _load_processor(transformers, spec):
    """Mask2Former's image processor; its PIL implementation where torchvision is missing (the project never
    installs torchvision)."""
    processor_class = getattr(transformers, "Mask2FormerImageProcessorPil", None)
    if processor_class is None:
        processor_class = transformers.Mask2FormerImageProcessor
    return processor_class.from_pretrained(spec)


class ClipColorClassifier:
    """GenEval's zero-shot CLIP colour classifier (module docstring)."""

    def __init__(self, clip_model=CLIP_MODEL, tokenizer=None, device=None, dtype=torch.float32,
                 colors=COLORS, templates=COLOR_TEMPLATES, background=GREY):
        check_model_path(clip_model if isinstance(clip_model, str) else None, "clip_model")
        self.model_spec = clip_model
        self.tokenizer_spec = tokenizer if tokenizer is not None else clip_model
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.colors = tuple(colors)
        self.templates = tuple(templates)
        self.background = np.asarray(background, dtype=np.uint8)
        self.model = None
        self.tokenizer = None
        self._text: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def check_ready(self) -> None:
        with self._lock:
            if self.model is not None:
                return
            _require("transformers")
            tokenizer = load_tokenizer(self.tokenizer_spec, reward="geneval", field="clip_model")
            model = load_clip_model(self.model_spec, reward="geneval", field="clip_model")
            self.tokenizer = tokenizer
            self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def color_embeddings(self, classname: str) -> torch.Tensor:
        """(len(colors), D): per colour the normalised mean of its templates' normalised text embeddings."""
        if classname not in self._text:
            texts = [t.format(c=color, cls=classname) for color in self.colors for t in self.templates]
            tokens = self.tokenizer(texts, padding="max_length", truncation=True, return_tensors="pt",
                                    max_length=self.model.config.text_config.max_position_embeddings).to(self.device)
            embeds = text_features(self.model, tokens["input_ids"], tokens.get("attention_mask")).float()
            embeds = F.normalize(embeds, dim=-1).view(len(self.colors), len(self.templates), -1).mean(dim=1)
            self._text[classname] = F.normalize(embeds, dim=-1)
        return self._text[classname]

    def crop(self, image: np.ndarray, detection: Detection) -> np.ndarray:
        """The object's mask over flat grey, cropped to its box rounded to whole pixels: uint8 (h, w, 3)."""
        image = np.asarray(image)
        if detection.mask is not None:
            image = np.where(np.asarray(detection.mask, dtype=bool)[..., None], image, self.background)
        x1, y1, x2, y2 = (int(round(v)) for v in detection.box[:4])
        crop = image[max(y1, 0) : max(y2, y1 + 1), max(x1, 0) : max(x2, x1 + 1)]
        return crop if crop.size else image

    @torch.no_grad()
    def classify(self, image, detections, classname) -> list[str]:
        self.check_ready()
        if not detections:
            return []
        size = self.model.config.vision_config.image_size
        pixels = torch.cat([clip_preprocess(torch.from_numpy(self.crop(image, d)).permute(2, 0, 1)[None].float() / 255, size)
                            for d in detections])
        embeds = F.normalize(image_features(self.model, pixels.to(self.device, self.dtype)).float(), dim=-1)
        best = (embeds @ self.color_embeddings(classname).T).argmax(dim=1)
        return [self.colors[i] for i in best.tolist()]


def build_detector(detector: str = "mask2former", detector_model=MASK2FORMER_MODEL, clip_model=CLIP_MODEL,
                   clip_tokenizer=None, device=None, dtype=torch.float32):
    """(detector, colour classifier) by name: "mask2former" (transformers Mask2Former + CLIP), or "shapes" (the
    exact shapes-world pair, ``shapes_scenes``). Nothing is loaded here (``check_ready`` does)."""
    if detector == "mask2former":
        return (Mask2FormerDetector(detector_model, device=device, dtype=dtype),
                ClipColorClassifier(clip_model, clip_tokenizer, device=device, dtype=dtype))
    if detector == "shapes":
        from ddpo_group.rewards.geneval.shapes_scenes import ShapesColorClassifier, ShapesDetector

        return ShapesDetector(), ShapesColorClassifier()
    raise ValueError(f"reward 'geneval': detector={detector!r} is not one of 'mask2former', 'shapes' "
                     "(config: reward_kwargs.geneval.detector)")
