"""train.lr_warmup_steps (issue 53, the learning ladder): the policy's learning rate rises linearly over the first
optimizer steps of a run, a resume going on where the warm-up stopped; 0 changes nothing; bad values are one line."""

import pytest

from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.training.trainer import Trainer, train
from helpers import cheap, make_config, read_metrics


def test_the_learning_rate_rises_over_the_warm_up_and_a_resume_goes_on_from_its_step(tmp_path):
    config = make_config(tmp_path, **cheap(num_epochs=2, train__lr_warmup_steps=5))
    lr = config.train.learning_rate
    run_dir = train(config)
    rows = read_metrics(run_dir)
    steps = [r["train/global_step"] for r in rows]
    per_epoch = steps[0]
    assert per_epoch >= 1 and steps == [per_epoch, 2 * per_epoch]
    # the lr of an epoch's last step k = global_step - 1: lr x min(1, (k + 1) / 5)
    assert [r["train/learning_rate"] for r in rows] == pytest.approx([lr * min(1, s / 5) for s in steps])
    config.resume_from, config.num_epochs = run_dir, 4
    Trainer(config, overrides={"resume_from", "num_epochs"}).run()
    rows = read_metrics(run_dir)
    assert [r["train/global_step"] for r in rows] == [per_epoch * (e + 1) for e in range(4)]
    assert [r["train/learning_rate"] for r in rows] == pytest.approx(
        [lr * min(1, per_epoch * (e + 1) / 5) for e in range(4)])


def test_no_warm_up_keeps_the_learning_rate(tmp_path):
    config = make_config(tmp_path, **cheap())
    rows = read_metrics(train(config))
    assert rows[0]["train/learning_rate"] == config.train.learning_rate


@pytest.mark.parametrize("value", [-1, True])
def test_a_bad_warm_up_is_one_line_naming_the_field(tmp_path, value):
    config = make_config(tmp_path, **cheap(train__lr_warmup_steps=value))
    with pytest.raises(ConfigError, match=r"train\.lr_warmup_steps=.*whole number of optimizer steps >= 0"):
        check_config(config)


def test_a_fractional_warm_up_on_the_command_line_is_one_line():
    from ddpo_group.config.fields import set_field

    config = make_config("/nonexistent")
    with pytest.raises(ConfigError, match=r"train\.lr_warmup_steps.*not a whole number"):
        set_field(config, "train.lr_warmup_steps=2.5")
