"""The policy losses that read each step's drift from pi_old's Gaussian step: dppo (Flow-DPPO, arXiv 2606.11025) and
grpo_guard (GRPO-Guard, arXiv 2510.22319). Expected numbers come from the papers' formulas written out here in plain
Python on fixed tensors, never from the code's output."""

import math
import os

import pytest
import torch

from ddpo_group.algos.drift_losses import (
    StepDrift,
    compute_policy_loss_dppo,
    compute_policy_loss_grpo_guard,
    guard_log_ratio,
)
from ddpo_group.algos.losses import gaussian_kl, get_policy_loss
from ddpo_group.algos.stepwise import column_loss, grpo_loss
from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.diffusion.policy import policy_for
from ddpo_group.diffusion.tiny import build_tiny_pipeline
from ddpo_group.training.trainer import train
from helpers import cheap, make_config, read_metrics

# two trajectories, three steps; the last step of the second has no density (mask 0)
OLD = [[-1.0, -0.5, 0.2], [0.3, -0.2, 0.0]]
NEW = [[-0.9, -0.6, 0.2], [0.1, -0.1, 0.4]]
ADV = [[1.0, 1.0, -2.0], [-1.5, 0.5, 0.7]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
KL = [[2e-5, 5e-6, 3e-5], [4e-5, 1e-6, 9.0]]
STD = [[0.5, 0.25, 0.1], [0.5, 0.25, 0.0]]
DT = [[0.2, 0.3, 0.5], [0.2, 0.3, 0.0]]


class Config:
    clip_ratio = 0.2
    clip_ratio_low = None
    clip_ratio_high = None
    loss_agg_mode = "token-mean"
    dppo_kl_max = 1e-5
    guard_reweight = "dt"


def tensors(dtype=torch.float64):
    new = torch.tensor(NEW, dtype=dtype, requires_grad=True)
    drift = StepDrift(torch.tensor(KL, dtype=dtype), torch.tensor(STD, dtype=dtype), torch.tensor(DT, dtype=dtype))
    return torch.tensor(OLD, dtype=dtype), new, torch.tensor(ADV, dtype=dtype), torch.tensor(MASK, dtype=dtype), drift


def cells():
    return [(i, t) for i in range(2) for t in range(3) if MASK[i][t] > 0]


# ---- dppo ----


def dppo_expected(kl_max=1e-5):
    """Flow-DPPO by hand: L = (1 - M) (-A r), M = [D > delta] and ((A > 0 and r > 1) or (A < 0 and r < 1));
    token-mean; d L / d log_prob = (1 - M) (-A r) / N."""
    n = len(cells())
    loss, grad = 0.0, [[0.0] * 3 for _ in range(2)]
    for i, t in cells():
        r = math.exp(NEW[i][t] - OLD[i][t])
        a = ADV[i][t]
        away = (a > 0 and r > 1) or (a < 0 and r < 1)
        masked = KL[i][t] > kl_max and away
        if not masked:
            loss += -a * r / n
            grad[i][t] = -a * r / n
    return loss, grad


def test_dppo_matches_the_papers_mask_on_fixed_tensors():
    old, new, adv, mask, drift = tensors()
    loss, metrics = compute_policy_loss_dppo(old, new, adv, mask, Config(), drift)
    loss.backward()
    expected, grad = dppo_expected()
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    assert torch.allclose(new.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=0)
    # masked by hand: (0, 0) D 2e-5 > 1e-5, A > 0, r = e^0.1 > 1; (1, 0) D 4e-5, A < 0, r = e^-0.2 < 1.
    # kept: (0, 2) D 3e-5 but r = 1 (not moving away); (0, 1), (1, 1) inside the region
    assert float(metrics["clipfrac"]) == pytest.approx(2 / 5)
    assert float(metrics["clipfrac_lower"]) == pytest.approx(1 / 5)
    assert float(metrics["dppo/outside"]) == pytest.approx(3 / 5)
    assert float(metrics["dppo/kl_old"]) == pytest.approx((2e-5 + 5e-6 + 3e-5 + 4e-5 + 1e-6) / 5)


def test_dppo_keeps_a_corrective_step_outside_the_region():
    # outside the region (D 1) but moving back (A > 0 and r < 1; A < 0 and r > 1): the gradient stays -A r / N
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[-0.3, 0.4]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    drift = StepDrift(torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
                      torch.ones(1, 2, dtype=torch.float64))
    loss, metrics = compute_policy_loss_dppo(old, new, adv, torch.ones(1, 2), Config(), drift)
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-math.exp(-0.3) / 2, math.exp(0.4) / 2])
    assert float(metrics["clipfrac"]) == 0.0


