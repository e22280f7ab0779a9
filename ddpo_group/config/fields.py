"""The config's field names and plain fields: unknown or renamed names, non-finite numbers, num_epochs, the precision,
the seeds.

The defaults live in ddpo_group/config/base.py only; `load_base_config()` returns them. The checks here are the
walk's first section ("fields"): they import nothing heavy, so that a misspelt field is named at once.
"""

import math

import ml_collections

from ddpo_group.config.registry import ConfigError, check_choice, check_positive, register_config_check

MIXED_PRECISIONS = ("no", "fp16", "bf16")
# The largest seed: numpy's generators take 0 .. 2**32 - 1, and accelerate's set_seed adds the process index.
MAX_SEED = 2**31 - 1
# Sub-configs whose keys are the user's own (kwargs, reward names).
FREE_FORM_FIELDS = ("prompt_fn_kwargs", "reward_weights", "reward_kwargs")
# Fields that were renamed or merged: what to set instead.
RENAMED_FIELDS = {
    "group_ppo.actor_tokens": "train.timestep_selection ('endpoints': the actor trains at the segment endpoints, "
    "'all': at every valid step with the segment advantage)",
}


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


def set_field(config, assignment):
    """Sets one "FIELD=VALUE" assignment (a benchmark's --set) in `config`: FIELD dotted (train.learning_rate),
    VALUE a JSON value typed as the field's default is (an int field takes 100 or 1e2, a bool one true / false; a
    string field takes the text as written, or a JSON string's text: "grpo_guard" with its quotes is grpo_guard).
    A field the config lacks, or a value its type cannot take, is a one-line ConfigError naming the assignment
    (and the closest field)."""
    import json

    key, equals, text = assignment.partition("=")
    if not equals or not key:
        raise ConfigError(f"--set {assignment!r}: write FIELD=VALUE, e.g. --set train.learning_rate=1e-3")
    node, *parents, leaf = config, *key.split(".")
    for part in parents:
        node = node[part] if part in node and isinstance(node[part], ml_collections.ConfigDict) else None
        if node is None:
            break
    if node is None or leaf not in node:
        hint = closest_field(key, config)
        raise ConfigError(f"--set {assignment!r}: the config has no field {key!r}"
                          + (f" (did you mean {hint!r}?)" if hint else "")
                          + "; every field is listed in ddpo_group/config/base.py")
    old = node[leaf]
    if isinstance(old, str):
        if len(text) >= 2 and text[0] == text[-1] == '"':
            try:  # the quotes a JSON string (or a shell habit) wraps it in are not part of the value
                text = json.loads(text)
            except ValueError:
                pass
        node[leaf] = text
        return config
    try:
        value = json.loads(text)
        if isinstance(old, bool) or old is None or isinstance(old, (dict, list, ml_collections.ConfigDict)):
            ok = old is None or isinstance(value, type(old) if not isinstance(old, ml_collections.ConfigDict) else dict)
            if not ok:
                raise ValueError(f"not a {type(old).__name__}")
        elif isinstance(old, int):
            if isinstance(value, bool) or float(value) != int(value):
                raise ValueError("not a whole number")
            value = int(value)
        elif isinstance(old, float):
            if isinstance(value, bool):
                raise ValueError("not a number")
            value = float(value)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"--set {assignment!r}: {text!r} is not a value config.{key} can take "
                          f"(its default is {old!r}; {err})") from None
    node[leaf] = value
    return config


def _non_finite_floats(config, prefix=""):
    """Dotted names of float fields holding NaN or inf."""
    bad = []
    for key in config.keys():
        name, value = f"{prefix}{key}", config[key]
        if isinstance(value, ml_collections.ConfigDict):
            bad += _non_finite_floats(value, prefix=name + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(name)
    return bad


@register_config_check("fields")
def check_field_names(config, machine):
    """Every field is one of base.py's (a renamed one says what replaced it, an unknown one its closest name)."""
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


@register_config_check("fields")
def check_finite_numbers(config, machine):
    """No float field holds NaN or inf."""
    non_finite = _non_finite_floats(config)
    if non_finite:
        name = non_finite[0]
        raise ConfigError(f"config.{name}={_get(config, name)} "
                          "is not a finite number; give a finite value")


@register_config_check("fields")
def check_run_length_and_precision(config, machine):
    """config.num_epochs > 0; config.mixed_precision is known, and fp16 has a GPU (machine.has_gpu False: none)."""
    check_choice(config.mixed_precision, MIXED_PRECISIONS, "mixed_precision")
    check_positive(config.num_epochs, "num_epochs")
    if config.mixed_precision == "fp16" and machine.has_gpu is False:
        raise ConfigError(
            "config.mixed_precision='fp16' needs a GPU; on CPU use --config.mixed_precision=no (float32) "
            "or --config.mixed_precision=bf16 (CPU autocast)"
        )


@register_config_check("fields")
def check_seeds(config, machine):
    """config.seed and eval_seed from 0 to MAX_SEED."""
    for field in ("seed", "eval_seed"):
        if not 0 <= config[field] <= MAX_SEED:
            raise ConfigError(f"config.{field}={config[field]} must be from 0 to 2**31 - 1")
