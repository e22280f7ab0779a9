"""The model-family seam: everything the trainer needs from a diffusion model, in one object.

The trainer sees a denoising trajectory as a token sequence and never names a UNet, a
transformer, a text encoder, a VAE or a scheduler: a `DiffusionPolicy` does. One subclass per
model family (``ddpo_group.diffusion.sd.StableDiffusionPolicy`` for SD 1.x / 2.x with DDIM; a
flow-matching family for SD3 / FLUX is a new file beside it), registered with `register_family`
and found for a loaded pipeline by `policy_for`:

    policy = load_policy("tiny-shapes")                       # the pipeline, wrapped by its family
    model = policy.prepare(device, dtype, use_lora=True, lora_rank=4)   # the trainable module
    batch = policy.sample(prompts, num_steps=10, guidance_scale=3.0, eta=1.0, generator=g)
    log_prob, mean, std = policy.step_log_prob(model, batch, rows, step_index, guidance_scale=3.0, eta=1.0)
    policy.save_trainable(model, output_dir, use_lora=True)   # LoRA in the family's diffusers format

A step's log-probability is the one function of the family (``step_log_prob``), shared by
sampling and training, so re-scoring with unchanged weights in the sampling layout equals the
sampled log-probs bit for bit. Step math is float32 (docs/design.md §10).
"""

from __future__ import annotations

FAMILIES: dict[str, type[DiffusionPolicy]] = {}


class DiffusionPolicy:
    """A diffusion pipeline seen as a Gaussian policy over denoising steps. Subclasses implement:

    supports(pipeline) -> bool           classmethod: is this pipeline of the family?
    load(model, revision, torch_dtype) -> pipeline
                                          classmethod: the family's offline names, a directory or a hub id
    offline_models, pipeline_class_names  class attributes: the names `load` builds offline, and the
                                          diffusers pipeline classes (model_index.json's _class_name) it loads
    configure(sde_type, max_sequence_length, resolution)
                                          the config's sampling options (ValueError naming the field when the
                                          family has no use for one)
    prepare(device, dtype, use_lora, lora_rank, lora_alpha) -> module
                                          freeze and move the frozen parts (dtype), add LoRA or unfreeze
                                          the whole model; returns the trainable module
    trainable_module                      the module being trained (unwrapped); settable
    critic_sizes() -> dict                latent_channels and prompt_dim of a critic V(x_t, t, c)
    sample(prompts, ..., keep_steps=True) -> Trajectories
                                          trajectories with float32 latents and log-probs, no graph
                                          (keep_steps=False: the clean latents only, no log-prob computed)
    step_log_prob(model, batch, rows, step_index, guidance_scale, eta) -> (log_prob, mean, std)
                                          one stored step re-scored with `model`, with autograd
    forward_noise(x0, noise, timesteps) -> (x_t, target, x0_scale)
                                          the family's forward process at model timesteps (b,) of its
                                          sampling grid, its training target (eps for SD 1.x/2.x, the
                                          velocity noise - x0 for flow matching) and the factor c (b,) with
                                          x0_hat - x0 = -c (prediction - target) (docs/forward.md)
    predict(model, x_t, timesteps, batch, rows, guidance_scale) -> prediction
                                          the model's output for x_t with the conditioning of `rows`
                                          of `batch` (classifier-free guidance when guidance_scale > 1),
                                          float32, with autograd
    save_trainable(module, dir, use_lora) / load_trainable(module, dir, use_lora)
    """

    family = "abstract"
    offline_models = ()
    pipeline_class_names = ()
    # whether `flow_grpo_kl_std` applies (train.kl_type="flow_grpo"): flow-matching families only
    supports_flow_grpo_kl = False

    def __init__(self, pipeline):
        if not self.supports(pipeline):
            raise TypeError(f"{type(self).__name__} does not support {type(pipeline).__name__}")
        self.pipeline = pipeline

    @classmethod
    def supports(cls, pipeline) -> bool:
        raise NotImplementedError

    @classmethod
    def load(cls, model, revision=None, torch_dtype=None):
        raise NotImplementedError

    def configure(self, sde_type="", max_sequence_length=0, resolution=0):
        raise NotImplementedError

    def prepare(self, device, dtype, use_lora, lora_rank=4, lora_alpha=None):
        raise NotImplementedError

    @property
    def trainable_module(self):
        raise NotImplementedError

    def critic_sizes(self):
        raise NotImplementedError

    def sample(self, prompts, num_steps, guidance_scale, eta, generator=None, prompt_ids=None, negative_prompt="",
               model=None, show_progress=False, keep_steps=True):
        raise NotImplementedError

    def forward_noise(self, x0, noise, timesteps):
        raise NotImplementedError

    def predict(self, model, x_t, timesteps, batch, rows, guidance_scale):
        raise NotImplementedError

    def step_log_prob(self, model, batch, rows, step_index, guidance_scale, eta):
        raise NotImplementedError

    def flow_grpo_kl_std(self, batch, rows, step_index, std):
        """The std that makes gaussian_kl Flow-GRPO's KL of a step (train.kl_type="flow_grpo"); flow families."""
        raise ValueError(
            f"config.train.kl_type='flow_grpo' is Flow-GRPO's KL of a flow-matching step; the {self.family} family "
            "steps with DDIM: use train.kl_type='gaussian'"
        )

    def save_trainable(self, module, output_dir, use_lora):
        raise NotImplementedError

    def load_trainable(self, module, input_dir, use_lora):
        raise NotImplementedError


