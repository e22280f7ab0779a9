import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.runs import grids
from ddpo_group.runs.grids import group_rows, make_grid, save_epoch_samples, save_png, to_uint8_hwc


def exact_images(n, height, width, seed=0):
    """(n, 3, H, W) images whose values are k / 255, so the uint8 conversion is exact."""
    levels = np.random.default_rng(seed).integers(0, 256, size=(n, 3, height, width))
    return levels / 255.0, levels.astype(np.uint8)


def upscaled(levels_chw, factor):
    """Nearest-neighbour upscale by hand: out[y, x] = in[y // factor, x // factor], (H*f, W*f, 3)."""
    channels, height, width = levels_chw.shape
    out = np.zeros((height * factor, width * factor, channels), dtype=np.uint8)
    for y in range(height * factor):
        for x in range(width * factor):
            out[y, x] = levels_chw[:, y // factor, x // factor]
    return out


def test_to_uint8_clips_and_rounds():
    image = np.array([-0.5, 0.2, 1.5, 0.5]).reshape(1, 1, 4).repeat(3, axis=0)
    # 0.2 * 255 = 51; 0.5 * 255 = 127.5 rounds up to 128; out-of-range values clip to 0 and 255.
    assert to_uint8_hwc(image)[0, :, 0].tolist() == [0, 51, 255, 128]


def test_grid_size_is_rows_times_cells():
    images, _ = exact_images(5, height=4, width=6)
    grid = make_grid(
        images, nrow=3, captions=["c"] * 5, row_labels=["p0", "p1"], upscale=2,
        padding=2, caption_height=10, label_width=50,
    )
    # 2 rows x 3 columns; cell image 12 x 8 (6x4 upscaled by 2).
    # width = 50 (labels) + 2 + 3 * (12 + 2) = 94; height = 2 + 2 * (8 + 10 + 2) = 42
    assert grid.size == (94, 42)


def test_grid_cell_pixels_equal_upscaled_input():
    images, levels = exact_images(5, height=4, width=6)
    grid = np.asarray(make_grid(images, nrow=3, upscale=2, padding=2, caption_height=10, label_width=50,
                                row_labels=["p0", "p1"], captions=[""] * 5))
    for i in range(5):
        row, col = divmod(i, 3)
        x, y = 50 + 2 + col * 14, 2 + row * 20
        np.testing.assert_array_equal(grid[y : y + 8, x : x + 12], upscaled(levels[i], 2))


def test_grid_without_captions_or_labels_has_no_margins():
    images, levels = exact_images(4, height=3, width=3)
    grid = np.asarray(make_grid(images, nrow=2, upscale=1, padding=0))
    assert grid.shape == (6, 6, 3)
    np.testing.assert_array_equal(grid[3:6, 0:3], upscaled(levels[2], 1))


def test_auto_upscale_makes_32px_images_96px_cells():
    images, levels = exact_images(1, height=32, width=32)
    grid = make_grid(images, nrow=1, padding=0)
    assert grid.size == (96, 96)
    np.testing.assert_array_equal(np.asarray(grid), upscaled(levels[0], 3))


def test_grid_accepts_torch_tensors():
    images, levels = exact_images(2, height=3, width=3)
    grid = make_grid(torch.tensor(images, dtype=torch.float32), nrow=2, upscale=1, padding=0)
    np.testing.assert_array_equal(np.asarray(grid)[:, 3:6], upscaled(levels[1], 1))


def test_none_cell_is_grey():
    images, levels = exact_images(1, height=2, width=2)
    grid = np.asarray(make_grid([images[0], None], nrow=2, upscale=1, padding=0))
    np.testing.assert_array_equal(grid[:, 2:4], np.full((2, 2, 3), 230, dtype=np.uint8))
    np.testing.assert_array_equal(grid[:, 0:2], upscaled(levels[0], 1))


def test_make_grid_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"images must have shape \(N, 3, H, W\)"):
        make_grid(np.zeros((2, 4, 4)), nrow=2)
    with pytest.raises(ValueError, match="captions: expected 2"):
        make_grid(np.zeros((2, 3, 4, 4)), nrow=2, captions=["a"])
    with pytest.raises(ValueError, match="row_labels: expected 1"):
        make_grid(np.zeros((2, 3, 4, 4)), nrow=2, row_labels=["a", "b"])


