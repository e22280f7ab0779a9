"""Named experiment configurations. Pick one with `--config config/grpo.py:NAME` (a checkout) or
`ddpo-group-train --config NAME` (any directory, installed or not). One file of some 800 lines because a variant
is read against the ones it derives from (tiny_* from tiny, the task presets from sd35): the list below is the map.

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
    tiny_window4    the main job with noise and training in a 4-step SDE window, lr 5e-5 (issue 35's best critic-free arm)
    tiny_hacking    reward hacking on show: trains on JPEG incompressibility, watches shapes_alignment (gold)
    test            the random-weight tiny pipeline, a few seconds; for tests and smoke checks
    sd35            GRPO + KL on SD3.5-Medium (flow matching, SDE steps) with Flow-GRPO's settings, one GPU
    flux            GRPO + KL on FLUX.1-dev (flow matching, SDE steps), bf16, LoRA, one GPU
    sd35_nft        DiffusionNFT on SD3.5-Medium with the paper's settings (CFG-free, deterministic sampler), one GPU
    tiny_sd3        a random-weight tiny SD3 pipeline (flow matching), seconds; tests and smoke checks
    tiny_flux       a random-weight tiny FLUX pipeline (flow matching), seconds; tests and smoke checks
    qwen_image      GRPO on Qwen-Image (flow matching, true CFG) with LoRA r64, Flow-Factory / verl settings, one GPU
    tiny_qwen_image  a random-weight tiny Qwen-Image pipeline (Qwen2.5-VL text, true CFG), seconds; tests and smoke checks
    sd35_ocr        Flow-GRPO's OCR (text rendering) recipe on SD3.5-Medium: the `ocr` reward (PaddleOCR), one GPU
    wan21_t2v_1_3b  GRPO + KL on Wan 2.1 T2V 1.3B (text-to-video, 33 frames) with Flow-GRPO's Wan settings, one GPU
    wan21_t2v_14b   GRPO on Wan 2.1 T2V 14B (5 frames, 10 steps) with Flow-Factory's Wan 2.1 T2V settings, LoRA
    tiny_wan        a random-weight tiny Wan pipeline (UMT5 text, videos of 5 frames), seconds; tests and smoke checks
    sd35_pickscore  SD3.5-Medium with Flow-GRPO's PickScore settings (PickScore / 26 on its prompt set, KL 0.01), one GPU
    sdxl            GRPO + KL on SDXL 1.0 base (DDIM, two text encoders, pooled embeddings, time ids) with LoRA, one GPU
    tiny_sdxl       a random-weight tiny SDXL pipeline, seconds; tests and smoke checks
    flux_kontext    GRPO image editing on FLUX.1 Kontext [dev] with Flow-Factory's settings, LoRA r64, one GPU
    tiny_flux_kontext  a random-weight tiny FLUX.1 Kontext editing the shipped shapes-world sources, seconds
    qwen_image_edit GRPO image editing on Qwen-Image-Edit (true CFG 4) with Flow-Factory's settings, LoRA r64, one GPU
    tiny_qwen_image_edit  a random-weight tiny Qwen-Image-Edit editing the shipped shapes-world sources, seconds
    tiny_geneval    the main job's model and method trained with the geneval reward (exact shapes detector), CPU, minutes
    tiny_scenes     the second main job: Flow-GRPO's GenEval recipe on the shipped flow model tiny-scenes-sd3 (1-4 shapes
                    per 64-px scene, GenEval's six tags), evaluated on the held-out geneval_scenes.jsonl, CPU, minutes
    tiny_scenes_sd  the same task and evaluation on the shipped UNet + DDIM scenes model tiny-scenes (GRPO + KL)
    sd35_geneval    Flow-GRPO's GenEval recipe on SD3.5-Medium: the geneval reward (partial score), generated prompts
    sd35_nft_geneval  DiffusionNFT's GenEval recipe on SD3.5-Medium (sd35_nft with the geneval reward)

The tiny_* algorithm variants (tiny_ddpo, tiny_gae, tiny_group_ppo, tiny_group_ppo_alg2, tiny_group_ppo_sampled,
tiny_early_window, tiny_window4, tiny_nft, tiny_awm) are `tiny()` with only their method's fields changed: the main job's
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


# --- issue 33: the OCR task (the `ocr` reward, ddpo_group/rewards/ocr.py; docs/tasks_ocr_judge.md) ---
def sd35_ocr():
    """Flow-GRPO's OCR recipe on SD3.5-Medium (yifan123/flow_grpo config/grpo.py: general_ocr_sd3, whose settings
    are geneval_sd3's, and so sd35's here, but for the prompt set, the reward and the evaluation): the `ocr` reward
    with Flow-GRPO's recogniser (PaddleOCR: pip install "ddpo-group[paddle]"; GOT-OCR 2.0 instead with
    --config.reward_kwargs.ocr.engine=got_ocr2), trained on Flow-GRPO's dataset/ocr/train.txt and evaluated on its
    dataset/ocr/test.txt, one image per test prompt, every 60 epochs (Flow-GRPO's eval_freq and save_freq 60).
    The two prompt files are not shipped: take them from a clone of yifan123/flow_grpo (its dataset/ocr/, one
    prompt a line with the text to render in double quotes) and run from the directory that holds dataset/, or
    point --config.prompt_fn / --config.eval_prompt_fn at them. Flow-GRPO evaluates with 40 sampling steps; here the
    evaluation samples with the training steps (10). Not yet run here (no GPU)."""
    config = sd35()
    config.reward_fn = "ocr"
    config.reward_kwargs.ocr = {"engine": "paddleocr"}
    config.prompt_fn = "dataset/ocr/train.txt"
    config.eval_prompt_fn = "dataset/ocr/test.txt"
    config.eval_images_per_prompt = 1
    config.eval_freq = 60
    config.save_freq = 60
    return config


# --- Wan (text-to-video, ddpo_group/diffusion/wan.py; docs/wan.md) ---------------------------------------------


def wan21_t2v_1_3b():
    """Wan 2.1 T2V 1.3B (hub id Wan-AI/Wan2.1-T2V-1.3B-Diffusers) with Flow-GRPO's Wan settings (yifan123/flow_grpo
    config/grpo.py: general_ocr_wan2_1): 33 frames, 20 sampling steps, CFG 4.5, KL weight 0.004 on Flow-GRPO's
    scale, lr 1e-4, clip range 1e-3, 4 videos per prompt, timestep_fraction 0.99 (the last step never trained),
    LoRA; the noise level 0.7 of its "sde" step (its config/base.py). Flow-GRPO samples 240 x 416; a sample here
    is square, 256 x 256 (Flow-Factory's Wan 2.1 training size, 66 k pixels against 100 k). Its reward, video OCR,
    is not built in here: every frame-averaged image reward applies (aesthetic on 4 evenly spaced frames by
    default), a video reward with video=True. The scheduler is the flow-matching Euler one with Wan's 480p
    flow_shift 3.0. Not yet run (no GPU and no hub where it was written)."""
    config = sd35()
    config.pretrained.model = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    config.sample.num_frames = 33  # Flow-GRPO: frames 33
    config.sample.num_steps = 20  # Flow-GRPO: num_steps 20 (eval 50)
    config.sample.guidance_scale = 4.5  # Flow-GRPO: guidance_scale 4.5
    config.sample.resolution = 256  # Flow-GRPO 240 x 416 is not square; Flow-Factory trains Wan 2.1 at 256
    config.sample.max_sequence_length = 512  # WanPipeline's default
    config.sample.group_size = 4  # Flow-GRPO: num_image_per_prompt 4
    config.sample.batch_size = 8  # Flow-GRPO: train_batch_size 8 per GPU
    config.sample.num_batches_per_epoch = 2  # Flow-GRPO: num_batches_per_epoch 2
    config.train.batch_size = 2
    config.train.gradient_accumulation_steps = 4  # one optimizer step per epoch (Flow-GRPO: 2 batches // 2)
    config.train.learning_rate = 1e-4  # Flow-GRPO
    config.train.clip_range = 1e-3  # Flow-GRPO
    config.train.beta = 0.004  # Flow-GRPO, kl_type "flow_grpo" (sd35's)
    config.reward_frames = 4
    return config


def wan21_t2v_14b():
    """Wan 2.1 T2V 14B (hub id Wan-AI/Wan2.1-T2V-14B-Diffusers) with Flow-Factory's Wan 2.1 T2V settings
    (X-GenGroup/Flow-Factory examples/grpo/full/wan21/t2v.yaml): 5 frames of 256 x 256, 10 steps, CFG 5.0,
    flow_shift 3.0, Flow-SDE noise level 0.9, 16 videos per prompt, clip range 1e-4, KL weight 0, lr 1e-4,
    weight decay 1e-4, rewards CLIP score 1.0 + PickScore 0.5 (here per frame on 4 evenly spaced frames, which
    for 5 frames are frames 0, 1, 3, 4). Flow-Factory fine-tunes all 14B weights with FSDP2 on 8 GPUs and noises
    one random step of steps 1-3; here LoRA r32 / alpha 64 on one GPU and every step stochastic (sample.sde_window's
    modes cannot draw from steps 1-3 only). Not yet run (no GPU and no hub where it was written)."""
    config = wan21_t2v_1_3b()
    config.pretrained.model = "Wan-AI/Wan2.1-T2V-14B-Diffusers"
    config.sample.num_frames = 5  # Flow-Factory: num_frames 5
    config.sample.num_steps = 10  # Flow-Factory: num_inference_steps 10
    config.sample.guidance_scale = 5.0  # Flow-Factory: guidance_scale 5.0
    config.sample.eta = 0.9  # Flow-Factory: noise_level 0.9 of Flow-SDE
    config.sample.resolution = 256  # Flow-Factory: resolution 256
    config.sample.group_size = 16  # Flow-Factory: group_size 16
    config.sample.batch_size = 16  # one group per sampling batch
    config.train.batch_size = 2
    config.train.gradient_accumulation_steps = 8  # two optimizer steps per epoch (Flow-Factory: gradient_step_per_epoch 2)
    config.train.clip_range = 1e-4  # Flow-Factory
    config.train.adam_weight_decay = 1e-4  # Flow-Factory
    config.train.use_reference_model = False  # Flow-Factory: kl_beta 0
    config.train.use_kl_loss = False
    config.train.beta = 0.0
    config.reward_fn = ""
    config.reward_weights = {"clip_score": 1.0, "pickscore": 0.5}  # Flow-Factory: CLIP 1.0, PickScore 0.5
    return config


def tiny_wan():
    """A random-weight tiny Wan pipeline (tiny UMT5 and tokenizer built in memory, 3-D VAE): videos of 5 frames of
    32x32 in seconds, for tests and smoke runs; the reward is JPEG compressibility averaged over 3 evenly spaced
    frames (0, 2, 4) of each video."""
    config = _tiny_flow("tiny-wan")
    config.sample.num_frames = 5
    config.reward_frames = 3
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
    "tiny_window4": tiny_window4,
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
    "sd35_ocr": sd35_ocr,  # issue 33: the OCR task
    "wan21_t2v_1_3b": wan21_t2v_1_3b,
    "wan21_t2v_14b": wan21_t2v_14b,
    "tiny_wan": tiny_wan,
}


# ---- sd35_pickscore (issue 33: the PickScore task) ----
def sd35_pickscore():
    """SD3.5-Medium with Flow-GRPO's PickScore settings (yifan123/flow_grpo, config/grpo.py: pickscore_sd3): the sd35
    recipe (Flow-GRPO's geneval_sd3, scaled from 32 GPUs to one) with the PickScore reward on Flow-GRPO's scale
    (exp(logit_scale) x cosine / 26 on the CLIP image processor's input: flow_grpo/pickscore_scorer.py) and KL weight
    0.01 (geneval_sd3: 0.04). Prompts: Flow-GRPO's dataset/pickscore/train.txt (25,432 Pick-a-Pic prompts) and
    test.txt (2,048), not shipped here: run from a directory holding them or pass --config.prompt_fn=PATH
    --config.eval_prompt_fn=PATH; evaluated every 60 epochs as Flow-GRPO (one image per prompt, at the training's
    10 steps where Flow-GRPO's evaluation takes 40). Flow-GRPO's EMA of the LoRA weights and its global std have no
    counterpart here. Not yet run (no GPU and no hub access where it was written)."""
    config = sd35()
    config.reward_fn = "pickscore"
    config.reward_kwargs["pickscore"] = {"divisor": 26.0, "preprocess": "processor"}  # Flow-GRPO's value
    config.train.beta = 0.01  # Flow-GRPO pickscore_sd3: beta 0.01
    config.prompt_fn = "dataset/pickscore/train.txt"  # Flow-GRPO: config.dataset = dataset/pickscore
    config.eval_prompt_fn = "dataset/pickscore/test.txt"
    config.eval_freq = 60  # Flow-GRPO: eval_freq 60, save_freq 60
    config.save_freq = 60
    config.eval_images_per_prompt = 1
    return config


VARIANTS["sd35_pickscore"] = sd35_pickscore


# ---- issue 37: SDXL and the image-editing families (FLUX.1 Kontext, Qwen-Image-Edit) ----
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


def _flow_factory_edit(config):
    """X-GenGroup/Flow-Factory's GRPO LoRA edit recipes (examples/grpo/lora/flux1_kontext/default.yaml and
    qwen_image_edit_plus/default.yaml), scaled to one GPU: LoRA r64 / alpha 128, bf16, 384 px targets and sources,
    10 steps, 16 images per prompt, clip range 1e-4, no KL, lr 3e-4, weight decay 1e-4, two optimizer steps per
    epoch. Both train the SDE at one random step of 1-3 only: not expressible with sample.sde_window's modes, so
    every step is stochastic here. The prompt file's records carry their source image (docs/editing.md); the reward
    is PickScore there (optional extra here), aesthetic as the installed default."""
    config.lora_rank = 64
    config.lora_alpha = 128
    config.prompt_fn = "shapes_edits.jsonl"  # replace with your edit prompts: {"prompt", "source_image"} records
    config.sample.num_steps = 10
    config.sample.resolution = 384
    config.sample.group_size = 16
    config.sample.batch_size = 16
    config.sample.num_batches_per_epoch = 2
    config.train.batch_size = 2
    config.train.gradient_accumulation_steps = 8
    config.train.learning_rate = 3e-4
    config.train.adam_weight_decay = 1e-4
    config.train.clip_range = 1e-4
    config.train.use_reference_model = False
    config.train.use_kl_loss = False
    config.train.beta = 0.0
    return config


def flux_kontext():
    """FLUX.1 Kontext [dev] (hub id black-forest-labs/FLUX.1-Kontext-dev): image editing with Flow-Factory's recipe
    (``_flow_factory_edit``): its guidance embedding 2.5, Flow-SDE noise level 0.9. Not yet run (no GPU, no hub);
    the shipped shapes_edits.jsonl sources are 32 px: give 384 px sources (sample.resolution) of your own."""
    config = _flow_factory_edit(flux())
    config.pretrained.model = "black-forest-labs/FLUX.1-Kontext-dev"
    config.sample.guidance_scale = 2.5  # Flow-Factory / the pipeline's default: the guidance embedding, not CFG
    config.sample.eta = 0.9  # Flow-Factory: Flow-SDE noise_level 0.9
    return config


def tiny_flux_kontext():
    """A random-weight tiny FLUX.1 Kontext pipeline (the tiny FLUX's parts) editing the shipped 32 px shapes-world
    sources of shapes_edits.jsonl, seconds: tests and smoke runs."""
    config = tiny_flux()
    config.pretrained.model = "tiny-flux-kontext"
    config.prompt_fn = "shapes_edits.jsonl"
    config.sample.resolution = 32
    config.sample.guidance_scale = 2.5
    return config


def qwen_image_edit():
    """Qwen-Image-Edit (hub id Qwen/Qwen-Image-Edit; QwenImageEditPipeline, true CFG with the negative prompt " ")
    with Flow-Factory's recipe (``_flow_factory_edit``; its example trains Qwen-Image-Edit-2509 with the same
    settings): true CFG 4, Flow-SDE noise level 1.0. max_sequence_length 512 holds the source's vision tokens
    (a 384 px source: 196) and the prompt. Not yet run (no GPU, no hub); the 20B transformer in bf16 with LoRA
    needs an 80 GB GPU."""
    config = _flow_factory_edit(qwen_image())
    config.pretrained.model = "Qwen/Qwen-Image-Edit"
    config.sample.guidance_scale = 4.0  # Flow-Factory: guidance_scale 4 (true CFG)
    config.sample.eta = 1.0  # Flow-Factory: noise_level 1.0
    config.sample.max_sequence_length = 512
    return config


def tiny_qwen_image_edit():
    """A random-weight tiny Qwen-Image-Edit pipeline (its Qwen2.5-VL vision tower reads the source) editing the
    shipped 32 px shapes-world sources of shapes_edits.jsonl, seconds: tests and smoke runs."""
    config = tiny_qwen_image()
    config.pretrained.model = "tiny-qwen-image-edit"
    config.prompt_fn = "shapes_edits.jsonl"
    config.sample.resolution = 32
    return config


VARIANTS.update({
    "sdxl": sdxl,
    "tiny_sdxl": tiny_sdxl,
    "flux_kontext": flux_kontext,
    "tiny_flux_kontext": tiny_flux_kontext,
    "qwen_image_edit": qwen_image_edit,
    "tiny_qwen_image_edit": tiny_qwen_image_edit,
})
# ---- end of issue 37's SDXL and editing block ----


# ---- GenEval (docs/geneval.md): the task variants of the geneval reward and protocol


def _geneval_task(config, detector_kwargs):
    """The geneval reward (Flow-GRPO's partial score) with `detector_kwargs`, on training prompts generated by
    GenEval's rules (ddpo_group.rewards.geneval.metadata:training_prompts). Set prompt_fn_kwargs.exclude to
    GenEval's prompts/evaluation_metadata.jsonl to drop its evaluation prompts from training ("A and B" ==
    "B and A"), and evaluate with scripts/evaluate.py --protocol geneval --prompts that file."""
    config.reward_fn = "geneval"
    config.reward_kwargs["geneval"] = {"score": "partial", **detector_kwargs}
    config.prompt_fn = "ddpo_group.rewards.geneval.metadata:training_prompts"
    config.prompt_fn_kwargs = {"n_per_tag": 1000, "seed": 0, "exclude": ""}
    return config


def tiny_geneval():
    """The main job (the shipped shapes-world model, GRPO + KL, its lr 2e-4) trained with the geneval reward on
    GenEval records of the tags one object can show (ddpo_group/assets/prompts/geneval_shapes_squares.jsonl: the
    36 square prompts, a small square asks for the shape (single_object), a big one for the shape in its colour
    (colors)); the exact shapes-world detector (docs/geneval.md) stands in for Mask2Former + CLIP. Evaluated as
    the main job every 10 epochs (eval/reward_mean: the partial score, 4 images per prompt) and afterwards with
    scripts/evaluate.py --protocol geneval --checkpoint RUN (GenEval's table)."""
    config = tiny()
    config.prompt_fn = "geneval_shapes_squares.jsonl"
    config.reward_fn = "geneval"
    config.reward_kwargs["geneval"] = {"detector": "shapes", "score": "partial"}
    config.eval_images_per_prompt = 4
    return config


def sd35_geneval():
    """Flow-GRPO's GenEval recipe (yifan123/flow_grpo config/grpo.py geneval_sd3: reward {"geneval": 1.0},
    prompt_fn "geneval", and the SD3.5-M settings `sd35` already takes from it: 10 steps, noise level 0.7, CFG
    4.5, 512 px, 24 images per prompt, KL 0.04, lr 3e-4, clip range 1e-4, LoRA r32) with the reward as Flow-GRPO
    computes it: the partial score of yifan123/reward-server gen_eval.py on images sent as JPEG (PIL quality 75),
    the detector Mask2Former Swin-S and CLIP ViT-L/14 (here through transformers; docs/geneval.md says where
    they differ from the mmdetection checkpoint). Flow-GRPO evaluates every 60 epochs with 40 steps; here the
    evaluation uses the training steps (10): measure with scripts/evaluate.py --protocol geneval --num-steps 40."""
    config = _geneval_task(sd35(), {"detector": "mask2former", "jpeg_quality": 75})
    config.save_freq = 60  # Flow-GRPO geneval_sd3: save_freq 60, eval_freq 60
    config.eval_freq = 60
    return config


def sd35_nft_geneval():
    """DiffusionNFT's GenEval recipe (arXiv 2509.16117; NVlabs/DiffusionNFT config/nft.py sd3_geneval: reward
    {"geneval": 1.0}, the GenEval prompts, one optimizer step per epoch, KL weight 1e-4, CFG-free, deterministic
    sampler) on `sd35_nft`'s settings, with the partial score computed in-process (DiffusionNFT's
    flow_grpo/gen_eval.py: no JPEG round trip)."""
    return _geneval_task(sd35_nft(), {"detector": "mask2former", "jpeg_quality": 0})


VARIANTS.update({"tiny_geneval": tiny_geneval, "sd35_geneval": sd35_geneval, "sd35_nft_geneval": sd35_nft_geneval})


def tiny_scenes():
    """The second main job: Flow-GRPO's GenEval recipe (yifan123/flow_grpo config/grpo.py geneval_sd3: the geneval
    partial score, generated GenEval prompts without the evaluation set's, the "sde" sampler with noise level 0.7,
    10 steps, CFG 4.5, KL 0.04 on Flow-GRPO's scale, the last step never trained) scaled to the shipped flow model
    tiny-scenes-sd3 (64-px scenes of one to four shapes, docs/scenes.md): the whole 0.9M-parameter transformer
    trained (no LoRA), 8 images per prompt, 64 per epoch, lr 2e-4 and clip range 1e-2 as the main job, the exact
    shapes-world detector for Mask2Former + CLIP. Evaluated every 10 epochs on the held-out set
    (assets/prompts/geneval_scenes.jsonl, 150 records, 2 fixed-noise images each): eval/geneval/<tag> and
    eval/geneval/overall are GenEval's table; scripts/evaluate.py --protocol geneval gives it with 4 images."""
    config = _tiny_common(base.get_config())
    config.pretrained.model = "tiny-scenes-sd3"
    config.reward_fn = "geneval"
    config.reward_kwargs["geneval"] = {"detector": "shapes", "score": "partial"}
    config.prompt_fn = "ddpo_group.data.scenes:scene_training_prompts"
    config.prompt_fn_kwargs = {"n_per_tag": 100, "seed": 0}
    config.eval_prompt_fn = "geneval_scenes.jsonl"
    config.eval_freq = 10
    config.eval_images_per_prompt = 2
    config.eval_batch_size = 100
    config.num_epochs = 40
    config.save_freq = 20
    config.log_images_every = 10
    config.sample.num_steps = 10
    config.sample.eta = 0.7
    config.sample.sde_type = "sde"
    config.sample.guidance_scale = 4.5
    config.sample.resolution = 64
    config.sample.max_sequence_length = 16
    config.sample.group_size = 8
    config.train.learning_rate = 2e-4
    config.train.clip_range = 1e-2
    config.algorithm.adv_estimator = "grpo"
    config.train.use_reference_model = True
    config.train.use_kl_loss = True
    config.train.beta = 0.04
    config.train.kl_type = "flow_grpo"
    config.train.skip_last_steps = 1
    return config


def tiny_scenes_sd():
    """tiny_scenes's task, prompts, reward and evaluation on the shipped UNet + DDIM scenes model tiny-scenes, with
    the main job's method (GRPO + KL, DDIM with eta 1, guidance 5 as its pretraining's evaluation); the family
    where DDPO and Algorithm 2 run."""
    config = tiny_scenes()
    config.pretrained.model = "tiny-scenes"
    config.sample.eta = 1.0
    config.sample.sde_type = ""
    config.sample.guidance_scale = 5.0
    config.sample.max_sequence_length = 0
    config.sample.resolution = 0
    config.train.kl_type = "gaussian"
    config.train.beta = 0.01  # the main job's KL weight on its (Gaussian) scale
    config.train.skip_last_steps = 0
    return config


VARIANTS.update({"tiny_scenes": tiny_scenes, "tiny_scenes_sd": tiny_scenes_sd})

def get_config(name="sd15"):
    if name not in VARIANTS:
        raise ValueError(f"unknown config variant {name!r} in config/grpo.py; choose one of {sorted(VARIANTS)}")
    config = VARIANTS[name]()
    config.variant = name  # kept in the run's config.json: the report's headline names the variant
    return config


from ddpo_group.config.next_misc_variants import NEXT_MISC_DESCRIPTIONS, NEXT_MISC_VARIANTS  # noqa: E402,F401  issue 46
VARIANTS.update(NEXT_MISC_VARIANTS)
