"""GPU check: SD-1.5, SD3.5 and FLUX architectures train in fp16 / bf16 with LoRA, exactly on-policy, at a known cost.

    python benchmarks/gpu_check.py                      # a CUDA machine: SD-1.5 and SD3.5-Medium, random weights
    python benchmarks/gpu_check.py --arch flux --dtypes bf16                       # FLUX.1-dev (12B)
    python benchmarks/gpu_check.py --arch flux --flux-depth 8,16 --dtypes bf16     # FLUX with fewer blocks
    python benchmarks/gpu_check.py --arch sdxl --dtypes bf16 --sample-batch 4 --train-batch 2   # SDXL base (2.6B UNet)
    python benchmarks/gpu_check.py --device cpu --arch tiny,tiny-sd3 --dtypes bf16 --steps 4   # the code path on a CPU

No hub: every architecture is built from the published configs' numbers with random weights (offline names,
the loading route of "random-sd15"):

    sd15      "random-sd15": SD 1.5 (UNet 859.5M), DDIM, 512 px
    sd35      "random-sd35": SD3.5-Medium (MMDiT-X transformer 2.24B + 0.23B position table, 16-channel VAE),
              small CLIP text encoders of the real widths and no T5 (zero T5 embeddings of 256 tokens, as SD3 does
              without one); the `sd35` preset's sampling (Flow-GRPO's "sde" step, eta 0.7, CFG 4.5), 512 px
    flux      "random-flux": FLUX.1-dev (transformer 11.9B: 19 double + 38 single blocks; `--flux-depth D,S`
              builds fewer, and the output says so), small CLIP-L / 1-layer T5 of the real widths; the `flux`
              preset's sampling (guidance embedding 3.5, eta 0.9), 512 px
    wan       "random-wan21-1.3b": Wan 2.1 T2V 1.3B (transformer 1.42B: 30 blocks of 12 x 128, FFN 8960; the published
              3-D VAE), a 1-layer UMT5 of the real width 4096; the `wan21_t2v_1_3b` preset's sampling (Flow-GRPO's
              33 frames, CFG 4.5, eta 0.7) at 256 x 256: videos, sampled against the pipeline's pipeline(...).frames
    sdxl      "random-sdxl": SDXL 1.0 base (UNet 2.57B: the published config; VAE with scaling 0.13025), small
              2-layer text encoders of the real widths 768 + 1280 (pooled 1280) and 77 tokens; DDIM at 1024 px,
              25 sampling steps (the `sdxl` preset's), the SD path's eta 1 and CFG 5
    flux2     "random-flux2": FLUX.2 [dev] (transformer 32.2B: 8 double + 48 single blocks of 48 x 128), FLUX.2's
              VAE, a 30-layer Mistral-3 of the real width 5120 (4 heads, 64-wide MLP); the `flux2` preset's sampling
              (guidance embedding 4, eta 1.0, 8 steps), 512 px. Not yet run (no GPU where it was written)
    flux2-klein  "random-flux2-klein-4b": FLUX.2 [klein] 4B base (transformer 3.9B: 5 + 20 blocks of 24 x 128), a
              27-layer Qwen3 of width 2560; the `flux2_klein` preset's sampling (4 steps, no CFG, eta 0.5), 384 px
    zimage, zimage-turbo  "random-zimage": Z-Image (transformer 6.2B: 30 layers of 3840), FLUX.1's VAE, a 3-layer
              Qwen3 of width 2560; the `zimage` (10 steps, CFG 5) / `zimage_turbo` (8 steps, no CFG) presets' sampling,
              512 px; pipeline(...) gets guidance_scale w - 1 (ZImagePipeline's g of pos + g (pos - neg))
    sana      "random-sana-1600m": SANA 1600M (transformer 1.60B: 20 blocks of 70 x 32 linear attention; the DC-AE f32c32
              0.31B), a 1-layer Gemma-2 of the real width 2304; Flow-GRPO's sampling (`sd35`'s) at 1024 px
    hunyuan-video15  "random-hunyuan-video15-480p": HunyuanVideo 1.5 480p (transformer 8.33B, the published 3-D VAE);
              Flow-GRPO's sampling (`sd35`'s), 33 frames at 480 px. Its pipeline takes one prompt a call: pipeline(...)
              runs once per prompt (each with its own seed, as the policy's initial noise), the videos concatenated
    qwen-image-edit-plus  "random-qwen-image-edit-plus": Qwen-Image-Edit-2509 (transformer 20.43B: 60 blocks of
              24 x 128; the 16-channel VAE), a 1-layer Qwen2.5-VL of the real width 3584 with a 1-block vision tower
              of width 1280; the `qwen_image_edit_plus` preset's sampling (true CFG 4, eta 1.0), two random sources
              per prompt, 384 px, one prompt a call. Not yet run (no GPU where it was written)
    ltx2      "random-ltx2": LTX-2 (transformer 18.88B: 48 blocks, video 32 x 128, audio 32 x 64; video VAE 1.22B,
              audio VAE, vocoder), a 1-layer Gemma-3 of the real width 3840; the `ltx2` preset's sampling (cps, eta
              0.8, no CFG), 121 frames at 512 px; pipeline(...) with LTX2Policy.pipeline_kwargs. Not yet run
    tiny, tiny-sd3, tiny-flux, tiny-wan, tiny-sdxl, tiny-flux2, tiny-zimage, tiny-sana, tiny-qwen-image-edit-plus,
    tiny-hunyuan-video15, tiny-ltx2   the tiny offline models: the same code path in seconds on a CPU (the
              Qwen-Image-Edit-2509 row edits two random sources per prompt, one prompt a call; LTX-2's pipeline(...)
              gets LTX2Policy.pipeline_kwargs, the settings the policy equals)

Rewards on random weights mean nothing, so precision, exactness, speed and memory are checked. For each
architecture and dtype:

    sampling      time of the policy's sampler (`sample_trajectories` for SD) vs the pipeline's own `pipeline(...)`,
                  same dtype, batch `--sample-batch` (8), `--sample-steps` (SD 50, SDXL 25, flow 10); for the flow models also
                  the largest |image difference| at noise level 0 (the ODE path) against `pipeline(...)` (reported:
                  the pipeline keeps its latents in the model dtype, the policy in float32); each sampler is called
                  once untimed, then `--sample-repeats` (3) times, and the mean is reported
    fwd+bwd       the bare cost of one training forward + backward of the LoRA model (`policy.predict`, CFG as in
                  training) on a micro-batch of `--train-batch` (4) sampled states, under autocast
    algorithms    `--epochs` (2) epochs of GRPO (the arch's preset: sd15 / sd35 / flux), DDPO, Group-PPO (learning
                  design and Algorithm 2), and the forward-process objectives NFT / AWM, LoRA, `--steps` denoising
                  steps, reward jpeg_compressibility, at learning rate `--lr` (1e-30) with `--optimizer-steps` (4)
                  optimizer steps per epoch. Read back from metrics.jsonl, every epoch: the on-policy max |log ratio|
                  before the first optimizer step, approx_kl and clipfrac (all three exactly 0: at lr 1e-30 the
                  weights do not move, so the recompute pass of pi_old must equal every later training forward
                  bit for bit), the layout noise that recomputing pi_old removed, the training pass in seconds per
                  trajectory-step, peak GPU memory, skipped optimizer steps (fp16: apart from them, the steps the
                  GradScaler skipped while it lowered its scale from 2**16, and its final scale; not failures).
                  For NFT / AWM the on-policy number
                  is the first window's max |prediction - old model's prediction| (exactly 0 as well).
                  `--gradient-checkpointing` runs the fwd+bwd check and every training run with
                  train.gradient_checkpointing (docs/memory.md).

With GRPO among the variants and more than one optimizer step, GRPO also runs with one optimizer step per epoch (no
recompute pass): the baseline of the recompute pass's memory. On a GPU the targets are checked and shown (not in the
exit code): sampling within 1.05x of pipeline(...), LoRA SD-1.5 peak memory within 10 GiB for GRPO, DDPO and
Group-PPO, the recompute pass within +10 % peak memory (docs/memory.md).

`--fsdp2 1,N` adds the FSDP2 row (docs/sharding.md): a full fine-tune (no LoRA, train.sharding="fsdp2", bf16
compute) of each architecture with GRPO, launched with torchrun on 1 and N processes (N GPUs; on a CPU, gloo
processes); per process count the peak memory of a process (GPU MB, or resident MB on a CPU) and the seconds per
epoch, with approx_kl / clipfrac checked as above.

    python benchmarks/gpu_check.py --arch sd35,flux --flux-depth 8,16 --dtypes bf16 --variants none --fsdp2 1,8

It prints a table, writes benchmarks/results/gpu_check.json (or --output), and exits 1 if any on-policy ratio
is not exactly 1, any approx_kl or clipfrac is not exactly 0, any optimizer step was skipped or a sampled step
lost its density. Not part of CI (CI has no GPU).
"""

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "config"))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

