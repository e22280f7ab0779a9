"""Wan image-to-video (ddpo_group/diffusion/wan_i2v.py) on the tiny twins tiny-wan-i2v (Wan 2.1 I2V: one
transformer, a CLIP image encoder) and tiny-wan22-i2v (Wan 2.2 A14B I2V: two experts, no image encoder).

Checked: the image condition is WanImageToVideoPipeline.prepare_latents' own (mask channels + the VAE's normalised
latents of [image, 0, ...]) and the initial noise its draw; on the two-expert twin noise 0 gives the pipeline's
videos and re-scoring is bit-exact also after cat / index (tiny-wan-i2v: the wan_i2v row of
tests/test_family_contract.py, with the LoRA round trip and the resume); an I2V prompt without its image is one line
naming the field; two epochs train exactly on policy with rewards that see each prompt's source; the report shows
source -> video; Wan 2.2 TI2V-5B's I2V is refused.

diffusers 0.42's WanImageToVideoPipeline calls ``ftfy.fix_text`` whether or not ftfy is installed: the comparisons
with its ``__call__`` give it the identity (what ftfy does to these ASCII prompts).
"""

import json
import math
import os
import types

import numpy as np
import pytest
import torch
from PIL import Image

import diffusers.pipelines.wan.pipeline_wan_i2v as pipeline_wan_i2v
from ddpo_group.config.check import ConfigError, load_config_prompts
from ddpo_group.diffusion.base import Trajectories
from ddpo_group.diffusion.policy import family_for_model, load_policy, policy_for
from ddpo_group.diffusion.wan_i2v import WanI2VPolicy, build_tiny_wan22_i2v_pipeline, build_tiny_wan_i2v_pipeline
from ddpo_group.data.edit_sources import read_source_image
from ddpo_group.data.prompts import load_prompts
from ddpo_group.training.trainer import train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a red circle", "a big blue square on a white background"]
LENGTH = 16
BUILDERS = {"tiny-wan-i2v": build_tiny_wan_i2v_pipeline, "tiny-wan22-i2v": build_tiny_wan22_i2v_pipeline}
SEEN = []  # what i2v_reward received


def i2v_reward(images, prompts, metadata):
    """A frame reward: closeness of a frame to the prompt's first frame (mean |frame - source|, negated)."""
    sources = torch.stack([m["source_image"] for m in metadata])
    SEEN.append((images.clone(), sources.clone()))
    return -(images - sources).abs().mean(dim=(1, 2, 3)), {}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def pipeline(request):
    return BUILDERS[request.param](seed=0)


@pytest.fixture()
def no_ftfy(monkeypatch):
    monkeypatch.setattr(pipeline_wan_i2v, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)


def _policy(pipeline, **options):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=LENGTH, **options)
    return policy


def _pixels(seed, n=1):
    return (np.random.default_rng(seed).random((n, 32, 32, 3)) * 255).astype(np.uint8)


def _sources(pixels):
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255


def test_the_family_is_found_by_name_and_by_pipeline(pipeline):
    for name in BUILDERS:
        assert family_for_model(name) is WanI2VPolicy
    policy = policy_for(pipeline)
    assert type(policy) is WanI2VPolicy and policy.conditions_on_images
    assert policy.two_experts == (pipeline.transformer_2 is not None)
    assert type(load_policy("tiny-wan22-i2v")) is WanI2VPolicy


def test_the_condition_and_the_noise_are_the_pipelines_own(pipeline):
    policy = _policy(pipeline)
    sources = _sources(_pixels(1))
    cond = policy._encode_source(sources)
    noise, condition = pipeline.prepare_latents(sources * 2 - 1, 1, 4, 32, 32, 5, torch.float32, torch.device("cpu"),
                                                torch.Generator().manual_seed(4))
    assert torch.equal(cond["image_condition"], condition) and condition.shape == (1, 2 + 4, 3, 8, 8)
    assert torch.equal(policy._initial_latents(1, torch.device("cpu"), torch.Generator().manual_seed(4)), noise)
    assert ("image_embeds" in cond) == (pipeline.image_encoder is not None)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_noise_level_zero_reproduces_the_pipeline(pipeline, guidance, no_ftfy):
    if pipeline.transformer_2 is None:
        pytest.skip("tiny-wan-i2v: the wan_i2v row of tests/test_family_contract.py")
    policy = _policy(pipeline)
    pixels = _pixels(2)
    ours = policy.sample(PROMPTS[:1], 4, guidance, 0.0, generator=torch.Generator().manual_seed(3),
                         source_images=_sources(pixels))
    theirs = pipeline(image=Image.fromarray(pixels[0]), prompt=PROMPTS[:1], height=32, width=32, num_frames=5,
                      num_inference_steps=4, guidance_scale=guidance, generator=torch.Generator().manual_seed(3),
                      output_type="pt", max_sequence_length=LENGTH).frames
    assert ours.images.shape == theirs.shape == (1, 5, 3, 32, 32)
    assert (ours.images - theirs).abs().max() < 1e-5
    other = policy.sample(PROMPTS[:1], 4, guidance, 0.0, generator=torch.Generator().manual_seed(3),
                          source_images=_sources(_pixels(5)))
    assert (other.images - ours.images).abs().max() > 1e-3  # the image conditions the video


