"""The shapes detector's calibrated score (issue 53): its formula, rendered scenes kept exact above GenEval's
thresholds, fragments dropped, issue 42's unit confidence kept on request; the flip-rate benchmark's guard."""

import math
from collections import Counter

import numpy as np
import pytest
from helpers import load_script

from ddpo_group.data import scenes
from ddpo_group.rewards.geneval.protocol import COUNTING_THRESHOLD, THRESHOLD
from ddpo_group.rewards.geneval.shapes_scenes import (
    ShapesColorClassifier, ShapesDetector, SceneObject, calibrated_scores, render_scene,
)

OTHERS = ("square", "triangle", "diamond", "cross", "ring", "star")


def test_a_near_tie_between_two_templates_splits_the_score_in_half():
    overlaps = {"circle": 0.8, "semicircle": 0.8, **{name: 0.2 for name in OTHERS}}
    scores = calibrated_scores(overlaps)
    # q = 1 (best 0.8 >= 0.7); softmax with T = 0.025: 1 / (2 + 6 exp(-0.6 / 0.025))
    expected = 1 / (2 + 6 * math.exp(-24))
    assert scores["circle"] == pytest.approx(expected, abs=1e-12)
    assert scores["semicircle"] == pytest.approx(expected, abs=1e-12)
    assert THRESHOLD < scores["circle"] < COUNTING_THRESHOLD  # kept for two objects, dropped for counting


def test_a_poor_fit_scales_the_score_by_the_shape_quality():
    # best overlap 0.55: q = (0.55 - 0.4) / (0.7 - 0.4) = 0.5; the square leads by 0.3: softmax 1 / (1 + 7 e^-12)
    overlaps = {"square": 0.55, "circle": 0.25, **{name: 0.25 for name in OTHERS if name != "square"},
                "semicircle": 0.25}
    assert calibrated_scores(overlaps)["square"] == pytest.approx(0.5 / (1 + 7 * math.exp(-12)), abs=1e-12)
    # best overlap 0.35 < 0.4: no shape at all, every class scores 0
    assert set(calibrated_scores({name: v - 0.2 for name, v in overlaps.items()}).values()) == {0.0}


def test_random_rendered_scenes_are_recovered_with_every_score_above_the_counting_threshold():
    records = [r for tag_records in scenes.world_records().values() for r in tag_records]
    detector, colors = ShapesDetector(), ShapesColorClassifier()
    for seed in range(40):
        rng = np.random.default_rng(seed)
        objects, background = scenes.sample_scene(records[rng.integers(len(records))], rng)
        image = scenes.render_objects(objects, background)
        found = detector.detect(image[None])[0]
        kept = {name: [d for d in dets if d.score > THRESHOLD] for name, dets in found.items()}
        recovered = Counter((name, color) for name, dets in kept.items() if dets
                            for color in colors.classify(image, dets, name))
        assert recovered == Counter((shape, color) for shape, color, _ in objects), seed
        assert min(d.score for dets in kept.values() for d in dets) > COUNTING_THRESHOLD, seed


def test_a_fragment_under_the_minimum_area_is_no_object():
    image = render_scene([SceneObject("square", "red", (20, 20), 100), SceneObject("circle", "blue", (45, 45), 30)])
    assert {name: len(v) for name, v in ShapesDetector().detect(image[None])[0].items()} == {"square": 1}
    # issue 42's detector (unit confidence, fragments from 4 px) finds the 30-px circle, scored 1.0 like the square
    unit = ShapesDetector(confidence="unit").detect(image[None])[0]
    assert {name: [d.score for d in v] for name, v in unit.items()} == {"square": [1.0], "circle": [1.0]}


def test_an_unknown_confidence_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="confidence='sharp'.*calibrated"):
        ShapesDetector(confidence="sharp")


def test_the_flip_rate_benchmark_never_overwrites_a_result_it_was_not_pointed_at(tmp_path, monkeypatch):
    bench = load_script("benchmarks/flip_rate.py")
    monkeypatch.setattr(bench, "RESULTS", str(tmp_path))
    (tmp_path / "tiny_scenes_sd3.json").write_text("{}")
    with pytest.raises(SystemExit):
        bench.main([])  # the default output of tiny-scenes-sd3 exists: refused before any model loads
    assert (tmp_path / "tiny_scenes_sd3.json").read_text() == "{}"
