"""The sd_flow family (ddpo_group/diffusion/sd_flow.py): SD's UNet stepped by flow matching, told apart from the
stable_diffusion family by its scheduler, and ``ddpo-group pretrain --arch sd-flow`` that makes one on the scenes
world. The family contract (sampling = diffusers' Euler loop, exact re-scoring, LoRA) is tests/test_family_contract.py's
row "sd_flow"."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from ddpo_group.cli import pretrain
from ddpo_group.data.scenes import SCENE_WORDS
from ddpo_group.diffusion.loading import load_pipeline
from ddpo_group.diffusion.policy import family_for_model, load_policy, policy_for
from ddpo_group.diffusion.sd_flow import StableDiffusionFlowPolicy, build_tiny_sd_flow_pipeline
from ddpo_group.diffusion.tiny import build_tiny_pipeline, build_tiny_scenes_pipeline


def test_the_scheduler_tells_the_two_unet_families_apart_in_memory_and_on_disk(tmp_path):
    flow, ddim = build_tiny_sd_flow_pipeline(seed=0), build_tiny_pipeline(seed=0)
    assert policy_for(flow).family == "sd_flow" and policy_for(ddim).family == "stable_diffusion"
    flow.save_pretrained(tmp_path / "flow")
    ddim.save_pretrained(tmp_path / "ddim")
    assert family_for_model(str(tmp_path / "flow")) is StableDiffusionFlowPolicy
    assert family_for_model(str(tmp_path / "ddim")).family == "stable_diffusion"
    policy = load_policy(str(tmp_path / "flow"))
    assert policy.family == "sd_flow" and type(policy.pipeline.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert policy.pipeline.scheduler.config.shift == 3.0
    # the DDIM loader would have put DDIM's betas on a velocity model without a word: it refuses, naming the family
    with pytest.raises(ValueError, match="flow-matching UNet.*sd_flow"):
        load_pipeline(str(tmp_path / "flow"))
    with pytest.raises(ValueError, match="not FlowMatchEulerDiscreteScheduler"):
        StableDiffusionFlowPolicy.load(str(tmp_path / "ddim"))


def test_clip_has_no_t5_tokens_to_count_and_the_resolution_is_the_unets():
    policy = policy_for(build_tiny_sd_flow_pipeline(seed=0))
    assert policy.resolution == 32  # sample_size 8 latents x the VAE's factor 4
    with pytest.raises(ValueError, match="max_sequence_length=16"):
        policy.configure(sde_type="sde", max_sequence_length=16)
    with pytest.raises(ValueError, match="multiple of 8"):  # two halvings of the latent side (three levels)
        policy.configure(resolution=36)
    policy.configure(sde_type="sde", resolution=64)
    assert policy.resolution == 64


def test_the_flow_unets_pretraining_loss_is_the_velocity_error_at_logit_normal_levels():
    """pretrain.denoiser_loss("sd-flow"): mean (v_theta(x_s, 1000 s, c) - (eps - x0))^2 with x_s = (1 - s) x0 + s eps
    and s = sigmoid(N(0, 1)), the draws in that order from the generator; computed here from the same draws."""
    pretrain._import_torch()  # the CLI imports torch when a pretraining starts
    pipeline = build_tiny_scenes_pipeline(SCENE_WORDS, "sd-flow", seed=1)
    z0 = torch.randn(3, 4, 16, 16, generator=torch.Generator().manual_seed(5))
    ids = pipeline.tokenizer(["a photo of a red circle", "", "a photo of two stars"], padding="max_length",
                             max_length=pipeline.tokenizer.model_max_length, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = pretrain.denoiser_loss(pipeline, "sd-flow", z0, ids, torch.Generator().manual_seed(9))
        g = torch.Generator().manual_seed(9)
        eps = torch.randn(z0.shape, generator=g)
        s = torch.sigmoid(torch.randn(3, generator=g))
        x = (1 - s.view(-1, 1, 1, 1)) * z0 + s.view(-1, 1, 1, 1) * eps
        v = pipeline.unet(x, s * 1000, pipeline.text_encoder(ids)[0]).sample
        expected = F.mse_loss(v, eps - z0)
    assert torch.equal(loss, expected)


def test_pretrain_arch_sd_flow_writes_a_flow_unet_the_family_loads(tmp_path, capsys):
    args = pretrain.parse_args(["--world", "scenes", "--arch", "sd-flow", "--quick", "--flow-times", "uniform",
                                "--output-dir", str(tmp_path / "model"), "--state-dir", str(tmp_path / "state"),
                                "--vae-from", os.path.join(pretrain.ASSETS_DIR, "tiny_scenes_sd3")])
    assert args.guidance_scale == 4.5  # evaluated as the flow model is
    pretrain.main(["--world", "scenes", "--arch", "sd-flow", "--quick", "--flow-times", "uniform",
                   "--output-dir", str(tmp_path / "model"), "--state-dir", str(tmp_path / "state"),
                   "--vae-from", os.path.join(pretrain.ASSETS_DIR, "tiny_scenes_sd3")])
    with open(tmp_path / "model" / "pretrain_log.json") as f:
        log = json.load(f)
    assert (log["arch"], log["flow_times"]) == ("sd-flow", "uniform") and "init" not in log
    assert log["evaluation"]["eta"] is None and log["shift_factor"] is not None  # the ODE; SD3's latent convention
    policy = load_policy(str(tmp_path / "model"))
    assert policy.family == "sd_flow" and policy.pipeline.vae.config.shift_factor == log["shift_factor"]
    for refused in (["--init", "adaln-zero"], ["--patch", "1"]):
        with pytest.raises(SystemExit):
            pretrain.parse_args(["--world", "scenes", "--arch", "sd-flow", *refused])
        assert "the transformer's (--arch sd3)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrain.parse_args(["--arch", "sd-flow"])  # the shapes world's tiny-shapes is a DDIM UNet
    assert "is for --world scenes" in capsys.readouterr().err


def test_the_ladders_flow_family_trains_a_flow_unet_with_clips_fixed_length(tmp_path):
    """benchmarks/scenes_ladder.py --model-flow DIR of the sd_flow family: the flow variant's 16 zero T5 tokens
    (tiny_scenes, for the SD3 model) would be refused by the UNet's CLIP; the ladder sets 0 and the run trains."""
    from helpers import load_script

    ladder = load_script("benchmarks/scenes_ladder.py")
    pipeline = build_tiny_scenes_pipeline(SCENE_WORDS, "sd-flow", seed=0)
    pipeline.save_pretrained(tmp_path / "flow_unet")
    config = ladder.ladder_config("a", "flow", "jpeg", "a photo of three circles", 42, str(tmp_path / "run"),
                                  model=str(tmp_path / "flow_unet"))
    assert config.sample.max_sequence_length == 0 and config.pretrained.model == str(tmp_path / "flow_unet")
    policy = load_policy(config.pretrained.model)
    policy.configure(sde_type=config.sample.sde_type, max_sequence_length=config.sample.max_sequence_length,
                     resolution=config.sample.resolution)
    assert ladder.ladder_config("a", "flow", "jpeg", "a photo of three circles", 42,
                                str(tmp_path / "run")).sample.max_sequence_length == 16  # tiny-scenes-sd3's


