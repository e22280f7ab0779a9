"""Critic designs beside the learned ValueNetwork (issue 35, docs/critic.md): the Tweedie anchor, the anchor
plus a learned residual, and a critic lambda of its own (value pre-training on Monte-Carlo returns).

`config.critic.kind` says what V(x_t) is:

    "network"          V = ValueNetwork(x_t, t, c) (critic.py), trained on the returns: today's critic.
    "anchor"           V(x_t) = R(decode(x0_hat(x_t)), c): the reward of the one-step prediction of the clean
                       sample, no learning. For DDIM (Tweedie) x0_hat = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t)
                       (v- and x0-prediction: the scheduler's equivalents), from the model call sampling made.
                       Cost per step it is used at: one VAE decode and one reward call.
    "anchor_residual"  V = anchor + ValueNetwork(x_t, t, c); the network regresses returns - anchor (it starts
                       at 0, so V starts as the anchor).

`config.critic.lam` (negative: `algorithm.lam`) is the GAE lambda of the critic's regression targets, apart
from the actor's `algorithm.lam`: VC-PPO / VAPO pre-train the value on Monte-Carlo returns (critic.lam = 1,
gamma 1: every step's target is the trajectory's reward) while the actor's advantages use a smaller lambda.
Value pre-training before the actor moves is `critic.warmup_epochs` value-only epochs (their rollouts are the
reference policy's: the actor has not moved) with critic.lam = 1.

The anchor reads x0_hat from the model call sampling already made: the trainer samples with
``keep_x0_hat=True`` when critic.kind is not "network" or the advantage estimator ``needs_step_rewards``
(Trajectories.x0_hat, (B, T, C, h, w)); a batch without it (e.g. one of scripts) costs one more model call per step.
Any family whose ``anchor_refusal`` is None has an anchor (ddpo_group/diffusion/base.py): DDIM's Tweedie x0_hat
(SD 1.x/2.x, SDXL) and the flow families' x0_hat = x_t - sigma v (SD3, FLUX, Qwen-Image, Wan); the editing
families are refused (their rewards read the source image, which the anchor's reward calls do not pass).

The same machinery gives the step rewards of ``algorithm.adv_estimator="step_gain"`` (ddpo_group/algos/step_gain.py):
r[:, k] = R(decode(x0_hat(x_k))) at every step k (epoch_advantages.EpochAdvantages.step_rewards).
"""

import torch

from ddpo_group.algos.advantages import get_adv_estimator
from ddpo_group.config.registry import ConfigError, register_config_check
from ddpo_group.diffusion.ddim import ddim_x0_hat

__all__ = ["CRITIC_KINDS", "check_critic_config", "critic_lambda", "ddim_x0_hat", "anchor_values", "keeps_x0_hat",
           "anchor_refusal", "critic_returns", "critic_targets"]

CRITIC_KINDS = ("network", "anchor", "anchor_residual")


def anchor_refusal(family):
    """Why the anchor cannot score the steps of the model family named `family` (its class's ``anchor_refusal``), or
    None when it can, or when no family of that name is registered (nothing to check). A registered family that does
    not set the attribute inherits the base's refusal (it has no ``predict_x0`` / ``decode``)."""
    from ddpo_group.diffusion.policy import FAMILIES  # imports every built-in family, so that each is registered

    cls = FAMILIES.get(family)
    return None if cls is None else cls.anchor_refusal


def check_critic_config(config, needs_values, family=None, needs_step_rewards=False):
    """ConfigError naming the field for a critic design that cannot run. `needs_values`: whether the advantage
    estimator reads a critic; `needs_step_rewards`: whether it reads the anchor's step rewards (step_gain);
    `family`: the model family's name when known (the anchor needs a family with one: ``anchor_refusal``)."""
    critic = config.critic
    kind = critic.get("kind", "network")
    if kind not in CRITIC_KINDS:
        raise ConfigError(f"config.critic.kind={kind!r} is not one of {list(CRITIC_KINDS)}")
    lam = critic.get("lam", -1.0)
    if not (lam < 0 or 0.0 <= lam <= 1.0):
        raise ConfigError(f"config.critic.lam={lam} must lie in [0, 1] (or be negative: algorithm.lam)")
    if not needs_values and (kind != "network" or lam >= 0):
        field = "kind" if kind != "network" else "lam"
        raise ConfigError(
            f"config.critic.{field}={critic[field]!r} needs an estimator with a critic (algorithm.adv_estimator "
            f"'gae' or 'group_ppo'), not {config.algorithm.adv_estimator!r}"
        )
    if kind == "anchor" and critic.warmup_epochs:
        raise ConfigError(
            f"config.critic.warmup_epochs={critic.warmup_epochs}: critic.kind='anchor' learns nothing to warm up; "
            "set critic.warmup_epochs=0 or critic.kind='anchor_residual'"
        )
    refusal = anchor_refusal(family) if family is not None else None
    if kind != "network" and refusal:
        raise ConfigError(
            f"config.critic.kind={kind!r} decodes each step's one-step prediction x0_hat; the {family} family has "
            f"no anchor ({refusal}): use critic.kind='network'"
        )
    if needs_step_rewards and refusal:
        raise ConfigError(
            f"config.algorithm.adv_estimator={config.algorithm.adv_estimator!r} scores each step's decoded one-step "
            f"prediction x0_hat; the {family} family has no anchor ({refusal}): use algorithm.adv_estimator='grpo'"
        )


