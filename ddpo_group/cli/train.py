"""`ddpo-group train` (and ddpo-group-train, `accelerate launch scripts/train.py`): the absl / ml_collections
command line of the trainer, `--config NAME | FILE.py[:ARG] [--config.FIELD=VALUE ...]`, its errors as one line."""

from __future__ import annotations

import os
import sys
from typing import Sequence

from ddpo_group.cli.common import cpu_threads, one_line  # noqa: F401  (one_line: also ddpo_group.cli.one_line)


def _variant_lines() -> list[str]:
    """'  NAME  description' for each built-in variant, one line each, the descriptions in one column: from
    ddpo_group/config/grpo.py's docstring (a description that goes on over the next, more indented lines is joined),
    else the first line of the variant function's docstring."""
    from ddpo_group.config import grpo

    described: dict[str, str] = {}
    last = None
    for line in (grpo.__doc__ or "").splitlines():
        name, _, text = line.strip().partition(" ")
        if name in grpo.VARIANTS:
            described[name], last = text.strip(), name
        elif last is not None and line.strip() and line.startswith(" " * 8) and not name.endswith(":"):
            described[last] += " " + line.strip()  # the description goes on
        else:
            last = None

    def first_line(fn):  # a variant the docstring does not list: its function's docstring's first line
        return (fn.__doc__ or "").strip().splitlines()[0] if (fn.__doc__ or "").strip() else ""

    # in the docstring's order, where "the same ..." follows the variant it means; the others after them
    names = list(described) + [name for name in grpo.VARIANTS if name not in described]
    width = max(len(name) for name in grpo.VARIANTS)
    return [f"  {name:<{width}}  {described.get(name) or first_line(grpo.VARIANTS[name])}" for name in names]


def train_help() -> str:
    import os

    from ddpo_group.config import grpo

    config_dir = os.path.dirname(os.path.abspath(grpo.__file__))
    return "\n".join(
        [
            "usage: ddpo-group train [VARIANT | --config CONFIG] [--config.FIELD=VALUE ...]   (or ddpo-group-train)",
            "       accelerate launch [--multi_gpu --num_processes N] scripts/train.py [same arguments]",
            "",
            "Fine-tune a text-to-image diffusion model with RL (GRPO, DDPO, RLOO, GAE, Group-PPO), one epoch at",
            "a time: sample, reward, advantages, train. Writes LOGDIR/RUN_NAME/ (metrics.jsonl, samples/, checkpoints/).",
            "",
            "  --config CONFIG        a built-in variant NAME, or FILE.py[:ARG] whose get_config(ARG) returns an",
            "                         ml_collections.ConfigDict (default: tiny, the offline shapes-world run)",
            "  VARIANT                the same as --config VARIANT, given first (ddpo-group train tiny_scenes)",
            "  --config.FIELD=VALUE   override one field, e.g. --config.train.beta=0.01 --config.num_epochs=10",
            "",
            f"built-in variants (listed in {os.path.join(config_dir, 'grpo.py')}, defined in "
            f"{os.path.join(config_dir, 'variants')}{os.sep}):",
            *_variant_lines(),
            "",
            f"every field, its default and what it does: {os.path.join(config_dir, 'base.py')}",
            "resume a run: --config.resume_from=LOGDIR/RUN_NAME",
        ]
    )


def _resolve_config_argument(argv: list[str]) -> list[str]:
    """`--config NAME` / `--config=NAME` with a built-in variant NAME -> the package's grpo.py:NAME."""
    import os

    from ddpo_group.config import grpo

    path = os.path.abspath(grpo.__file__)
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out) and out[i + 1] in grpo.VARIANTS:
            out[i + 1] = f"{path}:{out[i + 1]}"
        elif arg.startswith("--config=") and arg.partition("=")[2] in grpo.VARIANTS:
            out[i] = f"--config={path}:{arg.partition('=')[2]}"
    return out


