"""Group-PPO: endpoint grouping over denoising timesteps (Algorithm 2; docs/group_ppo.md).

A trajectory of T denoising steps is cut into consecutive segments. A segment grows while
the per-step advantages inside it vary little compared with how much the outcome
(GRPO) advantages vary across trajectories; the last step of each segment is an
*endpoint*. Endpoints are shared by the whole batch, so the training pass runs one batched
UNet call per endpoint (K calls instead of T). Every step of a segment gets the segment's
mean advantage.

Shapes: B trajectories, T steps; ``mask`` (B, T) is 1 for steps that exist.
"""

import math

import torch

from ddpo_group.algos.advantages import (
    estimator_option,
    compute_gae_advantages,
    compute_grpo_advantages,
    group_normalize_step_advantages,
    register_adv_est,
    token_level_rewards_from_outcome,
)
from ddpo_group.config.registry import ConfigError, check_choice, check_positive, register_config_check

__all__ = [
    "ADVANTAGE_NORMS",
    "AdaptiveThreshold",
    "compute_group_ppo_advantages",
    "find_group_endpoints",
    "group_ppo_estimator",
    "grouping_metrics",
    "segment_advantages",
]


# group_ppo.advantage_norm: GAE's batch whitening only (Algorithm 2 as written), or a per-prompt baseline on top.
ADVANTAGE_NORMS = ("whiten", "group")


def _check_2d(name, tensor, shape=None):
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a (B, T) tensor, got {got}")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (the shape of advantages), got {tuple(tensor.shape)}")


def _per_trajectory_outcome(outcome_advantages, valid):
    """(B,) outcome advantage per trajectory from a (B,) or (B, T) tensor.

    For (B, T) (grpo advantages broadcast over the steps, A[i, t] = A_i * mask[i, t]) the
    value at each trajectory's first valid step is taken; a trajectory without valid steps
    takes column 0 (it is excluded from every variance anyway).
    """
    B, T = valid.shape
    if outcome_advantages.dim() == 1:
        if outcome_advantages.shape[0] != B:
            raise ValueError(
                f"outcome_advantages must have shape ({B},) or ({B}, {T}), got {tuple(outcome_advantages.shape)}"
            )
        return outcome_advantages
    if outcome_advantages.dim() == 2 and tuple(outcome_advantages.shape) == (B, T):
        first_valid = valid.to(torch.int64).argmax(dim=1)  # argmax returns the first maximum
        return outcome_advantages.gather(1, first_valid[:, None]).squeeze(1)
    raise ValueError(
        f"outcome_advantages must have shape ({B},) or ({B}, {T}), got {tuple(outcome_advantages.shape)}"
    )


