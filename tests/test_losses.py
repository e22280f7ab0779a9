"""Losses (docs/design.md §5): expected numbers by hand, plain-Python loops and analytic gradients."""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpo_group.algos.losses import (
    AGG_MODES,
    POLICY_LOSS_REGISTRY,
    agg_loss,
    compute_value_loss,
    gaussian_kl,
    get_policy_loss,
    kl_penalty,
    register_policy_loss,
    registered_policy_losses,
)


def clip_config(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, mode="token-mean"):
    return SimpleNamespace(
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=mode,
    )


def reference_agg(loss_rows, mask_rows, mode):
    """Plain-Python aggregation."""
    num_steps = len(loss_rows[0])
    sums = [sum(l * m for l, m in zip(lr, mr)) for lr, mr in zip(loss_rows, mask_rows)]
    counts = [sum(mr) for mr in mask_rows]
    if mode == "token-mean":
        return sum(sums) / sum(counts)
    if mode == "seq-mean-token-sum":
        return sum(sums) / len(sums)
    if mode == "seq-mean-token-mean":
        return sum(s / c for s, c in zip(sums, counts)) / len(sums)
    return sum(sums) / num_steps


def reference_vanilla_token(old, new, advantage, low, high, c):
    ratio = math.exp(min(max(new - old, -20.0), 20.0))
    clipped = -advantage * max(min(ratio, 1 + high), 1 - low)
    loss = max(-advantage * ratio, clipped)
    if advantage < 0:
        loss = min(loss, -advantage * c)
    return loss


LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
MASK = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (1 + 2 + 4) / 3),  # divided by T = 3, not by the token count
    ],
)
def test_agg_loss_modes_by_hand(mode, expected):
    result = agg_loss(torch.tensor(LOSS), torch.tensor(MASK), mode)
    assert result.shape == ()
    assert result.item() == pytest.approx(expected)


def test_agg_loss_sum_norm_uses_the_constant_step_count():
    loss = torch.ones(2, 4)
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(3 / 4)
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(1.0)


def test_agg_loss_of_a_fully_masked_batch_is_zero():
    assert agg_loss(torch.ones(2, 3), torch.zeros(2, 3), "token-mean").item() == 0.0
    assert agg_loss(torch.ones(2, 3), torch.zeros(2, 3), "seq-mean-token-mean").item() == 0.0


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.floats(-5, 5), st.booleans()), min_size=4, max_size=4), min_size=1, max_size=4),
    st.sampled_from(AGG_MODES),
)
def test_agg_loss_matches_python_loop(rows, mode):
    loss_rows = [[v for v, _ in row] for row in rows]
    mask_rows = [[1.0] + [float(m) for _, m in row[1:]] for row in rows]  # a valid step in every row
    result = agg_loss(torch.tensor(loss_rows, dtype=torch.float64), torch.tensor(mask_rows), mode)
    assert result.item() == pytest.approx(reference_agg(loss_rows, mask_rows, mode), abs=1e-12)


def test_agg_loss_rejects_bad_mode_and_shapes():
    with pytest.raises(ValueError, match="loss_agg_mode must be one of .*seq-mean-token-sum-norm"):
        agg_loss(torch.ones(2, 3), torch.ones(2, 3), "sum")
    with pytest.raises(ValueError, match="mask must have the shape of loss_mat"):
        agg_loss(torch.ones(2, 3), torch.ones(3), "token-mean")  # no broadcasting
    with pytest.raises(ValueError, match="loss_mat is empty"):
        agg_loss(torch.ones(0, 3), torch.ones(0, 3), "token-mean")


LOGP = [[-1.0, 0.0, 0.0, 30.0]]
REF = [[0.0, 0.0, 30.0, 0.0]]