def _config_value(argv: Sequence[str]) -> str | None:
    """The value of --config NAME / --config=NAME, None when not given."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.partition("=")[2]
    return None


def _unknown_variant(argv: Sequence[str]) -> str | None:
    """A one-line error for a --config naming no built-in variant (NAME, or grpo.py:NAME), else None."""
    import difflib
    import os

    from ddpo_group.config import grpo

    value = _config_value(argv)
    if value is None:
        return None
    path, _, name = value.rpartition(":") if ".py:" in value else ("", "", value)
    if path and os.path.basename(path) != "grpo.py":
        return None  # a user's own config file: its get_config judges the argument
    if not path and (value.endswith(".py") or os.path.exists(value)):
        return None
    if name in grpo.VARIANTS:
        return None
    hint = difflib.get_close_matches(name, list(grpo.VARIANTS), n=1)
    return (
        f"unknown config variant {name!r} (--config {value})" + (f"; did you mean {hint[0]!r}?" if hint else "")
        + f"; the built-in variants: {', '.join(grpo.VARIANTS)} (ddpo-group-train --help)"
    )


def _missing_config_file(argv: Sequence[str]) -> str | None:
    """A one-line error for a --config FILE.py[:ARG] whose file does not exist, else None."""
    import os

    value = _config_value(argv)
    if value is None:
        return None
    if os.path.isdir(value):
        return (
            f"--config {value!r} is a directory; give a built-in variant NAME or FILE.py[:ARG], such as "
            "config/grpo.py:tiny (ddpo-group-train --help)"
        )
    file = value.rpartition(":")[0] if ".py:" in value else (value if value.endswith(".py") else "")
    if file and not os.path.isfile(file):
        return (
            f"config file {file!r} does not exist (--config {value}, looked in {os.getcwd()}); give a built-in variant "
            "NAME or FILE.py[:ARG] (ddpo-group-train --help)"
        )
    return None


def _override_fields(argv: Sequence[str]) -> list[str]:
    """The dotted field names of the --config.FIELD=VALUE (or --config.FIELD VALUE) arguments."""
    return [arg[len("--config."):].split("=", 1)[0] for arg in argv if arg.startswith("--config.")]


def _unknown_override(fields: Sequence[str]) -> str | None:
    """A one-line error for the first override that names no config field, else None."""
    from ddpo_group.config.fields import FREE_FORM_FIELDS, closest_field, field_paths, load_base_config

    base = load_base_config()
    known = set(field_paths(base))
    for field in fields:
        if field in known or field.split(".")[0] in FREE_FORM_FIELDS:
            continue
        hint = closest_field(field, base)
        return (
            f"unknown config field {field!r} (--config.{field})" + (f"; did you mean {hint!r}?" if hint else "")
            + "; every field and its default is listed in ddpo_group/config/base.py (ddpo-group-train --help)"
        )
    return None



def _allow_dotted_keys_on_the_command_line() -> None:
    """--config.FIELD='{...}' for a sub-config (reward_weights, reward_kwargs) accepts keys with dots, the documented
    '{"http://host:port": 1.0}' and 'path/to/file.py:function' specs; ml_collections' own parser refuses them."""
    import ast

    import ml_collections
    from absl import flags
    from ml_collections import config_flags

    class DottedKeysParser(flags.ArgumentParser):
        def parse(self, argument):
            if isinstance(argument, ml_collections.ConfigDict):  # the field's default
                return argument
            try:
                value = ast.literal_eval(argument)
            except (SyntaxError, ValueError) as err:
                raise ValueError(f"{argument!r} is not a dict literal such as '{{\"aesthetic\": 1.0}}' ({err})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{argument!r} is not a dict literal such as '{{\"aesthetic\": 1.0}}'")
            return ml_collections.ConfigDict(value, allow_dotted_keys=True)

        def flag_type(self):
            return "config_dict"

    config_flags.register_flag_parser_for_type(ml_collections.ConfigDict, DottedKeysParser())


