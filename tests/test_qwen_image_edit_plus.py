"""Qwen-Image-Edit-2509 / 2511 (QwenImageEditPlusPolicy, several source images per prompt) on its tiny pipeline.

Checked against values computed here: the text encoder reads every source (its vision tokens, "Picture k: " each),
each source's normalised VAE mode is kept in order; the rewards see every source and the report shows picture 1;
other algorithms train; bad prompt files are one line naming the field. Noise 0 (QwenImageEditPlusPipeline's images,
one prompt per call), exact re-scoring after cat / index, the on-policy first epoch and the LoRA round trip:
tests/test_family_contract.py.
"""

import json
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.config.check import ConfigError, load_config_prompts
from ddpo_group.data.edit_sources import reward_metadata, source_images
from ddpo_group.data.prompts import load_prompts
from ddpo_group.diffusion.policy import family_for_model, policy_for
from ddpo_group.diffusion.qwen_image import (
    QwenImageEditPlusPolicy,
    build_tiny_qwen_image_edit_plus_pipeline,
)
from ddpo_group.training.trainer import train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a big blue circle on a white background", "a big green triangle on a black background"]
SEEN = []


def multi_edit_reward(images, prompts, metadata):
    """Closeness to the second source; records the sources it was given."""
    SEEN.append([m["source_images"] for m in metadata])
    second = torch.stack([m["source_images"][1] for m in metadata])
    return -(images - second).abs().mean(dim=(1, 2, 3)), {}


@pytest.fixture(scope="module")
def pipe():
    return build_tiny_qwen_image_edit_plus_pipeline(seed=0)


def _policy(pipeline):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=64, resolution=32)
    return policy


def _pixels(seed, k=2):
    return (np.random.default_rng(seed).random((2, k, 32, 32, 3)) * 255).astype(np.uint8)


def _as_sources(pixels):
    return torch.from_numpy(pixels).permute(0, 1, 4, 2, 3).float() / 255


def test_the_family_its_template_and_its_source_checks(pipe):
    assert family_for_model("tiny-qwen-image-edit-plus") is QwenImageEditPlusPolicy
    policy = _policy(pipe)
    assert policy.family == "qwen_image_edit_plus" and policy.conditions_on_images and policy.max_source_images == 3
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 64
    with pytest.raises(ValueError, match="every prompt needs 1 to 3 source images"):
        policy.sample(PROMPTS, 2, 4.0, 0.7)
    with pytest.raises(ValueError, match="field 'source_images': 4 source images per prompt"):
        policy.sample(PROMPTS, 2, 4.0, 0.7, source_images=torch.rand(2, 4, 3, 32, 32))
    with pytest.raises(ValueError, match=r"source_images must be \(B, K, 3, H, W\) = \(2, K, 3, 32, 32\)"):
        policy.sample(PROMPTS, 2, 4.0, 0.7, source_images=torch.rand(2, 2, 3, 16, 16))


def test_the_condition_reads_every_source_in_the_text_and_the_latents(pipe):
    policy = _policy(pipe)
    pixels = _pixels(0)
    batch = policy.sample(PROMPTS, 2, 4.0, 0.7, generator=torch.Generator().manual_seed(0),
                          source_images=_as_sources(pixels), keep_steps=False)
    text = [len(pipe.tokenizer(f"Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: "
                               f"<|vision_start|><|image_pad|><|vision_end|>{p}<|im_end|>\n<|im_start|>assistant\n"
                               ).input_ids) for p in PROMPTS]
    # each <|image_pad|> becomes the vision tower's merged tokens of the 384 px condition image (the tiny processor
    # resizes it to 28 px: 2 x 2 patches of 14, merged 2 x 2 into 1 token)
    grid = pipe.processor.image_processor(images=[Image.new("RGB", (384, 384))])["image_grid_thw"]
    merged = int(grid.prod()) // 4
    assert merged == 1
    assert batch.extra_cond["prompt_embeds_mask"].sum(1).tolist() == [n + 2 * (merged - 1) for n in text]
    latents = batch.extra_cond["image_latents"]
    assert latents.shape == (2, 2, 4, 8, 8)
    vae = pipe.vae
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1)
    std = torch.tensor([1.5, 0.8, 1.2, 2.0]).view(1, 4, 1, 1)
    with torch.no_grad():
        for k in range(2):
            mode = vae.encode((_as_sources(pixels)[:, k] * 2 - 1).unsqueeze(2)).latent_dist.mean[:, :, 0]
            torch.testing.assert_close(latents[:, k], (mode - mean) / std, rtol=0, atol=1e-6)
    swapped = policy.sample(PROMPTS, 2, 4.0, 0.7, generator=torch.Generator().manual_seed(0),
                            source_images=_as_sources(pixels[:, ::-1].copy()), keep_steps=False)
    assert torch.equal(swapped.extra_cond["image_latents"][:, 0], latents[:, 1])
    assert (swapped.prompt_embeds - batch.prompt_embeds).abs().max() > 1e-4  # "Picture 1" is another image
    assert (swapped.images - batch.images).abs().max() > 1e-4  # the order of the sources matters


