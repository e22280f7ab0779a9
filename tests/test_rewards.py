"""Rewards: built-ins against independent computations, plugin loading, combination, errors."""

import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from helpers import pil_jpeg_kb, tiny_clip_model

from ddpo_group.rewards import (
    AsyncRewardRunner,
    CombinedReward,
    RewardError,
    RewardNotReadyError,
    build_reward_fn,
    get_reward,
    list_rewards,
    register_reward,
    resolve_reward,
)
from ddpo_group.rewards.aesthetic import AestheticReward
from ddpo_group.rewards.clip_models import CLIP_MEAN, CLIP_STD, clip_preprocess

PROMPTS = ["a cat", "a dog", "a fox"]

def quantized_images(batch=3, size=32, seed=0):
    """Images whose values are exact multiples of 1/255, and the uint8 arrays they come from."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(batch, size, size, 3), dtype=np.uint8)
    # smooth half of each image so that JPEG sizes differ between images
    pixels[:, : size // 2] = pixels[:, : size // 2].mean(axis=(1, 2), keepdims=True).astype(np.uint8)
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).double() / 255
    return images, pixels

def test_jpeg_incompressibility_is_jpeg_size_in_kb():
    images, pixels = quantized_images()
    rewards, info = get_reward("jpeg_incompressibility")(images, PROMPTS, [{}] * 3)
    np.testing.assert_array_equal(rewards, pil_jpeg_kb(pixels))
    assert info == {}

def test_jpeg_compressibility_is_negated_jpeg_size():
    images, pixels = quantized_images(seed=1)
    rewards, _ = get_reward("jpeg_compressibility")(images, PROMPTS, [{}] * 3)
    np.testing.assert_array_equal(rewards, -pil_jpeg_kb(pixels))

def tiny_clip(seed=0):
    return tiny_clip_model(seed)

@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_clip")
    tiny_clip().save_pretrained(path)
    return path

def random_mlp_state(input_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dims = [(input_dim, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)]
    state = {}
    for index, (n_in, n_out) in zip([0, 2, 4, 6, 7], dims):
        state[f"layers.{index}.weight"] = torch.randn(n_out, n_in, generator=gen) / n_in**0.5
        state[f"layers.{index}.bias"] = torch.randn(n_out, generator=gen) * 0.1
    return state

def expected_aesthetic(clip, state, images):
    """Normalize by hand, CLIP vision tower + projection, L2-normalize, 5 affine maps."""
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    pixel_values = (images.float() - mean) / std
    with torch.no_grad():
        pooled = clip.vision_model(pixel_values=pixel_values).pooler_output
        embeds = clip.visual_projection(pooled)
    x = embeds / embeds.norm(dim=-1, keepdim=True)
    for index in [0, 2, 4, 6, 7]:
        x = x @ state[f"layers.{index}.weight"].T + state[f"layers.{index}.bias"]
    return x[:, 0].numpy()

def test_aesthetic_matches_clip_plus_mlp_from_safetensors(clip_dir, tmp_path):
    from safetensors.torch import save_file
    from transformers import CLIPModel

    state = random_mlp_state(16)
    save_file(state, str(tmp_path / "mlp.safetensors"))
    reward = get_reward("aesthetic", clip_model=str(clip_dir), mlp_weights=str(tmp_path / "mlp.safetensors"))
    images, _ = quantized_images()
    rewards, info = reward(images, PROMPTS, [{}] * 3)
    expected = expected_aesthetic(CLIPModel.from_pretrained(clip_dir).eval(), state, images)
    np.testing.assert_allclose(np.asarray(rewards), expected, rtol=1e-5, atol=1e-5)
    assert info == {}

def test_aesthetic_loads_torch_pth_weights(clip_dir, tmp_path):
    from transformers import CLIPModel

    state = random_mlp_state(16, seed=3)
    torch.save(state, tmp_path / "mlp.pth")
    reward = AestheticReward(clip_model=str(clip_dir), mlp_weights=str(tmp_path / "mlp.pth"))
    images, _ = quantized_images(batch=2, seed=4)
    rewards, _ = reward(images, PROMPTS[:2], [{}] * 2)
    expected = expected_aesthetic(CLIPModel.from_pretrained(clip_dir).eval(), state, images)
    np.testing.assert_allclose(np.asarray(rewards), expected, rtol=1e-5, atol=1e-5)

def test_aesthetic_missing_weights_fails_in_check_ready_with_the_field_to_set(clip_dir, tmp_path):
    reward = build_reward_fn("aesthetic", reward_kwargs={"aesthetic": {
        "clip_model": str(clip_dir), "mlp_weights": str(tmp_path / "missing.pth")}})
    with pytest.raises(RewardNotReadyError, match="mlp_weights=") as error:
        reward.check_ready()
    assert "missing.pth" in str(error.value)

def test_aesthetic_missing_clip_model_names_download_command(tmp_path):
    from safetensors.torch import save_file

    save_file(random_mlp_state(16), str(tmp_path / "mlp.safetensors"))
    reward = AestheticReward(clip_model=str(tmp_path / "no_clip_here"), mlp_weights=str(tmp_path / "mlp.safetensors"))
    with pytest.raises(RewardNotReadyError, match="huggingface-cli download") as error:
        reward.check_ready()
    assert "clip_model=" in str(error.value)

def test_clip_preprocess_resizes_shortest_side_crops_and_normalizes():
    color = torch.tensor([0.2, 0.5, 0.9]).view(1, 3, 1, 1)
    images = color.expand(2, 3, 48, 64).clone()  # constant: resizing keeps the value
    pixel_values = clip_preprocess(images, 32)
    assert pixel_values.shape == (2, 3, 32, 32)
    for c in range(3):
        expected = (color[0, c, 0, 0].item() - CLIP_MEAN[c]) / CLIP_STD[c]
        torch.testing.assert_close(pixel_values[:, c], torch.full((2, 32, 32), expected), rtol=1e-5, atol=1e-5)

def test_clip_score_is_cosine_of_image_and_text_embeddings():
    from ddpo_group.diffusion.tiny import build_tiny_tokenizer

    clip, tokenizer = tiny_clip(seed=1), build_tiny_tokenizer()
    reward = get_reward("clip_score", clip_model=clip, tokenizer=tokenizer)
    images, _ = quantized_images(seed=5)
    rewards, _ = reward(images, PROMPTS, [{}] * 3)
    tokens = tokenizer(PROMPTS, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    mean, std = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        image = clip.visual_projection(clip.vision_model(pixel_values=(images.float() - mean) / std).pooler_output)
        text = clip.text_projection(clip.text_model(**tokens).pooler_output)
    expected = torch.nn.functional.cosine_similarity(image, text, dim=-1).numpy()
    np.testing.assert_allclose(np.asarray(rewards), expected, rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize("name, module, pip_command", [
    ("imagereward", "ImageReward", "pip install image-reward"),
    ("hpsv2", "hpsv2", "pip install hpsv2"),
])
def test_missing_optional_package_fails_at_check_ready_with_pip_command(monkeypatch, name, module, pip_command):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    reward = build_reward_fn(name)  # building imports nothing heavy
    with pytest.raises(RewardNotReadyError) as error:
        reward.check_ready()
    assert pip_command in str(error.value)
    assert error.value.reward == name

def test_pickscore_missing_weights_names_download_command_and_field():
    reward = build_reward_fn("pickscore", reward_kwargs={"pickscore": {"tokenizer": "/nonexistent/tokenizer"}})
    with pytest.raises(RewardNotReadyError, match="tokenizer=") as error:
        reward.check_ready()
    assert "huggingface-cli download /nonexistent/tokenizer" in str(error.value)

def mean_brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3)), {}

def test_register_reward_makes_a_name_usable_as_reward_fn():
    register_reward("test_mean_brightness")(mean_brightness)
    images = torch.stack([torch.full((3, 4, 4), v) for v in (0.1, 0.5, 0.9)])
    total, components, _ = build_reward_fn("test_mean_brightness")(images, PROMPTS, None)
    np.testing.assert_allclose(total, [0.1, 0.5, 0.9], rtol=1e-6)
    assert list(components) == ["test_mean_brightness"]
    assert "test_mean_brightness" in list_rewards()

def test_register_reward_refuses_a_taken_name_for_another_function():
    with pytest.raises(ValueError, match="already taken"):
        register_reward("jpeg_compressibility")(mean_brightness)

def test_unknown_reward_name_lists_registered_rewards():
    with pytest.raises(ValueError, match="jpeg_compressibility"):
        build_reward_fn("no_such_reward")

def test_plugin_from_file_path(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent("""
        def red_fraction(images, prompts, metadata):
            return images[:, 0].mean(dim=(1, 2)), {"n": len(prompts)}
    """))
    images = torch.zeros(2, 3, 4, 4)
    images[0, 0] = 1.0
    images[1, 0, :2] = 1.0
    reward = build_reward_fn(f"{path}:red_fraction")
    total, components, info = reward(images, PROMPTS[:2], None)
    np.testing.assert_allclose(total, [1.0, 0.5])
    assert reward.names == ["red_fraction"]
    assert info == {"red_fraction/n": 2}

def test_plugin_from_module_path_with_class_and_kwargs(tmp_path, monkeypatch):
    package = tmp_path / "my_reward_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text(textwrap.dedent("""
        class Constant:
            def __init__(self, value=0.0):
                self.value = value

            def __call__(self, images, prompts, metadata):
                return [self.value] * len(prompts), {}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = build_reward_fn("my_reward_pkg.scores:Constant", reward_kwargs={"my_reward_pkg.scores:Constant": {"value": 2.5}})
    total, components, _ = reward(torch.zeros(3, 3, 4, 4), PROMPTS, None)
    np.testing.assert_array_equal(total, [2.5, 2.5, 2.5])
    assert list(components) == ["Constant"]

