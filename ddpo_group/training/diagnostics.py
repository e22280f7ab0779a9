"""Per-step diagnostics: where in the trajectory the training signal is (docs/diagnostics.md).

Every epoch the trainer writes, beside its flat metrics, one list of length T per quantity
(``steps/<quantity>``, one value per denoising step t = 0 (noisiest) ... T-1, ``None`` where the
step had nothing to measure: no density, not trained, no critic):

    steps/adv_mean, steps/adv_std     mean and population std over trajectories of the advantage A[i, t]
                                      that the actor's loss used (valid steps of the gathered batch)
    steps/trained                     1 where the actor trained step t this epoch, 0 where it did not
    steps/approx_kl                   mean over trained (trajectory, step) pairs of old - new log-prob
                                      (the k1 estimate of KL(pi_old || pi_theta), as the flat approx_kl)
    steps/kl                          with a reference model: mean over trained (trajectory, step) pairs of the
                                      per-step KL to the reference that the flat `kl` averages (train.kl_type:
                                      "gaussian", mean over pixels of (mu - mu_ref)^2 / (2 sigma_t^2))
    steps/clipfrac                    share of those pairs whose ratio r = exp(new - old) the PPO clip cuts:
                                      A > 0 and r > 1 + clip_high, or A < 0 and r < 1 - clip_low
    steps/ratio_std                   population std of r over those pairs
    steps/log_ratio_mean, _std        with a loss that reads each step's drift from pi_old (dppo, grpo_guard): mean
                                      and population std over the trained pairs of the log-ratio log pi - log pi_old
    steps/norm_log_ratio_mean, _std   the same of GRPO-Guard's normalised log-ratio (log-ratio + D) * s (the
                                      ratio grpo_guard clips; losses.guard_log_ratio): before / after RatioNorm
    steps/kl_old                      the mean exact KL D of the trained pairs' steps to pi_old's (dppo's trust region)
    steps/grad_share                  share of the policy gradient's norm that step t's backward contributes:
                                      sum over micro-batches of ||grad of column t's loss||, divided by the sum
                                      over steps (the loss includes the KL term where there is one)
    steps/value_error                 with a critic: mean over trajectories of (V(x_t) - R)^2, R the final reward
    steps/explained_variance          with a critic: 1 - Var_i(R_i - V(x_t)_i) / Var_i(R_i)
    steps/step_reward                 with step rewards (algorithm.adv_estimator="step_gain"): mean over trajectories
                                      of r[i, t] = R(decode(x0_hat(x_t))), the reward of step t's one-step
                                      prediction, at every step (with or without a density)
    steps/step_gain                   with step rewards: mean over trajectories of the gain g[i, t] = r[i, t+1] -
                                      r[i, t] (r[i, T] = R_i), at every step

Everything here is measured on values the training pass computes anyway: no extra model call (the step rewards
cost decodes and reward calls of their own, which the estimator that reads them pays).
The gradient share comes from hooks on the trainable parameters, which see each backward's
gradient before it is accumulated (one norm per parameter per backward).

Pure tensor code: no trainer, no I/O.
"""

import math

import torch

from ddpo_group.algos.step_gain import step_reward_gains

__all__ = ["StepAccumulator", "GradShare", "advantage_step_stats", "value_step_stats", "step_reward_stats", "STEP_KEYS"]

STEP_KEYS = (
    "steps/adv_mean", "steps/adv_std", "steps/trained", "steps/approx_kl", "steps/kl", "steps/clipfrac", "steps/ratio_std",
    "steps/log_ratio_mean", "steps/log_ratio_std", "steps/norm_log_ratio_mean", "steps/norm_log_ratio_std",
    "steps/kl_old", "steps/grad_share", "steps/value_error", "steps/explained_variance", "steps/step_reward", "steps/step_gain",
)


def _listed(values, counts):
    """(T,) float64 values -> list of floats, None where counts == 0 or the value is not finite."""
    return [float(v) if c > 0 and math.isfinite(float(v)) else None for v, c in zip(values.tolist(), counts.tolist())]


