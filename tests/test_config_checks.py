"""The config checks live beside what they check; `check_config` is a short walk over them (issue 45 item 2).

Each module registers its checks with `register_config_check(section)` (ddpo_group/config/registry.py);
`check_config` imports the modules and walks the sections in order, a model family's own rules come from
`DiffusionPolicy.check_config`, and a plugin may add a section of its own.
"""

import ast
import inspect
import textwrap

import pytest

from ddpo_group.config import check as check_module
from ddpo_group.config import registry
from ddpo_group.config.check import ConfigError, check_config, register_config_check, registered_checks
from helpers import make_config

# Every check the package registers: its section and the module of what it checks (docs/architecture.md).
WHERE = {
    "check_field_names": ("fields", "ddpo_group.config.fields"),
    "check_finite_numbers": ("fields", "ddpo_group.config.fields"),
    "check_run_length_and_precision": ("fields", "ddpo_group.config.fields"),
    "check_seeds": ("fields", "ddpo_group.config.fields"),
    "check_adv_estimator": ("algorithm", "ddpo_group.algos.advantages"),
    "check_loss_fields": ("algorithm", "ddpo_group.algos.losses"),
    "check_drift_losses": ("algorithm", "ddpo_group.algos.drift_losses"),
    "check_objective": ("algorithm", "ddpo_group.algos.forward"),
    "check_preference_objective": ("algorithm", "ddpo_group.training.preference_training"),
    "check_sampling": ("sampling", "ddpo_group.training.rollout"),
    "check_group_noise": ("sampling", "ddpo_group.training.rollout"),
    "check_family": ("family", "ddpo_group.diffusion.policy"),
    "check_update_fields": ("training", "ddpo_group.training.stepwise_update"),
    "check_step_selection": ("training", "ddpo_group.training.stepwise_update"),
    "check_reference": ("training", "ddpo_group.training.reference"),
    "check_async_rollout": ("training", "ddpo_group.training.async_rollout"),
    "check_stat_tracking": ("advantages", "ddpo_group.algos.stat_tracking"),
    "check_group_ppo": ("advantages", "ddpo_group.algos.grouping"),
    "check_critic_training": ("critic", "ddpo_group.training.critic"),
    "check_critic_design": ("critic", "ddpo_group.training.critic_designs"),
    "check_lora_rank": ("model", "ddpo_group.training.models"),
    "check_sharding": ("model", "ddpo_group.training.sharding"),
    "check_compile": ("model", "ddpo_group.training.speed"),
    "check_attention_backend": ("model", "ddpo_group.training.speed"),
    "check_run_dir_fields": ("run", "ddpo_group.runs.run_dir"),
    "check_logging": ("run", "ddpo_group.runs.metrics_log"),
    "check_perf_config": ("run", "ddpo_group.training.perf"),
    "check_reward_fields": ("rewards", "ddpo_group.rewards.checks"),
    "check_rewards": ("rewards", "ddpo_group.rewards.checks"),
    "check_evaluation": ("evaluation", "ddpo_group.evaluation.evaluator"),
    "check_eval_rewards": ("evaluation", "ddpo_group.evaluation.evaluator"),
    "check_reward_prompts": ("prompts", "ddpo_group.rewards.checks"),
}


@pytest.fixture
def config(tmp_path):
    config = make_config(tmp_path)
    check_config(config)  # a valid config; the walk has imported every registering module
    return config


@pytest.fixture
def own_registry(monkeypatch):
    """The registry as it is, restored after the test (checks registered here do not outlive it)."""
    monkeypatch.setattr(registry, "_CHECKS", {section: dict(checks) for section, checks in registry._CHECKS.items()})


def test_check_config_is_a_short_walk():
    tree = ast.parse(textwrap.dedent(inspect.getsource(check_module.check_config)))
    function = tree.body[0]
    assert function.end_lineno - function.lineno + 1 <= 60


def test_every_check_lives_in_the_module_of_what_it_checks(config):
    found = {check.__name__: (section, check.__module__) for section, check in registered_checks()
             if check.__module__.startswith("ddpo_group.")}
    assert found == WHERE


def test_the_walk_visits_the_sections_in_order(config, own_registry):
    seen = []
    for section in reversed(registry.SECTIONS):  # registered in the reverse order: the walk orders them
        register_config_check(section)(lambda config, machine, section=section: seen.append(section))
    check_config(config)
    assert seen == list(registry.SECTIONS)
    assert [section for section, _ in registered_checks()] == sorted(
        (section for section, _ in registered_checks()), key=registry.SECTIONS.index)


def test_the_machine_reaches_the_checks(config, own_registry):
    machines = []
    register_config_check("model")(lambda config, machine: machines.append(machine))
    check_config(config, num_processes=3, has_gpu=False)
    assert machines == [registry.Machine(3, False)]


def test_the_family_of_the_model_checks_the_config(config, monkeypatch):
    from ddpo_group.diffusion.policy import FAMILIES

    calls = []
    sd3 = FAMILIES["sd3"]
    monkeypatch.setattr(sd3, "check_config", classmethod(lambda cls, config: calls.append((cls, config))))
    config.pretrained.model = "tiny-sd3"
    check_config(config)
    assert calls == [(sd3, config)]
    # Stable Diffusion's own rule (it steps with DDIM), raised as its ValueError and reported as a ConfigError
    config.pretrained.model = "tiny-shapes"
    config.sample.flow_grid = "dance"
    with pytest.raises(ConfigError, match=r"config.sample.flow_grid='dance' needs a flow-matching model"):
        check_config(config)
    assert len(calls) == 1  # the SD model's walk did not ask SD3


def test_a_plugin_registers_a_check_of_its_own_section(tmp_path, own_registry):
    plugin = tmp_path / "lucky_plugin.py"
    plugin.write_text(textwrap.dedent(
        '''
        from ddpo_group.config.check import ConfigError, register_config_check


        @register_config_check("lucky")
        def check_seed(config, machine):
            if config.seed == 13:
                raise ConfigError("config.seed=13 is refused by lucky_plugin; choose another seed")
        '''
    ))
    config = make_config(tmp_path, plugins=str(plugin), seed=13)
    with pytest.raises(ConfigError, match=r"^config.seed=13 is refused by lucky_plugin; choose another seed$"):
        check_config(config)
    assert registered_checks()[-1][0] == "lucky"  # after the package's sections
    config.seed = 42
    check_config(config)


def test_a_section_needs_a_name():
    with pytest.raises(ValueError, match="section must be a non-empty name"):
        register_config_check("")


def test_the_registry_imports_nothing_of_the_package():
    # every checking module imports it, and check_config imports them: the registry must stay below them all
    tree = ast.parse(inspect.getsource(registry))
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.startswith("ddpo_group")]
