"""ReferencePolicy (docs/design.md §6) on the tiny real UNet: starts as the initial policy,
theta_ref <- alpha * theta + (1 - alpha) * theta_ref every update_freq optimizer steps,
LoRA without mixup = base model with adapters disabled, state_dict round trip."""

import copy

import pytest
import torch
from peft import LoraConfig

from ddpo_group.diffusion.tiny import build_tiny_pipeline
from ddpo_group.training.reference import ReferencePolicy


@pytest.fixture(scope="module")
def base_unet():
    return build_tiny_pipeline(seed=0).unet.float().eval()


@pytest.fixture
def unet(base_unet):
    unet = copy.deepcopy(base_unet)
    unet.requires_grad_(True)
    return unet


@pytest.fixture(scope="module")
def inputs(base_unet):
    generator = torch.Generator().manual_seed(0)
    c = base_unet.config
    sample = torch.randn(2, c.in_channels, c.sample_size, c.sample_size, generator=generator)
    timesteps = torch.tensor([901, 401])
    encoder_hidden_states = torch.randn(2, 5, c.cross_attention_dim, generator=generator)
    return sample, timesteps, encoder_hidden_states


def forward(model, inputs):
    sample, timesteps, encoder_hidden_states = inputs
    with torch.no_grad():
        return model(sample, timesteps, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


def perturb(unet, seed, scale=0.05):
    """theta <- theta + scale * N(0, 1) on the trainable parameters; returns the new values (copies)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in unet.parameters():
            if param.requires_grad:
                param.add_(scale * torch.randn(param.shape, generator=generator))
    return {name: p.detach().clone() for name, p in unet.named_parameters() if p.requires_grad}


def trainable(unet):
    return {name: p.detach().clone() for name, p in unet.named_parameters() if p.requires_grad}


def add_lora(unet, seed=1):
    """A rank-4 adapter whose B matrices are non-zero, so that it changes the output."""
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in unet.named_parameters():
            if "lora_B" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return unet


def test_copy_mode_starts_equal_to_the_policy(unet, inputs):
    reference = ReferencePolicy(unet, use_lora=False, mixup_alpha=0.3, update_freq=1)
    assert not reference.uses_disabled_adapters
    assert torch.equal(forward(reference, inputs), forward(unet, inputs))


def test_reference_keeps_the_initial_policy_when_the_policy_moves(unet, base_unet, inputs):
    reference = ReferencePolicy(unet, use_lora=False, mixup_alpha=0.3, update_freq=1)
    perturb(unet, seed=1)
    assert torch.equal(forward(reference, inputs), forward(base_unet, inputs))
    assert not torch.allclose(forward(unet, inputs), forward(base_unet, inputs))


def test_reference_output_has_no_gradient(unet, inputs):
    reference = ReferencePolicy(unet, use_lora=False)
    sample, timesteps, hidden = inputs
    out = reference(sample, timesteps, encoder_hidden_states=hidden, return_dict=False)[0]
    assert not out.requires_grad


def test_mixup_alpha_03(unet, base_unet, inputs):
    theta_ref = trainable(unet)
    reference = ReferencePolicy(unet, use_lora=False, mixup_alpha=0.3, update_freq=1)
    theta = perturb(unet, seed=2)
    assert reference.on_optimizer_step() is True
    expected = {n: (0.3 * theta[n].double() + 0.7 * theta_ref[n].double()) for n in theta}
    assert set(reference.params) == set(expected)
    for name, value in reference.params.items():
        torch.testing.assert_close(value.double(), expected[name], rtol=0, atol=1e-6)
    # the reference forward is the UNet with exactly those parameters
    mixed = copy.deepcopy(base_unet)
    mixed.load_state_dict({n: v.float() for n, v in expected.items()}, strict=False)
    torch.testing.assert_close(forward(reference, inputs), forward(mixed, inputs), rtol=1e-5, atol=1e-5)


def test_update_freq_syncs_every_n_steps(unet):
    reference = ReferencePolicy(unet, use_lora=False, mixup_alpha=1.0, update_freq=3)
    synced = []
    thetas = []
    for step in range(7):
        thetas.append(perturb(unet, seed=10 + step, scale=0.01))
        synced.append(reference.on_optimizer_step())
    assert synced == [False, False, True, False, False, True, False]
    assert reference.num_syncs == 2
    assert reference.steps_since_sync == 1
    assert reference.metrics() == {"ref/num_syncs": 2, "ref/steps_since_sync": 1}
    # the last sync was at the 6th call: the reference holds theta of that moment, not the latest one
    for name, value in reference.params.items():
        assert torch.equal(value, thetas[5][name])
        assert not torch.equal(value, thetas[6][name])


def test_alpha_one_is_a_hard_sync(unet, inputs):
    reference = ReferencePolicy(unet, use_lora=False, mixup_alpha=1.0, update_freq=1)
    theta = perturb(unet, seed=3)
    reference.on_optimizer_step()
    for name, value in reference.params.items():
        assert torch.equal(value, theta[name])
    assert torch.equal(forward(reference, inputs), forward(unet, inputs))


def test_update_freq_zero_never_syncs(unet, base_unet, inputs):
    initial = trainable(unet)
    reference = ReferencePolicy(unet, use_lora=False, mixup_alpha=1.0, update_freq=0)
    for step in range(5):
        perturb(unet, seed=20 + step)
        assert reference.on_optimizer_step() is False
    assert reference.num_syncs == 0
    assert reference.steps_since_sync == 5
    for name, value in reference.params.items():
        assert torch.equal(value, initial[name])
    assert torch.equal(forward(reference, inputs), forward(base_unet, inputs))


def test_lora_without_mixup_is_the_base_model(unet, base_unet, inputs):
    add_lora(unet)
    adapted = forward(unet, inputs)
    base = forward(base_unet, inputs)
    assert not torch.allclose(adapted, base, atol=1e-4), "the test adapter must change the output"
    reference = ReferencePolicy(unet, use_lora=True, mixup_alpha=1.0, update_freq=0)
    assert reference.uses_disabled_adapters
    assert reference.params == {}  # no copy of any weight
    torch.testing.assert_close(forward(reference, inputs), base, rtol=0, atol=1e-6)
    # the adapters are back on after the reference call
    assert torch.equal(forward(unet, inputs), adapted)


def test_lora_with_mixup_copies_the_adapter_weights_only(unet):
    add_lora(unet)
    reference = ReferencePolicy(unet, use_lora=True, mixup_alpha=0.5, update_freq=2)
    assert not reference.uses_disabled_adapters
    assert reference.params
    assert all("lora_" in name for name in reference.params)
    expected = {n for n, p in unet.named_parameters() if p.requires_grad}
    assert set(reference.params) == expected


def test_state_dict_round_trip(unet, base_unet, inputs):
    reference = ReferencePolicy(unet, use_lora=False, mixup_alpha=0.3, update_freq=2)
    perturb(unet, seed=4)
    reference.on_optimizer_step()
    reference.on_optimizer_step()
    reference.on_optimizer_step()
    state = reference.state_dict()
    assert state["num_syncs"] == 1 and state["steps_since_sync"] == 1

    other_unet = copy.deepcopy(base_unet).requires_grad_(True)
    restored = ReferencePolicy(other_unet, use_lora=False, mixup_alpha=0.3, update_freq=2)
    restored.load_state_dict(state)
    assert (restored.num_syncs, restored.steps_since_sync) == (1, 1)
    for name, value in reference.params.items():
        assert torch.equal(restored.params[name], value)
    assert torch.equal(forward(restored, inputs), forward(reference, inputs))


def test_state_dict_of_another_model_is_rejected(unet, base_unet):
    lora_unet = add_lora(copy.deepcopy(base_unet))
    lora_state = ReferencePolicy(lora_unet, use_lora=True, mixup_alpha=0.5, update_freq=1).state_dict()
    reference = ReferencePolicy(unet, use_lora=False, mixup_alpha=0.5, update_freq=1)
    with pytest.raises(ValueError, match="use_lora"):
        reference.load_state_dict(lora_state)


@pytest.mark.parametrize("alpha", [0.0, -0.5, 1.5])
def test_alpha_outside_0_1_is_rejected(unet, alpha):
    with pytest.raises(ValueError, match="reference_model_mixup_alpha"):
        ReferencePolicy(unet, use_lora=False, mixup_alpha=alpha, update_freq=1)


def test_negative_update_freq_is_rejected(unet):
    with pytest.raises(ValueError, match="reference_update_freq"):
        ReferencePolicy(unet, use_lora=False, mixup_alpha=1.0, update_freq=-1)
