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

A loss registered with `reads_drift=True` (dppo, grpo_guard: ddpo_group/algos/drift_losses.py, registered when
that module loads: the config checks and the trainer import it) also takes `drift`, a `StepDrift` of (B, T) tensors: the exact KL of each current Gaussian step
to the sampling policy's step and the step's std and length (the trainer fills it; `fn.reads_drift` tells it to).

`loss` is a 0-dim tensor carrying the gradient; `metrics` maps "clipfrac", "approx_kl"
and "clipfrac_lower" to detached 0-dim tensors (no host sync, so the caller can average
them over micro-batches and gather them across processes; call `.item()` to log).
approx_kl is the k1 estimate of KL(pi_old || pi_theta), the masked mean of old - new.
No gradient flows through `old_log_prob` or `advantages`.

Results have the floating dtype of the inputs (float32 or float64). Shapes must match
exactly: nothing is broadcast silently.
"""

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
