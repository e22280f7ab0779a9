"""The expected strict verdict (ddpo_group/rewards/geneval/expected.py): values worked out by hand from the
detector's scores, and the reward score "expected" on rendered scenes whose answer is known."""

import numpy as np
import pytest
import torch

from ddpo_group.rewards.geneval.expected import MAX_ASSIGNMENTS, expected_strict, objects_of
from ddpo_group.rewards.geneval.protocol import Detection
from ddpo_group.rewards.geneval.reward import GenEvalReward
from ddpo_group.rewards.geneval.shapes_scenes import SceneObject, render_scene

TWO = {"tag": "two_object", "include": [{"class": "star", "count": 1}, {"class": "triangle", "count": 1}]}


def obj(scores, x=0.0, color="red"):
    """One object reported under several classes (one shared mask, as the shapes-world detector reports it)."""
    mask = np.zeros((4, 4), bool)
    return {name: Detection((x, 0.0, x + 1, 1.0), score, mask) for name, score in scores.items()}, color


def detections(*objects):
    found, colors = {}, {}
    for scores, color in objects:
        for name, d in scores.items():
            found.setdefault(name, []).append(d)
            colors[id(d)] = color
    return found, lambda ds, name: [colors[id(d)] for d in ds]


def test_two_objects_unsure_of_their_classes_by_hand():
    # A: star 0.6, triangle 0.3, none 0.1; B: triangle 0.8, none 0.2. Exactly one star and one triangle only when
    # A is the star and B the triangle: 0.6 * 0.8.
    found, classify = detections(obj({"star": 0.6, "triangle": 0.3}), obj({"triangle": 0.8}, x=2))
    value, forced = expected_strict(found, TWO, classify)
    assert value == pytest.approx(0.48) and forced == 0
    assert len(objects_of(found)) == 2


def test_counting_is_a_poisson_binomial_without_the_threshold():
    three = {"tag": "counting", "include": [{"class": "semicircle", "count": 3}],
             "exclude": [{"class": "semicircle", "count": 4}]}
    found, classify = detections(*(obj({"semicircle": 0.5}, x=k) for k in range(4)))
    assert expected_strict(found, three, classify)[0] == pytest.approx(4 / 16)  # C(4, 3) / 2^4
    found, classify = detections(obj({"semicircle": 0.9}), obj({"semicircle": 0.8}, x=1), obj({"semicircle": 0.5}, x=2))
    assert expected_strict(found, three, classify)[0] == pytest.approx(0.9 * 0.8 * 0.5)


def test_scores_above_one_are_scaled_and_classes_outside_the_record_do_not_matter():
    # star 0.8 + triangle 0.7 = 1.5 -> 0.8 / 1.5 a star; the circle-only object never enters
    found, classify = detections(obj({"star": 0.8, "triangle": 0.7}), obj({"triangle": 1.0}, x=2),
                                 obj({"circle": 0.9}, x=4))
    assert expected_strict(found, TWO, classify)[0] == pytest.approx(0.8 / 1.5)


def test_colours_and_positions_are_the_strict_rules():
    attr = {"tag": "color_attr", "include": [{"class": "cross", "count": 1, "color": "magenta"},
                                             {"class": "star", "count": 1, "color": "yellow"}]}
    found, classify = detections(obj({"cross": 0.5}, color="magenta"), obj({"star": 0.5}, x=2, color="red"))
    assert expected_strict(found, attr, classify)[0] == 0.0  # the star is red whatever its class
    found, classify = detections(obj({"cross": 0.5}, color="magenta"), obj({"star": 0.4}, x=2, color="yellow"))
    assert expected_strict(found, attr, classify)[0] == pytest.approx(0.2)
    above = {"tag": "position", "include": [{"class": "cross", "count": 1},
                                            {"class": "star", "count": 1, "position": ["above", 0]}]}
    mask_a, mask_b = np.zeros((4, 4), bool), np.zeros((4, 4), bool)
    star = Detection((0.0, 0.0, 10.0, 10.0), 0.5, mask_a)  # centre y 5: above the cross's 45
    cross = Detection((0.0, 40.0, 10.0, 50.0), 1.0, mask_b)
    assert expected_strict({"star": [star], "cross": [cross]}, above, lambda ds, n: ["red"] * len(ds))[0] == 0.5
    low = Detection((0.0, 80.0, 10.0, 90.0), 0.5, mask_a)
    assert expected_strict({"star": [low], "cross": [cross]}, above, lambda ds, n: ["red"] * len(ds))[0] == 0.0


def test_detections_without_a_shared_mask_are_objects_of_their_own():
    # Mask2Former's queries: two star queries of 0.5 each; exactly one star: 2 * 0.5 * 0.5; the triangle 1.0
    found = {"star": [Detection((0, 0, 1, 1), 0.5, None), Detection((2, 0, 3, 1), 0.5, None)],
             "triangle": [Detection((4, 0, 5, 1), 1.0, None)]}
    assert len(objects_of(found)) == 3
    assert expected_strict(found, TWO, lambda ds, n: ["red"] * len(ds))[0] == pytest.approx(0.5)


def test_too_many_unsure_objects_fix_the_most_certain_ones():
    one = {"tag": "single_object", "include": [{"class": "star", "count": 1}]}
    n = int(np.log2(MAX_ASSIGNMENTS)) + 2  # two outcomes each: 4 x MAX_ASSIGNMENTS assignments
    probs = [0.1] * (n - 2) + [0.002, 0.001]  # the two surest ("none" at 0.998, 0.999) are fixed to none
    found, classify = detections(*(obj({"star": p}, x=k) for k, p in enumerate(probs)))
    value, forced = expected_strict(found, one, classify)
    assert forced == 2
    rest = probs[:-2]
    exact = sum(p * np.prod([1 - q for j, q in enumerate(rest) if j != k]) for k, p in enumerate(rest))
    assert value == pytest.approx(exact)


def test_the_reward_scores_rendered_scenes_as_their_verdict():
    reward = GenEvalReward(score="expected", detector="shapes")
    images = [render_scene([SceneObject("star", "red", (20, 20), 200), SceneObject("triangle", "blue", (44, 44), 200)]),
              render_scene([SceneObject("star", "red", (20, 20), 200), SceneObject("circle", "blue", (44, 44), 200)]),
              render_scene([])]
    pixels = torch.tensor(np.stack(images)).permute(0, 3, 1, 2).float() / 255
    values, info = reward(pixels, ["a photo of a star and a triangle"] * 3, [TWO] * 3)
    assert values[0] > 0.96 and values[1] == 0 and values[2] == 0
    assert info["strict_correct"].tolist() == [1.0, 0.0, 0.0]
    np.testing.assert_array_equal(values, info["expected_strict"])
    with pytest.raises(ValueError, match="'expected'"):
        GenEvalReward(score="soft", detector="shapes")
