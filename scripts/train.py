"""Train a text-to-image diffusion model with RL.

    accelerate launch scripts/train.py --config config/grpo.py:tiny
    accelerate launch scripts/train.py --config config/grpo.py --config.train.beta=0.01

`--config FILE:VARIANT` picks a config (config/grpo.py lists the variants); any field of
config/base.py can be overridden with `--config.FIELD=VALUE`. Without --config the
offline shapes-world run (config/grpo.py:tiny) starts. Same as `ddpo-group train` (ddpo_group/cli/train.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_group.cli import train_main  # noqa: E402

if __name__ == "__main__":
    train_main()
