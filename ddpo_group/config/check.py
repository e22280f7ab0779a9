"""Validation of a run configuration, before any model loads.

Every error names the config field and says what would fix it. The defaults themselves
live in ddpo_group/config/base.py only; `load_base_config()` returns them.

Names that a registry defines (advantage estimators, policy losses, loss aggregation modes, KL
types, reward aggregations) are checked against that registry, so a name registered by a plugin
(`config.plugins`) is accepted like a built-in one; an estimator's needs are its registered properties.
"""

import os

import ml_collections

from ddpo_group.algos.advantages import get_adv_estimator, registered_adv_estimators
from ddpo_group.algos.grouping import ADVANTAGE_NORMS
from ddpo_group.algos.losses import AGG_MODES, KL_TYPES, registered_policy_losses
from ddpo_group.diffusion.flow import CPS_LOG_PROBS, FLOW_GRIDS, SDE_TYPES
from ddpo_group.config.plugins import PluginError, import_plugins
from ddpo_group.rewards.base import is_video_reward
from ddpo_group.rewards.combine import REWARD_AGGREGATIONS
from ddpo_group.rewards.registry import check_reward_keywords, list_rewards, resolve_reward, unknown_reward_message

CRITIC_TRAIN_STEPS = ("endpoints", "all")
TIMESTEP_SELECTIONS = ("all", "fraction", "endpoints", "segment_start", "segment_sample", "early")
MIXED_PRECISIONS = ("no", "fp16", "bf16")
LOG_WITH = ("none", "wandb", "tensorboard")
OLD_LOG_PROBS = ("recompute", "sampled")
OBJECTIVES = ("stepwise", "nft", "awm")
SDE_WINDOWS = ("fixed", "random", "sliding")
# Sub-configs whose keys are the user's own (kwargs, reward names).
FREE_FORM_FIELDS = ("prompt_fn_kwargs", "reward_weights", "reward_kwargs")
# Fields that were renamed or merged: what to set instead.
RENAMED_FIELDS = {
    "group_ppo.actor_tokens": "train.timestep_selection ('endpoints': the actor trains at the segment endpoints, "
    "'all': at every valid step with the segment advantage)",
}


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


def load_config_prompts(config, field: str) -> list:
    """The prompt records of config.<field> ("prompt_fn" with prompt_fn_kwargs, or "eval_prompt_fn"); a file that
    is missing, empty or unreadable is a ConfigError naming the field."""
    from ddpo_group.data.prompts import load_prompts

    kwargs = dict(config.prompt_fn_kwargs) if field == "prompt_fn" else {}
    try:
        records = load_prompts(config[field], **kwargs)
    except (ValueError, OSError) as err:
        raise ConfigError(f"config.{field}={config[field]!r}: {' '.join(str(err).split())}") from None
    _check_edit_prompts(config, field, records)
    return records


def _check_edit_prompts(config, field, records):
    """An editing model's prompts carry readable source images of the run's resolution; other models' carry none
    (ddpo_group/data/edit_sources.py); checked before any model loads (the family is known by the model's name)."""
    from ddpo_group.diffusion.policy import family_for_model
    from ddpo_group.data.edit_sources import check_edit_prompts, record_sources

    family = family_for_model(config.pretrained.model)
    editing = getattr(family, "conditions_on_images", False)
    if not editing and not any(record_sources(record.metadata) for record in records):
        return
    try:
        check_edit_prompts(records, editing, config.sample.resolution, field, config.pretrained.model,
                           getattr(family, "max_source_images", 1))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def load_base_config():
    """ddpo_group/config/base.py's get_config(): every field with its default."""
    from ddpo_group.config.base import get_config

    return get_config()


def _unknown_fields(config, reference, prefix=""):
    unknown = []
    for key in config.keys():
        name = f"{prefix}{key}"
        if key not in reference:
            unknown.append(name)
        elif key in FREE_FORM_FIELDS and not prefix:
            continue
        elif isinstance(config[key], ml_collections.ConfigDict) and isinstance(reference[key], ml_collections.ConfigDict):
            unknown += _unknown_fields(config[key], reference[key], prefix=name + ".")
    return unknown


