"""The policy losses that read each step's drift from the sampling policy's Gaussian step (docs/concepts.md).

A denoising step is Gaussian, N(mu, s^2 I), and the current and the sampling policy's steps share their std s, so
the divergence of one from the other is exact: D = mean over the latent's dimensions of (mu_theta - mu_old)^2 /
(2 s^2) (`gaussian_kl`). Two objectives build on it, registered beside the others (`register_policy_loss(...,
reads_drift=True)`): the trainer then keeps pi_old's step means (its recompute pass) and passes each loss a
`StepDrift` of (B, T) tensors as a sixth argument.

    dppo        Flow-DPPO (arXiv 2606.11025): PPO's ratio clip replaced by a trust region on D
    grpo_guard  GRPO-Guard (arXiv 2510.22319): the clip on a per-step normalised ratio, 1 / dt step weights

Pure math: no trainer, no I/O. Shapes and conventions as in ddpo_group/algos/losses.py.
"""

import dataclasses
from typing import Any

import torch

from ddpo_group.algos.losses import (
    POLICY_LOSS_REGISTRY,
    _check_like,
    _check_policy_inputs,
    _clip_range,
    _config_value,
    _masked_mean,
    agg_loss,
    register_policy_loss,
)
from ddpo_group.config.registry import ConfigError, check_choice, register_config_check

__all__ = ["StepDrift", "GUARD_REWEIGHTS", "guard_log_ratio", "compute_policy_loss_dppo",
           "compute_policy_loss_grpo_guard"]


@dataclasses.dataclass
class StepDrift:
    """How far each current Gaussian step is from the sampling policy's step, for the losses that read it.

    kl   (B, T) the exact KL(pi_theta step || pi_old step) = mean over the latent's dimensions of
         (mu_theta - mu_old)^2 / (2 s^2) (`gaussian_kl`, the two steps share their std s); it carries the
         gradient of mu_theta on the live column (grpo_guard's ratio reads it; dppo detaches it).
    std  (B, T) the step's std s (sigma_t sqrt|dt| of a flow SDE step, DDIM's sigma_t), 0 where a step has no density.
    dt   (B, T) the step's length in flow time, sigma_t - sigma_{t+1} > 0 (DDIM: the flow time of its noise level,
         `DiffusionPolicy.step_dt`); grpo_guard's timestep weight is 1 / dt.
    """

    kl: torch.Tensor
    std: torch.Tensor
    dt: torch.Tensor


def _check_drift(drift: Any, reference: torch.Tensor, loss: str) -> StepDrift:
    if not isinstance(drift, StepDrift):
        raise ValueError(
            f"policy loss {loss!r} needs drift=StepDrift(kl, std, dt) of (B, T) tensors (the exact KL of each step to "
            f"the sampling policy's step), got {type(drift).__name__}"
        )
    for name in ("kl", "std", "dt"):
        _check_like(getattr(drift, name), reference, f"drift.{name}", "log_prob")
    return drift


@register_policy_loss("dppo", reads_drift=True)
def compute_policy_loss_dppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: Any,
    drift: StepDrift | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO: a trust region on the exact per-step KL in place of PPO's ratio clip (arXiv 2606.11025).

    The per-step policy is Gaussian and pi_theta's and pi_old's steps share their std s, so their divergence
    is exact and cheap: D = drift.kl = mean_dims (mu_theta - mu_old)^2 / (2 s^2). With r = exp(log_prob -
    old_log_prob) (the log-ratio clamped to [-20, 20]) the asymmetric divergence mask drops a step's gradient
    only when it is outside the region AND the update still pushes it further out:

        masked = D > dppo_kl_max  and  ((A > 0 and r > 1)  or  (A < 0 and r < 1))
        L      = (1 - masked) * (-A * r);    loss = agg_loss(L, mask, config.loss_agg_mode)

    so a step inside the region (D <= dppo_kl_max), and a corrective step (moving back: A > 0 with r < 1, or
    A < 0 with r > 1), keeps the unclipped policy gradient -A grad r; there is no ratio clip at all. At equal
    weights (r = 1, D = 0) nothing is masked and the gradient is the policy gradient -A grad log pi.
    D is detached (the mask is a constant of the step). `config.dppo_kl_max` is the threshold delta > 0
    (train.dppo_kl_max, default 1e-5: verl-omni's Flow-DPPO recipe, kl_mask_threshold=1e-5 on the same
    mean-over-dimensions KL with the std sigma_t sqrt|dt|). The paper's mask and its D >= delta in verl-omni's
    FlowDPPOLoss differ from this D > delta only on a set of measure zero.
    Metrics: clipfrac = masked mean of [masked] (the share of steps the trust region stops); clipfrac_lower
    = the same for A < 0; approx_kl = masked mean of old - new; dppo/kl_old = masked mean of D;
    dppo/outside = masked mean of [D > dppo_kl_max].
    """
    mask = _check_policy_inputs(old_log_prob, log_prob, advantages, mask)
    drift = _check_drift(drift, log_prob, "dppo")
    kl_max = float(_config_value(config, "dppo_kl_max"))
    if not kl_max > 0:
        raise ValueError(f"config.dppo_kl_max is Flow-DPPO's trust region on the per-step KL and must be > 0, got {kl_max}")
    loss_agg_mode = _config_value(config, "loss_agg_mode", "token-mean")
    old_log_prob = old_log_prob.detach()
    advantages = advantages.detach()
    kl_old = drift.kl.detach().to(log_prob.dtype)

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    outside = kl_old > kl_max
    masked = outside & (((advantages > 0) & (ratio > 1)) | ((advantages < 0) & (ratio < 1)))
    pg_losses = torch.where(masked, torch.zeros_like(ratio), -advantages * ratio)
    loss = agg_loss(pg_losses, mask, loss_agg_mode)

    with torch.no_grad():
        metrics = {
            "clipfrac": _masked_mean(masked.to(mask.dtype), mask),
            "approx_kl": _masked_mean(-log_ratio, mask),
            "clipfrac_lower": _masked_mean((masked & (advantages < 0)).to(mask.dtype), mask),
            "dppo/kl_old": _masked_mean(kl_old, mask),
            "dppo/outside": _masked_mean(outside.to(mask.dtype), mask),
        }
    return loss, metrics


GUARD_REWEIGHTS = ("dt", "none")


def guard_log_ratio(log_ratio: torch.Tensor, drift: StepDrift) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio of each step: (log_ratio + D) * s.

    With x_{t+1} = mu_old + s eps and delta = mu_theta - mu_old, a step's log-ratio (mean over the dimensions,
    as log_prob) is mean(eps delta) / s - D with D = mean(delta^2) / (2 s^2) = drift.kl: its mean -D < 0 shifts
    the ratio left (so the upper clip rarely binds), and its spread grows as 1 / s across the steps. Adding D
    back centres it at 0 and multiplying by s gives every step the spread of mean(eps delta).
    """
    return (log_ratio + drift.kl.to(log_ratio.dtype)) * drift.std.detach().to(log_ratio.dtype)


