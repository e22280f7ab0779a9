"""The text-embedding cache (config.sample.text_embedding_cache, ddpo_group/diffusion/text_cache.py) on tiny real
models: what it serves equals the uncached encoding bit for bit, the LRU bound, and the cases it must not serve."""

import pytest
import torch

from ddpo_group.diffusion.flux import FluxKontextPolicy
from ddpo_group.diffusion.qwen_image import QwenImagePolicy
from ddpo_group.diffusion.sd import StableDiffusionPolicy, StableDiffusionXLPolicy
from ddpo_group.diffusion.sd3 import StableDiffusion3Policy
from ddpo_group.diffusion.text_cache import TextEmbeddingCache
from ddpo_group.diffusion.tiny import build_tiny_pipeline, build_tiny_sdxl_pipeline

CPU = torch.device("cpu")
PROMPTS = ["a red circle", "two blue squares", "a green triangle", "a cat"]


def frozen(policy):
    """The policy's text encoders frozen, as ``prepare`` leaves them (a fresh module's parameters require grad, and
    the cache never serves a text encoder that may be training)."""
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if getattr(policy.pipeline, name, None) is not None:
            getattr(policy.pipeline, name).requires_grad_(False)
    return policy


@pytest.fixture(scope="module")
def sd3():
    return frozen(StableDiffusion3Policy(StableDiffusion3Policy.load("tiny-sd3")))


@pytest.fixture(scope="module")
def sd():
    return frozen(StableDiffusionPolicy(build_tiny_pipeline()))


@pytest.fixture(scope="module")
def sdxl():
    return frozen(StableDiffusionXLPolicy(StableDiffusionXLPolicy.load("tiny-sdxl")))


def height(policy):
    return policy.resolution or policy.pipeline.unet.config.sample_size * policy.pipeline.vae_scale_factor


def assert_same(cached, uncached):
    assert cached.keys() == uncached.keys()
    for name, value in uncached.items():
        if value is None:
            assert cached[name] is None, name
        else:
            assert cached[name].dtype == value.dtype and torch.equal(cached[name], value), name


def flow_encode(policy, prompts, guidance=4.5):
    return policy._encode_text(prompts, "", guidance, CPU)


def sd_encode(policy, prompts):
    return policy._encode_text(prompts, "", True, CPU, height(policy))


@pytest.mark.parametrize("family", ["sd3", "sd", "sdxl"])
def test_served_rows_equal_the_uncached_encoding_bit_for_bit(family, request):
    policy = request.getfixturevalue(family)
    policy.configure_text_cache(64)
    policy.text_cache.clear()
    encode = flow_encode if family == "sd3" else sd_encode
    uncached = (lambda p: policy._encode(p, "", 4.5, CPU)) if family == "sd3" else (
        lambda p: policy._encode(p, "", True, CPU, height(policy)))
    first = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    second = [PROMPTS[2], PROMPTS[2], PROMPTS[3], PROMPTS[3]]
    assert_same(encode(policy, first), uncached(first))  # misses: encoded whole, as without the cache
    assert_same(encode(policy, second), uncached(second))
    misses = policy.text_cache.misses
    for batch in ([PROMPTS[1], PROMPTS[3], PROMPTS[0], PROMPTS[2]], [PROMPTS[3]] * 4, first):  # other neighbours
        assert_same(encode(policy, batch), uncached(batch))
    assert policy.text_cache.misses == misses and policy.text_cache.hits == 3  # all three served from the cache
    encode(policy, [PROMPTS[0]])  # another batch size: its own key (the pooled projection's bits depend on B)
    assert policy.text_cache.misses == misses + 1
    policy.configure_text_cache(0)


def test_sampling_with_the_cache_equals_sampling_without(sd3):
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]

    def sample():
        return sd3.sample(prompts, num_steps=2, guidance_scale=4.5, eta=1.0, generator=torch.Generator().manual_seed(0))

    sd3.configure_text_cache(0)
    plain = sample()
    sd3.configure_text_cache(16)
    sample()  # fills the cache
    served = sample()
    assert sd3.text_cache.hits == 1
    for name in ("latents", "log_probs", "images", "prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds"):
        assert torch.equal(getattr(served, name), getattr(plain, name)), name
    sd3.configure_text_cache(0)


