"""Where the modules of the flat layout went when the package was grouped by job (docs/architecture.md).

`ddpo_group.trainer`, `ddpo_group.stat_tracking`, ... keep importing, as the same module objects as their new
homes: a user's script, a plugin, or a saved run's config naming `ddpo_group.scenes:scene_training_prompts` still
works. New code imports the new names; `tests/test_moved_modules.py` keeps every old name working.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# the old module (directly under ddpo_group) -> its new home
MOVED_MODULES = {
    "ddpo_group." + old: "ddpo_group." + new for old, new in {
        "trainer": "training.trainer", "rollout": "training.rollout", "epoch_advantages": "training.epoch_advantages",
        "stepwise_update": "training.stepwise_update", "forward_training": "training.forward_training",
        "reference": "training.reference", "critic": "training.critic", "critic_designs": "training.critic_designs",
        "sharding": "training.sharding", "models": "training.models", "batch": "training.batch",
        "diagnostics": "training.diagnostics",
        "run_dir": "runs.run_dir", "run_control": "runs.run_control", "metrics_log": "runs.metrics_log",
        "grids": "runs.grids",
        "protocols": "evaluation.protocols", "protocol_report": "evaluation.protocol_report",
        "hacking": "evaluation.hacking",
        "prompts": "data.prompts", "edit_sources": "data.edit_sources", "shapes": "data.shapes",
        "scenes": "data.scenes",
        "stat_tracking": "algos.stat_tracking", "hub": "diffusion.hub", "plugins": "config.plugins",
        "inspect": "report.inspect", "config_check": "config.check",
    }.items()
}
# `ddpo_group.evaluation` was a module and is now the package of that name: its names live in
# `ddpo_group.evaluation.evaluator` (the package re-exports none, so that importing a protocol stays light).


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, new):
        self.new = new

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        # the import system reads the module back from sys.modules: the old name becomes the new module itself
        sys.modules[module.__name__] = importlib.import_module(self.new)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; the old name keeps working", DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _MovedLoader(new))


def install():
    """Let the old module names import (once per process)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
