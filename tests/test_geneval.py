"""GenEval: the rules on hand-made detections, Flow-GRPO's partial score against values computed by hand, the
metadata reader's errors, the prompt generator's dedup, and the exact shapes-world detector on rendered scenes."""

import json

import numpy as np
import pytest

from ddpo_group.rewards.geneval.metadata import (
    GenEvalFormatError,
    generate_training_records,
    read_metadata,
    record_identity,
    training_prompts,
)
from ddpo_group.rewards.geneval.protocol import (
    Detection,
    flow_grpo_score,
    geneval_correct,
    keep_confident,
    relative_position,
    summarize,
)
from ddpo_group.rewards.geneval.shapes_scenes import SceneObject, ShapesColorClassifier, ShapesDetector, render_scene
from ddpo_group.rewards.geneval.vocabulary import COCO_CLASSES, COLORS


def box_at(cx, cy, w=10, h=10, score=1.0):
    return Detection((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), score)


def colors_by_x(table):
    """A colour classifier that answers from a {box x1: colour} table (independent of any model)."""
    return lambda found, name: [table[d.box[0]] for d in found]


NO_COLORS = colors_by_x({})


# ---- positions and detection thresholds


def test_relative_position_follows_the_margin_rule():
    # centres 20 apart on x, boxes 10 wide: |o'| = 20 - 0.1 * (10 + 10) = 18, dx = -18 / 20 = -0.9 -> "left of"
    assert relative_position(box_at(10, 50), box_at(30, 50)) == {"left of"}
    assert relative_position(box_at(30, 50), box_at(10, 50)) == {"right of"}
    assert relative_position(box_at(50, 10), box_at(50, 30)) == {"above"}  # image y grows downwards
    # diagonal (20, 20): o' = (18, 18), / |o| = 28.28 -> 0.636 each: below AND right of
    assert relative_position(box_at(30, 30), box_at(10, 10)) == {"right of", "below"}
    # (20, 5): o' = (18, 3), |o| = 20.6 -> dx 0.873, dy 0.146: right of only
    assert relative_position(box_at(30, 15), box_at(10, 10)) == {"right of"}
    # offset 1.5 within the margin 0.1 * (10 + 10) = 2 on both axes: no relation
    assert relative_position(box_at(11.5, 10), box_at(10, 10)) == set()


def test_keep_confident_uses_the_counting_threshold_and_sorts_by_score():
    found = {"dog": [box_at(10, 10, score=0.5), box_at(40, 10, score=0.95), box_at(70, 10, score=0.3)]}
    kept = keep_confident(found, "two_object")
    assert [d.score for d in kept["dog"]] == [0.95, 0.5]  # 0.3 is not above 0.3
    assert [d.score for d in keep_confident(found, "counting")["dog"]] == [0.95]
    many = {"cat": [box_at(i, 0, score=0.5 + i / 100) for i in range(20)]}
    assert len(keep_confident(many, "single_object")["cat"]) == 16
    assert keep_confident({"cat": [box_at(0, 0, score=0.1)]}, "colors") == {}


# ---- GenEval's verdict and Flow-GRPO's partial score, by hand


def record(tag, include, exclude=None, prompt="p"):
    out = {"tag": tag, "include": include, "prompt": prompt}
    if exclude is not None:
        out["exclude"] = exclude
    return out


COUNT_TWO = record("counting", [{"class": "cup", "count": 2}], [{"class": "cup", "count": 3}])


def test_counting_is_exactly_n_through_the_exclude_clause():
    two = {"cup": [box_at(10, 10), box_at(40, 10)]}
    three = {"cup": [box_at(10, 10), box_at(40, 10), box_at(70, 10)]}
    assert geneval_correct(two, COUNT_TWO, NO_COLORS)[0] is True
    assert geneval_correct(three, COUNT_TWO, NO_COLORS)[0] is False
    assert geneval_correct({"cup": [box_at(10, 10)]}, COUNT_TWO, NO_COLORS)[0] is False
    # Flow-GRPO: three cups for two -> 1 - |2 - 3| / 2 = 0.5; two cups -> 1.0
    assert flow_grpo_score(three, COUNT_TWO, NO_COLORS)[:2] == (False, 0.5)
    assert flow_grpo_score(two, COUNT_TWO, NO_COLORS)[:2] == (True, 1.0)


