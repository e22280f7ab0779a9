"""Value network V(x_t, t, c) for GAE and Group-PPO (docs/design.md §3, §4).

A small critic beside the UNet: it sees the noisy latent x_t of a denoising step, the
scheduler timestep t and the prompt embedding c, and predicts the final reward.

    h_x = AvgPool(SiLU(GN(Conv(...SiLU(GN(Conv(x_t)))))))       (B, hidden)
    h_t = MLP(sinusoidal(t))                                    (B, hidden)
    h_c = Linear(mean_tokens(c))                                (B, hidden)
    V   = Linear_0(SiLU(Linear([h_x, h_t, h_c])))               (B,)

The output layer is zero-initialised, so V = 0 before training (GAE then starts as
Monte Carlo returns). `update_critic` is the critic phase of a training epoch.
"""

import time

import numpy as np
import torch
from diffusers.models.embeddings import get_timestep_embedding
from torch import nn

from ddpo_group.algos.losses import compute_value_loss
from ddpo_group.config.registry import ConfigError, check_choice, check_positive, register_config_check

__all__ = ["ValueNetwork", "compute_values", "num_parameters"]


def num_parameters(module, trainable_only=False):
    """Number of parameters of ``module`` (only those with requires_grad if trainable_only)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def _group_norm(channels):
    num_groups = 8 if channels % 8 == 0 else 1
    return nn.GroupNorm(num_groups, channels)


class ValueNetwork(nn.Module):
    """V(x_t, t, c) -> (B,).

    Args:
        latent_channels: C of the latents (4 for Stable Diffusion).
        prompt_dim: D of the prompt embeddings (768 for SD 1.5's CLIP text encoder).
        hidden: width of the conv encoder and of the MLPs.
        time_embed_dim: size of the sinusoidal timestep embedding (even).
        num_conv_layers: conv layers of the latent encoder; all but the first halve h and w.
    """

    def __init__(self, latent_channels=4, prompt_dim=32, hidden=64, time_embed_dim=64, num_conv_layers=3):
        super().__init__()
        for name, value in [
            ("latent_channels", latent_channels),
            ("prompt_dim", prompt_dim),
            ("hidden", hidden),
            ("num_conv_layers", num_conv_layers),
        ]:
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if int(time_embed_dim) != time_embed_dim or time_embed_dim < 2 or time_embed_dim % 2:
            raise ValueError(f"time_embed_dim must be an even integer >= 2, got {time_embed_dim}")
        self.latent_channels = latent_channels
        self.prompt_dim = prompt_dim
        self.time_embed_dim = time_embed_dim

        layers = []
        in_channels = latent_channels
        for i in range(num_conv_layers):
            stride = 1 if i == 0 else 2
            layers += [nn.Conv2d(in_channels, hidden, 3, stride=stride, padding=1), _group_norm(hidden), nn.SiLU()]
            in_channels = hidden
        self.latent_encoder = nn.Sequential(*layers)
        self.time_mlp = nn.Sequential(nn.Linear(time_embed_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.prompt_proj = nn.Linear(prompt_dim, hidden)
        self.head = nn.Sequential(nn.Linear(3 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        nn.init.zeros_(self.head[-1].weight)
        nn.init.zeros_(self.head[-1].bias)

    def forward(self, latents, timesteps, prompt_embeds):
        """V(x_t, t, c).

        Args:
            latents: (B, C, h, w) noisy latents x_t; a video's (B, C', f, h, w) are read as (B, C' f, h, w), its
                frames stacked on the channels (latent_channels = C' f: ``critic_sizes`` of a video family).
            timesteps: (B,) or scalar scheduler timesteps.
            prompt_embeds: (B, L, D) token embeddings (mean-pooled over L here) or (B, D)
                already pooled.

        Returns:
            (B,) values.
        """
        if latents.dim() == 5:
            latents = latents.flatten(1, 2)
        if latents.dim() != 4 or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"latents must be (B, {self.latent_channels}, h, w), got {tuple(latents.shape)}"
            )
        B = latents.shape[0]
        if prompt_embeds.dim() == 3:
            prompt_embeds = prompt_embeds.mean(dim=1)
        if prompt_embeds.dim() != 2 or prompt_embeds.shape != (B, self.prompt_dim):
            raise ValueError(
                f"prompt_embeds must be (B, L, {self.prompt_dim}) or (B, {self.prompt_dim}) with B={B}, "
                f"got {tuple(prompt_embeds.shape)}"
            )
        timesteps = torch.as_tensor(timesteps, device=latents.device)
        if timesteps.dim() == 0:
            timesteps = timesteps.expand(B)
        if timesteps.shape != (B,):
            raise ValueError(f"timesteps must be a scalar or (B,) with B={B}, got {tuple(timesteps.shape)}")

        dtype = self.prompt_proj.weight.dtype
        h_x = self.latent_encoder(latents.to(dtype)).mean(dim=(2, 3))
        t_emb = get_timestep_embedding(timesteps, self.time_embed_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        h_t = self.time_mlp(t_emb.to(dtype))
        h_c = self.prompt_proj(prompt_embeds.to(dtype))
        return self.head(torch.cat([h_x, h_t, h_c], dim=1)).squeeze(1)


@torch.no_grad()
def compute_values(critic, latents, timesteps, prompt_embeds, micro_batch_size=None):
    """V(x_t, t, c) at every step of a batch of trajectories, without autograd.

    values[i, t] = critic(latents[i, t], timesteps[i, t], prompt_embeds[i]) for t < T
    (x_T, the final latent, has no step and no value).

    Args:
        critic: a ValueNetwork (or any module with its forward signature).
        latents: (B, T+1, C, h, w).
        timesteps: (B, T).
        prompt_embeds: (B, L, D) or (B, D).
        micro_batch_size: at most this many (trajectory, step) pairs per critic call;
            None evaluates all B*T at once.

    Returns:
        (B, T) float tensor on the device of ``latents``.
    """
    if latents.dim() not in (5, 6):
        raise ValueError(f"latents must be (B, T+1, C, h, w) or a video's (B, T+1, C, f, h, w), got {tuple(latents.shape)}")
    B, T_plus_1 = latents.shape[:2]
    T = T_plus_1 - 1
    if timesteps.shape != (B, T):
        raise ValueError(f"timesteps must be (B, T) = ({B}, {T}), got {tuple(timesteps.shape)}")
    if micro_batch_size is not None and (int(micro_batch_size) != micro_batch_size or micro_batch_size < 1):
        raise ValueError(f"micro_batch_size must be a positive integer or None, got {micro_batch_size}")
    if prompt_embeds.dim() == 3:
        prompt_embeds = prompt_embeds.mean(dim=1)  # pool once, not once per step

    flat_latents = latents[:, :T].reshape(B * T, *latents.shape[2:])
    flat_timesteps = timesteps.reshape(B * T)
    flat_prompts = prompt_embeds.repeat_interleave(T, dim=0)
    chunk = B * T if micro_batch_size is None else int(micro_batch_size)
    values = [
        critic(flat_latents[i : i + chunk], flat_timesteps[i : i + chunk], flat_prompts[i : i + chunk])
        for i in range(0, B * T, chunk)
    ]
    values = torch.cat(values) if values else latents.new_zeros(0)
    return values.reshape(B, T).to(latents.device)


def update_critic(critic, optimizer, samples, config, accelerator, epoch, metrics):
    """The critic phase of an epoch: config.critic.num_epochs passes of the clipped value loss over the steps of
    samples.critic_mask (the endpoints for group_ppo, every valid step for gae), micro-batches of
    train.batch_size trajectories; critic/value_loss, critic/clipfrac and time/critic into `metrics`."""
    acc = accelerator
    start = time.perf_counter()
    b_local = len(samples.prompts)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch * 101 + acc.process_index + 7)
    losses, clipfracs, skipped = [], [], 0
    critic.train()
    for _ in range(config.critic.num_epochs):
        perm = torch.randperm(b_local, generator=generator)
        for i in range(0, b_local, config.train.batch_size):
            rows = perm[i : i + config.train.batch_size].to(samples.latents.device)
            mask = samples.critic_mask[rows]
            r, s = mask.nonzero(as_tuple=True)
            latents = samples.latents[rows][r, s]
            values = critic(latents, samples.timesteps[rows][r, s], samples.prompt_embeds[rows][r].float())
            loss, clipfrac = compute_value_loss(
                values[None], samples.returns[rows][r, s][None], samples.old_values[rows][r, s][None],
                torch.ones_like(values)[None], config.critic.cliprange_value,
            )
            acc.backward(loss)
            acc.clip_grad_norm_(critic.parameters(), config.critic.max_grad_norm)
            optimizer.step()
            # fp16: the loss scaler (shared with the policy) skips a step whose scaled value-loss gradient
            # overflows, as with rewards of large magnitude early on, and lowers its scale
            skipped += int(getattr(optimizer, "step_was_skipped", False))
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            clipfracs.append(float(clipfrac))
    metrics["critic/value_loss"] = float(np.mean(losses))
    metrics["critic/clipfrac"] = float(np.mean(clipfracs))
    if acc.scaler is not None:
        metrics["critic/skipped_steps"] = skipped
    metrics["time/critic"] = time.perf_counter() - start


CRITIC_TRAIN_STEPS = ("endpoints", "all")


@register_config_check("critic")
def check_critic_training(config, machine):
    """config.critic.train_steps is known; a warmup needs an estimator with a critic."""
    from ddpo_group.algos.advantages import get_adv_estimator

    critic, algo = config.critic, config.algorithm
    check_choice(critic.train_steps, CRITIC_TRAIN_STEPS, "critic.train_steps")
    check_positive(critic.warmup_epochs, "critic.warmup_epochs", allow_zero=True)
    if critic.warmup_epochs and not get_adv_estimator(algo.adv_estimator).needs_values:
        raise ConfigError(
            f"config.critic.warmup_epochs={critic.warmup_epochs} needs a critic; "
            f"algorithm.adv_estimator={algo.adv_estimator!r} has none (use gae or group_ppo, or set it to 0)"
        )
