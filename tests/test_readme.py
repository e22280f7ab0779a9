"""The README's two set-up commands and what CI runs stay the same text."""

import os

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
    assert commands[0].endswith("scripts/train.py --config config/grpo.py:tiny")
    assert commands[1].endswith("python -m pytest -q")


def test_ci_runs_the_readme_test_command():
    readme_test_command = _commands(_read("README.md"))[1]
    assert _commands(_read(".ci", "run")) == [readme_test_command]
