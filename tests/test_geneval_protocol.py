"""GenEval end to end: scripts/evaluate.py --protocol geneval on shapes-world scenes whose table is known, the
registered reward geneval, the transformers detector and colour classifier on tiny random models, the
tiny_geneval variant's two epochs and its protocol evaluation, and the report's HTML fragment."""

import json
import os
import re

import numpy as np
import pytest
import torch
from helpers import load_script, make_config, pil_jpeg_kb, tiny_clip_model
from PIL import Image

from ddpo_group.evaluation.protocol_report import protocol_tables_html
from ddpo_group.evaluation.protocols import ProtocolError, get_protocol
from ddpo_group.rewards.base import RewardError, RewardNotReadyError
from ddpo_group.rewards.geneval.protocol import Detection
from ddpo_group.rewards.geneval.shapes_scenes import SceneObject as O
from ddpo_group.rewards.geneval.shapes_scenes import render_scene
from ddpo_group.rewards.registry import get_reward

# One record per GenEval tag in the shapes world's words, and scenes that satisfy it or not.
RECORDS = {
    "single_object": {"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": "a circle"},
    "two_object": {"tag": "two_object", "include": [{"class": "circle", "count": 1}, {"class": "square", "count": 1}],
                   "prompt": "a circle and a square"},
    "counting": {"tag": "counting", "include": [{"class": "triangle", "count": 3}],
                 "exclude": [{"class": "triangle", "count": 4}], "prompt": "three triangles"},
    "colors": {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "blue"}], "prompt": "a blue square"},
    "position": {"tag": "position", "include": [{"class": "circle", "count": 1},
                                                {"class": "square", "count": 1, "position": ["left of", 0]}],
                 "prompt": "a square left of a circle"},
    "color_attr": {"tag": "color_attr", "include": [{"class": "circle", "count": 1, "color": "red"},
                                                    {"class": "square", "count": 1, "color": "yellow"}],
                   "prompt": "a red circle and a yellow square"},
}
TRIANGLES = [(14, 14), (50, 14), (14, 50), (50, 50)]
SCENES = {  # tag -> (a scene GenEval calls correct, one it calls incorrect)
    "single_object": ([O("circle", "red", (32, 32), 150)], [O("square", "blue", (32, 32), 150)]),
    "two_object": ([O("circle", "red", (16, 32), 120), O("square", "blue", (48, 32), 120)],
                   [O("circle", "red", (16, 32), 120), O("circle", "green", (48, 32), 120)]),
    "counting": ([O("triangle", "green", c, 90) for c in TRIANGLES[:3]],
                 [O("triangle", "green", c, 90) for c in TRIANGLES]),
    "colors": ([O("square", "blue", (32, 32), 150)], [O("square", "green", (32, 32), 150)]),
    "position": ([O("square", "cyan", (16, 32), 120), O("circle", "red", (48, 32), 120)],
                 [O("circle", "red", (16, 32), 120), O("square", "cyan", (48, 32), 120)]),
    "color_attr": ([O("circle", "red", (16, 32), 120), O("square", "yellow", (48, 32), 120)],
                   [O("circle", "yellow", (16, 32), 120), O("square", "red", (48, 32), 120)]),
}
# correct images out of 4 per tag -> the table by hand: scores 1, .75, .5, .25, 0, .5; overall 3 / 6 = 0.5;
# 12 of 24 images correct; 5 of 6 prompts have a correct image (position has none)
CORRECT_OF_FOUR = {"single_object": 4, "two_object": 3, "counting": 2, "colors": 1, "position": 0, "color_attr": 2}


def write_geneval_folder(path):
    """GenEval's image layout (its README): NNNNN/metadata.jsonl and NNNNN/samples/NNNN.png, written here by hand."""
    for i, tag in enumerate(RECORDS):
        samples = path / f"{i:05d}" / "samples"
        samples.mkdir(parents=True)
        (path / f"{i:05d}" / "metadata.jsonl").write_text(json.dumps(RECORDS[tag]))
        good, bad = SCENES[tag]
        for j in range(4):
            Image.fromarray(render_scene(good if j < CORRECT_OF_FOUR[tag] else bad)).save(samples / f"{j:04d}.png")
    return str(path)


