"""The FLUX.2 families (ddpo_group.diffusion.flux2: [dev] and [klein]) on their offline tiny pipelines.

Checked against values computed here: the text conditioning is the encoder's three stacked hidden layers, the grid
is FLUX.2's empirically shifted one written out, klein's CFG is two transformer calls combined, the decode undoes the
VAE's batch norm; the first epoch's ratio is 1, every objective trains, LoRA covers the single-stream blocks. Noise 0
(the pipeline's own images), exact re-scoring after cat / index, the LoRA round trip: tests/test_family_contract.py.
"""

import math
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ddpo_group.diffusion.flux2 import (
    Flux2KleinPolicy,
    Flux2Policy,
    build_tiny_flux2_klein_pipeline,
    build_tiny_flux2_pipeline,
)
from ddpo_group.diffusion.policy import family_for_model, load_policy, policy_for
from ddpo_group.trainer import Trainer, train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a red circle", "a big blue square on a white background"]
LENGTH = 64
BUILDERS = {"dev": build_tiny_flux2_pipeline, "klein": build_tiny_flux2_klein_pipeline}


@pytest.fixture(scope="module")
def pipelines():
    return {name: build(seed=0) for name, build in BUILDERS.items()}


def _policy(pipeline, **options):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=options.pop("max_sequence_length", LENGTH), **options)
    return policy


def test_the_families_are_found_by_name_and_by_pipeline(pipelines):
    assert family_for_model("tiny-flux2") is Flux2Policy and family_for_model("tiny-flux2-klein") is Flux2KleinPolicy
    for name, cls in (("dev", Flux2Policy), ("klein", Flux2KleinPolicy)):
        policy = policy_for(pipelines[name])
        assert type(policy) is cls and policy.resolution == 32 and policy.latent_channels == 16
        assert policy.critic_sizes() == {"latent_channels": 16, "prompt_dim": 48}
        with pytest.raises(ValueError, match="config.sample.max_sequence_length"):
            policy.configure(max_sequence_length=1024)
        with pytest.raises(ValueError, match="config.sample.resolution"):
            policy.configure(resolution=34)
    with pytest.raises(ValueError, match="config.sample.negative_prompt"):
        _policy(pipelines["dev"]).sample(PROMPTS, 2, 4.0, 0.0, negative_prompt="blurry")


def test_a_negative_prompt_for_flux2_dev_is_refused_in_one_line_naming_the_field(tmp_path):
    from ddpo_group.config.check import ConfigError

    with pytest.raises(ConfigError, match=r"^config\.sample\.negative_prompt='blurry': .*FLUX\.2 \[dev\]"):
        Trainer(make_config(tmp_path, variant="tiny_flux2", sample__negative_prompt="blurry"))


def test_the_tiny_builders_are_seeded_and_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = (build_tiny_flux2_klein_pipeline(seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), state)
    for name in ("transformer", "vae", "text_encoder"):
        sa, sb, sc = (getattr(p, name).state_dict() for p in (a, b, c))
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


@pytest.mark.parametrize("name, layers", [("dev", (10, 20, 30)), ("klein", (9, 18, 27))])
def test_the_text_conditioning_stacks_three_hidden_layers(pipelines, name, layers):
    pipeline = pipelines[name]
    cond = _policy(pipeline)._encode(PROMPTS, "", 4.0, "cpu")
    embeds = cond["prompt_embeds"]
    assert embeds.shape == (2, LENGTH, 48)
    tokenizer = pipeline.tokenizer
    for i, prompt in enumerate(PROMPTS):
        if name == "dev":
            messages = [[{"role": "system", "content": [{"type": "text", "text": pipeline.system_message}]},
                         {"role": "user", "content": [{"type": "text", "text": prompt}]}]]
            text = tokenizer.apply_chat_template(messages, tokenize=False)[0]
        else:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=False)
        ids = tokenizer(text, return_tensors="pt").input_ids
        assert ids.shape[1] < LENGTH and prompt.split()[-1] in tokenizer.decode(ids[0])  # the prompt is not cut off
        with torch.no_grad():
            hidden = pipeline.text_encoder(input_ids=ids, output_hidden_states=True).hidden_states
        expected = torch.cat([hidden[k][0] for k in layers], dim=-1)  # (l, 3 D): layer-major channels per token
        torch.testing.assert_close(embeds[i, : ids.shape[1]], expected, rtol=0, atol=1e-5)
    if name == "klein":
        assert cond["negative_prompt_embeds"].shape == (2, LENGTH, 48)
        assert "negative_prompt_embeds" not in _policy(pipeline)._encode(PROMPTS, "", 1.0, "cpu")