def register_family(name):
    """Class decorator: register a DiffusionPolicy subclass under `name` (its `family`)."""

    def decorator(cls):
        if not (isinstance(cls, type) and issubclass(cls, DiffusionPolicy)):
            raise TypeError(f"register_family({name!r}): {cls!r} is not a DiffusionPolicy subclass")
        previous = FAMILIES.get(name)
        if previous is not None and (previous.__module__, previous.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"register_family: family {name!r} is already registered ({previous.__qualname__})")
        cls.family = name
        FAMILIES[name] = cls
        return cls

    return decorator


def _import_families():
    import ddpo_group.diffusion.flow_policy  # noqa: F401  registers "sd3" and "flux"
    import ddpo_group.diffusion.sd  # noqa: F401  registers "stable_diffusion"


def policy_for(pipeline):
    """The registered family's policy wrapping `pipeline`; ValueError naming the pipeline class otherwise."""
    _import_families()
    for cls in FAMILIES.values():
        if cls.supports(pipeline):
            return cls(pipeline)
    raise ValueError(
        f"no model family supports {type(pipeline).__name__}; supported families: {sorted(FAMILIES)} "
        "(register one with ddpo_group.diffusion.policy.register_family)"
    )


def family_for_model(model, revision=None):
    """The family that loads `model`: by its offline name, else by model_index.json's `_class_name`
    (a local directory, or the hub's copy when reachable); Stable Diffusion when neither tells."""
    import json
    import os

    _import_families()
    for cls in FAMILIES.values():
        if model in cls.offline_models:
            return cls
    path = os.path.expanduser(str(model))
    class_name = None
    if os.path.isfile(os.path.join(path, "model_index.json")):
        with open(os.path.join(path, "model_index.json")) as f:
            class_name = json.load(f).get("_class_name")
    elif not os.path.exists(path) and not str(model).startswith((".", "/", "~")) and str(model).count("/") == 1:
        try:
            from diffusers import DiffusionPipeline

            offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
            class_name = DiffusionPipeline.load_config(model, revision=revision, local_files_only=offline).get("_class_name")
        except Exception:
            class_name = None  # the default family's loader names the model in its error
    for cls in FAMILIES.values():
        if class_name in cls.pipeline_class_names:
            return cls
    return FAMILIES["stable_diffusion"]


def load_policy(model, revision=None, torch_dtype=None):
    """Load `model` (config.pretrained.model) with its family and wrap it; ValueError naming the model otherwise."""
    cls = family_for_model(model, revision)
    return cls(cls.load(model, revision=revision, torch_dtype=torch_dtype))
