"""The import map of docs/architecture.md holds: no circle, and the arrows go one way.

The graph is read from the source (module-level and function-level imports alike, so a lazy import
cannot hide a circle); nothing is imported.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ddpo_group"


def _modules():
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _owner(name):
    """The package module that `name` (a module or a name inside one) belongs to, or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module):
    """The package modules `module` imports anywhere in its source (not its own parent packages)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            owner = _owner(target)
            if owner and owner != module and not module.startswith(owner + "."):
                found.add(owner)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _reachable(start):
    seen, todo = set(), [start]
    while todo:
        for target in GRAPH[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_import_graph_is_read():
    # a known arrow of each kind, so that an empty graph cannot pass the tests below
    assert "ddpo_group.diffusion.base" in GRAPH["ddpo_group.diffusion.sd"]
    assert "ddpo_group.rewards.base" in GRAPH["ddpo_group.rewards.shapes"]
    assert "ddpo_group.runs.run_dir" in GRAPH["ddpo_group.training.trainer"]


def test_no_module_imports_itself_through_others():
    circles = sorted(module for module in GRAPH if module in _reachable(module))
    assert circles == [], f"modules on an import circle: {circles}"


def _registering(decorator):
    """Modules with a class or function decorated with `decorator(...)` (they register into a registry)."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            decorators = getattr(node, "decorator_list", [])
            if any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == decorator for d in decorators):
                found.append(module)
                break
    return sorted(found)


def _family_modules():
    return _registering("register_family")


# A family module that extends another family's policy class (a subclass, its builders): the only family-to-family
# arrows. Wan 2.2 A14B's two experts and Wan image-to-video build on the Wan family (issue 46); the flow-matching UNet
# (sd_flow) takes Stable Diffusion's conditioning, trainable UNet and LoRA format from sd.
EXTENDS = {"ddpo_group.diffusion.wan_moe": {"ddpo_group.diffusion.wan"},
           "ddpo_group.diffusion.wan_i2v": {"ddpo_group.diffusion.wan", "ddpo_group.diffusion.wan_moe"},
           "ddpo_group.diffusion.sd_flow": {"ddpo_group.diffusion.sd"}}


def test_the_diffusion_base_imports_no_family_and_families_import_only_the_base():
    families = _family_modules()
    assert {"ddpo_group.diffusion.sd", "ddpo_group.diffusion.sd3", "ddpo_group.diffusion.flux",
            "ddpo_group.diffusion.qwen_image"} <= set(families)
    # the base imports no family; only the text-embedding cache, a leaf that imports nothing of the package
    assert _reachable("ddpo_group.diffusion.base") == {"ddpo_group.diffusion.text_cache"}
    assert _reachable("ddpo_group.diffusion.text_cache") == set()
    # the layers below the families: the base, the step math, LoRA, loading and the tiny builders, the flow base
    below = {f"ddpo_group.diffusion.{name}" for name in ("base", "gaussian", "ddim", "flow", "lora", "loading", "tiny",
                                                            "flow_policy", "tiny_chat", "text_cache")}
    for family in families:
        allowed = below | EXTENDS.get(family, set())
        assert _reachable(family) <= allowed, f"{family} imports {sorted(_reachable(family) - allowed)}"


def test_only_the_family_lookup_imports_the_families():
    families = set(_family_modules())
    importers = sorted(m for m in GRAPH if GRAPH[m] & families and not GRAPH[m] & families <= EXTENDS.get(m, set()))
    assert importers == ["ddpo_group.diffusion.policy"], importers


def test_the_reward_base_imports_no_reward_and_rewards_register_into_it():
    assert _reachable("ddpo_group.rewards.base") == set()
    reward_modules = _registering("register_reward")
    assert "ddpo_group.rewards.shapes" in reward_modules
    for module in reward_modules + ["ddpo_group.rewards.remote"]:
        assert "ddpo_group.rewards.registry" not in _reachable(module), module
    # only the resolver (and what sits above it) imports the reward modules
    importers = sorted(m for m in GRAPH if GRAPH[m] & set(reward_modules))
    assert importers == ["ddpo_group.rewards.registry"], importers


@pytest.mark.parametrize("module", [
    "runs.run_dir", "runs.run_control", "runs.metrics_log", "evaluation.evaluator", "training.rollout",
    "training.epoch_advantages", "training.stepwise_update", "training.models", "training.forward_training",
    "training.critic",
])
def test_the_trainers_collaborators_do_not_import_the_trainer(module):
    assert "ddpo_group.training.trainer" not in _reachable(f"ddpo_group.{module}")


def test_the_trainer_names_no_model_family():
    families = set(_family_modules())
    assert not GRAPH["ddpo_group.training.trainer"] & families
    assert not GRAPH["ddpo_group.training.models"] & families


def test_the_trainer_class_reads_in_one_sitting():
    tree = ast.parse(MODULES["ddpo_group.training.trainer"].read_text())
    trainer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 <= 300


def test_the_report_modules_import_down_their_list():
    # docs/architecture.md: page -> compare -> tables -> figures -> markup -> run, and inspect.py re-exports them
    order = ["page", "compare", "tables", "figures", "markup", "run"]
    for i, name in enumerate(order):
        mine = {m for m in GRAPH[f"ddpo_group.report.{name}"] if m.startswith("ddpo_group.report")}
        allowed = {f"ddpo_group.report.{below}" for below in order[i + 1:]}
        assert mine <= allowed, f"report/{name}.py imports {sorted(mine - allowed)}"
    assert _reachable("ddpo_group.report.run") == set()


# The house (docs/architecture.md): the package is grouped by job, so that the folder shows the loop's phases.
NOT_COUNTED = {"__init__.py", "_quiet.py", "assets", "__pycache__"}


def test_the_package_has_at_most_twelve_entries():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name not in NOT_COUNTED and not p.name.endswith(".pyc"))
    assert len(entries) <= 12, entries
    # the rooms docs/architecture.md draws
    assert {"training", "runs", "evaluation", "data", "algos", "diffusion", "rewards", "report", "config"} <= set(entries)


def test_the_map_names_every_room():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for entry in PACKAGE.iterdir():
        if entry.is_dir() and entry.name not in NOT_COUNTED:
            assert f"{entry.name}/" in text, f"docs/architecture.md does not draw ddpo_group/{entry.name}/"


def test_a_module_over_600_lines_says_at_its_top_why_it_is_one_room():
    long = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        if len(lines) > 600:
            head = "\n".join(lines[:40]).lower()
            if "one room" not in head and "one file" not in head:
                long.append((module, len(lines)))
    assert long == [], f"modules over 600 lines without their reason at the top: {long}"


def test_every_torch_load_in_the_package_is_weights_only():
    """torch.load unpickles arbitrary objects unless weights_only=True (unsafe on an untrusted checkpoint or message);
    the rollout process's reply once used weights_only=False."""
    import re

    root = Path(__file__).resolve().parent.parent / "ddpo_group"
    bad = []
    for path in root.rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\btorch\.load\(", line) and "weights_only=True" not in line:
                bad.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not bad, "torch.load without weights_only=True:\n" + "\n".join(bad)