@register_policy_loss("grpo_guard", reads_drift=True)
def compute_policy_loss_grpo_guard(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: Any,
    drift: StepDrift | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Guard: PPO's clip on a per-step normalised ratio, with timestep gradient reweighting (arXiv 2510.22319).

    RatioNorm (`guard_log_ratio`): with D = drift.kl (exact KL to pi_old's step, with its gradient) and s = drift.std,
        z = (log_prob - old_log_prob + D) * s;   r = exp(clamp(z, -20, 20))
    the PPO clip on it (no dual clip):
        pg1 = -A * r;  pg2 = -A * clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high);  L = max(pg1, pg2)
    and the timestep reweighting w = 1 / dt (dt = drift.dt, the step's length in flow time; config.guard_reweight
    "dt", the paper's, or "none": w = 1), which evens the gradient over the noise levels (a step's mean moves
    with the velocity times dt):
        loss = agg_loss(w * L, mask, config.loss_agg_mode)
    The form of the paper's authors in verl-omni's GRPOGuardLoss and Flow-Factory's GRPOGuardTrainer (the
    ratio; verl-omni also weighs 1 / dt). With s = 1, D = 0 and w = 1 it is PPO's clipped surrogate.
    Metrics: clipfrac = masked mean of [pg2 > pg1]; clipfrac_lower = the A < 0 part of it; approx_kl = masked
    mean of old - new (the raw log-ratio).
    """
    mask = _check_policy_inputs(old_log_prob, log_prob, advantages, mask)
    drift = _check_drift(drift, log_prob, "grpo_guard")
    clip_low, clip_high = _clip_range(config)
    reweight = _config_value(config, "guard_reweight", "dt")
    if reweight not in GUARD_REWEIGHTS:
        raise ValueError(f"config.guard_reweight must be one of {list(GUARD_REWEIGHTS)}, got {reweight!r}")
    loss_agg_mode = _config_value(config, "loss_agg_mode", "token-mean")
    old_log_prob = old_log_prob.detach()
    advantages = advantages.detach()

    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(torch.clamp(guard_log_ratio(log_ratio, drift), min=-20.0, max=20.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if reweight == "dt":
        dt = drift.dt.detach().to(log_prob.dtype)
        # a step without density (mask 0) may have dt 0: weight 0 there, not inf * 0
        weight = torch.where(dt > 0, 1.0 / torch.where(dt > 0, dt, torch.ones_like(dt)), torch.zeros_like(dt))
        pg_losses = weight * pg_losses
    loss = agg_loss(pg_losses, mask, loss_agg_mode)

    with torch.no_grad():
        clipped = pg_losses2 > pg_losses1
        metrics = {
            "clipfrac": _masked_mean(clipped.to(mask.dtype), mask),
            "approx_kl": _masked_mean(-log_ratio, mask),
            "clipfrac_lower": _masked_mean((clipped & (advantages < 0)).to(mask.dtype), mask),
        }
    return loss, metrics


@register_config_check("algorithm")
def check_drift_losses(config, machine):
    """dppo's trust region and grpo_guard's reweighting hold; both read pi_old's step mean, which the stepwise
    update takes in its recompute pass (train.old_log_probs="recompute")."""
    train = config.train
    if not float(train.dppo_kl_max) > 0:
        raise ConfigError(f"config.train.dppo_kl_max={train.dppo_kl_max} is Flow-DPPO's per-step KL bound: use a number > 0 (e.g. 1e-5)")
    check_choice(train.guard_reweight, GUARD_REWEIGHTS, "train.guard_reweight")
    if train.policy_loss not in POLICY_LOSS_REGISTRY or not POLICY_LOSS_REGISTRY[train.policy_loss].reads_drift:
        return
    if train.objective != "stepwise":
        raise ConfigError(
            f"config.train.policy_loss={train.policy_loss!r} reads the KL of reverse-process steps to pi_old's: "
            f"use it with train.objective='stepwise' (got {train.objective!r})"
        )
    if train.old_log_probs != "recompute":
        raise ConfigError(
            f"config.train.policy_loss={train.policy_loss!r} needs pi_old's step mean, taken in the recompute pass: "
            f"set train.old_log_probs='recompute' (got {train.old_log_probs!r})"
        )
