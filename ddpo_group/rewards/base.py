"""The base of ``ddpo_group.rewards``: the reward contract, its error types, the registry every reward
registers into, and the image conversions rewards share. Imports no reward (docs/architecture.md).

A reward is any callable

    fn(images, prompts, metadata) -> (rewards, info)

with `images` a float tensor (B, 3, H, W) in [0, 1], `prompts` a list of B strings,
`metadata` a list of B dicts (the extra fields of the prompt records), `rewards` a
sequence / array / tensor of shape (B,) of real numbers and `info` a dict of extra values
to log (its numbers are logged as reward_info/<reward>/<key> in metrics.jsonl).

`images` is the reward's own copy, float32 on the CPU, whatever the training device and
dtype (float64 images, from a caller of the reward's own, stay float64): converting it to
NumPy needs no device move, and editing it in place changes nothing else; its `prompts` list and
`metadata` dicts are its own copies too. A reward that
runs a model on the accelerator says so, `@register_reward("name", device_tensors=True)`
(or a `device_tensors = True` attribute): it gets a copy on the training device instead.
A reward returns or raises; it must not end the process: sys.exit / KeyboardInterrupt are caught and stop the
run with an error naming it, but os._exit (or a crash of native code) ends the run at once, with no
failed.json, no final checkpoint and whatever exit code it gave; such a run's directory has no finished.json.

Videos (a video family's samples, ``DiffusionPolicy.video``) are (B, F, 3, H, W) in [0, 1]. An image reward
never sees one: ``CombinedReward`` gives it `config.reward_frames` evenly spaced frames of every video
(`frame_indices`) as a batch of B * k images (each prompt and metadata dict repeated k times, frame-major
within a video) and the video's reward is the mean of its k frame rewards, what Flow-Factory and verl-omni do
for PickScore and OCR. A reward that scores whole clips (motion, temporal consistency) declares itself,
`@register_reward("name", video=True)` (or a `video = True` attribute), and receives the (B, F, 3, H, W)
videos; it cannot score an image model's samples (a config error naming the reward field).

A group-wise reward sees a whole prompt group and returns one value per member (a rank, a pairwise
preference): `@register_reward("name", group_wise=True)` (or a `group_wise = True` attribute). Its
signature is the same, but every call holds exactly one group: all the samples of the group and no
other (images (G, 3, H, W), G prompts, G metadata dicts), in the order of their sample index. In
training a group is every sample of the epoch with the same prompt id, the key the GRPO advantages
group by (sample.group_size images; a multiple when the prompt was drawn more than once), gathered
from every process first; in the evaluation it is the images_per_prompt images of one prompt;
called directly, a CombinedReward groups by the `groups` keys it is given (default: equal prompts).
`reward_batch_size` never splits a group. docs/group_rewards.md says how the rollout
forms groups across processes.

Image editing (FLUX.1 Kontext, Qwen-Image-Edit; docs/editing.md): a prompt record's ``source_image`` reaches the
reward as the image itself, so an edit reward compares before and after: ``metadata[i]["source_image"]`` is the
source the sample edited, a float32 CPU tensor (3, H, W) in [0, 1] of the images' size (the reward's own copy),
and ``metadata[i]["source_image_path"]`` the file it was read from (a remote reward receives the image as nested
lists, ``remote.py``). Several sources per prompt (Qwen-Image-Edit-2509 / 2511, the record's ``source_images``):
``metadata[i]["source_images"]`` is the list of the K source tensors and ``metadata[i]["source_image_paths"]`` their
files, ``source_image`` / ``source_image_path`` the first. Text-to-image prompts carry none of these.

Video with audio (LTX-2, family ``ltx2``; docs/next_families.md): ``metadata[i]["audio"]`` is the sample's
soundtrack, a float32 CPU tensor (channels, samples) in about [-1, 1] (the reward's own copy), and
``metadata[i]["audio_sample_rate"]`` its rate in Hz (int; 24000 for LTX-2's vocoder). Models without sound give
neither key (``with_audio``).

Built-in, optional and shapes-world rewards register here when their modules are imported;
``registry.py`` imports them all and resolves a spec string to a reward.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from PIL import Image

REWARD_REGISTRY: dict[str, Callable] = {}


def with_audio(metadata, audio, sample_rate) -> list:
    """The rewards' metadata of a family that makes sound: copies of the B `metadata` dicts with "audio" (the row of
    `audio` (B, channels, samples), a float32 CPU copy) and "audio_sample_rate"; `metadata` itself when audio is
    None (a model without sound)."""
    if audio is None:
        return list(metadata)
    audio = audio.detach().float().cpu()
    return [{**meta, "audio": audio[i].clone(), "audio_sample_rate": int(sample_rate)}
            for i, meta in enumerate(metadata)]


class RewardError(RuntimeError):
    """A reward failed or returned a bad value; names the reward, prompt and sample index.

    Attributes: `reward` (component name), `index` (sample index in the batch, or None when
    the failure concerns the whole batch), `prompt` (that sample's prompt, or None).
    """

    def __init__(self, message: str, reward: str | None = None, index: int | None = None,
                 prompt: str | None = None):
        super().__init__(message)
        self.reward = reward
        self.index = index
        self.prompt = prompt


class RewardNotReadyError(RewardError):
    """An optional reward cannot run: its package or weights are missing.

    Raised by `check_ready()` before any sampling; the message says the exact install
    command or the path / config field to set.
    """




def register_reward(name: str, device_tensors: bool = False, video: bool = False, group_wise: bool = False):
    """Decorator: register a reward function or class under `name`.

        @register_reward("my_reward")
        def my_reward(images, prompts, metadata):
            return images.mean(dim=(1, 2, 3)), {}

    device_tensors=True: the reward receives its images on the training device (module docstring).
    video=True: the reward scores videos (B, F, 3, H, W) as a whole (module docstring); it is never given images.
    group_wise=True: each call holds one whole prompt group (module docstring).

    Registering a different object under a taken name raises ValueError (re-registering
    the same function, e.g. when its module is imported twice, is allowed).
    """
    if not isinstance(name, str) or not name or ":" in name or name.startswith("http"):
        raise ValueError(
            f"register_reward: name must be a non-empty string without ':' that does not start "
            f"with 'http', got {name!r}"
        )

    def decorator(obj):
        old = REWARD_REGISTRY.get(name)
        if old is not None and old is not obj and _qualname(old) != _qualname(obj):
            raise ValueError(
                f"register_reward: the name {name!r} is already taken by {_qualname(old)}; "
                f"choose another name for {_qualname(obj)}"
            )
        if device_tensors:
            obj.device_tensors = True
        if video:
            obj.video = True
        if group_wise:
            obj.group_wise = True
        REWARD_REGISTRY[name] = obj
        return obj

    return decorator


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def wants_device_tensors(fn) -> bool:
    """Whether a reward (function, instance, or partial of one) asked for images on the training device."""
    return bool(getattr(fn, "device_tensors", False) or getattr(getattr(fn, "func", None), "device_tensors", False))


def is_video_reward(fn) -> bool:
    """Whether a reward (function, instance, or partial of one) scores whole videos (registered with video=True)."""
    return bool(getattr(fn, "video", False) or getattr(getattr(fn, "func", None), "video", False))


def frame_indices(num_frames: int, count: int) -> list[int]:
    """`count` evenly spaced frame indices of a video of `num_frames` frames: round(i (F - 1) / (k - 1)), i = 0..k-1
    (halves rounded up), so the first and the last frame are among them; the middle frame (F - 1) // 2 for k = 1;
    every frame for k = 0 or k >= F."""
    if num_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {num_frames}")
    if count == 0 or count >= num_frames:
        return list(range(num_frames))
    if count == 1:
        return [(num_frames - 1) // 2]
    return [(2 * i * (num_frames - 1) + count - 1) // (2 * (count - 1)) for i in range(count)]


def is_group_wise(fn) -> bool:
    """Whether a reward (function, instance, or partial of one) asked to be called on whole prompt groups."""
    return bool(getattr(fn, "group_wise", False) or getattr(getattr(fn, "func", None), "group_wise", False))


def to_uint8_images(images) -> np.ndarray:
    """(B, 3, H, W) float in [0, 1] -> (B, H, W, 3) uint8, as round(clamp(255 * x, 0, 255)).

    Accepts a torch tensor or a numpy array; this is the quantization ddpo-pytorch
    applies before any PIL-based reward.
    """
    images = torch.as_tensor(images)
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape (B, 3, H, W), got {tuple(images.shape)}")
    images = (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)
    return images.permute(0, 2, 3, 1).cpu().numpy()


def to_pil_images(images) -> list[Image.Image]:
    """(B, 3, H, W) float in [0, 1] -> list of B RGB PIL images (see `to_uint8_images`)."""
    return [Image.fromarray(image) for image in to_uint8_images(images)]