def test_dppo_at_equal_weights_never_masks_and_is_the_unclipped_policy_gradient():
    # ratio 1 and KL 0 (the on-policy first micro-batch): grad = -A * mask / sum(mask), the REINFORCE gradient,
    # whatever the threshold (even the smallest)
    old, _, adv, mask, _ = tensors()
    new = old.clone().requires_grad_(True)
    zero = torch.zeros_like(old)
    config = Config()
    config.dppo_kl_max = 1e-30
    loss, metrics = compute_policy_loss_dppo(old, new, adv, mask, config, StepDrift(zero, zero + 0.3, zero + 0.1))
    loss.backward()
    assert float(metrics["clipfrac"]) == 0.0 and float(metrics["dppo/outside"]) == 0.0
    assert torch.allclose(new.grad, -adv * mask / mask.sum(), rtol=1e-12, atol=0)
    assert float(loss.detach()) == pytest.approx(-float((adv * mask).sum() / mask.sum()), rel=1e-12)


def test_dppo_needs_a_drift_and_a_positive_threshold():
    old, new, adv, mask, drift = tensors()
    with pytest.raises(ValueError, match="drift=StepDrift"):
        compute_policy_loss_dppo(old, new, adv, mask, Config())
    config = Config()
    config.dppo_kl_max = 0.0
    with pytest.raises(ValueError, match="dppo_kl_max"):
        compute_policy_loss_dppo(old, new, adv, mask, config, drift)


@pytest.mark.parametrize("fn", [compute_policy_loss_dppo, compute_policy_loss_grpo_guard])
def test_a_drift_of_another_shape_is_an_error_naming_it(fn):
    old, new, adv, mask, drift = tensors()
    bad = StepDrift(drift.kl[:, :2], drift.std, drift.dt)
    with pytest.raises(ValueError, match="drift.kl must have the shape of log_prob"):
        fn(old, new, adv, mask, Config(), bad)


# ---- grpo_guard ----


def guard_expected(reweight=True, clip=0.2):
    """GRPO-Guard by hand: z = (log_prob - old + D) s, r = e^z, L = max(-A r, -A clip(r, 1 - eps, 1 + eps)) / dt,
    token-mean; d L / d log_prob = s (d L / d r) r / dt with d L / d r = -A unless the clip is active."""
    n = len(cells())
    loss, grad = 0.0, [[0.0] * 3 for _ in range(2)]
    for i, t in cells():
        s, a = STD[i][t], ADV[i][t]
        r = math.exp((NEW[i][t] - OLD[i][t] + KL[i][t]) * s)
        clipped_r = min(max(r, 1 - clip), 1 + clip)
        w = 1 / DT[i][t] if reweight else 1.0
        loss += w * max(-a * r, -a * clipped_r) / n
        active = -a * clipped_r > -a * r
        grad[i][t] = 0.0 if active else w * -a * r * s / n
    return loss, grad


@pytest.mark.parametrize("reweight", ["dt", "none"])
def test_grpo_guard_matches_the_papers_formula_on_fixed_tensors(reweight):
    old, new, adv, mask, drift = tensors()
    config = Config()
    config.guard_reweight = reweight
    loss, _ = compute_policy_loss_grpo_guard(old, new, adv, mask, config, drift)
    loss.backward()
    expected, grad = guard_expected(reweight == "dt")
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    assert torch.allclose(new.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=0)


