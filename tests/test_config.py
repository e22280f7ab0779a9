"""Config validation: a config that cannot run stops before any model loads, naming the field."""

import os
import subprocess

import pytest
import torch

from ddpo_group.training import models as models_module
from ddpo_group.training import trainer as trainer_module
from ddpo_group.config.check import ConfigError, check_config
from helpers import PYTHON, ROOT, make_config, subprocess_env


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any model load fails the test: config errors must come first."""

    def load_policy(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(models_module, "load_policy", load_policy)


def _assert_rejected(tmp_path, config, field):
    with pytest.raises(ConfigError) as info:
        trainer_module.Trainer(config)
    assert field in str(info.value)
    assert not (tmp_path / "r").exists(), "the run directory was created before the config was validated"
    return str(info.value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


VARIANTS = ["sd15", "ddpo", "group_ppo", "group_ppo_alg2", "tiny", "tiny_ddpo", "tiny_group_ppo", "tiny_group_ppo_alg2",
            "tiny_gae", "test", "sd35", "flux", "tiny_scenes", "tiny_scenes_sd", "tiny_scenes_flow"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_shipped_variant_passes_the_check(tmp_path, variant):
    check_config(make_config(tmp_path, variant))


def test_test_variant_passes_on_cpu(tmp_path):
    check_config(make_config(tmp_path), num_processes=1, has_gpu=False)


def test_unknown_field_is_named(tmp_path, no_model_loading):
    config = make_config(tmp_path)
    with config.unlocked():
        config.train.foo = 1
    message = _assert_rejected(tmp_path, config, "train.foo")
    assert "config/base.py" in message


def test_group_size_not_dividing_the_batch(tmp_path, no_model_loading):
    config = make_config(tmp_path, sample__batch_size=4, sample__group_size=3)
    _assert_rejected(tmp_path, config, "sample.group_size")


def test_group_size_checked_against_all_processes():
    # 3 processes x 4 = 12 trajectories: group_size 3 divides it although it does not divide 4
    config = make_config("unused", sample__batch_size=4, sample__group_size=3)
    check_config(config, num_processes=3)
    with pytest.raises(ConfigError, match="sample.group_size"):
        check_config(config, num_processes=2)


def test_kl_loss_without_reference_model(tmp_path, no_model_loading):
    config = make_config(tmp_path, train__use_kl_loss=True, train__use_reference_model=False)
    _assert_rejected(tmp_path, config, "train.use_reference_model")


def test_endpoints_selection_needs_group_ppo(tmp_path, no_model_loading):
    config = make_config(tmp_path, train__timestep_selection="endpoints", algorithm__adv_estimator="grpo")
    message = _assert_rejected(tmp_path, config, "train.timestep_selection")
    assert "group_ppo" in message


def test_eta_zero(tmp_path, no_model_loading):
    config = make_config(tmp_path, sample__eta=0.0)
    _assert_rejected(tmp_path, config, "sample.eta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is valid with a GPU")
def test_fp16_on_cpu(tmp_path, no_model_loading):
    config = make_config(tmp_path, mixed_precision="fp16")
    message = _assert_rejected(tmp_path, config, "mixed_precision")
    assert "--config.mixed_precision=no" in message


def test_unknown_adv_estimator_lists_the_choices(tmp_path, no_model_loading):
    config = make_config(tmp_path, algorithm__adv_estimator="ppo2")
    message = _assert_rejected(tmp_path, config, "algorithm.adv_estimator")
    for name in ("ddpo", "grpo", "gae", "group_ppo"):
        assert name in message


def test_train_batch_size_must_divide_the_epoch(tmp_path, no_model_loading):
    config = make_config(tmp_path, sample__batch_size=4, sample__num_batches_per_epoch=1, train__batch_size=3)
    _assert_rejected(tmp_path, config, "train.batch_size")


def test_unknown_variant_on_the_command_line(tmp_path):
    result = subprocess.run(
        [PYTHON, os.path.join(ROOT, "scripts", "train.py"), "--config", "config/grpo.py:nope",
         f"--config.logdir={tmp_path}"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "'nope'" in result.stderr
    assert "tiny" in result.stderr and "test" in result.stderr  # the variants to choose from
    assert not any(tmp_path.iterdir())
    assert len(result.stderr.strip().splitlines()) == 1  # one line, no traceback


@pytest.mark.parametrize("argument", ["tinyy", "config/grpo.py:tinyy"])
def test_a_misspelt_variant_is_one_line_with_the_closest_name(argument):
    from ddpo_group.cli import _unknown_variant

    message = _unknown_variant(["--config", argument])
    assert "'tinyy'" in message and "did you mean 'tiny'?" in message and "\n" not in message
    assert _unknown_variant([f"--config={argument.replace('tinyy', 'tiny')}"]) is None
    assert _unknown_variant(["--config", "my_configs.py:anything"]) is None  # a user's file judges its own argument


def test_train_runs_from_any_directory_with_a_built_in_variant_name(tmp_path):
    """The defaults live in the package: no file of the checkout's config/ directory is read."""
    import subprocess

    from helpers import PYTHON, read_metrics, subprocess_env

    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    result = subprocess.run(
        [PYTHON, "-c", "from ddpo_group.cli import train_main; train_main()", "--config", "test",
         "--config.num_epochs=1", "--config.sample.num_steps=2", f"--config.logdir={tmp_path}", "--config.run_name=r",
         "--config.log_images_every=0"],
        cwd=workdir, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert [row["epoch"] for row in read_metrics(tmp_path / "r")] == [0]
    assert not (workdir / "config").exists()


def test_train_help_names_the_variants_and_the_defaults_file():
    import subprocess

    from helpers import PYTHON, ROOT, subprocess_env

    result = subprocess.run(
        [PYTHON, "scripts/train.py", "--help"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    for name in ("sd15", "tiny", "tiny_group_ppo", "test"):
        assert f"  {name} " in result.stdout
    assert "ddpo_group/config/base.py" in result.stdout.replace("\\", "/")


def test_eval_images_per_prompt_is_bounded(tmp_path, no_model_loading):
    message = _assert_rejected(tmp_path, make_config(tmp_path, eval_images_per_prompt=10000), "eval_images_per_prompt")
    assert "1024" in message and "ddpo-group evaluate --checkpoint" in message
    check_config(make_config(tmp_path, eval_images_per_prompt=1024))


def test_train_help_lists_each_variant_on_one_aligned_line_with_its_whole_description():
    # a name longer than the old 16-column field ran into its text, and tiny_scenes' description, which goes on over
    # two lines of grpo.py's docstring, was cut at "(1-4 shapes"
    from ddpo_group.cli.train import _variant_lines
    from ddpo_group.config import grpo

    lines = _variant_lines()
    assert sorted(line.split()[0] for line in lines) == sorted(grpo.VARIANTS)  # each once (in the docstring's order)
    columns = {len(line) - len(line[2:].split(" ", 1)[1].lstrip()) for line in lines}
    assert len(columns) == 1, "the descriptions start in one column"
    scenes = next(line for line in lines if line.split()[0] == "tiny_scenes")
    assert scenes.rstrip().endswith("geneval_scenes.jsonl, CPU, minutes")
    assert all(line.split(None, 1)[1].strip() for line in lines), "every variant has a description"


def test_a_benchmarks_set_assignment_is_typed_as_its_field_and_a_typo_is_one_line():
    """ddpo_group.config.fields.set_field, the --set FIELD=VALUE of benchmarks/overhead.py and scenes_study.py (one
    helper; they parsed it twice, and a misspelt field was a KeyError traceback)."""
    from ddpo_group.config.base import get_config
    from ddpo_group.config.fields import set_field
    from ddpo_group.config.registry import ConfigError

    config = get_config()
    set_field(config, "train.learning_rate=1e-3")
    set_field(config, "sample.num_batches_per_epoch=4e0")
    set_field(config, "compile=true")
    set_field(config, "run_name=a=b")  # a string field takes the text after the first "=" as written
    assert config.train.learning_rate == 0.001 and isinstance(config.train.learning_rate, float)
    assert config.sample.num_batches_per_epoch == 4 and type(config.sample.num_batches_per_epoch) is int
    assert config.compile is True
    assert config.run_name == "a=b"
    # a JSON string, quotes and all, is its text (the ladder's --set train.policy_loss='"grpo_guard"' stopped in
    # check_config naming the value with its quotes)
    set_field(config, 'train.policy_loss="grpo_guard"')
    assert config.train.policy_loss == "grpo_guard"
    set_field(config, 'run_name="a')  # not a JSON string: as written
    assert config.run_name == '"a'
    with pytest.raises(ConfigError, match=r"no field 'train.learnin_rate' \(did you mean 'train.learning_rate'\?\)"):
        set_field(config, "train.learnin_rate=1")
    with pytest.raises(ConfigError, match="no field 'nosuch.section.x'"):
        set_field(config, "nosuch.section.x=1")
    with pytest.raises(ConfigError, match="not a value config.sample.num_batches_per_epoch can take"):
        set_field(config, "sample.num_batches_per_epoch=2.5")
    with pytest.raises(ConfigError, match="not a value config.compile can take"):
        set_field(config, "compile=3")
    with pytest.raises(ConfigError, match="write FIELD=VALUE"):
        set_field(config, "train.learning_rate")
    for error in ("train.learnin_rate=1", "sample.num_batches_per_epoch=2.5"):
        try:
            set_field(config, error)
        except ConfigError as err:
            assert "\n" not in str(err)


def test_the_benchmarks_refuse_a_misspelt_set_field_in_one_line_before_running(capsys):
    from helpers import load_script

    for name in ("scenes_study", "overhead"):
        module = load_script(f"benchmarks/{name}.py")
        argv = ["--set", "train.learnin_rate=1"] + (["--methods", "flow_grpo", "--results", "/nonexistent/x"]
                                                    if name == "scenes_study" else [])
        with pytest.raises(SystemExit) as exit_info:
            module.main(argv)
        assert exit_info.value.code == 2
        assert "did you mean 'train.learning_rate'?" in capsys.readouterr().err
