"""Issue 43, the fourth fault audit: scripts/evaluate.py and the code under it (the evaluation, the protocols,
GenEval, the OCR reward, edit sources). Each bad outcome it found, as a test that failed before its fix, numbered
as in the issue; G: GenEval's rules against the official evaluator's code."""

import json
import os
import shutil
import struct
import threading
import zlib

import numpy as np
import pytest
import torch
from helpers import cheap, load_script, make_config
from PIL import Image

from ddpo_group.evaluation.protocols import ProtocolError, get_protocol, read_geneval_folder
from ddpo_group.rewards.geneval.protocol import Detection, keep_confident, numpy_argsort
from ddpo_group.rewards.geneval.shapes_scenes import SceneObject as O
from ddpo_group.rewards.geneval.shapes_scenes import render_scene
from ddpo_group.rewards.registry import get_reward, register_reward

SINGLE = {"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": "a circle"}


@pytest.fixture(scope="module")
def evaluate_script():
    return load_script("scripts/evaluate.py")


def geneval_folder(path, images_of_prompts, record=SINGLE):
    """GenEval's layout by hand: NNNNN/metadata.jsonl and NNNNN/samples/NNNN.png, one list of uint8 images per
    prompt."""
    for i, images in enumerate(images_of_prompts):
        samples = path / f"{i:05d}" / "samples"
        samples.mkdir(parents=True)
        (path / f"{i:05d}" / "metadata.jsonl").write_text(json.dumps(record))
        for j, image in enumerate(images):
            Image.fromarray(image).save(samples / f"{j:04d}.png")
    return path


def circle(size=64):
    return render_scene([O("circle", "red", (size / 2, size / 2), size * size / 8)], size=size)


def square(size=64):
    return render_scene([O("square", "blue", (size / 2, size / 2), size * size / 8)], size=size)


