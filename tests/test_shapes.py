"""The shapes world (ddpo_group/data/shapes.py) and its rewards (ddpo_group/rewards/shapes.py)."""

import math

import numpy as np
import pytest
import torch

from ddpo_group.data import shapes
from ddpo_group.rewards import shapes as shape_rewards
from ddpo_group.rewards.registry import get_reward
from ddpo_group.data.shapes import ShapeSpec, parse_prompt, prompt_from_spec, render, sample_dataset, shapes_prompts


def to_tensor(images_uint8):
    """(N, H, W, 3) uint8 -> (N, 3, H, W) float in [0, 1]."""
    return torch.from_numpy(np.asarray(images_uint8)).permute(0, 3, 1, 2).float() / 255.0


def canvas(background, size=8):
    """A (3, size, size) float image filled with an RGB colour given in [0, 1]."""
    return torch.tensor(background, dtype=torch.float32).view(3, 1, 1).repeat(1, size, size)


def rendered_batch(seed=0):
    """Every prompt once, rendered with position and area jitter."""
    rng = np.random.default_rng(seed)
    specs = shapes.all_specs()
    return to_tensor(np.stack([render(s, rng=rng) for s in specs])), [s.prompt for s in specs]


def swap(prompt, field, value):
    spec = parse_prompt(prompt)
    fields = dict(color=spec.color, shape=spec.shape, background=spec.background, size=spec.size)
    fields[field] = value
    return prompt_from_spec(ShapeSpec(**fields))


# --- the world -------------------------------------------------------------------------


def test_vocabulary_is_the_tokenizer_vocabulary():
    assert list(shapes.COLORS) == ["red", "green", "blue", "yellow", "magenta", "cyan"]
    assert list(shapes.SHAPES) == ["circle", "square", "triangle"]
    assert list(shapes.BACKGROUNDS) == ["white", "black", "gray"]
    assert list(shapes.SIZES) == ["small", "big"]


def test_shapes_prompts_lists_108_distinct_prompts_with_their_fields():
    records = shapes_prompts()
    assert len(records) == 108 == len({r["prompt"] for r in records})
    first = records[0]
    assert set(first) == {"prompt", "color", "shape", "background", "size"}
    assert first["prompt"] == f"a {first['size']} {first['color']} {first['shape']} on a {first['background']} background"


def test_parse_prompt_inverts_prompt_from_spec():
    spec = ShapeSpec(color="cyan", shape="triangle", background="gray", size="big")
    assert prompt_from_spec(spec) == "a big cyan triangle on a gray background"
    assert parse_prompt("a big cyan triangle on a gray background") == spec
    assert parse_prompt("A Big Cyan Triangle on a gray background.") == spec


@pytest.mark.parametrize(
    "prompt", ["a photo of a cat", "a big purple circle on a white background", "a huge red circle on a white background", ""]
)
def test_parse_prompt_rejects_other_prompts(prompt):
    with pytest.raises(ValueError, match="prompt"):
        parse_prompt(prompt)


def test_shape_spec_rejects_unknown_words():
    with pytest.raises(ValueError, match="color"):
        ShapeSpec(color="purple", shape="circle", background="white", size="big")


def test_render_centred_big_square_is_exact():
    # big, no rng: area fraction 0.25 -> 256 px -> side 16 centred at (16, 16): pixels 8..23.
    image = render(ShapeSpec(color="blue", shape="square", background="gray", size="big"))
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    expected = np.zeros((32, 32, 3), dtype=np.uint8)
    expected[:] = (128, 128, 128)
    expected[8:24, 8:24] = (0, 0, 255)
    np.testing.assert_array_equal(image, expected)


def test_render_antialiased_edges_mix_shape_and_background():
    image = render(ShapeSpec(color="red", shape="circle", background="white", size="big")).astype(int)
    # every pixel lies on the segment from white (255,255,255) to red (255,0,0): R = 255, G = B
    assert np.all(image[..., 0] == 255)
    assert np.all(image[..., 1] == image[..., 2])
    assert len(np.unique(image[..., 1])) > 2  # some partial-coverage pixels


@pytest.mark.parametrize("seed", range(5))
def test_render_with_jitter_keeps_the_shape_inside_and_its_area_in_range(seed):
    rng = np.random.default_rng(seed)
    for spec in shapes.all_specs()[::7]:
        image = render(spec, rng=rng).astype(float)
        background = np.array(shapes.BACKGROUNDS[spec.background], dtype=float)
        color = np.array(shapes.COLORS[spec.color], dtype=float)
        ring = np.ones((32, 32), dtype=bool)
        ring[2:30, 2:30] = False
        assert np.all(image[ring] == background), spec
        # coverage recovered from the pixel colours: image = c * color + (1 - c) * background
        axis = int(np.argmax(np.abs(color - background)))
        coverage = (image[..., axis] - background[axis]) / (color[axis] - background[axis])
        low, high = shapes.AREA_FRACTIONS[spec.size]
        assert low - 0.01 <= coverage.sum() / 1024 <= high + 0.01, spec


