"""Memory of the training pass (docs/memory.md), measured on the CPU by what autograd keeps.

Peak GPU memory is measured by benchmarks/gpu_check.py on a GPU; here the quantity behind it is counted
exactly: the bytes of the tensors autograd saves for the backward (its activations), live from the forward
that saves them until the backward (or the dropped graph) releases them. Parameters are left out (they are
held anyway), and a storage saved twice is counted once.
"""

import json

import pytest
import torch
from helpers import load_script, make_config

from ddpo_group.config.check import ConfigError
from ddpo_group.training.trainer import Trainer

activation_memory = load_script("benchmarks/activation_memory.py")
SavedActivations = activation_memory.SavedActivations

pytestmark = pytest.mark.slow


def _trainer_and_samples(tmp_path, **overrides):
    config = make_config(tmp_path, num_epochs=1, log_images_every=0, **overrides)
    trainer = Trainer(config)
    metrics = {}
    samples = trainer.sample_epoch(0, metrics)
    trainer.compute_advantages(samples, metrics)
    return trainer, samples


@pytest.mark.parametrize("objective", ["stepwise", "forward"])
def test_no_forward_with_gradients_starts_while_an_earlier_ones_activations_are_held(tmp_path, objective):
    # one optimizer step per micro-batch: the second micro-batch's pi_old comes from the recompute pass, whose
    # forwards run with gradients enabled (the training forward's kernels) and must drop each graph at once
    overrides = dict(train__gradient_accumulation_steps=1)
    if objective == "forward":
        overrides = dict(overrides, variant="tiny_nft", sample__batch_size=4, sample__num_batches_per_epoch=1,
                         train__batch_size=2, sample__group_size=2)
    trainer, samples = _trainer_and_samples(tmp_path, **overrides)
    meter = SavedActivations(trainer.trainable_module)
    starts, forwards = [], []
    policy = trainer.policy
    original = policy.step_log_prob if objective == "stepwise" else policy.predict

    def counted(model, *args, **kwargs):
        if not torch.is_grad_enabled():
            return original(model, *args, **kwargs)
        starts.append(meter.live)  # what earlier forwards still hold when this one begins
        before = meter.live
        out = original(model, *args, **kwargs)
        forwards.append(meter.live - before)
        return out

    if objective == "stepwise":
        policy.step_log_prob = counted
    else:
        policy.predict = counted
    metrics = {}
    with meter.counting():
        trainer.train_epoch(samples, 0, metrics)
    assert metrics["train/global_step"] == 2
    if objective == "stepwise":
        # 2 micro-batches x 4 steps in the training pass, 1 micro-batch x 4 steps in the recompute pass
        assert len(forwards) == 12
    assert min(forwards) > 0
    assert starts == [0] * len(starts)
    # so the pass never holds two forwards' activations (the loss after a forward saves a few bytes more)
    assert max(forwards) <= meter.peak < max(forwards) + min(forwards)


def _column_gradient(trainer, samples, checkpointing):
    """The LoRA gradient of the first micro-batch's first trained step, and the activation bytes its forward held."""
    update = trainer.update
    module = trainer.trainable_module
    if checkpointing:
        module.enable_gradient_checkpointing()
    else:
        module.disable_gradient_checkpointing()
    plan = update.plan(samples, 0)
    mb = plan[0]
    mb.old_log_probs = mb.old_log_probs.clone()
    meter = SavedActivations(module)
    trainer.model.zero_grad(set_to_none=True)
    with meter.counting():
        log_prob, _, _, finite = update.train_column(samples, mb, 0, mb.old_log_probs.clone(), 1, True)  # (log_prob, kl, drift, finite)
    assert finite and meter.live == 0  # the backward released everything the forward saved
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.requires_grad}
    return log_prob, grads, meter.peak


def test_gradient_checkpointing_keeps_values_and_gradients_and_holds_less(tmp_path, monkeypatch):
    # on a GPU the comparison needs deterministic kernels: cuDNN may otherwise pick convolution backward
    # algorithms that accumulate in a different order from one call to the next (no effect on the CPU)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    trainer, samples = _trainer_and_samples(tmp_path, use_lora=True, train__gradient_checkpointing=True)
    assert trainer.trainable_module.is_gradient_checkpointing
    log_prob_on, grads_on, held_on = _column_gradient(trainer, samples, checkpointing=True)
    log_prob_off, grads_off, held_off = _column_gradient(trainer, samples, checkpointing=False)
    assert torch.equal(log_prob_on, log_prob_off)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name in grads_on:
        assert torch.equal(grads_on[name], grads_off[name]), name
    # the UNet's blocks keep only their inputs until the backward
    assert held_on < 0.5 * held_off, (held_on, held_off)


def test_gradient_checkpointing_epoch_is_exactly_on_policy(tmp_path):
    trainer, samples = _trainer_and_samples(
        tmp_path, train__gradient_checkpointing=True, train__gradient_accumulation_steps=1, train__learning_rate=1e-30,
        train__clip_range=1e-4,
    )
    metrics = {}
    trainer.train_epoch(samples, 0, metrics)
    assert metrics["train/global_step"] == 2
    assert metrics["train/on_policy_max_abs_log_ratio"] == 0.0
    assert metrics["approx_kl"] == 0.0 and metrics["clipfrac"] == 0.0


def test_gradient_checkpointing_on_a_model_without_it_is_a_one_line_error(tmp_path, monkeypatch):
    from diffusers import UNet2DConditionModel

    monkeypatch.setattr(UNet2DConditionModel, "_supports_gradient_checkpointing", False)
    with pytest.raises(ConfigError, match=r"train\.gradient_checkpointing=True.*UNet2DConditionModel") as err:
        Trainer(make_config(tmp_path, train__gradient_checkpointing=True))
    assert "\n" not in str(err.value) and "train.gradient_checkpointing=False" in str(err.value)


def test_the_activation_benchmark_measures_both_ways_on_the_cpu(tmp_path, capsys):
    output = tmp_path / "activation_memory.json"
    assert activation_memory.main(["--arch", "tiny,tiny-sd3", "--batch", "2", "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    assert [e["arch"] for e in results["entries"]] == ["tiny", "tiny-sd3"]
    for entry in results["entries"]:
        assert entry["batch"] == 2 and entry["cfg"] is True and entry["device"] == "cpu"
        assert entry["plain_released_by_backward"] and entry["checkpointing_released_by_backward"]
        assert 0 < entry["checkpointing_mb"] < entry["plain_mb"]
        assert 0 < entry["largest_block_mb"] < entry["plain_mb"]
        assert entry["checkpointing_bound_mb"] == entry["checkpointing_mb"] + entry["largest_block_mb"]
        assert entry["ratio"] == pytest.approx(entry["checkpointing_mb"] / entry["plain_mb"])
    # the tiny SD3 transformer has 2 joint blocks (diffusion/tiny.py), each checkpointed
    assert results["entries"][1]["checkpointed_blocks"] == 2
    assert "| tiny (tiny) | fp32 | 2 x2 | 32 |" in capsys.readouterr().out