def _get(config, dotted):
    for part in dotted.split("."):
        config = config[part]
    return config


def field_paths(config, prefix=""):
    """Every dotted field name of a config (sub-configs included, their own names too)."""
    paths = []
    for key in config.keys():
        name = f"{prefix}{key}"
        paths.append(name)
        if isinstance(config[key], ml_collections.ConfigDict) and key not in FREE_FORM_FIELDS:
            paths += field_paths(config[key], prefix=name + ".")
    return paths


def closest_field(name, reference=None):
    """The known field name closest to `name` (difflib), or None."""
    import difflib

    paths = field_paths(reference if reference is not None else load_base_config())
    matches = difflib.get_close_matches(name, paths, n=1, cutoff=0.5)
    return matches[0] if matches else None


def _non_finite_floats(config, prefix=""):
    """Dotted names of float fields holding NaN or inf."""
    import math

    bad = []
    for key in config.keys():
        name, value = f"{prefix}{key}", config[key]
        if isinstance(value, ml_collections.ConfigDict):
            bad += _non_finite_floats(value, prefix=name + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(name)
    return bad


def _choice(value, choices, field):
    if value not in choices:
        raise ConfigError(f"config.{field}={value!r} is not one of {list(choices)}")


# The fixed evaluation draws this many images per prompt at most, at every evaluation.
MAX_EVAL_IMAGES_PER_PROMPT = 1024
# The largest seed: numpy's generators take 0 .. 2**32 - 1, and accelerate's set_seed adds the process index.
MAX_SEED = 2**31 - 1


def _positive(value, field, allow_zero=False):
    if value is None or (value < 0 if allow_zero else value <= 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"config.{field}={value!r} must be {bound}")


def _check_forward(config):
    """The forward-process objectives (train.objective 'nft' / 'awm'): what they use, and what they cannot."""
    from ddpo_group.algos.forward import WEIGHTINGS
    from ddpo_group.algos.losses import get_policy_loss

    train, forward = config.train, config.forward
    objective = f"config.train.objective={train.objective!r}"
    estimator = get_adv_estimator(config.algorithm.adv_estimator)
    if estimator.needs_values:
        raise ConfigError(
            f"{objective} trains on outcome advantages; algorithm.adv_estimator={config.algorithm.adv_estimator!r} "
            "needs a critic over reverse-process steps: use grpo, rloo or ddpo"
        )
    if estimator.needs_step_rewards:
        raise ConfigError(
            f"{objective} trains on outcome advantages; algorithm.adv_estimator={config.algorithm.adv_estimator!r} "
            "credits the reverse-process steps, which this objective does not keep: use grpo, rloo or ddpo"
        )
    if train.objective == "awm" and get_policy_loss(train.policy_loss).couples_steps:
        raise ConfigError(
            f"config.train.policy_loss={train.policy_loss!r} couples the steps of a trajectory; AWM's ratio is one "
            "per (sample, timestep): use train.policy_loss='vanilla'"
        )
    if train.skip_last_steps:
        raise ConfigError(f"config.train.skip_last_steps applies to train.objective='stepwise'; {objective}: set it to 0")
    _choice(forward.weighting, WEIGHTINGS, "forward.weighting")
    _positive(forward.num_timesteps, "forward.num_timesteps", allow_zero=True)
    if forward.num_timesteps > config.sample.num_steps:
        raise ConfigError(
            f"config.forward.num_timesteps={forward.num_timesteps} exceeds the sampling grid's sample.num_steps="
            f"{config.sample.num_steps}; use at most {config.sample.num_steps} (0: all)"
        )
    if not 0.0 < forward.nft_beta <= 1.0:
        raise ConfigError(f"config.forward.nft_beta={forward.nft_beta} must be in (0, 1] (DiffusionNFT's beta)")
    _positive(forward.old_decay_rate, "forward.old_decay_rate", allow_zero=True)
    if not 0.0 <= forward.old_decay_max < 1.0:
        raise ConfigError(
            f"config.forward.old_decay_max={forward.old_decay_max} must be in [0, 1): at 1 the sampling model "
            "would never follow the policy"
        )


def check_config(config, num_processes=1, has_gpu=None):
    """Raise ConfigError naming the field for a config that cannot run; returns the config.

    The modules of `config.plugins` are imported first, so that what they register is known.
    """
    try:
        import_plugins(config.get("plugins", ""))
    except PluginError as err:
        raise ConfigError(str(err)) from err
    unknown = _unknown_fields(config, load_base_config())
    renamed = [name for name in unknown if name in RENAMED_FIELDS]
    if renamed:
        raise ConfigError(f"config.{renamed[0]} no longer exists; set config.{RENAMED_FIELDS[renamed[0]]}")
    if unknown:
        hint = closest_field(unknown[0])
        raise ConfigError(
            f"unknown config field(s) {unknown}" + (f" (did you mean {hint!r}?)" if hint else "")
            + "; every field and its default is listed in ddpo_group/config/base.py"
        )
    non_finite = _non_finite_floats(config)
    if non_finite:
        name = non_finite[0]
        raise ConfigError(f"config.{name}={_get(config, name)} "
                          "is not a finite number; give a finite value")
    sample, train, algo = config.sample, config.train, config.algorithm
    _choice(algo.adv_estimator, registered_adv_estimators(), "algorithm.adv_estimator")
    _choice(train.timestep_selection, TIMESTEP_SELECTIONS, "train.timestep_selection")
    _choice(train.kl_type, KL_TYPES, "train.kl_type")
    _choice(train.loss_agg_mode, AGG_MODES, "train.loss_agg_mode")
    _choice(train.policy_loss, registered_policy_losses(), "train.policy_loss")
    _choice(config.mixed_precision, MIXED_PRECISIONS, "mixed_precision")
    _choice(config.log_with, LOG_WITH, "log_with")
    _choice(config.reward_aggregation, REWARD_AGGREGATIONS, "reward_aggregation")
    _choice(train.old_log_probs, OLD_LOG_PROBS, "train.old_log_probs")
    for field in ("num_epochs", "sample.num_steps", "sample.batch_size", "sample.num_batches_per_epoch",
                  "sample.group_size", "train.batch_size", "train.gradient_accumulation_steps",
                  "train.num_inner_epochs", "train.learning_rate", "train.max_grad_norm",
                  "train.clip_range", "train.adv_clip_max", "reward_workers", "lora_rank"):
        value = config
        for part in field.split("."):
            value = value[part]
        _positive(value, field)
    for field in ("seed", "eval_seed"):
        if not 0 <= config[field] <= MAX_SEED:
            raise ConfigError(f"config.{field}={config[field]} must be from 0 to 2**31 - 1")
    _positive(config.save_freq, "save_freq", allow_zero=True)
    _positive(config.num_checkpoint_limit, "num_checkpoint_limit", allow_zero=True)
    _positive(config.log_images_every, "log_images_every", allow_zero=True)
    _positive(config.eval_freq, "eval_freq", allow_zero=True)
    _positive(config.eval_images_per_prompt, "eval_images_per_prompt")
    if config.eval_images_per_prompt > MAX_EVAL_IMAGES_PER_PROMPT:
        raise ConfigError(
            f"config.eval_images_per_prompt={config.eval_images_per_prompt}: every evaluation would draw that many "
            f"images for each prompt; use at most {MAX_EVAL_IMAGES_PER_PROMPT} (the standard error of a mean over "
            "1024 rewards in [0, 1] is below 0.016), or score a checkpoint once with scripts/evaluate.py"
        )
    _positive(config.eval_grid_prompts, "eval_grid_prompts", allow_zero=True)
    _positive(config.train.grad_share_every, "train.grad_share_every", allow_zero=True)
    _positive(config.eval_batch_size, "eval_batch_size", allow_zero=True)
    _choice(train.objective, OBJECTIVES, "train.objective")
    forward_objective = train.objective != "stepwise"
    if forward_objective:
        _check_forward(config)
    if sample.eta < 0 or (sample.eta == 0 and not forward_objective):
        raise ConfigError(
            f"config.sample.eta={sample.eta} gives deterministic steps with no log-probability (DDIM's eta, "
            "or a flow model's noise level); RL needs eta > 0 (1.0 is the usual DDIM value); only the "
            "forward-process objectives (train.objective='nft' or 'awm') may sample deterministically"
        )
    _choice(sample.sde_type, ("",) + SDE_TYPES, "sample.sde_type")
    _choice(sample.cps_log_prob, CPS_LOG_PROBS, "sample.cps_log_prob")
    _choice(sample.flow_grid, FLOW_GRIDS, "sample.flow_grid")
    _positive(sample.flow_grid_shift, "sample.flow_grid_shift")
    if sample.cps_log_prob != "normalized" and sample.sde_type != "cps":
        raise ConfigError(
            f"config.sample.cps_log_prob={sample.cps_log_prob!r} is the log-prob of sample.sde_type='cps'; "
            f"sample.sde_type={sample.sde_type!r}: set sample.cps_log_prob='normalized' (the other steps have one form)"
        )
    # the offline models that step with DDIM (no flow-matching SDE, no Flow-GRPO KL), from the family registry;
    # imported here, not at the top: the families pull in every diffusers pipeline (1.5 s), which the CLI's
    # quick errors (an unknown field or variant) must not wait for
    from ddpo_group.diffusion.policy import FAMILIES

    ddim_models = {name for cls in FAMILIES.values() if not cls.supports_flow_grpo_kl for name in cls.offline_models}
    if sample.sde_type and config.pretrained.model in ddim_models:
        raise ConfigError(
            f"config.sample.sde_type={sample.sde_type!r} needs a flow-matching model (SD3, FLUX); "
            f"config.pretrained.model={config.pretrained.model!r} steps with DDIM (its noise is sample.eta): "
            "set sample.sde_type=''"
        )
    # (sample.cps_log_prob needs sde_type="cps", which the check above refuses for these models)
    if sample.flow_grid != "pipeline" and config.pretrained.model in ddim_models:
        raise ConfigError(
            f"config.sample.flow_grid={sample.flow_grid!r} needs a flow-matching model (SD3, FLUX); config.pretrained."
            f"model={config.pretrained.model!r} steps with DDIM: set sample.flow_grid='pipeline'"
        )
    if config.train.kl_type == "flow_grpo" and config.pretrained.model in ddim_models:
        raise ConfigError(
            f"config.train.kl_type='flow_grpo' is Flow-GRPO's KL of a flow-matching step; "
            f"config.pretrained.model={config.pretrained.model!r} steps with DDIM: use train.kl_type='gaussian'"
        )
    _positive(config.train.skip_last_steps, "train.skip_last_steps", allow_zero=True)
    if config.train.skip_last_steps >= sample.num_steps:
        raise ConfigError(
            f"config.train.skip_last_steps={config.train.skip_last_steps} leaves no step of sample.num_steps="
            f"{sample.num_steps} to train: use at most {sample.num_steps - 1}"
        )
    _choice(sample.sde_window, SDE_WINDOWS, "sample.sde_window")
    if sample.sde_type == "cps" and sample.eta > 1.0:
        raise ConfigError(
            f"config.sample.eta={sample.eta} is the noise level a of sample.sde_type='cps' (std = sigma' sin(a pi / 2)); "
            "it must lie in (0, 1]"
        )
    for field in ("sde_window_size", "sde_window_start", "max_sequence_length", "resolution"):
        _positive(sample[field], f"sample.{field}", allow_zero=True)
    _positive(sample.sde_window_shift_every, "sample.sde_window_shift_every")
    if sample.sde_window_size > sample.num_steps:
        raise ConfigError(
            f"config.sample.sde_window_size={sample.sde_window_size} exceeds sample.num_steps={sample.num_steps}; "
            "a window is at most every step (0 means every step)"
        )
    if sample.sde_window_size and sample.sde_window == "fixed" and sample.sde_window_start + sample.sde_window_size > sample.num_steps:
        raise ConfigError(
            f"config.sample.sde_window_start={sample.sde_window_start} with sde_window_size={sample.sde_window_size} "
            f"runs past the last of sample.num_steps={sample.num_steps} steps; choose a start <= "
            f"{sample.num_steps - sample.sde_window_size}"
        )
    if sample.guidance_scale < 1.0:
        raise ConfigError(f"config.sample.guidance_scale={sample.guidance_scale} must be >= 1 (1: no guidance)")
    total = sample.batch_size * num_processes
    if total % sample.group_size:
        raise ConfigError(
            f"config.sample.group_size={sample.group_size} does not divide the sampling batch of all processes "
            f"(sample.batch_size={sample.batch_size} x {num_processes} processes = {total}); "
            "choose a group_size that divides it"
        )
    per_epoch = sample.batch_size * sample.num_batches_per_epoch
    if per_epoch % train.batch_size:
        raise ConfigError(
            f"config.train.batch_size={train.batch_size} must divide the trajectories each process samples per "
            f"epoch (sample.batch_size x sample.num_batches_per_epoch = {per_epoch})"
        )
    if not 0.0 < train.timestep_fraction <= 1.0:
        raise ConfigError(f"config.train.timestep_fraction={train.timestep_fraction} must be in (0, 1]")
    estimator = get_adv_estimator(algo.adv_estimator)
    if train.timestep_selection in ("endpoints", "segment_start", "segment_sample") and not estimator.defines_endpoints:
        raise ConfigError(
            f"config.train.timestep_selection={train.timestep_selection!r} needs an estimator that defines segment "
            f"endpoints, such as algorithm.adv_estimator='group_ppo' (got {algo.adv_estimator!r})"
        )
    _positive(train.early_steps, "train.early_steps")
    if estimator.defines_endpoints and train.timestep_selection == "fraction":
        raise ConfigError(
            f"config.train.timestep_selection='fraction' contradicts algorithm.adv_estimator={algo.adv_estimator!r}, "
            "which chooses its steps itself; use 'endpoints' (train at the segment endpoints) or 'all'"
        )
    if train.timestep_selection != "fraction" and train.timestep_fraction != 1.0:
        raise ConfigError(
            f"config.train.timestep_fraction={train.timestep_fraction} has no effect unless "
            "train.timestep_selection='fraction'; set both"
        )
    tracking = config.per_prompt_stat_tracking
    _positive(tracking.buffer_size, "per_prompt_stat_tracking.buffer_size", allow_zero=True)
    _positive(tracking.min_count, "per_prompt_stat_tracking.min_count", allow_zero=True)
    if tracking.buffer_size and tracking.min_count > tracking.buffer_size:
        raise ConfigError(
            f"config.per_prompt_stat_tracking.min_count={tracking.min_count} exceeds buffer_size="
            f"{tracking.buffer_size}: the buffer could never be used; lower min_count or raise buffer_size (0: unbounded)"
        )
    if train.use_kl_loss and not train.use_reference_model:
        raise ConfigError("config.train.use_kl_loss=True needs config.train.use_reference_model=True")
    if train.use_kl_loss and train.beta < 0:
        raise ConfigError(f"config.train.beta={train.beta} must be >= 0")
    if not 0.0 < train.reference_model_mixup_alpha <= 1.0:
        raise ConfigError(
            f"config.train.reference_model_mixup_alpha={train.reference_model_mixup_alpha} must be in (0, 1]"
        )
    _positive(train.reference_update_freq, "train.reference_update_freq", allow_zero=True)
    if train.clip_ratio_c <= 1.0:
        raise ConfigError(f"config.train.clip_ratio_c={train.clip_ratio_c} must be > 1 (dual clip)")
    gp = config.group_ppo
    if not gp.min_threshold <= gp.variance_threshold <= gp.max_threshold:
        raise ConfigError(
            f"config.group_ppo.variance_threshold={gp.variance_threshold} must lie in "
            f"[group_ppo.min_threshold={gp.min_threshold}, group_ppo.max_threshold={gp.max_threshold}]"
        )
    _positive(gp.min_threshold, "group_ppo.min_threshold")
    _positive(gp.max_group_size, "group_ppo.max_group_size")
    _choice(gp.advantage_norm, ADVANTAGE_NORMS, "group_ppo.advantage_norm")
    _choice(config.critic.train_steps, CRITIC_TRAIN_STEPS, "critic.train_steps")
    _positive(config.critic.warmup_epochs, "critic.warmup_epochs", allow_zero=True)
    if config.critic.warmup_epochs and not estimator.needs_values:
        raise ConfigError(
            f"config.critic.warmup_epochs={config.critic.warmup_epochs} needs a critic; "
            f"algorithm.adv_estimator={algo.adv_estimator!r} has none (use gae or group_ppo, or set it to 0)"
        )
    if not 0.0 <= gp.target_compression < 1.0:
        raise ConfigError(f"config.group_ppo.target_compression={gp.target_compression} must be in [0, 1)")
    if config.mixed_precision == "fp16" and has_gpu is False:
        raise ConfigError(
            "config.mixed_precision='fp16' needs a GPU; on CPU use --config.mixed_precision=no (float32) "
            "or --config.mixed_precision=bf16 (CPU autocast)"
        )
    if config.log_with in ("wandb", "tensorboard"):
        import importlib.util

        package = "wandb" if config.log_with == "wandb" else "tensorboard"
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"config.log_with={config.log_with!r} needs the {package} package: pip install \"ddpo-group[{package}]\" "
                f"(or pip install {package}), or set --config.log_with=none"
            )
    if not config.reward_fn and not config.reward_weights:
        raise ConfigError("no reward: set config.reward_fn or config.reward_weights")
    logdir = os.path.expanduser(config.logdir)
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise ConfigError(f"config.logdir={config.logdir!r} is a file; give a directory (created if missing)")
    _check_rewards(config)
    _check_eval_rewards(config)
    _check_reward_prompts(config)
    return config


