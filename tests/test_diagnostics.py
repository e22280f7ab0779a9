"""Per-step diagnostics (ddpo_group/training/diagnostics.py, docs/diagnostics.md): each quantity against a
hand computation, and the lists a training run writes into metrics.jsonl."""

import math

import pytest
import torch

from ddpo_group.training.diagnostics import GradShare, StepAccumulator, advantage_step_stats, value_step_stats
from ddpo_group.training.trainer import Trainer
from helpers import cheap, make_config, read_metrics


def test_advantage_stats_per_step_skip_invalid_rows_and_steps():
    advantages = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 9.0], [5.0, 0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    stats = advantage_step_stats(advantages, mask)
    assert stats["steps/adv_mean"][:2] == pytest.approx([3.0, 3.0]) and stats["steps/adv_mean"][2] is None
    # population std of (1, 3, 5) and of (2, 4)
    assert stats["steps/adv_std"][:2] == pytest.approx([math.sqrt(8 / 3), 1.0]) and stats["steps/adv_std"][2] is None


def test_value_stats_mean_squared_error_and_explained_variance():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    values = torch.tensor([[0.5, 1.0], [0.5, 0.0], [0.5, 0.5], [0.5, 0.5]])
    mask = torch.ones(4, 2)
    stats = value_step_stats(values, rewards, mask)
    # step 0: V = 0.5 everywhere: errors 0.25, 0.25, 0, 0 -> 0.125; residual variance = reward variance -> 0
    # step 1: V = R exactly: error 0, explained variance 1
    assert stats["steps/value_error"] == pytest.approx([0.125, 0.0])
    assert stats["steps/explained_variance"] == pytest.approx([0.0, 1.0])


def test_value_stats_leave_explained_variance_empty_when_rewards_are_equal():
    stats = value_step_stats(torch.zeros(3, 1), torch.full((3,), 0.7), torch.ones(3, 1))
    assert stats["steps/explained_variance"] == [None]
    assert stats["steps/value_error"] == pytest.approx([0.49])


def test_step_accumulator_by_hand():
    acc = StepAccumulator(num_steps=3, clip_low=0.1, clip_high=0.2)
    # micro-batch 1: two rows trained at steps 0 and 2; micro-batch 2: one row at step 2 (step 1 never trained)
    log_ratio_1 = torch.tensor([[math.log(1.3), math.log(0.95)], [math.log(0.85), math.log(1.0)]])
    acc.add(torch.tensor([[0, 2], [0, 2]]), torch.zeros(2, 2), log_ratio_1, torch.tensor([[1.0, -1.0], [-1.0, 1.0]]),
            torch.ones(2, 2))
    acc.add(torch.tensor([[2, 1]]), torch.zeros(1, 2), torch.tensor([[math.log(0.5), 0.3]]),
            torch.tensor([[-2.0, 1.0]]), torch.tensor([[1.0, 0.0]]))
    metrics = acc.metrics()
    assert metrics["steps/trained"] == [1, 0, 1]
    # step 0: ratios 1.3 (A > 0, above 1 + 0.2: clipped) and 0.85 (A < 0, below 1 - 0.1: clipped)
    # step 2: ratios 0.95 (A < 0, inside), 1.0 (inside), 0.5 (A < 0, below 0.9: clipped)
    assert metrics["steps/clipfrac"][0] == pytest.approx(1.0) and metrics["steps/clipfrac"][2] == pytest.approx(1 / 3)
    assert metrics["steps/approx_kl"][0] == pytest.approx(-(math.log(1.3) + math.log(0.85)) / 2)
    assert metrics["steps/approx_kl"][2] == pytest.approx(-(math.log(0.95) + 0.0 + math.log(0.5)) / 3)
    assert metrics["steps/approx_kl"][1] is None and metrics["steps/ratio_std"][1] is None
    ratios = [0.95, 1.0, 0.5]
    mean = sum(ratios) / 3
    assert metrics["steps/ratio_std"][2] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in ratios) / 3))