def test_group_rows_orders_prompts_by_first_appearance():
    prompts = ["b", "a", "b", "a", "c", "b", "b"]
    assert group_rows(prompts, group_size=2) == [("b", [0, 2]), ("b", [5, 6]), ("a", [1, 3]), ("c", [4])]


def test_caption_format():
    assert grids.format_caption(0.834, 1.2) == "r=0.83 a=+1.20"
    assert grids.format_caption(0.5, -0.25) == "r=0.50 a=-0.25"
    assert grids.format_caption(0.5, None) == "r=0.50 a=n/a"


def test_save_epoch_samples_writes_records_and_single_images(tmp_path):
    images, levels = exact_images(3, height=4, width=4)
    prompts = ["a cat", "a dog", "a cat"]
    grid_path = save_epoch_samples(tmp_path, 7, images, prompts, [0.5, 0.25, 1.0], [1.0, 0.0, -1.0], group_size=2)

    assert grid_path == tmp_path / "samples" / "epoch_0007.png"
    assert grid_path.is_file()
    document = json.loads((tmp_path / "samples" / "epoch_0007.json").read_text())
    assert document["epoch"] == 7 and document["group_size"] == 2 and document["grid"] == "epoch_0007.png"
    assert document["records"] == [
        {"index": 0, "prompt": "a cat", "reward": 0.5, "advantage": 1.0, "image": "epoch_0007/000.png"},
        {"index": 1, "prompt": "a dog", "reward": 0.25, "advantage": 0.0, "image": "epoch_0007/001.png"},
        {"index": 2, "prompt": "a cat", "reward": 1.0, "advantage": -1.0, "image": "epoch_0007/002.png"},
    ]
    for i in range(3):
        single = np.asarray(Image.open(tmp_path / "samples" / "epoch_0007" / f"{i:03d}.png"))
        np.testing.assert_array_equal(single, upscaled(levels[i], 1))


def test_saved_grid_groups_copies_of_a_prompt_in_one_row(tmp_path):
    images, _ = exact_images(3, height=4, width=4)
    grid_path = save_epoch_samples(
        tmp_path, 0, torch.tensor(images), ["a cat", "a dog", "a cat"],
        torch.tensor([0.5, 0.25, 1.0]), torch.tensor([1.0, 0.0, -1.0]), group_size=2,
    )
    # Row "a cat" holds samples 0 and 2; row "a dog" holds sample 1 and an empty cell.
    expected = make_grid(
        [images[0], images[2], images[1], None], nrow=2,
        captions=["r=0.50 a=+1.00", "r=1.00 a=-1.00", "r=0.25 a=+0.00", ""], row_labels=["a cat", "a dog"],
    )
    np.testing.assert_array_equal(np.asarray(Image.open(grid_path)), np.asarray(expected))


def test_grid_is_capped_at_max_rows(tmp_path):
    images, _ = exact_images(5, height=4, width=4)
    prompts = [f"prompt {i}" for i in range(5)]
    grid_path = save_epoch_samples(tmp_path, 1, images, prompts, np.zeros(5), np.zeros(5), group_size=1, max_rows=2)
    expected = make_grid(images[:2], nrow=1, captions=["r=0.00 a=+0.00"] * 2, row_labels=prompts[:2])
    assert Image.open(grid_path).size == expected.size
    # Every sample is still saved and recorded.
    assert len(json.loads((tmp_path / "samples" / "epoch_0001.json").read_text())["records"]) == 5
    assert len(list((tmp_path / "samples" / "epoch_0001").glob("*.png"))) == 5


