"""The model-family seam (ddpo_group.diffusion.policy): the SD family behind it, found by pipeline class,
sampling and re-scoring through it, and a trainer that names none of a family's parts."""

import ast
import pathlib

import pytest
import torch

from ddpo_group.diffusion.policy import DiffusionPolicy, load_policy, policy_for, register_family
from ddpo_group.diffusion.sd import StableDiffusionPolicy
from ddpo_group.diffusion.tiny import build_tiny_pipeline
from helpers import ROOT


def test_the_sd_family_wraps_a_stable_diffusion_pipeline():
    policy = policy_for(build_tiny_pipeline(seed=0))
    assert isinstance(policy, StableDiffusionPolicy) and policy.family == "stable_diffusion"
    # critic sizes from the model: 4 latent channels, the tiny text encoder's hidden size 32
    assert policy.critic_sizes() == {"latent_channels": 4, "prompt_dim": 32}


def test_a_pipeline_no_family_supports_is_named():
    class OtherPipeline:
        pass

    with pytest.raises(ValueError, match="OtherPipeline"):
        policy_for(OtherPipeline())


def test_a_registered_family_must_be_a_policy():
    with pytest.raises(TypeError):
        register_family("not_a_policy")(object)


def test_load_policy_names_a_missing_model():
    with pytest.raises(ValueError, match="no_such_dir"):
        load_policy("./no_such_dir")


def test_step_log_prob_through_the_policy_equals_the_sampled_log_probs():
    policy = policy_for(build_tiny_pipeline(seed=0))
    model = policy.prepare("cpu", torch.float32, use_lora=True, lora_rank=2)
    batch = policy.sample(["a red circle", "a blue square"], num_steps=4, guidance_scale=3.0, eta=1.0,
                          generator=torch.Generator().manual_seed(0))
    rows = torch.arange(2)
    for k in range(4):
        log_prob, mean, std = policy.step_log_prob(model, batch, rows, torch.full((2,), k), guidance_scale=3.0, eta=1.0)
        assert torch.equal(log_prob, batch.log_probs[:, k])
        assert mean.shape == (2, 4, 8, 8) and bool((std > 0).all())


def test_lora_saved_by_the_policy_loads_into_a_fresh_pipeline(tmp_path):
    policy = policy_for(build_tiny_pipeline(seed=0))
    model = policy.prepare("cpu", torch.float32, use_lora=True, lora_rank=2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.01)
    policy.save_trainable(model, str(tmp_path), use_lora=True)
    fresh = build_tiny_pipeline(seed=0)
    fresh.load_lora_weights(str(tmp_path / "lora"))
    inputs = (torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([500]),
              torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(2)))
    with torch.no_grad():
        expected = model(inputs[0], inputs[1], encoder_hidden_states=inputs[2]).sample
        got = fresh.unet(inputs[0], inputs[1], encoder_hidden_states=inputs[2]).sample
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_the_trainer_names_no_part_of_a_model_family():
    tree = ast.parse((pathlib.Path(ROOT) / "ddpo_group" / "training" / "trainer.py").read_text())
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not names & {"unet", "vae", "text_encoder", "scheduler", "transformer", "load_pipeline"}


def test_the_base_class_lists_what_a_family_implements():
    for method in ("supports", "load", "prepare", "critic_sizes", "sample", "step_log_prob", "save_trainable",
                   "load_trainable"):
        assert hasattr(DiffusionPolicy, method) and hasattr(StableDiffusionPolicy, method)


def test_the_epoch_batch_carries_every_field_through_index_to_and_cat():
    from ddpo_group.training.batch import EpochBatch, GatheredBatch

    policy = policy_for(build_tiny_pipeline(seed=0))
    trajectories = policy.sample(["a red circle", "a blue square", "a cat"], num_steps=2, guidance_scale=3.0, eta=1.0,
                                 generator=torch.Generator().manual_seed(0))
    batch = EpochBatch.cat([trajectories])
    batch.rewards = torch.tensor([0.1, 0.2, 0.3])
    batch.components = {"a": torch.tensor([1.0, 2.0, 3.0])}
    batch.advantages = torch.arange(6.0).reshape(3, 2)
    batch.endpoint_mask = torch.tensor([[False, True]] * 3)
    batch.gathered = GatheredBatch(rewards=batch.rewards, components={}, prompt_ids=batch.prompt_ids, mask=batch.mask)
    picked = batch.index([2, 0]).to("cpu")
    assert isinstance(picked, EpochBatch)
    assert picked.rewards.tolist() == pytest.approx([0.3, 0.1])
    assert picked.components["a"].tolist() == [3.0, 1.0]
    assert picked.advantages.tolist() == [[4.0, 5.0], [0.0, 1.0]]
    assert picked.endpoint_mask.tolist() == [[False, True]] * 2
    assert picked.prompts == ["a cat", "a red circle"]
    assert picked.gathered is batch.gathered  # the all-process view is not indexed
    joined = EpochBatch.cat([picked, batch.index([1])])
    assert joined.rewards.tolist() == pytest.approx([0.3, 0.1, 0.2]) and joined.gathered is None