def find_group_endpoints(advantages, outcome_advantages, mask, threshold, max_group_size, eps=1e-6):
    """Algorithm 2: batch-shared segment endpoints over the denoising steps.

    ::

        r_grpo = Var_i(outcome_advantages[i]) + eps        # across trajectories, population var
        start = first valid step
        for t in valid steps after start:
            seg = valid steps in [start .. t]
            r_ppo = mean_i Var_{s in seg}(advantages[i, s]) + eps   # population var per trajectory
            if r_grpo / r_ppo < threshold or len(seg) > max_group_size:
                the valid step before t is an endpoint;  start = t
        the last valid step is always an endpoint

    A step is *valid for the batch* when ``mask`` is nonzero for any trajectory (masks are
    normally identical across rows); ``len(seg)`` counts those steps. Trajectories whose
    mask is all zero take part in neither variance. Inside ``r_ppo`` each trajectory's
    variance uses only its own valid steps of ``seg``, and the mean runs over the
    trajectories with at least one such step. A 1-step segment has variance 0, so a
    constant segment has ``r_ppo = eps`` and ``len(seg) > max_group_size`` bounds every
    segment to ``max_group_size`` steps. A larger ``threshold`` splits more often.

    Args:
        advantages: (B, T) per-step advantages (GAE for Group-PPO).
        outcome_advantages: (B,) or (B, T) outcome (grpo) advantages; for (B, T) the value
            at each trajectory's first valid step is used.
        mask: (B, T), 1 (or True) for steps that exist.
        threshold: float > 0.
        max_group_size: int >= 1, the longest segment.
        eps: float > 0 added to both variances.

    Returns:
        endpoint_mask: (B, T) bool, True at the shared endpoints (and only on valid steps).
        group_ids: (B, T) int64, segments numbered 1, 2, ... in time order, 0 on invalid steps.
    """
    _check_2d("advantages", advantages)
    _check_2d("mask", mask, advantages.shape)
    if not isinstance(outcome_advantages, torch.Tensor):
        raise ValueError("outcome_advantages must be a (B,) or (B, T) tensor")
    threshold = float(threshold)
    if not (threshold > 0 and math.isfinite(threshold)):
        raise ValueError(f"threshold must be a finite number > 0, got {threshold}")
    if isinstance(max_group_size, bool) or int(max_group_size) != max_group_size or max_group_size < 1:
        raise ValueError(f"max_group_size must be an integer >= 1, got {max_group_size}")
    max_group_size = int(max_group_size)
    eps = float(eps)
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps r_ppo of a constant segment finite), got {eps}")

    B, T = advantages.shape
    valid = mask > 0
    outcome = _per_trajectory_outcome(outcome_advantages, valid).detach().to(torch.float64)
    adv = advantages.detach().to(torch.float64)
    row_has_steps = valid.any(dim=1)
    step_is_valid = valid.any(dim=0)
    valid_steps = torch.nonzero(step_is_valid).flatten().tolist()

    endpoint_mask = torch.zeros(B, T, dtype=torch.bool, device=advantages.device)
    group_ids = torch.zeros(B, T, dtype=torch.int64, device=advantages.device)
    if not valid_steps:
        return endpoint_mask, group_ids

    r_grpo = outcome[row_has_steps].var(unbiased=False).item() + eps if row_has_steps.sum() > 1 else eps

    def r_ppo(first, last):
        seg_mask = valid[:, first : last + 1].to(torch.float64)
        seg_adv = adv[:, first : last + 1]
        count = seg_mask.sum(dim=1)
        rows = count > 0
        mean = (seg_adv * seg_mask).sum(dim=1) / count.clamp(min=1)
        var = ((seg_adv - mean[:, None]) ** 2 * seg_mask).sum(dim=1) / count.clamp(min=1)
        return var[rows].mean().item() + eps

    endpoints = []
    start = 0  # position in valid_steps
    for k in range(1, len(valid_steps)):
        seg_len = k - start + 1
        if seg_len > max_group_size or r_grpo / r_ppo(valid_steps[start], valid_steps[k]) < threshold:
            endpoints.append(valid_steps[k - 1])
            start = k
    endpoints.append(valid_steps[-1])

    shared_endpoints = torch.zeros(T, dtype=torch.bool, device=advantages.device)
    shared_endpoints[endpoints] = True
    # segment id of step t = 1 + number of endpoints strictly before t
    shared_ids = 1 + torch.cumsum(shared_endpoints.to(torch.int64), dim=0) - shared_endpoints.to(torch.int64)
    endpoint_mask = shared_endpoints[None, :].expand(B, T) & valid
    group_ids = torch.where(valid, shared_ids[None, :].expand(B, T), torch.zeros_like(group_ids))
    return endpoint_mask, group_ids


def segment_advantages(advantages, group_ids, mask):
    """Mean advantage of each segment, broadcast over its steps.

    out[i, t] = mean_{s : group_ids[i, s] = group_ids[i, t], mask[i, s] > 0} advantages[i, s]
    for valid steps (mask[i, t] > 0), 0 elsewhere. Segments are per trajectory: the mean
    never mixes rows.

    Args:
        advantages: (B, T) float.
        group_ids: (B, T) int, segment ids >= 0 (0 marks invalid steps).
        mask: (B, T), 1 for steps that exist.

    Returns:
        (B, T) tensor with the dtype of ``advantages``.
    """
    _check_2d("advantages", advantages)
    _check_2d("group_ids", group_ids, advantages.shape)
    _check_2d("mask", mask, advantages.shape)
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if group_ids.numel() and group_ids.min() < 0:
        raise ValueError("group_ids must be >= 0 (0 marks invalid steps)")

    valid = (mask > 0).to(advantages.dtype)
    ids = group_ids.to(torch.int64)
    num_slots = int(ids.max().item()) + 1 if ids.numel() else 1
    B = advantages.shape[0]
    sums = torch.zeros(B, num_slots, dtype=advantages.dtype, device=advantages.device)
    counts = torch.zeros_like(sums)
    sums.scatter_add_(1, ids, advantages * valid)
    counts.scatter_add_(1, ids, valid)
    means = sums / counts.clamp(min=1)
    return means.gather(1, ids) * valid


