"""LoRA adapters on the UNet: unchanged policy at creation, base model as reference."""

import pytest
import torch

from ddpo_group.diffusion.lora import add_lora, disabled_adapters, has_lora, lora_parameters
from ddpo_group.diffusion.sampling import sample_trajectories, trajectory_log_probs
from ddpo_group.diffusion.tiny import build_tiny_pipeline

PROMPTS = ["a red circle", "a cat"]
STEPS = 3


@pytest.fixture()
def base():
    pipeline = build_tiny_pipeline(seed=0)
    trajectories = sample_trajectories(pipeline, PROMPTS, STEPS, 4.0, 1.0, generator=torch.Generator().manual_seed(0))
    return pipeline, trajectories


def perturb_lora_b(unet):
    with torch.no_grad():
        for name, param in unet.named_parameters():
            if "lora_B" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))


def test_add_lora_freezes_the_base_and_trains_only_lora(base):
    pipeline, _ = base
    params = add_lora(pipeline.unet, rank=4)
    assert has_lora(pipeline.unet)
    names = [name for name, p in pipeline.unet.named_parameters() if p.requires_grad]
    assert names and all("lora_" in name for name in names)
    assert len(params) == len(names) == len(lora_parameters(pipeline.unet))
    targets = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in names}
    assert targets == {"to_k", "to_q", "to_v", "0"}  # "0" is to_out.0
    lora_b = [p for name, p in pipeline.unet.named_parameters() if "lora_B" in name]
    assert lora_b and all(torch.equal(p, torch.zeros_like(p)) for p in lora_b)
    assert all(p.shape[0] == 4 for name, p in pipeline.unet.named_parameters() if "lora_A" in name)


def test_fresh_adapter_leaves_log_probs_identical(base):
    pipeline, trajectories = base
    add_lora(pipeline.unet, rank=4)
    with torch.no_grad():
        log_probs = trajectory_log_probs(pipeline, trajectories, 4.0, 1.0)
    assert torch.equal(log_probs, trajectories.log_probs)


def test_perturbed_adapter_changes_log_probs_and_disabled_adapters_give_the_base(base):
    pipeline, trajectories = base
    add_lora(pipeline.unet, rank=4, alpha=8)
    perturb_lora_b(pipeline.unet)
    with torch.no_grad():
        adapted = trajectory_log_probs(pipeline, trajectories, 4.0, 1.0)
        with disabled_adapters(pipeline.unet):
            reference = trajectory_log_probs(pipeline, trajectories, 4.0, 1.0)
        adapted_again = trajectory_log_probs(pipeline, trajectories, 4.0, 1.0)
    assert (adapted - trajectories.log_probs).abs().max() > 1e-4
    assert (reference - trajectories.log_probs).abs().max() < 1e-7
    assert torch.equal(adapted_again, adapted)


def test_disabled_adapters_restores_requires_grad(base):
    pipeline, _ = base
    add_lora(pipeline.unet, rank=2)
    before = {name: p.requires_grad for name, p in pipeline.unet.named_parameters()}
    with disabled_adapters(pipeline.unet):
        pass
    assert {name: p.requires_grad for name, p in pipeline.unet.named_parameters()} == before


def test_disabled_adapters_without_lora_is_the_model_itself(base):
    pipeline, trajectories = base
    with torch.no_grad(), disabled_adapters(pipeline.unet):
        log_probs = trajectory_log_probs(pipeline, trajectories, 4.0, 1.0)
    assert torch.equal(log_probs, trajectories.log_probs)


def test_alpha_scales_the_lora_update(base):
    # a LoRA linear layer outputs W x + (alpha / r) * B A x
    pipeline, _ = base
    add_lora(pipeline.unet, rank=2, alpha=4)
    perturb_lora_b(pipeline.unet)
    layer = pipeline.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with disabled_adapters(pipeline.unet):
            base_out = layer(x)
        delta = layer(x) - base_out
        lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    torch.testing.assert_close(delta, (4 / 2) * x @ lora_a.T @ lora_b.T, atol=1e-6, rtol=1e-5)


def test_rank_must_be_positive(base):
    pipeline, _ = base
    with pytest.raises(ValueError, match="rank"):
        add_lora(pipeline.unet, rank=0)
