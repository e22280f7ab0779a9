"""sample.group_noise (docs/critic.md): a prompt's group sharing its initial noise (TempFlow-GRPO's seed groups) and,
with ODE steps before an SDE window, branching at the window's start."""

import pytest
import torch

from ddpo_group.config.check import ConfigError
from ddpo_group.training.rollout import check_group_noise
from ddpo_group.training.trainer import Trainer
from helpers import make_config


def _epoch(tmp_path, name, variant="test", **overrides):
    fields = dict(num_epochs=1, reward_fn="jpeg_compressibility", sample__num_steps=4, sample__batch_size=4,
                  sample__group_size=2, sample__num_batches_per_epoch=2, train__batch_size=4)
    config = make_config(tmp_path, variant=variant, run_name=name, **{**fields, **overrides})
    trainer = Trainer(config)
    samples = trainer.sample_epoch(0, {})
    return samples.prompt_ids.tolist(), samples.latents  # latents (B, T + 1, C, h, w): x_0 (noise) ... x_T


def _same(a, b):
    return torch.equal(a, b)


@pytest.mark.parametrize("variant, start", [("test", 0), ("test", 2), ("tiny_sd3", 2)])
def test_a_shared_group_is_one_trajectory_until_the_window_and_branches_there(tmp_path, variant, start):
    """DDIM (tiny SD) and a flow SDE (tiny SD3)."""
    ids, latents = _epoch(tmp_path, f"w{start}", variant, sample__group_noise="shared", sample__sde_window_size=1,
                          sample__sde_window_start=start)
    pairs = [(i, j) for i in range(len(ids)) for j in range(i + 1, len(ids)) if ids[i] == ids[j]]
    others = [(i, j) for i in range(len(ids)) for j in range(i + 1, len(ids)) if ids[i] != ids[j]]
    assert pairs and others  # groups of 2 spread over the epoch's batches, and more than one prompt
    for i, j in pairs:
        # x_0 .. x_start: the initial noise and the ODE steps before the window, equal to float rounding (the rows
        # sit at different places of their batches)
        torch.testing.assert_close(latents[i, : start + 1], latents[j, : start + 1], rtol=1e-5, atol=1e-5)
        # the window's stochastic step draws each trajectory's own noise: the group branches at x_{start + 1}
        assert (latents[i, start + 1] - latents[j, start + 1]).abs().max() > 1e-2
    for i, j in others:
        assert not _same(latents[i, 0], latents[j, 0])


def test_independent_noise_gives_each_trajectory_its_own_start(tmp_path):
    ids, latents = _epoch(tmp_path, "ind", sample__sde_window_size=1)
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            assert not _same(latents[i, 0], latents[j, 0])


def test_shared_noise_is_the_same_whatever_the_batching(tmp_path):
    """A prompt's initial noise depends on (seed, epoch, prompt) alone: one batch of 8 or two of 4 start alike."""
    ids_two, two = _epoch(tmp_path, "two", sample__group_noise="shared", sample__sde_window_size=1)
    ids_one, one = _epoch(tmp_path, "one", sample__group_noise="shared", sample__sde_window_size=1,
                          sample__num_batches_per_epoch=1, sample__batch_size=8, train__batch_size=8)
    first_two = {p: two[n, 0] for n, p in enumerate(ids_two)}
    assert any(p in first_two for p in ids_one)  # the two epochs draw some prompts in common
    for n, p in enumerate(ids_one):
        if p in first_two:
            torch.testing.assert_close(one[n, 0], first_two[p], rtol=0, atol=0)


@pytest.mark.parametrize("overrides, words", [
    ({"group_noise": "seeded"}, ["sample.group_noise='seeded'", "independent", "shared"]),
    ({"group_noise": "shared", "eta": 0.0}, ["sample.group_noise='shared'", "sample.eta=0", "eta > 0"]),
])
def test_group_noise_errors_name_the_field(tmp_path, overrides, words):
    config = make_config(tmp_path)
    for field, value in overrides.items():
        config.sample[field] = value
    with pytest.raises(ConfigError) as err:
        check_group_noise(config)
    for word in words:
        assert word in str(err.value)
    with pytest.raises(ConfigError):  # and the trainer stops on it before any model loads
        Trainer(config)


@pytest.mark.parametrize("spec, window", [("group_shared", "fixed"), ("branch", "random")])
def test_study_arms_are_valid_configs(spec, window, tmp_path):
    from helpers import load_script

    from ddpo_group.config.check import check_config

    bench = load_script("benchmarks/bench_training.py")
    config = bench.build_method_config(spec, "tiny-shapes", 40, str(tmp_path / "r"), common_variant="tiny", seed=42,
                                       eval_freq=5)
    check_config(config)
    check_group_noise(config)
    assert config.sample.group_noise == "shared" and config.sample.sde_window_size == 1
    assert config.sample.sde_window == window
