"""Group-PPO grouping (docs/design.md §4): Algorithm 2, segment advantages, adaptive threshold, metrics."""

import json
import math
import random

import pytest
import torch

from ddpo_group.algos.advantages import get_adv_estimator
from ddpo_group.algos.grouping import (
    AdaptiveThreshold,
    compute_group_ppo_advantages,
    find_group_endpoints,
    grouping_metrics,
    segment_advantages,
)


def endpoints_of(endpoint_mask, row=0):
    return torch.nonzero(endpoint_mask[row]).flatten().tolist()


def test_constant_advantages_give_segments_of_max_group_size():
    # Var of a constant segment is 0, so r_ppo = eps and r_grpo / r_ppo = (2/3 + eps) / eps >> 1:
    # only the length rule closes segments. T=10, max 4: [0..3], [4..7], [8..9].
    advantages = torch.full((3, 10), 0.5)
    outcome = torch.tensor([1.0, -1.0, 0.0])
    endpoint_mask, group_ids = find_group_endpoints(advantages, outcome, torch.ones(3, 10), 1.0, 4)
    for row in range(3):
        assert endpoints_of(endpoint_mask, row) == [3, 7, 9]
        assert group_ids[row].tolist() == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert endpoint_mask.dtype == torch.bool and group_ids.dtype == torch.int64


def test_alternating_advantages_give_single_step_segments():
    # Any 2-step segment [+1, -1] has population variance 1 in every row: r_ppo = 1 + eps.
    # Outcome (0.1, -0.1) has variance 0.01: ratio ~ 0.01 < 0.5, so every step closes a segment.
    advantages = torch.tensor([[(-1.0) ** s for s in range(6)]] * 2)
    outcome = torch.tensor([0.1, -0.1])
    endpoint_mask, group_ids = find_group_endpoints(advantages, outcome, torch.ones(2, 6), 0.5, 16)
    assert endpoint_mask.all()
    assert group_ids.tolist() == [[1, 2, 3, 4, 5, 6]] * 2


def test_hand_worked_single_trajectory():
    # B=1: r_grpo = 0 + eps = 0.1. threshold 0.5 splits when r_ppo > 0.2, i.e. Var > 0.1.
    # t=1: seg [0, .4]          Var 0.04          ratio 0.1/0.14  = 0.71  keep
    # t=2: seg [0, .4, .4]      Var 0.08/3=0.0267 ratio 0.1/0.127 = 0.79  keep
    # t=3: seg [0, .4, .4, 2]   mean 0.7, Var (.49+.09+.09+1.69)/4 = 0.59, ratio 0.1/0.69 = 0.145 split
    #      -> step 2 is an endpoint, start = 3
    # t=4: seg [2, 2]           Var 0             ratio 1               keep
    # last valid step 4 is an endpoint.
    advantages = torch.tensor([[0.0, 0.4, 0.4, 2.0, 2.0]])
    endpoint_mask, group_ids = find_group_endpoints(
        advantages, torch.tensor([3.0]), torch.ones(1, 5), 0.5, 16, eps=0.1
    )
    assert endpoint_mask.tolist() == [[False, False, True, False, True]]
    assert group_ids.tolist() == [[1, 1, 1, 2, 2]]


def test_hand_worked_two_trajectories_mean_of_variances():
    # r_grpo = Var(1, -1) + eps = 1 + eps; threshold 4 splits when r_ppo > 0.25.
    # t=2: row0 [1, 1, 1.4] Var 0.0356, row1 [0, 0, 0] Var 0 -> r_ppo 0.0178, ratio 56   keep
    # t=3: row0 [1, 1, 1.4, 3] Var 0.68, row1 Var 0      -> r_ppo 0.34,   ratio 2.94 split at 2
    # t=4: row0 [3, 3] Var 0, row1 [0, 0.6] Var 0.09     -> r_ppo 0.045,  ratio 22   keep
    advantages = torch.tensor([[1.0, 1.0, 1.4, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.6]])
    mask = torch.ones(2, 5)
    expected_ids = [[1, 1, 1, 2, 2]] * 2
    # outcome advantages as (B,) or broadcast over the steps as grpo returns them (B, T)
    for outcome in (torch.tensor([1.0, -1.0]), torch.tensor([[1.0] * 5, [-1.0] * 5])):
        endpoint_mask, group_ids = find_group_endpoints(advantages, outcome, mask, 4.0, 16)
        assert endpoints_of(endpoint_mask, 0) == [2, 4] and endpoints_of(endpoint_mask, 1) == [2, 4]
        assert group_ids.tolist() == expected_ids


