"""The Z-Image family (ddpo_group.diffusion.zimage: Z-Image and Z-Image-Turbo) on its offline tiny pipeline.

Checked against values computed here: the text conditioning is the encoder's last-but-one hidden state of the valid
tokens, padded with a mask, the grid is Z-Image's shifted linspace, the velocity is minus the transformer's output at
time 1 - sigma with the pipeline's CFG in one call; the first epoch's ratio is 1, every objective trains, the Turbo
preset's tiny twin runs. Noise 0 (the pipeline's own images, guidance w = its g + 1), exact re-scoring after cat /
index, the LoRA round trip: tests/test_family_contract.py.
"""

import math

import numpy as np
import pytest
import torch

from ddpo_group.config import grpo
from ddpo_group.diffusion.policy import family_for_model, load_policy, policy_for
from ddpo_group.diffusion.zimage import ZImagePolicy, build_tiny_zimage_pipeline
from ddpo_group.trainer import train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a red circle", "a big blue square on a white background"]
LENGTH = 32


@pytest.fixture(scope="module")
def pipeline():
    return build_tiny_zimage_pipeline(seed=0)


def _policy(pipeline, **options):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=options.pop("max_sequence_length", LENGTH), **options)
    return policy


def test_the_family_is_found_by_name_and_by_pipeline(pipeline):
    assert family_for_model("tiny-zimage") is ZImagePolicy
    policy = policy_for(pipeline)
    assert isinstance(policy, ZImagePolicy) and policy.family == "zimage"
    assert policy.resolution == 32 and policy.latent_channels == 4
    assert policy.critic_sizes() == {"latent_channels": 4, "prompt_dim": 16}
    with pytest.raises(ValueError, match="config.sample.max_sequence_length"):
        policy.configure(max_sequence_length=1024)
    with pytest.raises(ValueError, match="config.sample.resolution"):
        policy.configure(resolution=36)


def test_the_tiny_builder_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = (build_tiny_zimage_pipeline(seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), state)
    for name in ("transformer", "vae", "text_encoder"):
        sa, sb, sc = (getattr(p, name).state_dict() for p in (a, b, c))
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_the_text_conditioning_is_the_valid_tokens_of_the_last_but_one_layer(pipeline):
    cond = _policy(pipeline)._encode(PROMPTS, "", 4.5, "cpu")
    tokenizer = pipeline.tokenizer
    for key, texts in (("prompt_embeds", PROMPTS), ("negative_prompt_embeds", ["", ""])):
        embeds, mask = cond[key], cond[f"{key}_mask"]
        assert embeds.shape == (2, LENGTH, 16) and mask.dtype == torch.int64
        for i, text in enumerate(texts):
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=True)
            ids = tokenizer(chat, return_tensors="pt").input_ids
            with torch.no_grad():
                hidden = pipeline.text_encoder(input_ids=ids, output_hidden_states=True).hidden_states[-2][0]
            n = ids.shape[1]
            assert mask[i].tolist() == [1] * n + [0] * (LENGTH - n)
            torch.testing.assert_close(embeds[i, :n], hidden, rtol=0, atol=1e-5)
            assert embeds[i, n:].eq(0).all()
    assert "negative_prompt_embeds" not in _policy(pipeline)._encode(PROMPTS, "", 1.0, "cpu")  # w = 1: no CFG


def test_the_grid_is_z_images_shifted_linspace(pipeline):
    batch = _policy(pipeline).sample(PROMPTS, 4, 1.0, 0.7, generator=torch.Generator().manual_seed(0))
    t = np.linspace(1.0, 0.25, 4)
    expected = torch.tensor(np.append(3 * t / (1 + 2 * t), 0.0), dtype=torch.float32)  # shift 3, no dynamic shift
    torch.testing.assert_close(batch.sigmas, expected.expand(2, 5), rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.timesteps, expected[:4].expand(2, 4) * 1000, rtol=0, atol=1e-3)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_the_velocity_is_minus_the_transformers_output_with_the_pipelines_cfg(pipeline, guidance):
    policy = _policy(pipeline)
    batch = policy.sample(PROMPTS, 2, guidance, 0.7, generator=torch.Generator().manual_seed(1), keep_steps=False)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([900.0, 300.0])
    mask = batch.extra_cond["prompt_embeds_mask"].bool()

    def call(embeds, mask):  # one row at a time, the valid tokens only
        return torch.stack([pipeline.transformer([x[i].unsqueeze(1)], 1 - t[i : i + 1] / 1000, [embeds[i][mask[i]]],
                                                 return_dict=False)[0][0][:, 0] for i in range(2)])

    with torch.no_grad():
        out = call(batch.prompt_embeds, mask)
        if guidance > 1:
            neg = call(batch.negative_prompt_embeds, batch.extra_cond["negative_prompt_embeds_mask"].bool())
            out = out + (guidance - 1) * (out - neg)
        ours = policy.predict(pipeline.transformer, x, t, batch, torch.arange(2), guidance)
    torch.testing.assert_close(ours, -out, rtol=1e-4, atol=1e-5)


def test_a_saved_pipeline_loads_from_its_directory(pipeline, tmp_path):
    pipeline.save_pretrained(str(tmp_path / "zimage"))
    assert family_for_model(str(tmp_path / "zimage")) is ZImagePolicy
    loaded = load_policy(str(tmp_path / "zimage"), torch_dtype=torch.float32)
    assert loaded.resolution == 1024  # the pipeline's default: 1024 px
    loaded.configure(max_sequence_length=LENGTH, resolution=32)
    a, b = (p.sample(PROMPTS, 2, 4.5, 0.0, generator=torch.Generator().manual_seed(7)).images
            for p in (_policy(pipeline), loaded))
    assert torch.equal(a, b)


def test_the_turbo_presets_sample_eight_steps_without_cfg_in_a_window():
    for name in ("zimage_turbo", "tiny_zimage_turbo"):
        s = grpo.get_config(name).sample
        assert (s.num_steps, s.guidance_scale, s.sde_window_size, s.sde_window_start) == (8, 1.0, 3, 1)
    assert grpo.get_config("zimage").sample.guidance_scale == 5.0  # the pipeline's guidance 4


@pytest.mark.parametrize("variant", ["tiny_zimage", "tiny_zimage_turbo"])
def test_two_epochs_train_and_the_first_ratio_is_one(tmp_path, variant):
    steps = dict(sample__num_steps=2) if variant == "tiny_zimage" else {}
    run_dir = train(make_config(tmp_path, variant=variant, sample__batch_size=2, sample__num_batches_per_epoch=2,
                                train__gradient_accumulation_steps=2, **steps))
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [0, 1]
    assert rows[-1]["train/global_step"] == 2 and rows[-1]["train/skipped_steps"] == 0
    assert rows[0]["approx_kl"] == 0.0  # one optimizer step per epoch: the ratio is exactly 1 in the first epoch
    assert math.isfinite(rows[-1]["loss"])


@pytest.mark.parametrize("overrides", [
    dict(algorithm__adv_estimator="gae"),
    dict(train__objective="nft", forward__num_timesteps=2),
    dict(train__objective="awm", train__clip_range=0.2, forward__num_timesteps=2),
    dict(train__objective="dgpo", train__use_reference_model=True, forward__num_timesteps=2),
    dict(train__objective="dpo", train__use_reference_model=True, forward__num_timesteps=2),
], ids=["gae", "nft", "awm", "dgpo", "dpo"])
def test_every_objective_trains_tiny_zimage(tmp_path, overrides):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_zimage", **cheap(**overrides))))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])