class AdaptiveThreshold:
    """Variance threshold of Algorithm 2, adapted towards a target compression.

    After each batch, with c = 1 - endpoints / valid steps (counted over the whole batch)::

        threshold <- clip(threshold * exp(lr * (c - target_compression)), min_threshold, max_threshold)

    Compression above the target raises the threshold (more endpoints next time), below
    lowers it. With ``enabled=False`` (config ``adaptive_threshold=False``) ``update``
    leaves the threshold fixed. ``state_dict()`` is JSON-serialisable, for checkpoints.
    """

    def __init__(
        self,
        threshold=1.0,
        lr=0.01,
        min_threshold=0.1,
        max_threshold=10.0,
        target_compression=0.75,
        enabled=True,
    ):
        if not min_threshold > 0:
            raise ValueError(f"min_threshold must be > 0, got {min_threshold}")
        if not max_threshold >= min_threshold:
            raise ValueError(
                f"max_threshold ({max_threshold}) must be >= min_threshold ({min_threshold})"
            )
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        if enabled and not min_threshold <= threshold <= max_threshold:
            raise ValueError(
                f"threshold ({threshold}) must lie in [min_threshold, max_threshold] = "
                f"[{min_threshold}, {max_threshold}]; change variance_threshold or the bounds"
            )
        if not 0.0 <= target_compression <= 1.0:
            raise ValueError(f"target_compression must be in [0, 1], got {target_compression}")
        if not lr >= 0:
            raise ValueError(f"lr (threshold_lr) must be >= 0, got {lr}")
        self.threshold = float(threshold)
        self.lr = float(lr)
        self.min_threshold = float(min_threshold)
        self.max_threshold = float(max_threshold)
        self.target_compression = float(target_compression)
        self.enabled = bool(enabled)
        self.num_updates = 0

    @classmethod
    def from_config(cls, group_config):
        """Build from the ``config.group_ppo`` block (docs/group_ppo.md)."""
        return cls(
            threshold=group_config.variance_threshold,
            lr=group_config.threshold_lr,
            min_threshold=group_config.min_threshold,
            max_threshold=group_config.max_threshold,
            target_compression=group_config.target_compression,
            enabled=group_config.adaptive_threshold,
        )

    def update(self, endpoint_mask, mask):
        """Adapt the threshold from one batch's (B, T) endpoint_mask and mask; returns it."""
        _check_2d("endpoint_mask", endpoint_mask)
        _check_2d("mask", mask, endpoint_mask.shape)
        valid = mask > 0
        num_valid = int(valid.sum().item())
        if not self.enabled or num_valid == 0:
            return self.threshold
        num_endpoints = int((endpoint_mask.bool() & valid).sum().item())
        compression = 1.0 - num_endpoints / num_valid
        new = self.threshold * math.exp(self.lr * (compression - self.target_compression))
        self.threshold = min(max(new, self.min_threshold), self.max_threshold)
        self.num_updates += 1
        return self.threshold

    def state_dict(self):
        return {"threshold": self.threshold, "num_updates": self.num_updates}

    def load_state_dict(self, state):
        if "threshold" not in state:
            raise ValueError("AdaptiveThreshold state must contain 'threshold'")
        self.threshold = float(state["threshold"])
        self.num_updates = int(state.get("num_updates", 0))

    def __repr__(self):
        return (
            f"AdaptiveThreshold(threshold={self.threshold}, lr={self.lr}, min_threshold={self.min_threshold}, "
            f"max_threshold={self.max_threshold}, target_compression={self.target_compression}, "
            f"enabled={self.enabled})"
        )