@pytest.mark.parametrize(
    "kinds, expected",
    [
        (("k1", "kl"), [-1.0, 0.0, -30.0, 30.0]),
        (("abs",), [1.0, 0.0, 30.0, 30.0]),
        (("k2", "mse"), [0.5, 0.0, 450.0, 450.0]),
        # k = ref - logp = 1, 0, 30 -> 20, -30 -> -20; exp(k) - k - 1 = e - 2, 0, then clamped to 10 twice.
        (("k3", "low_var_kl"), [math.e - 2, 0.0, 10.0, 10.0]),
    ],
)
def test_kl_penalty_kinds_by_hand(kinds, expected):
    for kind in kinds:
        result = kl_penalty(torch.tensor(LOGP, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64), kind)
        torch.testing.assert_close(result, torch.tensor([expected], dtype=torch.float64))


def test_low_var_kl_gradient_is_zero_where_clamped():
    logprob = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    kl_penalty(logprob, torch.tensor(REF, dtype=torch.float64), "k3").sum().backward()
    # d/dlogp (exp(ref - logp) - (ref - logp) - 1) = 1 - exp(ref - logp)
    torch.testing.assert_close(logprob.grad, torch.tensor([[1 - math.e, 0.0, 0.0, 0.0]], dtype=torch.float64))


def test_kl_penalty_rejects_unknown_kind_and_shape_mismatch():
    with pytest.raises(ValueError, match="kl kind must be one of .*low_var_kl"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "k4")
    with pytest.raises(ValueError, match="ref_logprob must have the shape of logprob"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 1), "k1")


MEAN = [[[[1.0, 2.0]]], [[[0.0, 0.0]]]]  # (2, 1, 1, 2)
REF_MEAN = [[[[0.0, 0.0]]], [[[3.0, 1.0]]]]


@pytest.mark.parametrize(
    "std, expected",
    [
        (0.5, [(1 + 4) / 2 / 0.5, (9 + 1) / 2 / 0.5]),  # 2 sigma^2 = 0.5
        (torch.tensor(0.5), [5.0, 10.0]),
        (torch.tensor([1.0, 2.0]), [(0.5 + 2.0) / 2, (9 / 8 + 1 / 8) / 2]),
        (torch.tensor([1.0, 2.0]).reshape(2, 1, 1, 1), [1.25, 0.625]),
    ],
)
def test_gaussian_kl_by_hand(std, expected):
    result = gaussian_kl(torch.tensor(MEAN), torch.tensor(REF_MEAN), std)
    torch.testing.assert_close(result, torch.tensor(expected))


def test_gaussian_kl_keeps_float64_and_carries_the_gradient():
    mean = torch.tensor(MEAN, dtype=torch.float64, requires_grad=True)
    std = torch.tensor([1.0, 2.0], dtype=torch.float64)
    result = gaussian_kl(mean, torch.tensor(REF_MEAN, dtype=torch.float64), std)
    assert result.dtype == torch.float64 and result.shape == (2,)
    result.sum().backward()
    # d/dmu mean_d (mu - mu_ref)^2 / (2 s^2) = (mu - mu_ref) / (s^2 * D), D = 2
    expected = torch.tensor([[[[0.5, 1.0]]], [[[-3 / 8, -1 / 8]]]], dtype=torch.float64)
    torch.testing.assert_close(mean.grad, expected)


def test_gaussian_kl_is_zero_with_finite_gradient_where_std_is_zero():
    mean = torch.tensor(MEAN, requires_grad=True)
    result = gaussian_kl(mean, torch.tensor(REF_MEAN), torch.tensor([0.0, 2.0]))
    torch.testing.assert_close(result, torch.tensor([0.0, 0.625]))
    result.sum().backward()
    torch.testing.assert_close(mean.grad, torch.tensor([[[[0.0, 0.0]]], [[[-3 / 8, -1 / 8]]]]))


