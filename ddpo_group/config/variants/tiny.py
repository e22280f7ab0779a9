"""The shipped shapes-world model (tiny-shapes) on the CPU: the README's main job `tiny`, its demos on other
prompt sets (tiny_all, tiny_squares, tiny_one_prompt, tiny_hacking) and its algorithm variants, and `test`, the
random-weight tiny pipeline the tests run.

The tiny_* algorithm variants (tiny_ddpo, tiny_gae, tiny_group_ppo, tiny_group_ppo_alg2, tiny_group_ppo_sampled,
tiny_early_window, tiny_window4, tiny_nft, tiny_awm, tiny_dppo, tiny_grpo_guard) are `tiny()` with only their method's fields changed
(tests/test_variants.py checks the changed fields).
"""

from ddpo_group.config import base
from ddpo_group.config.variants._methods import _algorithm2_group_ppo, _diffusion_nft, _dgpo, _dpo, _learning_group_ppo


def _tiny_common(config):
    """The shipped shapes-world model on the CPU: 64 trajectories of 10 steps per epoch, about 10 s an epoch."""
    config.pretrained.model = "tiny-shapes"
    config.mixed_precision = "no"
    config.logdir = "runs"
    config.prompt_fn = "shapes"
    config.reward_fn = "shapes_alignment"
    config.use_lora = False  # the whole 0.8M-parameter UNet is trained
    config.num_epochs = 40
    config.save_freq = 10
    config.log_images_every = 5
    config.sample.num_steps = 10
    config.sample.guidance_scale = 3.0
    config.sample.batch_size = 32
    config.sample.num_batches_per_epoch = 2
    config.sample.group_size = 4
    config.train.batch_size = 16
    config.train.gradient_accumulation_steps = 1
    config.train.learning_rate = 3e-5
    config.train.clip_range = 2e-3
    config.per_prompt_stat_tracking.buffer_size = 32
    config.per_prompt_stat_tracking.min_count = 4
    return config


def tiny_all():
    """GRPO + KL on all 108 shapes-world prompts (the earlier main job; its reward barely moves in 40 epochs)."""
    config = _tiny_common(base.get_config())
    config.algorithm.adv_estimator = "grpo"
    config.train.use_reference_model = True
    config.train.use_kl_loss = True
    config.train.beta = 0.01
    return config


def tiny():
    """The README main job: GRPO + KL on the 18 big-square prompts (squares are the shape the pretrained
    model gets most wrong; the big ones are where RL moves it fastest), with a fixed-noise evaluation
    every 10 epochs whose reward visibly rises. The whole 36 square prompts: tiny_squares."""
    config = tiny_all()
    config.prompt_fn = "shapes_big_squares.txt"
    config.num_epochs = 40
    config.save_freq = 20
    config.log_images_every = 10
    config.sample.group_size = 8
    config.train.learning_rate = 2e-4
    config.train.clip_range = 1e-2
    config.eval_freq = 10
    config.eval_images_per_prompt = 8
    config.eval_batch_size = 144
    return config


def tiny_squares():
    """The main job's settings on all 36 square prompts (small squares learn slower), 60 epochs."""
    config = tiny()
    config.prompt_fn = "shapes_squares.txt"
    config.num_epochs = 60
    config.eval_images_per_prompt = 4
    return config


def tiny_one_prompt():
    """GRPO on one prompt the pretrained model gets wrong (it draws circles and triangles): a fast,
    visible rise of the reward, to see the machinery learn in two minutes."""
    config = tiny()
    config.prompt_fn = "shapes_one_hard.txt"
    config.num_epochs = 12
    config.sample.group_size = 8
    config.train.learning_rate = 1e-4
    config.train.clip_range = 1e-2
    config.log_images_every = 1
    config.save_freq = 12
    config.eval_freq = 4
    config.eval_images_per_prompt = 32
    config.eval_batch_size = 32
    return config


