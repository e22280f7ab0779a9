"""The config checks' registry: `ConfigError`, `register_config_check`, the sections in walk order, two helpers.

Each part of the package checks its own fields where its code lives and registers the check here with
`@register_config_check(section)`; `ddpo_group.config.check.check_config` imports those modules and walks the
sections in SECTIONS order (then any section a plugin added, in the order it was first registered). A check is
`check(config, machine)`: `machine` is a `Machine` (the number of processes, whether a GPU is there; None: not
known). It raises `ConfigError` naming the field and the fix. Imports nothing of the package, so that every
checking module may import it (docs/architecture.md: no import circle).

    from ddpo_group.config.registry import check_positive, register_config_check

    @register_config_check("training")
    def check_my_field(config, machine):
        check_positive(config.train.my_field, "train.my_field")
"""

from collections import namedtuple

# The walk's order: the field names first (the CLI's quick errors), then what each part of the loop reads.
SECTIONS = ("fields", "algorithm", "sampling", "family", "training", "advantages", "critic", "model", "run",
            "rewards", "evaluation", "prompts")

Machine = namedtuple("Machine", ["num_processes", "has_gpu"])

_CHECKS = {}  # section -> {(module, qualified name): check}, in registration order


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


def register_config_check(section):
    """Decorator: run `check(config, machine)` in `section` of the config walk. Registering the same module and
    function again (a plugin imported twice) replaces it."""
    if not isinstance(section, str) or not section:
        raise ValueError(f"register_config_check: the section must be a non-empty name, got {section!r}")

    def decorator(check):
        _CHECKS.setdefault(section, {})[(check.__module__, check.__qualname__)] = check
        return check

    return decorator


def registered_checks(section=None):
    """The registered checks in walk order: (section, check) pairs, or the checks of one `section`."""
    if section is not None:
        return list(_CHECKS.get(section, {}).values())
    order = list(SECTIONS) + [name for name in _CHECKS if name not in SECTIONS]
    return [(name, check) for name in order for check in _CHECKS.get(name, {}).values()]


def check_choice(value, choices, field):
    """ConfigError unless `value` is one of `choices` (config.<field>)."""
    if value not in choices:
        raise ConfigError(f"config.{field}={value!r} is not one of {list(choices)}")


def check_positive(value, field, allow_zero=False):
    """ConfigError unless `value` > 0 (>= 0 with allow_zero) (config.<field>)."""
    if value is None or (value < 0 if allow_zero else value <= 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"config.{field}={value!r} must be {bound}")
