"""Variants of the newest Wan models (issue 46): Wan 2.2 A14B's two experts (ddpo_group/diffusion/wan_moe.py) and
Wan image-to-video (wan_i2v.py); docs/wan.md. They build on video_edit.py's Wan 2.1 variants.

The published presets follow X-GenGroup/Flow-Factory's GRPO LoRA recipes (examples/grpo/lora/wan22/t2v.yaml,
wan22/i2v.yaml, wan21/i2v.yaml); none has been run here (no GPU, no hub where they were written). Flow-Factory
noises one random step of steps 1-3 (sde_steps [1, 2, 3]); sample.sde_window's modes cannot draw from those steps
only, so every step is stochastic here, as in wan21_t2v_14b.
"""

from ddpo_group.config.variants.video_edit import tiny_wan, wan21_t2v_14b


def wan22_a14b_t2v():
    """GRPO on Wan 2.2 T2V A14B (two experts, both trained) with Flow-Factory's Wan 2.2 T2V LoRA recipe.

    Hub id Wan-AI/Wan2.2-T2V-A14B-Diffusers (two 14B experts, boundary_ratio 0.875);
    Flow-Factory's Wan 2.2 T2V LoRA recipe (examples/grpo/lora/wan22/t2v.yaml): LoRA r64 / alpha 128 on both experts
    (target_components ['transformer', 'transformer_2']), 5 frames of 480 x 480, 10 steps, CFG 4.0 for the
    high-noise expert and guidance_scale_2 3.0 for the low-noise one, Flow-SDE noise 0.9, 16 videos per prompt,
    clip range 1e-4, no KL, lr 1e-4, weight decay 1e-4, PickScore (per frame on 4 evenly spaced frames here)."""
    config = wan21_t2v_14b()
    config.pretrained.model = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    config.mixed_precision = "bf16"  # Flow-Factory: bf16
    config.lora_rank, config.lora_alpha = 64, 128  # Flow-Factory: lora_rank 64, lora_alpha 128
    config.train.experts = "both"  # Flow-Factory: target_components ['transformer', 'transformer_2']
    config.sample.resolution = 480  # Flow-Factory: resolution 480
    config.sample.guidance_scale = 4.0  # Flow-Factory: guidance_scale 4.0
    config.sample.guidance_scale_2 = 3.0  # Flow-Factory: guidance_scale_2 3.0
    config.train.batch_size = 1  # Flow-Factory: per_device_batch_size 1
    config.train.gradient_accumulation_steps = 16  # two optimizer steps per epoch (gradient_step_per_epoch 2)
    config.reward_weights = {"pickscore": 1.0}  # Flow-Factory: PickScore, weight 1
    return config


def _image_to_video(config):
    """The I2V prompt file: records {"prompt", "source_image"} (docs/wan.md); the shipped shapes_edits.jsonl
    sources are 32 px: give sources of sample.resolution of your own (Flow-Factory: sharegpt4o_image_mini)."""
    config.prompt_fn = "shapes_edits.jsonl"
    config.eval_prompt_fn = ""
    return config


def wan21_i2v():
    """GRPO on Wan 2.1 I2V 14B (image-to-video: source_image is the first frame) with Flow-Factory's recipe.

    Hub id Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (CLIP ViT-H image encoder);
    Flow-Factory's Wan 2.1 I2V LoRA recipe (examples/grpo/lora/wan21/i2v.yaml): LoRA r64 / alpha 128, 5 frames
    of 240 x 240 from the prompt's first frame (source_image), 10 steps, CFG 5.0, Flow-SDE noise 0.9, 16 videos
    per prompt, clip range 1e-4, no KL, lr 1e-4, PickScore."""
    config = _image_to_video(wan22_a14b_t2v())
    config.pretrained.model = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
    config.train.experts = "both"  # one transformer
    config.sample.resolution = 240  # Flow-Factory: resolution 240
    config.sample.guidance_scale = 5.0  # Flow-Factory: guidance_scale 5.0
    config.sample.guidance_scale_2 = 0.0  # one transformer
    return config


def wan22_i2v():
    """GRPO on Wan 2.2 I2V A14B (image-to-video, the high-noise expert trained) with Flow-Factory's recipe.

    Hub id Wan-AI/Wan2.2-I2V-A14B-Diffusers (two experts, boundary_ratio 0.9, no image encoder);
    Flow-Factory's Wan 2.2 I2V LoRA recipe (examples/grpo/lora/wan22/i2v.yaml): LoRA r64 / alpha 128 on the
    high-noise expert only (target_modules "transformer.default"), 5 frames of 480 x 480, 8 steps, CFG 3.5 for both
    experts, Flow-SDE noise 0.9, 16 videos per prompt, clip range 1e-4, no KL, lr 1e-4, PickScore."""
    config = _image_to_video(wan22_a14b_t2v())
    config.pretrained.model = "Wan-AI/Wan2.2-I2V-A14B-Diffusers"
    config.train.experts = "high"  # Flow-Factory: target_modules "transformer.default"
    config.sample.num_steps = 8  # Flow-Factory: num_inference_steps 8
    config.sample.guidance_scale = 3.5  # Flow-Factory: guidance_scale 3.5 (no guidance_scale_2: the same)
    config.sample.guidance_scale_2 = 0.0
    return config


def tiny_wan22_moe():
    """a random-weight tiny Wan 2.2 A14B (two experts, both trained, CFG 4.5 then 3.0), seconds; tests and smoke checks

    Two tiny experts, the boundary at t = 700: 2 of the 4 steps each; videos of 5 frames of 32x32 in seconds, tests and smoke runs."""
    config = tiny_wan()
    config.pretrained.model = "tiny-wan22-moe"
    config.sample.guidance_scale_2 = 3.0
    return config


def tiny_wan_i2v():
    """a random-weight tiny Wan 2.1 I2V (the first frame from source_image), seconds; tests and smoke checks

    A tiny CLIP image encoder; animating the shipped 32 px shapes-world
    sources of shapes_edits.jsonl (source_image: the first frame), seconds: tests and smoke runs."""
    config = _image_to_video(tiny_wan())
    config.pretrained.model = "tiny-wan-i2v"
    config.sample.resolution = 32
    return config


def tiny_wan22_i2v():
    """tiny_wan_i2v as Wan 2.2 A14B I2V (two experts, the high-noise one trained), seconds; tests and smoke checks

    Two tiny experts and no image encoder; the high-noise expert trained as in wan22_i2v."""
    config = tiny_wan_i2v()
    config.pretrained.model = "tiny-wan22-i2v"
    config.train.experts = "high"
    return config

