"""benchmarks/relation_loss.py (docs/scenes.md, "Why position does not learn"): its captions, its loss against one
computed here from the model's parts, and its share on a model blind to the relation word by construction."""

import json

import numpy as np
import pytest
import torch
from helpers import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/relation_loss.py")


@pytest.fixture(scope="module")
def scenes(script):
    from ddpo_group.data.scenes import COARSE_AREA_RANGE

    return script.position_scenes(4, seed=0, area_range=COARSE_AREA_RANGE)


def _pipeline(arch="sd-flow"):
    from ddpo_group.data.scenes import SCENE_WORDS
    from ddpo_group.diffusion.tiny import build_tiny_scenes_pipeline

    return build_tiny_scenes_pipeline(SCENE_WORDS, arch, seed=5, size="s")


def test_the_captions_of_a_position_prompt(script):
    assert script.opposite_prompts("a photo of a star above a cross") == {
        "prompt": "a photo of a star above a cross", "relation_flipped": "a photo of a star below a cross",
        "nouns_swapped": "a photo of a cross above a star", "empty": ""}
    assert script.opposite_prompts("a photo of a ring right of a diamond")["relation_flipped"] == (
        "a photo of a ring left of a diamond")


def test_the_scenes_are_training_position_records_drawn_as_captioned(script, scenes):
    from ddpo_group.data.scenes import training_records

    images, prompts = scenes
    assert images.shape == (4, 64, 64, 3) and images.dtype == np.uint8
    allowed = {r["prompt"] for r in training_records()["position"]}
    assert all(p in allowed for p in prompts)


