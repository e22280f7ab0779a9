"""Per-phase accounting (ddpo_group/training/perf.py) and benchmarks/overhead.py (issue 44 items 1-2)."""

import json
import math

import pytest
import torch
from helpers import load_script, make_config, read_metrics

from ddpo_group.config.check import ConfigError
from ddpo_group.diffusion.tiny import tiny_component_configs
from ddpo_group.training import perf
from ddpo_group.training.trainer import Trainer


def test_a_linear_forward_counts_two_flops_per_multiply_add_and_three_times_that_in_training():
    layer = torch.nn.Linear(8, 16, bias=False)
    accounting = perf.PerfAccounting(peak_tflops=1.0)
    accounting.attach("denoiser", layer)
    x = torch.randn(4, 8)
    with perf.active(accounting):
        with perf.phase("sampling"), torch.no_grad():
            layer(x)
            layer(x)
        with perf.phase("training"):
            layer(x).sum().backward()
    assert accounting.flops == {"sampling": 2 * (2 * 4 * 8 * 16), "training": 3 * (2 * 4 * 8 * 16)}
    assert accounting.calls == {("sampling", "denoiser"): 2, ("training", "denoiser"): 1}


def test_tiny_unet_forward_flops_match_flop_counter_mode():
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**tiny_component_configs(vocab_size=64)["unet"]).eval()
    inputs = (torch.randn(2, 4, 8, 8), torch.tensor([10, 500]))
    kwargs = {"encoder_hidden_states": torch.randn(2, 7, 32)}
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        unet(*inputs, **kwargs)
    expected = counter.get_total_flops()
    assert expected > 0
    accounting = perf.PerfAccounting(peak_tflops=1.0)
    accounting.attach("denoiser", unet)
    with perf.active(accounting), perf.phase("sampling"), torch.no_grad():
        for _ in range(3):
            unet(*inputs, **kwargs)
    assert accounting.flops["sampling"] == 3 * expected  # counted once, multiplied by the calls


def test_phases_nest_and_a_second_counts_for_the_innermost_only():
    accounting = perf.PerfAccounting(peak_tflops=1.0)
    with perf.active(accounting):
        with perf.phase("training"):
            with perf.phase("reference"):
                x = sum(range(10000))
            perf.switch("critic")
    metrics = accounting.epoch_metrics()
    phases = {f"perf/{p}_{k}" for p in ("reference", "training", "critic") for k in ("seconds", "tflops")}
    assert x and set(metrics) == phases | {"perf/peak_tflops"}
    assert all(metrics[f"perf/{p}_seconds"] >= 0 for p in ("reference", "training", "critic"))
    assert accounting.seconds == {}  # started afresh


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_a_bad_peak_tflops_is_a_one_line_error_naming_the_field(tmp_path, value):
    config = make_config(tmp_path)
    config.perf.peak_tflops = value
    with pytest.raises(ConfigError) as err:
        Trainer(config)
    message = str(err.value)
    assert "config.perf.peak_tflops" in message and "\n" not in message
    assert not (tmp_path / "r").exists()  # refused before anything is written


def test_published_gpu_peaks_are_matched_by_name_and_dtype():
    assert perf.gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert perf.gpu_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5
    assert perf.gpu_peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert perf.gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert perf.gpu_peak_tflops("NVIDIA GeForce RTX 4090", "fp16") == 165.2
    assert perf.gpu_peak_tflops("Some Future GPU", "bf16") is None


def test_cpu_peak_is_measured_once_per_process_and_written_nowhere(tmp_path, monkeypatch):
    # a run writes nothing outside its run directory: no cache file in the user's home or XDG cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    perf._CPU_PEAK.clear()
    first = perf.cpu_matmul_tflops(size=64, seconds=0.02)
    assert first > 0
    assert perf.cpu_matmul_tflops(size=64, seconds=0.02) == first  # measured once
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """One epoch of the test variant with the peak set (no CPU measurement), its calls recorded."""
    config = make_config(tmp_path_factory.mktemp("perf"), num_epochs=1, save_freq=0, log_images_every=0)
    config.perf.peak_tflops = 2.0
    trainer = Trainer(config)
    trainer.perf.record_inputs = True
    run_dir = trainer.run()
    calls = {}
    for (phase, name, _, _), n in trainer.perf.run_calls.items():
        calls[phase, name] = calls.get((phase, name), 0) + n
    return config, read_metrics(run_dir)[0], calls, trainer.perf


