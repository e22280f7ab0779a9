"""The Qwen-Image family (ddpo_group.diffusion.qwen_image) on its offline tiny pipeline.

Checked against values computed here: the tokenizer's template prefix is the pipeline's 34 dropped tokens,
the text conditioning is the text encoder's own hidden states padded to a fixed length, the sigma grid is
Qwen-Image's shifted one written out in numpy, true CFG is the pipeline's norm-rescaled combination of two
transformer calls, the decode de-normalises with the VAE's mean / std; every objective trains. (Noise 0 giving
the pipeline's images, exact re-scoring also after cat / index and the LoRA export: tests/test_family_contract.py,
as for every family.)
"""

import math

import numpy as np
import pytest
import torch

from ddpo_group.diffusion.policy import family_for_model, load_policy, policy_for
from ddpo_group.diffusion.qwen_image import QwenImagePolicy, build_tiny_qwen_image_pipeline
from ddpo_group.diffusion.tiny import TOKENIZER_WORDS
from ddpo_group.training.trainer import train
from helpers import make_config, read_metrics

PROMPTS = ["a red circle", "a big blue square on a white background"]
LENGTH = 32


@pytest.fixture(scope="module")
def pipeline():
    return build_tiny_qwen_image_pipeline(seed=0)


def _policy(pipeline, **options):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=options.pop("max_sequence_length", LENGTH), **options)
    return policy


def test_the_family_is_found_by_name_and_by_pipeline(pipeline):
    assert family_for_model("tiny-qwen-image") is QwenImagePolicy
    policy = policy_for(pipeline)
    assert isinstance(policy, QwenImagePolicy) and policy.family == "qwen_image"
    assert policy.resolution == 32 and policy.latent_channels == 4
    assert policy.critic_sizes() == {"latent_channels": 4, "prompt_dim": 32}
    with pytest.raises(ValueError, match="max_sequence_length"):
        policy.configure(max_sequence_length=2048)


def test_the_tiny_builder_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = (build_tiny_qwen_image_pipeline(seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), state)
    for name in ("transformer", "vae", "text_encoder"):
        sa, sb, sc = (getattr(p, name).state_dict() for p in (a, b, c))
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_the_tokenizer_splits_the_template_as_qwen_does(pipeline):
    tokenizer = pipeline.tokenizer
    prefix = pipeline.prompt_template_encode.split("{}")[0]
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(prefix).input_ids)
    # Qwen2.5-VL's tokenizer: <|im_start|> system \n Describe, 13 space-led words and 6 commas, ':' ...
    assert len(tokens) == pipeline.prompt_template_encode_start_idx == 34
    assert tokens[:4] == ["<|im_start|>", "system", "Ċ", "Describe"] and tokens[-3:] == ["<|im_start|>", "user", "Ċ"]
    for word in TOKENIZER_WORDS:  # every shapes-world word after a space is one token
        assert len(tokenizer(" " + word).input_ids) == 1, word


def test_the_text_conditioning_is_the_encoders_hidden_states_padded_to_a_fixed_length(pipeline):
    policy = _policy(pipeline)
    cond = policy._encode(PROMPTS, "", 4.5, "cpu")
    tokenizer, encoder = pipeline.tokenizer, pipeline.text_encoder
    template, drop = pipeline.prompt_template_encode, 34
    for key, texts in (("prompt_embeds", PROMPTS), ("negative_prompt_embeds", [" ", " "])):
        embeds, mask = cond[key], cond[f"{key}_mask"]
        assert embeds.shape == (2, LENGTH, 32) and mask.shape == (2, LENGTH) and mask.dtype == torch.int64
        for i, text in enumerate(texts):
            ids = tokenizer(template.format(text), return_tensors="pt").input_ids  # one prompt: no padding
            with torch.no_grad():
                hidden = encoder(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, drop:]
            n = hidden.shape[0]
            assert mask[i].tolist() == [1] * n + [0] * (LENGTH - n)
            torch.testing.assert_close(embeds[i, :n], hidden, rtol=0, atol=1e-5)
            assert embeds[i, n:].eq(0).all()
    assert "negative_prompt_embeds" not in policy._encode(PROMPTS, "", 1.0, "cpu")  # no guidance: no negative
    # fewer words, fewer valid tokens: the masks of test_family_contract's cat / index batches differ
    shorter = policy._encode(["a cat", "a dog"], "", 1.0, "cpu")["prompt_embeds_mask"]
    assert shorter.sum() < cond["prompt_embeds_mask"].sum()
    short = _policy(pipeline, max_sequence_length=4)._encode(PROMPTS, "", 1.0, "cpu")  # truncated: every token valid
    assert short["prompt_embeds"].shape == (2, 4, 32) and short["prompt_embeds_mask"].eq(1).all()


def _qwen_sigmas(num_steps, image_seq_len):
    """Qwen-Image's grid written out: linspace(1, 1/T, T), exponential shift by mu (linear in the image
    tokens between (256, 0.5) and (8192, 0.9)), stretched so that the last sigma is 0.02, then 0."""
    mu = 0.5 + (0.9 - 0.5) * (image_seq_len - 256) / (8192 - 256)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
    one_minus = 1 - shifted
    stretched = 1 - one_minus / (one_minus[-1] / (1 - 0.02))
    return np.append(stretched, 0.0)


