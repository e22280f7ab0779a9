"""The Wan family (ddpo_group.diffusion.wan) on its offline tiny pipeline, and the base layer's time axis.

Checked against values computed here: the text conditioning is the UMT5 encoder's own hidden states zero-padded to
a fixed length, the initial noise is the generator's draw of shape (B, C, f, h, w), the sigma grid is the shifted
Euler grid written out in numpy, CFG is two transformer calls combined, the decode de-normalises with the VAE's mean
/ std and puts the frame axis second; two epochs train with approx_kl exactly 0 at the first; Wan 2.2 TI2V's per-token
timesteps reproduce its pipeline. (Noise 0 giving WanPipeline's videos, exact re-scoring also after cat / index, the
LoRA export and a resumed run: tests/test_family_contract.py, as for every family.) On videos
an image reward is the mean of its rewards on evenly spaced frames (the frames and means computed here), a video
reward gets the clips, grids are animated WebP holding every frame.
"""

import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.diffusion.policy import family_for_model, load_policy, policy_for
from ddpo_group.diffusion.wan import WanPolicy, build_tiny_wan_pipeline
from ddpo_group.evaluation.evaluator import evaluate
from ddpo_group.runs.grids import save_epoch_samples, video_samples_html
from ddpo_group.data.prompts import PromptRecord
from ddpo_group.rewards import CombinedReward, register_reward
from ddpo_group.rewards.base import frame_indices
from ddpo_group.training.trainer import Trainer, train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a red circle", "a big blue square on a white background"]
LENGTH = 16


@pytest.fixture(scope="module")
def pipeline():
    return build_tiny_wan_pipeline(seed=0)


def _policy(pipeline, **options):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=options.pop("max_sequence_length", LENGTH), **options)
    return policy


