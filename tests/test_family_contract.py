"""What every model family (ddpo_group.diffusion, one per `register_family`) must give, checked on its tiny builder.

The contract, one test per clause, each parametrised over the rows of ROWS:

1. noise 0 (DDIM: eta 0, and eta 1 with the same generator) samples the images of the diffusers pipeline's own
   __call__ for the same generator, to the row's tolerance; the two prompts make different images, a video's first
   and last frames differ, an editing family's other source changes the edit;
2. re-scoring the recorded trajectories with unchanged weights is bit-exact for every SDE type the row lists (the
   public `trajectory_log_probs` too), with the mask of densities (cps: none at the last step);
3. two sampling batches concatenated (`Trajectories.cat`) and indexed (`index`) keep every per-row field of every
   row, and their rows re-score bit-exactly in the concatenation, also after index-then-cat (the layout is the
   same for every SDE type: the first of the row's, unless it lists cat_sde_types);
4. a LoRA run (rank 2, a KL to the adapter-free reference, one optimizer step an epoch) is exactly on-policy
   (approx_kl 0); its adapters load into a fresh pipeline in diffusers' format (load_lora_weights) and through the
   family's own loader, both sampling what the trained policy samples (to 1e-5), not what the untrained one does;
5. (rows with resume=True) the run resumed from that checkpoint restores the adapters, goes on from its step, and
   ends with the LoRA weights and epoch-1 loss of a run made straight through, bit for bit.
6. the policy losses that read each step's exact KL to pi_old's Gaussian step (train.policy_loss "dppo" and
   "grpo_guard": the step's mean and std from the family's step function, grpo_guard's 1 / dt from its step_dt)
   train an epoch with an off-policy micro-batch, finite, the drift measured at every trained step.

A family's own quirks (its text conditioning, sigma grid, CFG form, decode) stay in its own test file.

Adding a family: one entry in ROWS, keyed by its registered name (`register_family`), e.g.

    "my_family": Row(build=build_tiny_my_family_pipeline, variant="tiny_my_family", guidances=(1.0, 4.0),
                     call=_call_flow, configure=dict(max_sequence_length=16)),

build(seed=0) -> its tiny pipeline; variant: the config variant that trains it; call: how its diffusers pipeline is
called (one of the _call_* functions below, or a new one of the same signature); the other fields have defaults
for a text-to-image flow-matching family (see Row): a video family sets sample_shape, an editing family inputs (its
source images) and prompts, a DDIM family sde_types=("",), a pipeline that takes one prompt a call
one_prompt_per_call=True (each row's noise its own generator), one without load_lora_weights its load_lora.
`test_every_registered_family_has_a_row` fails until the row is there, or, for a family that cannot fit the table's
shape, an entry in FAMILY_CONTRACT_ELSEWHERE naming the test file that checks the contract and why. Each pipeline
is built once for the module (the `tiny` fixture); clauses 4 and 5 train, the costly part: resume=False on the
families whose resume another test covers (the SD 1.x "test" variant's: the trainer's tests) or whose saving and
loading is a covered subclass's (sd3, flux, qwen_image: FlowMatchingPolicy's, as wan's, as flux2, flux2_klein, zimage, sana;
sd_flow: StableDiffusionPolicy's; flux_kontext, qwen_image_edit(_plus) and hunyuan_video15_i2v subclass
flux, qwen_image and hunyuan_video15), to hold the suite's time.
"""