def _masked_step_mean_std(values, mask):
    """Per step t over rows with mask[i, t] > 0: (mean (T,), population std (T,), count (T,)) in float64."""
    valid = (mask > 0).to(torch.float64)
    values = values.detach().to(torch.float64) * valid
    count = valid.sum(dim=0)
    mean = values.sum(dim=0) / count.clamp(min=1)
    var = (((values - mean) * valid) ** 2).sum(dim=0) / count.clamp(min=1)
    return mean, var.sqrt(), count


def advantage_step_stats(advantages, mask):
    """{"steps/adv_mean": [T], "steps/adv_std": [T]} of (B, T) advantages over the valid rows of each step."""
    mean, std, count = _masked_step_mean_std(advantages, mask)
    return {"steps/adv_mean": _listed(mean, count), "steps/adv_std": _listed(std, count)}


def value_step_stats(values, rewards, mask):
    """Critic quality per step: (V(x_t) - R)^2 averaged over trajectories, and the explained variance of R.

    values (B, T) V(x_t); rewards (B,) final rewards R; mask (B, T). explained_variance is None at a step
    whose rewards do not vary (nothing to explain).
    """
    target = rewards.detach().to(torch.float64)[:, None].expand_as(values)
    error_mean, _, count = _masked_step_mean_std((values.detach().to(torch.float64) - target) ** 2, mask)
    _, residual_std, _ = _masked_step_mean_std(target - values.detach().to(torch.float64), mask)
    _, reward_std, _ = _masked_step_mean_std(target, mask)
    explained = 1.0 - residual_std**2 / reward_std.clamp(min=1e-300) ** 2
    explained_count = torch.where(reward_std > 0, count, torch.zeros_like(count))
    return {"steps/value_error": _listed(error_mean, count), "steps/explained_variance": _listed(explained, explained_count)}


def step_reward_stats(step_rewards, rewards):
    """{"steps/step_reward": [T], "steps/step_gain": [T]}: per step, the mean over all B trajectories of the step
    rewards r (B, T) and of their gains r[:, t+1] - r[:, t] (r[:, T] = rewards (B,), ``step_reward_gains``)."""
    every = torch.ones(step_rewards.shape, device=step_rewards.device)
    reward_mean, _, count = _masked_step_mean_std(step_rewards, every)
    gain_mean, _, _ = _masked_step_mean_std(step_reward_gains(step_rewards, rewards), every)
    return {"steps/step_reward": _listed(reward_mean, count), "steps/step_gain": _listed(gain_mean, count)}


