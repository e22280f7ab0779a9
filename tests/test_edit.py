"""Image editing (ddpo_group/data/edit_sources.py, FluxKontextPolicy in ddpo_group.diffusion.flux) on tiny pipelines.

Checked against values computed here: the source condition is the VAE encoder's mode of 2 x - 1, shifted and scaled;
the velocity is the transformer called by hand on [target tokens ; source tokens] with the source's position ids in
frame 1, cut to the target's tokens; Qwen-Image-Edit's text encoder reads the source; the first epoch is exactly
on-policy; rewards receive the source image; the grid shows source -> edited; bad sources are one line naming the
field. (Noise 0 giving FluxKontextPipeline's / QwenImageEditPipeline's images for the same generator and source, the
source changing the edit, exact re-scoring also after cat / index, the LoRA export and a resumed run:
tests/test_family_contract.py, as for every family.)
"""

import json
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.config.check import ConfigError, load_config_prompts
from ddpo_group.diffusion.flux import FluxKontextPolicy, build_tiny_flux_kontext_pipeline
from ddpo_group.diffusion.policy import family_for_model, load_policy, policy_for
from ddpo_group.data.edit_sources import read_source_image, source_images
from ddpo_group.data.prompts import load_prompts
from ddpo_group.data.shapes import parse_prompt, render
from ddpo_group.training.trainer import train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a big blue circle on a white background", "a big green triangle on a black background"]
SEEN = []  # what edit_reward received, for the contract test


def edit_reward(images, prompts, metadata):
    """An edit reward: closeness to the source image (mean |edit - source|, negated); records what it was given."""
    sources = torch.stack([m["source_image"] for m in metadata])
    SEEN.append((images.clone(), sources.clone(), [m["source_image_path"] for m in metadata]))
    return -(images - sources).abs().mean(dim=(1, 2, 3)), {}


@pytest.fixture(scope="module")
def kontext():
    return build_tiny_flux_kontext_pipeline(seed=0)


def _policy(pipeline):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=16, resolution=32)
    return policy


def _sources(seed=9, n=2):
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_the_shipped_sources_are_the_shapes_world_renders_their_records_name():
    records = load_prompts("shapes_edits.jsonl")
    assert len(records) == 4
    for record in records:
        path = record.metadata["source_image"]
        assert os.path.isabs(path) and os.path.isfile(path)  # made absolute, relative to the prompt file
        expected = render(parse_prompt(record.metadata["source_prompt"]), 32)
        assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), expected)
        assert torch.equal(read_source_image(path), torch.from_numpy(expected).permute(2, 0, 1).float() / 255)


def test_the_family_is_found_by_name_and_by_pipeline(kontext):
    assert family_for_model("tiny-flux-kontext") is FluxKontextPolicy
    policy = policy_for(kontext)
    assert isinstance(policy, FluxKontextPolicy) and policy.family == "flux_kontext"
    assert policy.conditions_on_images and not type(policy).__mro__[1].conditions_on_images
    with pytest.raises(ValueError, match="every prompt needs a source image .*'source_image'"):
        policy.sample(PROMPTS, 2, 2.5, 0.7)
    with pytest.raises(ValueError, match=r"source_images must be .*\(2, 3, 32, 32\).*'source_image'"):
        policy.sample(PROMPTS, 2, 2.5, 0.7, source_images=torch.rand(2, 3, 16, 16))