def grouping_metrics(endpoint_mask, mask, threshold):
    """Logged grouping statistics of one batch (docs/group_ppo.md).

    With N valid steps and K endpoints over the batch, and R trajectories with valid steps:

    - ``group/compression_ratio`` = 1 - K / N
    - ``group/num_endpoints`` = K / R (endpoints per trajectory)
    - ``group/mean_segment_len`` = N / K (every segment ends at one endpoint)
    - ``group/threshold`` = threshold
    - ``group/efficiency_gain`` = N / K (UNet calls saved by training on endpoints only)

    ``mean_segment_len`` and ``efficiency_gain`` coincide because endpoints are shared.
    A batch without endpoints reports 0 for the ratios that divide by K.
    """
    _check_2d("endpoint_mask", endpoint_mask)
    _check_2d("mask", mask, endpoint_mask.shape)
    valid = mask > 0
    num_valid = int(valid.sum().item())
    num_endpoints = int((endpoint_mask.bool() & valid).sum().item())
    num_rows = int(valid.any(dim=1).sum().item())
    return {
        "group/compression_ratio": 1.0 - num_endpoints / num_valid if num_valid else 0.0,
        "group/num_endpoints": num_endpoints / num_rows if num_rows else 0.0,
        "group/mean_segment_len": num_valid / num_endpoints if num_endpoints else 0.0,
        "group/threshold": float(threshold),
        "group/efficiency_gain": num_valid / num_endpoints if num_endpoints else 0.0,
    }


def compute_group_ppo_advantages(
    token_level_rewards,
    values,
    mask,
    outcome_advantages,
    threshold,
    max_group_size,
    gamma=1.0,
    lam=0.95,
    eps=1e-6,
    advantage_norm="whiten",
    prompt_ids=None,
    norm_by_std=True,
):
    """Group-PPO advantages: GAE, Algorithm 2 grouping, segment means, then (optionally) a per-prompt baseline.

    ::

        A, returns = compute_gae_advantages(token_level_rewards, values, mask, gamma, lam)   # whitened over the batch
        endpoint_mask, group_ids = find_group_endpoints(A, outcome_advantages, mask, threshold, max_group_size, eps)
        segment_adv = segment_advantages(A, group_ids, mask)
        if advantage_norm == "group":       # per prompt group and step (group_normalize_step_advantages)
            segment_adv = (segment_adv - mean_g,t) / (std_g,t + 1e-6)

    advantage_norm "whiten" is Algorithm 2 as written (GAE's batch whitening only). "group" gives
    each prompt group its own baseline at every step, as GRPO does for outcome rewards: without it a
    segment advantage also carries how hard the prompt is, which the group shares and no action
    changed (docs/group_ppo.md).

    Args:
        token_level_rewards, values, mask: (B, T).
        outcome_advantages: (B,) or (B, T) grpo advantages of the same batch.
        advantage_norm: "whiten" or "group".
        prompt_ids: (B,) group keys, needed by "group".
        norm_by_std: "group" divides by the group std (False: subtracts the mean only, Dr.GRPO style).

    Returns:
        (segment_adv (B, T), returns (B, T), endpoint_mask (B, T) bool, group_ids (B, T) int64).
    """
    if advantage_norm not in ADVANTAGE_NORMS:
        raise ValueError(f"advantage_norm must be one of {list(ADVANTAGE_NORMS)}, got {advantage_norm!r}")
    if advantage_norm == "group" and prompt_ids is None:
        raise ValueError("advantage_norm='group' needs prompt_ids (the prompt group of each trajectory)")
    advantages, returns = compute_gae_advantages(token_level_rewards, values, mask, gamma=gamma, lam=lam)
    endpoint_mask, group_ids = find_group_endpoints(
        advantages, outcome_advantages, mask, threshold, max_group_size, eps=eps
    )
    segment_adv = segment_advantages(advantages, group_ids, mask)
    if advantage_norm == "group":
        segment_adv = group_normalize_step_advantages(segment_adv, prompt_ids, mask, norm_by_std=norm_by_std)
    return segment_adv, returns, endpoint_mask, group_ids