class StepAccumulator:
    """Sums over an epoch's micro-batches, per denoising step, of what the policy's ratio did.

    ``add(step_idx, old_log_probs, log_probs, advantages, mask, kl=None, drift=None)`` takes one micro-batch's
    (b, K) tensors: step_idx the denoising step of each column, the log-probs of pi_old and of the current policy
    (the value of the forward that back-propagated), the advantages, the mask of the trained pairs, (with a
    reference model) the KL of each pair to the reference and (dppo, grpo_guard) the StepDrift of each pair.
    ``metrics()`` returns steps/trained, steps/approx_kl, steps/clipfrac, steps/ratio_std, when a KL was
    given steps/kl and when a drift was, steps/log_ratio_*, steps/norm_log_ratio_* and steps/kl_old (module
    docstring).
    """

    def __init__(self, num_steps, clip_low, clip_high):
        self.num_steps = int(num_steps)
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)
        zeros = torch.zeros(self.num_steps, dtype=torch.float64)
        self.count, self.neg_log_ratio, self.clipped = zeros.clone(), zeros.clone(), zeros.clone()
        self.ratio, self.ratio_sq = zeros.clone(), zeros.clone()
        self.kl = None  # sum of the KL to the reference per step, once one is given
        self.drift = None  # sums of the log-ratio, its square, the normalised ones and D, once a drift is given

    def add(self, step_idx, old_log_probs, log_probs, advantages, mask, kl=None, drift=None):
        valid = (mask.detach() > 0).to(torch.float64).cpu().flatten()
        steps = step_idx.detach().to(torch.int64).cpu().flatten()
        log_ratio = (log_probs.detach().to(torch.float64) - old_log_probs.detach().to(torch.float64)).cpu().flatten()
        ratio = log_ratio.clamp(-20, 20).exp()
        adv = advantages.detach().to(torch.float64).cpu().flatten()
        clipped = ((adv > 0) & (ratio > 1 + self.clip_high)) | ((adv < 0) & (ratio < 1 - self.clip_low))
        for total, value in ((self.count, valid), (self.neg_log_ratio, -log_ratio * valid),
                             (self.clipped, clipped.to(torch.float64) * valid), (self.ratio, ratio * valid),
                             (self.ratio_sq, ratio**2 * valid)):
            total.index_add_(0, steps, value)
        if kl is not None:
            if self.kl is None:
                self.kl = torch.zeros(self.num_steps, dtype=torch.float64)
            self.kl.index_add_(0, steps, kl.detach().to(torch.float64).cpu().flatten() * valid)
        if drift is not None:
            from ddpo_group.algos.drift_losses import StepDrift, guard_log_ratio

            if self.drift is None:
                self.drift = torch.zeros(5, self.num_steps, dtype=torch.float64)
            drift64 = StepDrift(*(getattr(drift, n).detach().to(torch.float64).cpu().flatten() for n in ("kl", "std", "dt")))
            normalised = guard_log_ratio(log_ratio, drift64)
            for row, value in enumerate((log_ratio, log_ratio**2, normalised, normalised**2, drift64.kl)):
                self.drift[row].index_add_(0, steps, value * valid)

    def metrics(self):
        count = self.count
        denominator = count.clamp(min=1)
        mean_ratio = self.ratio / denominator
        ratio_var = (self.ratio_sq / denominator - mean_ratio**2).clamp(min=0)
        metrics = {
            "steps/trained": [1 if c > 0 else 0 for c in count.tolist()],
            "steps/approx_kl": _listed(self.neg_log_ratio / denominator, count),
            "steps/clipfrac": _listed(self.clipped / denominator, count),
            "steps/ratio_std": _listed(ratio_var.sqrt(), count),
        }
        if self.kl is not None:
            metrics["steps/kl"] = _listed(self.kl / denominator, count)
        if self.drift is not None:
            mean = self.drift / denominator
            for name, (first, second) in (("log_ratio", (0, 1)), ("norm_log_ratio", (2, 3))):
                metrics[f"steps/{name}_mean"] = _listed(mean[first], count)
                metrics[f"steps/{name}_std"] = _listed((mean[second] - mean[first] ** 2).clamp(min=0).sqrt(), count)
            metrics["steps/kl_old"] = _listed(mean[4], count)
        return metrics


class GradShare:
    """Gradient norm of each step's backward, from tensor hooks on the trainable parameters.

    with GradShare(params, num_steps) as share:
        share.step = t          # before the backward of a column whose rows all train step t
        loss.backward()         # the hooks add ||grad_p||^2 of this backward, parameter by parameter
        share.close_column()    # ||grad of the column|| is added to step t
    share.metrics() -> {"steps/grad_share": [T]}

    A hook sees the gradient of one backward before it is accumulated into .grad, so no copy of the
    gradients is made. Columns whose rows train different steps (timestep_selection="fraction") set
    step = None and are not counted.
    """

    def __init__(self, params, num_steps):
        self.params = [p for p in params if p.requires_grad]
        self.num_steps = int(num_steps)
        self.step = None
        self._column = None
        self.norms = torch.zeros(self.num_steps, dtype=torch.float64)
        self.counted = torch.zeros(self.num_steps, dtype=torch.float64)
        self._handles = []

    def __enter__(self):
        self._handles = [p.register_hook(self._hook) for p in self.params]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False

    def _hook(self, grad):
        if self.step is not None:
            squared = grad.detach().float().pow(2).sum()
            self._column = squared if self._column is None else self._column + squared
        return grad

    def close_column(self):
        if self.step is not None and self._column is not None:
            self.norms[self.step] += math.sqrt(float(self._column))
            self.counted[self.step] += 1
        self._column = None
        self.step = None

    def metrics(self):
        total = float(self.norms.sum())
        shares = self.norms / total if total > 0 else self.norms
        return {"steps/grad_share": _listed(shares, self.counted)}
