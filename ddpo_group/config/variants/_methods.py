"""The method recipes a variant applies onto another's config: the Group-PPO design that learns, Group-PPO as
Algorithm 2 is written, DiffusionNFT's objective settings and the scenes ladder's DiffusionNFT + KL recipe. Each
takes a ConfigDict, changes only its method's fields and returns it, so `tiny_group_ppo` and `group_ppo` (and
benchmarks/scenes_study.py's arms) share one recipe.
"""


def _learning_group_ppo(config):
    """The Group-PPO design that learns on the main job's task (docs/group_ppo.md, 3 seeds): SDE noise only
    where the actor trains (a one-step window at the noisiest step, deterministic DDIM/ODE steps elsewhere),
    the segment trained at its first step, GAE advantages normalised per prompt group, the reference KL kept."""
    config.algorithm.adv_estimator = "group_ppo"
    config.train.timestep_selection = "segment_start"
    config.sample.sde_window_size = 1
    config.sample.sde_window_start = 0
    config.group_ppo.advantage_norm = "group"
    return config


def _algorithm2_group_ppo(config):
    """Group-PPO exactly as Algorithm 2 is written: noise at every step, segments trained at their endpoints,
    GAE advantages whitened over the batch, no reference model. Its reward falls (docs/group_ppo.md)."""
    config.algorithm.adv_estimator = "group_ppo"
    config.train.timestep_selection = "endpoints"
    config.sample.sde_window_size = 0
    config.group_ppo.advantage_norm = "whiten"
    config.train.use_kl_loss = False
    config.train.use_reference_model = False
    return config


def _diffusion_nft(config, weighting):
    """DiffusionNFT's objective settings (NVlabs/DiffusionNFT config/nft.py): beta 1, int(0.99 * 10) = 9 of 10
    timesteps per sample, the old model's decay 0.001 per optimizer step up to 0.5; `weighting` as given."""
    config.train.objective = "nft"
    config.forward.num_timesteps = 9
    config.forward.nft_beta = 1.0
    config.forward.weighting = weighting
    config.forward.old_decay_rate = 0.001
    config.forward.old_decay_max = 0.5
    return config


def _diffusion_nft_kl(config):
    """The scenes ladder's DiffusionNFT recipe (docs/scenes.md, "DiffusionNFT + KL on the flow base"): DiffusionNFT's
    settings with uniform weighting, a KL of 0.1 to the frozen reference (the base), the conditional prediction
    alone in training (`train.cfg` off; sampling keeps its CFG), no step skipped (a forward-process objective keeps
    one outcome per sample, which a skip would mask whole) and 4 passes over each epoch's samples."""
    config = _diffusion_nft(config, weighting="uniform")
    config.train.skip_last_steps = 0
    config.train.use_reference_model = config.train.use_kl_loss = True
    config.train.beta = 0.1
    config.train.cfg = False
    config.train.num_inner_epochs = 4
    return config


def _preference(config, objective, num_timesteps):
    """The preference objectives' common settings (docs/forward.md): the frozen reference they compare with
    (the initial policy; no KL term on top of it), `num_timesteps` of the sampling grid trained per sample, and
    sampling with the policy itself (the lagged model's decay 0)."""
    config.train.objective = objective
    config.train.use_reference_model = True
    config.train.use_kl_loss = False
    config.train.beta = 0.0
    config.forward.num_timesteps = num_timesteps
    config.forward.old_decay_rate = 0.0
    config.forward.old_decay_max = 0.0
    return config


def _dgpo(config):
    """DGPO's settings (Luo-Yihong/DGPO config/dgpo.py, its default mode: a frozen reference, beta_dpo 100): beta
    100 and the preference objectives' common settings, 4 timesteps per sample. Its PPO-style clip of the matching
    loss and its KL weight 1e-3 are not part of it here."""
    config = _preference(config, "dgpo", num_timesteps=4)
    config.forward.dgpo_beta = 100.0
    return config


def _dpo(config):
    """Diffusion-DPO's settings (Wallace et al., 2023: beta T 5000 for SD 1.5) with online pairs, the best and the
    worst sample of each group, and the preference objectives' common settings, 4 timesteps per pair."""
    config = _preference(config, "dpo", num_timesteps=4)
    config.forward.dpo_beta = 5000.0
    config.forward.dpo_pairs = "online"
    return config
