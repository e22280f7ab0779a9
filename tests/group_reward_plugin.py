"""Reward plugins of the group-wise tests (tests/test_group_rewards.py), named as 'tests/group_reward_plugin.py:fn'
so that a launched training process loads them too."""

import numpy as np


def brightness(images, prompts, metadata):
    """Per image: the mean pixel value."""
    return images.double().mean(dim=(1, 2, 3)).numpy(), {}


def brightness_rank(images, prompts, metadata):
    """Group-wise: rank of the image's brightness in its group / group size; refuses a call that is not one group."""
    if len(set(prompts)) != 1:
        raise ValueError(f"a group-wise call got several prompts: {sorted(set(prompts))}")
    values = images.double().mean(dim=(1, 2, 3)).numpy()
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values))
    return ranks / len(values), {"group_size": float(len(values))}


brightness_rank.group_wise = True  # the attribute form of register_reward(..., group_wise=True)
