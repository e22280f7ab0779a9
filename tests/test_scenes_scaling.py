"""Issue 53's base pretraining: model sizes, a data set rendered by several processes, the denoiser's step count
from a time budget, and the scaling table's benchmark (docs/scenes.md, "A base that draws the world")."""

import json
import os

import numpy as np
import pytest

from helpers import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "ddpo_group", "assets")


def test_a_data_set_rendered_by_two_processes_is_the_one_rendered_by_one():
    from ddpo_group.data.scenes import DATASET_CHUNK, sample_dataset

    n = DATASET_CHUNK + 7  # two chunks, the second short
    one_images, one_prompts = sample_dataset(n, seed=5)
    two_images, two_prompts = sample_dataset(n, seed=5, workers=2)
    assert one_images.shape == (n, 64, 64, 3)
    assert np.array_equal(one_images, two_images) and one_prompts == two_prompts
    assert not np.array_equal(one_images[:8], sample_dataset(8, seed=6)[0])


def test_size_s_is_the_shipped_flow_models_architecture_and_the_shipped_unet_is_size_m():
    from ddpo_group.diffusion.tiny import SCENES_SIZES, scenes_component_configs

    with open(os.path.join(ASSETS, "tiny_scenes_sd3", "transformer", "config.json")) as f:
        shipped_transformer = json.load(f)
    small = scenes_component_configs(100, "s")["transformer"]
    for key in ("num_layers", "num_attention_heads", "attention_head_dim", "caption_projection_dim", "patch_size"):
        assert shipped_transformer[key] == small[key], key
    with open(os.path.join(ASSETS, "tiny_scenes", "unet", "config.json")) as f:
        shipped_unet = json.load(f)
    assert tuple(shipped_unet["block_out_channels"]) == SCENES_SIZES["m"]["sd"] == (48, 96, 96)
    medium = scenes_component_configs(100, "m")["transformer"]
    assert (medium["num_layers"], medium["num_attention_heads"], medium["attention_head_dim"]) == (8, 4, 32)
    with pytest.raises(ValueError, match="size='xl'"):
        scenes_component_configs(100, "xl")


def test_a_step_count_set_inside_the_warmup_gives_the_schedule_of_that_count_from_the_start():
    """--denoiser-minutes sets the total at step 50, inside a warm-up of >= 50 steps whose factors do not depend on it:
    the learning rates are those of --unet-steps TOTAL from the start."""
    from ddpo_group.cli.pretrain import lr_lambda

    holder = [10]
    later = lr_lambda(300, holder)
    early = [later(step) for step in range(50)]
    holder[0] = 2969
    fixed = lr_lambda(300, 2969)
    assert early + [later(step) for step in range(50, 2969)] == [fixed(step) for step in range(2969)]
    # by hand: the warm-up's last step is 1, the last step 0.1 + 0.9 * 0.5 * (1 + cos(pi * 2668 / 2669))
    assert fixed(299) == 1.0
    assert fixed(2968) == pytest.approx(0.1 + 0.45 * (1 + np.cos(np.pi * 2668 / 2669)))


def test_denoiser_minutes_needs_a_warmup_that_holds_its_timing(capsys):
    from ddpo_group.cli.pretrain import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--world", "scenes", "--denoiser-minutes", "1", "--warmup-steps", "10", "--output-dir", "/tmp/x"])
    assert "--denoiser-minutes" in capsys.readouterr().err


def test_the_scaling_benchmark_refuses_a_folder_it_did_not_make_and_tabulates_finished_runs(tmp_path, capsys):
    scaling = load_script("benchmarks/scenes_scaling.py")
    (tmp_path / "mine.txt").write_text("mine")
    with pytest.raises(SystemExit, match="did not make"):
        scaling.check_out(str(tmp_path))
    assert (tmp_path / "mine.txt").read_text() == "mine"
    out = tmp_path / "out"
    (out / "sd_m").mkdir(parents=True)
    tags = {"single_object": 1.0, "two_object": 0.5, "counting": 0.0, "colors": 0.5, "position": 0.0, "color_attr": 0.0}
    log = {"arch": "sd", "size": "m", "denoiser_parameters": 3_698_068, "device": "cuda",
           "denoiser": {"steps": 2969, "batch_size": 512, "seconds": 287.6},
           "denoiser_loss": {"train_scenes": 0.2037, "fresh_scenes": 0.2031},
           "evaluation": {"overall": 2.0 / 6, "tags": tags}}
    (out / "sd_m" / "pretrain_log.json").write_text(json.dumps(log))
    rows = scaling.collect(str(out))
    assert rows == [{"arch": "sd", "size": "m", "parameters": 3_698_068, "steps": 2969, "batch_size": 512,
                     "denoiser_seconds": 287.6, "device": "cuda", "loss_train_scenes": 0.2037,
                     "loss_fresh_scenes": 0.2031, "overall": 2.0 / 6, **tags}]
    assert "| sd | m | 3.70 | 2969 | 287.6 | 0.2037 | 0.2031 | 0.333 | 1.000 |" in capsys.readouterr().out
    assert json.loads((out / "scaling.json").read_text())["rows"] == rows