import grpo  # noqa: E402  config/grpo.py
import torch  # noqa: E402
from bench_outputs import BenchmarkError, fail, refuse_committed_default, require_finished  # noqa: E402

from ddpo_group.diffusion.base import configure_from_sample  # noqa: E402
from ddpo_group.diffusion.flux import FLUX_DEV_TRANSFORMER, register_random_flux  # noqa: E402
from ddpo_group.diffusion.policy import load_policy  # noqa: E402
from ddpo_group.diffusion.sampling import sample_trajectories  # noqa: E402
from ddpo_group.runs.run_dir import write_json_atomic  # noqa: E402
from ddpo_group.training.trainer import train  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ALGORITHMS = ("grpo", "ddpo", "group_ppo", "group_ppo_alg2", "nft", "awm")
ALIASES = {"sd15": "grpo"}  # the SD-1.5 GRPO preset's name, as earlier versions of this script called it
# the algorithm's preset (SD 1.5) in ddpo_group/config/grpo.py; the forward objectives take their fields from
# the tiny variants (train.objective, forward.*) on top of GRPO's preset
ALGORITHM_PRESETS = {"grpo": "sd15", "ddpo": "ddpo", "group_ppo": "group_ppo", "group_ppo_alg2": "group_ppo_alg2"}
FORWARD_VARIANTS = {"nft": "tiny_nft", "awm": "tiny_awm"}
# model: offline name; flow: the preset whose model-specific settings (sampling step, noise, guidance, resolution,
# LoRA, KL scale, skipped last step) a flow run takes; resolution 0: the model's own; sample_steps: sampling check
ARCHS = {
    "sd15": dict(model="random-sd15", flow=None, resolution=0, sample_steps=50),
    "sd35": dict(model="random-sd35", flow="sd35", resolution=512, sample_steps=10),
    "flux": dict(model="random-flux", flow="flux", resolution=512, sample_steps=10),
    "tiny": dict(model="tiny", flow=None, resolution=0, sample_steps=50),
    "tiny-sd3": dict(model="tiny-sd3", flow="sd35", resolution=0, sample_steps=10, max_sequence_length=16),
    "tiny-flux": dict(model="tiny-flux", flow="flux", resolution=0, sample_steps=10, max_sequence_length=16),
    # video: samples (B, F, 3, H, W); the pipeline's output is .frames
    "wan": dict(model="random-wan21-1.3b", flow="wan21_t2v_1_3b", resolution=256, sample_steps=10, video=True),
    "tiny-wan": dict(model="tiny-wan", flow="wan21_t2v_1_3b", resolution=0, sample_steps=10, max_sequence_length=16,
                     num_frames=5, video=True),
    # Wan 2.2 A14B: two 14B experts (random weights, 2 x 28 GB in bf16), sampled as wan22_a14b_t2v (5 frames, 480 px)
    "wan22-a14b": dict(model="random-wan22-a14b", flow="wan22_a14b_t2v", resolution=480, sample_steps=10, video=True),
    "tiny-wan22-moe": dict(model="tiny-wan22-moe", flow="wan22_a14b_t2v", resolution=0, sample_steps=10,
                           max_sequence_length=16, num_frames=5, video=True),
    # image-to-video: the first frame of every prompt is one random image (gpu_check's own prompt file for the runs)
    "wan21-i2v": dict(model="random-wan21-i2v-14b", flow="wan21_i2v", resolution=240, sample_steps=10, video=True,
                      image_to_video=True),
    "wan22-i2v": dict(model="random-wan22-i2v-a14b", flow="wan22_i2v", resolution=480, sample_steps=8, video=True,
                      image_to_video=True),
    "tiny-wan-i2v": dict(model="tiny-wan-i2v", flow="wan21_i2v", resolution=32, sample_steps=10,
                         max_sequence_length=16, num_frames=5, video=True, image_to_video=True),
    # SDXL 1.0 base's UNet at its 1024 px, sampled as the `sdxl` preset does (25 DDIM steps, CFG 5)
    "sdxl": dict(model="random-sdxl", flow=None, resolution=0, sample_steps=25),
    "tiny-sdxl": dict(model="tiny-sdxl", flow=None, resolution=0, sample_steps=25),
    # issue 46 (ddpo_group/diffusion/flux2.py, zimage.py): the published transformers, random weights;
    # pipeline_guidance_offset: added to the policy's guidance w for pipeline(...) where its scale differs
    # (ZImagePipeline's g = w - 1)
    "flux2": dict(model="random-flux2", flow="flux2", resolution=512, sample_steps=8),
    "flux2-klein": dict(model="random-flux2-klein-4b", flow="flux2_klein", resolution=384, sample_steps=4),
    "zimage": dict(model="random-zimage", flow="zimage", resolution=512, sample_steps=10, pipeline_guidance_offset=-1.0),
    "zimage-turbo": dict(model="random-zimage", flow="zimage_turbo", resolution=512, sample_steps=8,
                         pipeline_guidance_offset=-1.0),
    "tiny-flux2": dict(model="tiny-flux2", flow="flux2", resolution=0, sample_steps=8, max_sequence_length=64),
    "tiny-zimage": dict(model="tiny-zimage", flow="zimage", resolution=0, sample_steps=10, max_sequence_length=32,
                        pipeline_guidance_offset=-1.0),
    # SANA 1600M at its 1024 px (random-sana-1600m: the published transformer and DC-AE) with Flow-GRPO's sampling
    # (the sd35 preset's: sde, eta 0.7, CFG 4.5; SANA's own preset sana_nft samples without noise, which GRPO cannot
    # train); pipeline(...) without its aspect-ratio bins, at the sampled size
    "sana": dict(model="random-sana-1600m", flow="sd35", resolution=1024, sample_steps=10, max_sequence_length=300,
                 pipeline_kwargs={"use_resolution_binning": False}),
    "tiny-sana": dict(model="tiny-sana", flow="sd35", resolution=0, sample_steps=10, max_sequence_length=16,
                      pipeline_kwargs={"use_resolution_binning": False}),
    # issue 46's one-prompt-per-call pipelines (pipeline="..." names the call in PIPELINE_CALLS; one_prompt_per_call:
    # pipeline(...) once per prompt, each with its own generator, concatenated) and LTX-2 (ltx2.py's pipeline_kwargs).
    # Qwen-Image-Edit-2509 with two random sources per prompt (source_images=2), the qwen_image_edit_plus preset's
    # sampling (sde, eta 1.0, true CFG 4); the tiny row's pipeline(...) encodes its sources for the VAE at the sampled
    # side (the policy's), not QwenImageEditPlusPipeline's 1024 x 1024 px
    # random-qwen-image-edit-plus: the published 20.43B transformer and VAE (meta-device count), at the preset's 384 px
    "qwen-image-edit-plus": dict(model="random-qwen-image-edit-plus", flow="qwen_image_edit_plus", resolution=384,
                                 sample_steps=10, source_images=2, pipeline="qwen_image_edit_plus",
                                 one_prompt_per_call=True),
    "tiny-qwen-image-edit-plus": dict(model="tiny-qwen-image-edit-plus", flow="qwen_image_edit_plus", resolution=32,
                                      sample_steps=10, max_sequence_length=64, source_images=2,
                                      pipeline="qwen_image_edit_plus", one_prompt_per_call=True),
    # HunyuanVideo 1.5 480p (random-hunyuan-video15-480p: the published 8.33B transformer and 3-D VAE) with
    # Flow-GRPO's sampling (the sd35 preset's: no HunyuanVideo 1.5 RL recipe is published), 33 frames at 480 px; its
    # pipeline takes one prompt a call and its CFG scale is its guider's
    "hunyuan-video15": dict(model="random-hunyuan-video15-480p", flow="sd35", resolution=480, sample_steps=10,
                            num_frames=33, video=True, pipeline="hunyuan_video15", one_prompt_per_call=True),
    "tiny-hunyuan-video15": dict(model="tiny-hunyuan-video15", flow="sd35", resolution=0, sample_steps=10,
                                 max_sequence_length=32, num_frames=5, video=True, pipeline="hunyuan_video15",
                                 one_prompt_per_call=True),
    # LTX-2's tiny twin with the ltx2 preset's sampling (cps, eta 0.8, no CFG); pipeline(...) with the settings the
    # policy equals (LTX2Policy.pipeline_kwargs: plain CFG, spatio-temporal / modality guidance and rescale off)
    # random-ltx2: the published 18.88B transformer, video / audio VAEs and vocoder (meta-device count); the ltx2
    # preset's sampling (cps, eta 0.8, no CFG) at its 512 px, 121 frames
    "ltx2": dict(model="random-ltx2", flow="ltx2", resolution=512, sample_steps=10, max_sequence_length=1024,
                 num_frames=121, video=True, pipeline="ltx2"),
    "tiny-ltx2": dict(model="tiny-ltx2", flow="ltx2", resolution=0, sample_steps=10, max_sequence_length=16,
                      num_frames=5, video=True, pipeline="ltx2"),
}
FLOW_SAMPLE_FIELDS = ("sde_type", "eta", "guidance_scale", "max_sequence_length", "cps_log_prob", "flow_grid",
                      "flow_grid_shift", "num_frames")
