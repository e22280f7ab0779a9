"""The command line: one command, `ddpo-group SUBCOMMAND ...` (pyproject.toml [project.scripts]), as accelerate,
trl and huggingface-cli have.

    ddpo-group train --config tiny [--config.FIELD=VALUE ...]     train.py     (also ddpo-group-train)
    ddpo-group evaluate --checkpoint RUN_DIR [--protocol geneval] evaluate.py
    ddpo-group inspect RUN_DIR [--compare RUN_DIR2]               inspect.py   (also ddpo-group-inspect)
    ddpo-group serve REWARD [--port P]                            serve.py     (ddpo_group/rewards/server.py)
    ddpo-group pretrain [--world scenes] [--quick]                pretrain.py

`ddpo-group --help` lists the subcommands, `ddpo-group SUB --help` is the subcommand's own help. A subcommand's
module is imported only when it runs, so `ddpo-group --help` imports no torch. The scripts in scripts/ are thin
wrappers around these modules (`accelerate launch scripts/train.py --config config/grpo.py:NAME` from a checkout);
common.py holds what they share (one-line errors, the argparse parser with one-line errors, the torch threads).
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

from ddpo_group.cli.common import OneLineArgumentParser, cpu_threads, one_line  # noqa: F401
from ddpo_group.cli.inspect import inspect_main  # noqa: F401
from ddpo_group.cli.train import (  # noqa: F401
    _missing_config_file,
    _override_fields,
    _set_reward_kwargs,
    _split_reward_kwargs_flags,
    _unknown_override,
    _unknown_variant,
    train_help,
    train_main,
)

PROG = "ddpo-group"

# name -> (module, its function, one line for `ddpo-group --help`)
SUBCOMMANDS = {
    "train": ("ddpo_group.cli.train", "train_main",
              "fine-tune a diffusion model with RL: --config NAME | FILE.py[:ARG], --config.FIELD=VALUE"),
    "evaluate": ("ddpo_group.cli.evaluate", "run",
                 "mean reward of a model or a run's checkpoint with fixed noise, or a protocol's table (geneval, ocr)"),
    "inspect": ("ddpo_group.cli.inspect", "inspect_main",
                "an HTML report of a run directory (or two side by side, or per-step heat maps)"),
    "serve": ("ddpo_group.cli.serve", "serve_main", "serve a reward over HTTP to training runs elsewhere"),
    "pretrain": ("ddpo_group.cli.pretrain", "main",
                 "pretrain the tiny offline models (shapes world, scenes world) on a CPU"),
}


def usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    return "\n".join([
        f"usage: {PROG} {{{','.join(SUBCOMMANDS)}}} [ARGUMENTS ...]",
        "",
        "Reinforcement learning for text-to-image diffusion models (GRPO, DDPO, RLOO, GAE, Group-PPO).",
        "",
        "subcommands:",
        *(f"  {name:<{width}}  {line}" for name, (_, _, line) in SUBCOMMANDS.items()),
        "",
        f"{PROG} SUBCOMMAND --help shows a subcommand's arguments.",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    """`ddpo-group SUBCOMMAND [ARGUMENTS ...]`; `argv`: the arguments after `ddpo-group` (default sys.argv[1:]).
    Returns the exit status (a subcommand's errors exit with their own one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        import difflib

        hint = difflib.get_close_matches(name, list(SUBCOMMANDS), n=1)
        print(f"{PROG}: error: unknown subcommand {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
              + f"; choose from {', '.join(SUBCOMMANDS)} ({PROG} --help)", file=sys.stderr)
        return 2
    module, function, _ = SUBCOMMANDS[name]
    run = getattr(importlib.import_module(module), function)
    prog = f"{PROG} {name}"
    if name == "train":  # absl's argv: the program, then its arguments
        result = run([prog, *rest])
    else:
        result = run(rest, prog=prog)
    return result if isinstance(result, int) else 0  # evaluate and pretrain return their summaries
