"""The named experiment configurations: `ddpo_group/config/grpo.py` (inside the package).

    accelerate launch scripts/train.py --config config/grpo.py:NAME     # from a checkout
    ddpo-group-train --config NAME                                     # installed, any directory

NAME is one of sd15 (default), ddpo, group_ppo, group_ppo_alg2, tiny, tiny_one_prompt, tiny_ddpo, tiny_group_ppo,
tiny_group_ppo_alg2,
tiny_gae, tiny_nft, tiny_awm, sd35, sd35_nft, flux, qwen_image, tiny_qwen_image, test; `ddpo-group-train --help` lists them with one line each.
"""

from ddpo_group.config.grpo import VARIANTS, get_config  # noqa: F401