PROMPTS = ["a photo of a cat", "a photo of a dog", "a red circle", "a blue square"]


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats=1):
    """(result of the last call, mean seconds per call) after one untimed warm-up call."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    synchronize(device)
    return result, (time.perf_counter() - start) / repeats


def arch_settings(arch, args):
    """The arch's entry with the model name (a reduced FLUX registered under its own name), resolution and notes."""
    spec = dict(ARCHS[arch], notes=[])
    if arch == "flux":
        full = (FLUX_DEV_TRANSFORMER["num_layers"], FLUX_DEV_TRANSFORMER["num_single_layers"])
        depth = tuple(int(n) for n in args.flux_depth.split(","))
        if depth != full:
            spec["model"] = register_random_flux(*depth)
            spec["notes"].append(f"FLUX depth reduced to {depth[0]} double + {depth[1]} single blocks "
                                 f"(FLUX.1-dev has {full[0]} + {full[1]}): memory and time are not FLUX.1-dev's")
    if args.resolution:
        spec["resolution"] = args.resolution
    if args.sample_steps:
        spec["sample_steps"] = args.sample_steps
    return spec


def flow_sample_settings(spec):
    """The flow preset's sampling settings for this arch (sde_type, eta, guidance, ...)."""
    preset = grpo.get_config(spec["flow"]).sample
    settings = {field: preset[field] for field in FLOW_SAMPLE_FIELDS}
    for field in ("max_sequence_length", "num_frames"):
        if field in spec:
            settings[field] = spec[field]
    return settings


