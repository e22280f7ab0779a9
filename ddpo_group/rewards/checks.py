"""The reward fields' config checks, before any model loads: the rewards named exist (a registered name, an entry
point, a 'file.py:function' whose file is there), their keyword arguments are theirs, a video reward has a video
model, and a reward that states what its prompts must hold (`check_prompts` on its class or function, e.g. the OCR
reward's quoted text) sees the training and evaluation prompts. The reward classes keep their own rules
(`check_prompts`, `check_reward_keywords`); this module walks the config's specs to them.
"""

import os

from ddpo_group.config.registry import ConfigError, check_choice, check_positive, register_config_check
from ddpo_group.rewards.base import is_video_reward
from ddpo_group.rewards.combine import REWARD_AGGREGATIONS
from ddpo_group.rewards.registry import check_reward_keywords, list_rewards, resolve_reward, unknown_reward_message


@register_config_check("rewards")
def check_reward_fields(config, machine):
    """A reward is named; the aggregation is known; the reward workers > 0."""
    check_choice(config.reward_aggregation, REWARD_AGGREGATIONS, "reward_aggregation")
    check_positive(config.reward_workers, "reward_workers")
    if not config.reward_fn and not config.reward_weights:
        raise ConfigError("no reward: set config.reward_fn or config.reward_weights")


@register_config_check("rewards")
def check_rewards(config, machine):
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
    check_reward_modality(config, specs, field)
    unused = sorted(set(config.reward_kwargs.to_dict()) - set(weights or [config.reward_fn]))
    if unused:
        raise ConfigError(
            f"config.reward_kwargs names {unused}, which are not rewards in use ({sorted(weights or [config.reward_fn])}); "
            "key reward_kwargs by the reward's spec exactly as reward_fn or reward_weights give it"
        )


def check_reward_modality(config, specs, field):
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


@register_config_check("prompts")
def check_reward_prompts(config, machine):
    """A reward that states what its prompts must hold (a `check_prompts(prompts, source, **its reward_kwargs)`
    on its class or function, e.g. the OCR reward's quoted text) sees the training and evaluation prompts here,
    before any model loads; its ValueError is a ConfigError naming the prompt field. The training rewards and the
    gold rewards of the evaluations (which take no reward_kwargs); registered names and entry points only: the other
    specs are resolved when the rewards are built."""
    from ddpo_group.data.prompts import load_config_prompts
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
