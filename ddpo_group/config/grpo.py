"""Named experiment configurations. Pick one with `--config config/grpo.py:NAME` (a checkout) or
`ddpo-group-train --config NAME` (any directory, installed or not).

    sd15            GRPO + reference KL on Stable Diffusion 1.5 with LoRA (config/grpo.py without :NAME; needs a GPU, the hub)
    ddpo            ddpo-pytorch's algorithm and defaults on SD 1.5: PPO on all steps, per-prompt stat tracking
    group_ppo       Group-PPO on SD 1.5 in the design that learns on the shapes task (docs/group_ppo.md); unmeasured on SD 1.5
    group_ppo_alg2  Group-PPO on SD 1.5 exactly as Algorithm 2 is written: noise at every step, endpoints trained
    tiny            GRPO on the shipped shapes-world model's 18 big-square prompts, CPU, minutes (the README's main run)
    tiny_squares    the same on all 36 square prompts
    tiny_all        GRPO on all 108 shapes-world prompts (slower to show learning)
    tiny_one_prompt GRPO on a single prompt the shapes-world model gets wrong: a visible rise in 2 minutes
    tiny_ddpo       the main job with DDPO (per-prompt stat tracking, no dual clip, no KL) instead of GRPO + KL
    tiny_group_ppo  Group-PPO on the main job's task: noise and training at the segment's first step, per-prompt baseline, KL
    tiny_group_ppo_alg2  Group-PPO on the main job's task as Algorithm 2 is written (its reward falls; docs/group_ppo.md)
    tiny_gae        the main job with a critic and GAE advantages over the steps instead of GRPO's group baseline
    tiny_nft        DiffusionNFT (forward process, no log-probs) on the main job's task and evaluation
    tiny_awm        advantage-weighted matching (forward process, PPO ratio of matching losses) on the main job's task
    tiny_group_ppo_sampled  tiny_group_ppo_alg2 training one random step per segment (weighted) instead of its endpoint
    tiny_early_window  the main job trained only at the 2 noisiest steps (Flow-GRPO-Fast / MixGRPO style)
    tiny_hacking    reward hacking on show: trains on JPEG incompressibility, watches shapes_alignment (gold)
    test            the random-weight tiny pipeline, a few seconds; for tests and smoke checks
    sd35            GRPO + KL on SD3.5-Medium (flow matching, SDE steps) with Flow-GRPO's settings, one GPU
    flux            GRPO + KL on FLUX.1-dev (flow matching, SDE steps), bf16, LoRA, one GPU
    sd35_nft        DiffusionNFT on SD3.5-Medium with the paper's settings (CFG-free, deterministic sampler), one GPU
    tiny_sd3        a random-weight tiny SD3 pipeline (flow matching), seconds; tests and smoke checks
    tiny_flux       a random-weight tiny FLUX pipeline (flow matching), seconds; tests and smoke checks
    qwen_image      GRPO on Qwen-Image (flow matching, true CFG) with LoRA r64, Flow-Factory / verl settings, one GPU
    tiny_qwen_image  a random-weight tiny Qwen-Image pipeline (Qwen2.5-VL text, true CFG), seconds; tests and smoke checks

The tiny_* algorithm variants (tiny_ddpo, tiny_gae, tiny_group_ppo, tiny_group_ppo_alg2, tiny_group_ppo_sampled,
tiny_early_window, tiny_nft, tiny_awm) are `tiny()` with only their method's fields changed: the main job's
prompts, sampler steps, group size, epochs and evaluation, so their evaluations compare with the main job's
(tests/test_variants.py checks the changed fields; README "Configs" gives each one's measured result). A learning
rate differs from the main job's 2e-4 only where a measured sweep chose it, and the variant's docstring says so.
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


def group_ppo():
    """Group-PPO on SD 1.5 with the design measured to learn on the shapes task; not yet measured on SD 1.5."""
    return _learning_group_ppo(sd15())


def group_ppo_alg2():
    return _algorithm2_group_ppo(sd15())


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


def sd35():
    """SD3.5-Medium (hub id stabilityai/stable-diffusion-3.5-medium) with Flow-GRPO's GenEval settings
    (yifan123/flow_grpo, config/grpo.py: geneval_sd3 and config/base.py), scaled from 32 GPUs to one."""
    config = base.get_config()
    config.pretrained.model = "stabilityai/stable-diffusion-3.5-medium"
    config.mixed_precision = "bf16"
    config.use_lora = True
    config.lora_rank = 32  # Flow-GRPO: LoRA r=32, alpha=64 on the attention projections
    config.lora_alpha = 64
    config.num_epochs = 100
    config.save_freq = 10
    config.prompt_fn = "simple_animals"
    config.reward_fn = "aesthetic"  # GenEval's detector reward runs as a server: --config.reward_fn=http://HOST:PORT
    config.sample.num_steps = 10  # Flow-GRPO: 10 sampling (and training) steps
    config.sample.eta = 0.7  # Flow-GRPO: noise level a = 0.7 of the "sde" step
    config.sample.sde_type = "sde"
    # Conventions (docs/flow.md): Flow-GRPO's "sde" log-prob is the normalised Gaussian one, as ours, so its ratio,
    # and with it clip_range 1e-4, mean the same here (sample.cps_log_prob concerns sde_type="cps" only: its
    # "flow_grpo" form has log-ratios 2 std^2 times ours). Flow-GRPO samples on the pipeline's own grid (shift 3
    # for SD3.5, FLUX's resolution-dependent shift): flow_grid "pipeline", not DanceGRPO's linspace grid.
    config.sample.cps_log_prob = "normalized"
    config.sample.flow_grid = "pipeline"
    config.sample.guidance_scale = 4.5  # Flow-GRPO: CFG 4.5
    config.sample.resolution = 512  # Flow-GRPO: 512x512
    config.sample.group_size = 24  # Flow-GRPO: 24 images per prompt
    config.sample.batch_size = 24  # one group per sampling batch on one GPU (Flow-GRPO: 9 per GPU on 32 GPUs)
    config.sample.num_batches_per_epoch = 2
    config.train.batch_size = 8
    config.train.gradient_accumulation_steps = 3  # two optimizer steps per epoch, as Flow-GRPO
    config.train.learning_rate = 3e-4  # Flow-GRPO base.py
    config.train.clip_range = 1e-4  # Flow-GRPO base.py
    config.algorithm.adv_estimator = "grpo"
    config.train.use_reference_model = True
    config.train.use_kl_loss = True
    config.train.beta = 0.04  # Flow-GRPO geneval_sd3: KL weight 0.04, on its scale of the KL:
    # ||mu - mu_ref||^2 / (2 g^2) with g the noise level before the sqrt|dt| factor (scripts/train_sd3.py), the
    # exact Gaussian KL times |dt|; with kl_type="gaussian" the same beta would weigh it 1/|dt| (4x-100x) more
    config.train.kl_type = "flow_grpo"
    config.train.skip_last_steps = 1  # Flow-GRPO trains timestep_fraction 0.99 of the steps: never the last
    return config


def flux():
    """FLUX.1-dev (hub id black-forest-labs/FLUX.1-dev): guidance-distilled, no CFG; Flow-GRPO's FLUX settings
    (6 steps, noise level 0.9, bf16; yifan123/flow_grpo config/grpo.py), LoRA, one GPU."""
    config = sd35()
    config.pretrained.model = "black-forest-labs/FLUX.1-dev"
    config.sample.num_steps = 6  # Flow-GRPO FLUX: 6 steps
    config.sample.eta = 0.9  # Flow-GRPO FLUX: noise level 0.9
    config.sample.guidance_scale = 3.5  # FLUX.1-dev's guidance embedding (diffusers' default), not CFG
    # sd35's conventions: Flow-GRPO's "sde" step (normalised log-prob) on the pipeline's grid (Flow-GRPO's FLUX
    # script samples there too); DanceGRPO's FLUX recipe would be sde_type "dance", eta 0.3, 16 steps,
    # flow_grid "dance" with flow_grid_shift 3 (its scripts/finetune/finetune_flux_grpo.sh)
    config.sample.group_size = 16
    config.sample.batch_size = 16
    config.train.batch_size = 8
    config.train.gradient_accumulation_steps = 2
    config.train.learning_rate = 1e-4
    return config


def sd35_nft():
    """DiffusionNFT on SD3.5-Medium with the paper's settings (NVlabs/DiffusionNFT config/nft.py, sd3_geneval):
    CFG-free sampling and training (guidance 1), a deterministic sampler (here the Euler ODE: noise 0; the paper
    uses a 2nd-order DPM solver), 10 steps of which int(0.99 * 10) = 9 trained per sample, beta 1, adaptive
    weighting, the old model's decay 0.001 per step up to 0.5, KL weight 1e-4 to the base model, lr 3e-4,
    one optimizer step per epoch, LoRA r32 / alpha 64, 24 images per prompt at 512 px. Not yet run here (no GPU);
    on the shapes task the adaptive weighting was worse than the uniform one (docs/forward.md)."""
    config = _diffusion_nft(sd35(), weighting="adaptive")
    config.sample.guidance_scale = 1.0
    config.sample.eta = 0.0
    config.train.cfg = False
    config.train.skip_last_steps = 0
    config.train.kl_type = "gaussian"  # not read by the forward objectives: their KL is ||v - v_ref||^2
    config.train.beta = 1e-4
    config.train.learning_rate = 3e-4
    config.train.gradient_accumulation_steps = 6  # 48 samples of 8 per micro-batch: one optimizer step per epoch
    return config


def _tiny_flow(model):
    config = test()
    config.pretrained.model = model
    config.reward_fn = "jpeg_compressibility"  # random weights: any reward that varies between images
    config.sample.num_steps = 4
    config.sample.eta = 0.7
    config.sample.guidance_scale = 4.5
    config.sample.max_sequence_length = 16
    return config


def tiny_sd3():
    """A random-weight tiny SD3 pipeline (two tiny CLIP encoders, no T5), seconds: tests and smoke runs."""
    return _tiny_flow("tiny-sd3")


def tiny_flux():
    """A random-weight tiny FLUX pipeline (tiny CLIP and T5 built in memory), seconds: tests and smoke runs."""
    config = _tiny_flow("tiny-flux")
    config.sample.guidance_scale = 3.5  # the guidance embedding of FLUX.1-dev, not CFG
    return config


def qwen_image():
    """Qwen-Image (hub id Qwen/Qwen-Image; QwenImagePipeline, true CFG with a negative prompt, " " when empty)
    with the public Flow-GRPO LoRA recipes for it, scaled to one GPU: X-GenGroup/Flow-Factory
    examples/grpo/lora/qwen_image/default.yaml (LoRA r64 / alpha 128, lr 3e-4, weight decay 1e-4, 10 steps,
    512 px, guidance 4, noise level 1.0 of the Flow-SDE step, 16 images per prompt, clip range 1e-4, KL weight 0,
    two optimizer steps per epoch) and verl-project/verl examples/flowgrpo_trainer/run_qwen_image_ocr_lora.sh
    (the same LoRA r64 / alpha 128, lr 3e-4, weight decay 1e-4, true_cfg_scale 4, 16 rollouts per prompt,
    max_sequence_length 256). Both train the SDE at a few random early steps only (Flow-Factory one of steps
    1-3, verl a 2-step window in steps 0-5): not expressible with sample.sde_window's modes, so every step
    is stochastic here. Not yet run (no GPU and no hub access where it was written); the 20B transformer
    in bf16 with LoRA needs an 80 GB GPU."""
    config = sd35()
    config.pretrained.model = "Qwen/Qwen-Image"
    config.lora_rank = 64  # Flow-Factory and verl: r64, alpha 128
    config.lora_alpha = 128
    config.sample.num_steps = 10  # Flow-Factory: num_inference_steps 10
    config.sample.eta = 1.0  # Flow-Factory: Flow-SDE noise_level 1.0 (verl: 1.2)
    config.sample.sde_type = "sde"
    config.sample.guidance_scale = 4.0  # true CFG (the pipeline's true_cfg_scale): Flow-Factory 4, verl 4.0
    config.sample.negative_prompt = ""  # means " " for Qwen-Image (its model card's "no negative prompt")
    config.sample.resolution = 512  # Flow-Factory: resolution 512
    config.sample.max_sequence_length = 256  # verl: rollout.max_sequence_length 256
    config.sample.group_size = 16  # Flow-Factory group_size 16, verl rollout.n 16
    config.sample.batch_size = 16  # one group per sampling batch on one GPU
    config.sample.num_batches_per_epoch = 2
    config.train.batch_size = 2
    config.train.gradient_accumulation_steps = 8  # two optimizer steps per epoch (Flow-Factory gradient_step_per_epoch 2)
    config.train.learning_rate = 3e-4  # Flow-Factory and verl
    config.train.adam_weight_decay = 1e-4  # Flow-Factory and verl
    config.train.clip_range = 1e-4  # Flow-Factory
    config.train.use_reference_model = False  # Flow-Factory: kl_beta 0
    config.train.use_kl_loss = False
    config.train.beta = 0.0
    return config


def tiny_qwen_image():
    """A random-weight tiny Qwen-Image pipeline (tiny Qwen2.5-VL and tokenizer built in memory), seconds:
    tests and smoke runs. Guidance 4.5 is true CFG with the negative prompt " "."""
    config = _tiny_flow("tiny-qwen-image")
    config.sample.max_sequence_length = 32  # text tokens after the chat template's 34 dropped ones
    return config


VARIANTS = {
    "sd15": sd15,
    "ddpo": ddpo,
    "group_ppo": group_ppo,
    "group_ppo_alg2": group_ppo_alg2,
    "tiny": tiny,
    "tiny_all": tiny_all,
    "tiny_squares": tiny_squares,
    "tiny_one_prompt": tiny_one_prompt,
    "tiny_ddpo": tiny_ddpo,
    "tiny_group_ppo": tiny_group_ppo,
    "tiny_group_ppo_alg2": tiny_group_ppo_alg2,
    "tiny_gae": tiny_gae,
    "tiny_nft": tiny_nft,
    "tiny_awm": tiny_awm,
    "tiny_group_ppo_sampled": tiny_group_ppo_sampled,
    "tiny_early_window": tiny_early_window,
    "tiny_hacking": tiny_hacking,
    "test": test,
    "sd35": sd35,
    "flux": flux,
    "sd35_nft": sd35_nft,
    "tiny_sd3": tiny_sd3,
    "tiny_flux": tiny_flux,
    "qwen_image": qwen_image,
    "tiny_qwen_image": tiny_qwen_image,
}


def get_config(name="sd15"):
    if name not in VARIANTS:
        raise ValueError(f"unknown config variant {name!r} in config/grpo.py; choose one of {sorted(VARIANTS)}")
    config = VARIANTS[name]()
    config.variant = name  # kept in the run's config.json: the report's headline names the variant
    return config
