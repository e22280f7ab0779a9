"""The variants of the newest image families (issue 46): FLUX.2 [dev] and [klein] (ddpo_group/diffusion/flux2.py),
Z-Image and Z-Image-Turbo (ddpo_group/diffusion/zimage.py); docs/flux2_zimage.md. ``NEXT_IMAGE_VARIANTS`` maps each
name to its function; the variants' module adds them to its ``VARIANTS``.

The full-size presets follow X-GenGroup/Flow-Factory's GRPO LoRA examples (examples/grpo/lora/<model>/*.yaml), scaled
to one GPU as the Qwen-Image preset is: one group per sampling batch, two optimizer steps per epoch. Flow-Factory
noises one step per trajectory drawn from a short list of early steps (its scheduler.sde_steps); sample.sde_window
cannot draw from a subset, so these presets make every step of that list stochastic instead (a fixed window).
None has been run here (no GPU and no hub access where they were written).
"""


def _grpo():
    from ddpo_group.config import grpo  # here: the variants' module imports this one

    return grpo


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


def _window(config, first, last):
    """Steps first..last stochastic, the others ODE steps (Flow-Factory's sde_steps list, every one of them)."""
    config.sample.sde_window_size = last - first + 1
    config.sample.sde_window = "fixed"
    config.sample.sde_window_start = first
    return config


def flux2():
    """FLUX.2 [dev] (black-forest-labs/FLUX.2-dev, 32B) with Flow-Factory's GRPO LoRA recipe (examples/grpo/lora/flux2/t2i.yaml)."""
    config = _flow_factory_lora(_grpo().sd35())
    config.pretrained.model = "black-forest-labs/FLUX.2-dev"
    config.sample.num_steps = 8  # num_inference_steps 8
    config.sample.eta = 1.0  # Flow-SDE noise_level 1.0
    config.sample.guidance_scale = 4.0  # guidance_scale 4: FLUX.2 [dev]'s guidance embedding, not CFG
    config.sample.resolution = 512
    config.sample.max_sequence_length = 512  # Flux2Pipeline's default
    config.reward_fn = ""
    config.reward_weights = {"clip_score": 1.0, "pickscore": 0.5}  # its rewards: CLIP 1.0, PickScore 0.5
    return _window(config, 1, 3)  # sde_steps [1, 2, 3]


def flux2_klein():
    """FLUX.2 [klein] 9B, step-distilled (black-forest-labs/FLUX.2-klein-9B): Flow-Factory's GRPO LoRA recipe (examples/grpo/lora/flux2_klein/default.yaml)."""
    config = _flow_factory_lora(_grpo().sd35())
    config.pretrained.model = "black-forest-labs/FLUX.2-klein-9B"
    config.sample.num_steps = 4  # num_inference_steps 4: klein is distilled to 4 steps
    config.sample.eta = 0.5  # Flow-SDE noise_level 0.5
    config.sample.guidance_scale = 1.0  # no CFG (the distilled pipeline ignores guidance anyway)
    config.sample.resolution = 384
    config.sample.max_sequence_length = 512  # Flux2KleinPipeline's default
    config.reward_fn = "pickscore"  # its reward: PickScore
    config.train.skip_last_steps = 0  # the window (steps 1-2) never reaches the last step
    return _window(config, 1, 2)  # sde_steps [1, 2]


def zimage():
    """Z-Image (Tongyi-MAI/Z-Image, 6B) with Flow-Factory's GRPO LoRA recipe (examples/grpo/lora/z_image/default.yaml); CFG 5 here is the pipeline's guidance 4."""
    config = _flow_factory_lora(_grpo().sd35())
    config.pretrained.model = "Tongyi-MAI/Z-Image"
    config.sample.num_steps = 10  # num_inference_steps 10
    config.sample.eta = 0.7  # Flow-SDE noise_level 0.7
    config.sample.guidance_scale = 5.0  # its guidance_scale 4 is the pipeline's g of pos + g (pos - neg): w = g + 1
    config.sample.resolution = 512
    config.sample.max_sequence_length = 512  # ZImagePipeline's default
    config.reward_fn = "pickscore"  # its reward: PickScore
    config.train.skip_last_steps = 0  # the window (steps 1-3) never reaches the last step
    return _window(config, 1, 3)  # sde_steps [1, 2, 3]


def zimage_turbo():
    """Z-Image-Turbo (Tongyi-MAI/Z-Image-Turbo): 8 steps, no CFG, Flow-Factory's GRPO LoRA recipe for it (examples/grpo/lora/z_image_turbo/default.yaml)."""
    config = zimage()
    config.pretrained.model = "Tongyi-MAI/Z-Image-Turbo"
    # the model card's and diffusers' 8 steps (Flow-Factory samples 6 for training, 10 for evaluation)
    config.sample.num_steps = 8
    config.sample.guidance_scale = 1.0  # guidance_scale 0: distilled, no CFG
    return config  # noise level 0.7, steps 1-3 stochastic, no KL, as zimage (the same recipe file's values)


def _tiny(model):
    config = _grpo()._tiny_flow(model)
    config.sample.max_sequence_length = 32
    return config


def tiny_flux2():
    """A random-weight tiny FLUX.2 [dev] pipeline (tiny Mistral-3 and tokenizer built in memory), seconds: tests and smoke runs."""
    config = _tiny("tiny-flux2")
    config.sample.guidance_scale = 4.0  # the guidance embedding, not CFG
    config.sample.max_sequence_length = 64  # the tiny tokenizer's system message takes about 45 tokens
    return config


def tiny_flux2_klein():
    """A random-weight tiny FLUX.2 [klein] base pipeline (tiny Qwen3 and tokenizer built in memory; true CFG 4.5), seconds: tests and smoke runs."""
    return _tiny("tiny-flux2-klein")


def tiny_zimage():
    """A random-weight tiny Z-Image pipeline (tiny Qwen3 and tokenizer built in memory; CFG 4.5 = the pipeline's guidance 3.5), seconds: tests and smoke runs."""
    return _tiny("tiny-zimage")


def tiny_zimage_turbo():
    """zimage_turbo's sampling on the random-weight tiny Z-Image: 8 steps, no CFG, steps 1-3 stochastic, no KL, seconds."""
    config = _tiny("tiny-zimage")
    turbo = zimage_turbo()
    for field in ("num_steps", "eta", "guidance_scale", "sde_window_size", "sde_window", "sde_window_start"):
        config.sample[field] = turbo.sample[field]
    for field in ("use_reference_model", "use_kl_loss", "beta", "skip_last_steps"):
        config.train[field] = turbo.train[field]
    return config


NEXT_IMAGE_VARIANTS = {
    "flux2": flux2,
    "flux2_klein": flux2_klein,
    "tiny_flux2": tiny_flux2,
    "tiny_flux2_klein": tiny_flux2_klein,
    "zimage": zimage,
    "zimage_turbo": zimage_turbo,
    "tiny_zimage": tiny_zimage,
    "tiny_zimage_turbo": tiny_zimage_turbo,
}
