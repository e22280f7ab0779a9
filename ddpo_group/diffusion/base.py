"""The family-neutral base of ``ddpo_group.diffusion``: what every model family implements and returns.

Imports no family (docs/architecture.md): the `DiffusionPolicy` protocol and its family registry
(`register_family`, `FAMILIES`), the `Trajectories` a family samples, per-step noise levels and the
ODE/SDE window, the dtype a model's inputs are cast to, and `rescore`, the re-scoring of stored steps
through any family's ``step_log_prob``. Families (``sd.py``, ``flow_policy.py``, ...) import this
module; ``policy.py`` imports the families to find the one for a pipeline or a model name.

A denoising trajectory of T steps is a sequence of T "tokens": token t is the transition
x_t -> x_{t+1} (t = 0 is the noisiest) with log-probability log pi(x_{t+1} | x_t, c). A family
samples and re-scores with the same step function on the same batch composition, so re-scoring
with unchanged weights reproduces the sampled log-probs exactly (the PPO ratio is exactly 1).
Step math and log-probs are float32 (docs/design.md §10).
"""

from dataclasses import dataclass, fields

import torch

from ddpo_group.diffusion.text_cache import TextEmbeddingCache, encoder_state


def _per_row(field):
    """False for a field that describes the whole batch (not indexed, not concatenated)."""
    return field.metadata.get("per_row", True)


@dataclass
class Trajectories:
    """A batch of B denoising trajectories of T steps.

    images (B, 3, H, W) float in [0, 1], or for a video family (``DiffusionPolicy.video``) videos
    (B, F, 3, H, W): F frames of the same layout; latents (B, T+1, C, h, w) float32: x_0 (noise) ... x_T,
    (B, T+1, C, f, h, w) with a video family's latent time axis (every step and log-density is
    element-wise over the non-batch dims, so the axis rides along);
    log_probs (B, T) float32; timesteps (B, T) (int64 for DDIM); prompt_embeds (B, L, D);
    negative_prompt_embeds (B, L, D) or None (no guidance); mask (B, T) float, 0 where
    std_dev_t == 0; prompts list of B str; prompt_ids (B,) int64 (the GRPO group key);
    pooled_prompt_embeds, negative_pooled_prompt_embeds (B, D') or None: the pooled text
    embeddings of families that condition on them (SD3, FLUX; None for SD 1.x / 2.x); sigmas (B, T+1)
    float32: the flow families' noise grid the trajectory was sampled on (None for DDIM), so that
    re-scoring uses the trajectory's own grid whatever the scheduler holds by then; extra_cond: a family's
    own per-row conditioning tensors (name -> (B, ...)), e.g. a text attention mask, None for the built-in ones.
    audio (B, channels, samples) float32 in [-1, 1]: the waveforms sampled with the videos by a family that makes
    sound (``audio_sample_rate`` on the policy: LTX-2), None for the others; rewards get them in their metadata
    (rewards/base.py).

    Sampled with ``keep_steps=False`` (the forward-process objectives, docs/forward.md) a batch keeps
    only its clean latents: latents (B, 1, C, h, w) = x_T, log_probs and mask (B, 0); timesteps stay (B, T).

    ``index``, ``to`` and ``cat`` carry every declared field, those of subclasses too: a tensor
    field is indexed on dim 0, a dict field value by value, a field declared with
    ``metadata={"per_row": False}`` (a whole-batch view) is kept by ``index`` / ``to`` and dropped by ``cat``.
    """

    images: torch.Tensor
    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None
    mask: torch.Tensor
    prompts: list
    prompt_ids: torch.Tensor
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    sigmas: torch.Tensor | None = None
    extra_cond: dict | None = None
    x0_hat: torch.Tensor | None = None  # (B, T, C, h, w) each step's one-step prediction, kept when the anchor asks
    audio: torch.Tensor | None = None  # (B, channels, samples) float32 waveforms of a family with audio (LTX-2)

    def __len__(self):
        return self.latents.shape[0]

    def index(self, idx):
        """The trajectories selected by ``idx`` (int, slice, list or tensor of indices / bool mask on dim 0)."""
        if isinstance(idx, int):
            idx = [idx]
        if isinstance(idx, slice):
            prompts = self.prompts[idx]
        else:
            positions = torch.arange(len(self))[torch.as_tensor(idx).cpu()]
            prompts = [self.prompts[i] for i in positions.tolist()]
            idx = positions

        def select(value):
            return value[idx.to(value.device) if torch.is_tensor(idx) else idx]

        values = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "prompts":
                values[field.name] = prompts
            elif value is None or not _per_row(field):
                values[field.name] = value
            elif isinstance(value, dict):
                values[field.name] = {key: select(v) for key, v in value.items()}
            else:
                values[field.name] = select(value)
        return type(self)(**values)

    def to(self, device):
        """A copy with every per-row tensor on ``device``."""
        values = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, dict) and _per_row(field):
                value = {key: v.to(device) for key, v in value.items()}
            elif torch.is_tensor(value):
                value = value.to(device)
            values[field.name] = value
        return type(self)(**values)

    @classmethod
    def cat(cls, batches):
        """Concatenate several batches along the batch dim (prompt_ids are kept as they are)."""
        values = {}
        for field in fields(cls):
            parts = [getattr(batch, field.name, None) for batch in batches]
            if field.name == "prompts":
                values[field.name] = [prompt for part in parts for prompt in part]
            elif not _per_row(field) or any(part is None for part in parts):
                values[field.name] = None
            elif isinstance(parts[0], dict):
                values[field.name] = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
            else:
                values[field.name] = torch.cat(parts)
        return cls(**values)


