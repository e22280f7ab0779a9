"""CLIP helpers shared by the CLIP-based rewards: torch preprocessing and feature extraction.

Preprocessing follows CLIPImageProcessor (resize the shortest side to S with bicubic
interpolation, center crop S x S, normalize with the OpenAI CLIP mean / std) but runs in
torch on the (B, 3, H, W) float batch, without PIL or torchvision. transformers is
imported only when a model is loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddpo_group.rewards.base import RewardNotReadyError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def clip_preprocess(images: torch.Tensor, size: int, mean=CLIP_MEAN, std=CLIP_STD) -> torch.Tensor:
    """CLIP pixel values from images in [0, 1].

    images (B, 3, H, W) -> resize so that min(H, W) = size (bicubic, antialiased), clamp to
    [0, 1], center crop (size, size), then (x - mean_c) / std_c per channel -> (B, 3, size, size).
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape (B, 3, H, W), got {tuple(images.shape)}")
    images = images.float()
    height, width = images.shape[-2:]
    if min(height, width) != size:
        scale = size / min(height, width)
        new_size = (max(size, round(height * scale)), max(size, round(width * scale)))
        images = F.interpolate(images, size=new_size, mode="bicubic", antialias=True, align_corners=False)
        images = images.clamp(0, 1)
        height, width = new_size
    top, left = (height - size) // 2, (width - size) // 2
    images = images[:, :, top : top + size, left : left + size]
    mean = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    return (images - mean) / std


def _features(output) -> torch.Tensor:
    # transformers < 5 returns the projected embeddings as a tensor; transformers 5 returns a
    # BaseModelOutputWithPooling whose pooler_output holds them.
    if isinstance(output, torch.Tensor):
        return output
    for name in ("image_embeds", "text_embeds", "pooler_output"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    raise TypeError(f"cannot find embeddings in {type(output).__name__}")


def image_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """Projected CLIP image embeddings (B, D) of `model.get_image_features`, not normalized."""
    return _features(model.get_image_features(pixel_values=pixel_values))


def text_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Projected CLIP text embeddings (B, D) of `model.get_text_features`, not normalized."""
    return _features(model.get_text_features(input_ids=input_ids, attention_mask=attention_mask))


def load_clip_model(model, reward: str, field: str = "clip_model", model_class: str = "CLIPModel"):
    """`model` if it is already a module, else `transformers.<model_class>.from_pretrained(model)`.

    A missing model raises RewardNotReadyError with the download command and the field to set.
    """
    if isinstance(model, torch.nn.Module):
        return model
    import transformers

    check_reward_hub(model, reward, field)
    try:
        return getattr(transformers, model_class).from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise RewardNotReadyError(
            f"reward {reward!r}: cannot load {model_class} {model!r} ({exc}). Download it with "
            f"`huggingface-cli download {model}` (or `hf download {model}`) while online, or set "
            f"the reward's keyword argument {field}=/path/to/local/dir "
            f"(config: reward_kwargs.{reward}.{field})",
            reward=reward,
        ) from exc


def check_reward_hub(spec, reward: str, field: str) -> None:
    """Before a reward loads hub id `spec` (its keyword argument `field`): a hub that never answers is
    RewardNotReadyError in one line (``hub.check_hub``), not minutes of huggingface_hub's retries."""
    from ddpo_group.diffusion.hub import HubUnreachableError, check_hub

    try:
        check_hub(spec, f"reward_kwargs.{reward}.{field}")
    except HubUnreachableError as exc:
        raise RewardNotReadyError(str(exc), reward=reward) from None


def _from_pretrained(source, loader: str, what: str, reward: str, field: str):
    """`source` if it is already a loaded object, else `transformers.<loader>.from_pretrained(source)`; a source that
    cannot be loaded is RewardNotReadyError naming the reward's keyword argument `field`."""
    if not isinstance(source, str):
        return source
    import transformers

    check_reward_hub(source, reward, field)
    try:
        return getattr(transformers, loader).from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise RewardNotReadyError(
            f"reward {reward!r}: cannot load {what} {source!r} ({exc}). Download it with "
            f"`huggingface-cli download {source}` while online, or set the reward's keyword "
            f"argument {field}=/path/to/local/dir (config: reward_kwargs.{reward}.{field})",
            reward=reward,
        ) from exc


def load_tokenizer(tokenizer, reward: str, field: str = "tokenizer"):
    """`tokenizer` if it is already a tokenizer object, else `AutoTokenizer.from_pretrained(tokenizer)`."""
    return _from_pretrained(tokenizer, "AutoTokenizer", "tokenizer", reward, field)


def load_image_processor(processor, reward: str, field: str = "image_processor"):
    """`processor` if it is already an image processor object, else `CLIPImageProcessor.from_pretrained(processor)`."""
    return _from_pretrained(processor, "CLIPImageProcessor", "the CLIP image processor", reward, field)