import copy
import dataclasses
import math
import os
from collections.abc import Callable
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from ddpo_group.diffusion.base import FAMILIES, Trajectories, configure_from_sample
from ddpo_group.diffusion.flux import build_tiny_flux_kontext_pipeline
from ddpo_group.diffusion.flux2 import build_tiny_flux2_klein_pipeline, build_tiny_flux2_pipeline
from ddpo_group.diffusion.hunyuan_video15 import (
    build_tiny_hunyuan_video15_i2v_pipeline,
    build_tiny_hunyuan_video15_pipeline,
)
from ddpo_group.diffusion.ltx2 import build_tiny_ltx2_pipeline
from ddpo_group.diffusion.policy import policy_for
from ddpo_group.diffusion.qwen_image import (
    build_tiny_qwen_image_edit_pipeline,
    build_tiny_qwen_image_edit_plus_pipeline,
    build_tiny_qwen_image_pipeline,
)
from ddpo_group.diffusion.sana import build_tiny_sana_pipeline
from ddpo_group.diffusion.sd_flow import build_tiny_sd_flow_pipeline
from ddpo_group.diffusion.sampling import trajectory_log_probs
from ddpo_group.diffusion.tiny import (
    build_tiny_flux_pipeline,
    build_tiny_pipeline,
    build_tiny_sd3_pipeline,
    build_tiny_sdxl_pipeline,
)
from ddpo_group.diffusion.wan import build_tiny_wan_pipeline
from ddpo_group.diffusion.wan_i2v import build_tiny_wan_i2v_pipeline
from ddpo_group.diffusion.zimage import build_tiny_zimage_pipeline
from ddpo_group.training.trainer import Trainer, train
from helpers import cheap, make_config, read_metrics

PROMPTS = ("a red circle", "a big blue square on a white background")
EDIT_PROMPTS = ("a big blue circle on a white background", "a big green triangle on a black background")
QUOTED_PROMPTS = ('a big blue circle with the text "hi"', "a red square on a white background")  # HunyuanVideo's ByT5


# ---- how each family's diffusers pipeline is called: call(pipeline, prompts, steps, guidance, eta, generator,
# ---- **inputs) -> its images (B, 3, H, W) or videos (B, F, 3, H, W) in [0, 1]; inputs: the row's `inputs`


def _call_ddim(pipeline, prompts, steps, guidance, eta, generator):
    return pipeline(prompt=prompts, num_inference_steps=steps, guidance_scale=guidance, eta=eta, output_type="pt",
                    generator=generator).images


def _call_flow(pipeline, prompts, steps, guidance, eta, generator):
    return pipeline(prompt=prompts, num_inference_steps=steps, guidance_scale=guidance, output_type="pt",
                    generator=generator).images


def _call_sd_flow(pipeline, prompts, steps, guidance, eta, generator):
    # StableDiffusionPipeline.__call__ steps DDIM (no flow sampler): its components in diffusers' own Euler loop,
    # written here from the scheduler's step, CFG as the pipeline combines it, the latents of its prepare_latents
    from diffusers.utils.torch_utils import randn_tensor

    cond, uncond = pipeline.encode_prompt(prompts, "cpu", 1, guidance > 1, negative_prompt=[""] * len(prompts))
    side = pipeline.unet.config.sample_size
    latents = randn_tensor((len(prompts), pipeline.unet.config.in_channels, side, side), generator=generator)
    pipeline.scheduler.set_timesteps(steps)
    with torch.no_grad():
        for t in pipeline.scheduler.timesteps:
            if guidance > 1:
                u, c = pipeline.unet(torch.cat([latents] * 2), t, torch.cat([uncond, cond])).sample.chunk(2)
                velocity = u + guidance * (c - u)
            else:
                velocity = pipeline.unet(latents, t, cond).sample
            latents = pipeline.scheduler.step(velocity, t, latents).prev_sample
        vae = pipeline.vae
        images = vae.decode(latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)).sample
    return (images / 2 + 0.5).clamp(0, 1)


def _call_wan(pipeline, prompts, steps, guidance, eta, generator):
    return pipeline(prompt=prompts, height=32, width=32, num_frames=5, num_inference_steps=steps,
                    guidance_scale=guidance, generator=generator, output_type="pt", max_sequence_length=16).frames


def _call_ltx2(pipeline, prompts, steps, guidance, eta, generator):
    # plain CFG on both streams, the pipeline's spatio-temporal / modality guidance and rescale off (ltx2.py)
    return pipeline(prompt=prompts, height=32, width=32, num_frames=5, num_inference_steps=steps, generator=generator,
                    guidance_scale=guidance, audio_guidance_scale=None, stg_scale=0.0, audio_stg_scale=0.0,
                    modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
                    max_sequence_length=16, output_type="pt").frames


