"""PerPromptStatTracker (docs/design.md §3): per-prompt buffers with a batch fallback, numbers by hand."""

import json
import math

import numpy as np
import pytest
import torch

from ddpo_group.algos.stat_tracking import PerPromptStatTracker

EPS = 1e-6
PROMPTS = ["a", "a", "b"]


def test_buffers_below_min_count_use_the_batch_statistics():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)
    advantages = tracker.update(PROMPTS, np.array([1.0, 3.0, 5.0]))
    batch_std = math.sqrt(8 / 3)  # population std of 1, 3, 5 around mean 3
    np.testing.assert_allclose(advantages, [-2 / (batch_std + EPS), 0.0, 2 / (batch_std + EPS)])
    assert tracker.get_stats()["fallback_fraction"] == 1.0


def test_a_full_enough_buffer_is_used_and_includes_the_current_batch():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)
    tracker.update(PROMPTS, np.array([1.0, 3.0, 5.0]))
    advantages = tracker.update(PROMPTS, np.array([5.0, 7.0, 0.0]))
    # "a": buffer [1, 3, 5, 7] reaches min_count -> mean 4, population std sqrt(5)
    # "b": buffer [5, 0] is short -> this batch's mean 4 and std sqrt(26 / 3)
    expected = [1 / (math.sqrt(5) + EPS), 3 / (math.sqrt(5) + EPS), -4 / (math.sqrt(26 / 3) + EPS)]
    np.testing.assert_allclose(advantages, expected)
    stats = tracker.get_stats()
    assert stats["num_prompts"] == 2
    assert stats["mean_group_size"] == pytest.approx(1.5)
    assert stats["mean_group_std"] == pytest.approx((1.0 + 0.0) / 2)  # std of [5, 7] and of [0]
    assert stats["fallback_fraction"] == pytest.approx(1 / 3)
    assert stats["num_tracked_prompts"] == 2


def test_buffer_keeps_only_the_latest_buffer_size_rewards():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)
    tracker.update(["a", "a"], np.array([1.0, 3.0]))
    tracker.update(["a", "a"], np.array([5.0, 7.0]))
    advantages = tracker.update(["a", "a", "a"], np.array([10.0, 10.0, 10.0]))
    # buffer [7, 10, 10, 10]: mean 9.25, population variance (2.25^2 + 3 * 0.75^2) / 4
    std = math.sqrt((2.25**2 + 3 * 0.75**2) / 4)
    np.testing.assert_allclose(advantages, [0.75 / (std + EPS)] * 3)
    assert tracker.group_stats["a"]["count"] == 4


def test_unbounded_buffer_with_no_min_count():
    tracker = PerPromptStatTracker(buffer_size=None, min_count=0, norm_by_std=False)
    for reward in range(50):
        tracker.update(["a"], np.array([float(reward)]))
    advantages = tracker.update(["a"], np.array([100.0]))
    mean = (sum(range(50)) + 100.0) / 51
    np.testing.assert_allclose(advantages, [100.0 - mean])
    assert tracker.group_stats["a"]["count"] == 51


def test_without_std_normalisation_only_the_mean_is_subtracted():
    tracker = PerPromptStatTracker(buffer_size=8, min_count=2, norm_by_std=False)
    advantages = tracker.update(["a", "a", "b"], np.array([1.0, 4.0, 10.0]))
    # "a" has 2 values (uses its buffer, mean 2.5); "b" has 1 (batch mean 5)
    np.testing.assert_allclose(advantages, [-1.5, 1.5, 5.0])


def test_accepts_torch_rewards_and_keeps_float32():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=1)
    advantages = tracker.update(PROMPTS, torch.tensor([1.0, 3.0, 5.0]))
    assert isinstance(advantages, np.ndarray) and advantages.dtype == np.float32
    np.testing.assert_allclose(advantages, [-1 / (1 + EPS), 1 / (1 + EPS), 0.0], rtol=1e-6)
    assert tracker.update(PROMPTS, np.array([1.0, 2.0, 3.0])).dtype == np.float64
    assert tracker.update(PROMPTS, [1, 2, 3]).dtype == np.float64


def test_group_stats_report_each_buffer():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=2)
    tracker.update(PROMPTS, np.array([1.0, 3.0, 5.0]))
    assert tracker.group_stats == {
        "a": {"count": 2, "mean": 2.0, "std": 1.0, "uses_buffer": True},
        "b": {"count": 1, "mean": 5.0, "std": 0.0, "uses_buffer": False},
    }


def test_stats_before_any_update_are_zero():
    stats = PerPromptStatTracker().get_stats()
    assert stats["num_prompts"] == 0 and stats["fallback_fraction"] == 0.0 and stats["num_tracked_prompts"] == 0


def test_state_dict_survives_json_and_resumes_identically():
    original = PerPromptStatTracker(buffer_size=4, min_count=3)
    original.update(PROMPTS, np.array([1.0, 3.0, 5.0]))
    original.update(PROMPTS, np.array([5.0, 7.0, 0.0]))
    state = json.loads(json.dumps(original.state_dict()))
    resumed = PerPromptStatTracker(buffer_size=4, min_count=3)
    resumed.load_state_dict(state)
    assert resumed.group_stats == original.group_stats
    assert resumed.get_stats() == original.get_stats()
    batch = np.array([2.0, 8.0, 1.0])
    np.testing.assert_array_equal(resumed.update(PROMPTS, batch), original.update(PROMPTS, batch))


def test_load_state_dict_truncates_to_this_buffer_size():
    state = {"buffers": {"a": [1.0, 2.0, 3.0, 4.0, 5.0]}}
    tracker = PerPromptStatTracker(buffer_size=2, min_count=1)
    tracker.load_state_dict(state)
    assert tracker.group_stats["a"]["mean"] == 4.5


def test_clear_forgets_everything():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=1)
    tracker.update(PROMPTS, np.array([1.0, 3.0, 5.0]))
    tracker.clear()
    assert tracker.group_stats == {}
    assert tracker.get_stats()["num_prompts"] == 0


@pytest.mark.parametrize(
    "prompts, rewards, match",
    [
        (["a", "b"], np.array([1.0, math.nan]), "NaN or inf at indices \\[1\\]"),
        (["a", "b"], np.array([1.0, 2.0, 3.0]), "prompts has 2 entries but rewards has 3"),
        ([], np.array([]), "rewards is empty"),
        (["a", "b"], np.ones((2, 1)), "rewards must have shape \\(B,\\)"),
        ([1, 2], np.array([1.0, 2.0]), "prompts must be strings"),
        ("ab", np.array([1.0, 2.0]), "a single string"),
    ],
)
def test_update_rejects_bad_input(prompts, rewards, match):
    with pytest.raises(ValueError, match=match):
        PerPromptStatTracker().update(prompts, rewards)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(buffer_size=4, min_count=8), "min_count \\(8\\) > buffer_size \\(4\\)"),
        (dict(buffer_size=0), "buffer_size must be a positive integer or None"),
        (dict(min_count=-1), "min_count must be an integer >= 0"),
        (dict(eps=-1.0), "eps must be"),
    ],
)
def test_constructor_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PerPromptStatTracker(**kwargs)


def test_load_state_dict_rejects_a_malformed_state():
    with pytest.raises(ValueError, match="'buffers' dict"):
        PerPromptStatTracker().load_state_dict({"stats": {}})