def tiny_ddpo():
    """DDPO (ddpo-pytorch's algorithm) on the main job's task (prompts, sampler, evaluation, learning rate and clip
    range as `tiny`): per-prompt stat tracking of the rewards, PPO on all steps without the dual clip, no reference
    model or KL (ddpo-pytorch has none). No learning-rate sweep: the main job's 2e-4."""
    config = tiny()
    config.algorithm.adv_estimator = "ddpo"
    config.train.clip_ratio_c = 1e4  # ddpo-pytorch has no dual clip
    config.train.use_reference_model = False
    config.train.use_kl_loss = False
    config.train.beta = 0.0
    return config


def tiny_group_ppo():
    """Group-PPO on the main job's task (prompts, evaluation, KL as `tiny`) in the design that learns; its
    best learning rate of the study, 5e-5 (1e-4 and 2e-4 are worse)."""
    config = _learning_group_ppo(tiny())
    config.train.learning_rate = 5e-5
    return config


def tiny_group_ppo_alg2():
    """Algorithm 2 as written on the main job's task, at its least bad learning rate of the study (5e-5)."""
    config = _algorithm2_group_ppo(tiny())
    config.group_ppo.max_group_size = 8
    config.train.learning_rate = 5e-5
    return config


def tiny_group_ppo_sampled():
    """Algorithm 2 (tiny_group_ppo_alg2, its learning rate 5e-5 included) with one step drawn inside each segment
    (weighted by its length) instead of the endpoint: it differs from tiny_group_ppo_alg2 only in the trained step."""
    config = tiny_group_ppo_alg2()
    config.train.timestep_selection = "segment_sample"
    return config


def tiny_window4():
    """The main job (GRPO + KL) with the sampler's noise and the training in a 4-step SDE window at the noisiest
    steps (deterministic DDIM steps after it), lr 5e-5: the best critic-free arm of issue 35's comparison
    (docs/critic.md section 4; 1e-4 was worse in its sweep)."""
    config = tiny()
    config.sample.sde_window_size = 4
    config.train.learning_rate = 5e-5
    return config


def tiny_early_window():
    """The main job (GRPO + KL, its learning rate 2e-4) trained only at the 2 noisiest steps (Flow-GRPO-Fast /
    MixGRPO's window; 2 = Group-PPO's K here). No learning-rate sweep."""
    config = tiny()
    config.train.timestep_selection = "early"
    config.train.early_steps = 2
    return config


def tiny_hacking():
    """The reward-hacking monitor on show (docs/hacking.md): the main job's prompts, sampler, KL and learning
    rate, but trained on a proxy, JPEG incompressibility (detail: bytes of the image's JPEG), while every
    evaluation (every 5 epochs) also scores the images with the gold reward shapes_alignment. The model adds
    detail that breaks the flat background and the shape: the proxy rises and the gold falls (3 seeds)."""
    config = tiny()
    config.reward_fn = "jpeg_incompressibility"
    config.eval_rewards = "shapes_alignment"
    config.eval_freq = 5
    return config


def tiny_gae():
    """The main job (GRPO's KL to the reference, its learning rate 2e-4) with PPO's critic and GAE advantages over
    the denoising steps instead of GRPO's group baseline. No learning-rate sweep."""
    config = tiny()
    config.algorithm.adv_estimator = "gae"
    return config


def tiny_nft():
    """DiffusionNFT (docs/forward.md) on the main job's prompts, sampler and evaluation: the paper's objective
    settings (NVlabs/DiffusionNFT config/nft.py: beta 1, int(0.99 T) timesteps per sample, the old model's decay
    schedule 0.001 per step up to 0.5), no KL (the paper's KL weight is 1e-4), the paper's equation weighted
    uniformly: its reference code's adaptive weighting never reached eval 0.75 here (0/3 seeds; uniform 3/3).
    The sampler stays the main job's (DDIM eta 1, CFG 3) so the evaluation is the same."""
    config = _diffusion_nft(tiny(), weighting="uniform")
    config.train.use_reference_model = False
    config.train.use_kl_loss = False
    config.train.beta = 0.0
    config.train.learning_rate = 2e-4
    return config


