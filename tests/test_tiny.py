"""The offline tiny pipeline (architecture, tokenizer, save / load) and load_pipeline."""

import time

import pytest
import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

from ddpo_group.diffusion import loading
from ddpo_group.diffusion.loading import load_pipeline
from ddpo_group.diffusion.tiny import TOKENIZER_WORDS, build_tiny_pipeline, tiny_component_configs

SHAPES_WORDS = [
    "red", "green", "blue", "yellow", "magenta", "cyan", "circle", "square", "triangle",
    "white", "black", "gray", "small", "big",
    "a", "an", "the", "on", "of", "in", "with", "background", "photo",
]  # fmt: skip


def num_params(module):
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def pipeline():
    return build_tiny_pipeline(seed=0)


def test_build_is_fast_and_seeded():
    start = time.perf_counter()
    first = build_tiny_pipeline(seed=0)
    assert time.perf_counter() - start < 2.0
    second = build_tiny_pipeline(seed=0)
    other = build_tiny_pipeline(seed=1)
    for name in ("unet", "vae", "text_encoder"):
        a, b, c = (getattr(p, name).state_dict() for p in (first, second, other))
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert not all(torch.equal(a[k], c[k]) for k in a)


def test_build_leaves_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_pipeline(seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_architecture(pipeline):
    assert isinstance(pipeline, StableDiffusionPipeline)
    assert isinstance(pipeline.scheduler, DDIMScheduler)
    assert pipeline.safety_checker is None and pipeline.feature_extractor is None
    assert pipeline.vae_scale_factor == 4
    assert pipeline.unet.config.sample_size * pipeline.vae_scale_factor == 32
    assert pipeline.unet.config.in_channels == pipeline.unet.config.out_channels == 4
    assert pipeline.unet.config.cross_attention_dim == pipeline.text_encoder.config.hidden_size == 32
    assert 0.5e6 < num_params(pipeline.unet) < 1.5e6
    text_config = pipeline.text_encoder.config
    assert (text_config.num_hidden_layers, text_config.num_attention_heads, text_config.intermediate_size) == (2, 2, 64)
    for module in (pipeline.unet, pipeline.vae, pipeline.text_encoder):
        assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters())


def test_vae_maps_32x32_images_to_4x8x8_latents(pipeline):
    with torch.no_grad():
        latents = pipeline.vae.encode(torch.zeros(2, 3, 32, 32)).latent_dist.mean
        images = pipeline.vae.decode(latents).sample
    assert latents.shape == (2, 4, 8, 8)
    assert images.shape == (2, 3, 32, 32)


def test_component_configs_rebuild_the_same_architecture(pipeline):
    configs = tiny_component_configs()
    assert num_params(UNet2DConditionModel(**configs["unet"])) == num_params(pipeline.unet)
    assert num_params(AutoencoderKL(**configs["vae"])) == num_params(pipeline.vae)
    assert configs["text_encoder"]["vocab_size"] == len(pipeline.tokenizer)
    assert DDIMScheduler(**configs["scheduler"]).config == pipeline.scheduler.config


def test_scheduler_is_sd_schedule_and_no_step_has_zero_sigma(pipeline):
    config = pipeline.scheduler.config
    assert (config.beta_start, config.beta_end, config.beta_schedule) == (0.00085, 0.012, "scaled_linear")
    assert (config.num_train_timesteps, config.clip_sample, config.set_alpha_to_one, config.steps_offset) == (
        1000, False, False, 1,
    )  # fmt: skip
    scheduler = DDIMScheduler.from_config(config)
    a = scheduler.alphas_cumprod.tolist()
    for num_steps in (1, 4, 10, 50):
        scheduler.set_timesteps(num_steps)
        for t in scheduler.timesteps.tolist():
            t_prev = t - 1000 // num_steps
            a_prev = a[t_prev] if t_prev >= 0 else a[0]
            assert (1 - a_prev) / (1 - a[t]) * (1 - a[t] / a_prev) > 0


def test_every_word_is_one_token_and_shapes_words_are_included(pipeline):
    tokenizer = pipeline.tokenizer
    assert set(SHAPES_WORDS) <= set(TOKENIZER_WORDS)
    assert len(TOKENIZER_WORDS) >= len(SHAPES_WORDS) + 30
    for word in TOKENIZER_WORDS:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        assert tokenizer.convert_ids_to_tokens(ids) == [word + "</w>"]


