"""benchmarks/scenes_vocabulary.py: the held-out prompts that ask for a word no training caption has."""

import json

import pytest
from helpers import load_script

from ddpo_group.data.scenes import evaluation_prompts_path, training_records, world_records
from ddpo_group.rewards.geneval.metadata import read_metadata


@pytest.fixture(scope="module")
def vocab():
    return load_script("benchmarks/scenes_vocabulary.py")


def test_unseen_records_by_words_on_hand_made_prompts(vocab):
    held_out = [{"tag": "counting", "prompt": "two stars"}, {"tag": "counting", "prompt": "two circles"},
                {"tag": "colors", "prompt": "a red star"}, {"tag": "colors", "prompt": "a blue ring"}]
    found = vocab.unseen_records(held_out, ["three circles", "two squares", "a red star", "a blue circle"],
                                   str.split)
    assert found == {"unseen": ["ring", "stars"], "records": {"counting": ["two stars"], "colors": ["a blue ring"]},
                     "per_tag": {"counting": 2, "colors": 2},
                     "seen": {"three", "circles", "two", "squares", "a", "red", "star", "blue", "circle"}}


def test_ceiling_is_the_mean_of_the_tags_shares_with_those_records_wrong(vocab):
    assert vocab.ceiling({"a": ["x"]}, {"a": 4, "b": 2}) == pytest.approx((0.75 + 1.0) / 2)
    assert vocab.ceiling({}, {"a": 4, "b": 2}) == 1.0


def test_the_shipped_held_out_counting_records_of_classes_with_no_training_counting_record_are_the_unseen_ones(vocab):
    """Counted without any tokenizer: a class whose every counting record (two, three, four) is held out has its
    plural in no training caption (only counting prompts use plurals), so exactly those held-out records ask for an
    untaught word, the plurals of those classes; their embeddings stay among the untrained tokens', far under the
    trained ones'."""
    held_out = read_metadata(evaluation_prompts_path())
    training_counting = {r["include"][0]["class"] for r in training_records(held_out)["counting"]}
    expected = sorted(r["prompt"] for r in held_out
                      if r["tag"] == "counting" and r["include"][0]["class"] not in training_counting)
    assert len(expected) == 12  # four classes (cross, ring, star, triangle) x three counts
    training = [r["prompt"] for records in training_records(held_out).values() for r in records]
    world = [r["prompt"] for records in world_records().values() for r in records]
    row = vocab.measure("tiny-scenes-flow", held_out, training, world)["encoders"]["text_encoder"]
    assert sorted(row["records"]["counting"]) == expected and set(row["records"]) == {"counting"}
    assert row["unseen"] == sorted({prompt.split()[-1] + "</w>" for prompt in expected})  # the plural, CLIP's word end
    assert row["ceiling"] == pytest.approx((5 + 4 / 16) / 6)
    assert all(norm < row["seen_norm_mean"] / 2 for norm in row["unseen_norms"].values())
    assert all(abs(norm - row["never_used_norm_mean"]) < 3 * row["never_used_norm_std"]
               for norm in row["unseen_norms"].values())


def test_main_writes_the_json_and_refuses_an_unknown_model_in_one_line(vocab, tmp_path, capsys):
    out = tmp_path / "v.json"
    assert vocab.main(["--models", "tiny-scenes", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["models"]) == {"tiny-scenes"} and data["training_prompts"] > 0
    with pytest.raises(SystemExit):
        vocab.main(["--models", str(tmp_path / "nothing"), "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--models" in err[0] and "model_index.json" in err[0]