def test_plugin_from_entry_point(tmp_path, monkeypatch):
    (tmp_path / "ep_reward_mod.py").write_text(textwrap.dedent("""
        def prompt_length(images, prompts, metadata):
            return [float(len(p)) for p in prompts], {}
    """))
    dist_info = tmp_path / "ep_reward_dist-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-reward-dist\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[ddpo_group.rewards]\nprompt_length = ep_reward_mod:prompt_length\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "prompt_length" in list_rewards()
    total, _, _ = build_reward_fn("prompt_length")(torch.zeros(3, 3, 4, 4), ["a", "bb", "cccc"], None)
    np.testing.assert_array_equal(total, [1.0, 2.0, 4.0])

def test_shapes_rewards_resolve_lazily_by_name():
    fn = resolve_reward("shapes_color")
    assert fn.__module__ == "ddpo_group.rewards.shapes"

def test_weighted_combination_logs_each_component():
    images, pixels = quantized_images()
    register_reward("test_mean_brightness")(mean_brightness)
    reward = build_reward_fn(None, reward_weights={"test_mean_brightness": 1.0, "jpeg_compressibility": 0.1})
    total, components, _ = reward(images, PROMPTS, [{}] * 3)
    brightness = pixels.reshape(3, -1).astype(np.float64).mean(axis=1) / 255
    jpeg = -pil_jpeg_kb(pixels)
    np.testing.assert_allclose(components["test_mean_brightness"], brightness, rtol=1e-12)
    np.testing.assert_array_equal(components["jpeg_compressibility"], jpeg)
    np.testing.assert_allclose(total, 1.0 * brightness + 0.1 * jpeg, rtol=1e-12)
    assert total.dtype == np.float64 and reward.weights == {"test_mean_brightness": 1.0, "jpeg_compressibility": 0.1}