def load_configured_policy(spec, device, dtype):
    """The arch's policy on `device` with every part in `dtype`, configured as the arch's runs sample."""
    policy = load_policy(spec["model"], torch_dtype=dtype)
    policy.pipeline.to(device, dtype)
    if spec["flow"]:
        s = flow_sample_settings(spec)
        configure_from_sample(policy, dict(s, resolution=spec["resolution"]))
    return policy


def check_sampling(spec, device, dtype, batch, repeats=1):
    """Mean seconds of the policy's sampler and of pipeline(...) (`repeats` calls each, after one untimed call of
    each) for the same batch, dtype and steps; the flow models' ODE path (noise 0) against pipeline(...).
    Returns the policy, its last trajectories and the numbers."""
    policy = load_configured_policy(spec, device, dtype)
    pipeline, steps = policy.pipeline, spec["sample_steps"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    entry = {}
    if spec["flow"]:
        s = flow_sample_settings(spec)
        guidance, eta = s["guidance_scale"], s["eta"]
        side = policy.resolution
        pipeline_guidance = guidance + spec.get("pipeline_guidance_offset", 0.0)
        call = dict(num_inference_steps=steps, guidance_scale=pipeline_guidance, height=side, width=side, output_type="pt",
                    max_sequence_length=policy.max_sequence_length)

        extra, text = {}, {"prompt": list(prompts)}
        if spec.get("source_images"):  # K random sources per prompt (an editing family's)
            extra["source_images"] = source_images(batch, spec["source_images"], side).to(device)
        if spec.get("image_to_video"):  # one first frame for every prompt (the pipeline takes one image)
            pixels = first_frame(side)
            extra["source_images"] = (pixels.permute(2, 0, 1).float() / 255).expand(batch, -1, -1, -1).to(device)
            from PIL import Image

            call["image"] = Image.fromarray(pixels.numpy())
            # the text as the policy encodes it (WanImageToVideoPipeline's own cleaning needs ftfy, wan_i2v.py)
            cond = policy._encode(prompts, "", guidance, device)
            text = {"prompt_embeds": cond["prompt_embeds"], "negative_prompt_embeds": cond.get("negative_prompt_embeds")}

        if spec.get("one_prompt_per_call"):  # each prompt's initial noise its own generator, as pipeline(...)'s
            def ours(level=eta):
                initial = [torch.Generator().manual_seed(i) for i in range(batch)]
                return policy.sample(prompts, steps, guidance, level, generator=torch.Generator().manual_seed(0),
                                     initial_generator=initial, **extra)
        else:
            def ours(level=eta):
                return policy.sample(prompts, steps, guidance, level, generator=torch.Generator().manual_seed(0),
                                     **extra)

        if spec.get("video"):  # WanPipeline: frames, and the videos in .frames
            call["num_frames"] = policy.num_frames
        call.update(spec.get("pipeline_kwargs", {}))

        if spec.get("pipeline"):
            family_call = PIPELINE_CALLS[spec["pipeline"]]

            def one_call(rows, seed):
                sources = extra["source_images"][rows] if "source_images" in extra else None
                return family_call(policy, [prompts[i] for i in rows], dict(call, guidance_scale=pipeline_guidance),
                                   torch.Generator().manual_seed(seed), sources)

            def theirs():
                if spec.get("one_prompt_per_call"):  # once per prompt (seed i), concatenated
                    return torch.cat([one_call([i], i) for i in range(batch)])
                return one_call(list(range(batch)), 0)
        else:
            def theirs():
                # by name (Flux2Pipeline's first argument is its reference image), a copy (ZImagePipeline edits
                # the list)
                output = pipeline(**text, generator=torch.Generator().manual_seed(0), **call)
                return output.frames if spec.get("video") else output.images

        ode = ours(0.0).images.float()
        entry["ode_vs_pipeline_max_abs_image_diff"] = float((ode - theirs().float().to(ode.device)).abs().max())
    else:
        guidance, eta = 5.0, 1.0

        def ours():
            return sample_trajectories(pipeline, prompts, steps, guidance, eta, generator=torch.Generator().manual_seed(0))

        def theirs():
            return pipeline(prompts, num_inference_steps=steps, guidance_scale=guidance, eta=eta, output_type="pt",
                            generator=torch.Generator().manual_seed(0)).images

    trajectories, ours_s = timed(ours, device, repeats)  # each after one untimed call (`timed`)
    _, theirs_s = timed(theirs, device, repeats)
    # a sampled step without density: only cps's last step (sigma' = 0) may have none
    expected_mask = torch.ones_like(trajectories.mask)
    if spec["flow"] and flow_sample_settings(spec)["sde_type"] == "cps":
        expected_mask[:, -1] = 0
    entry.update({
        "sampling_s": ours_s,
        "pipeline_s": theirs_s,
        "sampling_vs_pipeline": ours_s / theirs_s,
        "sample_steps": steps,
        "sampling_repeats": repeats,
        "resolution": int(trajectories.images.shape[-1]),
        **({"num_frames": int(trajectories.images.shape[1])} if spec.get("video") else {}),
        "sampling_mask_all_ones": bool(torch.equal(trajectories.mask, expected_mask)),
        "log_probs_dtype": str(trajectories.log_probs.dtype),
    })
    return policy, trajectories, entry, guidance


def call_qwen_image_edit_plus(policy, prompts, call, generator, sources):
    """QwenImageEditPlusPipeline on one prompt and its K sources (true CFG with the negative prompt " "); the sources
    are encoded for the VAE at the sampled side, as the policy encodes them (the text encoder's condition images
    keep the pipeline's own size)."""
    from unittest import mock

    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module
    from PIL import Image

    side, guidance = call["height"], call["guidance_scale"]
    resize = plus_module.calculate_dimensions
    pixels = (sources[0].float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    def dimensions(area, ratio):
        return resize(area, ratio) if area == plus_module.CONDITION_IMAGE_SIZE else (side, side)

    with mock.patch.object(plus_module, "calculate_dimensions", dimensions):
        return policy.pipeline(image=[Image.fromarray(p) for p in pixels], prompt=prompts[0], true_cfg_scale=guidance,
                               negative_prompt=" " if guidance > 1 else None, height=side, width=side,
                               num_inference_steps=call["num_inference_steps"], generator=generator,
                               output_type="pt").images


def call_hunyuan_video15(policy, prompts, call, generator, sources):
    """HunyuanVideo15Pipeline on one prompt: its CFG scale is its guider's (set for the call, then restored)."""
    from diffusers import ClassifierFreeGuidance

    pipeline = policy.pipeline
    guider = pipeline.guider
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=call["guidance_scale"])
    try:
        return pipeline(prompt=prompts[0], height=call["height"], width=call["width"], num_frames=call["num_frames"],
                        num_inference_steps=call["num_inference_steps"], generator=generator, output_type="pt").frames
    finally:
        pipeline.guider = guider


def call_ltx2(policy, prompts, call, generator, sources):
    """LTX2Pipeline on the batch with the settings the policy equals (LTX2Policy.pipeline_kwargs)."""
    return policy.pipeline(prompt=list(prompts), num_inference_steps=call["num_inference_steps"], generator=generator,
                           output_type="pt", **policy.pipeline_kwargs(call["guidance_scale"])).frames


# spec["pipeline"]: call(policy, prompts, call settings, generator, sources or None) -> images / videos in [0, 1]
PIPELINE_CALLS = {"qwen_image_edit_plus": call_qwen_image_edit_plus, "hunyuan_video15": call_hunyuan_video15,
                  "ltx2": call_ltx2}


def source_images(batch, k, side):
    """(batch, k, 3, side, side) random 8-bit pixels / 255 (seed 0): an editing arch's sources (the same for every
    prompt row, as the runs' prompt file holds them)."""
    pixels = (torch.rand(k, 3, side, side, generator=torch.Generator().manual_seed(0)) * 255).round() / 255
    return pixels.expand(batch, -1, -1, -1, -1).contiguous()


def edit_prompts(logdir, k, side):
    """A prompt file in `logdir` whose records carry the `source_images(1, k, side)` PNGs as their source_images."""
    from PIL import Image

    os.makedirs(logdir, exist_ok=True)
    names = []
    for j, image in enumerate(source_images(1, k, side)[0]):
        names.append(f"source_{j}.png")
        pixels = (image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        Image.fromarray(pixels).save(os.path.join(logdir, names[-1]))
    path = os.path.join(logdir, f"edit_{k}_sources.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": prompt, "source_images": names}) + "\n" for prompt in PROMPTS)
    return path