def test_the_rewards_see_every_source_and_the_report_shows_picture_1(tmp_path):
    SEEN.clear()
    run_dir = train(make_config(tmp_path, variant="tiny_qwen_image_edit_plus", **cheap(
        log_images_every=1, reward_fn="test_qwen_image_edit_plus:multi_edit_reward")))
    assert math.isfinite(read_metrics(run_dir)[0]["loss"])
    by_prompt = {r.prompt: r.metadata["source_images"] for r in load_prompts("shapes_edits_two_sources.jsonl")}
    assert SEEN and all(len(sources) == 2 and sources[0].shape == (3, 32, 32) for batch in SEEN for sources in batch)
    document = json.loads(open(os.path.join(run_dir, "samples", "epoch_0000.json")).read())
    record = document["records"][0]  # the grid shows picture 1 as the row's source
    shown = np.asarray(Image.open(os.path.join(run_dir, "samples", record["source_image"])))
    assert np.array_equal(shown, np.asarray(Image.open(by_prompt[record["prompt"]][0]).convert("RGB")))


@pytest.mark.parametrize("overrides", [dict(train__objective="nft", forward__num_timesteps=2),
                                       dict(algorithm__adv_estimator="gae"), dict(sample__sde_type="cps")])
def test_other_algorithms_train_the_multi_source_model(tmp_path, overrides):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_qwen_image_edit_plus", **cheap(**overrides))))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])


def _png(path, size=32):
    Image.fromarray(np.zeros((size, size, 3), dtype=np.uint8)).save(path)


def test_bad_multi_source_prompts_are_one_line_naming_the_field(tmp_path):
    for name in ("a.png", "b.png", "c.png", "d.png"):
        _png(tmp_path / name)

    def check(records, variant="tiny_qwen_image_edit_plus"):
        path = tmp_path / "edits.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
        with pytest.raises(ConfigError) as info:
            load_config_prompts(make_config(tmp_path, variant=variant, prompt_fn=str(path)), "prompt_fn")
        assert "\n" not in str(info.value)
        return str(info.value)

    message = check([{"prompt": "x", "source_images": ["a.png", "b.png", "c.png", "d.png"]}])
    assert "field 'source_images' lists 4 images; config.pretrained.model='tiny-qwen-image-edit-plus' takes 1 to 3" \
        in message
    message = check([{"prompt": "x", "source_images": ["a.png"]}, {"prompt": "y", "source_images": ["a.png", "b.png"]}])
    assert "prompt 'x' has 1 source images and prompt 'y' 2; give every prompt of a run the same number" in message
    assert "'y' has no field 'source_images'" in check([{"prompt": "x", "source_images": ["a.png"]}, {"prompt": "y"}])
    message = check([{"prompt": "x", "source_images": ["a.png", "missing.png"]}])
    assert f"field 'source_images' '{tmp_path / 'missing.png'}' cannot be read" in message
    assert "must be a non-empty list" in check([{"prompt": "x", "source_images": []}])
    assert "either the field 'source_image' or 'source_images'" in check(
        [{"prompt": "x", "source_image": "a.png", "source_images": ["b.png"]}])
    message = check([{"prompt": "x", "source_images": ["a.png", "b.png"]}], variant="tiny_qwen_image_edit")
    assert "has a field 'source_images' but config.pretrained.model='tiny-qwen-image-edit' edits one image" in message
    message = check([{"prompt": "x", "source_images": ["a.png"]}], variant="tiny_qwen_image")
    assert "does not edit images" in message
    # good files: a list, and a single source_image (one source); both read as (B, K, 3, H, W) / (B, 3, H, W)
    path = tmp_path / "good.jsonl"
    path.write_text(json.dumps({"prompt": "x", "source_images": ["a.png", "b.png"]}) + "\n")
    (record,) = load_config_prompts(make_config(tmp_path, variant="tiny_qwen_image_edit_plus", prompt_fn=str(path)),
                                    "prompt_fn")
    assert record.metadata["source_images"] == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    sources = source_images([record], 32)
    assert sources.shape == (1, 2, 3, 32, 32)
    (meta,) = reward_metadata([record.metadata], sources)
    assert meta["source_image_paths"] == record.metadata["source_images"] and len(meta["source_images"]) == 2
    assert torch.equal(meta["source_image"], sources[0, 0]) and meta["source_image_path"] == str(tmp_path / "a.png")
    path.write_text(json.dumps({"prompt": "x", "source_image": "a.png"}) + "\n")
    load_config_prompts(make_config(tmp_path, variant="tiny_qwen_image_edit_plus", prompt_fn=str(path)), "prompt_fn")
