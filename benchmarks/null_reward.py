"""A null control for a learning run (docs/scenes.md, "The flow fall"): GenEval's partial score on the shapes
detector, computed and logged as usual (reward_info/ShuffledGenEval/strict_correct is the images' true strict
verdict), but the rewards handed to the trainer are those scores shuffled among the call's images, so the
advantages carry no information about the images they are attached to. A run on it shows what training does to
the images with the signal taken out (drift), against the same run on the real reward.

    python benchmarks/scenes_ladder.py --rungs b --cases colors --families flow --seeds 42 \
        --set reward_fn=benchmarks/null_reward.py:ShuffledGenEval --results RESULTS
"""

from __future__ import annotations

import itertools

import numpy as np

from ddpo_group.rewards.geneval.reward import GenEvalReward


class ShuffledGenEval(GenEvalReward):
    """GenEvalReward(score="partial", detector="shapes") whose returned rewards are a random permutation of the
    true ones (a fresh, seeded permutation every call: the same run shuffles the same way)."""

    def __init__(self, seed: int = 0, **kwargs):
        kwargs.setdefault("score", "partial")
        kwargs.setdefault("detector", "shapes")
        super().__init__(**kwargs)
        self._calls = itertools.count()
        self._seed = seed

    def __call__(self, images, prompts, metadata):
        rewards, info = super().__call__(images, prompts, metadata)
        rewards = np.asarray(rewards, dtype=np.float64)
        rng = np.random.default_rng([self._seed, next(self._calls)])
        return rewards[rng.permutation(len(rewards))], info