def test_patch_1_gives_the_transformer_16x16_tokens_of_the_same_latents():
    """--patch 1: one token per latent pixel (256 on 4x16x16 latents) against patch 2's 64, the same weights'
    shapes apart from the patch embedding and the output projection, and latents of the same shape out."""
    import torch
    from diffusers import SD3Transformer2DModel
    from ddpo_group.diffusion.tiny import scenes_component_configs

    one, two = (scenes_component_configs(100, "s", patch)["transformer"] for patch in (1, 2))
    assert (one["patch_size"], two["patch_size"]) == (1, 2)
    assert {k: v for k, v in one.items() if k != "patch_size"} == {k: v for k, v in two.items() if k != "patch_size"}
    model = SD3Transformer2DModel(**one).eval()
    tokens = model.pos_embed(torch.zeros(1, 4, 16, 16))
    assert tokens.shape[1] == 16 * 16
    with torch.no_grad():
        out = model(torch.randn(2, 4, 16, 16), encoder_hidden_states=torch.randn(2, 32, 64),
                    pooled_projections=torch.randn(2, 64), timestep=torch.tensor([500.0, 10.0])).sample
    assert out.shape == (2, 4, 16, 16)
    with pytest.raises(ValueError, match="patch=3"):
        scenes_component_configs(100, "s", 3)


def test_patch_is_the_transformers_and_refused_for_the_unet(capsys):
    pretrain = load_script("scripts/pretrain_tiny.py")
    assert pretrain.parse_args(["--world", "scenes", "--arch", "sd3", "--patch", "1"]).patch == 1
    with pytest.raises(SystemExit):
        pretrain.parse_args(["--world", "scenes", "--arch", "sd", "--patch", "1"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--patch" in error and "--arch sd" in error


def test_adaln_zero_starts_every_block_as_the_identity_and_predicts_zero():
    """--init adaln-zero (DiT's initialisation): with every modulation and the output layer at zero, each joint
    block returns its input unchanged and the model's prediction is exactly zero, whatever the latents, text and
    time; PyTorch's default initialisation (the shipped model's) predicts something else. The other weights are
    the default ones, drawn from the same seed."""
    import torch
    from ddpo_group.data.scenes import SCENE_WORDS
    from ddpo_group.diffusion.tiny import build_tiny_scenes_pipeline

    zero = build_tiny_scenes_pipeline(SCENE_WORDS, "sd3", seed=3, init="adaln-zero").transformer
    default = build_tiny_scenes_pipeline(SCENE_WORDS, "sd3", seed=3).transformer
    latents, text = torch.randn(2, 4, 16, 16), torch.randn(2, 32, 64)
    pooled, time = torch.randn(2, 64), torch.tensor([900.0, 20.0])
    with torch.no_grad():
        out = zero(latents, encoder_hidden_states=text, pooled_projections=pooled, timestep=time).sample
        other = default(latents, encoder_hidden_states=text, pooled_projections=pooled, timestep=time).sample
        hidden = zero.pos_embed(latents)
        context = zero.context_embedder(text)
        temb = zero.time_text_embed(time, pooled)
        new_context, new_hidden = zero.transformer_blocks[0](hidden_states=hidden, encoder_hidden_states=context,
                                                             temb=temb)
    assert out.shape == latents.shape and torch.count_nonzero(out) == 0
    assert other.abs().max() > 0.01
    assert torch.equal(new_hidden, hidden) and torch.equal(new_context, context)
    kept = {name: p for name, p in default.named_parameters() if ".norm1" not in name and "norm_out" not in name
            and "proj_out" not in name}
    assert all(torch.equal(p, dict(zero.named_parameters())[name]) for name, p in kept.items())
    with pytest.raises(ValueError, match="init='adaln-zero'"):
        build_tiny_scenes_pipeline(SCENE_WORDS, "sd", init="adaln-zero")


def test_init_is_the_transformers_and_refused_for_the_unet(capsys):
    pretrain = load_script("scripts/pretrain_tiny.py")
    assert pretrain.parse_args(["--world", "scenes", "--arch", "sd3", "--init", "adaln-zero"]).init == "adaln-zero"
    assert pretrain.parse_args(["--world", "scenes", "--arch", "sd3"]).init == "default"
    with pytest.raises(SystemExit):
        pretrain.parse_args(["--world", "scenes", "--arch", "sd", "--init", "adaln-zero"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--init" in error and "--arch sd" in error
