"""`ddpo-group inspect` (and ddpo-group-inspect, scripts/inspect_run.py): the HTML report of a run directory."""

from __future__ import annotations

import sys
from typing import Sequence

from ddpo_group.cli.common import OneLineArgumentParser, inside_package


def inspect_main(argv: Sequence[str] | None = None, prog: str = "ddpo-group-inspect") -> int:
    """ddpo-group inspect / ddpo-group-inspect / scripts/inspect_run.py: write an HTML report for a run directory.
    `argv`: the arguments after the command (default sys.argv[1:]); `prog`: the command's name in its messages."""
    parser = OneLineArgumentParser(
        prog=prog,
        description="Write a self-contained HTML report (config, reward curves, time per phase, sample grids, "
        "best and worst samples) for a run directory written by the trainer.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (logdir/run_name) containing metrics.jsonl")
    parser.add_argument("--compare", metavar="RUN_DIR2", nargs="+", default=None,
                        help="a second run to show side by side (with --steps-png: one or more)")
    parser.add_argument(
        "--output",
        default=None,
        help="HTML file to write (default RUN_DIR/report.html; RUN_DIR/report_vs_<RUN_DIR2 name>.html with --compare)",
    )
    parser.add_argument(
        "--prompts",
        nargs="+",
        default=None,
        metavar="PROMPT",
        help="prompts to show best/worst samples for (default: the 3 whose mean reward changed most)",
    )
    parser.add_argument("--top-k", type=int, default=4, help="best and worst samples shown per prompt (default 4)")
    parser.add_argument(
        "--steps-png", metavar="PNG", default=None,
        help="instead of the report, write the per-step heat maps (epoch x step) of RUN_DIR (and --compare) to PNG",
    )
    parser.add_argument(
        "--steps-keys", nargs="+", metavar="KEY", default=None,
        help="with --steps-png: the steps/* metrics to draw (default: all logged), e.g. steps/trained steps/grad_share",
    )
    parser.add_argument("--names", nargs="+", metavar="NAME", default=None,
                        help="labels of the runs in order, e.g. --names A,B (default 'A: <variant>', 'B: <variant>'); "
                        "with --steps-png: column titles")
    args = parser.parse_args(argv)
    for option, path in (("--output", args.output), ("--steps-png", args.steps_png)):
        problem = path and inside_package(path, option)  # the package's shipped files are never written over
        if problem:
            print(f"{prog}: error: {problem}", file=sys.stderr)
            return 2
    if args.names and len(args.names) == 1 and "," in args.names[0]:
        args.names = [name.strip() for name in args.names[0].split(",")]  # --names A,B (docs/design.md §13)

    from ddpo_group.report.page import write_report, write_step_heatmaps

    try:
        if args.steps_png:
            runs = [args.run_dir] + (args.compare or [])
            path = write_step_heatmaps(runs, args.steps_png, keys=args.steps_keys, names=args.names)
        else:
            if args.compare and len(args.compare) > 1:
                raise ValueError(f"--compare: the report compares two runs, got {len(args.compare) + 1}; "
                                 "more runs side by side only with --steps-png")
            path = write_report(args.run_dir, output=args.output, compare=args.compare[0] if args.compare else None,
                                prompts=args.prompts, top_k=args.top_k, names=args.names)
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
