"""Optional reward models, loaded lazily: clip_score, pickscore, imagereward, hpsv2.

Nothing heavy is imported until `check_ready()` (called by `CombinedReward.check_ready()`
before sampling, or on first use). A missing package or missing weights raise
RewardNotReadyError with the exact `pip install` command or the keyword argument
(config: `reward_kwargs.<name>.<field>`) to set.

- clip_score: cosine similarity of CLIP image and text embeddings, in [-1, 1]
  (model: `clip_model`, default openai/clip-vit-large-patch14).
- pickscore: PickScore_v1, r = exp(logit_scale) * cos(image, text) (~ 18..24 for real images),
  (model: `model`, default yuvalkirstain/PickScore_v1; tokenizer: `tokenizer`, default
  laion/CLIP-ViT-H-14-laion2B-s32B-b79K).
- imagereward: ImageReward-v1.0 through the `image-reward` package (`model`: name or checkpoint path).
- hpsv2: Human Preference Score v2 through the `hpsv2` package (`hps_version`, `checkpoint`).
"""

from __future__ import annotations

import importlib
import threading

import numpy as np
import torch

from ddpo_group.rewards.base import RewardNotReadyError, register_reward, to_pil_images
from ddpo_group.rewards.clip_models import (
    clip_preprocess,
    image_features,
    load_clip_model,
    load_tokenizer,
    text_features,
)


def require_package(module: str, pip_name: str, reward: str):
    """Import `module`, or raise RewardNotReadyError saying `pip install <pip_name>`."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RewardNotReadyError(
            f"reward {reward!r} needs the Python package {pip_name!r} (import {module!r} failed: "
            f"{exc}). Install it with: pip install {pip_name}",
            reward=reward,
        ) from exc


class _ClipSimilarityReward:
    """r_i = scale * cos(f_img(x_i), f_txt(prompt_i)) for a CLIP-like dual encoder."""

    name = "clip_similarity"
    model_field = "model"

    def __init__(self, model, tokenizer, device=None, dtype=torch.float32):
        self.model_spec = model
        self.tokenizer_spec = tokenizer
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.model = None
        self.tokenizer = None
        self._lock = threading.Lock()

    def logit_scale(self) -> torch.Tensor:
        return torch.ones((), device=self.device)

    def check_ready(self) -> None:
        with self._lock:
            if self.model is not None:
                return
            require_package("transformers", "transformers", self.name)
            tokenizer = load_tokenizer(self.tokenizer_spec, reward=self.name)
            model = load_clip_model(self.model_spec, reward=self.name, field=self.model_field)
            self.tokenizer = tokenizer
            self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        self.check_ready()
        images = torch.as_tensor(images).to(self.device)
        pixel_values = clip_preprocess(images, self.model.config.vision_config.image_size).to(self.dtype)
        image_embeds = image_features(self.model, pixel_values)
        tokens = self.tokenizer(
            list(prompts), padding="max_length", truncation=True,
            max_length=self.model.config.text_config.max_position_embeddings, return_tensors="pt",
        ).to(self.device)
        text_embeds = text_features(self.model, tokens["input_ids"], tokens.get("attention_mask"))
        image_embeds = image_embeds / torch.linalg.vector_norm(image_embeds, dim=-1, keepdim=True)
        text_embeds = text_embeds / torch.linalg.vector_norm(text_embeds, dim=-1, keepdim=True)
        cosine = (image_embeds * text_embeds).sum(dim=-1)
        return (self.logit_scale() * cosine).float().cpu(), {}


@register_reward("clip_score", device_tensors=True)
class ClipScoreReward(_ClipSimilarityReward):
    """r = cos(CLIP image embedding, CLIP text embedding of the prompt), in [-1, 1]."""

    name = "clip_score"
    model_field = "clip_model"

    def __init__(self, clip_model="openai/clip-vit-large-patch14", tokenizer=None, device=None,
                 dtype=torch.float32):
        super().__init__(clip_model, tokenizer if tokenizer is not None else clip_model, device, dtype)


@register_reward("pickscore", device_tensors=True)
class PickScoreReward(_ClipSimilarityReward):
    """r = exp(logit_scale) * cos(image, prompt) with the PickScore_v1 CLIP-H model."""

    name = "pickscore"

    def __init__(self, model="yuvalkirstain/PickScore_v1",
                 tokenizer="laion/CLIP-ViT-H-14-laion2B-s32B-b79K", device=None, dtype=torch.float32):
        super().__init__(model, tokenizer, device, dtype)

    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.exp()


@register_reward("imagereward", device_tensors=True)
class ImageRewardReward:
    """r = ImageReward-v1.0 score of (prompt, image) (the `image-reward` package)."""

    def __init__(self, model: str = "ImageReward-v1.0", device=None):
        self.model_spec = model
        self.device = str(device) if device is not None else "cpu"
        self.model = None
        self._lock = threading.Lock()

    def check_ready(self) -> None:
        with self._lock:
            if self.model is not None:
                return
            image_reward = require_package("ImageReward", "image-reward", "imagereward")
            try:
                self.model = image_reward.load(self.model_spec, device=self.device)
            except Exception as exc:
                raise RewardNotReadyError(
                    f"reward 'imagereward': cannot load {self.model_spec!r} ({exc}). Run once online to "
                    f"download it, or set the reward's keyword argument model=/path/to/ImageReward.pt "
                    f"(config: reward_kwargs.imagereward.model)",
                    reward="imagereward",
                ) from exc

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        self.check_ready()
        scores = []
        for image, prompt in zip(to_pil_images(images), prompts):
            score = self.model.score(prompt, [image])
            scores.append(float(np.ravel(score)[0]))
        return np.array(scores, dtype=np.float64), {}


@register_reward("hpsv2", device_tensors=True)
class HPSv2Reward:
    """r = HPS v2 score of (prompt, image) (the `hpsv2` package)."""

    def __init__(self, hps_version: str = "v2.1", checkpoint: str | None = None):
        self.hps_version = hps_version
        self.checkpoint = checkpoint
        self.hpsv2 = None

    def check_ready(self) -> None:
        if self.hpsv2 is None:
            self.hpsv2 = require_package("hpsv2", "hpsv2", "hpsv2")

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        self.check_ready()
        scores = []
        for image, prompt in zip(to_pil_images(images), prompts):
            try:
                score = self.hpsv2.score([image], prompt, cp=self.checkpoint, hps_version=self.hps_version)
            except OSError as exc:
                raise RewardNotReadyError(
                    f"reward 'hpsv2': cannot load the HPS {self.hps_version} checkpoint ({exc}); set the "
                    f"reward's keyword argument checkpoint=/path/to/HPS_v2.1_compressed.pt "
                    f"(config: reward_kwargs.hpsv2.checkpoint)",
                    reward="hpsv2",
                ) from exc
            scores.append(float(np.ravel(score)[0]))
        return np.array(scores, dtype=np.float64), {}