def test_the_partial_count_term_goes_negative_and_strict_wants_exact_counts():
    one_dog = record("single_object", [{"class": "dog", "count": 1}])
    three = {"dog": [box_at(10, 10), box_at(40, 10), box_at(70, 10)]}
    assert geneval_correct(three, one_dog, NO_COLORS)[0] is True  # "at least one dog"
    assert flow_grpo_score(three, one_dog, NO_COLORS)[:2] == (False, -1.0)  # 1 - |1 - 3| / 1
    two = record("two_object", [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}])
    found = {"dog": [box_at(10, 10), box_at(40, 10)], "cat": [box_at(70, 10)]}
    assert geneval_correct(found, two, NO_COLORS)[0] is True
    assert flow_grpo_score(found, two, NO_COLORS)[:2] == (False, 0.5)  # terms [0, 1]
    assert flow_grpo_score({}, two, NO_COLORS)[:2] == (False, 0.0)  # terms [0, 0]


def test_colour_terms():
    attr = record("color_attr", [{"class": "bus", "count": 1, "color": "red"}, {"class": "cup", "count": 1, "color": "blue"}])
    found = {"bus": [box_at(10, 10)], "cup": [box_at(40, 10)]}
    right = colors_by_x({5.0: "red", 35.0: "blue"})
    wrong_cup = colors_by_x({5.0: "red", 35.0: "green"})
    assert geneval_correct(found, attr, right)[0] is True
    assert flow_grpo_score(found, attr, right)[:2] == (True, 1.0)
    assert geneval_correct(found, attr, wrong_cup)[0] is False
    assert flow_grpo_score(found, attr, wrong_cup)[:2] == (False, 0.75)  # terms [1, 1, 1, 0]
    # a colour clause whose count is wrong adds one 0: two buses for one -> [1 - 1, 0], the cup [1, 1] -> 0.5
    two_buses = {"bus": [box_at(10, 10), box_at(70, 10)], "cup": [box_at(40, 10)]}
    assert flow_grpo_score(two_buses, attr, colors_by_x({5.0: "red", 65.0: "red", 35.0: "blue"}))[:2] == (False, 0.5)
    # GenEval checks the colour of the first `count` (most confident) buses only
    assert geneval_correct(two_buses, attr, colors_by_x({5.0: "red", 65.0: "green", 35.0: "blue"}))[0] is True


def test_position_terms_keep_flow_grpos_extra_one():
    left = record("position", [{"class": "cup", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}])
    held = {"cup": [box_at(40, 10)], "dog": [box_at(10, 10)]}
    swapped = {"cup": [box_at(10, 10)], "dog": [box_at(40, 10)]}
    assert geneval_correct(held, left, NO_COLORS)[0] is True
    assert flow_grpo_score(held, left, NO_COLORS)[:2] == (True, 1.0)  # [1], [1, 1]
    assert geneval_correct(swapped, left, NO_COLORS)[0] is False
    assert flow_grpo_score(swapped, left, NO_COLORS)[:2] == (False, 0.75)  # [1], [1, 0, 1]: the quirk
    no_cup = {"dog": [box_at(10, 10)]}
    correct, reason = geneval_correct(no_cup, left, NO_COLORS)
    assert correct is False and "no target for dog" in reason
    assert flow_grpo_score(no_cup, left, NO_COLORS)[:2] == (False, pytest.approx(1 / 3))  # [0], [1, 0]


def test_summarize_is_summary_scores():
    def result(tag, correct, prompt):
        return {"tag": tag, "correct": correct, "metadata": prompt}

    results = ([result("single_object", True, "a")] * 4 + [result("counting", c, "b") for c in (True, False, False, False)]
               + [result("counting", False, "c")] * 4 + [result("position", False, "d")] * 4)
    summary = summarize(results)
    assert summary["tags"]["single_object"]["score"] == 1.0
    assert summary["tags"]["counting"] == {"score": 1 / 8, "correct": 1, "images": 8}
    assert summary["overall"] == pytest.approx((1 + 1 / 8 + 0) / 3)
    assert summary["correct_images"] == 5 / 16
    assert summary["correct_prompts"] == 2 / 4  # "a" and "b" have a correct image
    assert list(summary["tags"]) == ["single_object", "counting", "position"]