def _check_rewards(config):
    """The rewards the config names exist, before any model loads: a plain name is registered (or an entry point;
    the closest names are suggested), the file of a 'file.py:function' spec exists, and reward_kwargs names only
    rewards in use, and config.reward_timeout is >= 0. Servers and 'module:function' specs are resolved when the
    rewards are built."""
    if config.reward_timeout is not None and config.reward_timeout < 0:  # a negative limit would blame a healthy reward
        raise ConfigError(f"config.reward_timeout={config.reward_timeout!r} must be >= 0 (seconds a reward batch may "
                          "take; 0: no limit)")
    weights = config.reward_weights.to_dict()
    field = "reward_weights" if weights else "reward_fn"
    if weights and all(isinstance(w, (int, float)) and w == 0 for w in weights.values()):
        raise ConfigError("config.reward_weights: every weight is 0, so every reward and advantage would be 0 and "
                          "nothing would train; give at least one reward a non-zero weight")
    specs = [spec.strip() for spec in (weights or [config.reward_fn])]
    for spec in specs:
        if spec.startswith(("http://", "https://")):
            continue
        if ":" not in spec:
            if spec not in list_rewards():
                raise ConfigError(f"config.{field}: {unknown_reward_message(spec)}")
            continue
        target = spec.rsplit(":", 1)[0]
        if (target.endswith(".py") or "/" in target or os.sep in target) and not os.path.isfile(target):
            raise ConfigError(
                f"config.{field}: the file {target!r} of reward {spec!r} does not exist (looked in {os.getcwd()}); "
                "give the path of a .py file, absolute or relative to the current directory"
            )
    for spec, kwargs in config.reward_kwargs.to_dict().items():
        if not isinstance(kwargs, dict):
            raise ConfigError(f"config.reward_kwargs[{spec!r}] must be a mapping of keyword arguments, such as "
                              f"'{{\"{spec}\": {{\"name\": value}}}}', got {kwargs!r}")
        if kwargs and spec in specs and not spec.startswith(("http://", "https://")):
            try:  # a misspelt argument is named now, not on the first scored images
                check_reward_keywords(spec, resolve_reward(spec), kwargs)
            except Exception as err:  # that, or the reward cannot be imported
                raise ConfigError(f"config.reward_kwargs[{spec!r}]: {' '.join(str(err).split())}") from None
    _check_reward_modality(config, specs, field)
    unused = sorted(set(config.reward_kwargs.to_dict()) - set(weights or [config.reward_fn]))
    if unused:
        raise ConfigError(
            f"config.reward_kwargs names {unused}, which are not rewards in use ({sorted(weights or [config.reward_fn])}); "
            "key reward_kwargs by the reward's spec exactly as reward_fn or reward_weights give it"
        )


