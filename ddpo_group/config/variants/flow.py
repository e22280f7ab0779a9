"""The flow-matching image families (docs/flow.md): SD3.5-Medium with Flow-GRPO's settings (sd35) and DiffusionNFT's
(sd35_nft), FLUX.1-dev, Qwen-Image (docs/qwen_image.md), FLUX.2 [dev] / [klein] and Z-Image(-Turbo) with Flow-Factory's
recipes (docs/flux2_zimage.md), and their random-weight tiny pipelines (tiny_sd3, tiny_flux, tiny_qwen_image,
tiny_flux2, tiny_flux2_klein, tiny_zimage, tiny_zimage_turbo) for tests and smoke runs.
"""

from ddpo_group.config import base
from ddpo_group.config.variants._methods import _diffusion_nft, _dgpo, _dpo
from ddpo_group.config.variants.tiny import test


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


def tiny_sd_flow():
    """A random-weight tiny SD UNet stepped by flow matching (the sd_flow family: SD3's scheduler, CLIP's fixed
    length, no T5 tokens to count), seconds: tests and smoke runs."""
    config = _tiny_flow("tiny-sd-flow")
    config.sample.max_sequence_length = 0
    return config


def tiny_sd3_dppo():
    """tiny_sd3 with Flow-DPPO's loss (train.policy_loss "dppo"): tests and smoke runs."""
    config = tiny_sd3()
    config.train.policy_loss = "dppo"
    return config


def tiny_sd3_grpo_guard():
    """tiny_sd3 with GRPO-Guard's loss (train.policy_loss "grpo_guard"): tests and smoke runs."""
    config = tiny_sd3()
    config.train.policy_loss = "grpo_guard"
    return config


def tiny_sd3_dgpo():
    """tiny_sd3 trained with DGPO (``_dgpo``) on samples of the deterministic flow ODE (noise level 0), as the paper
    samples; seconds: tests and smoke runs."""
    config = _dgpo(tiny_sd3())
    config.sample.eta = 0.0
    config.forward.num_timesteps = 2  # of the 4 sampling steps
    return config


def tiny_sd3_dpo():
    """tiny_sd3 trained with Diffusion-DPO's online pairs (``_dpo``); seconds: tests and smoke runs."""
    config = _dpo(tiny_sd3())
    config.forward.num_timesteps = 2  # of the 4 sampling steps
    return config


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


# The newest image families (issue 46; docs/flux2_zimage.md): FLUX.2 [dev] and [klein] (diffusion/flux2.py), Z-Image and
# Z-Image-Turbo (diffusion/zimage.py). The full-size presets follow X-GenGroup/Flow-Factory's GRPO LoRA examples
# (examples/grpo/lora/<model>/*.yaml), scaled to one GPU as the Qwen-Image preset is: one group per sampling batch,
# two optimizer steps per epoch. Flow-Factory noises one step per trajectory drawn from a short list of early steps
# (its scheduler.sde_steps); sample.sde_window cannot draw from a subset, so these presets make every step of that
# list stochastic instead (a fixed window). None has been run here (no GPU, no hub).


def _flow_factory_lora(config):
    """What Flow-Factory's GRPO LoRA examples share: LoRA r64 / alpha 128, lr 3e-4, weight decay 1e-4, clip range 1e-4,
    no KL (kl_beta 0), 16 images per prompt, two optimizer steps per epoch."""
    config.lora_rank = 64
    config.lora_alpha = 128
    config.sample.sde_type = "sde"  # Flow-Factory: dynamics_type Flow-SDE
    config.sample.negative_prompt = ""
    config.sample.group_size = 16
    config.sample.batch_size = 16  # one group per sampling batch on one GPU
    config.sample.num_batches_per_epoch = 2
    config.train.batch_size = 2
    config.train.gradient_accumulation_steps = 8  # two optimizer steps per epoch (gradient_step_per_epoch 2)
    config.train.learning_rate = 3e-4
    config.train.adam_weight_decay = 1e-4
    config.train.clip_range = 1e-4
    config.train.use_reference_model = False  # kl_beta 0
    config.train.use_kl_loss = False
    config.train.beta = 0.0
    return config


def _fixed_window(config, first, last):
    """Steps first..last stochastic, the others ODE steps (Flow-Factory's sde_steps list, every one of them)."""
    config.sample.sde_window_size = last - first + 1
    config.sample.sde_window = "fixed"
    config.sample.sde_window_start = first
    return config


def flux2():
    """FLUX.2 [dev] (32B) with Flow-Factory's GRPO LoRA recipe, one GPU.

    black-forest-labs/FLUX.2-dev; X-GenGroup/Flow-Factory examples/grpo/lora/flux2/t2i.yaml."""
    config = _flow_factory_lora(sd35())
    config.pretrained.model = "black-forest-labs/FLUX.2-dev"
    config.sample.num_steps = 8  # num_inference_steps 8
    config.sample.eta = 1.0  # Flow-SDE noise_level 1.0
    config.sample.guidance_scale = 4.0  # guidance_scale 4: FLUX.2 [dev]'s guidance embedding, not CFG
    config.sample.resolution = 512
    config.sample.max_sequence_length = 512  # Flux2Pipeline's default
    config.reward_fn = ""
    config.reward_weights = {"clip_score": 1.0, "pickscore": 0.5}  # its rewards: CLIP 1.0, PickScore 0.5
    return _fixed_window(config, 1, 3)  # sde_steps [1, 2, 3]