@register_config_check("critic")
def check_critic_design(config, machine):
    """`check_critic_config` before any model loads (the family's part, the anchor, is checked once the model is
    known: training/models.py)."""
    estimator = get_adv_estimator(config.algorithm.adv_estimator)
    check_critic_config(config, estimator.needs_values, needs_step_rewards=estimator.needs_step_rewards)


def keeps_x0_hat(config):
    """Whether sampling should keep each step's x0_hat (Trajectories.x0_hat): an anchor critic or an estimator that
    needs_step_rewards reads it."""
    needs_step_rewards = get_adv_estimator(config.algorithm.adv_estimator).needs_step_rewards
    return config.critic.get("kind", "network") != "network" or needs_step_rewards


def critic_lambda(config):
    """The GAE lambda of the critic's targets: critic.lam, or algorithm.lam when it is negative."""
    lam = config.critic.get("lam", -1.0)
    return config.algorithm.lam if lam < 0 else lam


def decode_latents(pipeline, latents):
    """Images in [0, 1] (B, 3, H, W) float32 from SD latents, as sampling decodes x_T (scripts' helper; the anchor
    decodes through the family's own ``policy.decode``)."""
    vae = pipeline.vae
    images = vae.decode((latents / vae.config.scaling_factor).to(vae.dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def anchor_values(policy, model, batch, reward_fn, prompts, metadata, guidance_scale, steps=None, micro_batch_size=None):
    """V_anchor (B, T) float32: at each step k of `steps` (default every step), the reward of the decoded x0_hat of
    the stored x_k; 0 at the other steps.

        V[i, k] = R(policy.decode(x0_hat(x_k)_i), c_i)

    x0_hat: DDIM's Tweedie prediction (x_k - sqrt(1 - abar_k) eps) / sqrt(abar_k) (the scheduler's equivalents for
    v- and x0-prediction), or a flow family's x_k - sigma_k v(x_k) (sigma_k from batch.sigmas).

    policy: a DiffusionPolicy with an anchor (``anchor_refusal`` None); model: its denoising module (the sampling
    weights); batch: a Trajectories / EpochBatch with latents (B, T+1, C, ...), timesteps (B, T), the conditioning
    (and, for a flow family, sigmas (B, T+1)) and, when sampling kept them, x0_hat (B, T, C, ...); reward_fn: a
    CombinedReward (its total is the value); prompts, metadata: B each. Cost per step used: one decode and one
    reward call on B images, and one model call (``policy.predict_x0``) when the batch has no stored x0_hat.
    """
    B, T = batch.timesteps.shape
    steps = range(T) if steps is None else steps
    chunk = micro_batch_size or B
    values = torch.zeros(B, T, dtype=torch.float32)
    stored = getattr(batch, "x0_hat", None)
    for k in steps:
        for start in range(0, B, chunk):
            rows = torch.arange(start, min(B, start + chunk), device=batch.latents.device)
            if stored is not None:  # the prediction sampling made (keep_x0_hat): no model call
                x0 = stored[rows, k]
            else:
                x0 = policy.predict_x0(model, batch, rows, k, guidance_scale)
            images = policy.decode(x0)
            idx = rows.tolist()
            total = reward_fn(images, [prompts[i] for i in idx], [metadata[i] for i in idx])[0]
            values[start : start + len(idx), k] = torch.as_tensor(total, dtype=torch.float32)
    return values.to(batch.latents.device)


@torch.no_grad()
def critic_returns(rewards, values, mask, gamma, lam):
    """The critic's regression targets (B, T) with its own lambda: GAE returns A + V of compute_gae_advantages
    (the reward at each trajectory's last valid step); with gamma = lam = 1 every valid step's target is R_i."""
    from ddpo_group.algos.advantages import compute_gae_advantages, token_level_rewards_from_outcome

    return compute_gae_advantages(token_level_rewards_from_outcome(rewards, mask), values, mask, gamma=gamma, lam=lam)[1]


def critic_targets(returns, old_values, anchor):
    """What the learned part of the critic regresses: (returns, old values) for kind "network" (anchor None), and
    (returns - anchor, old values - anchor) for "anchor_residual" (the network is the residual)."""
    if anchor is None:
        return returns, old_values
    return returns - anchor, old_values - anchor
