"""Pretrain the tiny offline models (shapes world: tiny-shapes; scenes world: tiny-scenes, tiny-scenes-sd3) on a CPU:
`ddpo-group pretrain` from a checkout (its code, docstring and --help: ddpo_group/cli/pretrain.py).

    python scripts/pretrain_tiny.py                       # 12-25 min on a CPU -> a new folder runs/pretrain_shapes_TIME
    python scripts/pretrain_tiny.py --quick --output-dir /tmp/tiny   # seconds: smoke test
    python scripts/pretrain_tiny.py --replace-shipped     # re-create the shipped ddpo_group/assets/tiny_shapes
"""

import os
import sys

# Run from a checkout without `pip install -e .`: import the package next to this folder.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_group.cli import pretrain  # noqa: E402


def __getattr__(name):  # this module as the command's: main, lr_lambda, ema_update, ...
    return getattr(pretrain, name)


if __name__ == "__main__":
    pretrain.main()
