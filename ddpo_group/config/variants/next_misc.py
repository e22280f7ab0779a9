"""Issue 46's newest families beside flow.py's and video_edit.py's: multi-image editing on Qwen-Image-Edit-2509 /
2511 (ddpo_group/diffusion/qwen_image.py), SANA (sana.py), HunyuanVideo 1.5 text- and image-to-video
(hunyuan_video15.py), LTX-2's tiny twin (ltx2.py); docs/next_families.md. They build on flow.py's and
video_edit.py's presets.
"""

from ddpo_group.config.variants.flow import _fixed_window, _flow_factory_lora, _tiny_flow, sd35, sd35_nft
from ddpo_group.config.variants.video_edit import qwen_image_edit, tiny_qwen_image_edit


def qwen_image_edit_plus():
    """GRPO multi-image editing on Qwen-Image-Edit-2509 (true CFG 4) with Flow-Factory's settings, LoRA r64, one GPU.

    Hub id Qwen/Qwen-Image-Edit-2509 (or Qwen/Qwen-Image-Edit-2511; QwenImageEditPlusPipeline), Flow-Factory's
    recipe (X-GenGroup/Flow-Factory examples/grpo/lora/qwen_image_edit_plus/default.yaml, as ``qwen_image_edit``:
    LoRA r64 / alpha 128, 384 px, 10 steps, true CFG 4, Flow-SDE noise level 1.0, 16 images per prompt, clip range
    1e-4, no KL, lr 3e-4). Each prompt record lists its sources in ``source_images`` (1 to 3, the same number per
    run); max_sequence_length 1024 (the model's limit) holds up to three 384 px sources' vision tokens (196 each)
    and the prompt. Flow-Factory samples one prompt per device batch (the pipeline takes one); here a batch holds
    several, each encoded alone. Not yet run (no GPU, no hub); the shipped shapes_edits_two_sources.jsonl sources
    are 32 px: give 384 px sources (sample.resolution) of your own."""
    config = qwen_image_edit()
    config.pretrained.model = "Qwen/Qwen-Image-Edit-2509"
    config.prompt_fn = "shapes_edits_two_sources.jsonl"  # replace with your own {"prompt", "source_images"} records
    config.sample.max_sequence_length = 1024
    return config


def tiny_qwen_image_edit_plus():
    """A random-weight tiny Qwen-Image-Edit-2509 editing two shipped shapes-world sources per prompt, seconds.

    Its Qwen2.5-VL vision tower reads every source; the two shipped 32 px shapes-world sources per prompt
    (shapes_edits_two_sources.jsonl: picture 1's shape and background in picture 2's colour), seconds: tests and
    smoke runs."""
    config = tiny_qwen_image_edit()
    config.pretrained.model = "tiny-qwen-image-edit-plus"
    config.prompt_fn = "shapes_edits_two_sources.jsonl"
    config.sample.max_sequence_length = 64  # two sources' 2 x (4 vision + 2 + "Picture k: ") tokens and the prompt
    return config


def sana_nft():
    """DiffusionNFT on SANA 1.5 1.6B (1024 px, CFG-free, Euler ODE sampler) with the paper's settings, one GPU.

    Hub id Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers, the SANA that
    nvidia-cosmos/cosmos-rl's diffusers configs train; SanaPipeline): ``sd35_nft``'s DiffusionNFT settings (arXiv
    2509.16117, NVlabs/DiffusionNFT config/nft.py: CFG-free sampling and training, the deterministic sampler, 10
    steps, beta 1, adaptive weighting, KL 1e-4, lr 3e-4, LoRA r32 / alpha 64, one optimizer step per epoch) at
    SANA's native 1024 px and max_sequence_length 300 (its pipeline's default and cosmos-rl's max_prompt_length).
    cosmos-rl's own SANA DiffusionNFT recipe file was not among the stored sources, so its numbers are not taken
    here. LoRA on the self- and cross-attention projections (to_q / to_k / to_v / to_out.0, cosmos-rl's targets).
    The policy samples SANA's flow with Euler steps on its flow_shift grid (not its DPM-Solver). Not yet run (no
    GPU, no hub)."""
    config = sd35_nft()
    config.pretrained.model = "Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers"
    config.sample.resolution = 1024
    config.sample.max_sequence_length = 300
    return config