def _check_reward_prompts(config):
    """A reward that states what its prompts must hold (a `check_prompts(prompts, source, **its reward_kwargs)`
    on its class or function, e.g. the OCR reward's quoted text) sees the training and evaluation prompts here,
    before any model loads; its ValueError is a ConfigError naming the prompt field. The training rewards and the
    gold rewards of the evaluations (which take no reward_kwargs); registered names and entry points only: the other
    specs are resolved when the rewards are built."""
    from ddpo_group.evaluation.hacking import gold_specs

    kwargs_by_spec = config.reward_kwargs.to_dict()
    training = config.reward_weights.to_dict() or [config.reward_fn]
    specs = {spec.strip(): kwargs_by_spec.get(spec, {}) for spec in training}
    for spec in gold_specs(config.eval_rewards) if config.eval_freq else []:
        specs.setdefault(spec, {})
    for spec, kwargs in specs.items():
        check = None if ":" in spec else getattr(resolve_reward(spec), "check_prompts", None)
        if check is None:
            continue
        for field in ("prompt_fn", "eval_prompt_fn"):
            if not config[field]:
                continue
            prompts = load_config_prompts(config, field)
            try:
                check(prompts, source=str(config[field]), **kwargs)
            except ValueError as err:
                raise ConfigError(f"config.{field}={config[field]!r}: {' '.join(str(err).split())}") from None