def _call_qwen(pipeline, prompts, steps, guidance, eta, generator):
    # true CFG: the negative prompt " " (the pipeline's own default when guidance is on), none without guidance
    return pipeline(prompt=prompts, negative_prompt=[" "] * len(prompts) if guidance > 1 else None,
                    true_cfg_scale=guidance, num_inference_steps=steps, generator=generator, output_type="pt").images


def _call_kontext(pipeline, prompts, steps, guidance, eta, generator, source_images):
    return pipeline(image=source_images, prompt=prompts, num_inference_steps=steps, guidance_scale=guidance, height=32,
                    width=32, max_area=32 * 32, _auto_resize=False, max_sequence_length=16, output_type="pt",
                    generator=generator).images


def _call_qwen_edit(pipeline, prompts, steps, guidance, eta, generator, source_images):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_module

    # the pipeline resizes the source to about 1024 x 1024 px; the tiny test keeps it at its 32 px. The sources are
    # 8-bit pixels / 255 (_pixel_sources): the PIL images hold the same pixels
    pixels = (source_images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    with mock.patch.object(edit_module, "calculate_dimensions", lambda area, ratio: (32, 32, None)):
        return pipeline(image=[Image.fromarray(p) for p in pixels], prompt=prompts, true_cfg_scale=guidance,
                        negative_prompt=[" "] * len(prompts) if guidance > 1 else None, height=32, width=32,
                        num_inference_steps=steps, generator=generator, output_type="pt").images


def _call_flux2(pipeline, prompts, steps, guidance, eta, generator):
    return pipeline(prompt=prompts, num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=64,
                    generator=generator, output_type="pt").images


def _call_zimage(pipeline, prompts, steps, guidance, eta, generator):
    # the pipeline's guidance_scale g is w - 1 (its CFG is cond + g (cond - neg))
    return pipeline(prompt=prompts, num_inference_steps=steps, guidance_scale=guidance - 1, height=32, width=32,
                    max_sequence_length=32, generator=generator, output_type="pt").images


def _call_sana(pipeline, prompts, steps, guidance, eta, generator):
    return pipeline(prompt=prompts, guidance_scale=guidance, height=32, width=32, num_inference_steps=steps,
                    generator=generator, output_type="pt", use_resolution_binning=False, max_sequence_length=16).images


def _pil(pixels):
    """(..., 3, H, W) 8-bit pixels / 255 -> a list of PIL images (the same pixels)"""
    return [Image.fromarray(p) for p in (pixels * 255).round().to(torch.uint8).movedim(-3, -1).reshape(
        -1, *pixels.shape[-2:], 3).numpy()]


# ---- the rows with one_prompt_per_call: the pipeline is called once per prompt (prompts and inputs of one row)


def _call_qwen_edit_plus(pipeline, prompts, steps, guidance, eta, generator, source_images):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module

    # the pipeline resizes each source to about 384 px (the text encoder's, as the policy does) and 1024 px (the
    # VAE's): the tiny test keeps its 32 px for the VAE
    resize = plus_module.calculate_dimensions

    def dimensions(area, ratio):
        return resize(area, ratio) if area == plus_module.CONDITION_IMAGE_SIZE else (32, 32)

    with mock.patch.object(plus_module, "calculate_dimensions", dimensions):
        return pipeline(image=_pil(source_images[0]), prompt=prompts[0], true_cfg_scale=guidance,
                        negative_prompt=" " if guidance > 1 else None, height=32, width=32,
                        num_inference_steps=steps, generator=generator, output_type="pt").images


def _call_hunyuan_video15(pipeline, prompts, steps, guidance, eta, generator, source_images=None):
    from diffusers import ClassifierFreeGuidance

    pipeline.guider = ClassifierFreeGuidance(guidance_scale=guidance)  # its guidance scale is its guider's
    if source_images is None:
        return pipeline(prompt=prompts[0], height=32, width=32, num_frames=5, num_inference_steps=steps,
                        generator=generator, output_type="pt").frames
    return pipeline(image=_pil(source_images)[0], prompt=prompts[0], num_frames=5, num_inference_steps=steps,
                    generator=generator, output_type="pt").frames


def _call_wan_i2v(pipeline, prompts, steps, guidance, eta, generator, source_images):
    import diffusers.pipelines.wan.pipeline_wan_i2v as wan_i2v_module

    # diffusers 0.42's WanImageToVideoPipeline calls ftfy.fix_text whether or not ftfy is installed: the identity
    # (what ftfy does to these ASCII prompts)
    with mock.patch.object(wan_i2v_module, "ftfy", mock.Mock(fix_text=lambda text: text), create=True):
        return pipeline(image=_pil(source_images)[0], prompt=prompts, height=32, width=32, num_frames=5,
                        num_inference_steps=steps, guidance_scale=guidance, generator=generator, output_type="pt",
                        max_sequence_length=16).frames


def _load_lora_weights(pipeline, lora_dir):
    pipeline.load_lora_weights(lora_dir)


def _load_transformer_lora(pipeline, lora_dir):
    # HunyuanVideo15Pipeline has no load_lora_weights in diffusers 0.42: its transformer loads the file
    pipeline.transformer.load_lora_adapter(lora_dir, prefix="transformer",
                                           weight_name="pytorch_lora_weights.safetensors")


def _float_sources(seed, n=2):
    return {"source_images": torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))}


