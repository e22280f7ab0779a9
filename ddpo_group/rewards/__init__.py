"""Reward functions: the registry, built-ins and plugin loading (imports: docs/architecture.md).

    fn(images (B, 3, H, W) float in [0, 1], prompts list[str], metadata list[dict])
        -> (rewards (B,), info dict)

`build_reward_fn(reward_fn, reward_weights, ...)` builds the CombinedReward the trainer
calls; see `registry` for the spec strings (registered name, entry point of the group
"ddpo_group.rewards", "module:function", "file.py:function", "http://host:port").
Built-ins: jpeg_compressibility, jpeg_incompressibility, aesthetic; optional (lazy):
clip_score, pickscore, pickscore_rank (group-wise), imagereward, hpsv2, hpsv3; the shapes-world rewards "shapes_*"
(ddpo_group.rewards.shapes). The reward server is ``python -m ddpo_group.rewards.server``.
"""

from ddpo_group.rewards.combine import (
    REWARD_AGGREGATIONS,
    AsyncRewardRunner,
    CombinedReward,
    build_reward_fn,
    validate_rewards,
)
from ddpo_group.rewards.registry import (
    ENTRY_POINT_GROUP,
    REWARD_REGISTRY,
    RewardError,
    RewardNotReadyError,
    get_reward,
    list_rewards,
    register_reward,
    resolve_reward,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "REWARD_AGGREGATIONS",
    "REWARD_REGISTRY",
    "AsyncRewardRunner",
    "CombinedReward",
    "RewardError",
    "RewardNotReadyError",
    "build_reward_fn",
    "get_reward",
    "list_rewards",
    "register_reward",
    "resolve_reward",
    "validate_rewards",
]
