"""sde_step_with_logprob (docs/flow.md): the three SDE types against the formulas written out in
plain Python, the noise-0 step against diffusers' FlowMatchEulerDiscreteScheduler.step, bad input."""

import math

import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

from ddpo_group.diffusion.flow import sde_step_with_logprob


def scheduler(steps=10):
    s = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    s.set_timesteps(steps)
    return s


def by_hand(kind, x, v, sigma, sigma_next, sigma_1, a):
    """(mean, std) of one element, plain Python floats."""
    dt = sigma_next - sigma
    if kind == "cps":
        std = sigma_next * math.sin(a * math.pi / 2)
        x0 = x - sigma * v
        eps = x + (1 - sigma) * v
        return (1 - sigma_next) * x0 + math.sqrt(max(sigma_next**2 - std**2, 0.0)) * eps, std
    if kind == "sde":
        g = a * math.sqrt(sigma / (1 - (sigma_1 if sigma == 1 else sigma)))
    else:
        g = a
    drift = v + g * g * (x + (1 - sigma) * v) / (2 * sigma)  # v + g^2 eps_hat / (2 sigma)
    return x + drift * dt, g * math.sqrt(-dt)


@pytest.mark.parametrize("kind,a", [("sde", 0.7), ("cps", 0.7), ("dance", 0.3)])
def test_mean_std_and_log_prob_match_the_formulas(kind, a):
    s = scheduler(10)
    sigmas = s.sigmas.double().tolist()
    generator = torch.Generator().manual_seed(0)
    for i, t in enumerate(s.timesteps.tolist()):
        x = torch.randn(2, 3, 2, 2, generator=generator, dtype=torch.float64)
        v = torch.randn(2, 3, 2, 2, generator=generator, dtype=torch.float64)
        prev, log_prob, mean, std = sde_step_with_logprob(s, v, t, x, noise_level=a, sde_type=kind,
                                                          generator=torch.Generator().manual_seed(i))
        means, stds = zip(*[by_hand(kind, xe, ve, sigmas[i], sigmas[i + 1], sigmas[1], a)
                            for xe, ve in zip(x.flatten().tolist(), v.flatten().tolist())])
        torch.testing.assert_close(mean.flatten(), torch.tensor(means, dtype=torch.float64), rtol=1e-10, atol=1e-12)
        assert float(std.flatten()[0]) == pytest.approx(stds[0], rel=1e-10, abs=1e-14)
        if stds[0] > 0:
            # log N(prev; mean, std^2) averaged over the 12 elements of each sample
            expected = [
                sum(-((p - m) ** 2) / (2 * stds[0] ** 2) - math.log(stds[0]) - 0.5 * math.log(2 * math.pi)
                    for p, m in zip(prev[b].flatten().tolist(), means[12 * b : 12 * b + 12])) / 12
                for b in range(2)
            ]
            assert log_prob.tolist() == pytest.approx(expected, rel=1e-9)
        else:  # cps at the last step (sigma' = 0): no density
            assert log_prob.tolist() == [0.0, 0.0]


def test_the_first_step_uses_sigmas_1_in_the_sde_denominator():
    s = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    s.set_timesteps(4)
    assert float(s.sigmas[0]) == 1.0
    x = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    _, _, _, std = sde_step_with_logprob(s, torch.zeros_like(x), s.timesteps[0], x, noise_level=0.5, sde_type="sde")
    sigma_1 = float(s.sigmas[1])
    expected = 0.5 * math.sqrt(1.0 / (1 - sigma_1)) * math.sqrt(1.0 - sigma_1)
    assert float(std) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_noise_level_zero_is_the_pipelines_euler_step(kind):
    s = scheduler(8)
    generator = torch.Generator().manual_seed(1)
    for t in s.timesteps:
        x = torch.randn(2, 4, 4, 4, generator=generator)
        v = torch.randn(2, 4, 4, 4, generator=generator)
        reference = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        reference.set_timesteps(8)
        reference._step_index = int((s.timesteps == t).nonzero())
        expected = reference.step(v, t, x, return_dict=False)[0]
        prev, log_prob, _, std = sde_step_with_logprob(s, v, t, x, noise_level=0.0, sde_type=kind)
        assert (prev - expected).abs().max() < 1e-6
        assert float(std.abs().max()) == 0.0 and log_prob.tolist() == [0.0, 0.0]


