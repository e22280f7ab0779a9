"""Preference objectives on the forward process: DGPO and Diffusion-DPO (docs/forward.md).

Both train, like DiffusionNFT and AWM (``ddpo_group.algos.forward``), on clean samples x_0 with the family's
matching loss at one (t, eps): the family noises x_0 to x_t and states its target (eps for SD 1.x/2.x, the
velocity eps - x_0 for flow matching), so the code here never names a family. Their implicit reward of a
sample is the matching loss's improvement over a frozen reference model pi_ref at the same (x_t, t, eps):

    D(x) = ||prediction - target||^2 - ||reference prediction - target||^2      (mean over dims; (B,))

(lower is better: D < 0 where the policy denoises x better than the reference). By the diffusion ELBO,
log pi_theta(x) / pi_ref(x) is -T w(t) E_t,eps[D(x)] up to a constant (Wallace et al., 2023, sec. 4), and
both objectives put that in place of DPO's log-ratio, with Jensen's inequality moving E_t,eps outside the
log-sigmoid (one (t, eps) per sample or pair per evaluation here).

Diffusion-DPO (Wallace et al., 2023, arXiv 2311.12908, eq. 14; flow-matching form: the velocity and its
target in place of eps), a preferred sample x_w and a dispreferred x_l of the same prompt, the same t and eps:

    L_dpo = -log sigmoid( -beta/2 * (D(x_w) - D(x_l)) )

``beta`` here is the paper's beta T w(lambda_t) as one constant (its released code's ``beta_dpo``, 5000 for SD 1.5
and SDXL; w = 1); the 1/2 is the released code's. With pi_theta = pi_ref, D = 0: the loss is log 2 and its
gradient is beta/4 * grad(||pred_w - target_w||^2 - ||pred_l - target_l||^2): denoise the winner better, the
loser worse, with equal weight (the sigmoid's 1/2).

DGPO (Luo, Hu and Tang, 2025, arXiv 2510.08425: Direct Group Preference Optimization). A group G of samples
of one prompt with GRPO's advantages A (which sum to 0 over the group) splits into a positive group (A > 0)
and a negative one (A < 0), each sample weighted by |A|; the group-level Bradley-Terry preference of the
positive over the negative group, with DPO's implicit reward beta log pi_theta / pi_ref, is

    R(G+) - R(G-) = sum_{x in G} A(x) beta log pi_theta(x) / pi_ref(x)

(the partition function's beta log Z(c) is multiplied by sum A = 0 and cancels: why the weights are the
advantages). With the ELBO as above and the weights averaged over the group (as the reference code,
Luo-Yihong/DGPO, does), per group:

    u     = beta / |G| * sum_{i in G} A_i D(x_i)
    L_dgpo = -log sigmoid(-u) / beta = softplus(u) / beta

divided by beta as DiffusionNFT's loss is here, so that the gradient's scale does not grow with beta: its
gradient is sigmoid(u) / |G| * sum_i A_i grad ||prediction_i - target_i||^2, which is the reference code's
(there beta only sharpens the group's sigmoid weight). At pi_theta = pi_ref (u = 0) the loss is log 2 / beta
and the gradient is half of advantage-weighted matching's on-policy one, (1 / 2|G|) sum_i A_i grad ||...||^2.

Pure math: no trainer, no I/O; every loss is float32 or wider.
"""

import torch
import torch.nn.functional as F

from ddpo_group.algos.forward import squared_error

__all__ = ["reference_gap", "diffusion_dpo_loss", "dgpo_clip_mask", "dgpo_loss"]


def reference_gap(prediction, reference_prediction, target):
    """D = ||prediction - target||^2 - ||reference_prediction - target||^2 per sample, (B,) (the reference detached)."""
    return squared_error(prediction, target) - squared_error(reference_prediction.detach(), target)


def diffusion_dpo_loss(prediction_w, reference_w, target_w, prediction_l, reference_l, target_l, beta):
    """Diffusion-DPO's loss of each pair, (P,): -log sigmoid(-beta/2 (D(x_w) - D(x_l))) (module docstring).

    Args:
        prediction_w, prediction_l: (P, ...) the policy's outputs on the noised winner / loser, with their graph.
        reference_w, reference_l: (P, ...) the frozen reference's outputs on the same inputs.
        target_w, target_l: (P, ...) the family's targets (eps, or the velocity eps - x_0).
        beta: > 0, the paper's beta T w(lambda_t) (its released code's beta_dpo).
    """
    if not beta > 0:
        raise ValueError(f"beta (Diffusion-DPO's beta T) must be > 0, got {beta}")
    gap = reference_gap(prediction_w, reference_w, target_w) - reference_gap(prediction_l, reference_l, target_l)
    return F.softplus(0.5 * beta * gap)  # -log sigmoid(-x) = softplus(x)


def dgpo_clip_mask(prediction, old_prediction, target, advantages, clip_range):
    """The samples whose matching loss left DGPO's trust region around the sampling model, (B,) bool.

    The reference code's PPO-style clip (Luo-Yihong/DGPO; not part of the paper's loss): with the ratio
    rho = exp(||old - target||^2 - ||prediction - target||^2) of the surrogate likelihoods (AWM's), a sample
    with A > 0 is clipped once rho > 1 + clip_range, one with A < 0 once rho < 1 - clip_range: it has moved far
    enough the way its advantage asks. Its matching loss then carries no gradient (``dgpo_loss(clipped=...)``).
    """
    with torch.no_grad():
        ratio = torch.exp(squared_error(old_prediction, target) - squared_error(prediction, target))
        return torch.where(advantages.to(ratio.device) > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


def dgpo_loss(prediction, reference_prediction, target, advantages, groups, beta, clipped=None):
    """DGPO's loss of each group, (G,): softplus(beta / |g| sum_{i in g} A_i D(x_i)) / beta (module docstring).

    Args:
        prediction: (B, ...) the policy's outputs with their graph; reference_prediction, target: (B, ...).
        advantages: (B,) the samples' outcome advantages (GRPO's: they sum to 0 over each whole group).
        groups: (B,) int64 group index of each row, 0 .. G-1 (every index used).
        beta: > 0, DGPO's beta (the reference code's beta_dpo).
        clipped: optional (B,) bool, the rows whose matching loss is detached (``dgpo_clip_mask``): the value is
            unchanged, their gradient 0.
    """
    if not beta > 0:
        raise ValueError(f"beta (DGPO's beta) must be > 0, got {beta}")
    error = squared_error(prediction, target)
    if clipped is not None:
        error = torch.where(clipped.to(error.device), error.detach(), error)
    gap = error - squared_error(reference_prediction.detach(), target)
    groups = groups.to(gap.device)
    num_groups = int(groups.max()) + 1
    sizes = torch.bincount(groups, minlength=num_groups).to(gap.dtype)
    weighted = advantages.to(gap.dtype) * gap
    sums = torch.zeros(num_groups, dtype=gap.dtype, device=gap.device).index_add(0, groups, weighted)
    return F.softplus(beta * sums / sizes) / beta