def test_invalid_tail_steps_get_group_id_zero_and_last_valid_step_is_endpoint():
    # Valid steps 0..3; constant advantages; max 3: [0..2], [3]. The garbage on masked steps is ignored.
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0, 50.0, -50.0]] * 2)
    mask = torch.tensor([[1.0, 1, 1, 1, 0, 0]] * 2)
    endpoint_mask, group_ids = find_group_endpoints(advantages, torch.tensor([1.0, -1.0]), mask, 1.0, 3)
    assert endpoint_mask.tolist() == [[False, False, True, True, False, False]] * 2
    assert group_ids.tolist() == [[1, 1, 1, 2, 0, 0]] * 2


def test_fully_masked_batch_has_no_endpoints():
    endpoint_mask, group_ids = find_group_endpoints(torch.ones(2, 4), torch.zeros(2), torch.zeros(2, 4), 1.0, 2)
    assert not endpoint_mask.any() and not group_ids.any()


def _reference_endpoints(advantages, outcome, threshold, max_group_size, eps):
    """Algorithm 2 as plain Python on lists (all steps valid)."""

    def pop_var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    T = len(advantages[0])
    r_grpo = pop_var(outcome) + eps
    endpoints, start = [], 0
    for t in range(1, T):
        r_ppo = sum(pop_var(row[start : t + 1]) for row in advantages) / len(advantages) + eps
        if r_grpo / r_ppo < threshold or t - start + 1 > max_group_size:
            endpoints.append(t - 1)
            start = t
    return endpoints + [T - 1]


