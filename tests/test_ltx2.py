"""The LTX-2 family (ddpo_group.diffusion.ltx2) on its offline tiny pipeline: video with audio.

Checked: the tiny pipeline's own __call__ runs offline on the CPU and returns video and audio; the family is found
by name and pipeline and checks its frames; the state is one flat latent of the video then the audio tokens; noise 0
gives LTX2Pipeline's videos and waveforms (its __call__ with the extra guidance terms off, ``pipeline_kwargs``), with
and without CFG; re-scoring is exact after cat / index; a run is exactly on-policy.
"""

import pytest
import torch

from ddpo_group.diffusion.base import Trajectories
from ddpo_group.diffusion.ltx2 import LTX2Policy, build_tiny_ltx2_pipeline, split_streams
from ddpo_group.diffusion.policy import family_for_model, policy_for
from ddpo_group.training.trainer import train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a red circle", "a big blue square on a white background"]


@pytest.fixture(scope="module")
def pipe():
    return build_tiny_ltx2_pipeline(seed=0)


def test_the_tiny_pipeline_makes_video_and_audio_offline(pipe):
    out = pipe(PROMPTS, height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
               max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(0))
    assert out.frames.shape == (2, 5, 3, 32, 32)
    assert out.audio.shape[:2] == (2, 2) and out.audio.shape[2] > 0 and torch.isfinite(out.audio).all()


def test_the_family_its_frames_and_its_flat_state(pipe):
    assert family_for_model("tiny-ltx2") is LTX2Policy
    policy = policy_for(pipe)
    assert policy.family == "ltx2" and policy.video and policy.audio_sample_rate == 16000
    assert (policy.height, policy.width, policy.num_frames, policy.max_sequence_length) == (32, 32, 5, 16)
    with pytest.raises(ValueError, match=r"sample.num_frames=4: .* 1 \+ 2 k frames"):
        policy.configure_frames(4)
    with pytest.raises(ValueError, match="sample.resolution=31 must be a multiple of 2"):
        policy.configure(resolution=31)
    with pytest.raises(ValueError, match="no critic"):
        policy.critic_sizes()
    batch = policy.sample(PROMPTS, 2, 4.0, 0.7, generator=torch.Generator().manual_seed(0))
    (sv, cv), (sa, ca) = policy._stream_shapes()
    assert batch.latents.shape == (2, 3, sv * cv + sa * ca) and batch.images.shape == (2, 5, 3, 32, 32)
    video, audio = split_streams(batch.latents[:, 0], (sv, cv), (sa, ca))
    initial = policy._initial_latents(2, "cpu", torch.Generator().manual_seed(0))
    assert torch.equal(torch.cat([video.flatten(1), audio.flatten(1)], 1), initial)
    assert {"audio_prompt_embeds", "prompt_mask", "negative_audio_prompt_embeds", "negative_prompt_mask"} <= set(
        batch.extra_cond)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_noise_level_zero_reproduces_the_ltx2_pipeline_video_and_audio(pipe, guidance):
    policy = policy_for(pipe)
    ours = policy.sample(PROMPTS, 3, guidance, 0.0, generator=torch.Generator().manual_seed(3))
    theirs = pipe(PROMPTS, num_inference_steps=3, generator=torch.Generator().manual_seed(3), output_type="pt",
                  **policy.pipeline_kwargs(guidance))
    assert (ours.images - theirs.frames).abs().max() < 1e-5
    assert (policy.decode_audio(ours.latents[:, -1]) - theirs.audio).abs().max() < 1e-5
    assert (theirs.frames[0] - theirs.frames[1]).abs().max() > 1e-2
    assert (theirs.audio[0] - theirs.audio[1]).abs().max() > 1e-4