def test_grad_share_is_each_columns_gradient_norm_over_the_total():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    inputs = [torch.randn(4, 3) for _ in range(3)]
    # independent: each column's gradient by autograd.grad, its norm
    norms = []
    for x in inputs:
        grads = torch.autograd.grad(layer(x).pow(2).sum(), list(layer.parameters()))
        norms.append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads)))
    with GradShare(layer.parameters(), num_steps=4) as share:
        for step, x in zip([0, 2, 2], inputs):
            share.step = step
            layer(x).pow(2).sum().backward()
            share.close_column()
        share.step = None  # a column of mixed steps: not counted
        layer(inputs[0]).sum().backward()
        share.close_column()
    total = sum(norms)
    result = share.metrics()["steps/grad_share"]
    assert result[1] is None and result[3] is None
    assert result[0] == pytest.approx(norms[0] / total) and result[2] == pytest.approx((norms[1] + norms[2]) / total)
    # the hooks are gone after the block: a later backward changes nothing
    layer(inputs[0]).sum().backward()
    assert share.metrics()["steps/grad_share"][0] == pytest.approx(norms[0] / total)


def _run(tmp_path, **overrides):
    # 4 trajectories in micro-batches of 2, both in one accumulation window: one optimizer step per epoch
    settings = dict(sample__num_steps=4, reward_fn="jpeg_compressibility", train__gradient_accumulation_steps=2)
    config = make_config(tmp_path, **cheap(**{**settings, **overrides}))
    return read_metrics(Trainer(config).run())


@pytest.mark.slow
def test_a_run_logs_one_value_per_step_with_nulls_outside_the_sde_window(tmp_path):
    # the random-weight tiny model has no flow steps; a DDIM window: noise (and a density) at steps 1, 2 only
    row = _run(tmp_path, sample__sde_window_size=2, sample__sde_window_start=1)[0]
    for key in ("steps/adv_mean", "steps/adv_std", "steps/approx_kl", "steps/clipfrac", "steps/ratio_std",
                "steps/grad_share", "steps/trained"):
        assert len(row[key]) == 4, key
    assert row["steps/trained"] == [0, 1, 1, 0]
    for key in ("steps/adv_mean", "steps/approx_kl", "steps/grad_share"):
        assert row[key][0] is None and row[key][3] is None and None not in row[key][1:3], key
    assert sum(row["steps/grad_share"][1:3]) == pytest.approx(1.0)
    # one optimizer step per epoch: pi_old recomputed, the on-policy ratio is exactly 1 at every trained step
    assert row["steps/approx_kl"][1:3] == [0.0, 0.0] and row["steps/clipfrac"][1:3] == [0.0, 0.0]


@pytest.mark.slow
def test_group_ppo_logs_the_critic_per_step_and_one_step_trajectories_work(tmp_path):
    row = _run(tmp_path / "gp", algorithm__adv_estimator="group_ppo", train__timestep_selection="endpoints")[0]
    assert len(row["steps/value_error"]) == 4 and len(row["steps/explained_variance"]) == 4
    assert all(v is not None and v >= 0 for v in row["steps/value_error"])
    one = _run(tmp_path / "one", sample__num_steps=1)[0]
    assert one["steps/trained"] == [1] and one["steps/grad_share"] == [1.0]


def test_step_accumulator_splits_the_kl_to_the_reference_by_step():
    acc = StepAccumulator(num_steps=3, clip_low=0.1, clip_high=0.1)
    zeros = torch.zeros(2, 2)
    acc.add(torch.tensor([[0, 2], [0, 2]]), zeros, zeros, zeros, torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
            kl=torch.tensor([[0.2, 0.5], [0.4, 9.0]]))  # 9.0 sits on a masked pair: not counted
    acc.add(torch.tensor([[2]]), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1),
            kl=torch.tensor([[0.1]]))
    kl = acc.metrics()["steps/kl"]
    assert kl[0] == pytest.approx((0.2 + 0.4) / 2) and kl[2] == pytest.approx((0.5 + 0.1) / 2) and kl[1] is None
    assert "steps/kl" not in StepAccumulator(3, 0.1, 0.1).metrics()  # no reference model: no key
