"""The named experiment configurations: `ddpo_group/config/grpo.py` (inside the package).

    accelerate launch scripts/train.py --config config/grpo.py:NAME     # from a checkout
    ddpo-group-train --config NAME                                     # installed, any directory

NAME is one of the variants listed in the package file's docstring (sd15, the default; tiny, the main job; ...);
`ddpo-group-train --help` lists them all with one line each.
"""

from ddpo_group.config.grpo import VARIANTS, get_config  # noqa: F401