def test_sample_dataset_is_reproducible_and_matches_prompts():
    images, prompts = sample_dataset(12, seed=3)
    images_again, prompts_again = sample_dataset(12, seed=3)
    assert images.shape == (12, 32, 32, 3) and images.dtype == np.uint8
    np.testing.assert_array_equal(images, images_again)
    assert prompts == prompts_again
    for image, prompt in zip(images, prompts):
        spec = parse_prompt(prompt)
        assert tuple(image[0, 0]) == shapes.BACKGROUNDS[spec.background]
    assert not np.array_equal(images, sample_dataset(12, seed=4)[0])


# --- rewards on hand-built 8x8 images ----------------------------------------------------

WHITE, RED, BLUE = (1.0, 1.0, 1.0), (1.0, 0.0, 0.0), (0.0, 0.0, 1.0)
SMALL_RED = "a small red square on a white background"


def test_color_is_one_for_the_requested_colour_and_zero_for_another():
    image = canvas(WHITE)
    image[:, 3:5, 3:5] = torch.tensor(RED).view(3, 1, 1)  # 4 of 64 px: presence term 1
    rewards, _ = shape_rewards.shapes_color(image[None], [SMALL_RED], [{}])
    assert rewards[0] == pytest.approx(1.0)
    rewards, _ = shape_rewards.shapes_color(image[None], ["a small magenta square on a white background"], [{}])
    # (0,-1,-1) projected on magenta - white = (0,-1,0): a = 1, residual |(0,0,-1)|/sqrt 3 = 0.577 > 0.25
    assert rewards[0] == pytest.approx(0.0)


def test_color_counts_an_antialiased_pixel_as_the_requested_colour():
    image = canvas(WHITE)
    image[:, 3:5, 3:5] = torch.tensor((1.0, 0.5, 0.5)).view(3, 1, 1)  # half red, half white
    rewards, _ = shape_rewards.shapes_color(image[None], [SMALL_RED], [{}])
    assert rewards[0] == pytest.approx(1.0)


def test_color_averages_over_foreground_pixels():
    image = canvas(WHITE)
    image[:, 2, 2:6] = torch.tensor(RED).view(3, 1)
    image[:, 5, 2:6] = torch.tensor(BLUE).view(3, 1)
    # blue: a = <(-1,-1,0),(0,-1,-1)> / 2 = 0.5, residual |(-1,-0.5,0.5)| / sqrt 3 = 0.707 -> match 0
    rewards, _ = shape_rewards.shapes_color(image[None], [SMALL_RED], [{}])
    assert rewards[0] == pytest.approx((4 * 1.0 + 4 * 0.0) / 8)


def test_color_presence_term_scales_a_single_pixel():
    image = canvas(WHITE)
    image[:, 4, 4] = torch.tensor(RED)
    rewards, _ = shape_rewards.shapes_color(image[None], [SMALL_RED], [{}])
    assert rewards[0] == pytest.approx((1 / 64) / 0.02)
    empty, _ = shape_rewards.shapes_color(canvas(WHITE)[None], [SMALL_RED], [{}])
    assert empty[0] == 0.0


@pytest.mark.parametrize(
    "pixels, size, expected",
    [
        (4, "small", 1.0),  # 4/64 = 0.0625 in [0.035, 0.11]
        (4, "big", 0.0),  # ln(0.15 / 0.0625) = 0.875 > ln 1.5
        (16, "big", 1.0),  # 0.25 in [0.15, 0.42]
        (16, "small", 0.0),
        (8, "small", 1 - math.log(0.125 / 0.11) / math.log(1.5)),
        (8, "big", 1 - math.log(0.15 / 0.125) / math.log(1.5)),
    ],
)
def test_area_scores_the_foreground_fraction_against_the_size_range(pixels, size, expected):
    image = canvas(WHITE)
    flat = image.view(3, -1)
    flat[:, :pixels] = torch.tensor(RED).view(3, 1)
    prompt = f"a {size} red square on a white background"
    rewards, info = shape_rewards.shapes_area(image[None], [prompt], [{}])
    assert info["area_fraction"][0] == pytest.approx(pixels / 64)
    assert rewards[0] == pytest.approx(expected)


def test_background_scores_the_border_ring():
    image = canvas(WHITE)
    assert shape_rewards.shapes_background(image[None], [SMALL_RED], [{}])[0][0] == pytest.approx(1.0)
    # gray (128/255) is |white - gray| / sqrt 3 = 0.498 away: match clip(1 - 0.498 / 0.2) = 0
    assert shape_rewards.shapes_background(image[None], ["a small red square on a gray background"], [{}])[0][0] == 0.0
    # ring of 28 px (8x8, 1 px wide); 14 of them at 0.9 gray: distance 0.1 -> match 0.5
    image[:, 0, :] = 0.9
    image[:, 7, 1:7] = 0.9
    expected = (14 * 0.5 + 14 * 1.0) / 28
    assert shape_rewards.shapes_background(image[None], [SMALL_RED], [{}])[0][0] == pytest.approx(expected)