def _pixel_sources(seed, n=2):
    pixels = (np.random.default_rng(seed).random((n, 32, 32, 3)) * 255).astype(np.uint8)
    return {"source_images": torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255}


def _two_pixel_sources(seed, n=2):  # two sources per prompt: (B, 2, 3, H, W)
    pixels = (np.random.default_rng(seed).random((n, 2, 32, 32, 3)) * 255).astype(np.uint8)
    return {"source_images": torch.from_numpy(pixels).permute(0, 1, 4, 2, 3).float() / 255}


@dataclasses.dataclass(frozen=True)
class Row:
    build: Callable  # build(seed=0) -> the family's tiny pipeline (the same weights for the same seed)
    variant: str  # the config variant that trains it (ddpo_group/config/variants/)
    guidances: tuple  # the guidance scales checked (1.0: CFG off); the last one is the cat / index check's
    call: Callable  # how its diffusers pipeline is called (the _call_* functions above)
    configure: dict = dataclasses.field(default_factory=dict)  # policy.configure(...) before sampling
    sde_types: tuple = ("sde", "cps", "dance")  # the SDE types re-scored; ("",): a DDIM family (its noise is eta)
    cat_sde_types: tuple | None = None  # those re-scored after cat / index (None: the first of sde_types)
    eta: float = 0.7  # the noise level of the re-scored samples
    pipeline_etas: tuple = (0.0,)  # the noise levels at which sampling is the pipeline's __call__ (DDIM: 0 and 1)
    tolerance: float = 1e-5  # max |ours - pipeline's| of the images in [0, 1]
    sample_shape: tuple = (3, 32, 32)  # one sample: (3, H, W), a video (F, 3, H, W)
    prompts: tuple = PROMPTS
    inputs: Callable | None = None  # inputs(seed) -> more sample() keywords, e.g. an editing family's source_images
    resume: bool = True  # clause 5 (a resumed run ends where a straight one does)
    one_prompt_per_call: bool = False  # the pipeline takes one prompt a call: clause 1 draws each row's noise alone
    load_lora: Callable = _load_lora_weights  # load_lora(pipeline, lora_dir): diffusers' loader of the LoRA export


