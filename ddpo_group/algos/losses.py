"""Policy losses, loss aggregation, KL penalties and the value loss on (B, T) tensors.

A denoising step is a "token": `log_prob[i, t]` is log pi(x_{t+1} | x_t, c) of step t of
trajectory i and `mask` (B, T) is 1 on steps that exist (docs/design.md §2, §5). The functions
follow verl's `core_algos` conventions unless docs/design.md says otherwise.

Policy losses are registered by name (`register_policy_loss`, `get_policy_loss`); each is

    loss, metrics = fn(old_log_prob, log_prob, advantages, mask, config)

with `config` any object (or mapping) with the fields

    clip_ratio       float, the PPO epsilon
    clip_ratio_low   float or None (None: clip_ratio); ratio lower bound 1 - clip_ratio_low
    clip_ratio_high  float or None (None: clip_ratio); ratio upper bound 1 + clip_ratio_high
    clip_ratio_c     float > 1, dual-clip bound (vanilla only; missing: 3.0)
    loss_agg_mode    one of AGG_MODES (missing: "token-mean")

A loss registered with `reads_drift=True` (dppo, grpo_guard) also takes `drift`, a `StepDrift` of (B, T) tensors:
the exact KL of each current Gaussian step to the sampling policy's step and the step's std and length (the
trainer fills it; `fn.reads_drift` tells it to).

`loss` is a 0-dim tensor carrying the gradient; `metrics` maps "clipfrac", "approx_kl"
and "clipfrac_lower" to detached 0-dim tensors (no host sync, so the caller can average
them over micro-batches and gather them across processes; call `.item()` to log).
approx_kl is the k1 estimate of KL(pi_old || pi_theta), the masked mean of old - new.
No gradient flows through `old_log_prob` or `advantages`.

Results have the floating dtype of the inputs (float32 or float64). Shapes must match
exactly: nothing is broadcast silently.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddpo_group.config.registry import ConfigError, check_choice, check_positive, register_config_check

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "KL_TYPES",
    "POLICY_LOSS_REGISTRY",
    "agg_loss",
    "kl_penalty",
    "gaussian_kl",
    "register_policy_loss",
    "get_policy_loss",
    "registered_policy_losses",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_dppo",
    "compute_policy_loss_grpo_guard",
    "StepDrift",
    "compute_value_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
# The KL of one diffusion step the trainer can add to the loss: the exact Gaussian KL of two steps
# (`gaussian_kl`, from the two means and the shared std), Flow-GRPO's scale of it for flow models
# ("flow_grpo": `gaussian_kl` with the step's noise level before its sqrt|dt| factor in place of the std;
# docs/flow.md), or a `kl_penalty` estimator on log-probs.
KL_TYPES = ("gaussian", "flow_grpo") + KL_KINDS

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSS_REGISTRY: dict[str, PolicyLoss] = {}

_MISSING = object()


def _check_matrix(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (B, T), got {type(tensor).__name__}")
    if tensor.dim() != 2:
        raise ValueError(f"{name} must have shape (B, T), got {tuple(tensor.shape)}")
    if tensor.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(tensor.shape)}); need at least one trajectory and one step")
    return tensor


def _check_like(tensor: torch.Tensor, reference: torch.Tensor, name: str, reference_name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != reference.shape:
        raise ValueError(
            f"{name} must have the shape of {reference_name} {tuple(reference.shape)}, got {tuple(tensor.shape)}"
        )
    return tensor


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / sum(mask); 0 when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1e-8)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Aggregate a (B, T) loss matrix into a scalar over the valid steps.

    With m = mask, n_i = sum_t m[i, t], T = loss_mat.shape[1]:
        token-mean               sum_{i,t} L m / sum_{i,t} m
        seq-mean-token-sum       (1/B) sum_i sum_t L m
        seq-mean-token-mean      (1/B) sum_i (sum_t L m) / n_i
        seq-mean-token-sum-norm  sum_{i,t} L m / T        (a constant divisor, Dr.GRPO / verl)
    A fully masked batch gives 0 for token-mean; a fully masked row counts as 0 in the
    seq-mean modes (divisor B unchanged, as in verl).

    Args:
        loss_mat: (B, T) per-step losses.
        mask: (B, T) 1 on valid steps (bool, int or float).
        mode: one of AGG_MODES.

    Returns:
        0-dim tensor of loss_mat's dtype.
    """
    _check_matrix(loss_mat, "loss_mat")
    _check_like(mask, loss_mat, "mask", "loss_mat")
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {list(AGG_MODES)}, got {mode!r}")
    mask = mask.to(loss_mat.dtype)
    masked = loss_mat * mask
    if mode == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1e-8)
    if mode == "seq-mean-token-sum":
        return masked.sum(dim=-1).mean()
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1e-8)).mean()
    return masked.sum() / loss_mat.shape[-1]


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-step KL estimate between the policy and the reference (Schulman's k1/k2/k3).

    With d = logprob - ref_logprob (samples drawn from the policy):
        k1, kl           d
        abs              |d|
        k2, mse          0.5 * d^2
        k3, low_var_kl   clamp(exp(k) - k - 1, -10, 10) with k = clamp(-d, -20, 20)
    The clamps of k3 stop the gradient where they are active (verl's convention).

    Args:
        logprob, ref_logprob: tensors of the same shape, typically (B, T).
        kind: one of KL_KINDS.

    Returns:
        tensor of logprob's shape and dtype.
    """
    if not isinstance(logprob, torch.Tensor) or not isinstance(ref_logprob, torch.Tensor):
        raise ValueError("logprob and ref_logprob must be torch.Tensor")
    _check_like(ref_logprob, logprob, "ref_logprob", "logprob")
    if kind in ("k1", "kl"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)
    raise ValueError(f"kl kind must be one of {list(KL_KINDS)}, got {kind!r}")


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """Exact KL between two Gaussian denoising steps that share their std.

    KL(N(mu, s^2 I) || N(mu_ref, s^2 I)) per dimension is (mu - mu_ref)^2 / (2 s^2);
    averaged over all non-batch dimensions (the log_prob convention of docs/design.md §2):
        kl_i = mean_{c,h,w} (mean - ref_mean)^2 / (2 std^2)

    Args:
        mean: (B, ...) policy step mean mu_theta.
        ref_mean: same shape, reference step mean.
        std: sigma_t >= 0: a number, a 0-dim or one-element tensor, a (B,) tensor, or a tensor
            with mean's number of dimensions whose sizes are 1 or mean's (e.g. (B, 1, 1, 1)).
            Where std is 0 (a step without density, mask 0) the KL is 0, with zero gradient.

    Returns:
        (B,) tensor of mean's dtype.
    """
    if not isinstance(mean, torch.Tensor) or not isinstance(ref_mean, torch.Tensor):
        raise ValueError("mean and ref_mean must be torch.Tensor")
    if mean.dim() < 1 or mean.shape[0] == 0:
        raise ValueError(f"mean must have shape (B, ...) with B >= 1, got {tuple(mean.shape)}")
    _check_like(ref_mean, mean, "ref_mean", "mean")
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    batch_size = mean.shape[0]
    if std.numel() == 1:
        std = std.reshape(())
    elif std.dim() == 1 and std.shape[0] == batch_size:
        std = std.reshape((batch_size,) + (1,) * (mean.dim() - 1))
    elif std.dim() != mean.dim() or any(s not in (1, m) for s, m in zip(std.shape, mean.shape)):
        raise ValueError(
            f"std must be a number, a (B,) = ({batch_size},) tensor or a tensor broadcastable with "
            f"mean {tuple(mean.shape)} of the same number of dimensions (e.g. (B, 1, 1, 1)); got {tuple(std.shape)}"
        )
    if not bool((std >= 0).all()):
        raise ValueError("std must be >= 0 (and finite) everywhere")
    # A step with std 0 has no density (its mask is 0): its KL is defined as 0, without a
    # 0/0 that would turn the gradient of the whole batch into NaN.
    has_density = std > 0
    safe_std = torch.where(has_density, std, torch.ones_like(std))
    kl = torch.where(has_density, (mean - ref_mean).square() / (2 * safe_std.square()), torch.zeros_like(mean))
    return kl.reshape(batch_size, -1).mean(dim=1)


def register_policy_loss(
    name: str, couples_steps: bool = False, reads_drift: bool = False
) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register `fn(old_log_prob, log_prob, advantages, mask, config) -> (loss, metrics)`.

    couples_steps: True when one step's loss depends on the other steps' current log-probs (a
    sequence-level ratio, as in gspo and geo_mean). The trainer back-propagates one step at a
    time and must then evaluate every step first; it reads this as `fn.couples_steps`.
    reads_drift: True when fn takes a fifth argument `drift` (a `StepDrift`): the exact Gaussian KL of
    each current step to the sampling policy's step, which needs pi_old's step mean (dppo, grpo_guard);
    the trainer reads this as `fn.reads_drift`.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_policy_loss: name must be a non-empty string, got {name!r}")

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        previous = POLICY_LOSS_REGISTRY.get(name)
        if previous is not None and (previous.__module__, previous.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(
                f"register_policy_loss: policy loss {name!r} is already registered "
                f"({previous.__module__}.{previous.__qualname__}); choose another name"
            )
        fn.couples_steps = bool(couples_steps)
        fn.reads_drift = bool(reads_drift)
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered under `name`; unknown name -> ValueError listing the known ones."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"Unknown policy loss {name!r}; registered policy losses: {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


def registered_policy_losses() -> list[str]:
    """Sorted names of the registered policy losses."""
    return sorted(POLICY_LOSS_REGISTRY)


def _config_value(config: Any, name: str, default: Any = _MISSING) -> Any:
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    if value is _MISSING:
        raise ValueError(f"policy loss config has no field `{name}`; set config.{name}")
    return value


def _clip_range(config: Any) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high), each falling back to clip_ratio when None."""
    if config is None:
        raise ValueError("policy loss needs a config with clip_ratio, clip_ratio_low, clip_ratio_high, ...; got None")
    clip_ratio = _config_value(config, "clip_ratio", None)
    low = _config_value(config, "clip_ratio_low", None)
    high = _config_value(config, "clip_ratio_high", None)
    low = clip_ratio if low is None else low
    high = clip_ratio if high is None else high
    for name, value in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        if value is None:
            raise ValueError(f"config.{name} is None and config.clip_ratio is None; set clip_ratio (e.g. 0.2)")
        if not float(value) >= 0:
            raise ValueError(f"config.{name} (or clip_ratio) must be >= 0, got {value}")
    return float(low), float(high)


def _check_policy_inputs(old_log_prob, log_prob, advantages, mask) -> torch.Tensor:
    _check_matrix(log_prob, "log_prob")
    _check_like(old_log_prob, log_prob, "old_log_prob", "log_prob")
    _check_like(advantages, log_prob, "advantages", "log_prob")
    _check_like(mask, log_prob, "mask", "log_prob")
    return mask.to(log_prob.dtype)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clipping and dual clip (verl "vanilla").

        ratio = exp(clamp(log_prob - old_log_prob, -20, 20))
        pg1 = -A * ratio
        pg2 = -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        c1  = max(pg1, pg2)
        pg3 = -A * clip_ratio_c                       (dual clip, clip_ratio_c > 1)
        c2  = min(pg3, c1)
        L   = where(A < 0, c2, c1);   loss = agg_loss(L, mask, config.loss_agg_mode)
    Metrics: clipfrac = masked mean of [pg2 > pg1]; clipfrac_lower = masked mean of
    [c1 > pg3 and A < 0]; approx_kl = masked mean of -(clamped log-ratio).

    Args:
        old_log_prob, log_prob, advantages, mask: (B, T).
        config: see the module docstring.
    """
    mask = _check_policy_inputs(old_log_prob, log_prob, advantages, mask)
    clip_low, clip_high = _clip_range(config)
    clip_ratio_c = float(_config_value(config, "clip_ratio_c", 3.0))
    if not clip_ratio_c > 1.0:
        raise ValueError(f"config.clip_ratio_c is the dual-clip bound and must be > 1, got {clip_ratio_c}")
    loss_agg_mode = _config_value(config, "loss_agg_mode", "token-mean")
    old_log_prob = old_log_prob.detach()
    advantages = advantages.detach()

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clipped_losses2 = torch.minimum(pg_losses3, clipped_losses1)
    pg_losses = torch.where(advantages < 0, clipped_losses2, clipped_losses1)
    loss = agg_loss(pg_losses, mask, loss_agg_mode)

    with torch.no_grad():
        metrics = {
            "clipfrac": _masked_mean((pg_losses2 > pg_losses1).to(mask.dtype), mask),
            "approx_kl": _masked_mean(-log_ratio, mask),
            "clipfrac_lower": _masked_mean(((clipped_losses1 > pg_losses3) & (advantages < 0)).to(mask.dtype), mask),
        }
    return loss, metrics


@register_policy_loss("gspo", couples_steps=True)
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: sequence-level importance ratio, applied per token (arXiv 2507.18071, verl "gspo").

        log s_i   = (1 / n_i) sum_t mask (log_prob - old_log_prob)          (sequence ratio)
        log s_i,t = clamp(sg[log s_i] + log_prob_i,t - sg[log_prob_i,t], max=10)
        pg1 = -A * s_i,t;  pg2 = -A * clamp(s_i,t, 1 - clip_ratio_low, 1 + clip_ratio_high)
        L   = max(pg1, pg2);  loss = agg_loss(L, mask, "seq-mean-token-mean")
    The value of s_i,t is s_i, but its gradient is s_i * grad log_prob_i,t: each token
    gets its own gradient, scaled by the sequence ratio. The aggregation is always
    seq-mean-token-mean (config.loss_agg_mode is not used). No dual clip.
    Metrics: clipfrac = masked mean of [pg2 > pg1]; approx_kl = masked mean of
    old - new; clipfrac_lower = 0.
    """
    mask = _check_policy_inputs(old_log_prob, log_prob, advantages, mask)
    clip_low, clip_high = _clip_range(config)
    old_log_prob = old_log_prob.detach()
    advantages = advantages.detach()

    log_ratio = log_prob - old_log_prob
    seq_lengths = mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / seq_lengths
    token_log_ratio = seq_log_ratio.detach()[:, None] + log_prob - log_prob.detach()
    token_ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    pg_losses1 = -advantages * token_ratio
    pg_losses2 = -advantages * torch.clamp(token_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    loss = agg_loss(pg_losses, mask, "seq-mean-token-mean")

    with torch.no_grad():
        metrics = {
            "clipfrac": _masked_mean((pg_losses2 > pg_losses1).to(mask.dtype), mask),
            "approx_kl": _masked_mean(-log_ratio, mask),
            "clipfrac_lower": torch.zeros((), dtype=log_prob.dtype, device=log_prob.device),
        }
    return loss, metrics


@register_policy_loss("geo_mean", couples_steps=True)
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: geometric-mean policy optimisation (arXiv 2507.20673, verl "geo_mean").

    Token clipping in log space, sign-aware (d = log_prob - old_log_prob, sgn = sign(A)):
        d_clip = clamp(d, -clip_ratio_low, clip_ratio_high)
        d_min  = sgn * min(sgn * d, sgn * d_clip)
    Per sequence i with n_i valid steps:
        r_i = exp((1 / n_i) sum_t mask d_min)          (geometric mean of token ratios)
        A_i = (1 / n_i) sum_t mask A                   (sequence-mean advantage)
    loss = (1/B) sum_i -A_i * r_i (sequence level: config.loss_agg_mode is not used).
    Metrics: clipfrac = masked mean of [d clipped and A > 0]; clipfrac_lower = masked mean
    of [d clipped and A < 0]; approx_kl = masked mean of old - new.
    """
    mask = _check_policy_inputs(old_log_prob, log_prob, advantages, mask)
    clip_low, clip_high = _clip_range(config)
    old_log_prob = old_log_prob.detach()
    advantages = advantages.detach()

    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, min=-clip_low, max=clip_high)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)
    seq_lengths = mask.sum(dim=-1).clamp(min=1)
    seq_ratio = torch.exp((log_ratio_min * mask).sum(dim=-1) / seq_lengths)
    seq_advantage = (advantages * mask).sum(dim=-1) / seq_lengths
    loss = (-seq_advantage * seq_ratio).mean()

    with torch.no_grad():
        clipped = log_ratio != log_ratio_clamped
        metrics = {
            "clipfrac": _masked_mean((clipped & (advantages > 0)).to(mask.dtype), mask),
            "approx_kl": _masked_mean(-log_ratio, mask),
            "clipfrac_lower": _masked_mean((clipped & (advantages < 0)).to(mask.dtype), mask),
        }
    return loss, metrics


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


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO).

        V_clip = clamp(vpreds, values - cliprange_value, values + cliprange_value)
        loss   = 0.5 * agg_loss(max((vpreds - R)^2, (V_clip - R)^2), mask, loss_agg_mode)
        clipfrac = masked mean of [(V_clip - R)^2 > (vpreds - R)^2]
    cliprange_value=None disables clipping (loss = 0.5 * agg((vpreds - R)^2), clipfrac 0).

    Args:
        vpreds: (B, T) current critic predictions (carry the gradient).
        returns: (B, T) targets R (from the advantage estimator).
        values: (B, T) critic values at sampling time.
        mask: (B, T) 1 on the steps to train.
        cliprange_value: clip range >= 0, or None.
        loss_agg_mode: one of AGG_MODES.

    Returns:
        (loss 0-dim tensor, clipfrac detached 0-dim tensor).
    """
    _check_matrix(vpreds, "vpreds")
    _check_like(returns, vpreds, "returns", "vpreds")
    _check_like(values, vpreds, "values", "vpreds")
    _check_like(mask, vpreds, "mask", "vpreds")
    returns = returns.detach()
    values = values.detach()
    if cliprange_value is None:
        vpreds_clipped = vpreds
    else:
        if not float(cliprange_value) >= 0:
            raise ValueError(f"cliprange_value must be >= 0 or None, got {cliprange_value}")
        vpreds_clipped = torch.clamp(vpreds, min=values - cliprange_value, max=values + cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpreds_clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), mask, loss_agg_mode)
    with torch.no_grad():
        clipfrac = _masked_mean((vf_losses2 > vf_losses1).to(vpreds.dtype), mask.to(vpreds.dtype))
    return loss, clipfrac


@register_config_check("algorithm")
def check_loss_fields(config, machine):
    """The KL estimator, the loss aggregation and the policy loss are registered names; the clip ranges hold."""
    train = config.train
    check_choice(train.kl_type, KL_TYPES, "train.kl_type")
    check_choice(train.loss_agg_mode, AGG_MODES, "train.loss_agg_mode")
    check_choice(train.policy_loss, registered_policy_losses(), "train.policy_loss")
    check_positive(train.clip_range, "train.clip_range")
    check_positive(train.adv_clip_max, "train.adv_clip_max")
    if train.clip_ratio_c <= 1.0:
        raise ConfigError(f"config.train.clip_ratio_c={train.clip_ratio_c} must be > 1 (dual clip)")


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