# ---- the metadata file and the generator


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = json.dumps({"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"})


@pytest.mark.parametrize("bad, words", [
    ("{not json", "invalid JSON"),
    (json.dumps({"tag": "colors", "prompt": "x"}), "missing field 'include'"),
    (json.dumps({"tag": "colors", "include": [{"class": "cup"}], "prompt": "x"}), "include[0]: 'count'"),
    (json.dumps({"tag": "colors", "include": [{"class": "cup", "count": 0}], "prompt": "x"}), "'count' must be"),
    (json.dumps({"tag": "position", "include": [{"class": "cup", "count": 1, "position": ["left of", 0]}],
                 "prompt": "x"}), "earlier include clause"),
    (json.dumps({"tag": "position", "include": [{"class": "a", "count": 1}, {"class": "b", "count": 1,
                 "position": ["beside", 0]}], "prompt": "x"}), "relation one of"),
    (json.dumps({"include": [{"class": "cup", "count": 1}], "prompt": "x"}), "field 'tag'"),
    (json.dumps({"tag": "weird_tag", "include": [{"class": "cup", "count": 1}], "prompt": "x"}),
     "tag 'weird_tag' is not one of GenEval's six tags (single_object, two_object, counting, colors, position, "
     "color_attr)"),
    (json.dumps(["a list"]), "expected a JSON object"),
])
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, bad, words):
    path = write_lines(tmp_path / "evaluation_metadata.jsonl", [GOOD, "", bad])
    with pytest.raises(GenEvalFormatError) as err:
        read_metadata(path)
    message = str(err.value)
    assert "\n" not in message and f"{path}, line 3" in message and words in message


def test_reading_geneval_records(tmp_path):
    position = {"tag": "position", "include": [{"class": "kite", "count": 1},
                                                {"class": "wine glass", "count": 1, "position": ["above", 0]}],
                "prompt": "a photo of a wine glass above a kite"}
    records = read_metadata(write_lines(tmp_path / "m.jsonl", [GOOD, json.dumps(position)]))
    assert [r["tag"] for r in records] == ["single_object", "position"]
    assert records[1]["include"][1]["position"] == ["above", 0]
    with pytest.raises(GenEvalFormatError, match="does not exist"):
        read_metadata(str(tmp_path / "missing.jsonl"))


def test_a_and_b_is_b_and_a_and_left_of_is_right_of_reversed():
    ab = {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}], "prompt": "x"}
    ba = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}], "prompt": "y"}
    assert record_identity(ab) == record_identity(ba)
    left = {"tag": "position", "include": [{"class": "cup", "count": 1},
                                            {"class": "dog", "count": 1, "position": ["left of", 0]}], "prompt": "x"}
    right = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                             {"class": "cup", "count": 1, "position": ["right of", 0]}], "prompt": "y"}
    above = {"tag": "position", "include": [{"class": "cup", "count": 1},
                                             {"class": "dog", "count": 1, "position": ["above", 0]}], "prompt": "z"}
    assert record_identity(left) == record_identity(right) != record_identity(above)


def test_generated_prompts_follow_genevals_rules_and_avoid_the_evaluation_set(tmp_path):
    # an evaluation set with "a cat and a dog"; the generator must not make "a dog and a cat"
    evaluation = [{"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
                   "prompt": "a photo of a cat and a dog"}]
    two_classes = ("cat", "dog")
    made = generate_training_records(5, seed=0, tags=("two_object",), exclude_records=evaluation, classes=two_classes)
    assert made == []  # the only pair there is, in either order, is in the evaluation set
    made = generate_training_records(5, seed=0, tags=("two_object",), classes=two_classes)
    assert len(made) == 1 and made[0]["prompt"] in ("a photo of a cat and a dog", "a photo of a dog and a cat")

    records = generate_training_records(30, seed=1)
    by_tag = {}
    for r in records:
        by_tag.setdefault(r["tag"], []).append(r)
    assert {tag: len(v) for tag, v in by_tag.items()} == dict.fromkeys(
        ["single_object", "two_object", "counting", "colors", "position", "color_attr"], 30)
    assert len({record_identity(r) for r in records}) == len(records)
    for r in by_tag["counting"]:
        n = r["include"][0]["count"]
        assert 2 <= n <= 4 and r["exclude"] == [{"class": r["include"][0]["class"], "count": n + 1}]
        assert r["prompt"].startswith(f"a photo of {['two', 'three', 'four'][n - 2]} ")
    for r in by_tag["colors"] + by_tag["color_attr"]:
        assert all(c["class"] != "person" and c["color"] in COLORS for c in r["include"])
    for r in by_tag["position"]:
        a, b = r["include"][1]["class"], r["include"][0]["class"]
        relation = r["include"][1]["position"][0]
        assert r["prompt"] == f"a photo of {'an' if a[0] in 'aeiou' else 'a'} {a} {relation} " \
                              f"{'an' if b[0] in 'aeiou' else 'a'} {b}"
    assert all(c["class"] in COCO_CLASSES for r in records for c in r["include"])
    assert generate_training_records(30, seed=1) == records  # the same seed, the same prompts


