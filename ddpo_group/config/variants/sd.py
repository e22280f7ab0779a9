"""The UNet + DDIM family on the hub: Stable Diffusion 1.5 (sd15, the default; ddpo, ddpo-pytorch's recipe; the two
Group-PPO designs) and SDXL 1.0 (sdxl, with its random-weight tiny pipeline tiny_sdxl, docs/sdxl.md).
"""

from ddpo_group.config import base
from ddpo_group.config.variants._methods import _algorithm2_group_ppo, _learning_group_ppo
from ddpo_group.config.variants.tiny import test


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
    """Group-PPO on SD 1.5 with the design measured to learn on the shapes task; not yet measured on SD 1.5."""
    return _learning_group_ppo(sd15())


def group_ppo_alg2():
    return _algorithm2_group_ppo(sd15())


def sdxl():
    """SDXL 1.0 base (hub id stabilityai/stable-diffusion-xl-base-1.0) with LoRA: SD 1.5's GRPO + KL recipe (sd15:
    DDIM with eta 1.0 as ddpo-pytorch, group 8, reference KL 0.004) at SDXL's own settings: 1024 px, CFG 5.0 and 25
    steps (the SDXL GRPO / DPO research scripts' validation sampling in huggingface/diffusers
    examples/research_projects/diffusion_grpo/train_diffusion_grpo_sdxl.py), LoRA rank 8 and learning rate 1e-5
    (that script's README command, fp16). fp16 keeps SDXL's VAE in float32 (its force_upcast); the fixed VAE
    madebyollin/sdxl-vae-fp16-fix is the usual swap. Not yet run here (no GPU, no hub); its UNet is 2.6B parameters."""
    config = sd15()
    config.pretrained.model = "stabilityai/stable-diffusion-xl-base-1.0"
    config.lora_rank = 8
    config.sample.resolution = 1024
    config.sample.num_steps = 25
    config.sample.guidance_scale = 5.0
    config.sample.batch_size = 8
    config.train.batch_size = 2
    config.train.gradient_accumulation_steps = 8  # two optimizer steps per epoch of 32 trajectories, as sd15
    config.train.learning_rate = 1e-5
    return config


def tiny_sdxl():
    """A random-weight tiny SDXL pipeline (two tiny CLIP encoders, one with projection; pooled embeddings and time
    ids), DDIM, seconds: tests and smoke runs."""
    config = test()
    config.pretrained.model = "tiny-sdxl"
    config.reward_fn = "jpeg_compressibility"  # random weights: any reward that varies between images
    config.sample.guidance_scale = 5.0
    return config