def test_rescoring_is_exact_also_after_cat_and_index(pipeline):
    if pipeline.transformer_2 is None:
        pytest.skip("tiny-wan-i2v: the wan_i2v row of tests/test_family_contract.py")
    policy = _policy(pipeline)
    first = policy.sample(["a cat", "a dog"], 4, 4.0, 0.7, generator=torch.Generator().manual_seed(5),
                          source_images=_sources(_pixels(6, 2)))
    second = policy.sample(PROMPTS, 4, 4.0, 0.7, generator=torch.Generator().manual_seed(6),
                           source_images=_sources(_pixels(7, 2)))
    for k in range(4):
        log_prob, _, _ = policy.step_log_prob(policy.trainable_module, first, torch.arange(2), torch.full((2,), k), 4.0, 0.7)
        assert torch.equal(log_prob, first.log_probs[:, k])
    both = Trajectories.cat([first, second]).index([2, 3, 0, 1])
    assert both.extra_cond["image_condition"].shape == (4, 6, 3, 8, 8)
    for k in range(4):
        log_prob, _, _ = policy.step_log_prob(policy.trainable_module, both, torch.arange(2), torch.full((2,), k), 4.0, 0.7)
        assert torch.equal(log_prob, second.log_probs[:, k])


def test_a_prompt_without_its_image_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="field 'source_image'") as info:
        _policy(build_tiny_wan_i2v_pipeline()).sample(PROMPTS, 2, 4.0, 0.7)
    assert "\n" not in str(info.value)
    Image.fromarray(_pixels(1)[0]).save(tmp_path / "ok.png")
    prompts = tmp_path / "i2v.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat", "source_image": "ok.png"}) + "\n" + json.dumps({"prompt": "a dog"}))
    config = make_config(tmp_path, variant="tiny_wan_i2v", prompt_fn=str(prompts))
    with pytest.raises(ConfigError, match="'a dog' has no field 'source_image'.*tiny-wan-i2v") as info:
        load_config_prompts(config, "prompt_fn")
    assert "\n" not in str(info.value)


def test_wan_2_2_ti2v_image_to_video_is_refused_in_one_line():
    pipeline = build_tiny_wan_i2v_pipeline()
    pipeline.register_to_config(expand_timesteps=True)
    with pytest.raises(ValueError, match="TI2V-5B's image-to-video"):
        _policy(pipeline)


def test_two_epochs_train_exactly_on_policy_rewards_see_the_sources_and_the_report_shows_source_to_video(tmp_path):
    SEEN.clear()
    run_dir = train(make_config(tmp_path, variant="tiny_wan_i2v", reward_fn="test_wan_i2v:i2v_reward",
                                sample__batch_size=2, sample__num_batches_per_epoch=2,
                                train__gradient_accumulation_steps=2))
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [0, 1] and rows[-1]["train/skipped_steps"] == 0
    assert rows[0]["approx_kl"] == 0.0 and rows[0]["train/on_policy_max_abs_log_ratio"] == 0.0
    assert math.isfinite(rows[-1]["loss"]) and rows[0]["reward_mean"] < 0
    sources = {r.metadata["source_image"] for r in load_prompts("shapes_edits.jsonl")}
    _, seen = SEEN[0]
    assert seen.shape == (6, 3, 32, 32)  # 3 frames of each of 2 videos (reward_frames), each against its first frame
    assert any(torch.equal(seen[0], read_source_image(path)) for path in sources)
    document = json.loads(open(os.path.join(run_dir, "samples", "epoch_0000.json")).read())
    record = document["records"][0]
    assert record["image"].endswith(".webp") and record["source_image"].endswith("_source.png")
    from ddpo_group.report.page import build_report

    page = build_report(run_dir)
    assert "source &rarr; edited" in page and "data:image/webp;base64," in page


@pytest.mark.parametrize("overrides", [dict(), dict(train__objective="nft", forward__num_timesteps=2, train__experts="both"),
                                       dict(algorithm__adv_estimator="gae")])
def test_the_two_expert_i2v_twin_trains_its_high_noise_expert_and_other_algorithms_run(tmp_path, overrides):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_wan22_i2v", **cheap(**overrides))))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])


@pytest.mark.slow
def test_the_gpu_check_rows_of_image_to_video(tmp_path):
    """benchmarks/gpu_check.py: wan21-i2v / wan22-i2v are the published architectures (random weights) sampled as
    the wan21_i2v / wan22_i2v presets from a first frame; the tiny code path passes every check on the CPU."""
    from test_flow_gpu_check import _gpu_check_module, run_check

    gpu_check = _gpu_check_module()
    for arch, model, side in (("wan21-i2v", "random-wan21-i2v-14b", 240), ("wan22-i2v", "random-wan22-i2v-a14b", 480)):
        spec = gpu_check.arch_settings(arch, gpu_check.parse_args(["--arch", arch]))
        assert spec["model"] == model and spec["image_to_video"] and spec["resolution"] == side
    result, results = run_check(tmp_path, "--arch", "tiny-wan-i2v", "--variants", "grpo")
    assert result.returncode == 0 and "result: PASS" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    entry = results["archs"]["tiny-wan-i2v"]["dtypes"]["bf16"]
    assert entry["num_frames"] == 5 and entry["ode_vs_pipeline_max_abs_image_diff"] < 0.1  # bf16
    assert entry["variants"]["grpo"]["approx_kl_by_epoch"] == [0.0, 0.0]
