"""User plugins: modules imported before a config is validated (`config.plugins`).

A plugin registers what a run then selects by name: an advantage estimator
(`register_adv_est`), a policy loss (`register_policy_loss`), a reward (`register_reward`).

    # my_algos.py
    from ddpo_group.algos.advantages import register_adv_est, compute_grpo_advantages

    @register_adv_est("grpo_median")
    def grpo_median(*, rewards=None, prompt_ids=None, mask, token_level_rewards=None, values=None, config=None, **options):
        ...

    accelerate launch scripts/train.py --config config/grpo.py:tiny \
        --config.plugins=my_algos.py --config.algorithm.adv_estimator=grpo_median

`config.plugins` is a comma-separated list of importable module names (`my_package.algos`) or
paths of Python files (`path/to/my_algos.py`). Importing the same entry again returns the module
already imported, so every process (and every check) may call `import_plugins`.
"""

import importlib
import importlib.util
import os
import sys


class PluginError(ValueError):
    """A plugin that cannot be imported; the message names config.plugins, the entry and the cause."""


_IMPORTED_FILES = {}  # absolute path -> module


def _module_name_for_path(path):
    # named after the file, so that a copy of the same plugin elsewhere registers the same names again
    # (the registries accept a re-registration of the same module and function name)
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"ddpo_group_plugin_{stem}"


def import_plugin(entry):
    """Import one plugin: a module name, or a path to a .py file. Returns the module."""
    if entry.endswith(".py") or os.sep in entry or "/" in entry:
        path = os.path.abspath(os.path.expanduser(entry))
        if not os.path.isfile(path):
            raise PluginError(f"config.plugins: {entry!r} is not a file; give a .py path or an importable module name")
        if path in _IMPORTED_FILES:
            return _IMPORTED_FILES[path]
        name = _module_name_for_path(path)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[name]
            raise PluginError(f"config.plugins: importing {path} failed: {type(err).__name__}: {err}") from err
        _IMPORTED_FILES[path] = module
        return module
    try:
        return importlib.import_module(entry)
    except ModuleNotFoundError as err:
        raise PluginError(
            f"config.plugins: no module named {entry!r} ({err}); install it, add its directory to PYTHONPATH, "
            "or give the path of its .py file"
        ) from err
    except Exception as err:
        raise PluginError(f"config.plugins: importing {entry!r} failed: {type(err).__name__}: {err}") from err


def import_plugins(spec):
    """Import every entry of a comma-separated `config.plugins` string (empty: none). Returns the modules."""
    entries = [entry.strip() for entry in (spec or "").split(",") if entry.strip()]
    return [import_plugin(entry) for entry in entries]