def test_the_tiny_scenes_flow_variant_configures_the_shipped_flow_unet_with_its_settings():
    """config/grpo.py:tiny_scenes_flow is tiny_scenes's Flow-GRPO recipe on tiny-scenes-flow; the shipped model takes
    its sampler settings at 64 px (tiny_scenes's 16 T5 tokens would be refused by its CLIP)."""
    from ddpo_group.config import grpo

    config = grpo.get_config("tiny_scenes_flow")
    policy = load_policy(config.pretrained.model)
    assert policy.family == "sd_flow"
    with pytest.raises(ValueError, match="max_sequence_length=16"):
        policy.configure(sde_type="sde", max_sequence_length=grpo.get_config("tiny_scenes").sample.max_sequence_length)
    policy.configure(sde_type=config.sample.sde_type, max_sequence_length=config.sample.max_sequence_length,
                     resolution=config.sample.resolution)
    assert policy.resolution == 64


def test_the_flip_rate_benchmark_samples_a_flow_unet_as_its_variant_does():
    """benchmarks/flip_rate.py --model tiny-scenes-flow took tiny_scenes's settings (16 T5 tokens: refused by the
    UNet's CLIP); it takes tiny_scenes_flow's, and names its result after the shipped directory."""
    from helpers import load_script

    bench = load_script("benchmarks/flip_rate.py")
    policy = policy_for(build_tiny_sd_flow_pipeline(seed=0))
    sample = bench.sampling_config(policy).sample
    assert sample.max_sequence_length == 0 and sample.sde_type == "sde" and sample.eta == 0.7
    policy.configure(sde_type=sample.sde_type, max_sequence_length=sample.max_sequence_length)
    assert bench.sampling_config(policy_for(build_tiny_pipeline(seed=0))).sample.eta == 1.0  # the UNet's DDIM
    assert bench.model_label("tiny-scenes-flow") == "tiny_scenes_flow"