def test_gaussian_kl_rejects_bad_std():
    mean, ref = torch.zeros(2, 1, 1, 2), torch.ones(2, 1, 1, 2)
    with pytest.raises(ValueError, match="std must be a number, a \\(B,\\)"):
        gaussian_kl(mean, ref, torch.ones(2, 2))
    with pytest.raises(ValueError, match="std must be >= 0"):
        gaussian_kl(mean, ref, torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="std must be >= 0"):
        gaussian_kl(mean, ref, torch.tensor([1.0, math.nan]))
    with pytest.raises(ValueError, match="ref_mean must have the shape of mean"):
        gaussian_kl(mean, torch.ones(2, 2), 1.0)


# vanilla: six tokens, old log-prob 0, clip 0.2, dual clip 3.0
VANILLA_RATIOS = [[1.1, 1.5, 0.5], [5.0, 0.7, 9.0]]
VANILLA_ADV = [[1.0, 1.0, -1.0], [-1.0, 2.0, 1.0]]
VANILLA_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def vanilla_inputs(dtype=torch.float32):
    log_prob = torch.tensor(VANILLA_RATIOS, dtype=dtype).log().requires_grad_(True)
    return torch.zeros(2, 3, dtype=dtype), log_prob, torch.tensor(VANILLA_ADV, dtype=dtype), torch.tensor(VANILLA_MASK)


def test_vanilla_loss_and_metrics_by_hand():
    old, log_prob, advantages, mask = vanilla_inputs()
    loss, metrics = get_policy_loss("vanilla")(old, log_prob, advantages, mask, clip_config())
    # per-token losses: -1.1 (inside), -1.2 (clipped high), 0.8 (clipped low), 3.0 (dual clip), -1.4 (inside)
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 + 3.0 - 1.4) / 5, rel=1e-5)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["clipfrac_lower"].item() == pytest.approx(1 / 5)
    expected_kl = -sum(math.log(r) for r in [1.1, 1.5, 0.5, 5.0, 0.7]) / 5
    assert metrics["approx_kl"].item() == pytest.approx(expected_kl, rel=1e-5)
    assert all(m.shape == () and not m.requires_grad for m in metrics.values())


