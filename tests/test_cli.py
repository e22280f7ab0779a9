"""The one command, `ddpo-group SUBCOMMAND` (ddpo_group/cli/): its overview, each subcommand's own help, a misspelt
subcommand as one line, a tiny training run through it, and the scripts in scripts/ as thin wrappers around it."""

import os
import subprocess

import pytest
from helpers import PYTHON, ROOT, read_metrics, subprocess_env

from ddpo_group.cli import SUBCOMMANDS, main

# each subcommand and options its --help names
HELP_NAMES = {
    "train": ["--config CONFIG", "--config.FIELD=VALUE", "tiny", "resume_from"],
    "evaluate": ["--checkpoint", "--model", "--protocol", "--output", "--reward-timeout"],
    "inspect": ["RUN_DIR", "--compare", "--output", "--steps-png"],
    "serve": ["--serve", "--port", "--host", "--max-body-mb"],
    "pretrain": ["--world", "--quick", "--output-dir", "--state-dir"],
}


def _command(*args, cwd=ROOT, timeout=120):
    """`ddpo-group ARGS` in a fresh interpreter (python -m ddpo_group.cli: the entry point without an install)."""
    return subprocess.run([PYTHON, "-m", "ddpo_group.cli", *args], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_the_overview_lists_every_subcommand_with_one_line():
    result = _command("--help")
    assert result.returncode == 0, result.stderr
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(SUBCOMMANDS) == list(HELP_NAMES)
    assert "ddpo-group SUBCOMMAND --help" in result.stdout


def test_no_subcommand_shows_the_overview_and_exits_2(capsys):
    assert main([]) == 2
    assert "subcommands:" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_each_subcommand_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert f"ddpo-group {name}" in out  # its own usage line, named as it was called
    for option in HELP_NAMES[name]:
        assert option in out, (name, option)


def test_an_unknown_subcommand_is_one_line_naming_the_choices(capsys):
    assert main(["trian", "--config", "tiny"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpo-group: error: unknown subcommand 'trian'"), lines
    assert "did you mean 'train'?" in lines[0] and all(name in lines[0] for name in SUBCOMMANDS)


def test_a_pretrain_flag_error_is_one_line_not_the_usage_block(capsys):
    # it printed argparse's 20-line usage block before
    with pytest.raises(SystemExit) as exit_info:
        main(["pretrain", "--bogus"])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line == "ddpo-group pretrain: error: unrecognized arguments: --bogus (ddpo-group pretrain --help lists the flags)"


def test_a_subcommands_flag_error_is_one_line_naming_the_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "--top-k", "many", "runs/x"])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("ddpo-group inspect: error: argument --top-k") and "\n" not in line
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", "tinyy"])
    assert "unknown config variant 'tinyy'" in str(exit_info.value) and "did you mean 'tiny'?" in str(exit_info.value)


def test_the_overview_imports_no_torch():
    code = "import sys; from ddpo_group.cli import main; main(['--help']); assert 'torch' not in sys.modules"
    result = subprocess.run([PYTHON, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_ddpo_group_train_runs_a_tiny_epoch_from_any_directory(tmp_path):
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    result = _command("train", "--config", "test", "--config.num_epochs=1", "--config.sample.num_steps=2",
                      f"--config.logdir={tmp_path}", "--config.run_name=r", "--config.log_images_every=0",
                      cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [row["epoch"] for row in read_metrics(tmp_path / "r")] == [0]


def test_the_scripts_are_thin_wrappers_around_the_package():
    for script, target in [("train.py", "ddpo_group.cli import train_main"),
                           ("inspect_run.py", "ddpo_group.cli import inspect_main"),
                           ("evaluate.py", "from ddpo_group.cli import evaluate"),
                           ("pretrain_tiny.py", "from ddpo_group.cli import pretrain")]:
        path = os.path.join(ROOT, "scripts", script)
        with open(path) as f:
            text = f.read()
        assert target in text and len(text.splitlines()) <= 25, (script, len(text.splitlines()))


def test_serve_takes_the_reward_first_and_says_so_when_it_is_missing(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0"])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("ddpo-group serve: error: name the reward to serve first") and "\n" not in line
    with pytest.raises(SystemExit) as exit_info:  # the reward's name is read: a limit of 0 is refused after it
        main(["serve", "jpeg_compressibility", "--workers", "0"])
    assert str(exit_info.value) == "ddpo-group serve: error: --workers must be > 0, got 0"  # named as it was called
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "no_such_reward", "--port", "0"])
    assert str(exit_info.value).startswith("ddpo-group serve: error: --serve 'no_such_reward': unknown reward")


def test_a_train_error_names_the_command_it_was_called_by_and_reads_as_one_sentence():
    # `ddpo-group train` errors began "ddpo-group-train: error:", and the variant / field lists ran on without a break
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", "no_such"])
    message = str(exit_info.value)
    assert message.startswith("ddpo-group train: error: unknown config variant 'no_such' (--config no_such); "
                              "the built-in variants: sd15, "), message
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", "tiny", "--config.no_such_field=1"])
    assert str(exit_info.value).startswith("ddpo-group train: error: unknown config field 'no_such_field' "
                                           "(--config.no_such_field); every field and its default"), exit_info.value
    from ddpo_group.cli import train_main

    with pytest.raises(SystemExit) as exit_info:
        train_main(["train.py", "--config", "no_such"])
    assert str(exit_info.value).startswith("ddpo-group-train: error: unknown config variant 'no_such'")