@pytest.fixture(scope="module")
def evaluate_script():
    return load_script("scripts/evaluate.py")


def test_evaluate_protocol_geneval_prints_the_known_table(tmp_path, evaluate_script, capsys):
    folder = write_geneval_folder(tmp_path / "images")
    output = tmp_path / "out" / "geneval.json"
    output.parent.mkdir()
    evaluate_script.main(["--protocol", "geneval", "--images", folder, "--protocol-option", "detector=shapes",
                          "--output", str(output)])
    printed = capsys.readouterr().out
    for line in (r"single_object +1\.0000 +4 / 4", r"two_object +0\.7500 +3 / 4", r"counting +0\.5000 +2 / 4",
                 r"colors +0\.2500 +1 / 4", r"position +0\.0000 +0 / 4", r"color_attr +0\.5000 +2 / 4",
                 r"overall +0\.5000", r"% correct images +50\.00% of 24", r"% correct prompts +83\.33% of 6"):
        assert re.search(line, printed), line
    summary = json.loads(output.read_text())
    assert summary["overall"] == 0.5 and summary["correct_images"] == 0.5
    assert summary["correct_prompts"] == pytest.approx(5 / 6)
    assert {tag: row["correct"] for tag, row in summary["tags"].items()} == CORRECT_OF_FOUR
    rows = [json.loads(line) for line in (tmp_path / "out" / "geneval_images.jsonl").read_text().splitlines()]
    assert len(rows) == 24
    position = [r for r in rows if r["tag"] == "position"]
    assert all("expected square left of target" in r["reason"] for r in position)
    # Flow-GRPO's partial score of the swapped position scene: [1], [1, 0, 1] -> 0.75
    assert [r["partial_score"] for r in position] == [0.75] * 4


def test_a_wrong_format_evaluation_file_is_one_line_before_any_model_loads(tmp_path, evaluate_script):
    bad = tmp_path / "evaluation_metadata.jsonl"
    bad.write_text(json.dumps(RECORDS["colors"]) + "\n" + json.dumps({"tag": "colors", "prompt": "x"}) + "\n")
    with pytest.raises(SystemExit) as err:  # the model path does not exist: the records fail first
        evaluate_script.run(["--protocol", "geneval", "--prompts", str(bad), "--model", str(tmp_path / "no_model"),
                             "--protocol-option", "detector=shapes"])
    message = str(err.value.code)
    assert "\n" not in message and f"{bad}, line 2" in message and "'include'" in message
    words = tmp_path / "coco.jsonl"  # a COCO class the shapes detector never finds
    words.write_text(json.dumps({"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a dog"}))
    with pytest.raises(SystemExit, match="class 'dog' is not one the detector finds"):
        evaluate_script.run(["--protocol", "geneval", "--prompts", str(words), "--protocol-option", "detector=shapes"])


def test_an_evaluation_file_with_a_seventh_tag_is_refused_naming_file_and_line(tmp_path, evaluate_script):
    # GenEval's overall score is the mean over its six tags: a seventh would enter it
    bad = tmp_path / "tags.jsonl"
    bad.write_text(json.dumps({"tag": "weird_tag", "include": [{"class": "square", "count": 1}],
                               "prompt": "a photo of a square"}) + "\n")
    with pytest.raises(SystemExit) as err:
        evaluate_script.run(["--protocol", "geneval", "--prompts", str(bad), "--model", str(tmp_path / "no_model"),
                             "--protocol-option", "detector=shapes"])
    message = str(err.value.code)
    assert "\n" not in message and f"{bad}, line 1" in message and "tag 'weird_tag' is not one of" in message


