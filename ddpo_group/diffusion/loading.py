"""Load the pipeline a run trains: the offline tiny models, a local directory or a hub id.

Every pipeline comes back with a ``DDIMScheduler`` (built from the model's scheduler config,
as ddpo-pytorch does), the safety checker disabled and the progress bar off.
"""

import os
from pathlib import Path

import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline

from ddpo_group.diffusion.tiny import build_sd15_random_pipeline, build_tiny_pipeline

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TINY_SHAPES_DIR = ASSETS_DIR / "tiny_shapes"
# The scenes world's shipped models (scripts/pretrain_tiny.py --world scenes --arch sd | sd3): name -> directory
SHIPPED_SCENES = {"tiny-scenes": ASSETS_DIR / "tiny_scenes", "tiny-scenes-sd3": ASSETS_DIR / "tiny_scenes_sd3",
                  "tiny-scenes-flow": ASSETS_DIR / "tiny_scenes_flow"}

# a StableDiffusionPipeline with one of these schedulers is a flow-matching UNet: the sd_flow family's (sd_flow.py)
FLOW_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler",)

OFFLINE_HINT = (
    "To run offline, use the tiny model (`--config config/grpo.py:tiny`, model 'tiny' or 'tiny-shapes') "
    "or pass a local directory written by StableDiffusionPipeline.save_pretrained."
)


def shipped_dir(model: str) -> Path:
    """The directory of a shipped scenes model ("tiny-scenes", "tiny-scenes-sd3", "tiny-scenes-flow"); ValueError saying how to make
    it when it is missing."""
    path = SHIPPED_SCENES[model]
    if not (path / "model_index.json").is_file():
        arch = {"tiny-scenes-sd3": "sd3", "tiny-scenes-flow": "sd-flow"}.get(model, "sd")
        raise ValueError(f"model {model!r}: the pretrained scenes model is missing from {path}; create it with "
                         f"`python scripts/pretrain_tiny.py --world scenes --arch {arch} --replace-shipped`")
    return path


def load_tiny_scenes_sd3(torch_dtype=torch.float32):
    """The shipped flow-matching scenes model "tiny-scenes-sd3" (a StableDiffusion3Pipeline without T5)."""
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(
        str(shipped_dir("tiny-scenes-sd3")), text_encoder_3=None, tokenizer_3=None, dtype=torch_dtype,
        local_files_only=True,
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _finish(pipeline, torch_dtype):
    if type(pipeline.scheduler).__name__ in FLOW_SCHEDULERS:  # DDIM from its config would be silent
        raise ValueError(f"{pipeline.config._name_or_path!r} is a flow-matching UNet (its scheduler is "
                         "FlowMatchEulerDiscreteScheduler), not a DDIM one: load it with "
                         "ddpo_group.diffusion.policy.load_policy (the sd_flow family)")
    pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)
    pipeline.safety_checker = None
    pipeline.register_to_config(requires_safety_checker=False)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline.to(dtype=torch_dtype)


def _from_pretrained(model, torch_dtype, **kwargs):
    return StableDiffusionPipeline.from_pretrained(
        model, dtype=torch_dtype, safety_checker=None, requires_safety_checker=False, **kwargs
    )


def load_pipeline(model, revision=None, torch_dtype=torch.float32, local_files_only=None):
    """A StableDiffusionPipeline with a DDIM scheduler for ``model``.

    model:
        "tiny"         random tiny pipeline (``build_tiny_pipeline()``), offline;
        "tiny-shapes"  the pretrained shapes-world tiny model shipped in ddpo_group/assets/tiny_shapes;
        "tiny-scenes"  the pretrained scenes-world UNet shipped in ddpo_group/assets/tiny_scenes;
        "random-sd15"  SD 1.5's architecture with random weights (``build_sd15_random_pipeline``), offline:
                       for speed and memory checks on GPUs (benchmarks/gpu_check.py);
        a directory    written by ``StableDiffusionPipeline.save_pretrained``;
        a hub id       e.g. "stable-diffusion-v1-5/stable-diffusion-v1-5" (the old runwayml id is gone from the hub) (``revision`` picks a branch / commit).
    local_files_only: for hub ids; None means True when HF_HUB_OFFLINE is set.

    Raises ValueError naming the model and how to run offline when it cannot be loaded.
    """
    if not isinstance(model, str | os.PathLike) or not str(model):
        raise ValueError(
            f"model must be 'tiny', 'tiny-shapes', 'tiny-scenes', 'random-sd15', a local directory or a hub id, got {model!r}"
        )
    model = str(model)
    if model == "tiny":
        return _finish(build_tiny_pipeline(), torch_dtype)
    if model == "random-sd15":
        return _finish(build_sd15_random_pipeline(), torch_dtype)
    if model == "tiny-shapes":
        if not (TINY_SHAPES_DIR / "model_index.json").is_file():
            raise ValueError(
                f"model 'tiny-shapes': the pretrained tiny model is missing from {TINY_SHAPES_DIR}; "
                "create it with `python scripts/pretrain_tiny.py --replace-shipped`, or use model 'tiny' "
                "(random weights)."
            )
        return _finish(_from_pretrained(str(TINY_SHAPES_DIR), torch_dtype, local_files_only=True), torch_dtype)
    if model == "tiny-scenes":
        return _finish(_from_pretrained(str(shipped_dir(model)), torch_dtype, local_files_only=True), torch_dtype)

    path = Path(model).expanduser()
    if path.is_dir():
        try:
            pipeline = _from_pretrained(str(path), torch_dtype, local_files_only=True)
        except Exception as err:
            raise ValueError(
                f"model {model!r}: could not load a StableDiffusionPipeline from this directory ({err}). "
                + OFFLINE_HINT
            ) from err
        return _finish(pipeline, torch_dtype)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model {model!r}: no such directory. " + OFFLINE_HINT)

    if local_files_only is None:
        local_files_only = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        pipeline = _from_pretrained(model, torch_dtype, revision=revision, local_files_only=local_files_only)
    except Exception as err:
        raise ValueError(
            f"model {model!r}: could not load it from the Hugging Face hub or its cache ({type(err).__name__}: {err}). "
            + OFFLINE_HINT
        ) from err
    return _finish(pipeline, torch_dtype)
