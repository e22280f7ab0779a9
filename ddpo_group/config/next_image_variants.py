"""The variants of the newest image families (issue 46): FLUX.2 [dev] and [klein] (ddpo_group/diffusion/flux2.py),
Z-Image and Z-Image-Turbo (ddpo_group/diffusion/zimage.py); docs/flux2_zimage.md.

``next_image_variants(sd35, tiny_flow)`` returns ``{name: variant function}`` (``NEXT_IMAGE_VARIANTS`` lists the
names). The variants build on two presets of the variants' module, which passes them in (this module cannot import
that one, which imports it: an import circle): ``sd35`` (the full-size flow preset whose task, reward and evaluation
the full-size presets keep) and ``tiny_flow(model)`` (the tiny flow variants' base).

The full-size presets follow X-GenGroup/Flow-Factory's GRPO LoRA examples (examples/grpo/lora/<model>/*.yaml), scaled
to one GPU as the Qwen-Image preset is: one group per sampling batch, two optimizer steps per epoch. Flow-Factory
noises one step per trajectory drawn from a short list of early steps (its scheduler.sde_steps); sample.sde_window
cannot draw from a subset, so these presets make every step of that list stochastic instead (a fixed window).
None has been run here (no GPU and no hub access where they were written).
"""

import inspect


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


def flux2(sd35):
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
    return _window(config, 1, 3)  # sde_steps [1, 2, 3]


def flux2_klein(sd35):
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
    return _window(config, 1, 2)  # sde_steps [1, 2]


def zimage(sd35):
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
    return _window(config, 1, 3)  # sde_steps [1, 2, 3]


def zimage_turbo(sd35):
    """Z-Image-Turbo: 8 steps, no CFG, steps 1-3 stochastic, no KL (Flow-Factory's recipe for it), one GPU.

    Tongyi-MAI/Z-Image-Turbo; X-GenGroup/Flow-Factory examples/grpo/lora/z_image_turbo/default.yaml: its noise level
    0.7, SDE steps [1, 2, 3], kl_beta 0, LoRA and optimizer are zimage's. Steps: the model card's and diffusers' 8
    (Flow-Factory samples 6 for training, 10 for evaluation)."""
    config = zimage(sd35)
    config.pretrained.model = "Tongyi-MAI/Z-Image-Turbo"
    config.sample.num_steps = 8
    config.sample.guidance_scale = 1.0  # its guidance_scale 0: distilled, no CFG
    return config


def _tiny(tiny_flow, model):
    config = tiny_flow(model)
    config.sample.max_sequence_length = 32
    return config


def tiny_flux2(tiny_flow):
    """A random-weight tiny FLUX.2 [dev] (tiny Mistral-3 built in memory), seconds: tests and smoke runs."""
    config = _tiny(tiny_flow, "tiny-flux2")
    config.sample.guidance_scale = 4.0  # the guidance embedding, not CFG
    config.sample.max_sequence_length = 64  # the tiny tokenizer's system message takes about 45 tokens
    return config


def tiny_flux2_klein(tiny_flow):
    """A random-weight tiny FLUX.2 [klein] base (tiny Qwen3 in memory, true CFG 4.5), seconds: tests and smoke runs."""
    return _tiny(tiny_flow, "tiny-flux2-klein")


def tiny_zimage(tiny_flow):
    """A random-weight tiny Z-Image (tiny Qwen3 built in memory, CFG 4.5), seconds: tests and smoke runs."""
    return _tiny(tiny_flow, "tiny-zimage")


def tiny_zimage_turbo(tiny_flow, sd35):
    """zimage_turbo's sampling and KL on the random-weight tiny Z-Image (8 steps, no CFG, SDE steps 1-3), seconds."""
    config = _tiny(tiny_flow, "tiny-zimage")
    turbo = zimage_turbo(sd35)
    for field in ("num_steps", "eta", "guidance_scale", "sde_window_size", "sde_window", "sde_window_start"):
        config.sample[field] = turbo.sample[field]
    for field in ("use_reference_model", "use_kl_loss", "beta", "skip_last_steps"):
        config.train[field] = turbo.train[field]
    return config


VARIANT_FUNCTIONS = {fn.__name__: fn for fn in (
    flux2, flux2_klein, zimage, zimage_turbo, tiny_flux2, tiny_flux2_klein, tiny_zimage, tiny_zimage_turbo,
)}
NEXT_IMAGE_VARIANTS = tuple(VARIANT_FUNCTIONS)


def next_image_variants(sd35, tiny_flow):
    """{name: variant function (no arguments)} of this module's variants, built on `sd35` and `tiny_flow`."""
    presets = {"sd35": sd35, "tiny_flow": tiny_flow}

    def bind(fn):
        def variant():
            return fn(**{name: presets[name] for name in inspect.signature(fn).parameters})

        variant.__name__, variant.__qualname__, variant.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        return variant

    return {name: bind(fn) for name, fn in VARIANT_FUNCTIONS.items()}
