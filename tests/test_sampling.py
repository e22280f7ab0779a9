"""sample_trajectories / step_log_prob / trajectory_log_probs on the tiny pipeline."""

import pytest
import torch
from diffusers import DDIMScheduler

from ddpo_group.diffusion.base import Trajectories, default_prompt_ids
from ddpo_group.diffusion.sampling import sample_trajectories, trajectory_log_probs
from ddpo_group.diffusion.sd import step_log_prob
from ddpo_group.diffusion.tiny import build_tiny_pipeline

PROMPTS = ["a red circle", "a blue square", "a red circle"]
STEPS = 4


@pytest.fixture(scope="module")
def pipeline():
    return build_tiny_pipeline(seed=0)


@pytest.fixture(scope="module")
def other_pipeline():
    return build_tiny_pipeline(seed=1)


@pytest.fixture(scope="module")
def trajectories(pipeline):
    return sample_trajectories(pipeline, PROMPTS, STEPS, 5.0, 1.0, generator=torch.Generator().manual_seed(0))


def test_fields_shapes_and_dtypes(trajectories):
    B, T = 3, STEPS
    assert len(trajectories) == B
    assert trajectories.images.shape == (B, 3, 32, 32)
    assert trajectories.latents.shape == (B, T + 1, 4, 8, 8)
    assert trajectories.log_probs.shape == (B, T) and trajectories.log_probs.dtype == torch.float32
    assert trajectories.timesteps.shape == (B, T) and trajectories.timesteps.dtype == torch.int64
    assert trajectories.prompt_embeds.shape == (B, 16, 32)
    assert trajectories.negative_prompt_embeds.shape == (B, 16, 32)
    assert trajectories.mask.shape == (B, T) and trajectories.mask.dtype.is_floating_point
    assert trajectories.prompts == PROMPTS
    assert trajectories.prompt_ids.dtype == torch.int64
    assert trajectories.images.min() >= 0 and trajectories.images.max() <= 1


def test_timesteps_are_the_schedulers_noisiest_first(trajectories):
    # leading spacing, 1000 // 4 = 250 apart, steps_offset 1
    assert trajectories.timesteps.tolist() == [[751, 501, 251, 1]] * 3