@pytest.mark.parametrize("seed", range(6))
def test_endpoints_match_plain_python_algorithm(seed):
    rng = random.Random(seed)
    B, T = 3, 9
    advantages = [[rng.gauss(0, 1) * rng.choice([0.1, 1.0]) for _ in range(T)] for _ in range(B)]
    outcome = [rng.gauss(0, 1) for _ in range(B)]
    threshold = rng.choice([0.3, 1.0, 3.0])
    max_group_size = rng.choice([2, 4, 16])
    endpoint_mask, _ = find_group_endpoints(
        torch.tensor(advantages), torch.tensor(outcome), torch.ones(B, T), threshold, max_group_size
    )
    assert endpoints_of(endpoint_mask) == _reference_endpoints(advantages, outcome, threshold, max_group_size, 1e-6)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=-1.0), "threshold"),
        (dict(max_group_size=0), "max_group_size"),
        (dict(max_group_size=2.5), "max_group_size"),
        (dict(mask=torch.ones(2, 3)), "mask"),
        (dict(outcome_advantages=torch.zeros(3)), "outcome_advantages"),
        (dict(advantages=torch.zeros(2, 4, 1)), "advantages"),
        (dict(eps=0.0), "eps"),
    ],
)
def test_find_group_endpoints_rejects_bad_input(kwargs, name):
    args = dict(
        advantages=torch.zeros(2, 4), outcome_advantages=torch.zeros(2), mask=torch.ones(2, 4),
        threshold=1.0, max_group_size=2,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        find_group_endpoints(**args)


def test_segment_advantages_mean_over_each_segment_of_each_trajectory():
    advantages = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 0.0, 6.0, 2.0, -2.0]], dtype=torch.float64)
    group_ids = torch.tensor([[1, 1, 2, 2, 2], [1, 1, 2, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    out = segment_advantages(advantages, group_ids, mask)
    # row 0: (1+2)/2, (3+4+5)/3; row 1: (0+0)/2, (6+2)/2, masked step -> 0
    assert out.tolist() == [[1.5, 1.5, 4.0, 4.0, 4.0], [0.0, 0.0, 4.0, 4.0, 0.0]]
    assert out.dtype == torch.float64


def test_segment_advantages_rejects_float_group_ids():
    with pytest.raises(ValueError, match="group_ids"):
        segment_advantages(torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3))


def _endpoints(num_endpoints, T=10):
    endpoint_mask = torch.zeros(1, T, dtype=torch.bool)
    endpoint_mask[0, T - num_endpoints :] = True
    return endpoint_mask


def test_adaptive_threshold_rises_when_compression_above_target():
    tracker = AdaptiveThreshold(threshold=1.0, lr=0.01, target_compression=0.75)
    # 2 endpoints over 10 valid steps: c = 0.8
    assert tracker.update(_endpoints(2), torch.ones(1, 10)) == pytest.approx(math.exp(0.01 * 0.05))
    assert tracker.threshold > 1.0


def test_adaptive_threshold_falls_when_compression_below_target():
    tracker = AdaptiveThreshold(threshold=2.0, lr=0.01, target_compression=0.75)
    # 5 endpoints over 10 valid steps: c = 0.5
    assert tracker.update(_endpoints(5), torch.ones(1, 10)) == pytest.approx(2.0 * math.exp(-0.01 * 0.25))


def test_adaptive_threshold_is_clipped():
    high = AdaptiveThreshold(threshold=1.0, lr=100.0, min_threshold=0.1, max_threshold=10.0)
    assert high.update(_endpoints(1), torch.ones(1, 10)) == 10.0  # 1 * exp(100 * 0.15) -> 10
    low = AdaptiveThreshold(threshold=1.0, lr=100.0, min_threshold=0.1, max_threshold=10.0)
    assert low.update(_endpoints(10), torch.ones(1, 10)) == 0.1  # 1 * exp(-75) -> 0.1


def test_adaptive_threshold_disabled_stays_fixed():
    tracker = AdaptiveThreshold(threshold=1.5, enabled=False)
    assert tracker.update(_endpoints(1), torch.ones(1, 10)) == 1.5


def test_adaptive_threshold_state_round_trip():
    tracker = AdaptiveThreshold(threshold=1.0, lr=0.5)
    tracker.update(_endpoints(1), torch.ones(1, 10))
    state = json.loads(json.dumps(tracker.state_dict()))
    restored = AdaptiveThreshold(threshold=1.0, lr=0.5)
    restored.load_state_dict(state)
    assert restored.threshold == tracker.threshold == pytest.approx(math.exp(0.5 * 0.15))
    assert restored.update(_endpoints(1), torch.ones(1, 10)) == pytest.approx(math.exp(2 * 0.5 * 0.15))


def test_adaptive_threshold_rejects_threshold_outside_bounds():
    with pytest.raises(ValueError, match="threshold"):
        AdaptiveThreshold(threshold=20.0, max_threshold=10.0)


def test_grouping_metrics_by_hand():
    # 2 trajectories x 5 valid steps (step 5 masked), endpoints at steps 1 and 4: K = 4, N = 10.
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]] * 2)
    endpoint_mask = torch.tensor([[False, True, False, False, True, False]] * 2)
    metrics = grouping_metrics(endpoint_mask, mask, 1.5)
    assert metrics == {
        "group/compression_ratio": pytest.approx(0.6),
        "group/num_endpoints": 2.0,
        "group/mean_segment_len": 2.5,
        "group/threshold": 1.5,
        "group/efficiency_gain": 2.5,
    }


