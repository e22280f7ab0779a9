"""Families beyond text-to-image: text-to-video with Wan 2.1 (wan21_t2v_1_3b, wan21_t2v_14b, tiny_wan; docs/wan.md)
and image editing with FLUX.1 Kontext and Qwen-Image-Edit on Flow-Factory's recipe (flux_kontext, qwen_image_edit,
their tiny pipelines editing the shipped shapes-world sources; docs/editing.md).
"""

from ddpo_group.config.variants.flow import _tiny_flow, flux, qwen_image, sd35, tiny_flux, tiny_qwen_image


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
