"""Optional reward models, loaded lazily: clip_score, pickscore, pickscore_rank, imagereward, hpsv2, hpsv3.

Nothing heavy is imported until `check_ready()` (called by `CombinedReward.check_ready()`
before sampling, or on first use). A missing package or missing weights raise
RewardNotReadyError with the exact `pip install` command or the keyword argument
(config: `reward_kwargs.<name>.<field>`) to set.

- clip_score: cosine similarity of CLIP image and text embeddings, in [-1, 1]
  (model: `clip_model`, default openai/clip-vit-large-patch14).
- pickscore: PickScore_v1, r = exp(logit_scale) * cos(image, text) / divisor (~ 18..24 for real images with
  the default divisor 1; Flow-GRPO and Flow-Factory divide by 26: divisor=26, ~ 0.7..0.92)
  (model: `model`, default yuvalkirstain/PickScore_v1; tokenizer: `tokenizer`, default
  laion/CLIP-ViT-H-14-laion2B-s32B-b79K; preprocess: "torch" resizes the float images in torch,
  "processor" runs the checkpoint's CLIPImageProcessor on uint8 PIL images, as Flow-GRPO does).
- pickscore_rank (group-wise): Flow-Factory's PickScore_Rank, r_i = rank_i / G within the prompt group of G
  images, rank 0 for the lowest PickScore up to G - 1 for the highest (ties: the mean of their ranks).
- imagereward: ImageReward-v1.0 through the `image-reward` package (`model`: name or checkpoint path).
- hpsv2: Human Preference Score v2 through the `hpsv2` package (`hps_version`, `checkpoint`).
- hpsv3: HPSv3 (Qwen2-VL-7B reward model) through the `hpsv3` package: r = the mean mu of its (mu, sigma)
  output (`checkpoint_path`, `config_path`).
"""

from __future__ import annotations

import importlib
import os
import threading

import numpy as np
import torch

from ddpo_group.rewards.base import RewardNotReadyError, register_reward, to_pil_images
from ddpo_group.rewards.clip_models import (
    clip_preprocess,
    image_features,
    load_clip_model,
    load_image_processor,
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

    def __init__(self, model, tokenizer, device=None, dtype=torch.float32, preprocess="torch", image_processor=None):
        if preprocess not in ("torch", "processor"):
            raise ValueError(f"reward {self.name!r}: preprocess must be 'torch' or 'processor', got {preprocess!r} "
                             f"(config: reward_kwargs.{self.name}.preprocess)")
        self.model_spec = model
        self.tokenizer_spec = tokenizer
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.preprocess = preprocess
        # "processor": the checkpoint's CLIPImageProcessor (default: the tokenizer's directory, where Flow-GRPO's
        # AutoProcessor reads it), or an image processor object
        self.image_processor_spec = image_processor if image_processor is not None else tokenizer
        self.image_processor = None
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
            if self.preprocess == "processor":
                self.image_processor = load_image_processor(self.image_processor_spec, self.name)
            self.tokenizer = tokenizer
            self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)

    def pixel_values(self, images) -> torch.Tensor:
        """(B, 3, S, S) CLIP inputs: torch preprocessing of the float images, or the image processor on uint8 PIL."""
        if self.preprocess == "processor":
            pixels = self.image_processor(images=to_pil_images(images), return_tensors="pt")["pixel_values"]
            return pixels.to(self.device, self.dtype)
        images = torch.as_tensor(images).to(self.device)
        return clip_preprocess(images, self.model.config.vision_config.image_size).to(self.dtype)

    @torch.no_grad()
    def scores(self, images, prompts) -> torch.Tensor:
        """(B,) float32 on the CPU: scale * cos(image, prompt)."""
        self.check_ready()
        pixel_values = self.pixel_values(images)
        image_embeds = image_features(self.model, pixel_values)
        tokens = self.tokenizer(
            list(prompts), padding="max_length", truncation=True,
            max_length=self.model.config.text_config.max_position_embeddings, return_tensors="pt",
        ).to(self.device)
        text_embeds = text_features(self.model, tokens["input_ids"], tokens.get("attention_mask"))
        image_embeds = image_embeds / torch.linalg.vector_norm(image_embeds, dim=-1, keepdim=True)
        text_embeds = text_embeds / torch.linalg.vector_norm(text_embeds, dim=-1, keepdim=True)
        cosine = (image_embeds * text_embeds).sum(dim=-1)
        return (self.logit_scale() * cosine).float().cpu()

    def __call__(self, images, prompts, metadata):
        return self.scores(images, prompts), {}


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
    """r = exp(logit_scale) * cos(image, prompt) / divisor with the PickScore_v1 CLIP-H model.

    divisor=26 with preprocess="processor" is Flow-GRPO's value (yifan123/flow_grpo, flow_grpo/pickscore_scorer.py:
    the image processor on PIL images, exp(logit_scale) * cosine, then / 26, "norm to 0-1"); the default
    (divisor 1, torch preprocessing of the float images) is PickScore's own scale, ~ 26x larger, and its resize
    differs from the processor's PIL resize by rounding-level amounts (docs/group_rewards.md, "PickScore's scale").
    """

    name = "pickscore"

    def __init__(self, model="yuvalkirstain/PickScore_v1", tokenizer="laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
                 device=None, dtype=torch.float32, divisor=1.0, preprocess="torch", image_processor=None):
        super().__init__(model, tokenizer, device, dtype, preprocess, image_processor)
        if not (isinstance(divisor, (int, float)) and np.isfinite(divisor) and divisor > 0):
            raise ValueError(f"reward {self.name!r}: divisor must be a positive number (Flow-GRPO's: 26), got "
                             f"{divisor!r} (config: reward_kwargs.{self.name}.divisor)")
        self.divisor = float(divisor)

    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.exp() / self.divisor


