"""Per-step credit from the predicted outcome: the step reward gain, registered as the estimator "step_gain".

Stepwise-Flow-GRPO and DenseGRPO give each denoising step a dense reward: how much the step improved the
reward of the clean sample predicted from its state. With the step rewards

    r[i, k] = R(decode(x0_hat(x_k)), c_i)   k = 0 .. T-1   (the reward of step k's one-step prediction)
    r[i, T] = R_i                                          (the final sample's reward)

the gain of step k (the transition x_k -> x_{k+1}) is

    g[i, k] = r[i, k+1] - r[i, k],          so  sum_k g[i, k] = R_i - r[i, 0]  (the gains telescope),

and the advantage is GRPO's per-prompt normalisation applied step by step to the gains
(``group_normalize_step_advantages``): for each step k and each group of trajectories with the same prompt,
over those with mask[i, k] = 1,

    A[i, k] = (g[i, k] - mean_g,k) / (std_g,k + eps)     (norm_by_std=True; population std)
    A[i, k] =  g[i, k] - mean_g,k                        (norm_by_std=False)

with mean 0 and std 1 for a group with one valid trajectory at k, and A = 0 where mask is 0. A step without a
density (mask 0, e.g. an ODE step outside the SDE window) still moves the prediction; its gain is computed
and dropped, never credited to a neighbour.

What is implemented, exactly: the prediction x0_hat is the one-step prediction of the sampling model call (DDIM's
Tweedie formula, a flow model's x_k - sigma_k v), not a multi-step ODE completion to the clean sample; the
gains are not discounted, not mixed with the outcome advantage, and normalised per step within prompt groups as
above. The papers' own choices of predictor and normalisation may differ; their text was not available when
this was written, so this module states only its own formula.

Pure math: (B, T) tensors in, (B, T) tensors out, no trainer, no I/O. The trainer provides `step_rewards`
(the estimator's property ``needs_step_rewards``; ddpo_group/training/epoch_advantages.py).
"""

from typing import Any

import torch

from ddpo_group.algos.advantages import (
    _check_mask,
    _check_rewards,
    _check_same_shape,
    _float_dtype,
    _outcome_rewards,
    _require,
    estimator_option,
    group_normalize_step_advantages,
    register_adv_est,
)

__all__ = ["step_reward_gains", "compute_step_gain_advantages", "step_gain_estimator"]


@torch.no_grad()
def step_reward_gains(step_rewards: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """The gain of each step in the predicted outcome's reward.

    g[i, k] = r[i, k+1] - r[i, k] for k < T-1, and g[i, T-1] = R_i - r[i, T-1], with r = step_rewards.
    Row sums: sum_k g[i, k] = R_i - r[i, 0].

    Args:
        step_rewards: (B, T) r[i, k], the reward of step k's decoded one-step prediction.
        rewards: (B,) R_i, the final samples' rewards.

    Returns:
        (B, T) gains, the floating dtype of the inputs (promoted).
    """
    step_rewards = _as_step_rewards(step_rewards)
    rewards = _check_rewards(rewards, step_rewards.shape[0])
    dtype = _float_dtype(step_rewards, rewards)
    final = rewards.to(device=step_rewards.device, dtype=dtype)[:, None]
    after = torch.cat([step_rewards[:, 1:].to(dtype), final], dim=1)
    return after - step_rewards.to(dtype)


@torch.no_grad()
def compute_step_gain_advantages(
    step_rewards: torch.Tensor,
    rewards: torch.Tensor,
    prompt_ids: Any,
    mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-gain advantages (module docstring): A = group_normalize_step_advantages(g, prompt_ids, mask).

    Args:
        step_rewards: (B, T) r[i, k] = R(decode(x0_hat(x_k))), finite.
        rewards: (B,) final rewards R_i, finite.
        prompt_ids: (B,) group keys (int64 tensor, numpy array or list of hashables).
        mask: (B, T) 1 on steps with a density.
        norm_by_std: divide by the per-step group std (True) or only subtract the group mean (False).
        eps: added to the std.

    Returns:
        (advantages (B, T), returns (B, T)), the same values (critic-free, as grpo), 0 where mask is 0.
    """
    mask = _check_mask(mask)
    step_rewards = _check_same_shape(_as_step_rewards(step_rewards), mask, "step_rewards")
    gains = step_reward_gains(step_rewards, rewards)
    advantages = group_normalize_step_advantages(gains, prompt_ids, mask.to(gains.device), norm_by_std=norm_by_std,
                                                 eps=eps)
    return advantages, advantages.clone()


def _as_step_rewards(step_rewards: Any) -> torch.Tensor:
    step_rewards = torch.as_tensor(step_rewards)
    if step_rewards.dim() != 2 or step_rewards.shape[0] == 0 or step_rewards.shape[1] == 0:
        raise ValueError(f"step_rewards must have shape (B, T) with B, T >= 1, got {tuple(step_rewards.shape)}")
    if not step_rewards.dtype.is_floating_point:
        step_rewards = step_rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(step_rewards).all()):
        raise ValueError("step_rewards contains NaN or inf; every step reward must be finite")
    return step_rewards


@register_adv_est("step_gain", needs_step_rewards=True)
def step_gain_estimator(
    *,
    rewards=None,
    prompt_ids=None,
    mask,
    token_level_rewards=None,
    values=None,
    config=None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Registry adapter of compute_step_gain_advantages. Options: step_rewards (B, T), required (the trainer
    passes them: the property needs_step_rewards), norm_by_std (True), eps (1e-6). Uses `rewards`, or the row
    sums of `token_level_rewards` when `rewards` is None."""
    step_rewards = _require(estimator_option("step_rewards", options, config, None), "step_rewards", "step_gain")
    return compute_step_gain_advantages(
        step_rewards,
        _require(_outcome_rewards(rewards, token_level_rewards, mask), "rewards", "step_gain"),
        _require(prompt_ids, "prompt_ids", "step_gain"),
        mask,
        norm_by_std=bool(estimator_option("norm_by_std", options, config, True)),
        eps=float(estimator_option("eps", options, config, 1e-6)),
    )
