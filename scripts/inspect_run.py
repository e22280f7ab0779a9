"""Write an HTML report for a run directory.

    python scripts/inspect_run.py logs/RUN [--compare logs/RUN2] [--output report.html] [--prompts "p1" "p2"] [--top-k 4]

Same as `ddpo-group inspect` (ddpo_group/cli/inspect.py).
"""

import os
import sys

# Run from a checkout without `pip install -e .`: import the package next to this folder.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_group.cli import inspect_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(inspect_main())