def test_initial_latents_are_the_pipelines_noise(trajectories):
    noise = torch.randn((3, 4, 8, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(trajectories.latents[:, 0], noise)  # DDIM init_noise_sigma = 1


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
def test_eta_zero_reproduces_the_pipeline_images(pipeline, guidance_scale):
    ours = sample_trajectories(
        pipeline, PROMPTS, STEPS, guidance_scale, 0.0, generator=torch.Generator().manual_seed(7)
    )
    theirs = pipeline(
        PROMPTS,
        num_inference_steps=STEPS,
        guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(7),
        output_type="pt",
    ).images
    assert (ours.images - theirs).abs().max() < 1e-4
    assert torch.equal(ours.mask, torch.zeros(3, STEPS))


def test_eta_one_reproduces_the_pipeline_images_with_the_same_generator(pipeline, trajectories):
    theirs = pipeline(
        PROMPTS, num_inference_steps=STEPS, guidance_scale=5.0, eta=1.0,
        generator=torch.Generator().manual_seed(0), output_type="pt",
    ).images  # fmt: skip
    assert (trajectories.images - theirs).abs().max() < 1e-4


def test_images_are_the_decoded_final_latents(pipeline, trajectories):
    with torch.no_grad():
        decoded = pipeline.vae.decode(trajectories.latents[:, -1] / 0.18215).sample
    torch.testing.assert_close(trajectories.images, (decoded * 0.5 + 0.5).clamp(0, 1))


def test_rescoring_with_unchanged_weights_is_exact(pipeline, trajectories):
    log_probs = trajectory_log_probs(pipeline, trajectories, 5.0, 1.0)
    assert torch.equal(log_probs, trajectories.log_probs)


def test_rescoring_is_exact_with_autograd_on(pipeline, trajectories):
    with torch.enable_grad():
        log_probs = trajectory_log_probs(pipeline, trajectories, 5.0, 1.0, step_indices=[0, 3])
    assert log_probs.requires_grad
    assert torch.equal(log_probs.detach(), trajectories.log_probs[:, [0, 3]])


def test_rescoring_in_micro_batches_is_close(pipeline, trajectories):
    with torch.no_grad():
        log_probs = trajectory_log_probs(pipeline, trajectories, 5.0, 1.0, micro_batch_size=2)
    assert (log_probs - trajectories.log_probs).abs().max() < 1e-5


def test_per_trajectory_step_indices(pipeline, trajectories):
    step_indices = torch.tensor([[0, 2], [1, 3], [3, 0]])
    with torch.no_grad():
        log_probs = trajectory_log_probs(pipeline, trajectories, 5.0, 1.0, step_indices=step_indices)
    assert (log_probs - trajectories.log_probs.gather(1, step_indices)).abs().max() < 1e-5


def test_log_probs_are_normal_densities_of_the_stored_steps(pipeline, trajectories):
    with torch.no_grad():
        _, means, stds = trajectory_log_probs(pipeline, trajectories, 5.0, 1.0, return_means=True)
    assert means.shape == (3, STEPS, 4, 8, 8) and stds.shape == (3, STEPS, 1, 1, 1)
    expected = torch.distributions.Normal(means, stds).log_prob(trajectories.latents[:, 1:]).mean(dim=(2, 3, 4))
    torch.testing.assert_close(trajectories.log_probs, expected, atol=1e-5, rtol=1e-5)


def test_changed_weights_change_the_log_probs(trajectories, other_pipeline):
    other = other_pipeline
    with torch.no_grad():
        log_probs = trajectory_log_probs(other, trajectories, 5.0, 1.0)
    assert (log_probs - trajectories.log_probs).abs().max() > 1e-3


def test_unet_argument_overrides_the_pipelines_unet(pipeline, trajectories, other_pipeline):
    other = other_pipeline
    generator = torch.Generator().manual_seed(0)
    with_other_unet = sample_trajectories(pipeline, PROMPTS, STEPS, 5.0, 1.0, generator=generator, unet=other.unet)
    assert not torch.equal(with_other_unet.latents[:, -1], trajectories.latents[:, -1])
    with torch.no_grad():
        assert torch.equal(
            trajectory_log_probs(pipeline, with_other_unet, 5.0, 1.0, unet=other.unet), with_other_unet.log_probs
        )


def test_no_guidance_has_no_negative_embeddings(pipeline):
    out = sample_trajectories(pipeline, PROMPTS, 2, 1.0, 1.0, generator=torch.Generator().manual_seed(0))
    assert out.negative_prompt_embeds is None
    with torch.no_grad():
        assert torch.equal(trajectory_log_probs(pipeline, out, 1.0, 1.0), out.log_probs)


def test_mask_is_zero_where_sigma_is_zero(pipeline):
    pipeline_zero_sigma = build_tiny_pipeline(seed=0)
    pipeline_zero_sigma.scheduler = DDIMScheduler.from_config(
        pipeline.scheduler.config, set_alpha_to_one=True, steps_offset=0
    )
    out = sample_trajectories(pipeline_zero_sigma, PROMPTS, 3, 5.0, 1.0, generator=torch.Generator().manual_seed(0))
    assert out.mask.tolist() == [[1.0, 1.0, 0.0]] * 3
    assert torch.equal(out.log_probs[:, 2], torch.zeros(3))


def test_sampling_keeps_no_autograd_graph(pipeline):
    pipeline.unet.requires_grad_(True)
    try:
        out = sample_trajectories(pipeline, PROMPTS, 2, 5.0, 1.0, generator=torch.Generator().manual_seed(0))
    finally:
        pipeline.unet.requires_grad_(False)
    for value in (out.images, out.latents, out.log_probs, out.prompt_embeds, out.negative_prompt_embeds):
        assert not value.requires_grad and value.grad_fn is None


def test_default_prompt_ids_are_first_appearance_indices():
    assert default_prompt_ids(["a", "b", "a"]).tolist() == [0, 1, 0]
    assert default_prompt_ids(["x", "x", "y", "x", "z"]).tolist() == [0, 0, 2, 0, 4]


def test_prompt_ids_default_and_explicit(pipeline, trajectories):
    assert trajectories.prompt_ids.tolist() == [0, 1, 0]
    out = sample_trajectories(pipeline, PROMPTS, 1, 1.0, 1.0, prompt_ids=[5, 6, 5])
    assert out.prompt_ids.tolist() == [5, 6, 5]
    with pytest.raises(ValueError, match="prompt_ids"):
        sample_trajectories(pipeline, PROMPTS, 1, 1.0, 1.0, prompt_ids=[0, 1])


def test_step_log_prob_is_one_cfg_unet_call_with_gradients(pipeline, trajectories):
    calls = []
    handle = pipeline.unet.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    pipeline.unet.requires_grad_(True)
    try:
        k = 1
        log_prob, mean, std = step_log_prob(
            pipeline.unet,
            pipeline.scheduler,
            trajectories.latents[:, k],
            trajectories.latents[:, k + 1],
            trajectories.timesteps[:, k],
            trajectories.prompt_embeds,
            trajectories.negative_prompt_embeds,
            5.0,
            1.0,
            num_inference_steps=STEPS,
        )
        log_prob.mean().backward()
        grads = [p.grad for p in pipeline.unet.parameters()]
    finally:
        handle.remove()
        pipeline.unet.requires_grad_(False)
        pipeline.unet.zero_grad(set_to_none=True)
    assert calls == [6]  # [uncond, cond] of B = 3 in one call
    assert torch.equal(log_prob.detach(), trajectories.log_probs[:, k])
    assert mean.shape == (3, 4, 8, 8) and std.shape == (3, 1, 1, 1)
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_trajectories_index_to_and_cat(trajectories):
    picked = trajectories.index([2, 0])
    assert picked.prompts == [PROMPTS[2], PROMPTS[0]]
    assert torch.equal(picked.latents, trajectories.latents[[2, 0]])
    assert torch.equal(picked.prompt_ids, trajectories.prompt_ids[[2, 0]])
    assert trajectories.index(1).prompts == [PROMPTS[1]] and len(trajectories.index(1)) == 1
    assert trajectories.index(slice(0, 2)).prompts == PROMPTS[:2]
    assert trajectories.index(torch.tensor([True, False, True])).prompts == [PROMPTS[0], PROMPTS[2]]
    joined = Trajectories.cat([picked, trajectories.index([1])])
    assert joined.prompts == [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    assert torch.equal(joined.log_probs, trajectories.log_probs[[2, 0, 1]])
    moved = trajectories.to("cpu")
    assert torch.equal(moved.images, trajectories.images) and moved.prompts == PROMPTS