def test_the_grid_is_qwen_images_shifted_grid(pipeline):
    policy = _policy(pipeline)
    batch = policy.sample(PROMPTS, 4, 1.0, 0.7, generator=torch.Generator().manual_seed(0))
    expected = torch.tensor(_qwen_sigmas(4, (32 // 4 // 2) ** 2), dtype=torch.float32)
    torch.testing.assert_close(batch.sigmas, expected.expand(2, 5), rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.timesteps, expected[:4].expand(2, 4) * 1000, rtol=0, atol=1e-3)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_the_velocity_is_the_transformers_with_the_pipelines_true_cfg(pipeline, guidance):
    policy = _policy(pipeline)
    batch = policy.sample(PROMPTS, 4, guidance, 0.7, generator=torch.Generator().manual_seed(1), keep_steps=False)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([900.0, 300.0])
    # the 2x2 packing written out: token (i, j) holds channels c of pixels (2i + di, 2j + dj), c-major
    packed = x.reshape(2, 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 16, 16)

    def call(embeds, mask):
        return pipeline.transformer(hidden_states=packed, timestep=t / 1000, encoder_hidden_states=embeds,
                                    encoder_hidden_states_mask=mask, img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0]

    with torch.no_grad():
        v = call(batch.prompt_embeds, batch.extra_cond["prompt_embeds_mask"])
        if guidance > 1:
            assert sorted(batch.extra_cond) == ["negative_prompt_embeds_mask", "prompt_embeds_mask"]
            neg = call(batch.negative_prompt_embeds, batch.extra_cond["negative_prompt_embeds_mask"])
            comb = neg + guidance * (v - neg)
            v = comb * v.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True)
        ours = policy.predict(pipeline.transformer, x, t, batch, torch.arange(2), guidance)
    unpacked = v.reshape(2, 4, 4, 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(2, 4, 8, 8)
    torch.testing.assert_close(ours, unpacked, rtol=1e-5, atol=1e-6)


def test_decoding_denormalises_with_the_vaes_mean_and_std(pipeline):
    policy = _policy(pipeline)
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1)
    std = torch.tensor([1.5, 0.8, 1.2, 2.0]).view(1, 4, 1, 1)
    with torch.no_grad():
        decoded = pipeline.vae.decode((z * std + mean).unsqueeze(2)).sample[:, :, 0]
        images = policy._decode(z)
    torch.testing.assert_close(images, (decoded / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-5)


def test_true_cfg_changes_the_images(pipeline):
    policy = _policy(pipeline)
    plain, guided = (policy.sample(PROMPTS, 4, g, 0.0, generator=torch.Generator().manual_seed(3)) for g in (1.0, 4.0))
    assert (plain.latents[:, -1] - guided.latents[:, -1]).abs().max() > 1e-2


def test_a_saved_pipeline_loads_from_its_directory(pipeline, tmp_path):
    pipeline.save_pretrained(str(tmp_path / "qwen"))
    assert family_for_model(str(tmp_path / "qwen")) is QwenImagePolicy
    loaded = load_policy(str(tmp_path / "qwen"), torch_dtype=torch.float32)
    loaded.configure(max_sequence_length=LENGTH, resolution=32)  # default_sample_size is not saved: 1024 px
    original = _policy(pipeline)
    a, b = (p.sample(PROMPTS, 3, 4.0, 0.0, generator=torch.Generator().manual_seed(7)).images for p in (original, loaded))
    assert torch.equal(a, b)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_two_epochs_of_tiny_qwen_image_train(tmp_path, estimator):
    # two sampling batches of 2 per epoch: the trainer concatenates them (fixed-length text, masks in extra_cond)
    run_dir = train(make_config(tmp_path, variant="tiny_qwen_image", algorithm__adv_estimator=estimator,
                                sample__batch_size=2, sample__num_batches_per_epoch=2,
                                train__gradient_accumulation_steps=2))
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [0, 1]
    assert rows[-1]["train/global_step"] == 2 and rows[-1]["train/skipped_steps"] == 0
    assert rows[0]["approx_kl"] == 0.0  # one optimizer step per epoch: the ratio is exactly 1 in the first epoch
    assert math.isfinite(rows[-1]["loss"]) and len({row["reward_mean"] for row in rows}) == 2


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_a_forward_objective_trains_tiny_qwen_image(tmp_path, objective):
    overrides = dict(num_epochs=1, log_images_every=0, train__objective=objective, train__use_reference_model=False,
                     train__use_kl_loss=False, train__beta=0.0, forward__num_timesteps=2, train__learning_rate=1e-3)
    if objective == "awm":
        overrides["train__clip_range"] = 0.2
    row = read_metrics(train(make_config(tmp_path, variant="tiny_qwen_image", **overrides)))[0]
    assert row["train/global_step"] == 2 and row["train/skipped_steps"] == 0
    assert row["forward/first_window_max_abs_deviation"] == 0.0 and math.isfinite(row["loss"])


@pytest.mark.parametrize("objective", ["dgpo", "dpo"])
def test_a_preference_objective_trains_tiny_qwen_image(tmp_path, objective):
    overrides = dict(num_epochs=1, log_images_every=0, train__objective=objective, train__use_reference_model=True,
                     train__use_kl_loss=False, train__beta=0.0, forward__num_timesteps=2, train__learning_rate=1e-3)
    row = read_metrics(train(make_config(tmp_path, variant="tiny_qwen_image", **overrides)))[0]
    assert row["train/global_step"] >= 1 and row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])