def test_template_iou_of_a_pixel_aligned_square_is_one():
    weight = np.zeros((16, 16))
    weight[4:8, 6:10] = 1.0  # area 16, centroid (8, 6): the square template covers exactly these pixels
    ious = shape_rewards.template_ious(weight)
    assert ious["square"] == pytest.approx(1.0)
    assert ious["circle"] < 0.9 and ious["triangle"] < 0.9


def test_shape_reward_prefers_the_requested_shape():
    spec = ShapeSpec(color="green", shape="circle", background="black", size="big")
    image = to_tensor(render(spec)[None])
    prompts = [swap(spec.prompt, "shape", shape) for shape in shapes.SHAPES]
    rewards, info = shape_rewards.shapes_shape(image.repeat(3, 1, 1, 1), prompts, [{}] * 3)
    np.testing.assert_allclose(rewards, [1.0, 0.0, 0.0])
    assert info["iou_circle"][0] > info["iou_square"][0] > info["iou_triangle"][0]


def test_alignment_is_the_product_of_the_components():
    image = canvas(WHITE)
    image.view(3, -1)[:, :8] = torch.tensor(RED).view(3, 1)
    rewards, components = shape_rewards.shapes_alignment(image[None], [SMALL_RED], [{}])
    product = 1.0
    for name in ("color", "area", "background", "shape"):
        product *= components[name][0]
    assert rewards[0] == pytest.approx(product)
    assert components["area"][0] == pytest.approx(1 - math.log(0.125 / 0.11) / math.log(1.5))


# --- rewards on rendered ground truth -----------------------------------------------------


def test_alignment_is_near_one_for_every_rendered_prompt():
    images, prompts = rendered_batch(seed=0)
    rewards, components = shape_rewards.shapes_alignment(images, prompts, [{}] * len(prompts))
    assert rewards.shape == (108,) and rewards.dtype == np.float64
    assert rewards.min() >= 0.95
    for name, values in components.items():
        assert values.min() >= 0.95, name


@pytest.mark.parametrize(
    "field, values",
    [("color", list(shapes.COLORS)), ("size", list(shapes.SIZES)), ("background", list(shapes.BACKGROUNDS)),
     ("shape", list(shapes.SHAPES))],
)
def test_alignment_is_low_for_a_mismatched_prompt(field, values):
    images, prompts = rendered_batch(seed=1)
    wrong_images, wrong_prompts = [], []
    for image, prompt in zip(images, prompts):
        for value in values:
            if value != getattr(parse_prompt(prompt), field):
                wrong_images.append(image)
                wrong_prompts.append(swap(prompt, field, value))
    rewards, _ = shape_rewards.shapes_alignment(torch.stack(wrong_images), wrong_prompts, [{}] * len(wrong_prompts))
    assert rewards.max() <= 0.15
    assert rewards.mean() <= 0.05


def test_rewards_lie_in_unit_interval_on_noise():
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(6, 3, 32, 32, generator=generator)
    prompts = [r["prompt"] for r in shapes_prompts()[::18]]
    for name in ("shapes_color", "shapes_area", "shapes_background", "shapes_shape", "shapes_alignment"):
        rewards, _ = get_reward(name)(images, prompts, [{}] * 6)
        rewards = np.asarray(rewards)
        assert rewards.shape == (6,) and np.all((rewards >= 0) & (rewards <= 1)), name


def test_rewards_fall_back_to_metadata_fields():
    spec = ShapeSpec(color="yellow", shape="triangle", background="black", size="small")
    image = to_tensor(render(spec)[None])
    metadata = [{"color": "yellow", "shape": "triangle", "background": "black", "size": "small"}]
    from_meta, _ = shape_rewards.shapes_alignment(image, ["a yellow thing"], metadata)
    from_prompt, _ = shape_rewards.shapes_alignment(image, [spec.prompt], [{}])
    assert from_meta[0] == pytest.approx(from_prompt[0]) and from_meta[0] >= 0.95


def test_rewards_reject_unparseable_prompts_and_bad_shapes():
    image = canvas(WHITE)[None]
    with pytest.raises(ValueError, match="not a shapes-world prompt"):
        shape_rewards.shapes_alignment(image, ["a photo of a cat"], [{}])
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        shape_rewards.shapes_color(image[:, :2], [SMALL_RED], [{}])
    with pytest.raises(ValueError, match="prompts"):
        shape_rewards.shapes_color(image.repeat(2, 1, 1, 1), [SMALL_RED], [{}])


def test_rewards_are_registered_by_name():
    for name in ("shapes_color", "shapes_area", "shapes_background", "shapes_shape", "shapes_alignment"):
        assert callable(get_reward(name))
