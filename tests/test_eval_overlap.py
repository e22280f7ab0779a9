"""The evaluation scores batch k while batch k+1 samples (ddpo_group/evaluation/evaluator.py), and its result is the
one-batch-at-a-time evaluation's."""

import threading

import numpy as np

from ddpo_group.data.prompts import PromptRecord
from ddpo_group.diffusion.policy import policy_for
from ddpo_group.diffusion.tiny import build_tiny_pipeline
from ddpo_group.evaluation.evaluator import evaluate

RECORDS = [PromptRecord(prompt) for prompt in ("a red circle", "a blue square", "a green triangle")]


class BrightnessAfterNextBatch:
    """The mean pixel per image; the reward of sampling call k first waits (at most 60 s) for call k + 1 to start,
    and records whether it started: it does only if the evaluation samples on while a reward runs."""

    names = ["brightness"]

    def __init__(self, started, batches):
        self.started, self.batches, self.calls, self.overlapped = started, batches, 0, []

    def __call__(self, images, prompts, metadata, **kwargs):
        index, self.calls = self.calls, self.calls + 1
        if index + 1 < self.batches:
            self.overlapped.append(self.started[index + 1].wait(timeout=60))
        values = images.float().mean(dim=(1, 2, 3)).numpy().astype(np.float64)
        return values, {"brightness": values}, {}


def test_a_batch_is_scored_while_the_next_samples_with_the_serial_result():
    policy = policy_for(build_tiny_pipeline(seed=0))
    sample, started = policy.sample, [threading.Event() for _ in range(3)]

    def sample_and_say(*args, **kwargs):
        started[sum(event.is_set() for event in started)].set()
        return sample(*args, **kwargs)

    policy.sample = sample_and_say
    reward = BrightnessAfterNextBatch(started, batches=3)
    kwargs = dict(images_per_prompt=2, num_steps=2, guidance_scale=3.0, eta=1.0, seed=7)
    result = evaluate(policy, None, RECORDS, reward, batch_size=2, **kwargs)  # 6 images: 3 batches
    assert reward.overlapped == [True, True]
    policy.sample = sample
    one_batch = evaluate(policy, None, RECORDS, BrightnessAfterNextBatch(started, batches=1), batch_size=6, **kwargs)
    np.testing.assert_allclose(result["rewards"], one_batch["rewards"], rtol=0, atol=1e-6)
    assert result["components"]["brightness"] == result["reward_mean"]