ROWS = {
    "stable_diffusion": Row(build_tiny_pipeline, "test", (1.0, 5.0), _call_ddim, sde_types=("",), eta=1.0,
                            pipeline_etas=(0.0, 1.0), tolerance=1e-4, resume=False),
    "sdxl": Row(build_tiny_sdxl_pipeline, "tiny_sdxl", (1.0, 5.0), _call_ddim, sde_types=("",), eta=1.0,
                pipeline_etas=(0.0, 1.0)),
    "sd3": Row(build_tiny_sd3_pipeline, "tiny_sd3", (4.5,), _call_flow, tolerance=1e-4, resume=False),
    "sd_flow": Row(build_tiny_sd_flow_pipeline, "tiny_sd_flow", (1.0, 4.5), _call_sd_flow, tolerance=1e-4,
                   resume=False),
    "flux": Row(build_tiny_flux_pipeline, "tiny_flux", (3.5,), _call_flow, tolerance=1e-4, resume=False),
    "flux_kontext": Row(build_tiny_flux_kontext_pipeline, "tiny_flux_kontext", (2.5,), _call_kontext,
                        configure=dict(max_sequence_length=16, resolution=32), sde_types=("sde", "cps"),
                        cat_sde_types=("sde", "cps"),
                        prompts=EDIT_PROMPTS, inputs=_float_sources),
    "qwen_image": Row(build_tiny_qwen_image_pipeline, "tiny_qwen_image", (1.0, 4.0), _call_qwen,
                      configure=dict(max_sequence_length=32), tolerance=1e-4, resume=False),
    "qwen_image_edit": Row(build_tiny_qwen_image_edit_pipeline, "tiny_qwen_image_edit", (1.0, 4.0), _call_qwen_edit,
                           configure=dict(max_sequence_length=32, resolution=32), sde_types=("sde",),
                           prompts=EDIT_PROMPTS, inputs=_pixel_sources),
    "wan": Row(build_tiny_wan_pipeline, "tiny_wan", (1.0, 4.0), _call_wan, configure=dict(max_sequence_length=16),
               sample_shape=(5, 3, 32, 32)),
    "flux2": Row(build_tiny_flux2_pipeline, "tiny_flux2", (4.0,), _call_flux2, configure=dict(max_sequence_length=64),
                 resume=False),
    "flux2_klein": Row(build_tiny_flux2_klein_pipeline, "tiny_flux2_klein", (1.0, 4.0), _call_flux2,
                       configure=dict(max_sequence_length=64), sde_types=("sde", "cps"), resume=False),
    "zimage": Row(build_tiny_zimage_pipeline, "tiny_zimage", (1.0, 4.5), _call_zimage,
                  configure=dict(max_sequence_length=32), resume=False),
    "sana": Row(build_tiny_sana_pipeline, "tiny_sana", (1.0, 4.5), _call_sana, configure=dict(max_sequence_length=16),
                sde_types=("sde", "cps"), resume=False),
    "qwen_image_edit_plus": Row(build_tiny_qwen_image_edit_plus_pipeline, "tiny_qwen_image_edit_plus", (1.0, 4.0),
                                _call_qwen_edit_plus, configure=dict(max_sequence_length=64, resolution=32),
                                sde_types=("sde",), prompts=EDIT_PROMPTS, inputs=_two_pixel_sources,
                                resume=False, one_prompt_per_call=True),
    "hunyuan_video15": Row(build_tiny_hunyuan_video15_pipeline, "tiny_hunyuan_video15", (1.0, 6.0),
                           _call_hunyuan_video15, configure=dict(max_sequence_length=32), sde_types=("sde",),
                           sample_shape=(5, 3, 32, 32), prompts=QUOTED_PROMPTS, one_prompt_per_call=True,
                           load_lora=_load_transformer_lora),
    "hunyuan_video15_i2v": Row(build_tiny_hunyuan_video15_i2v_pipeline, "tiny_hunyuan_video15_i2v", (1.0, 6.0),
                               _call_hunyuan_video15, configure=dict(max_sequence_length=32), sde_types=("sde",),
                               sample_shape=(5, 3, 32, 32), prompts=QUOTED_PROMPTS, inputs=_pixel_sources,
                               one_prompt_per_call=True, load_lora=_load_transformer_lora, resume=False),
    "wan_i2v": Row(build_tiny_wan_i2v_pipeline, "tiny_wan_i2v", (1.0, 4.0), _call_wan_i2v,
                   configure=dict(max_sequence_length=16), sde_types=("sde",), sample_shape=(5, 3, 32, 32),
                   inputs=_pixel_sources, one_prompt_per_call=True),
    "ltx2": Row(build_tiny_ltx2_pipeline, "tiny_ltx2", (1.0, 4.0), _call_ltx2, configure=dict(max_sequence_length=16),
                sample_shape=(5, 3, 32, 32)),
}