def test_grpo_guard_clips_where_the_normalised_ratio_leaves_the_range():
    # z = (0.9 + 0) * 0.5 = 0.45: r = 1.568 > 1.2 with A > 0, clipped (no gradient); with A < 0 it is not
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.full((1, 2), 0.9, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    half = torch.full((1, 2), 0.5, dtype=torch.float64)
    drift = StepDrift(torch.zeros(1, 2, dtype=torch.float64), half, torch.ones(1, 2, dtype=torch.float64))
    loss, metrics = compute_policy_loss_grpo_guard(old, new, adv, torch.ones(1, 2), Config(), drift)
    loss.backward()
    r = math.exp(0.45)
    assert float(loss.detach()) == pytest.approx((-1.2 + r) / 2)
    assert new.grad[0].tolist() == pytest.approx([0.0, r * 0.5 / 2])
    assert float(metrics["clipfrac"]) == 0.5 and float(metrics["clipfrac_lower"]) == 0.0


def test_grpo_guard_with_uniform_step_stats_is_ppos_clipped_surrogate():
    # s = 1, D = 0, dt = 1 at every step: the reference form max(-A r, -A clip(r, 1 - eps, 1 + eps)), i.e. vanilla
    # PPO without its dual clip (a dual-clip bound too large to act)
    old, new, adv, mask, _ = tensors()
    ones = torch.ones_like(old)
    loss, _ = compute_policy_loss_grpo_guard(old, new, adv, mask, Config(), StepDrift(ones * 0, ones, ones))
    expected = 0.0
    for i, t in cells():
        r = math.exp(NEW[i][t] - OLD[i][t])
        expected += max(-ADV[i][t] * r, -ADV[i][t] * min(max(r, 0.8), 1.2)) / len(cells())
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    config = Config()
    config.clip_ratio_c = 1e9
    vanilla, _ = get_policy_loss("vanilla")(old, new, adv, mask, config)
    assert float(loss.detach()) == pytest.approx(float(vanilla.detach()), rel=1e-12)


def test_guard_log_ratio_of_gaussian_steps_is_the_noise_times_the_mean_shift():
    # x = mu_old + s eps; log pi = mean_dims log N(x; mu, s^2): (log pi - log pi_old + D) s = mean_dims(eps (mu - mu_old))
    # (the left shift -D removed, the 1/s spread undone)
    g = torch.Generator().manual_seed(0)
    mu_old = torch.randn(3, 4, 5, 5, generator=g, dtype=torch.float64)
    mu = mu_old + 0.05 * torch.randn(3, 4, 5, 5, generator=g, dtype=torch.float64)
    eps = torch.randn(3, 4, 5, 5, generator=g, dtype=torch.float64)
    s = torch.tensor([0.7, 0.2, 0.05], dtype=torch.float64).reshape(3, 1, 1, 1)
    x = mu_old + s * eps

    def log_prob(mean):
        return (-((x - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))

    kl = ((mu - mu_old) ** 2 / (2 * s**2)).mean(dim=(1, 2, 3))
    assert torch.allclose(gaussian_kl(mu, mu_old, s), kl, rtol=1e-12)
    drift = StepDrift(kl[:, None], s.reshape(3, 1), torch.ones(3, 1, dtype=torch.float64))
    normalised = guard_log_ratio((log_prob(mu) - log_prob(mu_old))[:, None], drift)
    assert torch.allclose(normalised[:, 0], (eps * (mu - mu_old)).mean(dim=(1, 2, 3)), rtol=1e-9, atol=1e-15)


def test_column_losses_sum_to_the_whole_losss_gradient():
    # the trainer back-propagates one step column at a time (algos/stepwise.py): for the drift losses too, the
    # column gradients (other columns detached, their drift 0) add up to the gradient of the whole (b, K) loss
    for name in ("dppo", "grpo_guard"):
        fn = get_policy_loss(name)
        old, new, adv, mask, drift = tensors()
        kl = drift.kl.clone().requires_grad_(True)
        whole = grpo_loss(fn, Config(), old, new, adv, mask, drift=StepDrift(kl, drift.std, drift.dt))[0]
        whole.backward()
        new_grads, kl_grads = torch.zeros_like(old), torch.zeros_like(old)
        for k in range(3):
            log_prob = new.detach()[:, k].clone().requires_grad_(True)
            kl_k = drift.kl[:, k].clone().requires_grad_(True)
            column = column_loss(fn, Config(), old, new.detach(), k, log_prob, adv, mask,
                                 drift=StepDrift(kl_k, drift.std[:, k], drift.dt[:, k]))
            column.backward()
            new_grads[:, k] = log_prob.grad
            kl_grads[:, k] = torch.zeros(2, dtype=old.dtype) if kl_k.grad is None else kl_k.grad
        assert torch.allclose(new_grads, new.grad, rtol=1e-12, atol=1e-15), name
        assert torch.allclose(kl_grads, torch.zeros_like(old) if kl.grad is None else kl.grad, rtol=1e-12, atol=1e-15), name


# ---- step lengths, config checks ----


def test_ddim_step_dt_is_the_flow_time_of_its_noise_levels():
    pipeline = build_tiny_pipeline(seed=0)
    policy = policy_for(pipeline)
    scheduler = pipeline.scheduler
    scheduler.set_timesteps(4)
    timesteps = scheduler.timesteps.clone()
    batch = type("Batch", (), {"timesteps": timesteps.expand(2, 4).clone()})()
    a = scheduler.alphas_cumprod.double()
    stride = scheduler.config.num_train_timesteps // 4
    for k in range(4):
        dt = policy.step_dt(batch, torch.arange(2), torch.full((2,), k))
        t = int(timesteps[k])
        a_t = float(a[t])
        a_prev = float(a[t - stride]) if t - stride >= 0 else float(scheduler.final_alpha_cumprod)
        sigma = lambda x: math.sqrt(1 - x) / (math.sqrt(x) + math.sqrt(1 - x))  # noqa: E731
        assert dt.tolist() == pytest.approx([sigma(a_t) - sigma(a_prev)] * 2, rel=1e-6)
        assert float(dt[0]) > 0


@pytest.mark.parametrize("overrides,field", [
    (dict(train__policy_loss="dppo", train__dppo_kl_max=0.0), "train.dppo_kl_max"),
    (dict(train__policy_loss="grpo_guard", train__guard_reweight="sigma"), "train.guard_reweight"),
    (dict(train__policy_loss="dppo", train__old_log_probs="sampled"), "train.old_log_probs"),
    (dict(train__policy_loss="grpo_guard", train__old_log_probs="sampled"), "train.old_log_probs"),
])
def test_bad_drift_loss_settings_are_one_line_errors_naming_the_field(tmp_path, overrides, field):
    config = make_config(tmp_path, **overrides)
    with pytest.raises(ConfigError) as err:
        check_config(config)
    assert field in str(err.value) and "\n" not in str(err.value)


# ---- training ----


@pytest.mark.parametrize("variant,loss", [("test", "dppo"), ("test", "grpo_guard"), ("tiny_sd3_dppo", "dppo"),
                                          ("tiny_sd3_grpo_guard", "grpo_guard")])
def test_a_drift_loss_trains_a_ddim_and_a_flow_family(tmp_path, variant, loss):
    # two micro-batches, one optimizer step each: the second is off-policy, where the drift is not 0
    run_dir = train(make_config(tmp_path, variant=variant, **cheap(train__policy_loss=loss, log_images_every=0)))
    row = read_metrics(run_dir)[-1]
    assert math.isfinite(row["loss"]) and row["train/skipped_steps"] == 0
    assert row["train/on_policy_max_abs_log_ratio"] == 0.0
    # the per-step view: the log-ratio before and after GRPO-Guard's normalisation, the exact KL to pi_old's step
    trained = [k for k, on in enumerate(row["steps/trained"]) if on]
    for key in ("steps/log_ratio_mean", "steps/log_ratio_std", "steps/norm_log_ratio_mean", "steps/norm_log_ratio_std",
                "steps/kl_old"):
        assert all(row[key][k] is not None and math.isfinite(row[key][k]) for k in trained), key
    assert max(row["steps/kl_old"][k] for k in trained) > 0  # the off-policy micro-batch drifted
    assert os.path.isdir(run_dir)


@pytest.mark.parametrize("sde_type", ["cps", "dance"])
@pytest.mark.parametrize("loss", ["dppo", "grpo_guard"])
def test_a_drift_loss_trains_every_flow_sde_type(tmp_path, sde_type, loss):
    # the Gaussian step's mean and std come from the SDE type's step ("sde" is tiny_sd3's own, trained above)
    config = make_config(tmp_path, variant="tiny_sd3", **cheap(train__policy_loss=loss, sample__sde_type=sde_type,
                                                               log_images_every=0))
    row = read_metrics(train(config))[-1]
    trained = [k for k, on in enumerate(row["steps/trained"]) if on]
    assert math.isfinite(row["loss"]) and row["train/skipped_steps"] == 0
    assert trained and all(math.isfinite(row["steps/kl_old"][k]) for k in trained)
    assert max(row["steps/kl_old"][k] for k in trained) > 0


def test_grpo_guard_trains_wan_moe_whose_contract_is_elsewhere(tmp_path):
    # wan_moe (two experts, its own step function; tests/test_wan22_moe.py holds its contract): mean, std and dt
    config = make_config(tmp_path, variant="tiny_wan22_moe", **cheap(train__policy_loss="grpo_guard", use_lora=True,
                                                                     lora_rank=2, log_images_every=0))
    row = read_metrics(train(config))[-1]
    trained = [k for k, on in enumerate(row["steps/trained"]) if on]
    assert math.isfinite(row["loss"]) and row["train/skipped_steps"] == 0
    assert trained and all(math.isfinite(row["steps/norm_log_ratio_std"][k]) for k in trained)


@pytest.mark.parametrize("variant", ["tiny_dppo", "tiny_grpo_guard"])
def test_the_main_job_variants_train_an_epoch(tmp_path, variant):
    # the shipped shapes-world model with the variant's method, at test size (4 trajectories, 2 steps, 2 updates)
    config = make_config(tmp_path, variant=variant, **cheap(
        sample__batch_size=4, sample__num_batches_per_epoch=1, sample__group_size=2, train__batch_size=2,
        eval_freq=0, log_images_every=0))
    row = read_metrics(train(config))[-1]
    assert config.train.policy_loss == variant.removeprefix("tiny_")
    assert math.isfinite(row["loss"]) and row["train/skipped_steps"] == 0 and row["train/global_step"] == 2
