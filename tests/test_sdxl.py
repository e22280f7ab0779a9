"""The SDXL family (ddpo_group.diffusion.sd: StableDiffusionXLPolicy) on its offline tiny pipeline.

Checked against values computed here from the pipeline's parts: the text conditioning is the two encoders'
penultimate hidden states side by side with the second one's projected pooled output, the empty negative prompt is
zeros (force_zeros_for_empty_prompt), the time ids are (H, W, 0, 0, H, W), the prediction is the UNet called by
hand with its added conditioning and CFG; the first epoch is exactly on-policy, every algorithm trains. (DDIM with
eta 0 and eta 1 giving diffusers' pipeline's images, exact re-scoring also after cat / index, the LoRA export and a
resumed run: tests/test_family_contract.py, as for every family.)
"""

import math

import pytest
import torch

from ddpo_group.diffusion.base import Trajectories
from ddpo_group.diffusion.policy import family_for_model, load_policy, policy_for
from ddpo_group.diffusion.sd import StableDiffusionXLPolicy
from ddpo_group.diffusion.tiny import build_tiny_sdxl_pipeline
from ddpo_group.training.trainer import train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a red circle", "a big blue square on a white background"]


@pytest.fixture(scope="module")
def pipeline():
    return build_tiny_sdxl_pipeline(seed=0)


def test_the_family_is_found_by_name_and_by_pipeline(pipeline):
    assert family_for_model("tiny-sdxl") is StableDiffusionXLPolicy
    assert family_for_model("random-sdxl") is StableDiffusionXLPolicy
    policy = policy_for(pipeline)
    assert isinstance(policy, StableDiffusionXLPolicy) and policy.family == "sdxl"
    assert policy.critic_sizes() == {"latent_channels": 4, "prompt_dim": 64}
    assert type(load_policy("tiny-sdxl").pipeline.scheduler).__name__ == "DDIMScheduler"
    with pytest.raises(ValueError, match="sample.resolution=36 must be a multiple of 8"):
        policy.configure(resolution=36)
    with pytest.raises(ValueError, match="sample.sde_type"):
        policy.configure(sde_type="sde")