RANK_TIES = ("average", "ordinal")


def group_ranks(scores, ties: str = "average") -> np.ndarray:
    """Within-group ranks of `scores` (G,): 0 for the lowest up to G - 1 for the highest, float64.

    ties="average": tied scores share the mean of the ranks they span, rank_i = #{j: s_j < s_i} +
    (#{j: s_j = s_i} - 1) / 2, so the ranks do not depend on the members' order. ties="ordinal": distinct ranks,
    tied scores in the order of their position (a stable sort; Flow-Factory's argsort().argsort() orders ties
    arbitrarily).
    """
    scores = np.asarray(scores, dtype=np.float64)
    if ties not in RANK_TIES:
        raise ValueError(f"ties must be one of {RANK_TIES}, got {ties!r}")
    if ties == "ordinal":
        ranks = np.empty(len(scores))
        ranks[np.argsort(scores, kind="stable")] = np.arange(len(scores))
        return ranks
    below = (scores[None, :] < scores[:, None]).sum(axis=1)
    equal = (scores[None, :] == scores[:, None]).sum(axis=1)
    return below + (equal - 1) / 2


@register_reward("pickscore_rank", device_tensors=True, group_wise=True)
class PickScoreRankReward(PickScoreReward):
    """Group-wise: r_i = rank_i / G, the within-group rank of image i's PickScore among the G images of its prompt
    group (0 for the lowest, (G - 1) / G for the highest), as X-GenGroup/Flow-Factory's PickScore_Rank
    (src/flow_factory/rewards/pick_score.py: ranks = scores.argsort().argsort(), rewards = ranks / group size).

    ties: "average" (default: tied images share the mean of their ranks, independent of the members' order) or
    "ordinal" (see `group_ranks`). Logged info: the group's raw PickScore mean (info key "pickscore").
    The other keywords are pickscore's (the divisor does not change a rank).
    """

    name = "pickscore_rank"

    def __init__(self, model="yuvalkirstain/PickScore_v1", tokenizer="laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
                 device=None, dtype=torch.float32, divisor=1.0, preprocess="torch", image_processor=None,
                 ties="average"):
        super().__init__(model, tokenizer, device, dtype, divisor, preprocess, image_processor)
        if ties not in RANK_TIES:
            raise ValueError(f"reward 'pickscore_rank': ties must be one of {RANK_TIES}, got {ties!r} "
                             "(config: reward_kwargs.pickscore_rank.ties)")
        self.ties = ties

    def __call__(self, images, prompts, metadata):
        scores = self.scores(images, prompts).double().cpu().numpy()
        return group_ranks(scores, self.ties) / len(scores), {"pickscore": scores}


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