def test_the_condition_is_the_sources_vae_latents_and_the_velocity_the_transformers(kontext):
    policy = _policy(kontext)
    sources = _sources()
    batch = policy.sample(PROMPTS, 2, 2.5, 0.7, generator=torch.Generator().manual_seed(0), source_images=sources,
                          keep_steps=False)
    vae = kontext.vae
    with torch.no_grad():
        mode = vae.encode(sources * 2 - 1).latent_dist.mean  # a diagonal Gaussian's mode is its mean
    expected = (mode - vae.config.shift_factor) * vae.config.scaling_factor
    torch.testing.assert_close(batch.extra_cond["image_latents"], expected, rtol=0, atol=1e-6)

    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([900.0, 300.0])

    def pack(z):  # token (i, j) holds channels c of pixels (2i + di, 2j + dj), c-major
        return z.reshape(2, 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 16, 16)

    ids = torch.tensor([[0.0, i, j] for i in range(4) for j in range(4)])
    source_ids = ids.clone()
    source_ids[:, 0] = 1
    with torch.no_grad():
        out = kontext.transformer(
            hidden_states=torch.cat([pack(x), pack(expected)], dim=1), timestep=t / 1000,
            guidance=torch.full([2], 2.5), pooled_projections=batch.pooled_prompt_embeds,
            encoder_hidden_states=batch.prompt_embeds, txt_ids=torch.zeros(batch.prompt_embeds.shape[1], 3),
            img_ids=torch.cat([ids, source_ids]), return_dict=False,
        )[0][:, :16]
        ours = policy.predict(kontext.transformer, x, t, batch, torch.arange(2), 2.5)
    unpacked = out.reshape(2, 4, 4, 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(2, 4, 8, 8)
    torch.testing.assert_close(ours, unpacked, rtol=1e-5, atol=1e-6)


def test_a_saved_kontext_pipeline_loads_from_its_directory(kontext, tmp_path):
    kontext.save_pretrained(str(tmp_path / "kontext"))
    assert family_for_model(str(tmp_path / "kontext")) is FluxKontextPolicy
    loaded = load_policy(str(tmp_path / "kontext"), torch_dtype=torch.float32)
    loaded.configure(max_sequence_length=16, resolution=32)
    a, b = (p.sample(PROMPTS, 3, 2.5, 0.0, generator=torch.Generator().manual_seed(7), source_images=_sources()).images
            for p in (_policy(kontext), loaded))
    assert torch.equal(a, b)


def test_two_epochs_train_the_first_exactly_on_policy_rewards_see_the_sources_and_the_grid_shows_them(tmp_path):
    SEEN.clear()
    run_dir = train(make_config(tmp_path, variant="tiny_flux_kontext", reward_fn="test_edit:edit_reward",
                                sample__batch_size=2, sample__num_batches_per_epoch=2,
                                train__gradient_accumulation_steps=2))
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [0, 1]
    assert rows[0]["approx_kl"] == 0.0 and rows[0]["train/on_policy_max_abs_log_ratio"] == 0.0
    assert rows[-1]["train/skipped_steps"] == 0 and math.isfinite(rows[-1]["loss"])
    # the reward got each sample's own source: the file its prompt record names, as a (3, 32, 32) float image
    by_prompt = {r.prompt: r.metadata["source_image"] for r in load_prompts("shapes_edits.jsonl")}
    images, sources, paths = SEEN[0]
    assert sources.shape == images.shape == (2, 3, 32, 32) and sources.dtype == torch.float32
    for source, path in zip(sources, paths):
        assert path in by_prompt.values() and torch.equal(source, read_source_image(path))
    assert rows[0]["reward_mean"] < 0  # -mean |edit - source|
    # the grid: each row's source first, then its edits; each record names its source's PNG
    document = json.loads(open(os.path.join(run_dir, "samples", "epoch_0000.json")).read())
    record = document["records"][0]
    source_png = np.asarray(Image.open(os.path.join(run_dir, "samples", record["source_image"])))
    expected = np.asarray(Image.open(by_prompt[record["prompt"]]).convert("RGB"))
    assert np.array_equal(source_png, expected)
    grid = Image.open(os.path.join(run_dir, "samples", "epoch_0000.png"))
    plain = Image.open(os.path.join(train(make_config(tmp_path, variant="tiny_flux", run_name="t2i", num_epochs=1)),
                                    "samples", "epoch_0000.png"))
    assert grid.width > plain.width  # one more column: the source (group size 2 in both)


@pytest.mark.parametrize("overrides", [dict(train__objective="nft", forward__num_timesteps=2),
                                       dict(algorithm__adv_estimator="gae")])
def test_other_algorithms_train_an_edit_model(tmp_path, overrides):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_flux_kontext", **cheap(**overrides))))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])


def _write_prompts(tmp_path, records):
    path = tmp_path / "edits.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def _png(path, size):
    Image.fromarray(np.zeros((size, size, 3), dtype=np.uint8)).save(path)


def test_bad_edit_prompts_are_one_line_naming_the_field(tmp_path):
    _png(tmp_path / "ok.png", 32)
    _png(tmp_path / "big.png", 48)
    (tmp_path / "broken.png").write_bytes(b"not a png")

    def check(records, variant="tiny_flux_kontext"):
        config = make_config(tmp_path, variant=variant, prompt_fn=_write_prompts(tmp_path, records))
        with pytest.raises(ConfigError) as info:
            load_config_prompts(config, "prompt_fn")
        message = str(info.value)
        assert "\n" not in message
        return message

    message = check([{"prompt": "a cat", "source_image": "ok.png"}, {"prompt": "a dog"}])
    assert "'a dog' has no field 'source_image'" in message and "tiny-flux-kontext" in message
    assert "cannot be read as an image" in check([{"prompt": "a cat", "source_image": "broken.png"}])
    assert "field 'source_image'" in check([{"prompt": "a cat", "source_image": "missing.png"}])
    assert "missing.png' cannot be read as an image" in check([{"prompt": "a cat", "source_image": "missing.png"}])
    message = check([{"prompt": "a cat", "source_image": "big.png"}])
    assert "is 48x48 pixels; config.sample.resolution is 32" in message
    assert "field 'source_image' must be a path" in check([{"prompt": "a cat", "source_image": 3}])
    message = check([{"prompt": "a cat", "source_image": "ok.png"}], variant="tiny_flux")
    assert "has a field 'source_image' but config.pretrained.model='tiny-flux' does not edit images" in message
    # a good file passes, with the path made absolute relative to the prompt file
    config = make_config(tmp_path, variant="tiny_flux_kontext",
                         prompt_fn=_write_prompts(tmp_path, [{"prompt": "a cat", "source_image": "ok.png"}]))
    (record,) = load_config_prompts(config, "prompt_fn")
    assert record.metadata["source_image"] == str(tmp_path / "ok.png")
    assert source_images([record], 32).shape == (1, 3, 32, 32)


def test_the_report_fragment_shows_source_edited_pairs(tmp_path):
    from ddpo_group.data.edit_sources import edit_pairs_html

    run_dir = train(make_config(tmp_path, variant="tiny_flux_kontext", num_epochs=1, sample__num_steps=2))
    fragment = edit_pairs_html(run_dir)
    document = json.loads(open(os.path.join(run_dir, "samples", "epoch_0000.json")).read())
    assert fragment.count("<tr>") == len(document["records"]) == 4
    assert fragment.count("data:image/png;base64,") == 8 and "source &rarr; edited" in fragment
    assert document["records"][0]["prompt"] in fragment
    from ddpo_group.report.page import build_report

    assert "source &rarr; edited" in build_report(run_dir)  # the HTML report holds the fragment
    plain = train(make_config(tmp_path, variant="tiny_flux", run_name="t2i", num_epochs=1, sample__num_steps=2))
    assert edit_pairs_html(plain) == ""


# ---- Qwen-Image-Edit: the source conditions the text encoder (vision tokens) and the latents ----

from ddpo_group.diffusion.qwen_image import QwenImageEditPolicy, build_tiny_qwen_image_edit_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def qwen_edit():
    return build_tiny_qwen_image_edit_pipeline(seed=0)


def _qwen_policy(pipeline):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=32, resolution=32)
    return policy