def test_the_family_is_found_by_name_and_by_pipeline_and_checks_its_frames(pipeline):
    assert family_for_model("tiny-wan") is WanPolicy and family_for_model("random-wan21-1.3b") is WanPolicy
    policy = policy_for(pipeline)
    assert isinstance(policy, WanPolicy) and policy.family == "wan" and policy.video
    assert (policy.height, policy.width, policy.num_frames, policy.latent_channels) == (32, 32, 5, 4)
    with pytest.raises(ValueError, match=r"sample.num_frames=4: .* 1 \+ 2 k frames"):
        policy.configure_frames(4)
    policy.configure_frames(7)
    assert policy.num_frames == 7
    with pytest.raises(ValueError, match="sample.resolution=36"):
        policy.configure(resolution=36)
    # the critic reads the latent frames stacked on the 4 channels: 7 frames -> (7 - 1) / 2 + 1 = 4 latent frames
    assert policy.critic_sizes() == {"latent_channels": 16, "prompt_dim": 32}
    parts = {name: getattr(pipeline, name) for name in ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")}
    with pytest.raises(ValueError, match="boundary_ratio=0.875"):  # Wan 2.2 A14B's two experts
        policy_for(type(pipeline)(**parts, boundary_ratio=0.875)).configure()
    image_policy = load_policy("tiny-sd3")
    with pytest.raises(ValueError, match=r"sample.num_frames=5: the sd3 family makes images"):
        image_policy.configure_frames(5)
    image_policy.configure_frames(0)


def test_the_tiny_builder_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = (build_tiny_wan_pipeline(seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), state)
    for name in ("transformer", "vae", "text_encoder"):
        sa, sb, sc = (getattr(p, name).state_dict() for p in (a, b, c))
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_the_text_conditioning_is_the_encoders_hidden_states_zero_padded(pipeline):
    policy = _policy(pipeline)
    cond = policy._encode(PROMPTS, "", 4.5, "cpu")
    tokenizer, encoder = pipeline.tokenizer, pipeline.text_encoder
    for key, texts in (("prompt_embeds", PROMPTS), ("negative_prompt_embeds", ["", ""])):
        embeds = cond[key]
        assert embeds.shape == (2, LENGTH, 32)
        for i, text in enumerate(texts):
            ids = tokenizer(text, return_tensors="pt").input_ids  # the words and </s>, no padding
            with torch.no_grad():
                hidden = encoder(input_ids=ids).last_hidden_state[0]
            n = hidden.shape[0]
            assert n == len(text.split()) + 1
            torch.testing.assert_close(embeds[i, :n], hidden, rtol=0, atol=1e-5)
            assert embeds[i, n:].eq(0).all()
    assert "negative_prompt_embeds" not in policy._encode(PROMPTS, "", 1.0, "cpu")  # no guidance: no negative


def _wan_sigmas(num_steps, shift=3.0):
    """The Euler scheduler's shifted grid written out: sigma_min is the shifted 1/1000, the grid a linspace from 1
    to it (as timesteps / 1000), shifted by shift s / (1 + (shift - 1) s), then 0."""
    def shifted(s):
        return shift * s / (1 + (shift - 1) * s)

    grid = np.linspace(1.0, shifted(1 / 1000), num_steps)
    return np.append(shifted(grid), 0.0)


def test_the_latents_carry_a_time_axis_and_the_grid_is_the_shifted_euler_grid(pipeline):
    policy = _policy(pipeline)
    batch = policy.sample(PROMPTS, 4, 1.0, 0.7, generator=torch.Generator().manual_seed(0))
    # 5 frames -> (5 - 1) / 2 + 1 = 3 latent frames of 32 / 4 = 8 x 8
    assert batch.latents.shape == (2, 5, 4, 3, 8, 8) and batch.images.shape == (2, 5, 3, 32, 32)
    assert torch.equal(batch.latents[:, 0], torch.randn(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0)))
    expected = torch.tensor(_wan_sigmas(4), dtype=torch.float32)
    torch.testing.assert_close(batch.sigmas, expected.expand(2, 5), rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.timesteps, expected[:4].expand(2, 4) * 1000, rtol=0, atol=1e-3)
    assert batch.images.min() >= 0 and batch.images.max() <= 1


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_the_velocity_is_the_transformers_with_the_pipelines_cfg(pipeline, guidance):
    policy = _policy(pipeline)
    batch = policy.sample(PROMPTS, 4, guidance, 0.7, generator=torch.Generator().manual_seed(1), keep_steps=False)
    x = torch.randn(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([900.0, 300.0])

    def call(embeds):
        return pipeline.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]

    with torch.no_grad():
        v = call(batch.prompt_embeds)
        if guidance > 1:
            uncond = call(batch.negative_prompt_embeds)
            v = uncond + guidance * (v - uncond)
        ours = policy.predict(pipeline.transformer, x, t, batch, torch.arange(2), guidance)
    torch.testing.assert_close(ours, v, rtol=1e-5, atol=1e-6)