def test_per_sample_timesteps_and_scoring_a_given_sample():
    s = scheduler(6)
    x = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(2))
    v = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(3))
    t = s.timesteps[[0, 2, 5]]
    prev, log_prob, mean, std = sde_step_with_logprob(s, v, t, x, noise_level=0.7, generator=torch.Generator().manual_seed(4))
    for row, step in enumerate([0, 2, 5]):
        _, lp_row, mean_row, std_row = sde_step_with_logprob(s, v[row : row + 1], s.timesteps[step], x[row : row + 1],
                                                             noise_level=0.7, prev_sample=prev[row : row + 1])
        assert torch.equal(mean_row, mean[row : row + 1]) and torch.equal(std_row, std[row : row + 1])
        assert torch.equal(lp_row, log_prob[row : row + 1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_give_float32_step_math(dtype):
    s = scheduler(10)
    x = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(5))
    v = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(6))
    x16, v16 = x.to(dtype), v.to(dtype)
    prev, log_prob, mean, std = sde_step_with_logprob(s, v16, s.timesteps[3], x16, generator=torch.Generator().manual_seed(7))
    assert log_prob.dtype == mean.dtype == std.dtype == torch.float32
    _, lp64, _, _ = sde_step_with_logprob(s, v16.double(), s.timesteps[3], x16.double(), prev_sample=prev.double())
    assert (log_prob.double() - lp64).abs().max() < 1e-4


def test_bad_input_is_named():
    s = scheduler(4)
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match="sde_type"):
        sde_step_with_logprob(s, x, s.timesteps[0], x, sde_type="ode")
    with pytest.raises(ValueError, match="cps"):
        sde_step_with_logprob(s, x, s.timesteps[0], x, noise_level=1.5, sde_type="cps")
    with pytest.raises(ValueError, match="noise_level"):
        sde_step_with_logprob(s, x, s.timesteps[0], x, noise_level=-0.1)
    ddim = DDIMScheduler()
    ddim.set_timesteps(4)
    with pytest.raises(ValueError, match="flow-matching"):
        sde_step_with_logprob(ddim, x, ddim.timesteps[0], x)
    with pytest.raises(ValueError, match="grid"):
        sde_step_with_logprob(s, x, 123.456, x)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_given_sigmas_equal_the_lookup_on_the_scheduler_grid(kind):
    s = scheduler(6)
    x = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(5))
    v = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(6))
    steps = [0, 2, 5]
    grid = s.sigmas.float()
    prev, log_prob, mean, std = sde_step_with_logprob(s, v, s.timesteps[steps], x, noise_level=0.7, sde_type=kind,
                                                      generator=torch.Generator().manual_seed(7))
    given = (grid[steps], grid[[i + 1 for i in steps]], grid[1].expand(3))
    s.set_timesteps(3)  # the scheduler's grid no longer holds these steps: the given sigmas are all that is read
    _, lp, mean_given, std_given = sde_step_with_logprob(s, v, torch.zeros(3), x, noise_level=0.7, sde_type=kind,
                                                         prev_sample=prev, sigmas=given)
    assert torch.equal(lp, log_prob) and torch.equal(mean_given, mean) and torch.equal(std_given, std)
    with pytest.raises(ValueError, match="sigmas must be three"):
        sde_step_with_logprob(s, v, torch.zeros(3), x, sigmas=(grid[:2], grid[1:3], grid[:2]))
    with pytest.raises(ValueError, match="sigma_next <= sigma"):
        sde_step_with_logprob(s, v, torch.zeros(3), x, sigmas=given[1:2] + given[0:1] + given[2:])


def test_a_sigma_grid_is_checked_whole():
    from ddpo_group.diffusion.flow import check_sigma_grid

    check_sigma_grid(torch.tensor([[1.0, 0.5, 0.5, 0.0], [0.9, 0.3, 0.1, 0.0]]))  # flat steps and a final 0 are fine
    for bad in ([[1.0, 0.5, 0.6, 0.0]], [[1.0, 0.0, 0.0, 0.0]], [[0.0, 0.0]]):
        with pytest.raises(ValueError, match="sigma > 0 to sigma_next <= sigma"):
            check_sigma_grid(torch.tensor(bad))
