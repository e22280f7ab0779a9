"""benchmarks/scenes_misses.py: the wrong images of an evaluation drawn in order with what the detector found."""

import json
import os

import numpy as np
import pytest
from helpers import load_script
from PIL import Image

misses = load_script("benchmarks/scenes_misses.py")


def write_evaluation(tmp_path, colors, verdicts, detections):
    folder = tmp_path / "images" / "00000" / "samples"
    folder.mkdir(parents=True)
    rows = tmp_path / "out_images.jsonl"
    with open(rows, "w") as f:
        for i, (color, right, found) in enumerate(zip(colors, verdicts, detections)):
            Image.fromarray(np.full((64, 64, 3), color, dtype=np.uint8)).save(folder / f"{i:04d}.png")
            row = {"prompt_index": 0, "image_index": i, "strict_correct": right, "detections": found}
            f.write(json.dumps(row) + "\n")
    return str(rows), str(tmp_path / "images")


def test_the_wrong_images_are_drawn_in_order_with_what_was_found(tmp_path):
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    rows, images = write_evaluation(tmp_path, colors, [False, True, False],
                                    [{"star": [[0, 0, 4, 4, 0.9]] * 2, "cross": [[0, 0, 4, 4, 0.8]]}, {}, {}])
    out = str(tmp_path / "misses.png")
    wrong = misses.main(["--rows", rows, "--images", images, "--output", out, "--columns", "2"])
    assert [r["image_index"] for r in wrong] == [0, 2]
    picture = np.asarray(Image.open(out).convert("RGB"))
    cell = misses.CELL
    # two columns, one row: the red image first, the blue one second (the green one was right)
    assert picture.shape == (cell + misses.LABEL + 8, 2 * (cell + 8), 3)
    assert tuple(picture[4 + cell // 2, 4 + cell // 2]) == (255, 0, 0)
    assert tuple(picture[4 + cell // 2, cell + 12 + cell // 2]) == (0, 0, 255)
    assert misses.found_text({"star": [[0, 0, 4, 4, 0.9]] * 2, "cross": [[0, 0, 4, 4, 0.8]]}) == "cross x1, star x2"
    assert misses.found_text({}) == "nothing"


def test_an_existing_output_and_a_missing_input_are_one_line(tmp_path, capsys):
    rows, images = write_evaluation(tmp_path, [(0, 0, 0)], [False], [{}])
    out = tmp_path / "misses.png"
    out.write_bytes(b"keep")
    with pytest.raises(SystemExit):
        misses.main(["--rows", rows, "--images", images, "--output", str(out)])
    assert "exists" in capsys.readouterr().err and out.read_bytes() == b"keep"
    with pytest.raises(SystemExit):
        misses.main(["--rows", str(tmp_path / "none.jsonl"), "--images", images, "--output", str(tmp_path / "m.png")])
    assert "--rows" in capsys.readouterr().err and not os.path.exists(tmp_path / "m.png")