def test_compute_group_ppo_advantages_end_to_end():
    # V = 0, gamma = lam = 1: raw GAE A_t = R_i on every step, returns = R_i.
    # Whitening over 8 valid steps of +-1: mean 0, unbiased var 8/7 -> A = +-1/sqrt(8/7 + 1e-8).
    # Rows are constant, so only max_group_size = 2 closes segments: endpoints 1 and 3.
    token_level_rewards = torch.tensor([[0.0, 0, 0, 1], [0, 0, 0, -1]])
    values = torch.zeros(2, 4)
    mask = torch.ones(2, 4)
    segment_adv, returns, endpoint_mask, group_ids = compute_group_ppo_advantages(
        token_level_rewards, values, mask, torch.tensor([1.0, -1.0]), 1.0, 2, gamma=1.0, lam=1.0
    )
    a = 1 / math.sqrt(8 / 7 + 1e-8)
    torch.testing.assert_close(segment_adv, torch.tensor([[a] * 4, [-a] * 4]))
    assert returns.tolist() == [[1.0] * 4, [-1.0] * 4]
    assert endpoints_of(endpoint_mask) == [1, 3]
    assert group_ids.tolist() == [[1, 1, 2, 2]] * 2


def test_group_ppo_is_registered_and_reports_grouping():
    estimator = get_adv_estimator("group_ppo")
    info = {}
    segment_adv, returns = estimator(
        rewards=torch.tensor([1.0, -1.0]),
        prompt_ids=torch.tensor([0, 0]),
        mask=torch.ones(2, 4),
        values=torch.zeros(2, 4),
        config={"gamma": 1.0, "lam": 1.0, "max_group_size": 2},
        threshold=1.0,
        info=info,
    )
    a = 1 / math.sqrt(8 / 7 + 1e-8)
    torch.testing.assert_close(segment_adv, torch.tensor([[a] * 4, [-a] * 4]))
    assert returns.tolist() == [[1.0] * 4, [-1.0] * 4]
    assert info["group_ids"].tolist() == [[1, 1, 2, 2]] * 2
    assert endpoints_of(info["endpoint_mask"]) == [1, 3]


def test_group_advantage_norm_gives_each_prompt_its_own_baseline_per_step():
    # V = 0, gamma = lam = 1: raw GAE A_t = R_i, whitened over the batch; one segment of the 3 steps
    # (max_group_size 3, threshold so low that only the length closes a segment). Prompt a: R = 1, 3;
    # prompt b: R = 10, 10. The per-prompt baseline removes the batch whitening's affine map:
    # prompt a -> (R - 2) / (1 + 1e-6) = -1, +1 (up to eps); prompt b: equal rewards -> 0.
    rewards = torch.tensor([1.0, 3.0, 10.0, 10.0], dtype=torch.float64)
    mask = torch.ones(4, 3)
    token_level_rewards = torch.zeros(4, 3, dtype=torch.float64)
    token_level_rewards[:, -1] = rewards
    segment_adv, _, _, group_ids = compute_group_ppo_advantages(
        token_level_rewards, torch.zeros(4, 3, dtype=torch.float64), mask, torch.tensor([-1.0, 1.0, 0.0, 0.0]),
        1e-9, 3, gamma=1.0, lam=1.0, advantage_norm="group", prompt_ids=torch.tensor([0, 0, 1, 1]),
    )
    assert group_ids.tolist() == [[1, 1, 1]] * 4
    whitened_gap = 2.0 / (torch.tensor([1.0, 3.0, 10.0, 10.0] * 3).var() + 1e-8).sqrt()  # R_a gap after whitening
    half = float(whitened_gap) / 2
    expected = torch.tensor([[-half / (half + 1e-6)] * 3, [half / (half + 1e-6)] * 3, [0.0] * 3, [0.0] * 3],
                            dtype=torch.float64)
    torch.testing.assert_close(segment_adv, expected, rtol=1e-12, atol=1e-12)


def test_group_advantage_norm_needs_prompt_ids_and_a_known_name():
    args = (torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2), 1.0, 2)
    with pytest.raises(ValueError, match="prompt_ids"):
        compute_group_ppo_advantages(*args, advantage_norm="group")
    with pytest.raises(ValueError, match="advantage_norm"):
        compute_group_ppo_advantages(*args, advantage_norm="per_prompt")