def test_missing_advantages_are_recorded_as_null(tmp_path):
    images, _ = exact_images(2, height=4, width=4)
    save_epoch_samples(tmp_path, 0, images, ["p", "p"], [0.1, 0.2], None, group_size=2)
    records = json.loads((tmp_path / "samples" / "epoch_0000.json").read_text())["records"]
    assert [r["advantage"] for r in records] == [None, None]


def test_save_leaves_no_temporary_files(tmp_path):
    images, _ = exact_images(4, height=4, width=4)
    save_epoch_samples(tmp_path, 0, images, ["p"] * 4, np.zeros(4), np.zeros(4), group_size=4)
    save_epoch_samples(tmp_path, 0, images, ["p"] * 4, np.ones(4), np.zeros(4), group_size=4)  # overwrite
    names = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert names == [
        "samples/epoch_0000.json", "samples/epoch_0000.png",
        "samples/epoch_0000/000.png", "samples/epoch_0000/001.png",
        "samples/epoch_0000/002.png", "samples/epoch_0000/003.png",
    ]


def test_failed_write_keeps_the_old_file_and_no_tmp(tmp_path, monkeypatch):
    path = tmp_path / "grid.png"
    old = Image.new("RGB", (4, 4), (10, 20, 30))
    save_png(old, path)

    def crash_midway(self, fp, format=None, **kwargs):
        Path(fp).write_bytes(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Image.Image, "save", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        save_png(Image.new("RGB", (4, 4), (0, 0, 0)), path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.png"]
    assert np.asarray(Image.open(path))[0, 0].tolist() == [10, 20, 30]


def test_save_epoch_samples_rejects_mismatched_inputs(tmp_path):
    images, _ = exact_images(2, height=4, width=4)
    with pytest.raises(ValueError, match="prompts: expected 2"):
        save_epoch_samples(tmp_path, 0, images, ["p"], [0, 0], [0, 0], group_size=2)
    with pytest.raises(ValueError, match=r"rewards must have shape \(2,\)"):
        save_epoch_samples(tmp_path, 0, images, ["p", "p"], [0, 0, 0], [0, 0], group_size=2)
    with pytest.raises(ValueError, match=r"advantages must have shape \(2,\).*advantages\[:, 0\]"):
        save_epoch_samples(tmp_path, 0, images, ["p", "p"], [0, 0], np.zeros((2, 5)), group_size=2)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        save_epoch_samples(tmp_path, 0, images, ["p", "p"], [0, 0], [0, 0], group_size=0)
    assert not (tmp_path / "samples").exists()


class _CountingDraw:
    """An ImageDraw that counts the text measurements made through it."""

    def __init__(self, draw):
        self.draw, self.calls = draw, 0

    def __getattr__(self, name):
        attr = getattr(self.draw, name)
        if name in ("textlength", "textbbox"):
            def counted(*args, **kwargs):
                self.calls += 1
                return attr(*args, **kwargs)
            return counted
        return attr


@pytest.mark.parametrize("text", ["x" * 10_000, "word " * 2_000, "a" * 300 + " " + "b" * 9_000])
def test_captions_take_bounded_work_whatever_the_prompt(text):
    from PIL import Image, ImageDraw

    from ddpo_group.runs import grids

    draw = _CountingDraw(ImageDraw.Draw(Image.new("RGB", (10, 10))))
    lines = grids._fit_lines(draw, text, grids._font(), 150, 4)
    assert 1 <= len(lines) <= 4 and lines[-1].endswith("...")
    assert all(grids._text_width(draw.draw, line, grids._font()) <= 150 for line in lines)
    # a few measurements per shown line, independent of the 10,000 characters
    assert draw.calls < 400


def test_a_10000_character_prompt_gets_a_grid(tmp_path):
    from ddpo_group.runs.grids import save_epoch_samples

    images = torch.rand(2, 3, 32, 32)
    path = save_epoch_samples(str(tmp_path), 0, images, ["z" * 10_000] * 2, np.array([0.1, 0.2]), np.array([1.0, -1.0]), 2)
    assert os.path.exists(path)
