"""The HunyuanVideo 1.5 text-to-video family (ddpo_group.diffusion.hunyuan_video15) on its offline tiny pipeline.

Checked: the family is found by name and pipeline, checks its frames and resolution; the Qwen text is the pipeline's
cropped chat-template encoding, ByT5 reads only quoted texts; CFG is two transformer calls combined; every objective
trains; a frame count the VAE cannot make is one line naming the field; the image-to-video condition and report.
tests/test_family_contract.py (both families' rows) checks noise 0 = HunyuanVideo15Pipeline's videos (one prompt per
call, its VAE takes one video), exact re-scoring after cat / index, the on-policy first epoch, LoRA in diffusers'
format loaded into a fresh transformer (the pipeline has no LoRA loader in diffusers 0.42) and through the family,
and (text-to-video, its own save / load) a resumed run ending where a straight one does.
"""

import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.diffusion.hunyuan_video15 import HunyuanVideo15Policy, build_tiny_hunyuan_video15_pipeline
from ddpo_group.diffusion.policy import family_for_model, policy_for
from ddpo_group.training.trainer import Trainer, train
from helpers import cheap, make_config, read_metrics

PROMPTS = ['a big blue circle with the text "hi"', "a red square on a white background"]


@pytest.fixture(scope="module")
def pipe():
    return build_tiny_hunyuan_video15_pipeline(seed=0)


def _policy(pipeline):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=32)
    return policy


def test_the_family_its_frames_and_its_text(pipe):
    assert family_for_model("tiny-hunyuan-video15") is HunyuanVideo15Policy
    policy = _policy(pipe)
    assert policy.family == "hunyuan_video15" and policy.video
    assert (policy.height, policy.width, policy.num_frames, policy.latent_channels) == (32, 32, 5, 4)
    assert policy.critic_sizes() == {"latent_channels": 12, "prompt_dim": 32}
    with pytest.raises(ValueError, match=r"sample.num_frames=4: .* 1 \+ 2 k frames"):
        policy.configure_frames(4)
    with pytest.raises(ValueError, match="sample.resolution=30 must be a multiple of 4"):
        policy.configure(resolution=30)
    batch = policy.sample(PROMPTS, 2, 4.5, 0.7, generator=torch.Generator().manual_seed(0))
    assert batch.images.shape == (2, 5, 3, 32, 32) and batch.latents.shape == (2, 3, 4, 3, 8, 8)
    # the Qwen text: the chat template cropped after the system turn, max_sequence_length tokens, the layer 2 before last
    tokenizer = pipe.tokenizer
    inputs = tokenizer.apply_chat_template(
        [[{"role": "system", "content": pipe.system_message}, {"role": "user", "content": PROMPTS[1]}]],
        add_generation_prompt=True, tokenize=True, return_dict=True, padding="max_length",
        max_length=32 + pipe.prompt_template_encode_start_idx, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = pipe.text_encoder(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                                   output_hidden_states=True).hidden_states[-3]
    start = pipe.prompt_template_encode_start_idx
    torch.testing.assert_close(batch.prompt_embeds[1], hidden[0, start:], rtol=0, atol=1e-5)
    assert torch.equal(batch.extra_cond["prompt_embeds_mask"][1], inputs.attention_mask[0, start:])
    assert tokenizer.decode(inputs.input_ids[0, start : start + 1]).strip() == "a"  # the crop ends at the prompt
    # ByT5 reads the quoted text only: 'Text "hi". ' and </s>; no quote: zeros, mask 0
    assert batch.extra_cond["prompt_embeds_mask_2"].sum(1).tolist() == [len('Text "hi". ') + 1, 0]
    assert not batch.extra_cond["prompt_embeds_2"][1].any()
    # CFG: two calls combined
    x, t = batch.latents[:, 1], batch.timesteps[:, 1]
    with torch.no_grad():
        v = policy.predict(pipe.transformer, x, t, batch, torch.arange(2), 4.5)
        cond = policy._velocity(pipe.transformer, x, t, policy._rows_cond(batch, torch.arange(2)), 1.0)
        negative = {k.removeprefix("negative_"): v for k, v in policy._rows_cond(batch, torch.arange(2)).items()
                    if k.startswith("negative_")}
        uncond = policy._velocity(pipe.transformer, x, t, negative, 1.0)
    torch.testing.assert_close(v, uncond + 4.5 * (cond - uncond), rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", [dict(train__objective="nft", forward__num_timesteps=2),
                                       dict(algorithm__adv_estimator="gae"), dict(sample__sde_type="cps")])
def test_other_objectives_train_hunyuan_video15(tmp_path, overrides):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_hunyuan_video15", **cheap(**overrides))))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])


