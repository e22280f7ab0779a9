"""Mean reward of a model or a run's checkpoint, or an evaluation protocol's table: `ddpo-group evaluate` from a
checkout (its code and --help: ddpo_group/cli/evaluate.py).

    python scripts/evaluate.py --checkpoint runs/NAME [--protocol geneval] [--output FILE]
"""

import os
import sys

# Run from a checkout without `pip install -e .`: import the package next to this folder.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_group.cli import evaluate  # noqa: E402


def __getattr__(name):  # this module as the command's: main, run, EvaluateError, write_result, ...
    return getattr(evaluate, name)


if __name__ == "__main__":
    evaluate.run()