# registered families whose contract is checked in their own test file, and why they do not fit a row
FAMILY_CONTRACT_ELSEWHERE = {
    "wan_moe": "tests/test_wan22_moe.py: two experts (the step's expert recorded, guidance_scale_2, LoRA in lora/ and "
               "lora_2/ loaded with load_into_transformer_2); its file checks noise 0 = WanPipeline, exact re-scoring "
               "also after cat / index, the LoRA round trip through diffusers, the family and the evaluation's "
               "loader, and a resume",
}


def _inputs(row, seed):
    return row.inputs(seed) if row.inputs else {}


@pytest.fixture(scope="module")
def tiny():
    """tiny(name) -> the row's pipeline, built once for the module (the checks leave its weights as they are)."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = ROWS[name].build(seed=0)
        return built[name]

    return get


def _policy(pipeline, row, sde_type=""):
    policy = policy_for(pipeline)
    policy.configure(sde_type=sde_type, **row.configure)
    return policy


def test_every_registered_family_has_a_row():
    missing = sorted(set(FAMILIES) - set(ROWS) - set(FAMILY_CONTRACT_ELSEWHERE))
    assert not missing, f"families without a row in tests/test_family_contract.py ROWS: {missing} (add one each)"
    assert not set(ROWS) - set(FAMILIES) and not set(FAMILY_CONTRACT_ELSEWHERE) - set(FAMILIES)
    assert not set(ROWS) & set(FAMILY_CONTRACT_ELSEWHERE)


def _noise(row):
    """sample() keywords for the initial noise of clause 1: one generator for the batch, or one per prompt (seeds 3,
    4, ...) for a row whose pipeline takes one prompt a call"""
    if row.one_prompt_per_call:
        return dict(initial_generator=[torch.Generator().manual_seed(3 + i) for i in range(len(row.prompts))])
    return dict(generator=torch.Generator().manual_seed(3))


def _pipeline_call(row, pipeline, prompts, guidance, eta, inputs):
    if not row.one_prompt_per_call:
        return row.call(pipeline, prompts, 4, guidance, eta, torch.Generator().manual_seed(3), **inputs)
    return torch.cat([row.call(pipeline, prompts[i : i + 1], 4, guidance, eta, torch.Generator().manual_seed(3 + i),
                               **{k: v[i : i + 1] for k, v in inputs.items()}) for i in range(len(prompts))])


# ---- 1. noise 0 is the pipeline


@pytest.mark.parametrize("name,guidance,eta", [
    (name, guidance, eta) for name, row in ROWS.items() for guidance in row.guidances for eta in row.pipeline_etas
])
def test_noise_level_zero_reproduces_the_pipeline(tiny, name, guidance, eta):
    row, pipeline = ROWS[name], tiny(name)
    policy = _policy(pipeline, row)
    assert policy.family == name
    prompts, inputs = list(row.prompts), _inputs(row, 9)
    ours = policy.sample(prompts, 4, guidance, eta, **_noise(row), **inputs)
    theirs = _pipeline_call(row, pipeline, prompts, guidance, eta, inputs)
    assert ours.images.shape == theirs.shape == (2, *row.sample_shape)
    assert (ours.images - theirs).abs().max() < row.tolerance  # eta 1 (DDIM): the same noise from the same generator
    assert (theirs[0] - theirs[1]).abs().max() > 1e-2  # the prompts make different images
    assert (ours.mask.sum() == 0) if eta == 0 else ours.mask.eq(1).all()  # deterministic steps have no density
    if policy.video:
        assert (theirs[:, 0] - theirs[:, -1]).abs().max() > 1e-2  # and the frames differ
    if row.inputs:
        other = policy.sample(prompts, 4, guidance, eta, **_noise(row), **_inputs(row, 10))
        # the source conditions the edit, well above the agreement with the pipeline (Edit-Plus at w 4: 1.0e-3)
        assert (other.images - ours.images).abs().max() > 10 * row.tolerance


# ---- 2. re-scoring is exact


@pytest.mark.parametrize("name,guidance,sde_type", [
    (name, guidance, sde_type) for name, row in ROWS.items() for guidance in row.guidances for sde_type in row.sde_types
])
def test_rescoring_with_unchanged_weights_is_exact(tiny, name, guidance, sde_type):
    row, pipeline = ROWS[name], tiny(name)
    policy = _policy(pipeline, row, sde_type)
    batch = policy.sample(list(row.prompts), 4, guidance, row.eta, generator=torch.Generator().manual_seed(0),
                          **_inputs(row, 9))
    assert batch.log_probs.dtype == torch.float32 and torch.isfinite(batch.log_probs).all()
    rows = torch.arange(2)
    for k in range(4):
        log_prob, _, _ = policy.step_log_prob(policy.trainable_module, batch, rows, torch.full((2,), k), guidance,
                                              row.eta)
        assert torch.equal(log_prob, batch.log_probs[:, k])
    if sde_type == "cps":  # std = sigma' sin(a pi / 2) is 0 at the last step (sigma' = 0): no density there
        assert batch.mask[:, :3].eq(1).all() and batch.mask[:, 3].eq(0).all()
    else:
        assert torch.equal(batch.mask, torch.ones(2, 4))
    if sde_type in ("", "sde"):  # the public re-scoring function (its default SDE type)
        assert torch.equal(trajectory_log_probs(pipeline, batch, guidance, row.eta), batch.log_probs)


# ---- 3. ... also after cat and index


def _per_row_fields(batch):
    """(name, tensor) of every per-row tensor of `batch`, a dict field's values as name.key."""
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if value is None or not field.metadata.get("per_row", True) or field.name == "prompts":
            continue
        if isinstance(value, dict):
            yield from ((f"{field.name}.{key}", v) for key, v in sorted(value.items()))
        else:
            yield field.name, value


