"""Validation of a run configuration, before any model loads.

Every error names the config field and says what would fix it. The defaults themselves
live in config/base.py only; `load_base_config()` reads that file.
"""

import importlib.util
import os

import ml_collections

ADV_ESTIMATORS = ("ddpo", "grpo", "rloo", "gae", "group_ppo")
CRITIC_ESTIMATORS = ("gae", "group_ppo")
TIMESTEP_SELECTIONS = ("all", "fraction", "endpoints")
KL_TYPES = ("gaussian", "k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("vanilla", "gspo", "geo_mean")
MIXED_PRECISIONS = ("no", "fp16", "bf16")
LOG_WITH = ("none", "wandb", "tensorboard")
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
ACTOR_TOKENS = ("endpoints", "all")
OLD_LOG_PROBS = ("recompute", "sampled")
# Sub-configs whose keys are the user's own (kwargs, reward names).
FREE_FORM_FIELDS = ("prompt_fn_kwargs", "reward_weights", "reward_kwargs")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


def base_config_path():
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config", "base.py")


def load_base_config():
    """config/base.py's get_config(): every field with its default."""
    path = base_config_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"config/base.py not found at {path}; run from a checkout of ddpo-group")
    spec = importlib.util.spec_from_file_location("ddpo_group_config_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


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


def _choice(value, choices, field):
    if value not in choices:
        raise ConfigError(f"config.{field}={value!r} is not one of {list(choices)}")


def _positive(value, field, allow_zero=False):
    if value is None or (value < 0 if allow_zero else value <= 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"config.{field}={value!r} must be {bound}")


def check_config(config, num_processes=1, has_gpu=None):
    """Raise ConfigError naming the field for a config that cannot run; returns the config."""
    unknown = _unknown_fields(config, load_base_config())
    if unknown:
        raise ConfigError(
            f"unknown config field(s) {unknown}; every field and its default is listed in config/base.py"
        )
    sample, train, algo = config.sample, config.train, config.algorithm
    _choice(algo.adv_estimator, ADV_ESTIMATORS, "algorithm.adv_estimator")
    _choice(train.timestep_selection, TIMESTEP_SELECTIONS, "train.timestep_selection")
    _choice(train.kl_type, KL_TYPES, "train.kl_type")
    _choice(train.loss_agg_mode, LOSS_AGG_MODES, "train.loss_agg_mode")
    _choice(train.policy_loss, POLICY_LOSSES, "train.policy_loss")
    _choice(config.mixed_precision, MIXED_PRECISIONS, "mixed_precision")
    _choice(config.log_with, LOG_WITH, "log_with")
    _choice(config.reward_aggregation, REWARD_AGGREGATIONS, "reward_aggregation")
    _choice(config.group_ppo.actor_tokens, ACTOR_TOKENS, "group_ppo.actor_tokens")
    _choice(train.old_log_probs, OLD_LOG_PROBS, "train.old_log_probs")
    for field in ("num_epochs", "sample.num_steps", "sample.batch_size", "sample.num_batches_per_epoch",
                  "sample.group_size", "train.batch_size", "train.gradient_accumulation_steps",
                  "train.num_inner_epochs", "train.learning_rate", "train.max_grad_norm",
                  "train.clip_range", "train.adv_clip_max", "reward_workers", "lora_rank"):
        value = config
        for part in field.split("."):
            value = value[part]
        _positive(value, field)
    _positive(config.save_freq, "save_freq", allow_zero=True)
    _positive(config.num_checkpoint_limit, "num_checkpoint_limit", allow_zero=True)
    _positive(config.log_images_every, "log_images_every", allow_zero=True)
    if sample.eta <= 0:
        raise ConfigError(
            f"config.sample.eta={sample.eta} gives deterministic DDIM steps with no log-probability; "
            "RL needs eta > 0 (1.0 is the usual value)"
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
    if train.timestep_selection == "endpoints" and algo.adv_estimator != "group_ppo":
        raise ConfigError(
            "config.train.timestep_selection='endpoints' needs algorithm.adv_estimator='group_ppo' "
            f"(got {algo.adv_estimator!r}): only Group-PPO defines segment endpoints"
        )
    if algo.adv_estimator == "group_ppo" and train.timestep_selection == "fraction":
        raise ConfigError(
            "config.train.timestep_selection='fraction' contradicts algorithm.adv_estimator='group_ppo', which "
            "chooses its steps itself; use 'endpoints' or 'all' (with group_ppo.actor_tokens)"
        )
    if train.timestep_selection != "fraction" and train.timestep_fraction != 1.0:
        raise ConfigError(
            f"config.train.timestep_fraction={train.timestep_fraction} has no effect unless "
            "train.timestep_selection='fraction'; set both"
        )
    if algo.adv_estimator == "group_ppo":
        expected = "endpoints" if config.group_ppo.actor_tokens == "endpoints" else "all"
        if train.timestep_selection != expected:
            raise ConfigError(
                f"config.train.timestep_selection={train.timestep_selection!r} contradicts "
                f"config.group_ppo.actor_tokens={config.group_ppo.actor_tokens!r}; set "
                f"train.timestep_selection={expected!r} (actor_tokens 'endpoints' trains endpoints, 'all' every step)"
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
    if not 0.0 <= gp.target_compression < 1.0:
        raise ConfigError(f"config.group_ppo.target_compression={gp.target_compression} must be in [0, 1)")
    if config.mixed_precision == "fp16" and has_gpu is False:
        raise ConfigError(
            "config.mixed_precision='fp16' needs a GPU; on CPU use --config.mixed_precision=no (float32) "
            "or --config.mixed_precision=bf16 (CPU autocast)"
        )
    if not config.reward_fn and not config.reward_weights:
        raise ConfigError("no reward: set config.reward_fn or config.reward_weights")
    return config
