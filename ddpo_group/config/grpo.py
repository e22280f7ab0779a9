"""Named experiment configurations. Pick one with `--config config/grpo.py:NAME` (a checkout) or
`ddpo-group-train --config NAME` (any directory, installed or not).

    sd15            GRPO + reference KL on Stable Diffusion 1.5 with LoRA (default; needs a GPU and the hub)
    ddpo            ddpo-pytorch's algorithm and defaults on SD 1.5: PPO on all steps, per-prompt stat tracking
    group_ppo       Group-PPO on SD 1.5: critic, GAE, timestep grouping, actor trained on endpoints only
    tiny            GRPO on the shipped offline shapes-world model, CPU, minutes (the README's main run)
    tiny_one_prompt GRPO on a single prompt the shapes-world model gets wrong: a visible rise in 2 minutes
    tiny_ddpo       the DDPO baseline on the shapes-world model
    tiny_group_ppo  Group-PPO on the shapes-world model
    tiny_gae        PPO with a critic and GAE over timesteps on the shapes-world model
    test            the random-weight tiny pipeline, a few seconds; for tests and smoke checks
"""

from ddpo_group.config import base


def sd15():
    config = base.get_config()
    config.pretrained.model = "stable-diffusion-v1-5/stable-diffusion-v1-5"
    config.mixed_precision = "fp16"
    config.use_lora = True
    config.num_epochs = 100
    config.save_freq = 10
    config.prompt_fn = "simple_animals"
    config.reward_fn = "aesthetic"
    config.sample.num_steps = 50
    config.sample.guidance_scale = 5.0
    config.sample.batch_size = 8
    config.sample.num_batches_per_epoch = 4
    config.sample.group_size = 8
    config.train.batch_size = 4
    config.train.gradient_accumulation_steps = 2
    config.train.learning_rate = 3e-4
    config.algorithm.adv_estimator = "grpo"
    config.train.use_reference_model = True
    config.train.use_kl_loss = True
    config.train.beta = 0.004
    config.train.kl_type = "gaussian"
    return config


def ddpo():
    """ddpo-pytorch's compressibility recipe (config/dgx.py) as closely as this trainer expresses it."""
    config = base.get_config()
    config.pretrained.model = "stable-diffusion-v1-5/stable-diffusion-v1-5"
    config.mixed_precision = "fp16"
    config.use_lora = True
    config.num_epochs = 100
    config.prompt_fn = "imagenet_animals"
    config.reward_fn = "jpeg_compressibility"
    config.sample.batch_size = 8
    config.sample.num_batches_per_epoch = 4
    config.sample.group_size = 1  # prompts are drawn independently; the tracker groups equal prompts
    config.train.batch_size = 4
    config.train.gradient_accumulation_steps = 2
    config.algorithm.adv_estimator = "ddpo"
    config.train.policy_loss = "vanilla"
    config.train.clip_ratio_c = 1e4  # ddpo-pytorch has no dual clip
    config.train.loss_agg_mode = "token-mean"
    config.per_prompt_stat_tracking.buffer_size = 16
    config.per_prompt_stat_tracking.min_count = 16
    return config


def group_ppo():
    config = sd15()
    config.algorithm.adv_estimator = "group_ppo"
    config.train.timestep_selection = "endpoints"
    config.train.use_kl_loss = False
    config.train.use_reference_model = False
    return config


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


def tiny():
    config = _tiny_common(base.get_config())
    config.algorithm.adv_estimator = "grpo"
    config.train.use_reference_model = True
    config.train.use_kl_loss = True
    config.train.beta = 0.01
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
    return config


def tiny_ddpo():
    config = _tiny_common(base.get_config())
    config.algorithm.adv_estimator = "ddpo"
    config.train.clip_ratio_c = 1e4
    return config


def tiny_group_ppo():
    config = _tiny_common(base.get_config())
    config.algorithm.adv_estimator = "group_ppo"
    config.train.timestep_selection = "endpoints"
    config.group_ppo.max_group_size = 8
    return config


def tiny_gae():
    config = _tiny_common(base.get_config())
    config.algorithm.adv_estimator = "gae"
    return config


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


VARIANTS = {
    "sd15": sd15,
    "ddpo": ddpo,
    "group_ppo": group_ppo,
    "tiny": tiny,
    "tiny_one_prompt": tiny_one_prompt,
    "tiny_ddpo": tiny_ddpo,
    "tiny_group_ppo": tiny_group_ppo,
    "tiny_gae": tiny_gae,
    "test": test,
}


def get_config(name="sd15"):
    if name not in VARIANTS:
        raise ValueError(f"unknown config variant {name!r} in config/grpo.py; choose one of {sorted(VARIANTS)}")
    return VARIANTS[name]()