@register_adv_est("group_ppo", needs_values=True, needs_outcome_advantages=True, defines_endpoints=True)
def group_ppo_estimator(
    *,
    rewards=None,
    prompt_ids=None,
    mask,
    token_level_rewards=None,
    values=None,
    config=None,
    **options,
):
    """Registry adapter of compute_group_ppo_advantages; returns (segment_adv, returns).

    Options (explicit keyword > attribute/key of ``config`` > default):
    ``threshold`` (else ``variance_threshold``, 1.0; pass the AdaptiveThreshold's current
    value explicitly), ``max_group_size`` (16), ``eps`` (1e-6), ``gamma`` (1.0),
    ``lam`` (0.95), ``norm_by_std`` (True, for the outcome advantages and the "group" norm),
    ``advantage_norm`` ("whiten" or "group", see compute_group_ppo_advantages),
    ``outcome_advantages`` ((B,) or (B, T); computed with grpo from ``rewards`` and
    ``prompt_ids`` when absent) and ``info``: a dict that receives ``endpoint_mask`` and
    ``group_ids``.
    """
    if values is None:
        raise ValueError("advantage estimator 'group_ppo' needs `values` (critic values); got None")
    if token_level_rewards is None:
        if rewards is None:
            raise ValueError("advantage estimator 'group_ppo' needs `rewards` or `token_level_rewards`; got None")
        token_level_rewards = token_level_rewards_from_outcome(rewards, mask)
    outcome_advantages = options.get("outcome_advantages")
    if outcome_advantages is None:
        if prompt_ids is None:
            raise ValueError(
                "advantage estimator 'group_ppo' needs `prompt_ids` (or the option outcome_advantages); got None"
            )
        if rewards is None:
            rewards = token_level_rewards.sum(dim=-1)
        outcome_advantages, _ = compute_grpo_advantages(
            rewards,
            prompt_ids,
            mask,
            norm_by_std=bool(estimator_option("norm_by_std", options, config, True)),
            eps=float(estimator_option("eps", options, config, 1e-6)),
        )
    threshold = options["threshold"] if "threshold" in options else estimator_option("variance_threshold", {}, config, 1.0)
    segment_adv, returns, endpoint_mask, group_ids = compute_group_ppo_advantages(
        token_level_rewards,
        values,
        torch.as_tensor(mask),
        outcome_advantages,
        threshold,
        estimator_option("max_group_size", options, config, 16),
        gamma=float(estimator_option("gamma", options, config, 1.0)),
        lam=float(estimator_option("lam", options, config, 0.95)),
        eps=float(estimator_option("eps", options, config, 1e-6)),
        advantage_norm=estimator_option("advantage_norm", options, config, "whiten"),
        prompt_ids=prompt_ids,
        norm_by_std=bool(estimator_option("norm_by_std", options, config, True)),
    )
    info = options.get("info")
    if info is not None:
        info.update(endpoint_mask=endpoint_mask, group_ids=group_ids)
    return segment_adv, returns


@register_config_check("advantages")
def check_group_ppo(config, machine):
    """config.group_ppo: the variance thresholds in order, the group size, the normalisation, the compression."""
    gp = config.group_ppo
    if not gp.min_threshold <= gp.variance_threshold <= gp.max_threshold:
        raise ConfigError(
            f"config.group_ppo.variance_threshold={gp.variance_threshold} must lie in "
            f"[group_ppo.min_threshold={gp.min_threshold}, group_ppo.max_threshold={gp.max_threshold}]"
        )
    check_positive(gp.min_threshold, "group_ppo.min_threshold")
    check_positive(gp.max_group_size, "group_ppo.max_group_size")
    check_choice(gp.advantage_norm, ADVANTAGE_NORMS, "group_ppo.advantage_norm")
    if not 0.0 <= gp.target_compression < 1.0:
        raise ConfigError(f"config.group_ppo.target_compression={gp.target_compression} must be in [0, 1)")