def test_frames_the_vae_cannot_make_are_one_line_naming_the_field(tmp_path):
    config = make_config(tmp_path, variant="tiny_hunyuan_video15", sample__num_frames=4)
    with pytest.raises((ConfigError, ValueError)) as info:
        check_config(config)
        train(config)
    assert "sample.num_frames=4" in str(info.value) and "\n" not in str(info.value)


# ---- image-to-video: the conditioning image rides in the trajectories as an editing family's source does ----

from ddpo_group.diffusion.hunyuan_video15 import (  # noqa: E402
    HunyuanVideo15ImageToVideoPolicy,
    build_tiny_hunyuan_video15_i2v_pipeline,
)


@pytest.fixture(scope="module")
def i2v():
    return build_tiny_hunyuan_video15_i2v_pipeline(seed=0)


def _sources(seed):
    pixels = (np.random.default_rng(seed).random((2, 32, 32, 3)) * 255).astype(np.uint8)
    return pixels, torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255


def test_the_i2v_condition_is_the_images_siglip_tokens_and_first_latent_frame(i2v):
    assert family_for_model("tiny-hunyuan-video15-i2v") is HunyuanVideo15ImageToVideoPolicy
    policy = _policy(i2v)
    assert policy.conditions_on_images and policy.video
    with pytest.raises(ValueError, match="every prompt needs one"):
        policy.sample(PROMPTS, 2, 4.5, 0.7)
    with pytest.raises(ValueError, match=r"source_images must be \(B, 3, H, W\) = \(2, 3, 32, 32\)"):
        policy.sample(PROMPTS, 2, 4.5, 0.7, source_images=torch.rand(2, 3, 16, 16))
    pixels, sources = _sources(0)
    batch = policy.sample(PROMPTS, 2, 4.5, 0.7, generator=torch.Generator().manual_seed(0), source_images=sources)
    with torch.no_grad():
        inputs = i2v.feature_extractor(images=[Image.fromarray(p) for p in pixels], return_tensors="pt")
        siglip = i2v.image_encoder(**inputs).last_hidden_state
        mode = torch.cat([i2v.vae.encode((sources[i : i + 1] * 2 - 1).unsqueeze(2)).latent_dist.mode()
                          for i in range(2)]) * i2v.vae.config.scaling_factor  # the VAE takes one image a call
    torch.testing.assert_close(batch.extra_cond["image_embeds"], siglip, rtol=0, atol=1e-5)
    torch.testing.assert_close(batch.extra_cond["image_latents"], mode, rtol=0, atol=1e-5)
    condition, _ = policy._condition(batch.latents[:, 0], batch.extra_cond, torch.float32)
    assert torch.equal(condition[:, :4, 0], batch.extra_cond["image_latents"][:, :, 0])
    assert not condition[:, :4, 1:].any() and condition[:, 4, 0].eq(1).all() and not condition[:, 4, 1:].any()


def test_an_i2v_run_shows_source_to_video_and_exports_lora(tmp_path):
    import json

    from safetensors.torch import load_file

    from ddpo_group.data.edit_sources import edit_pairs_html

    trainer = Trainer(make_config(tmp_path, variant="tiny_hunyuan_video15_i2v", use_lora=True, lora_rank=2,
                                  save_freq=1, log_images_every=1, num_epochs=1, sample__batch_size=2,
                                  sample__num_batches_per_epoch=2, train__gradient_accumulation_steps=2,
                                  sample__num_steps=2))
    run_dir = trainer.run()
    document = json.loads(open(os.path.join(run_dir, "samples", "epoch_0000.json")).read())
    record = document["records"][0]
    assert document["video"] and record["image"].endswith(".webp") and record["source_image"].endswith(".png")
    assert os.path.isfile(os.path.join(run_dir, "samples", document["grid"]))
    fragment = edit_pairs_html(run_dir)  # the report's source -> video pairs
    assert fragment.count("data:image/webp;base64,") == len(document["records"])
    assert fragment.count("data:image/png;base64,") == len(document["records"])
    checkpoint = os.path.join(run_dir, "checkpoints", "checkpoint_1")
    state = load_file(os.path.join(checkpoint, "lora", "pytorch_lora_weights.safetensors"))
    assert state and all(k.startswith("transformer.") for k in state)


def test_an_i2v_prompt_without_its_image_is_one_line_naming_the_field(tmp_path):
    import json

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a cat"}) + "\n")
    from ddpo_group.config.check import load_config_prompts

    with pytest.raises(ConfigError) as info:
        load_config_prompts(make_config(tmp_path, variant="tiny_hunyuan_video15_i2v", prompt_fn=str(path)), "prompt_fn")
    assert "'a cat' has no field 'source_image'" in str(info.value) and "\n" not in str(info.value)