def test_rescoring_is_exact_also_after_cat_and_index(pipe):
    policy = policy_for(pipe)
    first = policy.sample(PROMPTS, 3, 4.0, 0.7, generator=torch.Generator().manual_seed(5))
    second = policy.sample(["a cat", "a dog"], 3, 4.0, 0.7, generator=torch.Generator().manual_seed(6))
    assert first.log_probs.dtype == torch.float32 and torch.isfinite(first.log_probs).all()
    both = Trajectories.cat([first, second])
    picked = both.index([3, 0])
    assert torch.equal(picked.extra_cond["audio_prompt_embeds"][1], first.extra_cond["audio_prompt_embeds"][0])
    for start, part in ((0, first), (2, second)):
        rows = torch.arange(start, start + 2)
        for k in range(3):
            log_prob, _, _ = policy.step_log_prob(pipe.transformer, both, rows, torch.full((2,), k), 4.0, 0.7)
            assert torch.equal(log_prob, part.log_probs[:, k])


def test_a_run_is_exactly_on_policy(tmp_path):
    # one optimizer step an epoch (2 batches of 2, accumulation 2): the epoch's ratios are exactly 1
    rows = read_metrics(train(make_config(tmp_path, variant="tiny_ltx2", **cheap(
        use_lora=True, lora_rank=2, train__learning_rate=3e-2, sample__batch_size=2, sample__num_batches_per_epoch=2,
        train__gradient_accumulation_steps=2))))
    assert rows[0]["approx_kl"] == 0.0 and rows[0]["train/on_policy_max_abs_log_ratio"] == 0.0
    assert rows[0]["train/skipped_steps"] == 0


def test_rewards_get_the_audio_in_their_metadata(tmp_path):
    from ddpo_group.rewards.base import register_reward

    seen = []

    @register_reward("test_ltx2_loudness", video=True)
    def loudness(images, prompts, metadata):
        assert images.shape[1:] == (5, 3, 32, 32)  # a video reward: the whole clips
        for meta in metadata:
            audio = meta["audio"]
            assert audio.dtype == torch.float32 and audio.device.type == "cpu" and audio.dim() == 2
            assert audio.shape[0] == 2 and meta["audio_sample_rate"] == 16000
            seen.append(audio)
        return torch.stack([m["audio"].abs().mean() for m in metadata]), {}

    row = read_metrics(train(make_config(tmp_path, variant="tiny_ltx2", reward_fn="test_ltx2_loudness", **cheap())))[0]
    assert seen and row["reward_mean"] > 0
    policy = policy_for(build_tiny_ltx2_pipeline(seed=0))
    batch = policy.sample(PROMPTS, 2, 4.0, 0.7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(batch.audio, policy.decode_audio(batch.latents[:, -1]))
    assert torch.equal(Trajectories.cat([batch, batch]).index([3]).audio[0], batch.audio[1])


def test_the_samples_keep_a_wav_beside_each_video_and_the_report_plays_them(tmp_path):
    import json
    import os
    import wave

    from ddpo_group.report.page import build_report
    from ddpo_group.runs.grids import audio_samples_html

    run_dir = train(make_config(tmp_path, variant="tiny_ltx2", **cheap(log_images_every=1)))
    with open(os.path.join(run_dir, "samples", "epoch_0000.json"), encoding="utf-8") as f:
        document = json.load(f)
    record = document["records"][0]
    assert document["video"] and record["image"].endswith(".webp") and record["audio"] == "epoch_0000/000.wav"
    with wave.open(os.path.join(run_dir, "samples", record["audio"]), "rb") as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (2, 2, 16000) and f.getnframes() > 0
    page = build_report(run_dir)
    assert "<h2>Sample audio (epoch 0)</h2>" in page and page.count('<audio controls src="data:audio/wav;base64,') >= 1
    assert audio_samples_html(tmp_path / "elsewhere") == ""


def test_the_ltx2_preset_is_flow_factorys_recipe():
    from ddpo_group.config.grpo import get_config

    config = get_config("ltx2")
    assert config.pretrained.model == "Lightricks/LTX-2" and (config.lora_rank, config.lora_alpha) == (64, 128)
    assert (config.sample.num_frames, config.sample.num_steps, config.sample.sde_type, config.sample.eta) == (
        121, 24, "cps", 0.8)
    assert (config.sample.sde_window_start, config.sample.sde_window_size, config.sample.guidance_scale) == (0, 10, 1.0)
    assert config.reward_fn == "pickscore" and config.train.clip_range == 1e-4 and config.train.learning_rate == 3e-4