def test_single_object_prompts_run_out_against_genevals_evaluation_set(tmp_path):
    evaluation = [json.dumps({"tag": "single_object", "include": [{"class": name, "count": 1}],
                              "prompt": f"a photo of a {name}"}) for name in COCO_CLASSES]
    path = write_lines(tmp_path / "evaluation_metadata.jsonl", evaluation)
    made = training_prompts(n_per_tag=10, seed=0, exclude=path, tags="single_object,colors")
    assert [r["tag"] for r in made] == ["colors"] * 10


# ---- the shapes world: scenes whose answer is known


def test_the_shapes_detector_finds_every_object_of_a_scene_exactly():
    scene = [SceneObject("circle", "red", (14, 14), 110), SceneObject("square", "blue", (46, 16), 100),
             SceneObject("triangle", "green", (16, 46), 100), SceneObject("triangle", "yellow", (48, 48), 60),
             SceneObject("circle", "magenta", (32, 32), 48)]  # >= MIN_AREA (40 px)
    for background in ("white", "black", "gray"):
        image = render_scene(scene, background)
        found = ShapesDetector().detect(image[None])[0]
        assert {name: len(v) for name, v in found.items()} == {"circle": 2, "square": 1, "triangle": 2}
        colors = {name: sorted(ShapesColorClassifier().classify(image, v, name)) for name, v in found.items()}
        assert colors == {"circle": ["magenta", "red"], "square": ["blue"], "triangle": ["green", "yellow"]}
        # the square's box: side 10 centred at (46, 16) covers x in [41, 51), y in [11, 21) exactly
        (square,) = found["square"]
        assert square.box == (41.0, 11.0, 51.0, 21.0)


def test_generated_prompts_are_a_prompt_source_whose_metadata_is_the_record():
    from ddpo_group.data.prompts import load_prompts

    records = load_prompts("ddpo_group.rewards.geneval.metadata:training_prompts", n_per_tag=2, seed=3,
                           tags="counting,position")
    assert [r.metadata["tag"] for r in records] == ["counting", "counting", "position", "position"]
    first = records[0]
    n = first.metadata["include"][0]["count"]
    assert first.metadata["exclude"] == [{"class": first.metadata["include"][0]["class"], "count": n + 1}]
    assert "prompt" not in first.metadata and first.prompt.startswith("a photo of ")


def test_a_training_prompt_file_with_a_tag_not_one_of_the_six_is_refused_before_any_model_loads(tmp_path):
    from helpers import make_config

    from ddpo_group.config.check import ConfigError, check_config

    square = {"include": [{"class": "square", "count": 1}], "prompt": "a photo of a square"}
    prompts = write_lines(tmp_path / "prompts.jsonl", [json.dumps({"tag": "single_object", **square}),
                                                       json.dumps({"tag": "weird_tag", **square})])
    config = make_config(tmp_path, "tiny_geneval", prompt_fn=prompts, eval_freq=0)
    with pytest.raises(ConfigError) as err:
        check_config(config)
    message = str(err.value)
    assert "\n" not in message and f"{prompts}, line 2" in message and "'weird_tag'" in message
    assert "single_object, two_object, counting, colors, position, color_attr" in message