REWARD_KWARGS_FLAG = "--config.reward_kwargs."


def _split_reward_kwargs_flags(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(argv without them, [(dotted path under reward_kwargs, value text)]) of the --config.reward_kwargs.NAME.KEY=VALUE
    (or ... VALUE) arguments. ml_collections' own parsing of them fails when reward_kwargs has no entry NAME yet
    (KeyError) or the entry has no KEY yet (AttributeError): an override may only replace an existing field, and a
    reward's keywords are open-ended; `_set_reward_kwargs` sets them after the other flags."""
    kept, settings, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(REWARD_KWARGS_FLAG):
            path, equals, text = arg[len(REWARD_KWARGS_FLAG):].partition("=")
            if not equals and i + 1 < len(argv):
                i, text = i + 1, argv[i + 1]
            settings.append((path, text))
        else:
            kept.append(arg)
        i += 1
    return kept, settings


def _flag_value(text: str):
    """A flag's value as ml_collections reads an untyped one: a Python literal (True, 3, 'x', [1, 2]), also
    JSON's true / false / null, else the text itself."""
    import ast
    import json

    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        pass
    try:
        return json.loads(text)
    except ValueError:
        return text


def _set_reward_kwargs(config, settings) -> str | None:
    """Sets each (path, text) of `_split_reward_kwargs_flags` in config.reward_kwargs, creating the reward's entry
    and any level below it; a one-line error when a level on the path already holds a value that is not a dict."""
    import ml_collections

    for path, text in settings:
        *parents, leaf = path.split(".")
        if not parents or not all(parents) or not leaf:
            return (f"{REWARD_KWARGS_FLAG}{path}: give a reward and its keyword, --config.reward_kwargs.NAME.KEY=VALUE "
                    "(e.g. --config.reward_kwargs.ocr.allow_unquoted=True), or the whole dict, "
                    "--config.reward_kwargs='{\"ocr\": {\"allow_unquoted\": true}}'")
        with config.unlocked():
            node = config.reward_kwargs
            for depth, part in enumerate(parents, start=1):
                if part not in node:
                    node[part] = ml_collections.ConfigDict()
                elif not isinstance(node[part], ml_collections.ConfigDict):
                    held = ".".join(parents[:depth])
                    return (f"{REWARD_KWARGS_FLAG}{path}: config.reward_kwargs.{held} is {node[part]!r}, not a dict of "
                            "keywords; set it whole, e.g. --config.reward_kwargs='{\"ocr\": {\"allow_unquoted\": true}}'")
                node = node[part]
            if leaf in node and node[leaf] is not None:
                node[leaf] = None  # a keyword may change type (ConfigDict is type-safe): replaced, not converted
            node[leaf] = _flag_value(text)
    return None


GET_CONFIG_CONTRACT = (
    "a config file defines get_config() (or get_config(ARG) for FILE.py:ARG) returning an ml_collections.ConfigDict "
    "with every field of ddpo_group/config/base.py: start from ddpo_group.config.base.get_config() (or a variant, "
    "ddpo_group.config.grpo.get_config('tiny')) and change its fields"
)


def _user_config_file(argv: Sequence[str]) -> str | None:
    """The FILE.py of --config FILE.py[:ARG] when it is the user's own file (not a built-in variant), else None."""
    import os

    value = _config_value(argv)
    if value is None:
        return None
    file = value.rpartition(":")[0] if ".py:" in value else value
    return file if file.endswith(".py") and os.path.basename(file) != "grpo.py" else None


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing with its errors (a value that does not parse, a config file that cannot be read) as one line."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        sys.exit(f"{_PROG}: error: {_without_traceback(str(err))} (ddpo-group-train --help)")
    except Exception as err:  # the user's config file raised while it was imported, or has no get_config
        file = _user_config_file(argv[1:])
        if file is None or os.environ.get("DDPO_GROUP_DEBUG", "").lower() in ("1", "true", "yes"):
            raise
        text = " ".join(str(err).split()) or type(err).__name__
        sys.exit(f"{_PROG}: error: config file {file!r} could not be loaded ({type(err).__name__}: {text}); "
                 f"{GET_CONFIG_CONTRACT}")


def _config_file_problem(config, file: str) -> str | None:
    """A one-line error for what the user's config file `file` returned, when it is not a ConfigDict holding every
    top-level field of the base config; None when it is."""
    import ml_collections

    from ddpo_group.config.fields import load_base_config

    if not isinstance(config, ml_collections.ConfigDict):
        return f"config file {file!r}: get_config returned a {type(config).__name__}, not a ConfigDict; {GET_CONFIG_CONTRACT}"
    missing = [field for field in load_base_config() if field not in config]
    if missing:
        return (f"config file {file!r}: get_config returned a ConfigDict without the fields {', '.join(missing[:6])}"
                f"{', ...' if len(missing) > 6 else ''}; {GET_CONFIG_CONTRACT}")
    return None


def _without_traceback(message: str) -> str:
    """A flag error as one line: a config file's get_config that raised is reported by its exception's last line
    (ml_collections puts the whole traceback in the message), with the fix when it takes no argument."""
    head, marker, trace = message.partition("Traceback (most recent call last):")
    if marker:
        lines = [line.strip() for line in trace.splitlines() if line.strip()]
        message = head + (lines[-1] if lines else "")
        if "get_config() takes 0 positional arguments" in message:
            message += "; this file's get_config takes no argument: give --config FILE.py without ':ARG'"
    return " ".join(message.split())


def _leading_variant(argv: list[str]) -> tuple[list[str], str | None]:
    """(argv, None) with a first argument VARIANT (`ddpo-group train tiny_scenes`) read as --config VARIANT; a one-line
    error when it names no built-in variant, or when --config is given too (two configs: which one is meant?)."""
    import difflib

    from ddpo_group.config import grpo

    if len(argv) < 2 or argv[1].startswith("-"):
        return argv, None
    name = argv[1]
    if name not in grpo.VARIANTS:
        hint = difflib.get_close_matches(name, list(grpo.VARIANTS), n=1)
        return argv, (f"unexpected argument {name!r}: the first argument is a built-in variant" + (
            f" (did you mean {hint[0]!r}?)" if hint else "") + "; a config file goes with --config FILE.py[:ARG] "
            "(ddpo-group-train --help lists the variants)")
    if _config_value(argv[2:]) is not None:
        return argv, (f"the variant {name!r} and --config {_config_value(argv[2:])} both name a config; give one")
    return [argv[0], "--config", name, *argv[2:]], None


def _stray_arguments(positional: Sequence[str]) -> str | None:
    """A one-line error for arguments that are no flag (absl leaves them unparsed; they were ignored), else None."""
    if not positional:
        return None
    return (f"unexpected argument {positional[0]!r}: a variant goes first or with --config NAME, a field with "
            "--config.FIELD=VALUE (ddpo-group-train --help)")


def _logdir_problem(config) -> str | None:
    """A one-line error when the run directory (config.logdir / run_name) resolves inside the package, whose
    shipped files no run writes over; None otherwise."""
    from ddpo_group.cli.common import inside_package

    logdir = str(config.get("logdir") or "")
    run_dir = os.path.join(logdir, str(config.get("run_name") or ""))
    return inside_package(logdir, "--config.logdir") or inside_package(run_dir, "--config.logdir/run_name")


# the program name the errors start with: `ddpo-group train` when the dispatcher called it so, else ddpo-group-train
_PROG = "ddpo-group-train"


def train_main(argv: Sequence[str] | None = None) -> None:
    """ddpo-group train / ddpo-group-train / scripts/train.py: `--config NAME | FILE.py[:VARIANT] [--config.FIELD=VALUE ...]`.

    `argv` as sys.argv (its default): argv[0] names the program (absl's), the arguments follow.

    The default config is the built-in variant "tiny" (ddpo_group/config/grpo.py), so an installed
    package trains from any directory. Every error is printed as one line naming the field, file,
    reward or limit (DDPO_GROUP_DEBUG=1 for the traceback); on resume, the fields given on the
    command line are the ones compared with the run's stored config.
    """
    import os

    global _PROG
    argv = list(sys.argv if argv is None else argv)
    _PROG = "ddpo-group train" if argv and argv[0] == "ddpo-group train" else "ddpo-group-train"
    if any(arg in ("-h", "--help", "-help", "--helpfull", "--helpshort") for arg in argv[1:]):
        print(train_help())
        sys.exit(0)
    debug = os.environ.get("DDPO_GROUP_DEBUG", "").lower() in ("1", "true", "yes")
    argv, problem = _leading_variant(argv)
    if problem:
        sys.exit(f"{_PROG}: error: {problem}")
    overrides = _override_fields(argv[1:])
    problem = _missing_config_file(argv[1:]) or _unknown_variant(argv[1:]) or _unknown_override(overrides)
    if problem:
        sys.exit(f"{_PROG}: error: {problem}")

    from absl import app, flags
    from ml_collections import config_flags

    from ddpo_group.config import grpo
    from ddpo_group.runs.run_control import end_with_launcher

    end_with_launcher()  # a launcher stopped before the run's own signal handling starts (models loading) ends it
    cpu_threads()
    _allow_dotted_keys_on_the_command_line()
    default = f"{os.path.abspath(grpo.__file__)}:tiny"
    # ml_collections reads the --config.FIELD overrides from sys.argv unless given sys_argv: it is given the
    # arguments without the --config.reward_kwargs.NAME.KEY ones, which main() sets itself
    absl_argv, reward_kwargs = _split_reward_kwargs_flags(_resolve_config_argument(argv))
    if "config" not in flags.FLAGS:
        config_flags.DEFINE_config_file("config", default, "Training configuration: NAME or FILE.py[:VARIANT].",
                                        sys_argv=absl_argv)
    else:  # defined by an earlier call in this process (tests): its overrides are this call's
        flags.FLAGS["config"]._sys_argv = absl_argv

    def main(positional):
        import json

        file = _user_config_file(argv[1:])
        problem = _stray_arguments(positional[1:]) or (_config_file_problem(flags.FLAGS.config, file) if file else None)
        problem = (problem or _set_reward_kwargs(flags.FLAGS.config, reward_kwargs)
                   or _logdir_problem(flags.FLAGS.config))
        if problem:
            sys.exit(f"{_PROG}: error: {problem}")

        from ddpo_group.training.trainer import STOPPED_FILE, train
        try:
            run_dir = train(flags.FLAGS.config, overrides=overrides)
        except Exception as err:
            if debug:
                raise
            sys.exit(f"{_PROG}: error: {one_line(err)}")
        stopped = os.path.join(run_dir, STOPPED_FILE)
        if os.path.exists(stopped):  # a signal stopped it: not a finished run (exit 128 + signal, as the shell does)
            with open(stopped) as f:
                info = json.load(f)
            print(f"{_PROG}: stopped by signal {info.get('signal')} after epoch {info.get('epoch')}, "
                  f"checkpoint written; resume with {info.get('resume')}", file=sys.stderr)
            sys.exit(128 + int(info.get("signal") or 0) if info.get("signal") else 1)

    try:
        app.run(main, argv=absl_argv, flags_parser=_parse_flags)
    except KeyboardInterrupt:  # Ctrl-C before the epochs start (during them the run stops itself: stopped.json)
        if debug:
            raise
        print(f"{_PROG}: interrupted (Ctrl-C) before training started; no epoch was run", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # a config file that cannot be read, a value that does not parse
        if debug:
            raise
        sys.exit(f"{_PROG}: error: {one_line(err)}")
