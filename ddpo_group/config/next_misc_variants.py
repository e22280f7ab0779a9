"""The variants of issue 46's newest families (Qwen-Image-Edit-2509 / 2511, SANA, ...): NEXT_MISC_VARIANTS, name ->
function returning the config, merged into config/grpo.py's VARIANTS by its last line; NEXT_MISC_DESCRIPTIONS,
name -> the one-line description ``ddpo-group-train --help`` shows (grpo.py's docstring list).

    qwen_image_edit_plus  GRPO multi-image editing on Qwen-Image-Edit-2509 (true CFG 4) with Flow-Factory's settings, LoRA r64
    tiny_qwen_image_edit_plus  a random-weight tiny Qwen-Image-Edit-2509 editing two shipped shapes-world sources per prompt, seconds

The functions import grpo.py's lazily (grpo.py imports this module at its end).
"""


def qwen_image_edit_plus():
    """Qwen-Image-Edit-2509 (hub id Qwen/Qwen-Image-Edit-2509, or Qwen/Qwen-Image-Edit-2511; QwenImageEditPlusPipeline)
    with Flow-Factory's recipe (X-GenGroup/Flow-Factory examples/grpo/lora/qwen_image_edit_plus/default.yaml, as
    ``qwen_image_edit``: LoRA r64 / alpha 128, 384 px, 10 steps, true CFG 4, Flow-SDE noise level 1.0, 16 images per
    prompt, clip range 1e-4, no KL, lr 3e-4). Each prompt record lists its sources in ``source_images`` (1 to 3,
    the same number per run); max_sequence_length 1024 (the model's limit) holds up to three 384 px sources' vision
    tokens (196 each) and the prompt. Flow-Factory samples one prompt per device batch (the pipeline takes one);
    here a batch holds several, each encoded alone. Not yet run (no GPU, no hub); the shipped
    shapes_edits_two_sources.jsonl sources are 32 px: give 384 px sources (sample.resolution) of your own."""
    from ddpo_group.config import grpo

    config = grpo.qwen_image_edit()
    config.pretrained.model = "Qwen/Qwen-Image-Edit-2509"
    config.prompt_fn = "shapes_edits_two_sources.jsonl"  # replace with your own {"prompt", "source_images"} records
    config.sample.max_sequence_length = 1024
    return config


def tiny_qwen_image_edit_plus():
    """A random-weight tiny Qwen-Image-Edit-2509 pipeline (its Qwen2.5-VL vision tower reads every source) editing two
    shipped 32 px shapes-world sources per prompt (shapes_edits_two_sources.jsonl: picture 1's shape and background
    in picture 2's colour), seconds: tests and smoke runs."""
    from ddpo_group.config import grpo

    config = grpo.tiny_qwen_image_edit()
    config.pretrained.model = "tiny-qwen-image-edit-plus"
    config.prompt_fn = "shapes_edits_two_sources.jsonl"
    config.sample.max_sequence_length = 64  # two sources' 2 x (4 vision + 2 + "Picture k: ") tokens and the prompt
    return config


NEXT_MISC_VARIANTS = {
    "qwen_image_edit_plus": qwen_image_edit_plus,
    "tiny_qwen_image_edit_plus": tiny_qwen_image_edit_plus,
}

NEXT_MISC_DESCRIPTIONS = {
    line.split()[0]: line.split(None, 1)[1]
    for line in (__doc__ or "").splitlines()
    if line.startswith("    ") and line.split() and line.split()[0] in NEXT_MISC_VARIANTS
}
