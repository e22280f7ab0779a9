"""Every configuration field with its default: `ddpo_group/config/base.py` (inside the package, read it there).

A config file of your own can start from it:

    from ddpo_group.config.base import get_config as base_config

    def get_config():
        config = base_config()
        config.reward_fn = "my_rewards.py:score"
        return config

and run with `accelerate launch scripts/train.py --config my_config.py`.
"""

from ddpo_group.config.base import get_config  # noqa: F401