def noise_levels(eta, num_steps):
    """Per-step noise levels (T,): `eta` for every step, or a sequence of num_steps values (0: a deterministic step)."""
    if isinstance(eta, (int, float)):
        levels = [float(eta)] * num_steps
    else:
        levels = [float(level) for level in eta]
        if len(levels) != num_steps:
            raise ValueError(f"eta must be a number or one value per step ({num_steps}), got {len(levels)} values")
    if any(not level >= 0 for level in levels):
        raise ValueError(f"eta (noise level) must be >= 0 at every step, got {levels}")
    return levels


def window_noise_levels(eta, num_steps, window_size=0, mode="fixed", start=0, shift_every=1, epoch=0, seed=0):
    """The ODE/SDE window of an epoch (Flow-GRPO-Fast, MixGRPO): eta inside, 0 (an ODE step) outside. (T,) list.

    window_size 0: every step is stochastic. mode "fixed": steps [start, start + size); "random": a start
    drawn per epoch from `seed` (the same on every process); "sliding": start + epoch // shift_every,
    wrapping around the T - size + 1 possible starts (MixGRPO's moving window).
    """
    if not window_size:
        return noise_levels(eta, num_steps)
    if not 0 < window_size <= num_steps:
        raise ValueError(f"config.sample.sde_window_size={window_size} must lie in [0, sample.num_steps={num_steps}]")
    starts = num_steps - window_size + 1
    if mode == "fixed":
        if not 0 <= start < starts:
            raise ValueError(
                f"config.sample.sde_window_start={start} puts the window outside the {num_steps} steps; "
                f"choose a start in [0, {starts - 1}]"
            )
        first = start
    elif mode == "random":
        first = int(torch.randint(starts, (1,), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)))
    elif mode == "sliding":
        first = (start + epoch // max(1, shift_every)) % starts
    else:
        raise ValueError(f"config.sample.sde_window={mode!r} is not one of ['fixed', 'random', 'sliding']")
    return [float(eta) if first <= i < first + window_size else 0.0 for i in range(num_steps)]


def final_latents_only(latents):
    """The step fields of trajectories sampled with keep_steps=False: latents (B, 1, ...) = the clean x_T,
    log_probs and mask (B, 0) (no step carries a density the trainer reads)."""
    empty = torch.zeros(latents.shape[0], 0, device=latents.device, dtype=torch.float32)
    return {"latents": latents.unsqueeze(1), "log_probs": empty, "mask": empty.clone()}


def default_prompt_ids(prompts):
    """(B,) int64: for each prompt, the batch index of the first appearance of the same prompt."""
    first_index = {}
    return torch.tensor([first_index.setdefault(prompt, i) for i, prompt in enumerate(prompts)], dtype=torch.int64)


def conditioning_only(prompts, cond, extra_cond=None):
    """Trajectories of `prompts` holding only their conditioning (``cond``: prompt_embeds, negative_prompt_embeds and
    the pooled ones where a family has them); latents, log-probs, timesteps and mask are empty (B, 0), images too.
    ``DiffusionPolicy.conditioning`` returns one: ``predict`` reads nothing else."""
    prompts = list(prompts)
    device = cond["prompt_embeds"].device
    empty = torch.zeros(len(prompts), 0, device=device)
    return Trajectories(
        images=empty, latents=empty, log_probs=empty, timesteps=empty, mask=empty,
        prompt_embeds=cond["prompt_embeds"], negative_prompt_embeds=cond.get("negative_prompt_embeds"),
        prompts=prompts, prompt_ids=default_prompt_ids(prompts),
        pooled_prompt_embeds=cond.get("pooled_prompt_embeds"),
        negative_pooled_prompt_embeds=cond.get("negative_pooled_prompt_embeds"), extra_cond=extra_cond or None,
    )


def execution_device(pipeline):
    """The device a pipeline's models run on: ``pipeline.device`` when no component carries an offloading hook
    (accelerate's ``_hf_hook``, diffusers' ``_diffusers_hook``), else diffusers' ``pipeline._execution_device``.
    The latter walks every submodule of every component on each call (diffusers' group-offloading check): a few
    milliseconds per sampled batch on the tiny models, more on a large model's thousands of modules
    (docs/performance.md)."""
    components = [m for m in pipeline.components.values() if isinstance(m, torch.nn.Module)]
    if any(hasattr(m, "_hf_hook") or hasattr(m, "_diffusers_hook") for m in components):
        return pipeline._execution_device
    return pipeline.device


def model_dtype(module):
    """The dtype a model's inputs are cast to: that of its first floating-point parameter.

    Works through DDP / ``torch.compile`` wrappers and for the reference policy (its ``unet``);
    float32 when the module has no parameters.
    """
    module = getattr(module, "module", module)
    module = getattr(module, "unet", module) if not isinstance(module, torch.nn.Module) else module
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


FAMILIES: dict[str, type["DiffusionPolicy"]] = {}



# The config.sample fields DiffusionPolicy.configure takes, in its order.
CONFIGURE_FIELDS = ("sde_type", "max_sequence_length", "resolution", "cps_log_prob", "flow_grid", "flow_grid_shift")


def configure_from_sample(policy, sample):
    """policy.configure with the CONFIGURE_FIELDS that `sample` (config.sample, or a run's config.json dict) holds; a
    field it lacks (a run older than the field) keeps configure's default, the behaviour that run had. Then
    policy.configure_frames with sample.num_frames (0 where it has none: the model's own)."""
    policy.configure(**{field: sample[field] for field in CONFIGURE_FIELDS if field in sample})
    policy.configure_frames(sample["num_frames"] if "num_frames" in sample else 0)
    policy.configure_text_cache(sample["text_embedding_cache"] if "text_embedding_cache" in sample else 0)


class DiffusionPolicy:
    """A diffusion pipeline seen as a Gaussian policy over denoising steps. Subclasses implement:

    supports(pipeline) -> bool           classmethod: is this pipeline of the family?
    load(model, revision, torch_dtype) -> pipeline
                                          classmethod: the family's offline names, a directory or a hub id
    offline_models, pipeline_class_names  class attributes: the names `load` builds offline, and the
                                          diffusers pipeline classes (model_index.json's _class_name) it loads
    scheduler_class_names                 class attribute: the schedulers that make a directory of such a class
                                          this family's when another family loads the class too (empty: any)
    configure(sde_type, max_sequence_length, resolution, cps_log_prob, flow_grid, flow_grid_shift)
                                          the config's sampling options (ValueError naming the field when the
                                          family has no use for one)
    configure_experts(guidance_scale_2, experts)
                                          a family with two experts: the low-noise expert's guidance scale and
                                          which experts train (config.sample.guidance_scale_2, config.train.experts)
    video, configure_frames(num_frames)   whether samples are videos (B, F, 3, H, W) (class attribute, False:
                                          images); the frames F of a video family (config.sample.num_frames,
                                          0: the model's default); an image family refuses any other than 0
    prepare(device, dtype, use_lora, lora_rank, lora_alpha) -> module
                                          freeze and move the frozen parts (dtype), add LoRA or unfreeze
                                          the whole model; returns the trainable module
    trainable_module                      the module being trained (unwrapped); settable
    shard_blocks                          class attribute: the trainable module's block attributes, each
                                          block one FSDP2 unit (train.sharding="fsdp2")
    text_rows_independent                 class attribute, True (the default) when a prompt's text conditioning
                                          depends only on the prompt and the batch size (fixed-length padding),
                                          so that the text-embedding cache may serve it (text_cache.py;
                                          config.sample.text_embedding_cache); a family calls its `_encode`
                                          through `_cached_text` (the flow base's and SD's `_encode_text` do)
    critic_sizes() -> dict                latent_channels and prompt_dim of a critic V(x_t, t, c)
    sample(prompts, ..., keep_steps=True) -> Trajectories
                                          trajectories with float32 latents and log-probs, no graph
                                          (keep_steps=False: the clean latents only, no log-prob computed)
    conditions_on_images                  class attribute, True for an image-editing family: its `sample` takes
                                          source_images (B, 3, H, W) float in [0, 1], one per prompt, and keeps
                                          their encoding in Trajectories.extra_cond (re-scored exactly); the
                                          callers pass source_images only to such a family (data/edit_sources.py)
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
    predict_x0(model, batch, rows, step_index, guidance_scale) -> x0_hat
                                          the one-step prediction of the clean sample from the stored x_k
                                          (k = step_index, an int) of `rows`, float32: what
                                          sample(..., keep_x0_hat=True) keeps in Trajectories.x0_hat
    decode(latents) -> images             clean latents (B, C, h, w) -> images (B, 3, H, W) in [0, 1] float32
                                          (videos (B, F, 3, H, W) for a video family), as sampling decodes x_T
    anchor_refusal                        class attribute: None when the anchor machinery (critic_designs.py:
                                          the reward of each step's decoded x0_hat) can score the family's
                                          steps, else the reason it cannot (one clause, for the ConfigError)
    save_trainable(module, dir, use_lora, state_dict=None) / load_trainable(module, dir, use_lora)
                                          state_dict: the module's full state dict to write the LoRA weights
                                          from (a sharded module's, gathered: train.sharding="fsdp2")
    """

    family = "abstract"
    offline_models = ()
    pipeline_class_names = ()
    # the schedulers (model_index.json's scheduler entry) that make a directory of one of pipeline_class_names this
    # family's, where two families share a pipeline class (sd_flow: a StableDiffusionPipeline stepped by flow
    # matching); empty: any scheduler
    scheduler_class_names = ()
    # whether `flow_grpo_kl_std` applies (train.kl_type="flow_grpo"): flow-matching families only
    supports_flow_grpo_kl = False
    # whether samples are videos (B, F, 3, H, W) with latents (B, C, f, h, w); images (B, 3, H, W) otherwise
    video = False
    # whether `sample` edits a source image per prompt (sample(..., source_images=...)): the editing families
    conditions_on_images = False
    # None when critic_designs.anchor_values can score this family's steps (its sample keeps x0_hat, predict_x0 and
    # decode exist, and its rewards read the decoded images alone); else why not, for the ConfigError
    anchor_refusal = "it has no one-step prediction x0_hat"
    # the trainable module's attributes whose modules (each element of a ModuleList) are FSDP2 units
    # (train.sharding="fsdp2", ddpo_group/training/sharding.py); empty: no block structure known, sharding refused
    shard_blocks = ()
    # whether a text encoding's row depends only on its prompt and the batch size (fixed-length padding), so that the
    # text-embedding cache (text_cache.py, config.sample.text_embedding_cache) may serve it; False: never cached
    text_rows_independent = True
    text_cache = TextEmbeddingCache(0)  # off until configure_text_cache

    def __init__(self, pipeline):
        if not self.supports(pipeline):
            raise TypeError(f"{type(self).__name__} does not support {type(pipeline).__name__}")
        self.pipeline = pipeline
        self.text_cache = TextEmbeddingCache(0)

    def configure_text_cache(self, max_prompts):
        """config.sample.text_embedding_cache: keep the conditioning rows of at most `max_prompts` prompts (0: off)."""
        if int(max_prompts) != self.text_cache.max_prompts:
            self.text_cache = TextEmbeddingCache(max_prompts)

    def _cached_text(self, encode_fn, prompts, *context):
        """encode_fn(prompts) (the family's conditioning dict) through the text-embedding cache (text_cache.py):
        `context` is what the encoding depends on besides the prompts; bypassed where caching would not be exact."""
        if self.text_cache.max_prompts <= 0 or not self.text_rows_independent:
            return encode_fn(prompts)
        identity, trained = encoder_state(self.pipeline)
        if trained:
            return encode_fn(prompts)
        autocast = tuple((kind, torch.is_autocast_enabled(kind), str(torch.get_autocast_dtype(kind)))
                         for kind in ("cpu", "cuda"))  # mixed precision changes the encoder's numbers
        return self.text_cache.encode(encode_fn, list(prompts), (type(self).__name__, *context, identity, autocast))

    @classmethod
    def supports(cls, pipeline) -> bool:
        raise NotImplementedError

    @classmethod
    def load(cls, model, revision=None, torch_dtype=None):
        raise NotImplementedError

    @classmethod
    def check_config(cls, config):
        """ValueError naming the field for a run configuration this family cannot honour, before any model loads
        (the config check calls it for the family that claims config.pretrained.model by its offline name). The
        default accepts every config; a family overrides it with its own rules."""

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, cps_log_prob="normalized",
                  flow_grid="pipeline", flow_grid_shift=3.0):
        raise NotImplementedError

    def configure_frames(self, num_frames):
        """config.sample.num_frames: an image family makes one frame and takes only 0 (a video family overrides)."""
        if num_frames:
            raise ValueError(
                f"config.sample.num_frames={num_frames}: the {self.family} family makes images, not videos; "
                "set sample.num_frames=0"
            )

    def configure_experts(self, guidance_scale_2=0.0, experts="both"):
        """config.sample.guidance_scale_2 and config.train.experts: a family with two experts (Wan 2.2 A14B,
        wan_moe.py) overrides this; every other family has one model and refuses anything but the defaults."""
        if guidance_scale_2:
            raise ValueError(f"config.sample.guidance_scale_2={guidance_scale_2}: the {self.family} family has one "
                             "model, not two experts; set sample.guidance_scale_2=0")
        if experts != "both":
            raise ValueError(f"config.train.experts={experts!r}: the {self.family} family has one model, not two "
                             "experts; set train.experts='both'")

    def prepare(self, device, dtype, use_lora, lora_rank=4, lora_alpha=None):
        raise NotImplementedError

    @property
    def trainable_module(self):
        raise NotImplementedError

    def critic_sizes(self):
        raise NotImplementedError

    def sample(self, prompts, num_steps, guidance_scale, eta, generator=None, prompt_ids=None, negative_prompt="",
               model=None, show_progress=False, keep_steps=True, initial_generator=None, keep_x0_hat=False):
        """B trajectories (``Trajectories``). generator: the step noise's (and, when initial_generator is None, the
        initial noise's); initial_generator: the initial noise's, a generator or a list of one per prompt
        (sample.group_noise="shared" gives a group's trajectories one seed); keep_x0_hat: also keep each step's
        one-step prediction of the clean sample from the step's own model call (Trajectories.x0_hat)."""
        raise NotImplementedError

    def predict_x0(self, model, batch, rows, step_index, guidance_scale):
        raise NotImplementedError

    def decode(self, latents):
        raise NotImplementedError

    def forward_noise(self, x0, noise, timesteps):
        raise NotImplementedError

    def encode_images(self, images):
        """Clean latents (B, C, h, w) float32 of images (B, 3, H, W) in [0, 1]: the inverse of ``decode`` (the VAE's
        posterior mean), for training on images the policy did not sample (Diffusion-DPO's offline pairs)."""
        raise NotImplementedError(f"{type(self).__name__} does not encode images (offline preference pairs)")

    def conditioning(self, prompts, guidance_scale):
        """A Trajectories holding only the text conditioning of `prompts` (its latents and steps empty), for
        ``predict`` on latents that were not sampled (Diffusion-DPO's offline pairs)."""
        raise NotImplementedError(f"{type(self).__name__} does not condition unsampled latents (offline preference pairs)")

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

    def step_dt(self, batch, rows, step_index):
        """(b,) the length in flow time of trajectories `rows`' steps `step_index`, sigma_t - sigma_{t+1} > 0
        (train.policy_loss="grpo_guard" weighs a step's gradient by 1 / dt)."""
        raise ValueError(
            f"config.train.guard_reweight='dt' needs the step length of the {self.family} family, which it does not "
            "define: use train.guard_reweight='none'"
        )

    def save_trainable(self, module, output_dir, use_lora, state_dict=None):
        raise NotImplementedError

    def load_trainable(self, module, input_dir, use_lora):
        raise NotImplementedError


