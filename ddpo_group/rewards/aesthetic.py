"""LAION aesthetic score: CLIP ViT-L/14 image embedding -> linear-MSE MLP (DDPO's "aesthetic").

    e = f_CLIP(preprocess(q(x))) / ||f_CLIP(preprocess(q(x)))||_2,   r = MLP(e)

q quantizes to 8 bits (round(255 x) / 255, as ddpo-pytorch scores uint8 images),
preprocess is `clip_preprocess`, f_CLIP the projected image embedding, MLP the
improved-aesthetic-predictor head 768 -> 1024 -> 128 -> 64 -> 16 -> 1 (dropout 0.2, 0.2,
0.1, inactive at eval). Weights: `clip_model` (hub id or local dir, default
openai/clip-vit-large-patch14) and `mlp_weights` (a local .safetensors / .pth file, an
https URL cached under ~/.cache/ddpo_group, or "hf://owner/repo/filename").
"""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

from ddpo_group.rewards.base import RewardNotReadyError, register_reward
from ddpo_group.rewards.clip_models import clip_preprocess, image_features, load_clip_model

DEFAULT_CLIP_MODEL = "openai/clip-vit-large-patch14"
DEFAULT_MLP_WEIGHTS = (
    "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
    "sac+logos+ava1-l14-linearMSE.pth"
)
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ddpo_group")


class AestheticMLP(nn.Module):
    """The improved-aesthetic-predictor head: (B, input_dim) -> (B, 1).

    Layer names (layers.0, .2, .4, .6, .7) match the LAION checkpoint's state dict.
    """

    def __init__(self, input_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)


def _not_ready(message: str) -> RewardNotReadyError:
    return RewardNotReadyError(
        f"reward 'aesthetic': {message}. Download the LAION predictor with "
        f"`wget {DEFAULT_MLP_WEIGHTS}` and set the reward's keyword argument "
        f"mlp_weights=/path/to/sac+logos+ava1-l14-linearMSE.pth "
        f"(config: reward_kwargs.aesthetic.mlp_weights)",
        reward="aesthetic",
    )


def resolve_mlp_weights(mlp_weights: str) -> str:
    """Local path of `mlp_weights`: the path itself, a cached download of an https URL, or an
    hf_hub_download of "hf://owner/repo/filename"; RewardNotReadyError when unavailable."""
    if mlp_weights.startswith(("http://", "https://")):
        path = os.path.join(CACHE_DIR, os.path.basename(mlp_weights))
        if not os.path.isfile(path):
            os.makedirs(CACHE_DIR, exist_ok=True)
            try:
                torch.hub.download_url_to_file(mlp_weights, path, progress=False)
            except Exception as exc:  # offline, proxy, HTTP error: all mean "not available"
                raise _not_ready(f"cannot download {mlp_weights} ({exc})") from exc
        return path
    if mlp_weights.startswith("hf://"):
        repo_and_file = mlp_weights[len("hf://") :]
        repo_id, _, filename = repo_and_file.rpartition("/")
        try:
            from huggingface_hub import hf_hub_download

            return hf_hub_download(repo_id, filename)
        except Exception as exc:
            raise _not_ready(f"cannot fetch {filename!r} from the hub repo {repo_id!r} ({exc})") from exc
    if not os.path.isfile(mlp_weights):
        raise _not_ready(f"mlp_weights file {mlp_weights!r} does not exist")
    return mlp_weights


def load_mlp_state_dict(path: str) -> dict[str, torch.Tensor]:
    """State dict of an MLP checkpoint: safetensors for *.safetensors, else torch.load(weights_only=True)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


@register_reward("aesthetic", device_tensors=True)
class AestheticReward:
    """r = MLP(normalized CLIP image embedding); rewards (B,) float32, roughly 1..10 for LAION."""

    def __init__(self, clip_model=DEFAULT_CLIP_MODEL, mlp_weights: str = DEFAULT_MLP_WEIGHTS,
                 device=None, dtype: torch.dtype = torch.float32):
        self.clip_model = clip_model
        self.mlp_weights = mlp_weights
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.clip = None
        self.mlp = None
        self._lock = threading.Lock()

    def check_ready(self) -> None:
        """Load CLIP and the MLP (once); RewardNotReadyError says what to download or set."""
        with self._lock:
            if self.mlp is not None:
                return
            state_dict = load_mlp_state_dict(resolve_mlp_weights(self.mlp_weights))
            if "layers.0.weight" not in state_dict:
                raise _not_ready(f"{self.mlp_weights!r} is not an aesthetic MLP checkpoint (no layers.0.weight)")
            clip = load_clip_model(self.clip_model, reward="aesthetic")
            input_dim = state_dict["layers.0.weight"].shape[1]
            if input_dim != clip.config.projection_dim:
                raise _not_ready(
                    f"the MLP expects {input_dim}-dim embeddings but the CLIP model "
                    f"{self.clip_model!r} projects to {clip.config.projection_dim}"
                )
            mlp = AestheticMLP(input_dim)
            mlp.load_state_dict(state_dict)
            self.clip = clip.to(self.device, self.dtype).eval().requires_grad_(False)
            self.mlp = mlp.to(self.device, self.dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        self.check_ready()
        images = torch.as_tensor(images).to(self.device)
        images = (images.float() * 255).round().clamp(0, 255) / 255
        pixel_values = clip_preprocess(images, self.clip.config.vision_config.image_size).to(self.dtype)
        embeds = image_features(self.clip, pixel_values)
        embeds = embeds / torch.linalg.vector_norm(embeds, dim=-1, keepdim=True)
        return self.mlp(embeds).squeeze(1).float().cpu(), {}