def test_decoding_denormalises_and_puts_frames_second(pipeline):
    policy = _policy(pipeline)
    z = torch.randn(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1, 1)
    std = torch.tensor([1.5, 0.8, 1.2, 2.0]).view(1, 4, 1, 1, 1)
    with torch.no_grad():
        decoded = pipeline.vae.decode(z * std + mean).sample  # (B, 3, F, H, W)
        videos = policy._decode(z)
    assert decoded.shape == (2, 3, 5, 32, 32) and videos.shape == (2, 5, 3, 32, 32)
    torch.testing.assert_close(videos[:, 2], (decoded[:, :, 2] / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(videos, (decoded / 2 + 0.5).clamp(0, 1).transpose(1, 2), rtol=0, atol=1e-5)


def test_the_evaluation_keeps_its_fixed_noise_for_videos(pipeline):
    # the same (prompt, video) pair gets the same noise whatever the batch it is sampled in
    policy = _policy(pipeline)
    reward = CombinedReward({"mean": lambda images, prompts, metadata: (images.mean(dim=(1, 2, 3)), {})}, frames=3)
    records = [PromptRecord(p) for p in PROMPTS]
    runs = [evaluate(policy, None, records, reward, 2, 3, 4.0, 0.7, seed=7, batch_size=size, grid_prompts=2)
            for size in (1, 4)]
    # (equal up to float rounding: a batch of 1 and one of 4 round their matrix products differently)
    np.testing.assert_allclose(runs[0]["rewards"], runs[1]["rewards"], rtol=0, atol=1e-6)
    assert runs[0]["images"].shape == (4, 5, 3, 32, 32)
    torch.testing.assert_close(runs[0]["images"], runs[1]["images"], rtol=0, atol=1e-5)
    assert runs[0]["rewards"][0, 0] != runs[0]["rewards"][0, 1]  # two videos of one prompt: two noises


# ---------------------------------------------------------------------------------------------------
# Rewards on videos


def test_frame_indices_are_evenly_spaced_with_both_ends():
    assert frame_indices(5, 3) == [0, 2, 4]
    assert frame_indices(5, 4) == [0, 1, 3, 4]  # i * 4 / 3 = 0, 1.33, 2.67, 4 rounded
    assert frame_indices(81, 4) == [0, 27, 53, 80]  # i * 80 / 3 = 0, 26.67, 53.33, 80 rounded
    assert frame_indices(33, 2) == [0, 32]
    assert frame_indices(5, 1) == [2] and frame_indices(4, 1) == [1]
    assert frame_indices(5, 0) == frame_indices(5, 5) == frame_indices(5, 9) == [0, 1, 2, 3, 4]


def _videos():
    generator = torch.Generator().manual_seed(0)
    return torch.rand(3, 5, 3, 4, 4, generator=generator)


def test_an_image_reward_on_videos_is_the_mean_over_evenly_spaced_frames():
    seen = []

    def brightness(images, prompts, metadata):
        seen.append((tuple(images.shape), list(prompts), [m["i"] for m in metadata]))
        return images.mean(dim=(1, 2, 3)) * 2.0, {"calls": 1.0}

    videos = _videos()
    array = videos.double().numpy()
    per_frame = array.mean(axis=(2, 3, 4)) * 2.0  # (3 videos, 5 frames), computed here
    prompts, metadata = ["a", "b", "c"], [{"i": 0}, {"i": 1}, {"i": 2}]
    for frames, chosen in ((3, [0, 2, 4]), (1, [2]), (0, [0, 1, 2, 3, 4])):
        seen.clear()
        total, components, _ = CombinedReward({"brightness": brightness}, frames=frames)(videos, prompts, metadata)
        expected = per_frame[:, chosen].mean(axis=1)
        np.testing.assert_allclose(components["brightness"], expected, rtol=1e-6)
        np.testing.assert_allclose(total, expected, rtol=1e-6)
        k = len(chosen)
        # one call on 3 k images, each video's frames consecutive with its prompt and metadata repeated
        assert seen == [((3 * k, 3, 4, 4), [p for p in prompts for _ in range(k)], [i for i in range(3) for _ in range(k)])]
    # chunked (reward_batch_size 2): chunks of videos, the same means
    chunked = CombinedReward({"brightness": brightness}, frames=3, batch_size=2)(videos, prompts, metadata)[0]
    np.testing.assert_allclose(chunked, per_frame[:, [0, 2, 4]].mean(axis=1), rtol=1e-6)
    with pytest.raises(ValueError, match="reward_frames"):
        CombinedReward({"brightness": brightness}, frames=-1)


def _motion(images, prompts, metadata):
    """A video reward: mean |frame difference| (motion), computed on the (B, F, 3, H, W) clips."""
    assert images.ndim == 5
    return (images[:, 1:] - images[:, :-1]).abs().mean(dim=(1, 2, 3, 4)), {}


register_reward("test_wan_motion", video=True)(_motion)


def test_a_video_reward_gets_the_clips_and_is_refused_for_an_image_model(tmp_path):
    videos = _videos()
    array = videos.double().numpy()
    expected = np.abs(array[:, 1:] - array[:, :-1]).mean(axis=(1, 2, 3, 4))
    reward = CombinedReward({"motion": _motion, "brightness": lambda i, p, m: (i.mean(dim=(1, 2, 3)), {})}, frames=2)
    total, components, _ = reward(videos, ["a"] * 3)
    np.testing.assert_allclose(components["motion"], expected, rtol=1e-6)
    np.testing.assert_allclose(total, expected + array[:, [0, 4]].mean(axis=(2, 3, 4)).mean(axis=1), rtol=1e-6)
    with pytest.raises(ValueError, match="config.reward_fn: reward 'motion' scores videos"):
        reward(videos[:, 0], ["a"] * 3)  # images
    with pytest.raises(ConfigError, match=r"^config.reward_fn: reward 'test_wan_motion' scores videos .* makes images"):
        check_config(make_config(tmp_path, variant="tiny_sd3", reward_fn="test_wan_motion"))
    with pytest.raises(ConfigError, match=r"^config.reward_weights: reward 'test_wan_motion' scores videos"):
        check_config(make_config(tmp_path, variant="test", reward_fn="",
                                 reward_weights={"test_wan_motion": 1.0, "jpeg_compressibility": 1.0}))
    check_config(make_config(tmp_path, variant="tiny_wan", reward_fn="test_wan_motion"))  # a video model: fine
    with pytest.raises(ConfigError, match=r"config.reward_frames=-1"):
        check_config(make_config(tmp_path, variant="tiny_wan", reward_frames=-1))


def test_frames_for_an_image_model_are_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^config.sample.num_frames=5: the sd3 family makes images, not videos; "
                                          r"set sample.num_frames=0$"):
        Trainer(make_config(tmp_path, variant="tiny_sd3", sample__num_frames=5))
    with pytest.raises(ConfigError, match=r"^config.sample.num_frames=6: this Wan model takes 1 \+ 2 k frames"):
        Trainer(make_config(tmp_path, variant="tiny_wan", run_name="w", sample__num_frames=6))


def test_video_grids_are_animated_webp_with_every_frame(tmp_path):
    videos = _videos()[:2]
    grid = save_epoch_samples(tmp_path, 3, videos, ["a", "a"], [0.5, 0.25], [1.0, -1.0], group_size=2, fps=8)
    assert grid.name == "epoch_0003.webp"
    with Image.open(grid) as image:
        assert image.is_animated and image.n_frames == 5
    with Image.open(tmp_path / "samples" / "epoch_0003" / "001.webp") as image:
        assert image.n_frames == 5
        for f in range(5):
            image.seek(f)
            expected = np.floor(np.clip(videos[1, f].numpy(), 0, 1) * 255 + 0.5).astype(np.uint8).transpose(1, 2, 0)
            assert np.array_equal(np.asarray(image.convert("RGB")), expected)  # lossless: each frame exactly
    html = video_samples_html(tmp_path)
    assert html.count('<img src="data:image/webp;base64,') == 1 and "epoch 3" in html
    assert video_samples_html(tmp_path / "elsewhere") == ""


# ---------------------------------------------------------------------------------------------------
# Training


def test_two_epochs_of_tiny_wan_train_with_frame_averaged_rewards(tmp_path):
    run_dir = train(make_config(tmp_path, variant="tiny_wan", sample__batch_size=2, sample__num_batches_per_epoch=2,
                                train__gradient_accumulation_steps=2, log_images_every=1))
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [0, 1]
    assert rows[-1]["train/global_step"] == 2 and rows[-1]["train/skipped_steps"] == 0
    assert rows[0]["approx_kl"] == 0.0  # one optimizer step per epoch: the ratio is exactly 1 in the first epoch
    assert math.isfinite(rows[-1]["loss"]) and len({row["reward_mean"] for row in rows}) == 2
    assert rows[0]["samples/grid"].endswith("epoch_0000.webp")
    with Image.open(os.path.join(run_dir, rows[0]["samples/grid"])) as grid:
        assert grid.n_frames == 5
    from ddpo_group.report.page import build_report

    page = build_report(run_dir)  # the HTML report shows the animated grids of a video run
    assert "<h2>Sample videos</h2>" in page and page.count("data:image/webp;base64,") >= 2


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_a_forward_objective_trains_tiny_wan(tmp_path, objective):
    overrides = dict(num_epochs=1, log_images_every=0, train__objective=objective, train__use_reference_model=False,
                     train__use_kl_loss=False, train__beta=0.0, forward__num_timesteps=2, train__learning_rate=1e-3)
    if objective == "awm":
        overrides["train__clip_range"] = 0.2
    row = read_metrics(train(make_config(tmp_path, variant="tiny_wan", **overrides)))[0]
    assert row["train/global_step"] == 2 and row["train/skipped_steps"] == 0
    assert row["forward/first_window_max_abs_deviation"] == 0.0 and math.isfinite(row["loss"])


@pytest.mark.parametrize("objective", ["dgpo", "dpo"])
def test_a_preference_objective_trains_tiny_wan(tmp_path, objective):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_wan", **cheap(
        train__objective=objective, train__use_reference_model=True, forward__num_timesteps=2))))[0]
    assert row["train/global_step"] >= 1 and row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])


