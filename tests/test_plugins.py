"""config.plugins: a user's module registers an estimator, a policy loss or a reward, selected by name;
the registries decide what a config may name."""

import textwrap

import numpy as np
import pytest

from ddpo_group.training import trainer as trainer_module
from ddpo_group.config.check import ConfigError, check_config
from helpers import cheap, grpo_advantages_numpy, make_config, read_dump

PLUGIN = textwrap.dedent(
    '''
    import torch

    from ddpo_group.algos.advantages import compute_grpo_advantages, register_adv_est
    from ddpo_group.algos.losses import get_policy_loss, register_policy_loss
    from ddpo_group.rewards.registry import register_reward


    @register_adv_est("plugin_double_grpo")
    def double_grpo(*, rewards=None, prompt_ids=None, mask, token_level_rewards=None, values=None, config=None, **options):
        advantages, _ = compute_grpo_advantages(rewards, prompt_ids, mask)
        return 2 * advantages, 2 * advantages


    @register_policy_loss("plugin_vanilla", couples_steps=True)
    def plugin_vanilla(old_log_prob, log_prob, advantages, mask, config):
        return get_policy_loss("vanilla")(old_log_prob, log_prob, advantages, mask, config)


    @register_reward("plugin_brightness")
    def brightness(images, prompts, metadata):
        return images.float().mean(dim=(1, 2, 3)).cpu(), {}
    '''
)


@pytest.fixture
def plugin_path(tmp_path):
    path = tmp_path / "my_plugin.py"
    path.write_text(PLUGIN)
    return str(path)


def test_a_plugin_estimator_loss_and_reward_train_by_name(tmp_path, plugin_path):
    config = make_config(
        tmp_path, **cheap(
            plugins=plugin_path, algorithm__adv_estimator="plugin_double_grpo", train__policy_loss="plugin_vanilla",
            reward_fn="plugin_brightness", debug_dump=True, train__adv_clip_max=100.0,
        )
    )
    trainer = trainer_module.Trainer(config)
    assert trainer.loss_couples_steps  # the property registered with the loss reaches the trainer
    run_dir = trainer.run()
    dump = read_dump(run_dir)
    expected = 2 * grpo_advantages_numpy(dump["rewards"], dump["prompt_ids"], np.asarray(dump["mask"]), clip=1e9)
    np.testing.assert_allclose(np.asarray(dump["advantages"]), expected, atol=1e-4)


def test_a_name_nobody_registered_is_refused_with_the_registered_ones(tmp_path):
    config = make_config(tmp_path, algorithm__adv_estimator="plugin_unknown")
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert "algorithm.adv_estimator" in str(info.value) and "'grpo'" in str(info.value)


def test_a_missing_plugin_is_one_error_naming_the_field(tmp_path):
    config = make_config(tmp_path, plugins="no_such_module_xyz")
    with pytest.raises(ConfigError) as info:
        check_config(config)
    message = str(info.value)
    assert message.startswith("config.plugins") and "no_such_module_xyz" in message and "\n" not in message


def test_a_plugin_that_raises_names_its_file(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError) as info:
        check_config(make_config(tmp_path, plugins=str(path)))
    assert str(path) in str(info.value) and "boom" in str(info.value)


def test_endpoints_need_an_estimator_that_defines_them(tmp_path, plugin_path):
    config = make_config(tmp_path, plugins=plugin_path, algorithm__adv_estimator="plugin_double_grpo",
                         train__timestep_selection="endpoints")
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert "train.timestep_selection" in str(info.value)


def test_the_merged_actor_tokens_field_names_its_replacement(tmp_path):
    config = make_config(tmp_path)
    with config.unlocked():
        config.group_ppo.actor_tokens = "all"
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert "group_ppo.actor_tokens" in str(info.value) and "train.timestep_selection" in str(info.value)
