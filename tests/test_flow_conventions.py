"""The flow steps' conventions against the peers' formulas, written out here from their equations (docs/flow.md):
FlowCPS / Flow-GRPO's cps log-prob, ratio and KL (sample.cps_log_prob="flow_grpo", train.kl_type="flow_grpo"),
DanceGRPO's shifted linspace grid and step (sample.flow_grid="dance"), and the options' one-line errors."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.diffusion.flow import dance_sigmas, sde_step_with_logprob
from ddpo_group.diffusion.policy import policy_for
from ddpo_group.diffusion.tiny import build_tiny_pipeline, build_tiny_sd3_pipeline
from ddpo_group.training.trainer import train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a red circle", "a big blue square"]


# ---- the peers' formulas, independently: float64, plain tensor arithmetic ----

def flowcps_mean_std(x, v, sigma, sigma_next, a):
    """FlowCPS (its sd3_sde_with_logprob, sde_type "cps"): std sigma' sin(a pi / 2); the mean recombines the
    predicted clean sample x - sigma v and the predicted noise x + (1 - sigma) v."""
    std = sigma_next * math.sin(a * math.pi / 2)
    clean, noise = x - sigma * v, x + (1 - sigma) * v
    return clean * (1 - sigma_next) + noise * math.sqrt(sigma_next**2 - std**2), std


def flowcps_log_prob(prev, mean):
    """FlowCPS's log-prob with every constant removed: minus the squared error, averaged over a sample's dims."""
    return -((prev - mean) ** 2).flatten(1).mean(1)


def dancegrpo_grid(num_steps, shift):
    """DanceGRPO (fastvideo/train_grpo_flux.py): linspace(1, 0, T + 1), then its sd3_time_shift s t / (1 + (s - 1) t)."""
    return [shift * t / (1 + (shift - 1) * t) for t in (1 - i / num_steps for i in range(num_steps + 1))]


def dancegrpo_mean_std(x, v, sigma, sigma_next, eta):
    """DanceGRPO's flux_step: the Euler step plus -eta^2 / 2 times its score estimate
    -(x - (1 - sigma) x0_hat) / sigma^2, both over d sigma; std eta sqrt(sigma - sigma')."""
    d_sigma = sigma_next - sigma
    x0_hat = x - sigma * v
    score = -(x - x0_hat * (1 - sigma)) / sigma**2
    return x + d_sigma * v + (-0.5 * eta**2 * score) * d_sigma, eta * math.sqrt(sigma - sigma_next)


def gaussian_log_prob_by_hand(prev, mean, std):
    return (-((prev - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)


# ---- CPS: Flow-GRPO's form ----

@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_cps_flow_grpo_form_gives_flowcps_log_prob_and_ratio(dtype, tolerance):
    s = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    s.set_timesteps(10)
    sigmas = s.sigmas.double().tolist()
    generator = torch.Generator().manual_seed(0)
    a = 0.6
    for i, t in enumerate(s.timesteps.tolist()[:-1]):  # the last step has std 0: no density in either form
        x = torch.randn(3, 4, 4, 4, generator=generator, dtype=torch.float64)
        v_old = torch.randn(3, 4, 4, 4, generator=generator, dtype=torch.float64)
        v_new = v_old + 0.01 * torch.randn(3, 4, 4, 4, generator=generator, dtype=torch.float64)
        prev, lp_old, mean, std = sde_step_with_logprob(
            s, v_old.to(dtype), t, x.to(dtype), noise_level=a, sde_type="cps", cps_log_prob="flow_grpo",
            generator=torch.Generator().manual_seed(i))
        _, lp_new, _, _ = sde_step_with_logprob(s, v_new.to(dtype), t, x.to(dtype), noise_level=a, sde_type="cps",
                                                cps_log_prob="flow_grpo", prev_sample=prev)
        mean_old, std_hand = flowcps_mean_std(x, v_old, sigmas[i], sigmas[i + 1], a)
        mean_new, _ = flowcps_mean_std(x, v_new, sigmas[i], sigmas[i + 1], a)
        prev64 = prev.double()
        torch.testing.assert_close(mean.double(), mean_old, rtol=tolerance, atol=tolerance)
        assert float(std.flatten()[0]) == pytest.approx(std_hand, rel=tolerance)
        torch.testing.assert_close(lp_old.double(), flowcps_log_prob(prev64, mean_old), rtol=tolerance, atol=tolerance)
        ratio_peer = torch.exp(flowcps_log_prob(prev64, mean_new) - flowcps_log_prob(prev64, mean_old))
        torch.testing.assert_close(torch.exp(lp_new - lp_old).double(), ratio_peer, rtol=tolerance, atol=tolerance)
        # the normalised form: same sample and mean, log-ratio 1 / (2 std^2) times FlowCPS's
        _, n_old, _, _ = sde_step_with_logprob(s, v_old.to(dtype), t, x.to(dtype), noise_level=a, sde_type="cps",
                                               prev_sample=prev)
        _, n_new, _, _ = sde_step_with_logprob(s, v_new.to(dtype), t, x.to(dtype), noise_level=a, sde_type="cps",
                                               prev_sample=prev)
        torch.testing.assert_close(n_old.double(), gaussian_log_prob_by_hand(prev64, mean_old, std_hand),
                                   rtol=tolerance, atol=tolerance)
        peer_log_ratio = flowcps_log_prob(prev64, mean_new) - flowcps_log_prob(prev64, mean_old)
        torch.testing.assert_close((n_new - n_old).double() * 2 * std_hand**2, peer_log_ratio,
                                   rtol=1e-3 if dtype == torch.float32 else 1e-9, atol=1e-7)


def test_cps_flow_grpo_form_is_refused_for_the_other_steps():
    s = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    s.set_timesteps(4)
    x = torch.zeros(1, 1, 2, 2)
    for sde_type in ("sde", "dance"):
        with pytest.raises(ValueError, match="cps_log_prob"):
            sde_step_with_logprob(s, x, s.timesteps[0], x, sde_type=sde_type, cps_log_prob="flow_grpo")
    with pytest.raises(ValueError, match="cps_log_prob"):
        sde_step_with_logprob(s, x, s.timesteps[0], x, sde_type="cps", cps_log_prob="unnormalised")


def _velocity(policy, trajectories, k):
    rows = torch.arange(trajectories.latents.shape[0])
    with torch.no_grad():
        return policy.predict(policy.trainable_module, trajectories.latents[:, k], trajectories.timesteps[:, k],
                              trajectories, rows, 4.5).double()


def test_a_cps_trajectory_in_flow_grpos_form_scores_and_rescores_as_flowcps():
    pipeline = build_tiny_sd3_pipeline(seed=0)
    policy = policy_for(pipeline)
    policy.configure(sde_type="cps", cps_log_prob="flow_grpo")
    a = 0.5
    trajectories = policy.sample(PROMPTS, 4, 4.5, a, generator=torch.Generator().manual_seed(0))
    grid = trajectories.sigmas[0].double().tolist()
    other = build_tiny_sd3_pipeline(seed=1).transformer  # a changed policy: the ratio is not 1
    rows = torch.arange(2)
    for k in range(3):
        x, x_next = trajectories.latents[:, k].double(), trajectories.latents[:, k + 1].double()
        mean, _ = flowcps_mean_std(x, _velocity(policy, trajectories, k), grid[k], grid[k + 1], a)
        torch.testing.assert_close(trajectories.log_probs[:, k].double(), flowcps_log_prob(x_next, mean),
                                   rtol=1e-4, atol=1e-6)
        steps = torch.full((2,), k)
        rescored, _, _ = policy.step_log_prob(policy.trainable_module, trajectories, rows, steps, 4.5, a)
        assert torch.equal(rescored, trajectories.log_probs[:, k])  # the same convention when re-scoring
        with torch.no_grad():
            v_other = policy.predict(other, trajectories.latents[:, k], trajectories.timesteps[:, k], trajectories,
                                     rows, 4.5).double()
            new, _, _ = policy.step_log_prob(other, trajectories, rows, steps, 4.5, a)
        mean_other, _ = flowcps_mean_std(x, v_other, grid[k], grid[k + 1], a)
        peer_ratio = torch.exp(flowcps_log_prob(x_next, mean_other) - flowcps_log_prob(x_next, mean))
        assert not torch.allclose(peer_ratio, torch.ones_like(peer_ratio), atol=1e-6)
        torch.testing.assert_close(torch.exp(new - trajectories.log_probs[:, k]).double(), peer_ratio,
                                   rtol=1e-4, atol=1e-6)
    assert trajectories.log_probs[:, 3].eq(0).all() and trajectories.mask[:, 3].eq(0).all()  # sigma' = 0


def test_flowcps_kl_of_the_cps_step():
    # FlowCPS's train_sd3.py (commit 814c359): kl = mean over dims of (mu - mu_ref)^2, no divisor
    from ddpo_group.algos.losses import gaussian_kl

    policy = policy_for(build_tiny_sd3_pipeline(seed=0))
    policy.configure(sde_type="cps")
    trajectories = policy.sample(PROMPTS, 4, 4.5, 0.5, generator=torch.Generator().manual_seed(2))
    reference = build_tiny_sd3_pipeline(seed=1).transformer
    rows = torch.arange(2)
    for k in range(4):
        steps = torch.full((2,), k)
        with torch.no_grad():
            _, mean, std = policy.step_log_prob(policy.trainable_module, trajectories, rows, steps, 4.5, 0.5)
            _, ref_mean, _ = policy.step_log_prob(reference, trajectories, rows, steps, 4.5, 0.5)
        ours = gaussian_kl(mean, ref_mean, policy.flow_grpo_kl_std(trajectories, rows, steps, std))
        expected = ((mean.double() - ref_mean.double()) ** 2).flatten(1).mean(1) if k < 3 else torch.zeros(2).double()
        torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=0)


# ---- DanceGRPO's grid ----

@pytest.mark.parametrize("num_steps,shift", [(16, 3.0), (10, 1.0), (6, 5.0)])
def test_dance_grid_is_dancegrpos_shifted_linspace(num_steps, shift):
    expected = dancegrpo_grid(num_steps, shift)
    assert dance_sigmas(num_steps, shift).tolist() == pytest.approx(expected, rel=1e-15, abs=1e-15)


def test_a_dance_grid_trajectory_follows_dancegrpos_step_and_rescores_on_its_own_grid():
    pipeline = build_tiny_sd3_pipeline(seed=0)
    policy = policy_for(pipeline)
    policy.configure(sde_type="dance", flow_grid="dance", flow_grid_shift=3.0)
    eta = 0.3
    trajectories = policy.sample(PROMPTS, 4, 4.5, eta, generator=torch.Generator().manual_seed(0))
    grid = dancegrpo_grid(4, 3.0)
    torch.testing.assert_close(trajectories.sigmas, torch.tensor([grid, grid], dtype=torch.float32))
    torch.testing.assert_close(trajectories.timesteps, torch.tensor([grid[:-1]] * 2, dtype=torch.float32) * 1000)
    pipeline_grid = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipeline_grid.set_timesteps(4)
    assert not torch.allclose(pipeline_grid.sigmas.double(), torch.tensor(grid, dtype=torch.float64))  # it matters
    for k in range(4):
        x, x_next = trajectories.latents[:, k].double(), trajectories.latents[:, k + 1].double()
        mean, std = dancegrpo_mean_std(x, _velocity(policy, trajectories, k), grid[k], grid[k + 1], eta)
        torch.testing.assert_close(trajectories.log_probs[:, k].double(), gaussian_log_prob_by_hand(x_next, mean, std),
                                   rtol=1e-4, atol=1e-4)
    pipeline.scheduler.set_timesteps(7)  # another grid on the scheduler: re-scoring reads the trajectories' own
    rows = torch.arange(2)
    for k in range(4):
        rescored, _, _ = policy.step_log_prob(policy.trainable_module, trajectories, rows, torch.full((2,), k), 4.5, eta)
        assert torch.equal(rescored, trajectories.log_probs[:, k])


def test_a_run_with_flow_grpos_cps_form_on_dancegrpos_grid_is_on_policy(tmp_path):
    run_dir = train(make_config(tmp_path, variant="tiny_sd3", **cheap(
        sample__num_steps=3, sample__sde_type="cps", sample__eta=0.5, sample__cps_log_prob="flow_grpo",
        sample__flow_grid="dance", sample__flow_grid_shift=3.0, train__skip_last_steps=1)))
    row = read_metrics(run_dir)[0]
    assert row["train/on_policy_max_abs_log_ratio"] == 0.0 and row["train/skipped_steps"] == 0
    assert row["steps/trained"][-1] == 0 and math.isfinite(row["loss"])


# ---- the options' errors ----

@pytest.mark.parametrize(
    "variant,overrides,names",
    [
        ("tiny_sd3", dict(sample__cps_log_prob="flowgrpo"), ["sample.cps_log_prob", "'normalized'", "'flow_grpo'"]),
        ("tiny_sd3", dict(sample__cps_log_prob="flow_grpo"), ["sample.cps_log_prob", "sample.sde_type='cps'"]),
        ("tiny_sd3", dict(sample__flow_grid="linspace"), ["sample.flow_grid", "'pipeline'", "'dance'"]),
        ("tiny_sd3", dict(sample__flow_grid="dance", sample__flow_grid_shift=0.0), ["sample.flow_grid_shift"]),
        ("tiny_sd3", dict(train__kl_type="flowgrpo"), ["train.kl_type", "'gaussian'", "'flow_grpo'"]),
        ("test", dict(sample__flow_grid="dance"), ["sample.flow_grid", "DDIM"]),
        ("test", dict(sample__sde_type="cps", sample__cps_log_prob="flow_grpo"), ["sample.sde_type", "DDIM"]),
        ("test", dict(train__kl_type="flow_grpo"), ["train.kl_type", "DDIM"]),
    ],
)
def test_bad_flow_options_are_one_line_errors_naming_the_field(tmp_path, variant, overrides, names):
    with pytest.raises(ConfigError) as info:
        check_config(make_config(tmp_path, variant=variant, **overrides))
    message = str(info.value)
    assert "\n" not in message and all(name in message for name in names), message


def test_a_flow_option_on_an_sd_pipeline_is_named_when_its_family_is_known():
    # a hub id or directory: config_check cannot tell its family; the policy refuses when it is loaded
    policy = policy_for(build_tiny_pipeline())
    for options, field in ((dict(flow_grid="dance"), "sample.flow_grid"), (dict(cps_log_prob="flow_grpo"), "sample.cps_log_prob"),
                           (dict(sde_type="cps"), "sample.sde_type")):
        with pytest.raises(ValueError, match=field) as info:
            policy.configure(**options)
        assert "\n" not in str(info.value)
    flow = policy_for(build_tiny_sd3_pipeline(seed=0))
    with pytest.raises(ValueError, match="sample.flow_grid"):
        flow.configure(flow_grid="uniform")
    with pytest.raises(ValueError, match="sample.cps_log_prob"):
        flow.configure(sde_type="dance", cps_log_prob="flow_grpo")


def test_the_flow_presets_state_their_conventions():
    from ddpo_group.config import grpo

    for name in ("sd35", "flux"):
        sample = grpo.get_config(name).sample
        assert (sample.sde_type, sample.cps_log_prob, sample.flow_grid) == ("sde", "normalized", "pipeline")


def test_sampling_sets_its_own_grid_after_another_call_set_one_of_the_same_length():
    """The scheduler is the pipeline's: a pipeline() call or an evaluation may leave a grid of the same number of steps
    but another shift on it. The next sampling must run on the policy's own grid, not that one."""
    from ddpo_group.diffusion.tiny import build_tiny_flux_pipeline

    pipeline = build_tiny_flux_pipeline(seed=0)
    policy = policy_for(pipeline)
    first = policy.sample(PROMPTS, 4, 1.0, 0.5, generator=torch.Generator().manual_seed(0))
    other = torch.linspace(1.0, 0.25, 4).numpy()
    pipeline.scheduler.set_timesteps(sigmas=other, mu=2.0)  # 4 steps, another grid (mu 2: a larger shift)
    assert not torch.allclose(pipeline.scheduler.sigmas.float(), first.sigmas[0])  # the trap is set
    again = policy.sample(PROMPTS, 4, 1.0, 0.5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.sigmas, first.sigmas)
    assert torch.equal(again.latents, first.latents)