def test_the_grid_is_flux2s_empirical_shift(pipelines):
    policy = _policy(pipelines["dev"])
    batch = policy.sample(PROMPTS, 4, 4.0, 0.7, generator=torch.Generator().manual_seed(0))
    tokens, steps = 8 * 8, 4  # 32 px / VAE factor 2 / patch 2
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    m200, m10 = a2 * tokens + b2, a1 * tokens + b1
    mu = (m200 - m10) / 190 * steps + m200 - 200 * (m200 - m10) / 190
    t = np.linspace(1.0, 1 / steps, steps)
    sigmas = np.append(math.exp(mu) / (math.exp(mu) + (1 / t - 1)), 0.0)  # exponential time shift
    expected = torch.tensor(sigmas, dtype=torch.float32)
    torch.testing.assert_close(batch.sigmas, expected.expand(2, 5), rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.timesteps, expected[:4].expand(2, 4) * 1000, rtol=0, atol=1e-3)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_klein_velocity_is_the_transformers_with_true_cfg(pipelines, guidance):
    pipeline = pipelines["klein"]
    policy = _policy(pipeline)
    batch = policy.sample(PROMPTS, 2, guidance, 0.7, generator=torch.Generator().manual_seed(1), keep_steps=False)
    x = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([900.0, 300.0])
    tokens = x.flatten(2).transpose(1, 2)  # token (i, j) = the 16 channels at (i, j), row-major
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(8.0), torch.zeros(1),
                                         indexing="ij"), dim=-1).reshape(1, 64, 4).expand(2, -1, -1)
    txt_ids = torch.stack([torch.zeros(LENGTH)] * 3 + [torch.arange(LENGTH * 1.0)], dim=-1).expand(2, -1, -1)

    def call(embeds):
        return pipeline.transformer(hidden_states=tokens, timestep=t / 1000, guidance=None, encoder_hidden_states=embeds,
                                    txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]

    with torch.no_grad():
        v = call(batch.prompt_embeds)
        if guidance > 1:
            neg = call(batch.negative_prompt_embeds)
            v = neg + guidance * (v - neg)
        ours = policy.predict(pipeline.transformer, x, t, batch, torch.arange(2), guidance)
    torch.testing.assert_close(ours, v.transpose(1, 2).reshape(2, 16, 8, 8), rtol=1e-5, atol=1e-6)


def test_decoding_undoes_the_batch_norm_and_the_patches(pipelines):
    pipeline = pipelines["dev"]
    z = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(4))
    mean = torch.linspace(-0.3, 0.3, 16).view(1, 16, 1, 1)
    std = (torch.linspace(0.5, 2.0, 16) + pipeline.vae.config.batch_norm_eps).sqrt().view(1, 16, 1, 1)
    x = z * std + mean  # channel 4 c + 2 di + dj of patch (i, j) -> channel c at (2 i + di, 2 j + dj)
    unpatched = x.reshape(2, 4, 2, 2, 8, 8).permute(0, 1, 4, 2, 5, 3).reshape(2, 4, 16, 16)
    with torch.no_grad():
        expected = (pipeline.vae.decode(unpatched).sample / 2 + 0.5).clamp(0, 1)
        images = _policy(pipeline)._decode(z)
    torch.testing.assert_close(images, expected, rtol=0, atol=1e-5)


def test_a_distilled_klein_ignores_guidance_as_its_pipeline_does():
    pipeline = build_tiny_flux2_klein_pipeline(seed=0, is_distilled=True)
    policy = _policy(pipeline)
    plain, guided = (policy.sample(PROMPTS, 2, g, 0.0, generator=torch.Generator().manual_seed(3)) for g in (1.0, 4.0))
    assert torch.equal(plain.images, guided.images) and guided.negative_prompt_embeds is None


def test_a_saved_pipeline_loads_from_its_directory(pipelines, tmp_path):
    pipelines["klein"].save_pretrained(str(tmp_path / "klein"))
    assert family_for_model(str(tmp_path / "klein")) is Flux2KleinPolicy
    loaded = load_policy(str(tmp_path / "klein"), torch_dtype=torch.float32)
    loaded.configure(max_sequence_length=LENGTH, resolution=32)  # default_sample_size is not saved
    a, b = (p.sample(PROMPTS, 2, 4.0, 0.0, generator=torch.Generator().manual_seed(7)).images
            for p in (_policy(pipelines["klein"]), loaded))
    assert torch.equal(a, b)


@pytest.mark.parametrize("variant", ["tiny_flux2", "tiny_flux2_klein"])
def test_two_epochs_train_and_the_first_ratio_is_one(tmp_path, variant):
    run_dir = train(make_config(tmp_path, variant=variant, sample__num_steps=2, sample__batch_size=2,
                                sample__num_batches_per_epoch=2, train__gradient_accumulation_steps=2))
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [0, 1]
    assert rows[-1]["train/global_step"] == 2 and rows[-1]["train/skipped_steps"] == 0
    assert rows[0]["approx_kl"] == 0.0  # one optimizer step per epoch: the ratio is exactly 1 in the first epoch
    assert math.isfinite(rows[-1]["loss"])


@pytest.mark.parametrize("overrides", [
    dict(algorithm__adv_estimator="gae"),
    dict(train__objective="nft", train__use_reference_model=False, forward__num_timesteps=2),
    dict(train__objective="awm", train__clip_range=0.2, forward__num_timesteps=2),
    dict(train__objective="dgpo", train__use_reference_model=True, forward__num_timesteps=2),
    dict(train__objective="dpo", train__use_reference_model=True, forward__num_timesteps=2),
], ids=["gae", "nft", "awm", "dgpo", "dpo"])
def test_every_objective_trains_tiny_flux2_klein(tmp_path, overrides):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_flux2_klein", **cheap(**overrides))))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])


def test_flux2_lora_covers_the_single_stream_blocks_fused_projection(tmp_path):
    policy = _policy(build_tiny_flux2_pipeline(seed=0))
    module = policy.prepare("cpu", torch.float32, use_lora=True, lora_rank=2)
    policy.save_trainable(module, str(tmp_path), use_lora=True)
    state = load_file(os.path.join(tmp_path, "lora", "pytorch_lora_weights.safetensors"))
    assert any(".single_transformer_blocks." in k for k in state)  # the single-stream blocks' fused projection too
