"""Find the model family for a pipeline or a model name: the only module that knows the families.

Every family registers itself with ``register_family`` (``ddpo_group.diffusion.base``) when its module
is imported; the imports below are the registration lines (a new family adds one). The trainer,
the scripts and the evaluation call `load_policy` / `policy_for` and see only the `DiffusionPolicy`
protocol:

    policy = load_policy("tiny-shapes")                       # the pipeline, wrapped by its family
    model = policy.prepare(device, dtype, use_lora=True, lora_rank=4)   # the trainable module
    batch = policy.sample(prompts, num_steps=10, guidance_scale=3.0, eta=1.0, generator=g)
    log_prob, mean, std = policy.step_log_prob(model, batch, rows, step_index, guidance_scale=3.0, eta=1.0)
    policy.save_trainable(model, output_dir, use_lora=True)   # LoRA in the family's diffusers format

Imports go one way (docs/architecture.md): this module -> the families -> ``base``.
"""

from ddpo_group.diffusion import flux, qwen_image, sd, sd3, wan  # noqa: F401  the registration lines (one per family)
from ddpo_group.diffusion import flux2  # noqa: F401  FLUX.2 [dev] and [klein]
from ddpo_group.diffusion import zimage  # noqa: F401  Z-Image and Z-Image-Turbo
from ddpo_group.diffusion import wan_i2v, wan_moe  # noqa: F401  Wan image-to-video, Wan 2.2 A14B's two experts
from ddpo_group.diffusion import hunyuan_video15, ltx2, sana  # noqa: F401  issue 46 (Qwen-Image-Edit-2509: qwen_image)
from ddpo_group.diffusion import sd_flow  # noqa: F401  SD's UNet stepped by flow matching (tiny-scenes-flow)
from ddpo_group.diffusion.base import FAMILIES, DiffusionPolicy, register_family  # noqa: F401  (re-exported)
from ddpo_group.config.registry import ConfigError, register_config_check


def policy_for(pipeline):
    """The registered family's policy wrapping `pipeline`; ValueError naming the pipeline class otherwise."""
    for cls in FAMILIES.values():
        if cls.supports(pipeline):
            return cls(pipeline)
    raise ValueError(
        f"no model family supports {type(pipeline).__name__}; supported families: {sorted(FAMILIES)} "
        "(register one with ddpo_group.diffusion.base.register_family)"
    )


def _index_classes(index):
    """(pipeline class, scheduler class) names of a model_index.json dict (None where it does not say)."""
    entry = index.get("scheduler") if isinstance(index, dict) else None
    return (index.get("_class_name") if isinstance(index, dict) else None,
            entry[1] if isinstance(entry, list | tuple) and len(entry) == 2 else None)


def family_for_model(model, revision=None):
    """The family that loads `model`: by its offline name, else by model_index.json's `_class_name` (a local
    directory, or the hub's copy when reachable) and, where two families load one class, its scheduler entry
    (``scheduler_class_names``); Stable Diffusion when neither tells."""
    import json
    import os

    for cls in FAMILIES.values():
        if model in cls.offline_models:
            return cls
    path = os.path.expanduser(str(model))
    class_name, scheduler = None, None
    if os.path.isfile(os.path.join(path, "model_index.json")):
        with open(os.path.join(path, "model_index.json")) as f:
            class_name, scheduler = _index_classes(json.load(f))
    elif not os.path.exists(path) and not str(model).startswith((".", "/", "~")) and str(model).count("/") == 1:
        from ddpo_group.diffusion.hub import check_hub

        check_hub(str(model), "config.pretrained.model")  # the first time the hub is asked: a bounded wait
        try:
            from diffusers import DiffusionPipeline

            offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
            class_name, scheduler = _index_classes(
                DiffusionPipeline.load_config(model, revision=revision, local_files_only=offline))
        except Exception:
            class_name = None  # the default family's loader names the model in its error
    for cls in FAMILIES.values():  # a family that names its schedulers first (sd_flow before stable_diffusion)
        if class_name in cls.pipeline_class_names and scheduler in cls.scheduler_class_names:
            return cls
    for cls in FAMILIES.values():
        if class_name in cls.pipeline_class_names and not cls.scheduler_class_names:
            return cls
    return FAMILIES["stable_diffusion"]


def load_policy(model, revision=None, torch_dtype=None):
    """Load `model` (config.pretrained.model) with its family and wrap it; ValueError naming the model otherwise."""
    cls = family_for_model(model, revision)
    pipeline = cls.load(model, revision=revision, torch_dtype=torch_dtype)
    # one pipeline class may hold several families (WanPipeline: Wan 2.1 / 2.2 TI2V, or 2.2 A14B's two experts)
    return cls(pipeline) if cls.supports(pipeline) else policy_for(pipeline)


@register_config_check("family")
def check_family(config, machine):
    """The family that claims config.pretrained.model by its offline name checks the config
    (`DiffusionPolicy.check_config`); a hub id or a directory is not looked up here (its family is known when it
    loads). The family's ValueError is a ConfigError with its words."""
    family = next((cls for cls in FAMILIES.values() if config.pretrained.model in cls.offline_models), None)
    if family is None:
        return
    try:
        family.check_config(config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
