"""Forward-process objectives: RL on the noising process, no reverse-step log-probabilities (docs/forward.md).

Both methods train on clean samples x_0 of the sampling (old) policy pi_old, with their
outcome advantages A (grpo, per prompt group). A training "token" is a (sample, t, eps)
triple: the family noises x_0 to x_t with its forward process and states its training target
(``policy.training_target``: eps for SD 1.x/2.x, the velocity eps - x_0 for flow matching), so the
code here is family-free. `prediction` is the model's output for x_t, `old_prediction` the same
output of pi_old (no gradient), `target` the family's target; every tensor (B, ...) and the
squared errors averaged over the non-batch dimensions.

DiffusionNFT (Zheng et al., 2025, arXiv 2509.16117: its training objective over the implicit
positive and negative policies, the one loss of the method):

    v_plus  = (1 - beta) * v_old + beta * v_theta
    v_minus = (1 + beta) * v_old - beta * v_theta

and the optimality probability r in [0, 1] of each sample,

    L_nft = E[ r * ||v_plus - v||^2 + (1 - r) * ||v_minus - v||^2 ] / beta

(the paper's loss divided by beta, as its reference code does, so that the gradient's scale does
not vanish with beta). r comes from the group-normalised advantage as in the reference code:
r = clip(A / (2 adv_clip_max) + 1/2, 0, 1). With r = 1/2 everywhere (no signal) the loss is
||v_old - v||^2 / beta + beta ||v_theta - v_old||^2: its gradient is 0 at theta = theta_old and
pulls back towards pi_old elsewhere; the per-sample optimum is
v_old + (2r - 1)(v - v_old) / beta (``nft_loss``'s docstring derives both).

Advantage-weighted matching (AWM; Xue et al., 2025, arXiv 2509.25050): the score /
flow-matching loss as a surrogate log-likelihood of the clean sample,

    log q_theta(x_0 | t, eps) = - ||prediction - target||^2   (mean over dims)

in PPO's clipped ratio with the sample's advantage, so that on-policy its gradient is
A * grad ||prediction - target||^2 with the sign that lowers the loss of good samples and raises
that of bad ones. The ratio's denominator is the same quantity under pi_old with the same
(t, eps) (the trainer recomputes it before the first optimizer step).

Weighting of a squared error (``weighted_error``; both methods; ``x0_scale`` c (B,) is the family's factor
with x0_hat - x_0 = -c (prediction - target): sigma for flow matching, sqrt((1 - abar) / abar) for eps):

    "uniform"   ||prediction - target||^2, the papers' equations in the family's target space
    "x0"        c^2 ||prediction - target||^2 = ||x0_hat - x_0||^2 (AWM's "t**2" weighting for flow models)
    "adaptive"  ||x0_hat - x_0||^2 / sg(mean |x0_hat - x_0|), DiffusionNFT's reference code (its adaptive
                loss weighting; the denominator is clamped at 1e-5 and carries no gradient)

Pure math: no trainer, no I/O.
"""

import torch

from ddpo_group.config.registry import ConfigError, check_choice, check_positive, register_config_check

__all__ = ["WEIGHTINGS", "nft_optimality", "nft_loss", "matching_log_prob", "squared_error", "weighted_error"]

WEIGHTINGS = ("uniform", "x0", "adaptive")


def squared_error(prediction, target):
    """||prediction - target||^2 averaged over the non-batch dimensions: (B,), float32 or wider."""
    dtype = torch.promote_types(prediction.dtype, torch.float32)
    diff = prediction.to(dtype) - target.to(dtype)
    return diff.pow(2).flatten(1).mean(dim=1)