def first_frame(side):
    """A random (side, side, 3) uint8 image (seed 0): the image-to-video archs' first frame."""
    return (torch.rand(side, side, 3, generator=torch.Generator().manual_seed(0)) * 255).round().to(torch.uint8)


def image_to_video_prompts(logdir, side):
    """A prompt file in `logdir` whose records carry `first_frame(side)` as their source_image (docs/wan.md)."""
    from PIL import Image

    os.makedirs(logdir, exist_ok=True)
    Image.fromarray(first_frame(side).numpy()).save(os.path.join(logdir, "first_frame.png"))
    path = os.path.join(logdir, "image_to_video.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": prompt, "source_image": "first_frame.png"}) + "\n" for prompt in PROMPTS)
    return path


def check_model_cost(policy, trajectories, device, dtype, batch, repeats, guidance, lora_rank, checkpointing=False):
    """Mean seconds of one forward + backward of the LoRA model (`policy.predict`, CFG as in training) on `batch`
    sampled states (the first step of the first `batch` trajectories), under autocast; with `checkpointing`, the
    model's gradient checkpointing on (train.gradient_checkpointing)."""
    module = policy.prepare(device, dtype, use_lora=True, lora_rank=lora_rank)
    if checkpointing:
        module.enable_gradient_checkpointing()
    rows = torch.arange(min(batch, trajectories.latents.shape[0]))
    x_t = trajectories.latents[rows, 0].to(device)
    timesteps = trajectories.timesteps[rows, 0].to(device)
    autocast = torch.autocast(device, dtype=dtype) if device == "cuda" or dtype == torch.bfloat16 else contextlib.nullcontext()

    def step():
        with autocast:
            out = policy.predict(module, x_t, timesteps, trajectories, rows, guidance)
        out.float().mean().backward()
        module.zero_grad(set_to_none=True)

    _, seconds = timed(step, device, repeats)
    return {"model_fwd_bwd_s": seconds, "model_fwd_bwd_s_per_trajectory_step": seconds / len(rows)}


def algorithm_config(algorithm, num_steps):
    """The algorithm's SD-1.5 preset; NFT / AWM: GRPO's preset with the tiny variant's objective fields."""
    if algorithm not in FORWARD_VARIANTS:
        return grpo.get_config(ALGORITHM_PRESETS[algorithm])
    source = grpo.get_config(FORWARD_VARIANTS[algorithm])
    config = grpo.get_config("sd15")
    config.train.objective = source.train.objective
    for field in ("use_reference_model", "use_kl_loss", "beta", "clip_range"):
        config.train[field] = source.train[field]
    config.forward = source.forward
    config.forward.num_timesteps = min(source.forward.num_timesteps or num_steps, num_steps)
    return config


def lora_rank_for(spec):
    """(rank, alpha) of the arch's LoRA: the flow preset's (SD 1.5's rank 4 without one), capped at 4 for the tiny
    offline models, whose adapted layers are 16-64 wide (a rank above a layer's width is refused), alpha scaled with
    it so that alpha / rank stays the preset's."""
    flow = grpo.get_config(spec["flow"]) if spec["flow"] else None
    rank, alpha = (flow.lora_rank, flow.lora_alpha) if flow else (4, 4)
    if spec["model"].startswith("tiny") and rank > 4:
        rank, alpha = 4, alpha * 4 // rank
    return rank, alpha


