"""The documentation site (mkdocs.yml, docs/) and the commands it shows.

- `mkdocs build --strict` passes: no broken link or anchor, no page left out of the nav (CI runs it too, .ci/run);
- every command of a code block (README.md and docs/*.md) that starts one of this project's scripts or entry points
  parses: a training command's variant exists and its `--config.FIELD` overrides name fields; any other script's
  flags are accepted by that script's own argument parser (parsed in this process, the script stopped right after);
- every Python block marked runnable (an HTML comment `<!-- runnable -->` on the line before its fence) runs, each
  in a fresh namespace, all of them in one subprocess;
- README.md states the same "what it is" as docs/index.md and the same two set-up commands as docs/getting_started.md.

Placeholders in commands (a word in capitals such as N, OUT or RUN_DIR) stand for a value: they are parsed as "2".
"""

import argparse
import contextlib
import glob
import importlib.util
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import textwrap

import pytest

from helpers import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
RUNNABLE = "<!-- runnable -->"
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
OURS = ("scripts/", "benchmarks/")  # the checkout's scripts (others, such as GenEval's own, are not checked)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _pages():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(DOCS, "*.md")))


def code_blocks(text):
    """[(language, code, runnable)] of a Markdown text: fenced blocks (```lang) and indented blocks (4 spaces after a
    blank line, outside lists)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", line)
        if fence:
            indent, marker, language = fence.groups()
            runnable = i > 0 and lines[i - 1].strip() == RUNNABLE
            body, i = [], i + 1
            while i < len(lines) and not lines[i].strip().startswith(marker):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            blocks.append((language or "text", "\n".join(body), runnable))
            i += 1
            continue
        previous = lines[i - 1] if i else ""
        if line.startswith("    ") and not previous.strip() and not _in_list(lines, i):
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            blocks.append(("text", "\n".join(body).strip("\n"), False))
            continue
        i += 1
    return blocks


def _in_list(lines, i):
    """Whether line i (indented, after a blank line) continues a list item rather than starting a code block."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    while j >= 0 and lines[j].strip():
        if re.match(r"^\s*([-*+]|\d+\.)\s", lines[j]):
            return True
        j -= 1
    return False