def video_frames(num_frames, temporal, model):
    """config.sample.num_frames F of a video family whose VAE compresses time by `temporal`: F - 1 must be a multiple
    of it (one line naming the field and the nearest valid count otherwise). Returns F as an int."""
    if num_frames < 1 or (num_frames - 1) % temporal:
        raise ValueError(
            f"config.sample.num_frames={num_frames}: this {model} model takes 1 + {temporal} k frames "
            f"(e.g. {1 + temporal * max(1, (num_frames - 1) // temporal)})"
        )
    return int(num_frames)


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


def rescore(policy, trajectories, guidance_scale, eta, step_indices=None, return_means=False, model=None,
            micro_batch_size=None):
    """Re-score stored steps with `model` (default: the policy's trainable module) through the family's
    ``step_log_prob``: log pi_theta(x_{k+1} | x_k, c) for k in step_indices.

    One model call per (step, micro-batch); never B * T samples at once. With the default
    ``micro_batch_size=None`` each call holds the whole batch of B, as in sampling, so with
    unchanged weights the result equals ``trajectories.log_probs`` exactly. Autograd follows the
    caller's grad mode.

    step_indices: None (all T steps), a (K,) list / tensor of step indices shared by the batch, or a
    (B, K) tensor of per-trajectory step indices. Returns log_probs (B, K) [, means (B, K, C, h, w),
    stds (B, K, 1, 1, 1) when return_means].
    """
    model = policy.trainable_module if model is None else model
    batch_size, num_steps = trajectories.timesteps.shape
    device = trajectories.latents.device
    if step_indices is None:
        step_indices = torch.arange(num_steps)
    step_indices = torch.as_tensor(step_indices, dtype=torch.int64, device=device)
    if step_indices.ndim == 1:
        step_indices = step_indices.unsqueeze(0).expand(batch_size, -1)
    if step_indices.ndim != 2 or step_indices.shape[0] != batch_size:
        raise ValueError(
            f"step_indices must have shape (K,) or (B, K) with B = {batch_size}, got {tuple(step_indices.shape)}"
        )
    if step_indices.shape[1] == 0:
        raise ValueError("step_indices must select at least one step")
    if step_indices.min() < 0 or step_indices.max() >= num_steps:
        raise ValueError(f"step_indices must lie in [0, T) = [0, {num_steps})")
    micro_batch_size = batch_size if micro_batch_size is None else micro_batch_size
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
    rows = torch.arange(batch_size, device=device)
    log_probs, means, stds = [], [], []
    for k in range(step_indices.shape[1]):
        parts = [
            policy.step_log_prob(model, trajectories, rows[i : i + micro_batch_size],
                                 step_indices[i : i + micro_batch_size, k], guidance_scale, eta)
            for i in range(0, batch_size, micro_batch_size)
        ]
        log_probs.append(torch.cat([part[0] for part in parts]))
        if return_means:
            means.append(torch.cat([part[1] for part in parts]))
            stds.append(torch.cat([part[2] for part in parts]))
    if return_means:
        return torch.stack(log_probs, 1), torch.stack(means, 1), torch.stack(stds, 1)
    return torch.stack(log_probs, 1)
