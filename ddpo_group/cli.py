"""Console-script entry points (pyproject.toml [project.scripts])."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def train_main() -> None:
    """ddpo-group-train / scripts/train.py: `--config config/grpo.py[:VARIANT] [--config.FIELD=VALUE ...]`.

    The default config is config/grpo.py:tiny of the checkout this package lives in. A config or
    checkpoint error is printed as one line naming the field or path, without a traceback.
    """
    import os

    from absl import app, flags
    from ml_collections import config_flags

    from ddpo_group.config_check import ConfigError, base_config_path

    default = os.path.join(os.path.dirname(base_config_path()), "grpo.py:tiny")
    if "config" not in flags.FLAGS:
        config_flags.DEFINE_config_file("config", default, "Training configuration (FILE[:VARIANT]).")

    def main(_):
        from ddpo_group.trainer import CheckpointError, train

        try:
            train(flags.FLAGS.config)
        except (ConfigError, CheckpointError) as err:
            sys.exit(f"ddpo-group-train: error: {err}")

    app.run(main)


def inspect_main(argv: Sequence[str] | None = None) -> int:
    """ddpo-group-inspect / scripts/inspect_run.py: write an HTML report for a run directory."""
    parser = argparse.ArgumentParser(
        prog="ddpo-group-inspect",
        description="Write a self-contained HTML report (config, reward curves, time per phase, sample grids, "
        "best and worst samples) for a run directory written by the trainer.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (logdir/run_name) containing metrics.jsonl")
    parser.add_argument("--compare", metavar="RUN_DIR2", default=None, help="a second run to show side by side")
    parser.add_argument(
        "--output",
        default=None,
        help="HTML file to write (default: RUN_DIR/report.html, or RUN_DIR/report_vs_<RUN_DIR2 name>.html)",
    )
    parser.add_argument(
        "--prompts",
        nargs="+",
        default=None,
        metavar="PROMPT",
        help="prompts to show best/worst samples for (default: the 3 whose mean reward changed most)",
    )
    parser.add_argument("--top-k", type=int, default=4, help="best and worst samples shown per prompt (default 4)")
    args = parser.parse_args(argv)

    from ddpo_group.inspect import write_report

    try:
        path = write_report(args.run_dir, output=args.output, compare=args.compare, prompts=args.prompts, top_k=args.top_k)
    except ValueError as err:
        print(f"ddpo-group-inspect: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