def tiny_sana():
    """A random-weight tiny SANA pipeline (Gemma-2 text, DC-AE, linear-attention DiT), seconds; tests and smoke checks.

    The tiny Gemma-2 and its tokenizer are built in memory. Guidance 4.5 is SANA's CFG (one call on negative and
    prompt rows)."""
    return _tiny_flow("tiny-sana")


def tiny_hunyuan_video15():
    """A random-weight tiny HunyuanVideo 1.5 text-to-video pipeline, 5 frames, seconds; tests and smoke checks.

    Its tiny Qwen2.5-VL text model and ByT5 encoder are built in memory, with its 3-D VAE: videos of 5 frames of
    32x32 in seconds, for tests and smoke runs; the reward is JPEG compressibility averaged over 3 evenly spaced
    frames, as tiny_wan's. No full-size preset: no published RL recipe for HunyuanVideo 1.5 was among the stored
    sources (Flow-Factory's examples have none)."""
    config = _tiny_flow("tiny-hunyuan-video15")
    config.sample.num_frames = 5
    config.sample.max_sequence_length = 32  # Qwen text tokens after the template's cropped system turn
    config.reward_frames = 3
    return config


def tiny_hunyuan_video15_i2v():
    """A random-weight tiny HunyuanVideo 1.5 image-to-video animating the shipped shapes-world sources, seconds.

    The tiny text-to-video pipeline's parts with a tiny SigLIP image encoder; each prompt of shapes_edits.jsonl
    names its 32 px source image (field source_image), the video's first frame (docs/next_families.md)."""
    config = tiny_hunyuan_video15()
    config.pretrained.model = "tiny-hunyuan-video15-i2v"
    config.prompt_fn = "shapes_edits.jsonl"
    config.sample.resolution = 32
    return config


def tiny_ltx2():
    """A random-weight tiny LTX-2 pipeline making video with audio, 5 frames, seconds; tests and smoke runs.

    Its tiny Gemma-3 text model, text connectors, video and audio VAEs and vocoder are built in memory: videos of 5
    frames of 32x32 with 16 kHz stereo waveforms (rewards get them as metadata["audio"]); plain CFG on both streams
    (docs/next_families.md). The reward is JPEG compressibility averaged over 3 evenly spaced frames."""
    config = _tiny_flow("tiny-ltx2")
    config.sample.num_frames = 5
    config.reward_frames = 3
    return config


def ltx2():
    """GRPO LoRA on LTX-2 (19B, video with audio) with Flow-Factory's text-to-audio-video recipe, one GPU.

    Lightricks/LTX-2 (LTX2Pipeline); X-GenGroup/Flow-Factory examples/grpo/lora/ltx2/t2av_pickscore.yaml (its
    t2av.yaml has the same settings with CLAP audio-text and ImageBind audio-video rewards, which this project does
    not have): LoRA r64 / alpha 128 on the one transformer, 121 frames at 24 fps, 24 steps, CPS steps of noise level
    0.8 among steps 0-9, training guidance 1.0 with the spatio-temporal / modality guidance and rescale off (what
    the policy samples: ltx2.py), 16 videos per prompt, clip range 1e-4, no KL, lr 3e-4, weight decay 1e-4,
    PickScore on the frames. Differences: Flow-Factory draws 3 of the steps 0-9 per trajectory; here all ten are
    stochastic (a fixed window, as the FLUX.2 presets); its 512 x 768 frames are 512 x 512 here (a square
    sample.resolution); no EMA. Not yet run (no GPU, no hub)."""
    config = _flow_factory_lora(sd35())
    config.pretrained.model = "Lightricks/LTX-2"
    config.sample.num_frames = 121  # num_frames 121 (1 + 8 k)
    config.sample.num_steps = 24  # num_inference_steps 24
    config.sample.sde_type = "cps"  # dynamics_type CPS
    config.sample.eta = 0.8  # noise_level 0.8
    config.sample.guidance_scale = 1.0  # train guidance_scale 1.0 (its evaluation: 4.0)
    config.sample.resolution = 512
    config.sample.max_sequence_length = 1024  # LTX2Pipeline's default
    config.reward_fn = "pickscore"  # t2av_pickscore.yaml's reward
    return _fixed_window(config, 0, 9)  # sde_steps [0 .. 9]