def test_missing_detector_weights_and_unknown_names_are_one_line(tmp_path, evaluate_script):
    records = tmp_path / "m.jsonl"
    records.write_text(json.dumps({"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a"}))
    missing = str(tmp_path / "mask2former")
    with pytest.raises(SystemExit) as err:
        evaluate_script.run(["--protocol", "geneval", "--prompts", str(records), "--protocol-option",
                             f"detector_model={missing}"])
    assert "\n" not in str(err.value.code) and "detector_model=" in str(err.value.code) and "does not exist" in str(err.value.code)
    with pytest.raises(SystemExit, match="unknown protocol 'genevel'; protocols: geneval, geneval2, ocr"):
        evaluate_script.run(["--protocol", "genevel", "--prompts", str(records)])
    with pytest.raises(ValueError, match="score='soft' is not one of"):
        get_reward("geneval", score="soft")
    with pytest.raises(ProtocolError, match="detector='yolo'"):
        get_protocol("geneval", detector="yolo")


def test_a_reward_mean_protocol_needs_its_reward_registered():
    from ddpo_group.evaluation.protocols import RewardMeanProtocol

    with pytest.raises(ProtocolError, match="reward 'no_such_reward', which is not registered"):
        RewardMeanProtocol("no_such_reward")


def test_the_ocr_protocol_averages_the_ocr_reward_over_images():
    from ddpo_group.data.prompts import PromptRecord
    from ddpo_group.rewards.ocr import Recogniser

    class Reads(Recogniser):  # a recogniser whose answers are known: the protocol's arithmetic is what is tested
        def load(self):
            pass

        def read(self, images):
            return ["OPEN sesame", "clsed"][: len(images)]

    protocol = get_protocol("ocr")
    protocol.reward.recogniser = Reads()
    records = [PromptRecord('a sign that says "open"', {}), PromptRecord('a door with "CLOSED now" on it', {})]
    results = protocol.score(torch.zeros(2, 3, 8, 8), records)
    # "open" is inside "opensesame": distance 0; "closednow" -> "clsed": delete o, n, o, w = 4 of 9 characters
    assert [r["reward"] for r in results] == pytest.approx([1.0, 1 - 4 / 9])
    summary = protocol.summarize(results)
    assert summary["mean"] == pytest.approx((1.0 + 5 / 9) / 2)
    assert (summary["num_images"], summary["num_prompts"]) == (2, 2)


def test_a_reward_mean_protocol_is_the_mean_of_its_rewards_per_image():
    from ddpo_group.evaluation.protocols import RewardMeanProtocol
    from ddpo_group.data.prompts import PromptRecord

    protocol = RewardMeanProtocol("jpeg_incompressibility")
    pixels = np.random.default_rng(0).integers(0, 256, size=(3, 16, 16, 3), dtype=np.uint8)
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255
    results = protocol.score(images, [PromptRecord("a", {}), PromptRecord("a", {}), PromptRecord("b", {})])
    expected = pil_jpeg_kb(pixels)
    assert [r["reward"] for r in results] == pytest.approx(list(expected))
    summary = protocol.summarize(results)
    assert summary["mean"] == pytest.approx(float(np.mean(expected))) and summary["num_prompts"] == 2


# ---- the reward


def scene_batch(*scenes):
    return torch.from_numpy(np.stack([render_scene(s) for s in scenes])).permute(0, 3, 1, 2).float() / 255


def test_the_geneval_reward_scores_partial_strict_or_correct():
    attr = RECORDS["color_attr"]
    meta = {k: v for k, v in attr.items() if k != "prompt"}
    good, bad = SCENES["color_attr"]
    images = scene_batch(good, bad)
    rewards, info = get_reward("geneval", detector="shapes")(images, [attr["prompt"]] * 2, [meta, meta])
    # the swapped colours: each clause's count term 1 and colour term 0 -> (1 + 0 + 1 + 0) / 4
    assert list(rewards) == [1.0, 0.5]
    assert list(info["correct"]) == [1.0, 0.0] and list(info["strict_correct"]) == [1.0, 0.0]
    three = dict(RECORDS["counting"])
    three_meta = {k: v for k, v in three.items() if k != "prompt"}
    four_triangles = scene_batch(SCENES["counting"][1])
    # four triangles for three: partial 1 - 1/3; strict and GenEval's verdict 0
    partial, _ = get_reward("geneval", detector="shapes")(four_triangles, ["t"], [three_meta])
    strict, _ = get_reward("geneval", detector="shapes", score="strict")(four_triangles, ["t"], [three_meta])
    assert partial[0] == pytest.approx(2 / 3) and strict[0] == 0.0