@register_reward("hpsv3", device_tensors=True)
class HPSv3Reward:
    """r = HPSv3's preference score of (prompt, image): the mean mu of the (mu, sigma) its Qwen2-VL-7B reward model
    returns (the `hpsv3` package, MizzenAI/HPSv3: HPSv3RewardInferencer(config_path, checkpoint_path, device)
    .reward(images, prompts) -> (B, 2) rows (mu, sigma); its inference.py scores with mu).

    checkpoint_path: HPSv3.safetensors (None: the package downloads MizzenAI/HPSv3 from the hub, which needs the
    network); config_path: the package's model config (None: its HPSv3_7B.yaml, whose base model
    Qwen/Qwen2-VL-7B-Instruct loads from the hub cache). inferencer: an already-built object with the same
    `.reward(pil_images, prompts)` method (a test's stand-in, or one shared between rewards).
    """

    HUB_REPO, HUB_FILE = "MizzenAI/HPSv3", "HPSv3.safetensors"

    def __init__(self, checkpoint_path=None, config_path=None, device=None, inferencer=None):
        self.checkpoint_path = checkpoint_path
        self.config_path = config_path
        self.device = str(device) if device is not None else "cpu"
        self.inferencer = inferencer
        self._lock = threading.Lock()

    def check_ready(self) -> None:
        """Import the package and check the files named before loading the 7B model; then load it."""
        with self._lock:
            if self.inferencer is not None:
                return
            hpsv3 = require_package("hpsv3", "hpsv3", "hpsv3")
            for field, path in (("checkpoint_path", self.checkpoint_path), ("config_path", self.config_path)):
                if path is not None and not os.path.isfile(path):
                    raise RewardNotReadyError(
                        f"reward 'hpsv3': {field}={path!r} is not a file; download the checkpoint with "
                        f"`huggingface-cli download {self.HUB_REPO} {self.HUB_FILE}` and set "
                        f"reward_kwargs.hpsv3.{field}=/path/to/it", reward="hpsv3")
            try:
                self.inferencer = hpsv3.HPSv3RewardInferencer(
                    config_path=self.config_path, checkpoint_path=self.checkpoint_path, device=self.device)
            except Exception as exc:  # the hub download or the base model's loading, both need the network
                raise RewardNotReadyError(
                    f"reward 'hpsv3': cannot load HPSv3 ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}). "
                    f"While online, `huggingface-cli download {self.HUB_REPO} {self.HUB_FILE}` and "
                    "`huggingface-cli download Qwen/Qwen2-VL-7B-Instruct`, then set "
                    "reward_kwargs.hpsv3.checkpoint_path=/path/to/HPSv3.safetensors", reward="hpsv3") from exc

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        self.check_ready()
        output = torch.as_tensor(self.inferencer.reward(to_pil_images(images), list(prompts)))
        if output.ndim != 2 or output.shape[0] != len(prompts):
            raise ValueError(f"HPSv3 returned shape {tuple(output.shape)}; expected ({len(prompts)}, 2): (mu, sigma)")
        return output[:, 0].float().cpu(), {"sigma": output[:, 1].float().cpu()} if output.shape[1] > 1 else {}