def _pixels(seed):
    return (np.random.default_rng(seed).random((2, 32, 32, 3)) * 255).astype(np.uint8)


def _as_sources(pixels):
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255


def test_the_qwen_edit_family_and_its_tokenizer_match_the_pipelines_template(qwen_edit):
    assert family_for_model("tiny-qwen-image-edit") is QwenImageEditPolicy
    policy = policy_for(qwen_edit)
    assert isinstance(policy, QwenImageEditPolicy) and policy.family == "qwen_image_edit" and policy.conditions_on_images
    tokenizer = qwen_edit.tokenizer
    prefix = qwen_edit.prompt_template_encode.split("<|vision_start|>")[0]
    # Qwen2.5-VL's tokenizer: the edit template's system turn and "<|im_start|>user\n" are the 64 dropped tokens
    assert len(tokenizer(prefix).input_ids) == qwen_edit.prompt_template_encode_start_idx == 64
    with pytest.raises(ValueError, match="every prompt needs a source image"):
        policy.sample(PROMPTS, 2, 4.0, 0.7)


def test_the_qwen_edit_condition_reads_the_source_in_the_text_and_the_latents(qwen_edit):
    policy = _qwen_policy(qwen_edit)
    pixels = _pixels(0)
    batch = policy.sample(PROMPTS, 2, 4.0, 0.7, generator=torch.Generator().manual_seed(0),
                          source_images=_as_sources(pixels), keep_steps=False)
    # the vision tower's 4 merged tokens (56 px: 4 x 4 patches of 14, merged 2 x 2) and the text's, after the 64
    text = [len(qwen_edit.tokenizer(f"{p}<|im_end|>\n<|im_start|>assistant\n").input_ids) for p in PROMPTS]
    assert batch.extra_cond["prompt_embeds_mask"].sum(1).tolist() == [2 + 4 + n for n in text]  # + vision start / end
    vae = qwen_edit.vae
    with torch.no_grad():
        mode = vae.encode((_as_sources(pixels) * 2 - 1).unsqueeze(2)).latent_dist.mean[:, :, 0]
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1)
    std = torch.tensor([1.5, 0.8, 1.2, 2.0]).view(1, 4, 1, 1)
    torch.testing.assert_close(batch.extra_cond["image_latents"], (mode - mean) / std, rtol=0, atol=1e-6)
    other = policy.sample(PROMPTS, 2, 4.0, 0.7, generator=torch.Generator().manual_seed(0),
                          source_images=_as_sources(_pixels(1)), keep_steps=False)
    assert (other.prompt_embeds - batch.prompt_embeds).abs().max() > 1e-4  # the text encoder sees the image