def test_any_text_tokenizes_with_bos_eos_padding_to_16(pipeline):
    tokenizer = pipeline.tokenizer
    assert tokenizer.model_max_length == 16
    ids = tokenizer("A red circle on a white background", padding="max_length", max_length=16).input_ids
    expected_words = ["a", "red", "circle", "on", "a", "white", "background"]
    expected = [tokenizer.bos_token_id] + tokenizer.convert_tokens_to_ids([w + "</w>" for w in expected_words])
    assert ids == expected + [tokenizer.eos_token_id] + [tokenizer.pad_token_id] * (16 - 9)
    odd = "Zürich 42 & émoji"
    odd_ids = tokenizer(odd, add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in odd_ids
    assert tokenizer.decode(odd_ids) == "zürich 4 2 & émoji"
    config = pipeline.text_encoder.config
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
    )  # fmt: skip
    assert config.vocab_size == len(tokenizer)


def test_pipeline_generates_32x32_images(pipeline):
    images = pipeline(
        ["a red circle", "a cat"], num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt"
    ).images
    assert images.shape == (2, 3, 32, 32)
    assert images.min() >= 0 and images.max() <= 1


def test_save_pretrained_round_trip(pipeline, tmp_path):
    pipeline.save_pretrained(tmp_path)
    loaded = StableDiffusionPipeline.from_pretrained(tmp_path, local_files_only=True)
    text = "a big magenta triangle on a gray background, Zürich"
    assert loaded.tokenizer(text).input_ids == pipeline.tokenizer(text).input_ids
    assert loaded.tokenizer.model_max_length == 16
    for name in ("unet", "vae", "text_encoder"):
        a, b = getattr(pipeline, name).state_dict(), getattr(loaded, name).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    public = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}
    assert public(loaded.scheduler.config) == public(pipeline.scheduler.config)
    assert loaded.safety_checker is None


def test_load_pipeline_tiny_is_the_tiny_pipeline():
    loaded = load_pipeline("tiny")
    built = build_tiny_pipeline()
    assert isinstance(loaded.scheduler, DDIMScheduler)
    assert loaded.safety_checker is None
    a, b = loaded.unet.state_dict(), built.unet.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert load_pipeline("tiny", torch_dtype=torch.float64).unet.dtype == torch.float64


def test_load_pipeline_local_directory(pipeline, tmp_path):
    pipeline.save_pretrained(tmp_path)
    loaded = load_pipeline(str(tmp_path))
    assert isinstance(loaded.scheduler, DDIMScheduler)
    a, b = loaded.unet.state_dict(), pipeline.unet.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_load_pipeline_tiny_shapes_missing_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "TINY_SHAPES_DIR", tmp_path / "tiny_shapes")
    with pytest.raises(ValueError, match=r"tiny-shapes.*python scripts/pretrain_tiny\.py"):
        load_pipeline("tiny-shapes")


def test_load_pipeline_tiny_shapes_loads_the_shipped_directory(pipeline, tmp_path, monkeypatch):
    pipeline.save_pretrained(tmp_path / "tiny_shapes")
    monkeypatch.setattr(loading, "TINY_SHAPES_DIR", tmp_path / "tiny_shapes")
    loaded = load_pipeline("tiny-shapes")
    assert torch.equal(loaded.unet.conv_in.weight, pipeline.unet.conv_in.weight)


@pytest.mark.parametrize("model", ["/nonexistent/model/dir", "./missing_dir"])
def test_load_pipeline_missing_directory_names_model_and_offline_config(model):
    with pytest.raises(ValueError, match="config/grpo.py:tiny") as info:
        load_pipeline(model)
    assert model in str(info.value)


@pytest.mark.parametrize("local_files_only", [None, True])
def test_load_pipeline_unreachable_hub_id_names_model_and_offline_config(local_files_only):
    # The tests run with HF_HUB_OFFLINE=1 (conftest): the hub cannot be reached.
    with pytest.raises(ValueError, match="config/grpo.py:tiny") as info:
        load_pipeline("nobody/no-such-model", local_files_only=local_files_only)
    assert "nobody/no-such-model" in str(info.value)


@pytest.mark.parametrize("builder", ["build_tiny_sd3_pipeline", "build_tiny_flux_pipeline"])
def test_tiny_flow_pipelines_are_seeded_offline_and_leave_the_rng_alone(builder, tmp_path):
    from ddpo_group.diffusion import tiny

    build = getattr(tiny, builder)
    state = torch.random.get_rng_state()
    a, b, c = build(seed=0), build(seed=0), build(seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    wa, wb, wc = (dict(p.transformer.named_parameters()) for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    images = a(["a red circle"], num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()