def test_the_flow_loss_is_the_velocity_error_computed_from_the_parts(script, scenes):
    images, prompts = scenes
    pipeline = _pipeline()
    rows = script.relation_losses(pipeline, images, prompts, levels=(0.5,), seed=0)
    with torch.no_grad():  # x_s = (1 - s) x0 + s eps, target eps - x0, timestep 1000 s, the same noise draw
        pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
        latents = pipeline.vae.encode(pixels).latent_dist.mean
        z0 = (latents - (pipeline.vae.config.shift_factor or 0.0)) * pipeline.vae.config.scaling_factor
        noise = torch.randn(z0.shape, generator=torch.Generator().manual_seed(500))
        ids = pipeline.tokenizer(prompts, padding="max_length", max_length=pipeline.tokenizer.model_max_length,
                                 return_tensors="pt").input_ids
        velocity = pipeline.unet(0.5 * z0 + 0.5 * noise, torch.full((4,), 500.0), pipeline.text_encoder(ids)[0]).sample
        expected = float(((velocity - (noise - z0)) ** 2).mean())
    assert rows[0]["prompt"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("arch", ["sd-flow", "sd3"])
def test_a_denoiser_blind_to_the_relation_word_has_share_zero(script, scenes, arch):
    images, prompts = scenes
    pipeline = _pipeline(arch)
    assert script.arch_of(pipeline) == arch
    token = lambda word: pipeline.tokenizer.convert_tokens_to_ids(pipeline.tokenizer.tokenize(word))[0]  # noqa: E731
    encoders = [pipeline.text_encoder] + ([pipeline.text_encoder_2] if arch == "sd3" else [])
    with torch.no_grad():  # one embedding for the relation words: a flipped caption reads as the caption
        for encoder in encoders:
            embeddings = encoder.get_input_embeddings().weight
            for word in ("below", "left", "right"):
                embeddings[token(word)] = embeddings[token("above")]
    rows = script.relation_losses(pipeline, images, prompts, levels=(0.8, 0.4))
    for row in rows:
        assert row["relation_flipped"] == row["prompt"]
        assert row["nouns_swapped"] != row["prompt"]  # the nouns' order still reaches it
        assert row["relation_share"] in (0.0, None)


def test_a_denoiser_that_reads_the_relation_word_has_a_share(script, scenes):
    images, prompts = scenes
    rows = script.relation_losses(_pipeline(), images, prompts, levels=(0.8,))
    assert rows[0]["relation_flipped"] != rows[0]["prompt"]


def test_the_share_and_its_error_from_the_paired_losses(script, scenes, monkeypatch):
    """Per-scene losses chosen here (a stand-in for the denoiser): the share is the mean paired difference over the
    caption's help, its error the paired differences' standard error over it; no share where the help is < 1 %."""
    import ddpo_group.cli.pretrain as pretrain

    images, prompts = scenes
    per_caption = {"prompt": [1.0, 1.0, 1.0, 1.0], "relation_flipped": [1.1, 1.3, 1.1, 1.3],
                   "nouns_swapped": [1.0, 1.0, 1.0, 1.0], "empty": [2.0, 2.0, 2.0, 2.0]}
    captions = {}

    def fake_loss(pipeline, arch, z0, ids, generator, flow_times="logit-normal", levels=None, per_sample=False):
        caption = captions[tuple(ids[0].tolist())]
        return torch.tensor(per_caption[caption], dtype=torch.float64)[: len(z0)]

    pipeline = _pipeline()
    for variant, text in script.opposite_prompts(prompts[0]).items():
        captions[tuple(pipeline.tokenizer([text], padding="max_length", max_length=pipeline.tokenizer.model_max_length,
                                          return_tensors="pt").input_ids[0].tolist())] = variant
    monkeypatch.setattr(pretrain, "denoiser_loss", fake_loss)
    same = [prompts[0]] * 4
    row = script.relation_losses(pipeline, images, same, levels=(0.5,))[0]
    assert row["relation_share"] == pytest.approx(0.2)  # (1.2 - 1.0) / (2.0 - 1.0)
    assert row["relation_share_stderr"] == pytest.approx(np.std([0.1, 0.3, 0.1, 0.3], ddof=1) / 2)
    per_caption["empty"] = [1.005] * 4  # the caption helps by 0.5 %: no share
    assert script.relation_losses(pipeline, images, same, levels=(0.5,))[0]["relation_share"] is None


def test_the_ddim_unet_is_measured_at_its_timesteps(script, scenes):
    images, prompts = scenes
    pipeline = _pipeline("sd")
    assert script.arch_of(pipeline) == "sd"
    rows = script.relation_losses(pipeline, images, prompts, levels=(0.5,), seed=0)
    with torch.no_grad():  # epsilon prediction at timestep 499 (round(1000 * 0.5) - 1)
        pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
        z0 = pipeline.vae.encode(pixels).latent_dist.mean * pipeline.vae.config.scaling_factor
        noise = torch.randn(z0.shape, generator=torch.Generator().manual_seed(500))
        abar = pipeline.scheduler.alphas_cumprod[499].float()
        ids = pipeline.tokenizer(prompts, padding="max_length", max_length=pipeline.tokenizer.model_max_length,
                                 return_tensors="pt").input_ids
        predicted = pipeline.unet(abar.sqrt() * z0 + (1 - abar).sqrt() * noise, torch.full((4,), 499),
                                  pipeline.text_encoder(ids)[0]).sample
        expected = float(((predicted - noise) ** 2).mean())
    assert rows[0]["prompt"] == pytest.approx(expected, rel=1e-5)


def test_a_bad_output_is_one_line(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--output", "/tmp/relation_loss.txt"])
    assert exit_info.value.code == 2
    assert "--output" in capsys.readouterr().err.strip().splitlines()[-1]


# benchmarks/relation_finetune.py: the experiment that asks whether more position scenes teach the relation word


@pytest.fixture(scope="module")
def finetune_script():
    return load_script("benchmarks/relation_finetune.py")


def test_the_share_gives_a_tag_its_fraction_of_the_draws(finetune_script):
    assert finetune_script.parse_share("position=0.5") == ("position", 0.5)
    from ddpo_group.data.scenes import world_records

    records = world_records()
    prompts = ([r["prompt"] for r in records["position"][:2]]
               + [records[tag][0]["prompt"] for tag in ("counting", "colors", "two_object", "color_attr")])
    weights = finetune_script.scene_weights(prompts, "position", 0.75)
    assert weights.tolist() == pytest.approx([0.375, 0.375, 0.0625, 0.0625, 0.0625, 0.0625])
    assert finetune_script.scene_weights(prompts[:2], "position", 0.75).tolist() == pytest.approx([0.5, 0.5])
    with pytest.raises(finetune_script.BenchmarkError, match="--share"):  # no scene of the tag: refused, not uniform
        finetune_script.scene_weights(prompts[2:], "position", 0.75)


@pytest.mark.parametrize("share", ["position", "shadow=0.5", "position=0", "position=1.5"])
def test_a_bad_share_is_one_line_naming_it(finetune_script, share, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        finetune_script.main(["--share", share, "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "--share" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_folder_with_files_is_refused_before_anything_runs(finetune_script, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        finetune_script.main(["--output-dir", str(tmp_path)])
    assert "--output-dir" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_the_finetune_trains_and_saves_the_average_as_a_pipeline(finetune_script, scenes, tmp_path):
    from diffusers import StableDiffusionPipeline

    images, prompts = scenes
    pipeline = _pipeline()
    before = {k: v.clone() for k, v in pipeline.unet.state_dict().items()}
    rows = finetune_script.finetune(pipeline, images, prompts, "position", 1.0, steps=2, lr=1e-3, save_every=2,
                                    output_dir=str(tmp_path), log=lambda *a: None,
                                    pretrain_log={"object_area": [150.0, 260.0], "arch": "sd-flow"})
    assert [r["step"] for r in rows] == [2]
    # the step folder keeps its base's object areas, which relation_loss.py draws its scenes at
    from ddpo_group.data.scenes import area_range_of_pipeline

    assert area_range_of_pipeline(str(tmp_path / "step_2")) == (150.0, 260.0)
    assert json.loads((tmp_path / "step_2" / "pretrain_log.json").read_text())["relation_finetune"]["step"] == 2
    saved = StableDiffusionPipeline.from_pretrained(str(tmp_path / "step_2"), local_files_only=True)
    # the saved weights are the average: 0.999 of the start plus 0.001 of each step's weights
    changed = [k for k, v in saved.unet.state_dict().items() if not torch.equal(v, before[k])]
    assert changed
    trained = pipeline.unet.state_dict()
    for key in changed[:5]:
        assert (saved.unet.state_dict()[key] - before[key]).abs().max() < (trained[key] - before[key]).abs().max()


def test_a_model_that_does_not_load_is_one_line_naming_it(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--model", str(tmp_path / "no_model"), "--output", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    assert "--model" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out.json").exists()