def test_the_tiny_builder_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = (build_tiny_sdxl_pipeline(seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), state)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        sa, sb, sc = (getattr(p, name).state_dict() for p in (a, b, c))
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_the_conditioning_is_both_encoders_hidden_states_the_pooled_projection_and_the_time_ids(pipeline):
    policy = policy_for(pipeline)
    batch = policy.sample(PROMPTS, 2, 5.0, 1.0, generator=torch.Generator().manual_seed(0), keep_steps=False)
    ids = pipeline.tokenizer(PROMPTS, padding="max_length", max_length=16, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        first = pipeline.text_encoder(ids, output_hidden_states=True)
        second = pipeline.text_encoder_2(ids, output_hidden_states=True)
    expected = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
    assert batch.prompt_embeds.shape == (2, 16, 64)
    torch.testing.assert_close(batch.prompt_embeds, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.pooled_prompt_embeds, second.text_embeds, rtol=0, atol=1e-6)
    # an empty negative prompt is the zero embedding (SDXL base's force_zeros_for_empty_prompt)
    assert batch.negative_prompt_embeds.eq(0).all() and batch.negative_pooled_prompt_embeds.eq(0).all()
    # original size, crop top-left, target size at the sampled 32 px
    assert batch.extra_cond["add_time_ids"].tolist() == [[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * 2
    assert batch.extra_cond["add_time_ids"].dtype == torch.float32
    named = policy.sample(PROMPTS, 2, 5.0, 1.0, negative_prompt="a cat", keep_steps=False,
                          generator=torch.Generator().manual_seed(0))
    assert named.negative_prompt_embeds.abs().max() > 0  # a named negative prompt is encoded


@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_the_prediction_is_the_unet_with_its_added_conditioning(pipeline, guidance):
    policy = policy_for(pipeline)
    batch = policy.sample(PROMPTS, 2, guidance, 1.0, generator=torch.Generator().manual_seed(1), keep_steps=False)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([901, 301])
    time_ids = torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * 2)

    def eps(embeds, pooled):
        return pipeline.unet(x, t, encoder_hidden_states=embeds, added_cond_kwargs={"text_embeds": pooled,
                                                                                    "time_ids": time_ids}).sample

    with torch.no_grad():
        expected = eps(batch.prompt_embeds, batch.pooled_prompt_embeds)
        if guidance > 1:
            uncond = eps(torch.zeros_like(batch.prompt_embeds), torch.zeros_like(batch.pooled_prompt_embeds))
            expected = uncond + guidance * (expected - uncond)
        ours = policy.predict(pipeline.unet, x, t, batch, torch.arange(2), guidance)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # the time ids matter: other sizes give another prediction
    other = Trajectories.cat([batch])
    other.extra_cond["add_time_ids"] = time_ids * 2
    with torch.no_grad():
        assert (policy.predict(pipeline.unet, x, t, other, torch.arange(2), guidance) - ours).abs().max() > 1e-6


def test_a_saved_pipeline_loads_from_its_directory(pipeline, tmp_path):
    pipeline.save_pretrained(str(tmp_path / "sdxl"))
    assert family_for_model(str(tmp_path / "sdxl")) is StableDiffusionXLPolicy
    loaded = load_policy(str(tmp_path / "sdxl"), torch_dtype=torch.float32)
    a, b = (p.sample(PROMPTS, 3, 5.0, 1.0, generator=torch.Generator().manual_seed(7)).images
            for p in (policy_for(pipeline), loaded))
    assert torch.equal(a, b)


def test_fp16_keeps_a_force_upcast_vae_in_float32():
    policy = policy_for(build_tiny_sdxl_pipeline(seed=0))
    policy.prepare("cpu", torch.float16, use_lora=True, lora_rank=2)
    pipe = policy.pipeline
    assert pipe.vae.dtype == torch.float32  # SDXL's VAE overflows in fp16: the pipeline upcasts it too
    assert pipe.text_encoder.dtype == pipe.text_encoder_2.dtype == pipe.unet.dtype == torch.float16


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_two_epochs_of_tiny_sdxl_train_and_the_first_is_exactly_on_policy(tmp_path, estimator):
    run_dir = train(make_config(tmp_path, variant="tiny_sdxl", algorithm__adv_estimator=estimator,
                                sample__batch_size=2, sample__num_batches_per_epoch=2,
                                train__gradient_accumulation_steps=2))
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [0, 1]
    assert rows[-1]["train/global_step"] == 2 and rows[-1]["train/skipped_steps"] == 0
    assert rows[0]["approx_kl"] == 0.0 and rows[0]["clipfrac"] == 0.0  # one optimizer step per epoch
    assert rows[0]["train/on_policy_max_abs_log_ratio"] == 0.0
    assert math.isfinite(rows[-1]["loss"]) and len({row["reward_mean"] for row in rows}) == 2


@pytest.mark.parametrize("overrides", [
    dict(algorithm__adv_estimator="ddpo", per_prompt_stat_tracking__min_count=2),
    dict(algorithm__adv_estimator="group_ppo", train__timestep_selection="segment_start"),
    dict(train__objective="nft", forward__num_timesteps=2),
    dict(train__objective="awm", forward__num_timesteps=2, train__clip_range=0.2),
    dict(train__objective="dgpo", train__use_reference_model=True, forward__num_timesteps=2),
    dict(train__objective="dpo", train__use_reference_model=True, forward__num_timesteps=2),
])
def test_every_algorithm_trains_tiny_sdxl(tmp_path, overrides):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_sdxl", **cheap(**overrides))))[0]
    assert row["train/skipped_steps"] == 0 and row["train/global_step"] >= 1 and math.isfinite(row["loss"])


def test_the_random_sdxl_unet_is_sdxl_bases_size():
    from diffusers import UNet2DConditionModel

    from ddpo_group.diffusion.tiny import SDXL_UNET

    with torch.device("meta"):  # shapes only: no 2.6B weights drawn
        unet = UNet2DConditionModel(**SDXL_UNET)
    # stabilityai/stable-diffusion-xl-base-1.0's UNet: 2,567,463,684 parameters; its added embedding takes the six
    # time ids x 256 Fourier features and the 1280-wide pooled text embedding
    assert sum(p.numel() for p in unet.parameters()) == 2_567_463_684
    assert unet.add_embedding.linear_1.in_features == 6 * 256 + 1280


def test_gpu_check_runs_the_sdxl_code_path_on_the_cpu(tmp_path):
    import json
    import subprocess

    from helpers import PYTHON, ROOT, subprocess_env

    output = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [PYTHON, "benchmarks/gpu_check.py", "--device", "cpu", "--dtypes", "bf16", "--arch", "tiny-sdxl", "--variants",
         "grpo", "--steps", "2", "--sample-steps", "2", "--sample-batch", "4", "--batches", "1", "--train-batch", "2",
         "--repeats", "1", "--sample-repeats", "1", "--epochs", "2", "--optimizer-steps", "2", "--output", str(output)],
        cwd=ROOT, env=subprocess_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    entry = json.loads(output.read_text())["archs"]["tiny-sdxl"]["dtypes"]["bf16"]
    assert entry["sampling_mask_all_ones"] is True and entry["sample_steps"] == 2
    row = entry["variants"]["grpo"]
    assert row["approx_kl_by_epoch"] == [0.0, 0.0] and row["on_policy_max_abs_log_ratio"] == 0.0