def test_calls_per_phase_are_the_configs_arithmetic(one_epoch):
    config, row, calls, accounting = one_epoch
    s, t = config.sample, config.train
    samples = s.batch_size * s.num_batches_per_epoch
    assert calls["sampling", "denoiser"] == s.num_batches_per_epoch * s.num_steps
    # classifier-free guidance: one call on the doubled batch (unconditional + conditional)
    cfg_factor = 2 if s.guidance_scale > 1 else 1
    sampled = [sig for (phase, name, sig, _) in accounting.run_calls if phase == "sampling"]
    assert {sig[1][0][0][0] for sig in sampled} == {cfg_factor * s.batch_size}
    assert calls["decoding", "decoder"] == s.num_batches_per_epoch
    micro_batches = samples // t.batch_size
    assert calls["training", "denoiser"] == micro_batches * s.num_steps == row["train/unet_calls"]
    assert calls["reference", "denoiser"] == calls["training", "denoiser"]
    first_window = t.gradient_accumulation_steps
    assert calls["old_log_probs", "denoiser"] == (micro_batches - first_window) * s.num_steps


def test_perf_metrics_are_present_finite_and_use_the_configured_peak(one_epoch):
    _, row, _, _ = one_epoch
    for phase in ("sampling", "decoding", "reward", "old_log_probs", "reference", "training"):
        assert math.isfinite(row[f"perf/{phase}_seconds"]) and row[f"perf/{phase}_seconds"] >= 0
        assert math.isfinite(row[f"perf/{phase}_tflops"])
    assert row["perf/sampling_tflops"] > 0 and row["perf/training_tflops"] > 0
    for key in ("perf/sampling_mfu", "perf/train_mfu", "perf/overhead"):
        assert math.isfinite(row[key]) and row[key] > 0
    # MFU = FLOPs / seconds / peak, the peak perf.peak_tflops=2.0
    assert row["perf/sampling_mfu"] == pytest.approx(row["perf/sampling_tflops"] / row["perf/sampling_seconds"] / 2.0)
    assert row["perf/train_mfu"] == pytest.approx(row["perf/training_tflops"] / row["perf/training_seconds"] / 2.0)
    assert "time/sample" in row and "time/train" in row  # the existing metrics stay


def test_overhead_benchmark_help_and_a_one_epoch_smoke_writes_its_json(tmp_path, capsys):
    overhead = load_script("benchmarks/overhead.py")
    with pytest.raises(SystemExit) as done:
        overhead.main(["--help"])
    assert done.value.code == 0 and "--epochs" in capsys.readouterr().out
    output = tmp_path / "out" / "test.json"
    overhead.main(["--config", "test", "--epochs", "1", "--output", str(output), "--logdir", str(tmp_path / "runs"),
                   "--replays", "1", "--set", "perf.peak_tflops=2.0", "--set", "sample.num_steps=2",
                   "--set", "save_freq=0", "--set", "log_images_every=0"])
    result = json.loads(output.read_text())
    assert result["peak_tflops"] == 2.0
    for phase in ("sampling", "training"):
        row = result["phases"][phase]
        assert set(row) >= {"seconds", "bare_seconds", "overhead", "mfu"}
        assert row["bare_seconds"] > 0 and row["overhead"] == pytest.approx(row["seconds"] / row["bare_seconds"])
    assert "sampling" in capsys.readouterr().out


def test_report_phase_costs_are_mean_seconds_and_flops_over_seconds_over_peak():
    from pathlib import Path

    from ddpo_group.report.figures import phase_costs, plot_phases
    from ddpo_group.report.run import RunData

    rows = [{"epoch": 0, "perf/sampling_seconds": 2.0, "perf/sampling_tflops": 0.5, "perf/peak_tflops": 1.0,
             "perf/reward_seconds": 0.5, "perf/reward_tflops": 0.0},
            {"epoch": 1, "perf/sampling_seconds": 3.0, "perf/sampling_tflops": 1.0, "perf/peak_tflops": 1.0,
             "perf/reward_seconds": 0.5, "perf/reward_tflops": 0.0}]
    run = RunData(path=Path("a"), config=None, metrics=rows)
    assert phase_costs(run) == {"sampling": (2.5, 1.5 / 5.0), "reward": (0.5, None)}
    other = RunData(path=Path("b"), config=None, metrics=rows[:1])
    assert plot_phases([run, other]).startswith(b"\x89PNG")  # both runs' bars (the compare page)
    assert plot_phases([RunData(path=Path("c"), config=None, metrics=[{"epoch": 0}])]) is None


def test_a_forward_that_raises_leaves_no_counter_or_phase_open():
    class Failing(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("out of memory")

    accounting = perf.PerfAccounting(peak_tflops=1.0)
    failing, layer = Failing(), torch.nn.Linear(8, 16, bias=False)
    accounting.attach("decoder", failing, phase="decoding")
    accounting.attach("denoiser", layer)
    with perf.active(accounting), perf.phase("sampling"), torch.no_grad():
        with pytest.raises(RuntimeError, match="out of memory"):
            failing(torch.zeros(1))
        assert accounting.current == "sampling"  # the decoding phase closed
        layer(torch.randn(4, 8))  # counted by a counter of its own: the failed call's was closed
    assert accounting.flops["sampling"] == 2 * 4 * 8 * 16
