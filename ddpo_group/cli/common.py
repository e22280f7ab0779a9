"""What every subcommand of `ddpo-group` shares: one-line errors, argparse with one-line errors, the torch CPU
threads. Imports nothing heavy at module level (`ddpo-group --help` stays fast); the reward server imports it."""

from __future__ import annotations

import argparse
import os


def debug() -> bool:
    """Whether DDPO_GROUP_DEBUG asks for tracebacks instead of one-line errors."""
    return os.environ.get("DDPO_GROUP_DEBUG", "").lower() in ("1", "true", "yes")


def one_line(err: BaseException) -> str:
    """An exception as one line: its message, with the type for errors that are not the library's own."""
    from ddpo_group.config.registry import ConfigError

    text = " ".join(str(err).split()) or type(err).__name__
    own = isinstance(err, ConfigError) or type(err).__name__ in (
        "CheckpointError", "RewardError", "RewardNotReadyError", "SamplesNotFiniteError", "HubUnreachableError")
    return text if own else f"{type(err).__name__}: {text} (DDPO_GROUP_DEBUG=1 shows the traceback)"


def cpu_threads() -> int:
    """Give this process the torch CPU threads `accelerate launch` gives scripts/train.py: $OMP_NUM_THREADS, else one
    (the launcher sets OMP_NUM_THREADS=1 in the processes it starts unless it is set). torch's own default, a thread
    per core in every process, oversubscribes a machine whose cores other processes use too. Returns the count."""
    import os

    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not threads.isdigit() or int(threads) < 1:
        threads = os.environ["OMP_NUM_THREADS"] = "1"  # and for the processes this one starts
    torch.set_num_threads(int(threads))
    return int(threads)


PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the installed ddpo_group/


def inside_package(path: str, option: str) -> str | None:
    """A one-line refusal when `path` resolves (symlinks, `..`, `~`, relative or absolute) to the package's own
    folder or anything in it (its shipped models, prompt sets, code), which no command writes over; None otherwise.
    `option` names where the path came from (--output-dir, config.logdir, ...)."""
    package = os.path.realpath(PACKAGE_DIR)
    target = os.path.realpath(os.path.expanduser(path))
    if os.path.commonpath([package, target]) != package:
        return None
    return (f"{option} {path}: resolves to {target}, inside the package's own folder {package} (its shipped models "
            f"and files, which no command writes over); give {option} a path outside it")


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line naming the flag (not its usage block), exit code 2;
    `help_command`: the command that lists the flags (default: PROG --help)."""

    def __init__(self, *args, help_command: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.help_command = help_command or f"{self.prog} --help"

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} ({self.help_command} lists the flags)\n")
