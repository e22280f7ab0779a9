"""Issue 54, the fifth fault audit: what a run reads (items 4, 5 and 11). Each bad outcome it found, as a test that
failed before its fix, numbered as in the issue:

4. a resume checks every file it trained on (prompt files, reward files, edit sources) against the content hash
   recorded at the run's start, and refuses a changed one unless told to take it (then resumes.jsonl says so);
5. every GenEval record is checked against its tag's schema before any model loads;
11. a prompt or data file that is not UTF-8 is one line naming the file, the line and the byte.
"""

import json
import os

import pytest

from ddpo_group.data.prompts import load_prompts
from ddpo_group.rewards.geneval.metadata import GenEvalFormatError, read_metadata

from helpers import make_config

POSITION = {"tag": "position", "prompt": "a photo of a dog right of a cat",
            "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}]}


# 11. a file that is not UTF-8: one line naming the file, the line and the byte (never a bare UnicodeDecodeError)
def _latin1(path, lines):
    """`lines` written in Latin-1 (an é is the single byte 0xe9, which UTF-8 never starts a character with)."""
    path.write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    return path


def _one_line_naming(message, path, line, byte="0xe9"):
    assert "\n" not in message
    assert f"{path}, line {line}" in message and f"byte {byte}" in message and "UTF-8" in message, message


@pytest.mark.parametrize("name, lines", [
    ("prompts.txt", ["a cat", "# a comment", "a caf\xe9 table"]),
    ("prompts.jsonl", ['{"prompt": "a cat"}', "", '{"prompt": "a caf\xe9 table"}']),
    ("prompts.json", ['["a cat",', ' "a dog",', ' "a caf\xe9 table"]']),
])
def test_a_prompt_file_that_is_not_utf8_names_the_file_the_line_and_the_byte(tmp_path, name, lines):
    path = _latin1(tmp_path / name, lines)
    with pytest.raises(ValueError) as info:
        load_prompts(str(path))
    _one_line_naming(str(info.value), path, 3)
    assert not isinstance(info.value, UnicodeDecodeError)


def test_a_geneval_metadata_file_that_is_not_utf8_names_the_file_the_line_and_the_byte(tmp_path):
    record = dict(POSITION, prompt="a photo of a dog right of a caf\xe9")
    path = _latin1(tmp_path / "evaluation_metadata.jsonl", [json.dumps(POSITION), json.dumps(record, ensure_ascii=False)])
    with pytest.raises(GenEvalFormatError) as info:
        read_metadata(str(path))
    _one_line_naming(str(info.value), path, 2)


def test_the_byte_offset_counts_a_byte_order_mark(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfab\ncd\xff\n")  # the BOM is 3 bytes, "ab\n" 3 more, "cd" 2: 0xff at offset 8
    with pytest.raises(ValueError) as info:
        load_prompts(str(path))
    _one_line_naming(str(info.value), path, 2, byte="0xff")
    assert "offset 8" in str(info.value)


def test_an_editing_prompt_file_that_is_not_utf8_is_named(tmp_path):
    path = _latin1(tmp_path / "edits.jsonl", ['{"prompt": "make it caf\xe9", "source_image": "a.png"}'])
    with pytest.raises(ValueError) as info:
        load_prompts(str(path))
    _one_line_naming(str(info.value), path, 1)


def test_a_geneval_image_folders_metadata_that_is_not_utf8_is_named(tmp_path):
    from ddpo_group.evaluation.protocols import read_geneval_folder

    folder = tmp_path / "images" / "00000"
    (folder / "samples").mkdir(parents=True)
    _latin1(folder / "metadata.jsonl", [json.dumps(dict(POSITION, prompt="caf\xe9"), ensure_ascii=False)])
    with pytest.raises(GenEvalFormatError) as info:
        read_geneval_folder(str(tmp_path / "images"))
    _one_line_naming(str(info.value), folder / "metadata.jsonl", 1)


# 5. every GenEval record is checked against its tag's schema: known keys, the tag's clauses, satisfiable clauses
# (djghosh13/geneval prompts/create_prompts.py writes each tag's clauses; evaluate_images.py reads only the clauses)
def _refused(record, *words):
    from ddpo_group.rewards.geneval.metadata import check_record

    with pytest.raises(GenEvalFormatError) as info:
        check_record(record, "F, line 7")
    message = str(info.value)
    assert message.startswith("F, line 7: ") and "\n" not in message
    for word in words:
        assert word in message, message
    return message


def _clause(**fields):
    return {"class": "dog", "count": 1, **fields}


GENEVAL_RECORDS = [  # one record of each tag as GenEval's create_prompts.py writes it
    {"tag": "single_object", "prompt": "a photo of a dog", "include": [_clause()]},
    {"tag": "two_object", "prompt": "a photo of a dog and a cat", "include": [_clause(), _clause(**{"class": "cat"})]},
    {"tag": "counting", "prompt": "a photo of three dogs", "include": [_clause(count=3)],
     "exclude": [_clause(count=4)]},
    {"tag": "colors", "prompt": "a photo of a red dog", "include": [_clause(color="red")]},
    POSITION,
    {"tag": "color_attr", "prompt": "a photo of a red dog and a blue cat",
     "include": [_clause(color="red"), _clause(**{"class": "cat", "color": "blue"})]},
]


@pytest.mark.parametrize("record", GENEVAL_RECORDS, ids=lambda r: r["tag"])
def test_each_tags_record_as_geneval_writes_it_is_accepted(record):
    from ddpo_group.rewards.geneval.metadata import check_record

    assert check_record(record, "F, line 1")["include"] == record["include"]


def test_an_unknown_key_in_an_include_clause_is_refused_with_the_closest_name():
    record = {"tag": "colors", "prompt": "a photo of a red dog", "include": [{"class": "dog", "count": 1, "colour": "red"}]}
    _refused(record, "include[0]", "'colour'", "did you mean 'color'?")


def test_an_unknown_key_in_an_exclude_clause_is_refused_with_the_closest_name():
    record = dict(GENEVAL_RECORDS[2], exclude=[{"class": "dog", "cuont": 4}])
    _refused(record, "exclude[0]", "'cuont'", "did you mean 'count'?")


def test_a_misspelt_record_field_is_refused_not_kept_as_metadata():
    record = dict(GENEVAL_RECORDS[2])
    record["exclud"] = record.pop("exclude")  # kept as metadata, "three dogs" would pass with five
    _refused(record, "'exclud'", "did you mean 'exclude'?")


def test_other_record_fields_are_kept():
    from ddpo_group.rewards.geneval.metadata import check_record

    assert check_record(dict(POSITION, data_source="geneval", seed=3), "F")["seed"] == 3


@pytest.mark.parametrize("record, words", [
    # a position record without a position clause would be scored as a two_object one
    ({"tag": "position", "prompt": "a dog right of a cat", "include": [_clause(**{"class": "cat"}), _clause()]},
     ("'position' record", "clause 1 needs 'position'")),
    ({"tag": "position", "prompt": "a dog right of a cat", "include": [_clause(**{"class": "cat"})]},
     ("'position' record has 2 include clauses, got 1",)),
    ({"tag": "colors", "prompt": "a photo of a red dog", "include": [_clause()]}, ("clause 0 needs 'color'",)),
    ({"tag": "single_object", "prompt": "a photo of a red dog", "include": [_clause(color="red")]},
     ("clause 0 has no 'color'",)),
    ({"tag": "two_object", "prompt": "a photo of a dog", "include": [_clause()]}, ("has 2 include clauses, got 1",)),
    ({"tag": "color_attr", "prompt": "a red dog and a cat", "include": [_clause(color="red"), _clause(**{"class": "cat"})]},
     ("clause 1 needs 'color'",)),
    # "three dogs" without the exclude clause {dog, 4} passes with five dogs
    ({"tag": "counting", "prompt": "a photo of three dogs", "include": [_clause(count=3)]},
     ("'counting' record needs the exclude clause", "'count': 4")),
    ({"tag": "counting", "prompt": "a photo of three dogs", "include": [_clause(count=3)], "exclude": [_clause(count=5)]},
     ("'counting' record needs the exclude clause",)),
])
def test_a_record_without_the_clauses_its_tag_asks_for_is_refused(record, words):
    _refused(record, *words)


@pytest.mark.parametrize("record, words", [
    # at least 2 dogs and fewer than 2 dogs
    ({"tag": "two_object", "prompt": "two dogs and a cat", "include": [_clause(count=2), _clause(**{"class": "cat"})],
      "exclude": [_clause(count=2)]}, ("exclude[0]", "include[0]", "no image passes both")),
    # the same detection of a dog cannot be red and blue
    ({"tag": "color_attr", "prompt": "a red dog and a blue dog", "include": [_clause(color="red"), _clause(color="blue")]},
     ("include[0] and include[1]", "no image passes both")),
    # a dog is never right of itself
    ({"tag": "position", "prompt": "a dog right of a dog",
      "include": [_clause(), _clause(position=["right of", 0])]}, ("include[1]", "itself")),
])
def test_clauses_no_image_can_meet_are_refused(record, words):
    _refused(record, *words)


def test_satisfiable_clauses_of_one_class_are_accepted():
    from ddpo_group.rewards.geneval.metadata import check_record

    # two clauses of one class with one colour: the same red dog meets both
    same = {"tag": "color_attr", "prompt": "a red dog and a red dog", "include": [_clause(color="red"), _clause(color="red")]}
    assert check_record(same, "F")


def test_a_metadata_file_names_the_line_of_a_record_its_tag_does_not_fit(tmp_path):
    bad = {"tag": "position", "prompt": "a dog right of a cat", "include": [_clause(**{"class": "cat"}), _clause()]}
    path = tmp_path / "metadata.jsonl"
    path.write_text(json.dumps(POSITION) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(GenEvalFormatError) as info:
        read_metadata(str(path))
    assert str(info.value).startswith(f"{path}, line 3: ")


def test_the_training_config_check_refuses_a_geneval_record_before_any_model_loads(tmp_path):
    from ddpo_group.config.check import check_config
    from ddpo_group.config.registry import ConfigError

    record = {"tag": "colors", "prompt": "a photo of a red dog", "include": [{"class": "dog", "count": 1, "colour": "red"}]}
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(record) + "\n")
    config = make_config(tmp_path, prompt_fn=str(path), reward_fn="geneval")
    config.reward_kwargs = {"geneval": {"detector": "shapes"}}
    with pytest.raises(ConfigError) as info:
        check_config(config)  # the config check: no model is built by it
    assert f"{path}, line 1" in str(info.value) and "did you mean 'color'?" in str(info.value)


# 4. a resume checks every file the run trained on against the sha256 recorded when it started
def _sha256(path):
    import hashlib

    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def prompt_file_run(tmp_path_factory):
    """A 1-epoch run of the tiny test model on a prompt file and a reward file, with its checkpoint_1; each test
    resumes a copy of it."""
    from ddpo_group.training.trainer import train
    from helpers import cheap

    root = tmp_path_factory.mktemp("inputs")
    (root / "prompts.txt").write_text("a red circle\na blue square\n")
    (root / "reward.py").write_text("def score(images, prompts, metadata):\n    return [0.5] * len(prompts), {}\n")
    config = make_config(root, **cheap(prompt_fn=str(root / "prompts.txt"), reward_fn=f"{root / 'reward.py'}:score",
                                       save_freq=1, eval_freq=0))
    train(config)
    return root


def _copy_run(root, tmp_path):
    """The run and its input files copied into tmp_path, its config.json pointed at the copies."""
    import shutil

    shutil.copytree(root, tmp_path / "copy")
    run = tmp_path / "copy" / "r"
    for name in ("config.json", "inputs.json"):
        text = (run / name).read_text().replace(str(root), str(tmp_path / "copy"))
        (run / name).write_text(text)
    return tmp_path / "copy", run


def _resume(copy, run, **overrides):
    from ddpo_group.training.trainer import Trainer
    from helpers import cheap

    given = make_config(copy, **cheap(num_epochs=2, resume_from=str(run), **overrides))
    return Trainer(given, overrides=["num_epochs", "resume_from", *[k.replace("__", ".") for k in overrides]])


def test_a_run_records_the_hash_of_each_file_it_trains_on(prompt_file_run):
    recorded = json.loads((prompt_file_run / "r" / "inputs.json").read_text())["files"]
    assert recorded == {str(prompt_file_run / name): _sha256(prompt_file_run / name) for name in ("prompts.txt", "reward.py")}


def test_a_resume_after_the_prompt_file_was_edited_is_refused_in_one_line_naming_it(prompt_file_run, tmp_path):
    from ddpo_group.config.registry import ConfigError

    copy, run = _copy_run(prompt_file_run, tmp_path)
    (copy / "prompts.txt").write_text("a red circle\na green triangle\n")  # edited in place
    before = {name: (run / name).read_bytes() for name in ("config.json", "metrics.jsonl", "inputs.json")}
    with pytest.raises(ConfigError) as info:
        _resume(copy, run)
    message = str(info.value)
    assert "\n" not in message and str(copy / "prompts.txt") in message and "changed" in message
    assert "new run" in message and "--config.resume_allow_input_changes=True" in message
    assert {name: (run / name).read_bytes() for name in before} == before  # a refused resume changes no file
    assert not (run / "resumes.jsonl").exists()


def test_a_resume_after_the_reward_file_was_edited_is_refused_naming_it(prompt_file_run, tmp_path):
    from ddpo_group.config.registry import ConfigError

    copy, run = _copy_run(prompt_file_run, tmp_path)
    (copy / "reward.py").write_text("def score(images, prompts, metadata):\n    return [1.0] * len(prompts), {}\n")
    with pytest.raises(ConfigError) as info:
        _resume(copy, run)
    assert str(copy / "reward.py") in str(info.value) and str(copy / "prompts.txt") not in str(info.value)


def test_with_the_flag_the_resume_goes_on_and_resumes_jsonl_records_the_change(prompt_file_run, tmp_path):
    copy, run = _copy_run(prompt_file_run, tmp_path)
    old = _sha256(copy / "prompts.txt")
    (copy / "prompts.txt").write_text("a red circle\na green triangle\n")
    new = _sha256(copy / "prompts.txt")
    trainer = _resume(copy, run, resume_allow_input_changes=True)
    trainer.files.release()
    assert [record.prompt for record in trainer.prompts] == ["a red circle", "a green triangle"]
    record = json.loads((run / "resumes.jsonl").read_text())
    assert record["epoch"] == 1 and record["inputs_changed"] == {str(copy / "prompts.txt"): [old, new]}
    # the accepted file is what the next resume compares against
    assert json.loads((run / "inputs.json").read_text())["files"][str(copy / "prompts.txt")] == new


def test_an_unchanged_resume_records_no_input_change(prompt_file_run, tmp_path):
    copy, run = _copy_run(prompt_file_run, tmp_path)
    trainer = _resume(copy, run)
    trainer.files.release()
    assert "inputs_changed" not in json.loads((run / "resumes.jsonl").read_text())  # the row of num_epochs 1 -> 2


def _run_dir_with_checkpoint(tmp_path, config, records=()):
    """A run directory as RunDir.start writes it, with a checkpoint_1 (only its trainer_state.json)."""
    from ddpo_group.runs.run_dir import RunDir

    run_dir, config = RunDir.resolve(config)
    run_dir.start(config, first_epoch=0, records=records)
    run_dir.release()
    checkpoint = tmp_path / "r" / "checkpoints" / "checkpoint_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"epoch": 1, "global_step": 1}))
    return tmp_path / "r"


def test_a_resume_after_an_edit_source_image_changed_is_refused_naming_it(tmp_path):
    from PIL import Image

    from ddpo_group.config.registry import ConfigError
    from ddpo_group.runs.run_dir import RunDir

    source = tmp_path / "red.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(source)
    records = load_prompts([{"prompt": "make it blue", "source_image": str(source)}])
    run = _run_dir_with_checkpoint(tmp_path, make_config(tmp_path, num_epochs=2), records)
    assert json.loads((run / "inputs.json").read_text())["files"] == {str(source): _sha256(source)}
    Image.new("RGB", (8, 8), (0, 255, 0)).save(source)
    with pytest.raises(ConfigError) as info:
        RunDir.resolve(make_config(tmp_path, num_epochs=2, resume_from=str(run)))
    assert str(source) in str(info.value) and "\n" not in str(info.value)


def test_a_gone_input_is_refused_and_a_run_without_recorded_inputs_is_not_checked(tmp_path):
    from ddpo_group.config.registry import ConfigError
    from ddpo_group.runs.run_dir import RunDir

    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    run = _run_dir_with_checkpoint(tmp_path, make_config(tmp_path, num_epochs=2, prompt_fn=str(prompts)))
    prompts.unlink()
    given = make_config(tmp_path, num_epochs=2, prompt_fn=str(prompts), resume_from=str(run))
    with pytest.raises(ConfigError) as info:
        RunDir.resolve(given)
    assert f"{prompts}, which the run" in str(info.value) and "is gone" in str(info.value)
    (run / "inputs.json").unlink()  # a run from before inputs.json was written
    resumed, _ = RunDir.resolve(given)
    assert resumed.input_changes == {}