def test_a_prompt_without_a_geneval_record_is_a_one_line_reward_error():
    with pytest.raises(RewardError) as err:
        get_reward("geneval", detector="shapes")(scene_batch([]), ["a red circle"], [{}])
    assert "\n" not in str(err.value) and "no GenEval metadata" in str(err.value)


# ---- transformers: a tiny random Mask2Former and CLIP


LABELS = ["person", "mouse", "remote", "dog"]


@pytest.fixture(scope="module")
def tiny_mask2former(tmp_path_factory):
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    from ddpo_group.rewards.geneval.detectors import _load_processor

    torch.manual_seed(0)
    backbone = SwinConfig(embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4, image_size=64,
                          out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=backbone, hidden_dim=32, num_queries=6, encoder_layers=1,
                               decoder_layers=2, feature_size=32, mask_feature_size=32, encoder_feedforward_dim=32,
                               dim_feedforward=32, num_attention_heads=2, num_labels=len(LABELS),
                               id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})
    path = tmp_path_factory.mktemp("mask2former")
    Mask2FormerForUniversalSegmentation(config).eval().save_pretrained(path)
    import transformers

    processor_class = getattr(transformers, "Mask2FormerImageProcessorPil", transformers.Mask2FormerImageProcessor)
    processor_class(size={"shortest_edge": 64, "longest_edge": 128}, size_divisor=32).save_pretrained(path)
    assert _load_processor(transformers, str(path)) is not None
    return str(path)


