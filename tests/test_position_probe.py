"""benchmarks/position_probe.py (docs/scenes.md, "Why position does not learn"): its verdicts and shares on images
whose answer is known, rendered scenes standing in for a model's samples."""

import json
import os

import numpy as np
import pytest
from helpers import load_script


def _rendering_sampler(follow_prompt, original):
    """A stand-in for scripts/evaluate.py: rendered scenes (the detector's exact case) scored by the real GenEval
    scorer; a model that follows the prompt draws each prompt's own scene, one that ignores it draws `original`'s."""
    from ddpo_group.data.scenes import render_record
    from ddpo_group.rewards.geneval.protocol import GenEvalScorer
    from ddpo_group.rewards.geneval.shapes_scenes import ShapesColorClassifier, ShapesDetector

    def sample(model_args, record, images, seed, workdir, label):
        rng = np.random.default_rng(seed)  # the same "noise" for every prompt
        drawn = record if follow_prompt else original
        pictures = np.stack([render_record(drawn, rng) for _ in range(images)])
        rows = GenEvalScorer(ShapesDetector(), ShapesColorClassifier()).score(pictures, [record] * images)
        return pictures, rows

    return sample


@pytest.mark.parametrize("follow_prompt", [True, False])
def test_the_probe_tells_a_model_that_follows_the_relation_from_one_that_ignores_it(tmp_path, monkeypatch, follow_prompt):
    probe = load_script("benchmarks/position_probe.py")
    from ddpo_group.rewards.geneval.metadata import position_record

    original = position_record("star", "above", "cross")
    monkeypatch.setattr(probe, "sample", _rendering_sampler(follow_prompt, original))
    output = tmp_path / "probe.json"
    probe.main(["--model", "tiny-scenes-flow", "--images", "4", "--output", str(output)])
    document = json.loads(output.read_text())
    entries = document["prompts"]
    assert [entries[k]["prompt"] for k in ("prompt", "nouns_swapped", "relation_flipped")] == [
        "a photo of a star above a cross", "a photo of a cross above a star", "a photo of a star below a cross"]
    assert entries["prompt"]["correct"] == 4 and entries["prompt"]["share_first_on_the_side"] == 1.0
    for label in ("nouns_swapped", "relation_flipped"):
        entry = entries[label]
        assert entry["placed"] == 4 and entry["wrong_objects"] == 0
        if follow_prompt:  # each drawn as its own prompt says: right, and the star below the cross
            assert entry["correct"] == 4 and entry["share_first_on_the_side"] == 0.0 and entry["pixel_change"] > 0
        else:  # the star above the cross whatever the words: wrong, and nothing in the image moves
            assert entry["correct"] == 0 and entry["share_first_on_the_side"] == 1.0 and entry["pixel_change"] == 0
    assert os.path.exists(tmp_path / "probe.png")


def test_the_probe_reads_the_prompts_relation_and_sides():
    probe = load_script("benchmarks/position_probe.py")
    assert probe.parse_prompt("a photo of an apple left of a cross") == ("apple", "left of", "cross")
    assert probe.parse_prompt("a photo of a star below a cross") == ("star", "below", "cross")
    # boxes (x1, y1, x2, y2), image y grows downwards: A at the top left, B at the bottom right
    a, b = (0, 0, 10, 10), (20, 20, 30, 30)
    assert probe.first_higher(a, b, "above") and not probe.first_higher(a, b, "below")
    assert probe.first_higher(a, b, "left of") and not probe.first_higher(a, b, "right of")
    row = {"strict_correct": False, "detections": {"star": [[0, 0, 9, 9, 1.0]], "cross": [[20, 20, 29, 29, 1.0]]}}
    assert probe.classify(row, "star", "cross") == "one of each"
    row["detections"]["star"].append([40, 40, 49, 49, 0.9])
    assert probe.classify(row, "star", "cross") == "wrong objects"


def test_the_probe_refuses_a_prompt_without_a_relation_and_an_output_not_json_in_one_line(tmp_path, capsys):
    probe = load_script("benchmarks/position_probe.py")
    for argv, named in ((["--prompt", "a photo of a star and a cross"], "--prompt"),
                        (["--images", "0"], "--images")):
        with pytest.raises(SystemExit) as exit_info:
            probe.main(argv + ["--output", str(tmp_path / "p.json")])
        assert exit_info.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"error: {named}" in line
    with pytest.raises(SystemExit):
        probe.main(["--output", str(tmp_path / "p.txt")])
    assert "--output" in capsys.readouterr().err and os.listdir(tmp_path) == []
