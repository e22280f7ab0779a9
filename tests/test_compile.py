"""config.compile and config.attention_backend (ddpo_group/training/speed.py, issue 44 item 3).

The trainer tests compile with torch.compile's "aot_eager" backend through the same code path as the default
"inductor" (speed.COMPILE_BACKEND): dynamo's graphs and AOTAutograd's forward / backward split, run by eager kernels.
Inductor itself takes minutes per graph on this CPU; benchmarks/overhead.py --set compile=true measures it
(docs/performance.md)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.training import speed
from ddpo_group.training.trainer import Trainer
from helpers import make_config

DELTA = 0.05  # stands in for a GPU's layout noise on the stored log-probs (as tests/test_precision.py)


@pytest.fixture
def counted_backend(monkeypatch):
    """The compile backend "aot_eager", counting the graphs it is given (grad-enabled or not)."""
    from torch._dynamo import lookup_backend

    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(torch.is_grad_enabled())
        return lookup_backend("aot_eager")(graph_module, example_inputs)

    monkeypatch.setattr(speed, "COMPILE_BACKEND", backend)
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()


@pytest.mark.parametrize("use_lora", [True, False])
def test_a_compiled_epoch_is_exactly_on_policy_and_its_checkpoint_loads(tmp_path, counted_backend, use_lora):
    # 4 trajectories, micro-batches of 2, one optimizer step each: the second micro-batch's pi_old comes from the
    # recompute pass; a learning rate of 0 keeps the weights, so every ratio of the epoch is exactly 1 when the
    # compiled old-log-prob pass and the compiled training forward agree to the bit. The KL's reference runs through
    # the compiled forward too: LoRA's with the adapters disabled, a full fine-tune's with its weights swapped in.
    config = make_config(tmp_path, run_name="c", num_epochs=1, log_images_every=0, compile=True, use_lora=use_lora,
                         train__gradient_accumulation_steps=1, train__clip_range=1e-4)
    trainer = Trainer(config)
    for group in trainer.optimizer.param_groups:
        group["lr"] = 0.0
    module = trainer.trainable_module
    assert speed.is_compiled(module) and trainer.policy.trainable_module is module
    metrics = {}
    samples = trainer.sample_epoch(0, metrics)
    assert counted_backend and not any(counted_backend)  # sampling ran a no-grad compiled graph
    samples.log_probs = samples.log_probs + DELTA * samples.mask
    trainer.compute_advantages(samples, metrics)
    trainer.train_epoch(samples, 0, metrics)
    assert any(counted_backend)  # and training a grad-enabled one
    assert metrics["train/global_step"] == 2
    assert metrics["train/on_policy_max_abs_log_ratio"] == 0.0
    assert metrics["approx_kl"] == 0.0 and metrics["clipfrac"] == 0.0
    assert metrics["train/layout_noise_max_abs_log_ratio"] == pytest.approx(DELTA, abs=1e-3)

    # the checkpoint holds the module's own keys (no torch.compile "_orig_mod." prefix) and loads into a fresh policy
    assert not any("_orig_mod" in key for key in module.state_dict())
    directory = tmp_path / "export"
    trainer.policy.save_trainable(module, str(directory), use_lora=use_lora)
    saved = load_file(os.path.join(directory, "lora", "pytorch_lora_weights.safetensors") if use_lora
                      else os.path.join(directory, "unet", "diffusion_pytorch_model.safetensors"))
    assert saved and not any("_orig_mod" in key for key in saved)
    fresh = Trainer(make_config(tmp_path, run_name="fresh", num_epochs=1, log_images_every=0, use_lora=use_lora))
    with torch.no_grad():
        for param in fresh.trainable_params:
            param.add_(1.0)  # differs from the trained weights until loaded
    fresh.policy.load_trainable(fresh.trainable_module, str(directory), use_lora=use_lora)
    trained = {k: v for k, v in module.state_dict().items() if "lora" in k or not use_lora}
    loaded = {k: v for k, v in fresh.trainable_module.state_dict().items() if "lora" in k or not use_lora}
    assert trained and trained.keys() == loaded.keys() and all(torch.equal(trained[k], loaded[k]) for k in trained)


def test_compile_refuses_fsdp2(tmp_path):
    config = make_config(tmp_path, compile=True, use_lora=False, train__sharding="fsdp2")
    with pytest.raises(ConfigError, match=r"config.compile=True with config.train.sharding='fsdp2'"):
        speed.check_compile(config, None)


def test_attention_backend_names_devices_and_packages(tmp_path):
    check_config(make_config(tmp_path, attention_backend="_native_math"), has_gpu=False)
    for value, has_gpu, message in [
        ("fast", None, r"config.attention_backend='fast' is not a diffusers attention backend"),
        ("_native_efficient", False, r"config.attention_backend='_native_efficient' runs only on a CUDA GPU"),
        ("flash", False, r"config.attention_backend='flash' runs only on a CUDA GPU"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            check_config(make_config(tmp_path, attention_backend=value), has_gpu=has_gpu)
        assert "\n" not in str(err.value)
    from diffusers.utils.import_utils import is_flash_attn_3_available

    if not is_flash_attn_3_available():  # a GPU machine without FlashAttention 3: what to install
        with pytest.raises(ConfigError, match=r"config.attention_backend='_flash_3' is not installed here \("
                                              r"FlashAttention 3"):
            check_config(make_config(tmp_path, attention_backend="_flash_3"), has_gpu=True)


def test_attention_backend_applies_to_dispatching_transformers_and_refuses_a_unet(tmp_path):
    from diffusers.models.attention_dispatch import AttentionBackendName

    with pytest.raises(ConfigError, match=r"config.attention_backend='native': the UNet2DConditionModel .* "
                                          r"attention_backend=''"):
        Trainer(make_config(tmp_path, run_name="unet", num_epochs=1, attention_backend="native"))
    trainer = Trainer(make_config(tmp_path, variant="tiny_flux", run_name="flux", num_epochs=1, log_images_every=0,
                                  sample__num_steps=2, attention_backend="_native_math"))
    backends = {getattr(m.processor, "_attention_backend", None) for m in trainer.trainable_module.modules()
                if hasattr(m, "processor")}
    assert backends == {AttentionBackendName._NATIVE_MATH}
    trainer.run()


def test_a_deep_copy_of_a_compiled_module_computes_with_its_own_weights(counted_backend):
    """train.async_rollout's frozen sampler copy (and any deepcopy of the denoiser) must run the copy's weights: the
    compiled forward once closed over the original's bound forward, so a copy silently ran the training weights."""
    import copy

    torch.manual_seed(0)
    module = speed.compile_denoiser(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)))
    x = torch.randn(3, 4)
    module(x)  # compiled for the original first
    duplicate = copy.deepcopy(module)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # the original trains on; the copy keeps the old weights
    eager_copy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    eager_copy.load_state_dict(duplicate.state_dict())
    expected_copy = torch.tanh(x @ eager_copy[0].weight.T + eager_copy[0].bias) @ eager_copy[2].weight.T + eager_copy[2].bias
    expected_original = (torch.tanh(x @ module[0].weight.T + module[0].bias) @ module[2].weight.T + module[2].bias)
    assert torch.allclose(duplicate(x), expected_copy, atol=1e-6)
    assert torch.allclose(module(x), expected_original, atol=1e-6)
    assert not torch.allclose(expected_copy, expected_original)
    assert speed.is_compiled(duplicate) and speed.is_compiled(module)