@pytest.mark.parametrize("estimator", ["group_ppo", "gae"])
def test_a_critic_run_trains_tiny_wan(tmp_path, estimator):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_wan", **cheap(
        algorithm__adv_estimator=estimator, train__timestep_selection="segment_start" if estimator == "group_ppo" else "all",
        sample__sde_window_size=1 if estimator == "group_ppo" else 0))))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])


def test_wan_2_2_ti2v_per_token_timesteps_reproduce_the_pipeline(pipeline):
    # Wan 2.2 TI2V-5B's pipeline flag: the transformer gets one timestep per latent token
    parts = {name: getattr(pipeline, name) for name in ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")}
    ti2v = type(pipeline)(**parts, expand_timesteps=True)
    ti2v.set_progress_bar_config(disable=True)
    policy = policy_for(ti2v)
    policy.height = policy.width = 32
    policy.num_frames = 5
    policy.configure(max_sequence_length=LENGTH)
    ours = policy.sample(PROMPTS, 3, 4.0, 0.0, generator=torch.Generator().manual_seed(8))
    theirs = ti2v(prompt=PROMPTS, height=32, width=32, num_frames=5, num_inference_steps=3, guidance_scale=4.0,
                  generator=torch.Generator().manual_seed(8), output_type="pt", max_sequence_length=LENGTH).frames
    assert (ours.images - theirs).abs().max() < 1e-5
    noisy = policy.sample(PROMPTS, 3, 4.0, 0.7, generator=torch.Generator().manual_seed(9))
    for k in range(3):
        log_prob, _, _ = policy.step_log_prob(ti2v.transformer, noisy, torch.arange(2), torch.full((2,), k), 4.0, 0.7)
        assert torch.equal(log_prob, noisy.log_probs[:, k])


def test_a_video_familys_frame_count_is_one_plus_a_multiple_of_its_temporal_factor():
    # diffusion/base.py's video_frames serves Wan, LTX-2 and HunyuanVideo 1.5 (their configure_frames)
    from ddpo_group.diffusion.base import video_frames

    assert video_frames(9, 4, "Wan") == 9 and video_frames(1, 4, "Wan") == 1 and video_frames(17, 8, "LTX-2") == 17
    with pytest.raises(ValueError) as err:
        video_frames(10, 4, "Wan")
    assert str(err.value) == "config.sample.num_frames=10: this Wan model takes 1 + 4 k frames (e.g. 9)"
    with pytest.raises(ValueError, match=r"this LTX-2 model takes 1 \+ 8 k frames \(e.g. 9\)"):
        video_frames(0, 8, "LTX-2")