def weighted_error(prediction, target, x0_scale=None, weighting="uniform"):
    """The squared error of each sample under `weighting` (module docstring), (B,) float32 or wider.

    x0_scale: (B,) the family's c (``policy.forward_noise``); needed unless weighting is "uniform".
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if weighting == "uniform":
        return squared_error(prediction, target)
    if x0_scale is None:
        raise ValueError(f"weighting={weighting!r} needs x0_scale (the family's x0 factor)")
    dtype = torch.promote_types(prediction.dtype, torch.float32)
    c = x0_scale.to(dtype)
    error = squared_error(prediction, target) * c**2  # ||x0_hat - x_0||^2, mean over dims
    if weighting == "x0":
        return error
    diff = (prediction.to(dtype) - target.to(dtype)).detach()
    scale = (diff.abs().flatten(1).mean(dim=1) * c.abs()).clamp(min=1e-5)
    return error / scale


def nft_optimality(advantages, adv_clip_max):
    """r = clip(A / (2 * adv_clip_max) + 1/2, 0, 1): A = +-adv_clip_max maps to 1 / 0, A = 0 to 1/2. (B,)"""
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    return (advantages / (2.0 * adv_clip_max) + 0.5).clamp(0.0, 1.0)


def nft_loss(prediction, old_prediction, target, optimality, beta, x0_scale=None, weighting="uniform"):
    """DiffusionNFT's loss of each sample, (B,) (module docstring).

        plus  = beta * prediction + (1 - beta) * old_prediction
        minus = (1 + beta) * old_prediction - beta * prediction
        loss  = (r * ||plus - target||^2 + (1 - r) * ||minus - target||^2) / beta

    With d = prediction - old_prediction and e = old_prediction - target: plus - target = e + beta d,
    minus - target = e - beta d, so for r = 1/2 the loss is (||e||^2 + beta^2 ||d||^2) / beta, whose
    gradient in the prediction, 2 beta d, vanishes at the old policy: a group without signal moves
    nothing. In general the gradient at d = 0 is 2 (2r - 1) e: towards the target for r > 1/2, away
    from it for r < 1/2, as the positive / negative split says.

    Args:
        prediction: (B, ...) the trained model's output, with its graph.
        old_prediction: (B, ...) pi_old's output on the same input (no graph needed).
        target: (B, ...) the family's training target.
        optimality: (B,) r in [0, 1].
        beta: float in (0, 1].
        x0_scale, weighting: how each of the two squared errors is weighted (``weighted_error``); the
            default is the paper's equation.
    """
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta (the NFT guidance strength) must be in (0, 1], got {beta}")
    old_prediction = old_prediction.detach()
    plus = beta * prediction + (1.0 - beta) * old_prediction
    minus = (1.0 + beta) * old_prediction - beta * prediction
    r = optimality.to(torch.promote_types(prediction.dtype, torch.float32))
    positive = weighted_error(plus, target, x0_scale, weighting)
    negative = weighted_error(minus, target, x0_scale, weighting)
    return (r * positive + (1.0 - r) * negative) / beta


def matching_log_prob(prediction, target, x0_scale=None, weighting="uniform"):
    """AWM's surrogate log-likelihood of a clean sample at one (t, eps): -||prediction - target||^2 (weighted), (B,)."""
    return -weighted_error(prediction, target, x0_scale, weighting)


# train.objective: the reverse-process update (training/stepwise_update.py) or the forward-process ones (this module).
OBJECTIVES = ("stepwise", "nft", "awm", "dgpo", "dpo")  # dgpo, dpo: algos/preference.py


@register_config_check("algorithm")
def check_objective(config, machine):
    """config.train.objective is known; the forward-process objectives (nft, awm, dgpo, dpo): what they use, and what
    they cannot."""
    from ddpo_group.algos.advantages import get_adv_estimator
    from ddpo_group.algos.losses import get_policy_loss

    train, forward = config.train, config.forward
    check_choice(train.objective, OBJECTIVES, "train.objective")
    if train.objective == "stepwise":
        return
    objective = f"config.train.objective={train.objective!r}"
    estimator = get_adv_estimator(config.algorithm.adv_estimator)
    if estimator.needs_values:
        raise ConfigError(
            f"{objective} trains on outcome advantages; algorithm.adv_estimator={config.algorithm.adv_estimator!r} "
            "needs a critic over reverse-process steps: use grpo, rloo or ddpo"
        )
    if estimator.needs_step_rewards:
        raise ConfigError(
            f"{objective} trains on outcome advantages; algorithm.adv_estimator={config.algorithm.adv_estimator!r} "
            "credits the reverse-process steps, which this objective does not keep: use grpo, rloo or ddpo"
        )
    if train.objective == "awm" and get_policy_loss(train.policy_loss).couples_steps:
        raise ConfigError(
            f"config.train.policy_loss={train.policy_loss!r} couples the steps of a trajectory; AWM's ratio is one "
            "per (sample, timestep): use train.policy_loss='vanilla'"
        )
    if train.skip_last_steps:
        raise ConfigError(f"config.train.skip_last_steps applies to train.objective='stepwise'; {objective}: set it to 0")
    check_choice(forward.weighting, WEIGHTINGS, "forward.weighting")
    check_positive(forward.num_timesteps, "forward.num_timesteps", allow_zero=True)
    if forward.num_timesteps > config.sample.num_steps:
        raise ConfigError(
            f"config.forward.num_timesteps={forward.num_timesteps} exceeds the sampling grid's sample.num_steps="
            f"{config.sample.num_steps}; use at most {config.sample.num_steps} (0: all)"
        )
    if not 0.0 < forward.nft_beta <= 1.0:
        raise ConfigError(f"config.forward.nft_beta={forward.nft_beta} must be in (0, 1] (DiffusionNFT's beta)")
    check_positive(forward.old_decay_rate, "forward.old_decay_rate", allow_zero=True)
    if not 0.0 <= forward.old_decay_max < 1.0:
        raise ConfigError(
            f"config.forward.old_decay_max={forward.old_decay_max} must be in [0, 1): at 1 the sampling model "
            "would never follow the policy"
        )
