"""The README's two set-up commands and what CI runs stay the same text; the main job's command form shows a
config error as the run's one line, first and only."""

import os
import shlex
import subprocess
import sys

import pytest

from helpers import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _commands(text):
    return [line.strip() for line in text.splitlines() if line.strip().startswith("python3 -m venv .venv &&")]


def test_readme_has_two_setup_commands_installing_cpu_torch_first():
    commands = _commands(_read("README.md"))
    assert len(commands) == 2
    for command in commands:
        assert command.index("pip install torch==2.13.0") < command.index('pip install -e ".[dev]"')
    assert commands[0].endswith(
        "accelerate launch -q --config_file config/accelerate.yaml scripts/train.py --config config/grpo.py:tiny")
    assert commands[1].endswith("python -m pytest -q")


def test_ci_runs_the_readme_test_command():
    readme_test_command = _commands(_read("README.md"))[1]
    assert _commands(_read(".ci", "run")) == [readme_test_command]


def _launch(readme_form, *arguments):
    """The README's `.venv/bin/accelerate launch ...` command (its last part), with this venv's accelerate and the
    arguments after `--config` replaced; run from the checkout's root."""
    command = shlex.split(readme_form.split("&&")[-1])
    assert command[0] == ".venv/bin/accelerate" and command[-2] == "--config"
    command = [os.path.join(os.path.dirname(sys.executable), "accelerate")] + command[1:-2] + list(arguments)
    env = subprocess_env()
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("arguments, needle", [
    (["--config", "config/grpo.py:tinyy"], "unknown config variant 'tinyy' (--config config/grpo.py:tinyy); did you "
                                           "mean 'tiny'?"),
    (["--config", "config/grpo.py:test", "--config.sample.group_size=3"], "config.sample.group_size=3 does not divide"),
])
def test_the_readme_command_shows_a_config_error_as_one_line(arguments, needle, tmp_path):
    result = _launch(_commands(_read("README.md"))[0], *arguments, f"--config.logdir={tmp_path}")
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("ddpo-group-train: error: ") and needle in lines[0], lines
    assert not os.listdir(tmp_path)


def test_the_bare_accelerate_launch_still_shows_the_line():
    result = _launch(".venv/bin/accelerate launch scripts/train.py --config config/grpo.py:tiny",
                     "--config", "config/grpo.py:tinyy")
    assert result.returncode != 0
    assert "ddpo-group-train: error: unknown config variant 'tinyy'" in result.stdout + result.stderr