def test_the_mask2former_detector_loads_from_a_directory_and_post_processes(tiny_mask2former):
    from ddpo_group.rewards.geneval.detectors import Mask2FormerDetector

    detector = Mask2FormerDetector(tiny_mask2former)
    images = np.random.default_rng(0).integers(0, 256, size=(2, 40, 56, 3), dtype=np.uint8)
    found = detector.detect(images)
    assert detector.classes == ("person", "computer mouse", "tv remote", "dog")  # GenEval's names
    for per_image in found:
        detections = [d for v in per_image.values() for d in v]
        assert len(detections) == 6 * 4  # every (query, class) pair: fewer than the top 100
        for d in detections:
            assert d.mask.shape == (40, 56) and 0 <= d.score <= 1
            if d.mask.any():  # the box is the mask's extent
                ys, xs = np.nonzero(d.mask)
                assert d.box == (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
        # score = class probability x mean sigmoid inside the mask <= the class probability; their sum over
        # classes of one query is below 1 (the "no object" class takes the rest)
        assert sum(d.score for d in detections) < 6


def tiny_clip_parts():
    from ddpo_group.diffusion.tiny import build_tiny_tokenizer

    return tiny_clip_model(0), build_tiny_tokenizer()


def test_the_clip_colour_classifier_is_zero_shot_over_the_templates():
    from ddpo_group.rewards.geneval.detectors import ClipColorClassifier

    model, tokenizer = tiny_clip_parts()
    classifier = ClipColorClassifier(model, tokenizer)
    image = np.zeros((20, 30, 3), dtype=np.uint8)
    image[5:15, 10:20] = (200, 30, 30)
    mask = np.zeros((20, 30), dtype=bool)
    mask[5:15, 10:15] = True
    detection = Detection((9.6, 4.6, 20.4, 15.4), 0.9, mask)  # rounds to x 10..20, y 5..15
    crop = classifier.crop(image, detection)
    assert crop.shape == (10, 10, 3)
    assert (crop[:, :5] == (200, 30, 30)).all() and (crop[:, 5:] == 0x99).all()  # outside the mask: #999 grey
    (color,) = classifier.classify(image, [detection], "dog")
    # independently: the normalised mean of the normalised template embeddings per colour, cosine, argmax
    with torch.no_grad():
        texts = [t.format(c=c, cls="dog") for c in classifier.colors for t in classifier.templates]
        tokens = tokenizer(texts, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
        text = model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        text = getattr(text, "pooler_output", text)
        text = torch.nn.functional.normalize(text, dim=-1).view(10, 3, -1).mean(1)
        text = torch.nn.functional.normalize(text, dim=-1)
        from ddpo_group.rewards.clip_models import clip_preprocess

        pixels = clip_preprocess(torch.from_numpy(crop).permute(2, 0, 1)[None].float() / 255, 32)
        embed = model.get_image_features(pixel_values=pixels)
        embed = torch.nn.functional.normalize(getattr(embed, "pooler_output", embed), dim=-1)
    assert color == classifier.colors[int((embed @ text.T).argmax())]


def test_the_geneval_reward_runs_on_the_tiny_transformers_detector(tiny_mask2former):
    model, tokenizer = tiny_clip_parts()
    reward = get_reward("geneval", detector_model=tiny_mask2former, clip_model=model, clip_tokenizer=tokenizer,
                        score="correct")
    reward.check_ready()
    record = {"tag": "color_attr", "include": [{"class": "dog", "count": 1, "color": "red"},
                                               {"class": "tv remote", "count": 1, "color": "blue"}]}
    images = torch.rand(2, 3, 40, 40, generator=torch.Generator().manual_seed(0))
    rewards, info = reward(images, ["p", "p"], [record, record])
    assert rewards.shape == (2,) and set(rewards) <= {0.0, 1.0} and set(info) == {"partial_score", "strict_correct", "correct"}
    with pytest.raises(RewardError, match="class 'cat' is not one the detector finds"):
        reward(images[:1], ["p"], [{"tag": "single_object", "include": [{"class": "cat", "count": 1}]}])


def test_missing_transformers_weights_are_a_one_line_not_ready_error(tmp_path):
    reward = get_reward("geneval", detector_model="facebook/not-a-downloaded-model", clip_model=str(tmp_path))
    with pytest.raises(RewardNotReadyError) as err:
        reward.check_ready()
    assert "\n" not in str(err.value) and "detector_model" in str(err.value)


# ---- the variant tiny_geneval and the report


def test_tiny_geneval_trains_two_epochs_and_is_evaluated_with_the_protocol(tmp_path, evaluate_script, capsys):
    from ddpo_group.training.trainer import train

    config = make_config(tmp_path, "tiny_geneval", num_epochs=2, save_freq=2, eval_freq=0, log_images_every=0,
                         sample__num_steps=2, sample__batch_size=4, sample__num_batches_per_epoch=1,
                         sample__group_size=2, train__batch_size=4)
    run_dir = train(config)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [row["epoch"] for row in rows if "reward_mean" in row] == [0, 1]
    assert any("reward_info/geneval/correct" in row for row in rows)
    capsys.readouterr()
    summary = evaluate_script.main(["--protocol", "geneval", "--checkpoint", run_dir, "--prompts",
                                    "geneval_shapes_squares.jsonl", "--images-per-prompt", "1", "--num-steps", "2"])
    printed = capsys.readouterr().out
    assert "single_object" in printed and "colors" in printed and "% correct prompts" in printed
    assert summary["options"] == {"detector": "shapes", "score": "partial"}  # the run's own detector
    assert summary["num_images"] == 36 and set(summary["tags"]) == {"single_object", "colors"}
    written = os.path.join(run_dir, "checkpoints", "checkpoint_2", "protocol_geneval.json")
    assert json.load(open(written))["overall"] == summary["overall"]
    fragment = protocol_tables_html(run_dir)
    assert "<h2>Protocol geneval</h2>" in fragment and f"<td>{summary['overall']:.3f}</td>" in fragment
    from ddpo_group.report.page import build_report

    assert fragment in build_report(run_dir)  # the HTML report shows the protocol's table


def test_the_report_fragment_shows_each_checkpoints_table(tmp_path):
    assert protocol_tables_html(str(tmp_path)) == ""
    for step, overall in ((10, 0.25), (20, 0.5)):
        folder = tmp_path / "checkpoints" / f"checkpoint_{step}"
        folder.mkdir(parents=True)
        (folder / "protocol_geneval.json").write_text(json.dumps({
            "tags": {"single_object": {"score": 1.0}, "counting": {"score": 0.5}}, "overall": overall,
            "correct_images": 0.125, "correct_prompts": 0.75}))
    (tmp_path / "checkpoints" / "checkpoint_20" / "protocol_ocr.json").write_text(json.dumps(
        {"mean": 0.5, "std": 0.25, "num_images": 8}))
    fragment = protocol_tables_html(str(tmp_path))
    geneval, ocr = fragment.split("<h2>Protocol ocr</h2>")
    rows = [line for line in geneval.splitlines() if line.startswith("<tr><td>")]
    assert rows[0] == ("<tr><td>10</td><td>1.000</td><td>-</td><td>0.500</td><td>-</td><td>-</td><td>-</td>"
                       "<td>0.250</td><td>12.5%</td><td>75.0%</td></tr>")
    assert rows[1].startswith("<tr><td>20</td>") and "<td>0.500</td><td>12.5%</td>" in rows[1]
    assert "<tr><td>20</td><td>0.500</td><td>0.250</td><td>8</td></tr>" in ocr


@pytest.mark.parametrize("variant", ["tiny_geneval", "sd35_geneval", "sd35_nft_geneval"])
def test_the_geneval_variants_pass_the_config_check(tmp_path, variant):
    from ddpo_group.config.check import check_config

    config = check_config(make_config(tmp_path, variant))
    assert config.reward_fn == "geneval"


def test_the_recipes_keep_their_sources_settings():
    from ddpo_group.config import grpo

    flow_grpo, nft = grpo.get_config("sd35_geneval"), grpo.get_config("sd35_nft_geneval")
    # Flow-GRPO geneval_sd3: 10 steps, CFG 4.5, noise 0.7, 24 images per prompt, KL 0.04, eval / save every 60;
    # its reward server receives JPEG (PIL's quality 75); DiffusionNFT scores in-process (no JPEG), CFG-free
    assert (flow_grpo.sample.num_steps, flow_grpo.sample.guidance_scale, flow_grpo.sample.eta) == (10, 4.5, 0.7)
    assert (flow_grpo.sample.group_size, flow_grpo.train.beta, flow_grpo.eval_freq, flow_grpo.save_freq) == (24, 0.04, 60, 60)
    assert flow_grpo.reward_kwargs.geneval.to_dict() == {"score": "partial", "detector": "mask2former", "jpeg_quality": 75}
    assert nft.reward_kwargs.geneval.jpeg_quality == 0 and nft.sample.guidance_scale == 1.0 and nft.train.beta == 1e-4
    assert nft.train.objective == "nft"


def test_saved_geneval_images_score_the_same_when_read_back(tmp_path, evaluate_script, capsys):
    """--save-images writes the sampled images in GenEval's layout (for its own scripts); --images scores a folder:
    the same images give the same verdicts."""
    prompts = tmp_path / "records.jsonl"
    prompts.write_text("".join(json.dumps({"tag": tag, "include": [{"class": "square", "count": 1, **extra}],
                                           "prompt": f"a {size} red square on a white background"}) + "\n"
                               for tag, size, extra in (("single_object", "small", {}),
                                                        ("colors", "big", {"color": "red"}))))
    saved = tmp_path / "saved"
    sampled = evaluate_script.main(["--protocol", "geneval", "--model", "tiny", "--prompts", str(prompts),
                                    "--protocol-option", "detector=shapes", "--images-per-prompt", "2",
                                    "--num-steps", "2", "--save-images", str(saved)])
    assert sorted(os.listdir(saved / "00001" / "samples")) == ["0000.png", "0001.png"]
    assert json.loads((saved / "00001" / "metadata.jsonl").read_text())["tag"] == "colors"
    read_back = evaluate_script.main(["--protocol", "geneval", "--images", str(saved),
                                      "--protocol-option", "detector=shapes"])
    assert read_back["tags"] == sampled["tags"] and read_back["num_images"] == 4
    with pytest.raises(SystemExit, match="not an empty directory"):
        evaluate_script.run(["--protocol", "geneval", "--model", "tiny", "--prompts", str(prompts), "--protocol-option",
                             "detector=shapes", "--images-per-prompt", "1", "--num-steps", "1", "--save-images", str(saved)])