def tiny_awm():
    """Advantage-weighted matching (docs/forward.md) on the main job's prompts, sampler and evaluation: the
    clipped ratio of matching losses with the outcome advantage, 4 of 10 timesteps trained (the reference
    code, scxue/advantage_weighted_matching, trains 6 of 14), uniform weighting, no KL; the old model follows
    DiffusionNFT's schedule. The main job's clip range 1e-2, not the reference code's 1: with a clip of 1 the
    reward fell at lr 3e-5 and 1e-4 and rose slowly at 1e-5; with 1e-2 at lr 1e-4 it rose fastest of all
    (one-seed sweep, docs/forward.md)."""
    config = tiny()
    config.train.objective = "awm"
    config.train.use_reference_model = False
    config.train.use_kl_loss = False
    config.train.beta = 0.0
    config.train.clip_range = 1e-2
    config.forward.num_timesteps = 4
    config.forward.weighting = "uniform"
    config.train.learning_rate = 1e-4
    return config


def tiny_dppo():
    """The main job (GRPO + KL, lr 2e-4, no sweep) with Flow-DPPO's loss: no ratio clip, a trust region of
    train.dppo_kl_max 1e-5 (verl-omni's recipe) on each step's exact Gaussian KL to pi_old's step (the main job's
    4 optimizer steps an epoch put the later micro-batches off-policy, where it acts)."""
    config = tiny()
    config.train.policy_loss = "dppo"
    return config


def tiny_grpo_guard():
    """The main job (GRPO + KL, lr 2e-4, clip range 1e-2, no sweep) with GRPO-Guard's loss: the clip on each step's
    normalised ratio exp((log-ratio + D) * s), every step's loss weighted by 1 / dt (train.guard_reweight "dt")."""
    config = tiny()
    config.train.policy_loss = "grpo_guard"
    return config


def tiny_dgpo():
    """DGPO (docs/forward.md) on the main job's prompts, sampler and evaluation: each group's preference of its
    positive over its negative samples (GRPO's advantages as weights) on the matching loss against the frozen
    initial model, beta 100 (the reference code's), 4 of 10 timesteps per sample, no KL term, no clip, lr 5e-5:
    at the main job's 2e-4 the reward fell at once (0.56 -> 0.33 in one epoch, seed 42); at 5e-5 the evaluation
    rose 0.554 -> 0.705 in 10 epochs, as with the reference code's clip (forward.dgpo_clip_range 1e-2) at 2e-4
    (0.701) at a third more training time (one seed each, docs/forward.md). The sampler stays the main job's (DDIM
    eta 1, CFG 3) so that the evaluation is the same; DGPO's own deterministic sampler is --config.sample.eta=0."""
    config = _dgpo(tiny())
    config.train.learning_rate = 5e-5
    return config


def tiny_dpo():
    """Diffusion-DPO (docs/forward.md) with online pairs on the main job's prompts, sampler and evaluation: the
    best and the worst sample of each group of 8 against the frozen initial model, beta T 5000 (the paper's for
    SD 1.5), 4 of 10 timesteps per pair, no KL term, the main job's learning rate (not swept)."""
    return _dpo(tiny())


def test():
    """Random-weight tiny pipeline, two epochs of a few seconds: what the tests run."""
    config = _tiny_common(base.get_config())
    config.pretrained.model = "tiny"
    config.num_epochs = 2
    config.save_freq = 1
    config.log_images_every = 1
    config.sample.num_steps = 4
    config.sample.batch_size = 4
    config.sample.num_batches_per_epoch = 1
    config.sample.group_size = 2
    config.train.batch_size = 2
    config.train.gradient_accumulation_steps = 1
    config.algorithm.adv_estimator = "grpo"
    config.train.use_reference_model = True
    config.train.use_kl_loss = True
    config.train.beta = 0.01
    return config
