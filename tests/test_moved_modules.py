"""The flat layout's module names keep importing after the package was grouped by job (docs/architecture.md)."""

import importlib
import os
import subprocess
import sys
import warnings

import pytest

import ddpo_group
from ddpo_group.config.moved import MOVED_MODULES

PACKAGE_DIR = os.path.dirname(ddpo_group.__file__)
# the 28 modules that moved, written out here (not read from the table) so that a lost entry fails
OLD = ["trainer", "rollout", "epoch_advantages", "stepwise_update", "forward_training", "reference", "critic",
       "critic_designs", "sharding", "models", "batch", "diagnostics", "run_dir", "run_control", "metrics_log",
       "grids", "protocols", "protocol_report", "hacking", "prompts", "edit_sources", "shapes", "scenes",
       "stat_tracking", "hub", "plugins", "inspect", "config_check"]


def test_the_table_lists_every_moved_module_and_no_old_file_is_left():
    assert sorted(MOVED_MODULES) == sorted(f"ddpo_group.{name}" for name in OLD)
    for name in OLD:
        assert not os.path.exists(os.path.join(PACKAGE_DIR, f"{name}.py")), name


@pytest.mark.parametrize("name", OLD)
def test_an_old_name_is_its_new_module(name):
    new = importlib.import_module(MOVED_MODULES[f"ddpo_group.{name}"])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        old = importlib.import_module(f"ddpo_group.{name}")
    assert old is new
    assert new.__name__ == MOVED_MODULES[f"ddpo_group.{name}"]


def test_old_imports_in_a_fresh_process_warn_once_and_give_the_same_objects():
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    from ddpo_group.stat_tracking import PerPromptStatTracker as a\n"
        "    from ddpo_group import trainer\n"
        "from ddpo_group.algos.stat_tracking import PerPromptStatTracker as b\n"
        "from ddpo_group.training.trainer import Trainer\n"
        "assert a is b and trainer.Trainer is Trainer\n"
        "print(sorted(str(w.message).split()[0] for w in caught if w.category is DeprecationWarning))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['ddpo_group.stat_tracking', 'ddpo_group.trainer']"


def test_a_saved_runs_prompt_fn_naming_the_old_module_still_loads():
    from ddpo_group.data.prompts import load_prompts

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        old = load_prompts("ddpo_group.scenes:scene_training_prompts", n_per_tag=2, seed=0)
    new = load_prompts("ddpo_group.data.scenes:scene_training_prompts", n_per_tag=2, seed=0)
    assert old == new and len(new) > 0


def test_an_unknown_old_style_name_still_fails_as_before():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ddpo_group.no_such_module")