def bomb_png(path, side=20000):
    """A PNG whose header claims side x side pixels (400 M at 20000: over twice PIL's MAX_IMAGE_PIXELS) and whose
    data is a few bytes: what a decompression bomb looks like to Image.open, which reads the header only."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)  # 8-bit grayscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0"))
                     + chunk(b"IEND", b""))
    return path


def exit_line(evaluate_script, argv):
    with pytest.raises(SystemExit) as info:
        evaluate_script.run(argv)
    line = str(info.value.code)
    assert "\n" not in line and "Traceback" not in line, line
    return line


# 4. a diverged model (NaN weights) is not scored: one line, no evaluation.json; a NaN flag is refused at once
@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    """The tiny model saved with NaN in every UNet weight: what a diverged checkpoint samples."""
    from ddpo_group.diffusion.policy import load_policy

    policy = load_policy("tiny")
    with torch.no_grad():
        for parameter in policy.pipeline.unet.parameters():
            parameter.fill_(float("nan"))
    path = tmp_path_factory.mktemp("nan") / "model"
    policy.pipeline.save_pretrained(str(path))
    return str(path)


def test_an_evaluation_of_nan_weights_stops_naming_the_first_image_and_writes_nothing(tmp_path, evaluate_script,
                                                                                      nan_model):
    output = tmp_path / "evaluation.json"
    # jpeg_compressibility scores a NaN image as the black one it encodes to: a plausible number
    line = exit_line(evaluate_script, ["--model", nan_model, "--prompts", "shapes_squares.txt", "--reward",
                                       "jpeg_compressibility", "--images-per-prompt", "2", "--num-steps", "2",
                                       "--output", str(output)])
    # every image is NaN: the first one is image 0 of prompt 0
    assert "are not finite (NaN or inf), the first image 0 of prompt 0" in line, line
    assert "earlier checkpoint" in line and not output.exists()
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({**SINGLE, "prompt": "a red circle"}) + "\n")
    line = exit_line(evaluate_script, ["--protocol", "geneval", "--model", nan_model, "--prompts", str(records),
                                       "--protocol-option", "detector=shapes", "--images-per-prompt", "1",
                                       "--num-steps", "2", "--output", str(output)])
    assert "1 of 1 sampled images are not finite (NaN or inf), the first image 0 of prompt 0 'a red circle'" in line
    assert not output.exists() and not (tmp_path / "evaluation_images.jsonl").exists()


@pytest.mark.parametrize("flag", ["--guidance-scale=nan", "--eta=inf", "--eta=-inf", "--guidance-scale=NaN"])
def test_a_non_finite_sampling_flag_is_refused_before_any_model_loads(tmp_path, evaluate_script, flag):
    with pytest.raises(SystemExit) as info:  # argparse's exit: status 2, its one line on stderr
        evaluate_script.run(["--model", str(tmp_path / "no_model"), flag])
    assert info.value.code == 2


def test_a_non_finite_sampling_flag_names_itself(tmp_path, evaluate_script, capsys):
    with pytest.raises(SystemExit):
        evaluate_script.run(["--model", str(tmp_path / "no_model"), "--guidance-scale", "nan"])
    assert "argument --guidance-scale: expected a finite number, got 'nan'" in capsys.readouterr().err


# 7. GenEval's numeric options are checked when the reward is built and when --protocol-option is parsed
BAD_OPTIONS = [
    ("threshold", 30), ("threshold", float("nan")), ("threshold", "abc"), ("threshold", 1.0), ("threshold", -0.1),
    ("counting_threshold", 90), ("counting_threshold", True), ("max_objects", -1), ("max_objects", 0),
    ("max_objects", 2.5), ("max_objects", True), ("position_margin", -0.1), ("position_margin", float("inf")),
    ("jpeg_quality", True), ("jpeg_quality", 101),
]


@pytest.mark.parametrize("field, value", BAD_OPTIONS)
def test_a_bad_geneval_option_in_training_names_its_config_field(field, value):
    from ddpo_group.rewards import build_reward_fn

    with pytest.raises(ValueError) as info:
        build_reward_fn("geneval", reward_kwargs={"geneval": {"detector": "shapes", field: value}})
    message = str(info.value)
    assert "\n" not in message and f"{field}={value!r}" in message and f"reward_kwargs.geneval.{field}" in message


def test_a_percentage_threshold_stops_training_before_the_run_starts(tmp_path):
    from ddpo_group.cli import one_line
    from ddpo_group.training.trainer import train

    config = make_config(tmp_path, variant="tiny_geneval", **cheap())
    config.reward_kwargs.geneval.threshold = 30  # 30 % meant: every detection (score <= 1) would be dropped
    with pytest.raises(ValueError) as info:
        train(config)
    assert "threshold=30 must be a detection score in [0, 1)" in one_line(info.value)
    assert "(config: reward_kwargs.geneval.threshold)" in one_line(info.value) and os.listdir(tmp_path) == []


@pytest.mark.parametrize("field, text", [("threshold", "30"), ("threshold", "NaN"), ("threshold", "abc"),
                                         ("max_objects", "-1"), ("position_margin", "-1"), ("counting_threshold", "1")])
def test_a_bad_geneval_protocol_option_is_one_line_naming_it(tmp_path, evaluate_script, field, text):
    folder = geneval_folder(tmp_path / "images", [[circle()]])
    line = exit_line(evaluate_script, ["--protocol", "geneval", "--images", str(folder), "--protocol-option",
                                       "detector=shapes", "--protocol-option", f"{field}={text}"])
    assert line.startswith("evaluate.py: error: protocol 'geneval': reward 'geneval': ") and f"{field}=" in line
    assert f"--protocol-option {field}=VALUE" in line


def test_geneval_options_in_range_are_taken():
    reward = get_reward("geneval", detector="shapes", threshold=0, counting_threshold=0.5, max_objects=1,
                        position_margin=0, jpeg_quality=100)
    assert (reward.scorer.threshold, reward.scorer.max_objects, reward.jpeg_quality) == (0, 1, 100)
    assert get_protocol("geneval", detector="shapes", threshold=0.5).reward.scorer.threshold == 0.5


# 8. a prompt folder without metadata.jsonl, or a numbered plain file, stops the evaluation naming it
def test_a_prompt_folder_without_its_metadata_is_refused_naming_it(tmp_path, evaluate_script):
    folder = geneval_folder(tmp_path / "images", [[circle()], [circle()]])
    (folder / "00001" / "metadata.jsonl").unlink()
    line = exit_line(evaluate_script, ["--protocol", "geneval", "--images", str(folder), "--protocol-option",
                                       "detector=shapes"])
    assert f"the prompt folder {folder / '00001'} has no metadata.jsonl" in line


def test_a_numbered_plain_file_in_an_image_folder_is_refused_naming_it(tmp_path):
    folder = geneval_folder(tmp_path / "images", [[circle()]])
    (folder / "00001").write_text("not a folder")
    with pytest.raises(ProtocolError, match=f"{folder / '00001'} is not a folder"):
        read_geneval_folder(str(folder))


# 9. --output is checked before any model loads: never a directory, another file, or a run's own file
def test_an_output_that_is_a_directory_is_refused_before_any_model_loads(tmp_path, evaluate_script):
    (tmp_path / "out").mkdir()
    line = exit_line(evaluate_script, ["--model", str(tmp_path / "no_model"), "--output", str(tmp_path / "out")])
    assert line == (f"evaluate.py: error: --output {tmp_path / 'out'}: is a directory; give a file path, e.g. "
                    f"{tmp_path / 'out' / 'evaluation.json'}")
    images = geneval_folder(tmp_path / "images", [[circle()]])
    line = exit_line(evaluate_script, ["--protocol", "geneval", "--images", str(images), "--protocol-option",
                                       "detector=shapes", "--output", str(tmp_path / "out")])
    assert "is a directory" in line and os.listdir(tmp_path / "out") == []


def test_an_output_that_is_another_file_or_a_runs_own_file_is_refused_and_kept(tmp_path, evaluate_script):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    line = exit_line(evaluate_script, ["--model", str(tmp_path / "no_model"), "--output", str(notes)])
    assert f"{notes} exists and is not an earlier output of evaluate.py" in line
    assert notes.read_text() == '{"mine": 1}'
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"epoch": 0}\n')
    for name in ("metrics.jsonl", "finished.json"):  # an existing one, and one the run writes when it ends
        line = exit_line(evaluate_script, ["--model", str(tmp_path / "no_model"), "--output", str(run / name)])
        assert f"{run / name} is a file of the run in {run}" in line
    assert (run / "metrics.jsonl").read_text() == '{"epoch": 0}\n' and not (run / "finished.json").exists()


def test_an_earlier_output_is_replaced(tmp_path, evaluate_script):
    images = geneval_folder(tmp_path / "images", [[circle(), square()]])
    output = tmp_path / "geneval.json"
    argv = ["--protocol", "geneval", "--images", str(images), "--protocol-option", "detector=shapes", "--output",
            str(output)]
    evaluate_script.main(argv)
    (images / "00000" / "samples" / "0001.png").unlink()  # the second evaluation sees one image: 1 of 1 correct
    evaluate_script.main(argv)
    assert json.loads(output.read_text())["num_images"] == 1
    assert len((tmp_path / "geneval_images.jsonl").read_text().splitlines()) == 1


# 10. --protocol ocr checks the prompts' text before any model loads; an ocr_text that is a number is refused
def test_the_ocr_protocol_checks_quoted_text_before_any_model_loads(tmp_path, evaluate_script):
    prompts = tmp_path / "signs.txt"
    prompts.write_text('a sign that says "open"\na poster of a cat\n')
    # the OCR model (GOT-OCR2 from the hub) is not here: the prompt is named first
    line = exit_line(evaluate_script, ["--protocol", "ocr", "--prompts", str(prompts), "--model",
                                       str(tmp_path / "no_model")])
    assert f"prompt file '{prompts}', line 2 has no quoted text to render" in line, line


def test_an_ocr_text_that_is_not_a_string_is_refused_naming_the_field(tmp_path, evaluate_script):
    from ddpo_group.data.prompts import PromptRecord
    from ddpo_group.rewards.base import RewardError
    from ddpo_group.rewards.ocr import OcrReward

    prompts = tmp_path / "signs.jsonl"
    prompts.write_text(json.dumps({"prompt": 'a sign that says "open"', "ocr_text": 42}) + "\n")
    line = exit_line(evaluate_script, ["--protocol", "ocr", "--prompts", str(prompts), "--model",
                                       str(tmp_path / "no_model")])
    assert "field 'ocr_text' must be a string (the text to render), got 42" in line, line
    with pytest.raises(RewardError, match="field 'ocr_text' must be a string"):
        OcrReward().targets(['a sign that says "open"'], [{"ocr_text": 42}])
    OcrReward.check_prompts([PromptRecord("a sign", {"ocr_text": "open"})])  # a string is the target


# 13. images of different sizes are scored; unreadable images and edit sources name their file; a FIFO never blocks
def test_a_geneval_folder_with_images_of_different_sizes_is_scored(tmp_path, evaluate_script):
    # prompt 0: a 64 px circle (correct) and a 48 px square (not); prompt 1: a 32 px circle (correct)
    folder = geneval_folder(tmp_path / "images", [[circle(64), square(48)], [circle(32)]])
    summary = evaluate_script.main(["--protocol", "geneval", "--images", str(folder), "--protocol-option",
                                    "detector=shapes", "--batch-size", "8"])
    assert summary["num_images"] == 3 and summary["correct_images"] == pytest.approx(2 / 3)


def test_a_decompression_bomb_in_a_geneval_folder_is_named(tmp_path, evaluate_script):
    folder = geneval_folder(tmp_path / "images", [[circle()]])
    bomb = bomb_png(folder / "00000" / "samples" / "0001.png")
    line = exit_line(evaluate_script, ["--protocol", "geneval", "--images", str(folder), "--protocol-option",
                                       "detector=shapes"])
    assert line.startswith(f"evaluate.py: error: {bomb}: cannot be read as an image (DecompressionBombError: ")


def test_an_edit_source_that_is_a_decompression_bomb_names_field_and_file(tmp_path):
    from ddpo_group.data.edit_sources import read_source_image

    bomb = bomb_png(tmp_path / "source.png")
    with pytest.raises(ValueError) as info:
        read_source_image(str(bomb), "prompt 'a cat'", 64)
    assert str(info.value).startswith(f"prompt 'a cat': field 'source_image' '{bomb}' cannot be read as an image "
                                      "(DecompressionBombError: ")


def test_an_edit_source_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    from ddpo_group.data.edit_sources import check_edit_prompts
    from ddpo_group.data.prompts import PromptRecord

    fifo = tmp_path / "source.png"
    os.mkfifo(fifo)
    outcome = []

    def check():
        try:
            check_edit_prompts([PromptRecord("a cat", {"source_image": str(fifo)})], True, 64, "prompt_fn", "kontext")
        except ValueError as err:
            outcome.append(str(err))

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # it blocked in open(): a writer end lets it go on, and the test fails
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
    assert outcome == [f"config.prompt_fn: prompt 'a cat': field 'source_image' '{fifo}' is not a regular file; "
                       "give an image file"]


# 15. a checkpoint that the live run prunes during the evaluation: the result goes to the run directory
PRUNED = {}


@register_reward("prune_while_scored")
def prune_while_scored(images, prompts, metadata):
    """Score 0.5; on its first call save a newer checkpoint and prune to one, as a live run with
    num_checkpoint_limit=1 does (run_dir._prune_checkpoints, the trainer's own)."""
    from ddpo_group.runs.run_dir import _prune_checkpoints

    root = PRUNED.pop("root", None)
    if root:
        shutil.copytree(os.path.join(root, "checkpoint_1"), os.path.join(root, "checkpoint_2"))
        _prune_checkpoints(root, 1)
    return [0.5] * len(prompts), {}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from ddpo_group.training.trainer import train

    return train(make_config(tmp_path_factory.mktemp("run"), **cheap(eval_freq=0)))


def test_the_result_survives_a_checkpoint_pruned_during_the_evaluation(trained_run, tmp_path, evaluate_script, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    PRUNED["root"] = str(run / "checkpoints")
    checkpoint = run / "checkpoints" / "checkpoint_1"
    summary = evaluate_script.main(["--checkpoint", str(checkpoint), "--reward", "prune_while_scored",
                                    "--images-per-prompt", "1"])
    assert not checkpoint.exists() and (run / "checkpoints" / "checkpoint_2").is_dir()
    written = json.loads((run / "checkpoint_1_evaluation.json").read_text())
    assert written["mean"] == 0.5 == summary["mean"] and written["model"] == str(checkpoint)
    assert f"wrote {run / 'checkpoint_1_evaluation.json'}" in capsys.readouterr().out
    assert not [n for n in os.listdir(run) if ".tmp" in n]


def test_a_protocol_result_of_a_pruned_checkpoint_goes_to_the_run_directory(tmp_path, evaluate_script):
    from ddpo_group.evaluation.protocols import write_protocol_results

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    gone = run / "checkpoints" / "checkpoint_3"  # pruned before the evaluation ended
    summary = {"protocol": "geneval", "model": str(gone), "prompts": "records.jsonl", "overall": 0.5}
    rows = [{"prompt_index": 0, "image_index": 0, "correct": True}]

    def write(path):
        return write_protocol_results(path, summary, rows)

    written = evaluate_script.write_result(None, str(gone), str(run), "protocol_geneval.json", write)
    assert written == str(run / "checkpoint_3_protocol_geneval.json")
    assert json.loads((run / "checkpoint_3_protocol_geneval.json").read_text()) == summary
    assert (run / "checkpoint_3_protocol_geneval_images.jsonl").read_text() == json.dumps(rows[0]) + "\n"
    shutil.rmtree(run)  # the whole run removed: one line, nothing written anywhere
    with pytest.raises(evaluate_script.EvaluateError, match="and its run directory were removed during the evaluation"):
        evaluate_script.write_result(None, str(gone), str(run), "protocol_geneval.json", write)
    assert os.listdir(tmp_path) == []


# G. GenEval's choice of detections as its evaluate_images.py makes it (float32 scores, numpy 1.23's argsort)
def box_at(x, score=1.0):
    return Detection((x, 0.0, x + 8.0, 8.0), score)


def test_equal_scores_are_taken_in_reverse_detector_order_up_to_16():
    # numpy 1.23 insertion-sorts at most 16 values: stable, so argsort(scores)[::-1] reverses equal scores
    found = [box_at(x) for x in range(5)]
    assert [d.box[0] for d in keep_confident({"circle": found}, "single_object")["circle"]] == [4, 3, 2, 1, 0]
    # 0.5, 0.8, 0.5, 0.8: stable ascending order 0, 2, 1, 3; reversed 3, 1, 2, 0
    mixed = [box_at(0, 0.5), box_at(1, 0.8), box_at(2, 0.5), box_at(3, 0.8)]
    assert [d.box[0] for d in keep_confident({"circle": mixed}, "colors")["circle"]] == [3, 1, 2, 0]
    assert numpy_argsort([1.0, 1.0, 0.0, 0.0]) == [2, 3, 0, 1]


def test_eighteen_equal_scores_follow_numpys_quicksort_partition():
    # 18 equal values: one partition of [0, 17]. Median of 0, 8, 17 swaps nothing; the pivot (index 8) goes to
    # position 16; i and j meet in the middle swapping (1, 15) ... (7, 9); the pivot comes back to position 8:
    # 0, 15, 14, ..., 9, 8, 7, ..., 1, 16, 17; both sides (<= 16 long) are insertion-sorted: unchanged.
    expected = [0, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 16, 17]
    assert numpy_argsort([1.0] * 18) == expected
    kept = keep_confident({"circle": [box_at(x) for x in range(18)]}, "single_object")["circle"]
    assert [d.box[0] for d in kept] == expected[::-1][:16]  # 17, 16, 1, 2, ..., 14


def test_the_shapes_world_checks_the_colour_of_the_last_detected_object():
    # the shapes detector lists objects by palette colour (red before blue), every score 1.0: GenEval checks the
    # blue square for "a blue square", so the image is correct (the red square was checked before)
    reward = get_reward("geneval", detector="shapes", score="correct")
    scene = render_scene([O("square", "blue", (48, 32), 120), O("square", "red", (16, 32), 120)])
    record = {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "blue"}]}
    pixels = torch.from_numpy(scene[None]).permute(0, 3, 1, 2).float() / 255
    rewards, _ = reward(pixels, ["a blue square"], [record])
    assert rewards.tolist() == [1.0]
    # "a square left of a circle": the blue square (right of the circle) is the one checked: wrong
    scene = render_scene([O("square", "red", (10, 32), 64), O("circle", "green", (32, 32), 64),
                          O("square", "blue", (54, 32), 64)])
    record = {"tag": "position", "include": [{"class": "circle", "count": 1},
                                             {"class": "square", "count": 1, "position": ["left of", 0]}]}
    pixels = torch.from_numpy(scene[None]).permute(0, 3, 1, 2).float() / 255
    result = reward.results(pixels, ["a square left of a circle"], [record])[0]
    assert result["correct"] is False and "expected square left of target, found right of" in result["reason"]


def test_a_score_of_float32_point_three_is_not_above_the_threshold():
    # float32(0.3) = 0.300000011920928955078125; GenEval compares its float32 scores with 0.3 in float32, where
    # 0.3 is that same number: not greater, dropped. The next float32 above it passes.
    at = float(np.float32(0.3))
    above = float(np.nextafter(np.float32(0.3), np.float32(1)))
    assert at > 0.3  # in float64 it would pass
    kept = keep_confident({"circle": [box_at(0, at), box_at(1, above)]}, "single_object")
    assert [d.box[0] for d in kept["circle"]] == [1]
    # a float64 score that rounds to float32(0.9) is not above the counting threshold either
    assert keep_confident({"circle": [box_at(0, 0.9000000001)]}, "counting") == {}
