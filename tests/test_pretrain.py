"""scripts/pretrain_tiny.py: the quick mode end to end, and the shipped tiny_shapes model."""

import json
import math
import os

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from helpers import load_script
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "ddpo_group", "assets", "tiny_shapes")
PROMPT = "a big red circle on a white background"


@pytest.fixture(scope="module")
def script():
    return load_script("scripts/pretrain_tiny.py")


@pytest.fixture(scope="module")
def quick_run(script, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("tiny_quick")
    log = script.main(["--quick", "--output-dir", str(output_dir), "--seed", "3"])
    return output_dir, log


def test_quick_run_writes_a_diffusers_directory_and_a_log(quick_run):
    output_dir, log = quick_run
    for path in ("model_index.json", "unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors", "scheduler/scheduler_config.json", "pretrain_log.json"):
        assert (output_dir / path).is_file(), path
    with open(output_dir / "pretrain_log.json") as f:
        written = json.load(f)
    assert written["seed"] == 3
    assert written["vae"]["steps"] == 3 and written["unet"]["steps"] == 3
    for stage in ("vae", "unet"):
        assert math.isfinite(written[stage]["loss"]) and written[stage]["seconds"] > 0
    assert 0.0 <= written["evaluation"]["shapes_alignment_mean"] <= 1.0
    assert len(written["evaluation"]["per_prompt"]) == 108


def test_quick_run_sets_the_vae_scaling_factor_to_unit_latent_std(quick_run):
    output_dir, log = quick_run
    with open(output_dir / "vae" / "config.json") as f:
        config = json.load(f)
    assert config["scaling_factor"] == pytest.approx(log["scaling_factor"])
    assert config["scaling_factor"] != pytest.approx(0.18215)


def test_quick_run_loads_offline_and_generates_a_32x32_image(quick_run):
    output_dir, _ = quick_run
    pipeline = StableDiffusionPipeline.from_pretrained(str(output_dir), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(PROMPT, num_inference_steps=2, guidance_scale=5.0, output_type="np",
                     generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 32, 32, 3)
    assert np.isfinite(image).all()


def test_same_seed_gives_the_same_weights(script, quick_run, tmp_path):
    output_dir, _ = quick_run
    script.main(["--quick", "--output-dir", str(tmp_path), "--seed", "3", "--eval-steps", "0"])
    first = load_file(str(output_dir / "unet" / "diffusion_pytorch_model.safetensors"))
    second = load_file(str(tmp_path / "unet" / "diffusion_pytorch_model.safetensors"))
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=0)


def test_learning_rate_warms_up_then_decays_to_a_tenth(script):
    factor = script.lr_lambda(warmup_steps=4, total_steps=14)
    assert factor(0) == pytest.approx(1 / 4)
    assert factor(3) == pytest.approx(1.0)
    assert factor(4) == pytest.approx(1.0)  # cosine start
    assert factor(9) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert factor(14) == pytest.approx(0.1)


def test_ema_update_mixes_with_the_warmup_decay(script):
    ema, param = [torch.zeros(2)], [torch.ones(2)]
    script.ema_update(ema, param, decay=0.999, step=0)  # d = min(0.999, 1/10) = 0.1
    torch.testing.assert_close(ema[0], torch.full((2,), 0.9))
    script.ema_update(ema, param, decay=0.5, step=1000)  # d = 0.5
    torch.testing.assert_close(ema[0], torch.full((2,), 0.95))


@pytest.mark.skipif(not os.path.isdir(SHIPPED), reason="ddpo_group/assets/tiny_shapes not built yet")
def test_shipped_tiny_shapes_model_loads_and_generates():
    pipeline = StableDiffusionPipeline.from_pretrained(SHIPPED, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(PROMPT, num_inference_steps=2, guidance_scale=5.0, output_type="np",
                     generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 32, 32, 3)
    with open(os.path.join(SHIPPED, "pretrain_log.json")) as f:
        log = json.load(f)
    assert not log["quick"]
    size = sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(SHIPPED) for name in names)
    assert size < 6 * 2**20