def run_config(arch, spec, algorithm, args, dtype_name, logdir, run_name):
    """The algorithm's config on the arch's model: for a flow model, the flow preset's model settings (step type,
    noise level, guidance, resolution, text length, LoRA size, KL scale, skipped last step)."""
    config = algorithm_config(algorithm, args.steps)
    config.pretrained.model = spec["model"]
    if spec["flow"]:
        flow = grpo.get_config(spec["flow"])
        for field, value in flow_sample_settings(spec).items():
            config.sample[field] = value
        config.sample.resolution = spec["resolution"]
        config.lora_rank, config.lora_alpha = lora_rank_for(spec)
        if config.train.objective == "stepwise":  # the forward objectives train no reverse-process step
            config.train.skip_last_steps = flow.train.skip_last_steps
            if config.train.kl_type == "gaussian":
                config.train.kl_type = flow.train.kl_type
    config.mixed_precision = dtype_name
    config.use_lora = True
    config.reward_fn = "jpeg_compressibility"
    config.prompt_fn = "simple_animals"
    if spec.get("image_to_video"):
        config.prompt_fn = image_to_video_prompts(logdir, spec["resolution"])
    if spec.get("source_images"):
        config.prompt_fn = edit_prompts(logdir, spec["source_images"], spec["resolution"])
    config.num_epochs = args.epochs
    config.save_freq = 0
    config.eval_freq = 0
    config.log_images_every = 0
    config.logdir = logdir
    config.run_name = run_name
    config.sample.num_steps = args.steps
    config.sample.batch_size = args.sample_batch
    config.sample.num_batches_per_epoch = args.batches
    config.sample.group_size = min(config.sample.group_size, args.sample_batch) if algorithm != "ddpo" else 1
    config.train.batch_size = args.train_batch
    config.train.learning_rate = args.lr
    config.train.gradient_checkpointing = args.gradient_checkpointing
    # `--optimizer-steps` optimizer steps per epoch: at lr 1e-30 the weights stay put, so every training forward
    # after a step must reproduce the recompute pass's pi_old exactly (approx_kl, clipfrac 0)
    micro_batches = args.sample_batch * args.batches // args.train_batch
    config.train.gradient_accumulation_steps = max(1, micro_batches // args.optimizer_steps)
    return config


def run_fsdp2(arch, spec, args, dtype_name, logdir, num_processes):
    """The FSDP2 row for one process count: this script again under torchrun (``fsdp2_worker``), read back from
    the run's metrics.jsonl."""
    import subprocess

    name = f"{arch}_fsdp2_{dtype_name}_{num_processes}"
    argv = sys.argv[1:] if args.argv is None else args.argv
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_processes),
               "--master_port", str(free_port()), os.path.abspath(__file__), *argv,
               "--fsdp2-worker", f"{arch},{dtype_name},{logdir},{name}"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"gpu_check: the FSDP2 run on {num_processes} processes failed:\n{result.stderr[-3000:]}")
    with open(os.path.join(logdir, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    peak_key = "peak_gpu_mb" if rows[-1].get("peak_gpu_mb") is not None else "peak_rss_mb"
    epoch_s = [sum(value for key, value in row.items() if key.startswith("time/")) for row in rows]
    return {
        "processes": num_processes, "epochs": len(rows), "peak_mb_per_process": max(row[peak_key] for row in rows),
        "peak_memory": peak_key, "s_per_epoch": sum(epoch_s) / len(rows), "launch_to_end_s": time.perf_counter() - start,
        "approx_kl": max(abs(row.get("approx_kl", 0.0)) for row in rows),
        "clipfrac": max(row.get("clipfrac", 0.0) for row in rows),
        # cumulative counters of the run: the last epoch's values
        "skipped_steps": rows[-1]["train/skipped_steps"],
        "scaler_skipped_steps": rows[-1].get("train/scaler_skipped_steps", 0),
        "grad_scale": rows[-1].get("train/grad_scale"),
    }


def fresh_peak(device):
    """Before a measured run: collect the previous runs' cyclic garbage (a Trainer holds reference cycles; until the
    collector runs, their GPU tensors would count in this run's peak), empty the cache, reset the peak counter."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fsdp2_worker(args):
    """One process of the FSDP2 row (under torchrun): GRPO's config on the arch, fully fine-tuned and sharded."""
    arch, dtype_name, logdir, name = args.fsdp2_worker.split(",")
    config = run_config(arch, arch_settings(arch, args), "grpo", args, dtype_name, logdir, name)
    config.use_lora = False
    config.train.sharding = "fsdp2"
    train(config)


def run_algorithm(arch, spec, algorithm, args, dtype_name, logdir, suffix=""):
    config = run_config(arch, spec, algorithm, args, dtype_name, logdir, f"{arch}_{algorithm}_{dtype_name}{suffix}")
    run_dir = train(config)
    require_finished(run_dir)  # a stopped run's rows are not the check's
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    # forward objectives: the first window's max |prediction - old prediction| stands for the log-ratio; NFT has
    # no ratio (approx_kl, clipfrac 0 by definition)
    on_policy = [row.get("train/on_policy_max_abs_log_ratio", row.get("forward/first_window_max_abs_deviation"))
                 for row in rows]
    noise = [row["train/layout_noise_max_abs_log_ratio"] for row in rows
             if row.get("train/layout_noise_max_abs_log_ratio") is not None]
    peaks = [row["peak_gpu_mb"] for row in rows if row.get("peak_gpu_mb") is not None]
    trained = sum(row["train/unet_steps_per_sample"] * row["num_samples"] for row in rows)
    return {
        "epochs": len(rows),
        "optimizer_steps_per_epoch": rows[-1]["train/global_step"] / len(rows),
        "learning_rate": args.lr,
        "on_policy_max_abs_log_ratio": max(on_policy, key=lambda v: -1 if v is None else v),
        "approx_kl": max(abs(row.get("approx_kl", 0.0)) for row in rows),
        "clipfrac": max(row.get("clipfrac", 0.0) for row in rows),
        "approx_kl_by_epoch": [row.get("approx_kl", 0.0) for row in rows],
        "clipfrac_by_epoch": [row.get("clipfrac", 0.0) for row in rows],
        "layout_noise_max_abs_log_ratio": max(noise) if noise else None,
        # cumulative counters of the run: the last epoch's values
        "skipped_steps": rows[-1]["train/skipped_steps"],
        "scaler_skipped_steps": rows[-1].get("train/scaler_skipped_steps", 0),
        "grad_scale": rows[-1].get("train/grad_scale"),
        "time_sample_s": sum(row["time/sample"] for row in rows) / len(rows),
        "time_train_s": sum(row["time/train"] for row in rows) / len(rows),
        "train_s_per_trajectory_step": sum(row["time/train"] for row in rows) / trained,
        "trained_trajectory_steps": trained,
        "peak_gpu_mb": max(peaks) if peaks else None,
    }


# The GPU targets (issue "flow fidelity"): sampling within 5 % of pipeline(...), LoRA SD-1.5 at batch 8 / train
# batch 4 with CFG within 10 GiB for these algorithms, the recompute pass of pi_old within +10 % peak memory.
SAMPLING_TARGET = 1.05
SD15_MEMORY_TARGET_MB = 10 * 1024
SD15_MEMORY_ALGORITHMS = ("grpo", "ddpo", "group_ppo")
RECOMPUTE_MEMORY_TARGET = 1.10


def targets(results):
    """The GPU targets, each {target, arch, dtype, value, limit, met}, from a results dict; none on a CPU (no GPU
    memory, and CPU timings say nothing of a GPU's)."""
    if results["machine"]["device"] != "cuda":
        return []
    rows = []
    for arch, a in results["archs"].items():
        for dtype, d in a["dtypes"].items():
            def add(target, value, limit):
                rows.append({"target": target, "arch": arch, "dtype": dtype, "value": value, "limit": limit,
                             "met": value is not None and value <= limit})

            add("sampling s / pipeline(...) s", d["sampling_vs_pipeline"], SAMPLING_TARGET)
            variants = d.get("variants", {})
            if arch == "sd15":
                for name in SD15_MEMORY_ALGORITHMS:
                    if name in variants:
                        add(f"{name} peak GPU MB", variants[name]["peak_gpu_mb"], SD15_MEMORY_TARGET_MB)
            one = d.get("grpo_one_optimizer_step")
            if one and "grpo" in variants and one["peak_gpu_mb"] and variants["grpo"]["peak_gpu_mb"]:
                add("grpo peak with the recompute pass / with one optimizer step",
                    variants["grpo"]["peak_gpu_mb"] / one["peak_gpu_mb"], RECOMPUTE_MEMORY_TARGET)
    return rows


def render(results):
    machine = results["machine"].get("gpu", results["machine"]["device"])
    lines = [f"GPU check on {machine}", ""]
    for arch, a in results["archs"].items():
        lines.append(f"{arch}: model {a['model']}, {a['parameters_m']:.4g}M parameters in the trained model (before LoRA)")
        lines += [f"  note: {note}" for note in a["notes"]]
    lines += [
        "",
        "| arch | dtype | sampling s | pipeline(...) s | ratio | ODE vs pipeline max abs | fwd+bwd s / trajectory-step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for arch, a in results["archs"].items():
        for dtype, d in a["dtypes"].items():
            ode = d.get("ode_vs_pipeline_max_abs_image_diff")
            lines.append(
                f"| {arch} | {dtype} | {d['sampling_s']:.3f} | {d['pipeline_s']:.3f} | {d['sampling_vs_pipeline']:.3f} | "
                f"{'-' if ode is None else f'{ode:.3g}'} | {d['model_fwd_bwd_s_per_trajectory_step']:.4f} |"
            )
    lines += [
        "",
        "| arch | dtype | algorithm | epochs x opt. steps | on-policy max abs log ratio | approx_kl (max over epochs) | "
        "clipfrac (max) | layout noise removed | train s / trajectory-step | peak GPU MB | skipped | "
        "fp16 scaler skips (final scale) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arch, a in results["archs"].items():
        for dtype, d in a["dtypes"].items():
            for name, v in d["variants"].items():
                noise, peak, ratio = v["layout_noise_max_abs_log_ratio"], v["peak_gpu_mb"], v["on_policy_max_abs_log_ratio"]
                lines.append(
                    f"| {arch} | {dtype} | {name} | {v['epochs']} x {v['optimizer_steps_per_epoch']:g} | "
                    f"{'-' if ratio is None else f'{ratio:.3g}'} | {v['approx_kl']:.3g} | {v['clipfrac']:.3g} | "
                    f"{'-' if noise is None else f'{noise:.3g}'} | {v['train_s_per_trajectory_step']:.4f} | "
                    f"{'-' if peak is None else f'{peak:.0f}'} | {v['skipped_steps']} | "
                    + (f"{v['scaler_skipped_steps']} ({v['grad_scale']:g}) |" if v.get("grad_scale") else "- |")
                )
    fsdp2 = [(arch, dtype, row) for arch, a in results["archs"].items() for dtype, d in a["dtypes"].items()
             for row in d.get("fsdp2", [])]
    if fsdp2:
        lines += ["", "FSDP2, full fine-tune (train.sharding='fsdp2'), GRPO:", "",
                  "| arch | dtype | processes | peak MB per process | s / epoch | approx_kl | clipfrac |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for arch, dtype, row in fsdp2:
            kind = "GPU" if row["peak_memory"] == "peak_gpu_mb" else "RSS"
            lines.append(f"| {arch} | {dtype} | {row['processes']} | {row['peak_mb_per_process']:.0f} ({kind}) | "
                         f"{row['s_per_epoch']:.2f} | {row['approx_kl']:.3g} | {row['clipfrac']:.3g} |")
    if results.get("targets"):
        lines += ["", "| target | arch | dtype | measured | limit | met |", "|---|---|---|---:|---:|---|"]
        for t in results["targets"]:
            value = "-" if t["value"] is None else f"{t['value']:.3f}"
            lines.append(f"| {t['target']} | {t['arch']} | {t['dtype']} | {value} | {t['limit']:g} | "
                         f"{'yes' if t['met'] else 'NO'} |")
    else:
        lines += ["", "targets (sampling time, peak memory): checked on a GPU only"]
    lines += ["", f"result: {'PASS' if results['passed'] else 'FAIL'}: {results['verdict']}"]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--arch", default="sd15,sd35", help=f"comma-separated, of {list(ARCHS)}")
    parser.add_argument("--flux-depth", default="19,38", help="double,single blocks of random-flux (FLUX.1-dev: 19,38)")
    parser.add_argument("--dtypes", default="fp16,bf16", help="comma-separated: fp16 (GPU only), bf16")
    parser.add_argument("--variants", default=",".join(ALGORITHMS), help=f"comma-separated, of {list(ALGORITHMS)}")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps of the training epochs")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of each training run")
    parser.add_argument("--lr", type=float, default=1e-30, help="learning rate of the training runs")
    parser.add_argument("--optimizer-steps", type=int, default=4, help="optimizer steps per epoch (at most the micro-batches)")
    parser.add_argument("--sample-steps", type=int, default=0, help="steps of the sampling check (0: SD 50, SDXL 25, flow 10)")
    parser.add_argument("--resolution", type=int, default=0, help="image side (0: SD 1.5's own 512, flow 512, tiny own)")
    parser.add_argument("--sample-batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=2, help="sampling batches per epoch")
    parser.add_argument("--train-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed forward+backward calls")
    parser.add_argument("--sample-repeats", type=int, default=3,
                        help="timed calls of each sampler (after one untimed call of each)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="train.gradient_checkpointing in the training runs and the fwd+bwd check (docs/memory.md)")
    parser.add_argument("--fsdp2", default="", help="process counts of the FSDP2 full fine-tune row, e.g. 1,8 "
                        "(empty: no row; docs/sharding.md)")
    parser.add_argument("--fsdp2-worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None, help="the JSON (default benchmarks/results/gpu_check.json; a "
                        "committed file there is replaced only when --output names it)")
    args = parser.parse_args(argv)
    given, args.output = args.output is not None, args.output or os.path.join(REPO_ROOT, "benchmarks", "results",
                                                                                "gpu_check.json")
    try:
        refuse_committed_default("--output", args.output, given)
    except BenchmarkError as err:
        parser.error(str(err))
    for arch in args.arch.split(","):
        if arch not in ARCHS:
            parser.error(f"--arch {arch!r} is not one of {list(ARCHS)}")
    for name in args.variants.split(",") if args.variants != "none" else []:
        if ALIASES.get(name, name) not in ALGORITHMS:
            parser.error(f"--variants {name!r} is not one of {list(ALGORITHMS)}")
    if args.sample_batch * args.batches % args.train_batch:
        parser.error("--train-batch must divide --sample-batch x --batches")
    return args


def main(argv=None):
    args = parse_args(argv)
    args.argv = argv
    if args.fsdp2_worker:
        return fsdp2_worker(args) or 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device is visible to torch; on a CPU use --device cpu --arch tiny --dtypes bf16")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if "fp16" in args.dtypes:
            raise SystemExit("gpu_check: fp16 needs a GPU; on a CPU use --dtypes bf16")
    machine = {"platform": platform.platform(), "torch_version": torch.__version__, "device": args.device}
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(0)
    results = {"machine": machine, "settings": vars(args), "archs": {}}
    logdir = tempfile.mkdtemp(prefix="gpu_check_")
    failures = []
    try:
        for arch in args.arch.split(","):
            spec = arch_settings(arch, args)
            entry = results["archs"][arch] = {"model": spec["model"], "notes": spec["notes"], "dtypes": {}}
            for note in spec["notes"]:
                print(f"{arch}: {note}", flush=True)
            for dtype_name in args.dtypes.split(","):
                dtype = DTYPES[dtype_name]
                fresh_peak(args.device)
                policy, trajectories, d, guidance = check_sampling(spec, args.device, dtype, args.sample_batch,
                                                                   args.sample_repeats)
                lora_rank = lora_rank_for(spec)[0]
                entry["parameters_m"] = sum(p.numel() for p in policy.trainable_module.parameters()) / 1e6
                d.update(check_model_cost(policy, trajectories, args.device, dtype, args.train_batch, args.repeats,
                                          guidance, lora_rank, args.gradient_checkpointing))
                if args.device == "cuda":
                    d["sampling_and_fwd_bwd_peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
                del policy, trajectories
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                print(f"{arch} {dtype_name} sampling: {json.dumps(d)}", flush=True)
                if not d["sampling_mask_all_ones"]:
                    failures.append(f"{arch} {dtype_name}: a sampled step lost its density (mask 0)")
                d["variants"] = {}
                for name in (args.variants.split(",") if args.variants != "none" else []):
                    fresh_peak(args.device)
                    try:
                        v = d["variants"][name] = run_algorithm(arch, spec, ALIASES.get(name, name), args, dtype_name,
                                                                logdir)
                    except BenchmarkError as err:  # after the finally below removed the runs: one line, exit 1
                        fail("gpu_check.py", err, code=1)
                    print(f"{arch} {dtype_name} {name}: {json.dumps(v)}", flush=True)
                    if v["on_policy_max_abs_log_ratio"] not in (0.0, None):
                        failures.append(f"{arch} {dtype_name} {name}: on-policy ratio not exactly 1")
                    if v["approx_kl"] != 0.0 or v["clipfrac"] != 0.0:
                        failures.append(f"{arch} {dtype_name} {name}: approx_kl / clipfrac not exactly 0 at lr {args.lr:g}")
                    if v["skipped_steps"]:
                        failures.append(f"{arch} {dtype_name} {name}: {v['skipped_steps']} optimizer step(s) skipped")
                    if not v["optimizer_steps_per_epoch"]:  # every step skipped, the loss scaler's included
                        failures.append(f"{arch} {dtype_name} {name}: no optimizer step taken (fp16 loss scaler "
                                        f"skipped {v['scaler_skipped_steps']}, final scale {v['grad_scale']})")
                if "grpo" in [ALIASES.get(n, n) for n in args.variants.split(",")] and args.optimizer_steps > 1:
                    # the same GRPO runs with one optimizer step per epoch (no recompute pass): the memory baseline
                    fresh_peak(args.device)
                    one = argparse.Namespace(**dict(vars(args), optimizer_steps=1))
                    d["grpo_one_optimizer_step"] = run_algorithm(arch, spec, "grpo", one, dtype_name, logdir, "_one")
                if args.fsdp2:
                    d["fsdp2"] = [run_fsdp2(arch, spec, args, dtype_name, logdir, int(n)) for n in args.fsdp2.split(",")]
                    for row in d["fsdp2"]:
                        print(f"{arch} {dtype_name} fsdp2: {json.dumps(row)}", flush=True)
                        if row["approx_kl"] != 0.0 or row["clipfrac"] != 0.0 or row["skipped_steps"]:
                            failures.append(f"{arch} {dtype_name} fsdp2 x{row['processes']}: approx_kl / clipfrac not "
                                            f"exactly 0 at lr {args.lr:g}, or a skipped step")
                entry["dtypes"][dtype_name] = d
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    if len(results["archs"]) == 1:  # one architecture: its dtypes also at the top level, as before
        (only,) = results["archs"].values()
        results["arch"], results["dtypes"] = args.arch, only["dtypes"]
    results["targets"] = targets(results)
    results["passed"] = not failures
    results["verdict"] = "; ".join(failures) or (
        f"every on-policy ratio exactly 1, approx_kl and clipfrac exactly 0 in every epoch at lr {args.lr:g}, "
        "no skipped step, no step without density")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    write_json_atomic(args.output, results)  # a reader sees the old file or the whole new one
    print(render(results))
    print(f"written: {args.output}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
