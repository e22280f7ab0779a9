"""Validation of a run configuration, before any model loads: `check_config`, a walk over the registered checks.

Every part of the package checks its own fields where its code lives and registers the check with
`register_config_check(section)` (ddpo_group/config/registry.py, which imports nothing of the package); the walk
below imports those modules and runs the sections in order. Every error names the config field and says what would
fix it. Where each check lives:

    fields       config/fields.py          unknown or renamed fields, non-finite numbers, num_epochs, precision, seeds
    algorithm    algos/advantages.py       the estimator;  algos/losses.py: KL type, aggregation, policy loss, clips
                 algos/drift_losses.py     dppo's trust region, grpo_guard's reweighting, their pi_old recompute
                 algos/forward.py          train.objective and the forward-process objectives (nft, awm)
                 training/preference_training.py   the preference objectives (dgpo, dpo) and the preference file
    sampling     training/rollout.py       config.sample: batch and groups, step noise, time grid, SDE window
    family       diffusion/policy.py       the family's own `DiffusionPolicy.check_config` (SD: DDIM only)
    training     training/stepwise_update.py   the update's batches and which steps train;
                 training/reference.py     the KL reference
    advantages   algos/stat_tracking.py, algos/grouping.py   per-prompt tracking, Group-PPO
    critic       training/critic.py, training/critic_designs.py
    model        training/models.py (lora_rank), training/sharding.py
    run          runs/run_dir.py (checkpoints, logdir), runs/metrics_log.py (trackers, sample grids)
    rewards      rewards/checks.py         the rewards named, their kwargs, their modality
    evaluation   evaluation/evaluator.py   the fixed-noise evaluation, eval_rewards
    prompts      rewards/checks.py         a reward's own rules for its prompts (check_prompts)

Names that a registry defines (advantage estimators, policy losses, ...) are checked against that registry, so a
name registered by a plugin (`config.plugins`) is accepted like a built-in one; a plugin may register checks too.
The defaults live in ddpo_group/config/base.py only; `load_base_config()` returns them.
"""

from ddpo_group.config.fields import FREE_FORM_FIELDS, MAX_SEED, closest_field, field_paths, load_base_config  # noqa: F401
from ddpo_group.config.plugins import PluginError, import_plugins
from ddpo_group.config.registry import (  # noqa: F401  (re-exported: the package and plugins import them from here)
    SECTIONS,
    ConfigError,
    Machine,
    check_choice,
    check_positive,
    register_config_check,
    registered_checks,
)
from ddpo_group.data.prompts import load_config_prompts  # noqa: F401  (re-exported)


def check_config(config, num_processes=1, has_gpu=None):
    """Raise ConfigError naming the field for a config that cannot run; returns the config.

    num_processes: the processes that sample together (a group may span them); has_gpu: False refuses fp16
    (None: not known). The modules of `config.plugins` are imported first, so that what they register is known.
    """
    try:
        import_plugins(config.get("plugins", ""))
    except PluginError as err:
        raise ConfigError(str(err)) from err
    machine = Machine(num_processes, has_gpu)
    # The field names first, before the modules below load (the families pull in every diffusers pipeline, 1.5 s):
    # the CLI's quick errors (an unknown field or variant) do not wait for them.
    for check in registered_checks("fields"):
        check(config, machine)
    # The modules that register checks, top-down (docs/architecture.md); importing one registers its checks.
    from ddpo_group.algos import advantages, drift_losses, forward, grouping, losses, stat_tracking  # noqa: F401
    from ddpo_group.diffusion import policy  # noqa: F401
    from ddpo_group.evaluation import evaluator  # noqa: F401
    from ddpo_group.rewards import checks  # noqa: F401
    from ddpo_group.runs import metrics_log, run_dir  # noqa: F401
    from ddpo_group.training import async_rollout, critic, critic_designs, models, reference, rollout, sharding  # noqa: F401
    from ddpo_group.training import preference_training, stepwise_update  # noqa: F401

    for section, check in registered_checks():
        if section != "fields":
            check(config, machine)
    return config