@pytest.mark.parametrize("name,sde_type", [
    (name, sde_type) for name, row in ROWS.items() for sde_type in (row.cat_sde_types or row.sde_types[:1])
])
def test_batches_concatenate_index_and_rescore_exactly_after_them(tiny, name, sde_type):
    row, pipeline = ROWS[name], tiny(name)
    policy, guidance = _policy(pipeline, row, sde_type), row.guidances[-1]
    first = policy.sample(["a cat", "a dog"], 3, guidance, row.eta, generator=torch.Generator().manual_seed(5),
                          **_inputs(row, 1))
    second = policy.sample(list(row.prompts), 3, guidance, row.eta, generator=torch.Generator().manual_seed(6),
                           **_inputs(row, 2))
    both = Trajectories.cat([first, second])
    picked = both.index([3, 0])
    assert both.prompts == first.prompts + second.prompts and picked.prompts == [second.prompts[1], first.prompts[0]]
    assert both.images.shape == (4, *row.sample_shape)
    fields = [dict(_per_row_fields(b)) for b in (first, second, both, picked)]
    assert fields[0].keys() == fields[1].keys() == fields[2].keys() == fields[3].keys()
    for key in fields[2]:  # every per-row field: text embeddings, pooled ones, masks, time ids, source latents ...
        assert torch.equal(fields[2][key], torch.cat([fields[0][key], fields[1][key]])), key
        assert torch.equal(fields[3][key][0], fields[1][key][1]) and torch.equal(fields[3][key][1], fields[0][key][0])
    for start, part in ((0, first), (2, second)):  # each sampling batch's rows, in the sampling layout
        rows = torch.arange(start, start + 2)
        for k in range(3):
            log_prob, _, _ = policy.step_log_prob(policy.trainable_module, both, rows, torch.full((2,), k), guidance,
                                                  row.eta)
            assert torch.equal(log_prob, part.log_probs[:, k])
    again = Trajectories.cat([both.index([0, 1]), both.index([2, 3])])  # index then cat: the same rows, exact
    for k in range(3):
        log_prob, _, _ = policy.step_log_prob(policy.trainable_module, again, torch.arange(2, 4), torch.full((2,), k),
                                              guidance, row.eta)
        assert torch.equal(log_prob, second.log_probs[:, k])


# ---- 4. and 5. LoRA exports in diffusers' format; a resumed run ends where a straight one does