def shell_commands(code):
    """The commands of a shell block: continuation lines joined, comments and [optional parts] dropped, split at &&
    and ;."""
    commands = []
    for line in re.sub(r"\\\n\s*", " ", code).splitlines():
        line = re.sub(r"\s\[[^\]]*\]", "", line)  # a usage synopsis's optional parts: [--flag VALUE]
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue  # not shell (a Python line, a table)
        current = []
        for token in tokens + ["&&"]:
            if token in ("&&", ";", "||"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
    return commands


def classify(tokens):
    """(kind, target, arguments) of a command that starts this project's code, else None.

    kind: "train" (scripts/train.py, ddpo-group-train or ddpo-group train), "inspect" (ddpo-group-inspect), "script"
    (a .py file of scripts/ or benchmarks/), "module" (python -m ddpo_group..., and ddpo-group SUBCOMMAND: python -m
    ddpo_group.cli), "shell" (bash SCRIPT.sh)."""
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
        tokens = tokens[1:]  # VAR=value prefixes
    if not tokens:
        return None
    program = os.path.basename(tokens[0])
    if program in ("ddpo-group-train", "ddpo-group-inspect"):
        return ("train" if program.endswith("train") else "inspect"), program, tokens[1:]
    if program == "ddpo-group":
        return ("train", "ddpo-group train", tokens[2:]) if tokens[1:2] == ["train"] else ("module", "ddpo_group.cli",
                                                                                          tokens[1:])
    if program == "bash" and len(tokens) > 1 and tokens[1].endswith(".sh"):
        return "shell", tokens[1], tokens[2:]
    if re.fullmatch(r"python3?", program):
        if len(tokens) > 2 and tokens[1] == "-m":
            module = tokens[2]
            return ("module", module, tokens[3:]) if module.startswith("ddpo_group") else None
        if len(tokens) > 1 and tokens[1].endswith(".py") and tokens[1].startswith(OURS):
            script = tokens[1]
            return ("train" if script.endswith("scripts/train.py") else "script"), script, tokens[2:]
        return None
    if (program == "accelerate" and tokens[1:2] == ["launch"]) or program == "torchrun":
        for k, token in enumerate(tokens):
            if token.endswith(".py") and token.startswith(OURS):
                kind = "train" if token.endswith("scripts/train.py") else "script"
                return kind, token, tokens[k + 1:]
    return None


def documented_commands():
    """[(page, command line, (kind, target, arguments))] of every code block's project command."""
    found = []
    for page in _pages():
        for language, code, _ in code_blocks(_read(page)):
            if language not in ("text", "bash", "sh", "shell", "console"):
                continue
            for tokens in shell_commands(code):
                kind = classify(tokens)
                if kind:
                    found.append((os.path.relpath(page, ROOT), " ".join(tokens), kind))
    return found


class _Parsed(BaseException):
    """Raised by the patched parser right after a successful parse: the script stops there (a BaseException, so
    that a script's own `except Exception` does not catch it)."""


@contextlib.contextmanager
def _stop_after_parsing():
    """ArgumentParser.parse_args / parse_known_args raise _Parsed when the outermost call returns (parse_args's
    own check of leftover arguments included)."""
    originals = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    depth = [0]

    def stopping(original):
        def parse(self, args=None, namespace=None):
            depth[0] += 1
            try:
                result = original(self, args, namespace)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed(result)
            return result
        return parse

    argparse.ArgumentParser.parse_args = stopping(originals[0])
    argparse.ArgumentParser.parse_known_args = stopping(originals[1])
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = originals


def _train_problem(arguments):
    """What ddpo-group-train would refuse in these arguments before loading anything (the CLI's own checks)."""
    from ddpo_group import cli

    argv = [a for a in arguments if not a.startswith("...")]
    return cli._unknown_variant(argv) or cli._missing_config_file(argv) or cli._unknown_override(
        cli._override_fields(argv))


def parse_problem(kind, target, arguments):
    """None when the command parses, else what is wrong (one line)."""
    import torch

    arguments = ["2" if PLACEHOLDER.match(a) else a for a in arguments]
    if kind == "train":
        if target.endswith(".py") and not os.path.isfile(os.path.join(ROOT, target)):
            return f"{target} does not exist"
        return _train_problem(arguments)
    if kind == "shell":
        return None if os.path.isfile(os.path.join(ROOT, target)) else f"{target} does not exist"
    if kind == "script" and not os.path.isfile(os.path.join(ROOT, target)):
        return f"{target} does not exist"
    saved = (list(sys.argv), list(sys.path), dict(os.environ), torch.get_num_threads())
    stderr = io.StringIO()
    try:
        with _stop_after_parsing(), contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            if kind == "inspect":
                from ddpo_group.cli import inspect_main

                inspect_main(arguments)
            elif kind == "module":
                sys.argv = [target] + arguments
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [target] + arguments
                runpy.run_path(os.path.join(ROOT, target), run_name="__main__")
    except _Parsed:
        return None
    except SystemExit as exit_:
        said = stderr.getvalue().strip().splitlines()
        return f"exit {exit_.code}: {said[-1] if said else '(nothing on stderr)'}"
    finally:
        sys.argv[:], sys.path[:] = saved[0], saved[1]
        os.environ.clear()
        os.environ.update(saved[2])
        torch.set_num_threads(saved[3])
    return "the command ran without parsing its arguments with argparse: check it another way"


def test_documented_commands_parse(monkeypatch):
    monkeypatch.chdir(ROOT)
    commands = documented_commands()
    kinds = {kind for _, _, (kind, _, _) in commands}
    assert {"train", "script", "inspect", "module", "shell"} <= kinds, kinds  # the extraction finds each kind
    problems, seen = [], {}
    for page, line, (kind, target, arguments) in commands:
        key = (kind, target, tuple(arguments))
        if key not in seen:
            seen[key] = parse_problem(kind, target, arguments)
        if seen[key]:
            problems.append(f"{page}: {line}\n    -> {seen[key]}")
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_wrong_variant_flag_and_path(monkeypatch):
    monkeypatch.chdir(ROOT)
    for line in (".venv/bin/accelerate launch scripts/train.py --config config/grpo.py:tinyy",
                 "ddpo-group-train --config tiny --config.train.betaa=0.1",
                 "ddpo-group train --config tinyy",
                 "ddpo-group evaluate --checkpoint runs/NAME --no-such-flag",
                 ".venv/bin/python scripts/evaluate.py --checkpoint runs/NAME --no-such-flag",
                 ".venv/bin/python scripts/no_such_script.py",
                 ".venv/bin/ddpo-group-inspect RUN_DIR --comparee RUN2"):
        (tokens,) = shell_commands(line)
        assert parse_problem(*classify(tokens)) is not None, line


def test_code_block_extraction():
    text = textwrap.dedent("""\
        Text

            .venv/bin/python scripts/evaluate.py --model tiny-shapes \\
                --prompts shapes_squares.txt   # a comment

        - a list item

            continued, not code

        <!-- runnable -->
        ```python
        print(1)
        ```
        """)
    blocks = code_blocks(text)
    assert [(language, runnable) for language, _, runnable in blocks] == [("text", False), ("python", True)]
    (tokens,) = shell_commands(blocks[0][1])
    assert classify(tokens) == ("script", "scripts/evaluate.py",
                                ["--model", "tiny-shapes", "--prompts", "shapes_squares.txt"])


def test_runnable_blocks_run(tmp_path):
    blocks = [(os.path.relpath(page, ROOT), code) for page in _pages()
              for language, code, runnable in code_blocks(_read(page)) if runnable]
    assert len(blocks) >= 3, "the docs mark at least their examples runnable"
    assert all(code.strip() for _, code in blocks)
    driver = tmp_path / "run_blocks.py"
    driver.write_text(textwrap.dedent("""\
        import json, sys, traceback
        failed = []
        for page, code in json.load(open(sys.argv[1])):
            try:
                exec(compile(code, page, "exec"), {"__name__": "__docs__"})
            except BaseException:
                failed.append(page + ":\\n" + code + "\\n" + traceback.format_exc(limit=3))
        print("\\n\\n".join(failed))
        sys.exit(1 if failed else 0)
        """))
    import json

    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    result = subprocess.run([sys.executable, str(driver), str(tmp_path / "blocks.json")], cwd=tmp_path,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _intro(text):
    return text.split("\n## ", 1)[0]


def test_readme_and_the_site_say_the_same():
    readme, index = _read(os.path.join(ROOT, "README.md")), _read(os.path.join(DOCS, "index.md"))
    assert _intro(readme).replace("](docs/", "](") == _intro(index)
    setup = [line for line in _read(os.path.join(DOCS, "getting_started.md")).splitlines()
             if line.startswith("python3 -m venv .venv &&")]
    assert setup == [line.strip() for line in readme.splitlines() if line.strip().startswith("python3 -m venv")]
    assert len(readme.splitlines()) <= 250


def test_every_page_is_in_the_nav():
    nav = _read(os.path.join(ROOT, "mkdocs.yml"))
    missing = [os.path.basename(p) for p in glob.glob(os.path.join(DOCS, "*.md")) if os.path.basename(p) not in nav]
    assert not missing, f"docs pages not in mkdocs.yml's nav: {missing}"


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip('mkdocs and mkdocs-material are not installed (pip install -e ".[dev]" installs them)')
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", os.path.join(ROOT, "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        cwd=ROOT, env=subprocess_env(NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "configs" / "index.html").is_file()