def test_reward_weights_replace_reward_fn_and_accept_a_config_dict():
    import ml_collections

    weights = ml_collections.ConfigDict({"jpeg_incompressibility": 2.0})
    reward = build_reward_fn("jpeg_compressibility", reward_weights=weights)
    assert reward.names == ["jpeg_incompressibility"]
    images, pixels = quantized_images(batch=2)
    total, _, _ = reward(images, PROMPTS[:2], None)
    np.testing.assert_array_equal(total, 2.0 * pil_jpeg_kb(pixels))

def test_chunks_and_worker_threads_give_the_same_rewards():
    images, pixels = quantized_images(batch=5, seed=7)
    prompts = [f"p{i}" for i in range(5)]
    reward = build_reward_fn(None, reward_weights={"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5},
                             reward_workers=3, reward_batch_size=2)
    total, components, _ = reward(images, prompts, None)
    reward.close()
    np.testing.assert_array_equal(components["jpeg_incompressibility"], pil_jpeg_kb(pixels))
    np.testing.assert_allclose(total, -0.5 * pil_jpeg_kb(pixels), rtol=1e-12)

def test_reward_aggregation_must_be_known():
    assert build_reward_fn("jpeg_compressibility", reward_aggregation="normalize_then_sum").aggregation == "normalize_then_sum"
    with pytest.raises(ValueError, match="sum_then_normalize"):
        build_reward_fn("jpeg_compressibility", reward_aggregation="mean")

def test_no_reward_given_is_an_error():
    with pytest.raises(ValueError, match="reward_fn"):
        build_reward_fn(None, reward_weights=None)

def combined(fn, name="bad"):
    return CombinedReward({name: fn})

def test_nan_reward_names_reward_prompt_and_index():
    reward = combined(lambda images, prompts, metadata: (np.array([1.0, np.nan, 2.0]), {}))
    with pytest.raises(RewardError, match=r"reward 'bad' returned nan for sample 1 \(prompt 'a dog'\)") as error:
        reward(torch.zeros(3, 3, 4, 4), PROMPTS, None)
    assert (error.value.reward, error.value.index, error.value.prompt) == ("bad", 1, "a dog")
    assert isinstance(error.value, RuntimeError)

def test_inf_reward_in_second_chunk_reports_the_batch_index():
    def fn(images, prompts, metadata):
        return [np.inf if p == "a fox" else 0.0 for p in prompts], {}

    reward = CombinedReward({"bad": fn}, batch_size=2)
    with pytest.raises(RewardError, match=r"sample 2 \(prompt 'a fox'\)"):
        reward(torch.zeros(3, 3, 4, 4), PROMPTS, None)

def test_wrong_shape_names_reward_shape_and_prompts():
    reward = combined(lambda images, prompts, metadata: (np.zeros((3, 1)), {}))
    with pytest.raises(RewardError, match=r"reward 'bad' returned shape \(3, 1\) .* expected \(3,\)") as error:
        reward(torch.zeros(3, 3, 4, 4), PROMPTS, None)
    assert "'a cat'" in str(error.value)

def test_exception_inside_reward_names_the_failing_sample():
    def fn(images, prompts, metadata):
        if any(m.get("broken") for m in metadata):
            raise KeyError("ground_truth")
        return [0.0] * len(prompts), {}

    metadata = [{}, {}, {"broken": True}]
    with pytest.raises(RewardError, match=r"reward 'bad' raised KeyError: 'ground_truth' on sample 2 \(prompt 'a fox'\)") as error:
        combined(fn)(torch.zeros(3, 3, 4, 4), PROMPTS, metadata)
    assert isinstance(error.value.__cause__, KeyError)

def test_reward_not_returning_a_tuple_is_an_error():
    with pytest.raises(RewardError, match="tuple"):
        combined(lambda images, prompts, metadata: np.zeros(3))(torch.zeros(3, 3, 4, 4), PROMPTS, None)

def test_mismatched_prompts_and_images_is_a_value_error():
    with pytest.raises(ValueError, match="3 images, 2 prompts"):
        build_reward_fn("jpeg_compressibility")(torch.zeros(3, 3, 4, 4), PROMPTS[:2], None)

def test_async_runner_returns_a_future_of_the_reward():
    images, pixels = quantized_images(batch=2)
    reward = build_reward_fn("jpeg_incompressibility")
    with AsyncRewardRunner(reward, workers=1) as runner:
        future = runner.submit(images, PROMPTS[:2], [{}, {}])
        total, components, _ = future.result(timeout=30)
    np.testing.assert_array_equal(total, pil_jpeg_kb(pixels))

def test_async_runner_scores_batches_concurrently_with_two_workers():
    barrier = threading.Barrier(2, timeout=10)

    def waits_for_the_other_batch(images, prompts, metadata):
        barrier.wait()  # only returns when both batches are being scored at the same time
        return np.ones(len(prompts)), {}

    with AsyncRewardRunner(CombinedReward({"w": waits_for_the_other_batch}), workers=2) as runner:
        futures = [runner.submit(torch.zeros(1, 3, 4, 4), ["a"], None) for _ in range(2)]
        results = [future.result(timeout=20) for future in futures]
    assert all(r[0].tolist() == [1.0] for r in results)