def _check_reward_modality(config, specs, field):
    """config.reward_frames, and a video reward (registered with video=True) on an image model, named before any
    model loads (the model's family from its offline name or model_index.json, only when a video reward is named)."""
    frames = config.get("reward_frames", 4)
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 0:
        raise ConfigError(f"config.reward_frames={frames!r} must be an integer >= 0 (0: every frame of a video)")
    video_specs = []
    for spec in specs:
        try:
            if not spec.startswith(("http://", "https://")) and is_video_reward(resolve_reward(spec)):
                video_specs.append(spec)
        except Exception:
            continue  # named when the rewards are built
    if not video_specs:
        return
    from ddpo_group.diffusion.policy import family_for_model

    family = family_for_model(config.pretrained.model, config.pretrained.revision or None)
    if not family.video:
        raise ConfigError(
            f"config.{field}: reward {video_specs[0]!r} scores videos (registered with video=True) and "
            f"config.pretrained.model={config.pretrained.model!r} makes images ({family.family}); use an image reward"
        )


def _check_eval_rewards(config):
    """config.eval_rewards: comma-separated reward specs that resolve, scored at evaluations (eval_freq > 0)."""
    from ddpo_group.evaluation.hacking import gold_specs

    specs = gold_specs(config.eval_rewards)
    if specs and not config.eval_freq:
        raise ConfigError(
            f"config.eval_rewards={config.eval_rewards!r} is scored at the fixed-noise evaluations, and "
            "config.eval_freq=0 runs none: set config.eval_freq (e.g. 10), or config.eval_rewards=''"
        )
    for spec in specs:
        try:
            resolve_reward(spec)
        except Exception as err:  # an unknown name, a missing file or module, an error importing it
            raise ConfigError(f"config.eval_rewards: {err}") from err
    _check_reward_modality(config, specs, "eval_rewards")