def test_lru_bound_and_one_copy_of_the_negative_rows(sd3):
    sd3.configure_text_cache(2)
    sd3.text_cache.clear()
    flow_encode(sd3, PROMPTS[:2])
    rows = list(sd3.text_cache.rows.values())
    assert rows[0]["negative_prompt_embeds"] is rows[1]["negative_prompt_embeds"]  # identical rows stored once
    flow_encode(sd3, PROMPTS[2:])  # two more prompts: the first two are evicted
    assert len(sd3.text_cache.rows) == 2
    assert {key[0] for key in sd3.text_cache.rows} == set(PROMPTS[2:])
    misses = sd3.text_cache.misses
    flow_encode(sd3, PROMPTS[:2])
    assert sd3.text_cache.misses == misses + 1
    sd3.configure_text_cache(0)


def test_key_holds_the_guidance_and_negative_prompt(sd3):
    sd3.configure_text_cache(16)
    sd3.text_cache.clear()
    with_cfg = flow_encode(sd3, PROMPTS[:2], guidance=4.5)
    without = flow_encode(sd3, PROMPTS[:2], guidance=1.0)
    assert "negative_prompt_embeds" in with_cfg and "negative_prompt_embeds" not in without
    negative = sd3._encode_text(PROMPTS[:2], "blurry", 4.5, CPU)
    assert_same(negative, sd3._encode(PROMPTS[:2], "blurry", 4.5, CPU))
    assert sd3.text_cache.misses == 3 and sd3.text_cache.hits == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed precision: other numbers, its own key
        assert_same(flow_encode(sd3, PROMPTS[:2]), sd3._encode(PROMPTS[:2], "", 4.5, CPU))
    assert sd3.text_cache.misses == 4 and sd3.text_cache.hits == 0
    sd3.configure_text_cache(0)


def test_a_trained_text_encoder_is_never_cached(sd):
    sd.configure_text_cache(16)
    sd.text_cache.clear()
    sd.pipeline.text_encoder.requires_grad_(True)
    try:
        sd_encode(sd, PROMPTS[:2])
        sd_encode(sd, PROMPTS[:2])
        assert not sd.text_cache.rows and sd.text_cache.hits == sd.text_cache.misses == 0
    finally:
        sd.pipeline.text_encoder.requires_grad_(False)
        sd.configure_text_cache(0)


def test_families_whose_rows_depend_on_their_neighbours_are_never_cached():
    assert QwenImagePolicy.text_rows_independent is False  # pads to the batch's longest prompt


def test_an_editing_family_caches_its_text_part_only():
    policy = frozen(FluxKontextPolicy(FluxKontextPolicy.load("tiny-flux-kontext")))
    policy.configure_text_cache(16)
    side = policy.resolution
    sources = [torch.rand(2, 3, side, side, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    for source in sources:
        cond = policy._encode_edit(PROMPTS[:2], "", 1.0, CPU, source)
        expected = {**policy._encode(PROMPTS[:2], "", 1.0, CPU), **policy._encode_source(source)}
        assert_same(cond, expected)  # the second call: text from the cache, the new source encoded
    assert policy.text_cache.hits == 1 and all("image_latents" not in row for row in policy.text_cache.rows.values())


def test_a_conditioning_that_is_not_per_row_is_refused():
    cache = TextEmbeddingCache(4)
    with pytest.raises(ValueError, match="sample.text_embedding_cache=0"):
        cache.encode(lambda prompts: {"prompt_embeds": torch.zeros(3)}, ["a", "b"], ())
    with pytest.raises(ValueError, match="text_embedding_cache=-1"):
        TextEmbeddingCache(-1)


def test_config_check_refuses_a_negative_size():
    from ddpo_group.config.check import ConfigError, check_config
    from ddpo_group.config.grpo import get_config

    config = get_config("tiny")
    config.sample.text_embedding_cache = -1
    with pytest.raises(ConfigError, match="sample.text_embedding_cache"):
        check_config(config)