@pytest.mark.parametrize("name", list(ROWS))
def test_lora_exports_and_a_resumed_run_ends_where_a_straight_one_does(tiny, tmp_path, name):
    row = ROWS[name]
    # LoRA rank 2 with the reference as the adapter-free base model (disabled adapters) and its KL in the loss; one
    # optimizer step an epoch (4 samples, micro-batches of 2, accumulation 2): every epoch exactly on-policy
    config = make_config(tmp_path, variant=row.variant, **cheap(
        train__learning_rate=3e-2, use_lora=True, lora_rank=2, train__use_reference_model=True,
        train__use_kl_loss=True, train__beta=0.01, train__gradient_accumulation_steps=2,
    ))

    def samples(policy):  # noise 0 from fixed noise (and sources), the variant's guidance and text length
        configure_from_sample(policy, config.sample)
        return policy.sample(list(row.prompts), 3, config.sample.guidance_scale, 0.0,
                             generator=torch.Generator().manual_seed(5), **_inputs(row, 5)).images

    straight_config = copy.deepcopy(config)  # the same run made straight through two epochs (clause 5)
    straight_config.run_name, straight_config.num_epochs = "straight", 2
    trainer = Trainer(config)
    run_dir = trainer.run()
    first = read_metrics(run_dir)
    assert first[0]["approx_kl"] == 0.0 and first[0]["train/on_policy_max_abs_log_ratio"] == 0.0
    assert first[0]["train/global_step"] == 1 and first[0]["train/skipped_steps"] == 0 and first[0]["kl"] >= 0
    # the adapters of checkpoint_1 load into a fresh pipeline (diffusers' format) and through the family's own loader
    checkpoint = os.path.join(run_dir, "checkpoints", "checkpoint_1")
    fresh = row.build(seed=0)
    row.load_lora(fresh, os.path.join(checkpoint, "lora"))
    trained, loaded = samples(trainer.policy), samples(policy_for(fresh))
    assert (trained - samples(policy_for(tiny(name)))).abs().max() > 1e-4  # training moved the adapters
    assert (loaded - trained).abs().max() < 1e-5
    again = policy_for(row.build(seed=0))
    again.load_trainable(again.prepare("cpu", torch.float32, use_lora=True, lora_rank=2), checkpoint, use_lora=True)
    assert (samples(again) - trained).abs().max() < 1e-5
    if not row.resume:
        return
    # resume to a second epoch: it starts from the checkpoint's adapters and step
    config.resume_from, config.num_epochs = run_dir, 2
    resumed = Trainer(config, overrides={"resume_from", "num_epochs"})
    assert (samples(resumed.policy) - trained).abs().max() < 1e-5
    resumed.run()
    rows = read_metrics(run_dir)
    assert [r["epoch"] for r in rows] == [0, 1] and [r["approx_kl"] for r in rows] == [0.0, 0.0]
    assert rows[-1]["train/skipped_steps"] == 0 and math.isfinite(rows[-1]["loss"])
    assert rows[-1]["train/global_step"] == 2 * rows[0]["train/global_step"] > 0  # it went on from the first's step
    # ... and ends where a run made straight through does, bit for bit
    straight = train(straight_config)

    def lora(run):
        return load_file(os.path.join(run, "checkpoints", "checkpoint_2", "lora", "pytorch_lora_weights.safetensors"))

    end, again = lora(straight), lora(run_dir)
    assert set(end) == set(again) and all(torch.equal(end[k], again[k]) for k in end)
    assert read_metrics(straight)[1]["loss"] == rows[1]["loss"]


@pytest.mark.parametrize("loss", ["dppo", "grpo_guard"])
@pytest.mark.parametrize("name", list(ROWS))
def test_the_drift_losses_train_on_the_family(tmp_path, name, loss):
    # the row's variant at test size (two micro-batches, one optimizer step each: the second is off-policy), LoRA
    config = make_config(tmp_path, variant=ROWS[name].variant, **cheap(
        train__policy_loss=loss, use_lora=True, lora_rank=2, log_images_every=0, save_freq=0))
    row = read_metrics(train(config))[-1]
    assert math.isfinite(row["loss"]) and row["train/skipped_steps"] == 0 and row["train/global_step"] >= 2
    trained = [k for k, on in enumerate(row["steps/trained"]) if on]
    assert trained and all(math.isfinite(row["steps/kl_old"][k]) for k in trained)
    assert all(math.isfinite(row["steps/norm_log_ratio_std"][k]) for k in trained)