def flux2_klein():
    """FLUX.2 [klein] 9B (step-distilled, 4 steps) with Flow-Factory's GRPO LoRA recipe, one GPU.

    black-forest-labs/FLUX.2-klein-9B; X-GenGroup/Flow-Factory examples/grpo/lora/flux2_klein/default.yaml."""
    config = _flow_factory_lora(sd35())
    config.pretrained.model = "black-forest-labs/FLUX.2-klein-9B"
    config.sample.num_steps = 4  # num_inference_steps 4: klein is distilled to 4 steps
    config.sample.eta = 0.5  # Flow-SDE noise_level 0.5
    config.sample.guidance_scale = 1.0  # no CFG (the distilled pipeline ignores guidance anyway)
    config.sample.resolution = 384
    config.sample.max_sequence_length = 512  # Flux2KleinPipeline's default
    config.reward_fn = "pickscore"  # its reward: PickScore
    config.train.skip_last_steps = 0  # the window (steps 1-2) never reaches the last step
    return _fixed_window(config, 1, 2)  # sde_steps [1, 2]


def zimage():
    """Z-Image (6B) with Flow-Factory's GRPO LoRA recipe, one GPU; CFG 5 here is the pipeline's guidance 4.

    Tongyi-MAI/Z-Image; X-GenGroup/Flow-Factory examples/grpo/lora/z_image/default.yaml."""
    config = _flow_factory_lora(sd35())
    config.pretrained.model = "Tongyi-MAI/Z-Image"
    config.sample.num_steps = 10  # num_inference_steps 10
    config.sample.eta = 0.7  # Flow-SDE noise_level 0.7
    config.sample.guidance_scale = 5.0  # its guidance_scale 4 is the pipeline's g of pos + g (pos - neg): w = g + 1
    config.sample.resolution = 512
    config.sample.max_sequence_length = 512  # ZImagePipeline's default
    config.reward_fn = "pickscore"  # its reward: PickScore
    config.train.skip_last_steps = 0  # the window (steps 1-3) never reaches the last step
    return _fixed_window(config, 1, 3)  # sde_steps [1, 2, 3]


def zimage_turbo():
    """Z-Image-Turbo: 8 steps, no CFG, steps 1-3 stochastic, no KL (Flow-Factory's recipe for it), one GPU.

    Tongyi-MAI/Z-Image-Turbo; X-GenGroup/Flow-Factory examples/grpo/lora/z_image_turbo/default.yaml: its noise level
    0.7, SDE steps [1, 2, 3], kl_beta 0, LoRA and optimizer are zimage's. Steps: the model card's and diffusers' 8
    (Flow-Factory samples 6 for training, 10 for evaluation)."""
    config = zimage()
    config.pretrained.model = "Tongyi-MAI/Z-Image-Turbo"
    config.sample.num_steps = 8
    config.sample.guidance_scale = 1.0  # its guidance_scale 0: distilled, no CFG
    return config


def _tiny_chat_flow(model):
    config = _tiny_flow(model)
    config.sample.max_sequence_length = 32
    return config


def tiny_flux2():
    """A random-weight tiny FLUX.2 [dev] (tiny Mistral-3 built in memory), seconds: tests and smoke runs."""
    config = _tiny_chat_flow("tiny-flux2")
    config.sample.guidance_scale = 4.0  # the guidance embedding, not CFG
    config.sample.max_sequence_length = 64  # the tiny tokenizer's system message takes about 45 tokens
    return config


def tiny_flux2_klein():
    """A random-weight tiny FLUX.2 [klein] base (tiny Qwen3 in memory, true CFG 4.5), seconds: tests and smoke runs."""
    return _tiny_chat_flow("tiny-flux2-klein")


def tiny_zimage():
    """A random-weight tiny Z-Image (tiny Qwen3 built in memory, CFG 4.5), seconds: tests and smoke runs."""
    return _tiny_chat_flow("tiny-zimage")


def tiny_zimage_turbo():
    """zimage_turbo's sampling and KL on the random-weight tiny Z-Image (8 steps, no CFG, SDE steps 1-3), seconds."""
    config = _tiny_chat_flow("tiny-zimage")
    turbo = zimage_turbo()
    for field in ("num_steps", "eta", "guidance_scale", "sde_window_size", "sde_window", "sde_window_start"):
        config.sample[field] = turbo.sample[field]
    for field in ("use_reference_model", "use_kl_loss", "beta", "skip_last_steps"):
        config.train[field] = turbo.train[field]
    return config