def test_vanilla_gradient_flows_only_through_unclipped_tokens():
    old, log_prob, advantages, mask = vanilla_inputs(torch.float64)
    loss, _ = get_policy_loss("vanilla")(old, log_prob, advantages, mask, clip_config())
    loss.backward()
    # d(-A * ratio)/dlogp = -A * ratio, divided by the 5 valid tokens (token-mean)
    expected = torch.tensor([[-1.1 / 5, 0.0, 0.0], [0.0, -2 * 0.7 / 5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(log_prob.grad, expected)


def test_vanilla_asymmetric_clip_and_fallback_to_clip_ratio():
    old = torch.zeros(1, 2)
    log_prob = torch.tensor([[1.25, 0.85]]).log()
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    loss, metrics = get_policy_loss("vanilla")(
        old, log_prob, advantages, mask, clip_config(clip_ratio_low=0.1, clip_ratio_high=0.3)
    )
    # 1.25 < 1 + 0.3 is inside: -1.25; 0.85 < 1 - 0.1 is clipped: max(0.85, 0.9) = 0.9
    assert loss.item() == pytest.approx((-1.25 + 0.9) / 2, rel=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    symmetric, _ = get_policy_loss("vanilla")(old, log_prob, advantages, mask, clip_config(clip_ratio=0.2))
    # with clip_ratio 0.2 on both sides: -min(1.25, 1.2) -> -1.2 and 0.85 inside -> 0.85
    assert symmetric.item() == pytest.approx((-1.2 + 0.85) / 2, rel=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_vanilla_matches_python_loop_for_every_aggregation(mode):
    generator = torch.Generator().manual_seed(0)
    old = 0.3 * torch.randn(4, 5, generator=generator, dtype=torch.float64)
    new = old + 0.4 * torch.randn(4, 5, generator=generator, dtype=torch.float64)
    advantages = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    mask = (torch.rand(4, 5, generator=generator) > 0.3).double()
    mask[:, 0] = 1.0
    config = clip_config(clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=2.0, mode=mode)
    loss, _ = get_policy_loss("vanilla")(old, new, advantages, mask, config)
    token_losses = [
        [reference_vanilla_token(o, n, a, 0.15, 0.28, 2.0) for o, n, a in zip(orow, nrow, arow)]
        for orow, nrow, arow in zip(old.tolist(), new.tolist(), advantages.tolist())
    ]
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(reference_agg(token_losses, mask.tolist(), mode), rel=1e-12)


def test_gspo_value_and_stop_gradient_structure():
    old = torch.zeros(2, 3, dtype=torch.float64)
    log_prob = torch.tensor([[0.1, -0.05, 0.04], [0.5, 0.3, 7.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    config = clip_config(mode="token-mean")  # ignored: GSPO aggregates seq-mean-token-mean
    loss, metrics = get_policy_loss("gspo")(old, log_prob, advantages, mask, config)
    s0 = math.exp((0.1 - 0.05 + 0.04) / 3)  # inside [0.8, 1.2]
    s1 = math.exp((0.5 + 0.3) / 2)  # 1.49 > 1.2, but A < 0 so max picks the unclipped -A * s1
    assert loss.item() == pytest.approx((-s0 + s1) / 2, rel=1e-12)
    assert metrics["clipfrac"].item() == 0.0
    assert metrics["clipfrac_lower"].item() == 0.0
    assert metrics["approx_kl"].item() == pytest.approx(-(0.1 - 0.05 + 0.04 + 0.5 + 0.3) / 5, rel=1e-12)
    loss.backward()
    # token ratio sg[s_i] * pi / sg[pi]: d/dlogp_{i,t} = -A_{i,t} * s_i / (B * n_i), per token
    expected = torch.tensor([[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(log_prob.grad, expected)


def test_gspo_clipped_sequence_gets_no_gradient():
    log_prob = torch.tensor([[0.5, 0.3]], dtype=torch.float64, requires_grad=True)
    loss, metrics = get_policy_loss("gspo")(
        torch.zeros(1, 2, dtype=torch.float64), log_prob, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2),
        clip_config(),
    )
    assert loss.item() == pytest.approx(-1.2)  # s = e^0.4 = 1.49 clipped to 1.2 for A > 0
    assert metrics["clipfrac"].item() == 1.0
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.zeros(1, 2, dtype=torch.float64))


def test_gspo_log_ratio_is_clamped_at_ten():
    log_prob = torch.tensor([[12.0, 12.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = get_policy_loss("gspo")(
        torch.zeros(1, 2, dtype=torch.float64), log_prob, -torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2),
        clip_config(),
    )
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-12)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.zeros(1, 2, dtype=torch.float64))


def test_geo_mean_value_metrics_and_gradient_by_hand():
    old = torch.zeros(2, 3, dtype=torch.float64)
    log_prob = torch.tensor([[0.1, 0.5, 5.0], [-0.5, 0.1, 5.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, metrics = get_policy_loss("geo_mean")(old, log_prob, advantages, mask, clip_config())
    # row 0 (A > 0): log ratios 0.1, 0.5 -> 0.1, 0.2 (clipped high); r0 = exp((0.1 + 0.2) / 2)
    # row 1 (A < 0): log ratios -0.5, 0.1 -> -0.2 (clipped low), 0.1; r1 = exp((-0.2 + 0.1) / 2)
    # the masked third step (log ratio 5) counts nowhere
    r0, r1 = math.exp(0.15), math.exp(-0.05)
    assert loss.item() == pytest.approx((-1.0 * r0 + 1.0 * r1) / 2, rel=1e-12)
    assert metrics["clipfrac"].item() == pytest.approx(1 / 4)
    assert metrics["clipfrac_lower"].item() == pytest.approx(1 / 4)
    loss.backward()
    # d/dlogp of -A_i r_i / B through an unclipped token: -A_i r_i / (B n_i)
    expected = torch.tensor([[-r0 / 4, 0.0, 0.0], [0.0, r1 / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(log_prob.grad, expected)


def test_policy_loss_config_may_be_a_mapping():
    old, log_prob, advantages, mask = vanilla_inputs()
    from_mapping, _ = get_policy_loss("vanilla")(old, log_prob, advantages, mask, dict(vars(clip_config())))
    from_object, _ = get_policy_loss("vanilla")(old, log_prob, advantages, mask, clip_config())
    assert from_mapping.item() == from_object.item()


@pytest.mark.parametrize(
    "config, match",
    [
        (None, "needs a config"),
        (clip_config(clip_ratio=None), "clip_ratio_low is None and config.clip_ratio is None"),
        (clip_config(clip_ratio_c=1.0), "clip_ratio_c .* must be > 1"),
        (clip_config(mode="mean"), "loss_agg_mode must be one of"),
    ],
)
def test_policy_loss_rejects_bad_config(config, match):
    old, log_prob, advantages, mask = vanilla_inputs()
    with pytest.raises(ValueError, match=match):
        get_policy_loss("vanilla")(old, log_prob, advantages, mask, config)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "geo_mean"])
def test_policy_losses_reject_mismatched_shapes(name):
    with pytest.raises(ValueError, match="advantages must have the shape of log_prob"):
        get_policy_loss(name)(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 1), torch.ones(2, 3), clip_config())
    with pytest.raises(ValueError, match="mask must have the shape of log_prob"):
        get_policy_loss(name)(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2), clip_config())


def test_policy_loss_registry():
    assert {"vanilla", "gspo", "geo_mean"} <= set(registered_policy_losses())
    with pytest.raises(ValueError, match="registered policy losses: .*'geo_mean'.*'gspo'.*'vanilla'"):
        get_policy_loss("ppo2")

    @register_policy_loss("test_zero")
    def zero_loss(old_log_prob, log_prob, advantages, mask, config):
        return (log_prob * 0).sum(), {}

    try:
        assert get_policy_loss("test_zero") is zero_loss
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_zero")(lambda *args: None)
    finally:
        POLICY_LOSS_REGISTRY.pop("test_zero", None)


VPREDS = [[1.0, 2.0], [0.5, 3.0]]
VALUES = [[0.8, 2.0], [0.5, 1.0]]
RETURNS = [[1.5, 1.0], [0.0, 0.0]]
VMASK = [[1.0, 1.0], [1.0, 0.0]]


def test_value_loss_clipped_by_hand():
    vpreds = torch.tensor(VPREDS, requires_grad=True)
    loss, clipfrac = compute_value_loss(vpreds, torch.tensor(RETURNS), torch.tensor(VALUES), torch.tensor(VMASK), 0.1)
    # (0, 0): V_clip = 0.9, max(0.25, 0.36) = 0.36 (clipped); (0, 1): 1.0; (1, 0): 0.25; (1, 1) masked
    assert loss.item() == pytest.approx(0.5 * (0.36 + 1.0 + 0.25) / 3, rel=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3)
    loss.backward()
    # clipped element: no gradient; others: 0.5 * 2 (V - R) / 3
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 1.0 / 3], [0.5 / 3, 0.0]]))


def test_value_loss_without_clipping_and_with_another_aggregation():
    vpreds, returns, values, mask = (torch.tensor(x) for x in (VPREDS, RETURNS, VALUES, VMASK))
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, None)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 1.0 + 0.25) / 3)
    assert clipfrac.item() == 0.0
    loss, _ = compute_value_loss(vpreds, returns, values, mask, 0.1, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(0.5 * ((0.36 + 1.0) + 0.25) / 2, rel=1e-6)


def test_value_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="returns must have the shape of vpreds"):
        compute_value_loss(torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 3), torch.ones(2, 3), 0.2)
