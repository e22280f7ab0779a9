"""The scenes world (ddpo_group/data/scenes.py, docs/scenes.md): its prompts, the held-out set, the scenes and their
detection, the shipped models and their pretraining."""

import json
import math
import os
from itertools import permutations

import numpy as np
import pytest
import torch
from helpers import load_script

from ddpo_group.data import scenes
from ddpo_group.rewards.geneval.metadata import read_metadata, record_identity
from ddpo_group.rewards.geneval.protocol import Detection, GenEvalScorer, relative_position
from ddpo_group.rewards.geneval.shapes_scenes import ShapesColorClassifier, ShapesDetector, classify_shape
from ddpo_group.data.shapes import ALL_SHAPES, SHAPES, shape_coverage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "ddpo_group", "assets")


def test_the_world_has_every_distinct_geneval_record_of_eight_shapes_and_six_colours_once():
    by_tag = scenes.world_records()
    s, c = 8, 6  # counted by hand: "A and B" is "B and A", "A left of B" is "B right of A" (and above / below)
    assert {tag: len(records) for tag, records in by_tag.items()} == {
        "single_object": s, "two_object": s * (s - 1) // 2, "counting": s * 3, "colors": s * c,
        "position": s * (s - 1) * 4 // 2, "color_attr": s * (s - 1) // 2 * c * (c - 1)}
    for records in by_tag.values():
        assert len({record_identity(r) for r in records}) == len(records)
    assert set(scenes.SCENE_SHAPES) == set(ALL_SHAPES) and len(ALL_SHAPES) == 8


def test_the_held_out_set_follows_geneval_shares_and_leaves_two_thirds_of_each_tag_to_train():
    sizes = scenes.evaluation_sizes()
    assert sum(sizes.values()) == 150
    totals = {tag: len(r) for tag, r in scenes.world_records().items()}
    assert sizes["single_object"] == totals["single_object"]  # every single-object prompt is held out, as GenEval's
    for tag, n in sizes.items():
        if tag != "single_object":
            assert totals[tag] - n >= totals[tag] / 3, tag
    # where the world has room, a tag gets at least round(150 x GenEval's share): 100 of 553 for color_attr
    assert sizes["color_attr"] >= round(150 * 100 / 553)


def test_the_shipped_held_out_set_is_the_rule_s_and_no_training_prompt_is_in_it():
    with open(scenes.evaluation_prompts_path()) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    assert lines == scenes.evaluation_records()
    shipped = read_metadata(scenes.evaluation_prompts_path())
    assert len({record_identity(r) for r in shipped}) == 150
    held_out = {record_identity(r) for r in shipped}
    for records in scenes.training_records().values():
        assert not held_out & {record_identity(r) for r in records}
    generated = scenes.scene_training_prompts(n_per_tag=50, seed=3)
    assert generated and not held_out & {record_identity(r) for r in generated}
    assert not [r for r in generated if r["tag"] == "single_object"]  # none left to train on
    # the first records of the set take the tags in turn: a grid of its first six prompts shows every tag
    assert [r["tag"] for r in shipped[:6]] == ["single_object", "two_object", "counting", "colors", "position",
                                               "color_attr"]


@pytest.mark.parametrize("shape", ALL_SHAPES[3:])
def test_a_scene_only_shape_has_the_asked_area_about_its_centroid(shape):
    area = 400.0
    coverage = shape_coverage(shape, area, (40.3, 41.7), 96, supersample=8)
    rows, cols = np.mgrid[0:96, 0:96] + 0.5
    assert coverage.sum() == pytest.approx(area, rel=0.02)
    assert (coverage * cols).sum() / coverage.sum() == pytest.approx(40.3, abs=0.05)
    assert (coverage * rows).sum() / coverage.sum() == pytest.approx(41.7, abs=0.05)


def test_a_window_draws_the_same_coverage():
    for shape in ALL_SHAPES:
        whole = shape_coverage(shape, 150.0, (30.4, 20.6), 64)
        assert np.array_equal(shape_coverage(shape, 150.0, (30.4, 20.6), 64, window=14), whole), shape


@pytest.mark.parametrize("area", [80.0, 160.0])
def test_every_shape_drawn_alone_is_classified_as_itself(area):
    for shape in ALL_SHAPES:
        assert classify_shape(shape_coverage(shape, area, (31.3, 30.8), 64)) == shape


def _box(coverage):
    ys, xs = np.nonzero(coverage > 0)
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


def test_a_scene_holds_exactly_what_its_record_asks():
    rng = np.random.default_rng(0)
    record = {"tag": "color_attr", "prompt": "a photo of a red ring and a blue star",
              "include": [{"class": "ring", "count": 1, "color": "red"}, {"class": "star", "count": 1, "color": "blue"}]}
    objects, background = scenes.sample_scene(record, rng)
    assert [(shape, color) for shape, color, _ in objects] == [("ring", "red"), ("star", "blue")]
    assert background in ("white", "black", "gray")
    counting = {"tag": "counting", "prompt": "a photo of four crosses", "include": [{"class": "cross", "count": 4}],
                "exclude": [{"class": "cross", "count": 5}]}
    objects, _ = scenes.sample_scene(counting, rng)
    boxes = [_box(coverage) for _, _, coverage in objects]
    assert [shape for shape, _, _ in objects] == ["cross"] * 4
    for (x1, y1, x2, y2) in boxes:
        assert min(x1, y1) >= scenes.MARGIN and max(x2, y2) <= scenes.SCENE_SIZE - scenes.MARGIN
    for a, b in permutations(boxes, 2):  # GAP px between any two boxes on one axis at least
        assert a[2] + scenes.GAP <= b[0] or b[2] + scenes.GAP <= a[0] or a[3] + scenes.GAP <= b[1] \
            or b[3] + scenes.GAP <= a[1]


@pytest.mark.parametrize("relation", ["left of", "right of", "above", "below"])
def test_a_position_scene_shows_only_the_asked_relation(relation):
    rng = np.random.default_rng(1)
    record = {"tag": "position", "prompt": f"a photo of a square {relation} a diamond",
              "include": [{"class": "diamond", "count": 1}, {"class": "square", "count": 1, "position": [relation, 0]}]}
    for _ in range(5):
        objects, _ = scenes.sample_scene(record, rng)
        (_, _, target), (_, _, subject) = objects
        (ax1, ay1, ax2, ay2), (bx1, by1, bx2, by2) = _box(subject), _box(target)
        # by hand: the subject's box centre against the target's, the larger offset says the relation
        dx, dy = (ax1 + ax2 - bx1 - bx2) / 2, (ay1 + ay2 - by1 - by2) / 2
        expected = ("left of" if dx < 0 else "right of") if abs(dx) > abs(dy) else ("above" if dy < 0 else "below")
        assert expected == relation
        assert relative_position(Detection(_box(subject), 1.0), Detection(_box(target), 1.0)) == {relation}


def test_an_infeasible_scene_is_refused_after_its_capped_attempts():
    crowd = {"tag": "counting", "prompt": "a photo of four stars", "include": [{"class": "star", "count": 4}]}
    with pytest.raises(scenes.SceneInfeasible, match="four stars"):
        scenes.sample_scene(crowd, np.random.default_rng(0), size=24)


def test_the_detector_finds_every_held_out_scene_correct():
    records = read_metadata(scenes.evaluation_prompts_path())[::5]  # 30 records, every tag
    rng = np.random.default_rng(2)
    images = np.stack([scenes.render_record(r, rng) for r in records])
    results = GenEvalScorer(ShapesDetector(), ShapesColorClassifier()).score(images, records)
    assert [r["reason"] for r in results if not r["correct"]] == []
    assert all(r["partial_score"] == 1.0 for r in results)


# Issue 53's coarse scale (COARSE_AREA_RANGE, ``pretrain --object-scale coarse``): the same records and rules, objects
# 1.4x as wide.
def test_a_coarse_scene_draws_its_objects_at_the_coarse_areas_within_the_rules():
    rng = np.random.default_rng(3)
    low, high = scenes.COARSE_AREA_RANGE
    assert (low, high) == (150.0, 260.0) and scenes.window_of(scenes.COARSE_AREA_RANGE) == 18
    assert scenes.window_of(scenes.AREA_RANGE) == scenes.WINDOW
    record = {"tag": "counting", "prompt": "a photo of four stars", "include": [{"class": "star", "count": 4}]}
    for _ in range(3):
        objects, _ = scenes.sample_scene(record, rng, area_range=scenes.COARSE_AREA_RANGE)
        areas = [coverage.sum() for _, _, coverage in objects]
        assert len(areas) == 4 and all(low * 0.97 <= a <= high * 1.03 for a in areas), areas
        boxes = [_box(coverage) for _, _, coverage in objects]
        for (x1, y1, x2, y2) in boxes:
            assert min(x1, y1) >= scenes.MARGIN and max(x2, y2) <= scenes.SCENE_SIZE - scenes.MARGIN
        for a, b in permutations(boxes, 2):
            assert a[2] + scenes.GAP <= b[0] or b[2] + scenes.GAP <= a[0] or a[3] + scenes.GAP <= b[1] \
                or b[3] + scenes.GAP <= a[1]


def test_the_widest_coarse_records_are_placed_and_the_detector_finds_them_correct():
    """Four of every class, and every position record of the two widest shapes (star, semicircle) side by side."""
    records = [r for r in scenes.world_records()["counting"] if r["include"][0]["count"] == 4]
    records += [r for r in scenes.world_records()["position"]
                if {c["class"] for c in r["include"]} == {"star", "semicircle"}]
    assert len(records) == 8 + 4
    rng = np.random.default_rng(4)
    images = np.stack([scenes.render_record(r, rng, area_range=scenes.COARSE_AREA_RANGE) for r in records])
    results = GenEvalScorer(ShapesDetector(), ShapesColorClassifier()).score(images, records)
    assert [r["reason"] for r in results if not r["correct"]] == []


@pytest.mark.parametrize("areas", [(0.0, 10.0), (20.0, 10.0), ("a", 1), (5.0,), (10.0, float("inf")),
                                   (float("nan"), 9.0)])
def test_a_bad_area_range_is_one_line(areas):
    with pytest.raises(ValueError, match="object areas") as err:
        scenes.sample_scene(scenes.world_records()["colors"][0], np.random.default_rng(0), area_range=areas)
    assert "\n" not in str(err.value)


def test_the_pretraining_renders_and_records_its_object_scale(tmp_path, capsys):
    script = load_script("scripts/pretrain_tiny.py")
    args = ["--world", "scenes", "--arch", "sd", "--quick", "--dataset-size", "8", "--eval-steps", "0",
            "--object-scale", "coarse", "--output-dir", str(tmp_path / "out"), "--state-dir", str(tmp_path / "state")]
    log = script.main(args)
    assert log["object_scale"] == "coarse" and log["object_area"] == [150.0, 260.0]
    assert json.loads((tmp_path / "state" / "options.json").read_text())["object_scale"] == "coarse"
    with np.load(tmp_path / "state" / "data.npz") as data:
        expected, _ = scenes.sample_dataset(8, seed=0, area_range=scenes.COARSE_AREA_RANGE)
        assert np.array_equal(data["images"], expected)
        fine, _ = scenes.sample_dataset(8, seed=0)
        assert not np.array_equal(data["images"], fine)
    with pytest.raises(SystemExit):
        script.parse_args(["--world", "shapes", "--object-scale", "coarse"])
    assert "--object-scale: the scenes world's" in capsys.readouterr().err


def test_the_shapes_world_keeps_its_three_shapes_and_108_prompts():
    from ddpo_group.data.shapes import shapes_prompts

    assert SHAPES == ("circle", "square", "triangle")
    assert len(shapes_prompts()) == 108


def test_pretraining_in_parts_gives_the_weights_of_one_run(tmp_path):
    script = load_script("scripts/pretrain_tiny.py")
    common = ["--world", "scenes", "--arch", "sd3", "--quick", "--dataset-size", "16"]
    script.main(common + ["--output-dir", str(tmp_path / "one"), "--state-dir", str(tmp_path / "one_state")])
    parts = ["--output-dir", str(tmp_path / "parts"), "--state-dir", str(tmp_path / "parts_state")]
    stopped = script.main(common + parts + ["--stop-at-step", "2"])
    assert "stopped" in stopped and not (tmp_path / "parts" / "model_index.json").exists()
    log = script.main(common + parts)
    from safetensors.torch import load_file

    for part in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                 "vae/diffusion_pytorch_model.safetensors"):
        one, two = load_file(str(tmp_path / "one" / part)), load_file(str(tmp_path / "parts" / part))
        assert all(torch.equal(one[k], two[k]) for k in one), part
    assert set(log["evaluation"]["tags"]) == set(scenes.TAGS)
    assert log["vae"]["steps"] == 3 and log["denoiser"]["steps"] == 3


@pytest.mark.parametrize("name,directory", [("tiny-scenes-sd3", "tiny_scenes_sd3"), ("tiny-scenes", "tiny_scenes"),
                                            ("tiny-scenes-flow", "tiny_scenes_flow")])
def test_a_shipped_scenes_model_loads_by_name_and_samples_64_px_scenes(name, directory):
    path = os.path.join(ASSETS, directory)
    if not os.path.exists(os.path.join(path, "model_index.json")):
        pytest.skip(f"{name} is not shipped in this checkout")
    weights = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
                  if f.endswith(".safetensors"))
    assert weights <= 30 * 10**6  # issue 53: at most 30 MB of safetensors a model
    with open(os.path.join(path, "pretrain_log.json")) as f:
        log = json.load(f)
    assert set(log["evaluation"]["tags"]) == set(scenes.TAGS)
    assert log["evaluation"]["overall"] == pytest.approx(np.mean(list(log["evaluation"]["tags"].values())))
    from ddpo_group.diffusion.policy import load_policy

    policy = load_policy(name)
    assert policy.family == {"tiny-scenes-sd3": "sd3", "tiny-scenes": "stable_diffusion", "tiny-scenes-flow": "sd_flow"}[name]
    trajectories = policy.sample(["a photo of a red circle and a blue square"], num_steps=2, guidance_scale=4.5,
                                 eta=1.0, generator=torch.Generator().manual_seed(0))
    assert trajectories.images.shape == (1, 3, 64, 64)
    assert math.isfinite(float(trajectories.images.sum()))


def test_an_evaluation_of_tagged_prompts_logs_genevals_table_by_tag():
    from ddpo_group.evaluation.evaluator import tag_table
    from ddpo_group.data.prompts import PromptRecord

    records = [PromptRecord("a", {"tag": "counting"}), PromptRecord("b", {"tag": "counting"}),
               PromptRecord("c", {"tag": "position"})]
    correct = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])  # (prompts, images)
    table = tag_table(records, {"geneval/correct": correct, "geneval/partial_score": correct})
    # by hand: counting 3 of 4 images, position 0 of 2, overall the unweighted mean of the two tags
    assert table == {"eval/geneval/counting": 0.75, "eval/geneval/position": 0.0, "eval/geneval/overall": 0.375}
    assert tag_table([PromptRecord("a", {}), PromptRecord("b", {})], {"geneval/correct": correct[:2]}) == {}


def test_the_report_shows_a_tagged_evaluation_by_tag_first_and_last(tmp_path):
    from PIL import Image

    from ddpo_group.evaluation.protocol_report import tag_evaluations_html

    run = tmp_path / "run"
    (run / "samples" / "eval_0000").mkdir(parents=True)
    (run / "samples" / "eval_0040").mkdir(parents=True)
    rows = [{"epoch": 0, "eval/geneval/counting": 0.25, "eval/geneval/position": 0.0, "eval/geneval/overall": 0.125},
            {"epoch": 40, "eval/geneval/counting": 0.75, "eval/geneval/position": 0.5, "eval/geneval/overall": 0.625}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for epoch, verdicts in ((0, [[0.0], [1.0]]), (40, [[1.0], [1.0]])):
        records = []
        for i, (prompt, tag) in enumerate((("a photo of two rings", "counting"), ("a photo of a star above a cross", "position"))):
            Image.new("RGB", (8, 8), (255, 0, 0)).save(run / "samples" / f"eval_{epoch:04d}" / f"{i:03d}.png")
            records.append({"prompt": prompt, "tag": tag, "image": f"eval_{epoch:04d}/{i:03d}.png", "prompt_index": i,
                            "image_index": 0})
        (run / "samples" / f"eval_{epoch:04d}.json").write_text(json.dumps(
            {"epoch": epoch, "records": records, "reward_info": {"geneval/correct": verdicts}}))
    html = tag_evaluations_html(str(run))
    assert "Held-out evaluation by tag" in html
    assert "<td>counting</td><td>0.250</td><td>0.750</td>" in html and "<td>overall</td><td>0.125</td><td>0.625</td>" in html
    assert html.count("data:image/png;base64,") == 4  # two prompts, first and last
    assert "a photo of a star above a cross" in html and "&#10007;" in html and "&#10003;" in html
    assert tag_evaluations_html(str(tmp_path / "nothing")) == ""


def test_the_flow_base_samples_with_the_text_tokens_it_was_trained_on(tmp_path):
    """Found in issue 53: the scenes pretraining feeds each prompt's 16 CLIP tokens then 16 zero T5 tokens
    (flow_text_embeddings), and the policy fed SD3's default 256 zero tokens at sampling, a different attention
    over the text (held-out 0.085 against 0.132 on the shipped model, 2 images a record). The policy's
    conditioning is now the training's, value for value; an explicit sample.max_sequence_length still wins, and a
    pipeline this project did not pretrain keeps diffusers' 256."""
    from ddpo_group.cli.pretrain import _import_torch, flow_text_embeddings
    from ddpo_group.diffusion.policy import load_policy
    from ddpo_group.diffusion.sd3 import trained_text_length

    _import_torch()  # the pretraining module's lazy imports

    policy = load_policy("tiny-scenes-sd3")
    pipeline = policy.pipeline
    assert policy.max_sequence_length == pipeline.tokenizer.model_max_length == 16
    prompts = ["a photo of a red circle and a blue square", ""]
    ids = pipeline.tokenizer(prompts, padding="max_length", max_length=16, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden, pooled = flow_text_embeddings(pipeline, ids)
        cond = policy._encode(prompts[:1], "", 4.5, torch.device("cpu"))
    assert hidden.shape == (2, 32, 64)  # 16 CLIP tokens, 16 zero ones
    assert torch.allclose(cond["prompt_embeds"], hidden[:1], atol=1e-6)
    assert torch.allclose(cond["negative_prompt_embeds"], hidden[1:], atol=1e-6)
    assert torch.allclose(cond["pooled_prompt_embeds"], pooled[:1], atol=1e-6)
    policy.configure(max_sequence_length=256)  # what a config that names a length gets
    assert policy._encode(prompts[:1], "", 4.5, torch.device("cpu"))["prompt_embeds"].shape[1] == 16 + 256
    policy.configure()
    assert policy.max_sequence_length == 16

    # the same pipeline saved without the pretraining's log is any SD3 pipeline: diffusers' 256
    pipeline.save_pretrained(tmp_path / "copy")
    assert load_policy(str(tmp_path / "copy")).max_sequence_length == 256
    (tmp_path / "copy" / "pretrain_log.json").write_text(json.dumps({"world": "scenes", "arch": "sd3", "text_tokens": 12}))
    assert load_policy(str(tmp_path / "copy")).max_sequence_length == 12
    (tmp_path / "copy" / "pretrain_log.json").write_text("{not json")
    assert load_policy(str(tmp_path / "copy")).max_sequence_length == 256
    assert trained_text_length(load_policy("tiny-sd3").pipeline) is None


def test_a_pipeline_says_the_object_areas_it_was_pretrained_on(tmp_path):
    (tmp_path / "pretrain_log.json").write_text(json.dumps({"world": "scenes", "object_area": [150.0, 260.0]}))
    assert scenes.area_range_of_pipeline(str(tmp_path)) == (150.0, 260.0)
    (tmp_path / "pretrain_log.json").write_text(json.dumps({"world": "scenes"}))  # a log from before the option
    assert scenes.area_range_of_pipeline(str(tmp_path)) == (80.0, 160.0)
    (tmp_path / "pretrain_log.json").write_text("[1, 2")  # not JSON
    assert scenes.area_range_of_pipeline(str(tmp_path)) == (80.0, 160.0)
    assert scenes.area_range_of_pipeline(str(tmp_path / "absent")) == (80.0, 160.0)
    assert scenes.area_range_of_pipeline(None) == (80.0, 160.0)


class _Encoded(tuple):
    """What a CLIP text encoder returns: [0] the pooled output, .hidden_states the layers."""


def _fake_flow_pipeline():
    """Just enough of an SD3 pipeline for cli.pretrain.denoiser_loss: text encoders of known output and a
    transformer that returns its input latents, so that the loss shows the noise levels it was given."""
    from types import SimpleNamespace

    def encoder(ids, output_hidden_states=True):
        out = _Encoded((torch.ones(ids.shape[0], 4),))
        out.hidden_states = [torch.zeros(ids.shape[0], ids.shape[1], 3)] * 3
        return out

    class Transformer:
        config = SimpleNamespace(joint_attention_dim=8)

        def __call__(self, noisy, **_):
            return SimpleNamespace(sample=noisy)

    return SimpleNamespace(text_encoder=encoder, text_encoder_2=encoder, transformer=Transformer())


@pytest.mark.parametrize("times", ["logit-normal", "uniform"])
def test_the_flow_pretraining_draws_its_noise_levels_as_asked(times):
    from ddpo_group.cli.pretrain import _import_torch, denoiser_loss

    _import_torch()  # the module's torch globals, as a pretraining sets them
    z0 = torch.linspace(-1, 1, 2 * 4 * 2 * 2).reshape(2, 4, 2, 2)
    ids = torch.zeros(2, 5, dtype=torch.long)
    loss = denoiser_loss(_fake_flow_pipeline(), "sd3", z0, ids, torch.Generator().manual_seed(7), times)
    # by hand: the same generator's draws, noise first, then the levels
    generator = torch.Generator().manual_seed(7)
    noise = torch.randn(z0.shape, generator=generator)
    u = torch.rand(2, generator=generator) if times == "uniform" else torch.sigmoid(torch.randn(2, generator=generator))
    s = u.view(-1, 1, 1, 1)
    expected = (((1 - s) * z0 + s * noise - (noise - z0)) ** 2).mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


def test_a_denoiser_batch_draws_scenes_their_posterior_latents_and_empty_captions_in_order():
    """cli.pretrain.scenes_batch, shared by the pretraining and benchmarks/scenes_sft_ceiling.py: by hand, the same
    generator's draws (scene indices, then the posterior's noise, then the caption coins)."""
    from ddpo_group.cli.pretrain import _import_torch, scenes_batch

    _import_torch()
    mean = torch.arange(5.0).view(5, 1, 1, 1).expand(5, 2, 2, 2).contiguous()
    std = torch.full((5, 2, 2, 2), 0.5)
    rows = torch.tensor([10, 11, 12, 13, 14])
    z, batch_rows = scenes_batch(mean, std, rows, 99, 6, 0.5, torch.Generator().manual_seed(3))
    generator = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 5, (6,), generator=generator)
    eps = torch.randn(6, 2, 2, 2, generator=generator)
    coins = torch.rand(6, generator=generator)
    assert torch.allclose(z, idx.float().view(6, 1, 1, 1) + 0.5 * eps)
    assert batch_rows.tolist() == [99 if c < 0.5 else 10 + i for i, c in zip(idx.tolist(), coins.tolist())]
    assert rows.tolist() == [10, 11, 12, 13, 14]  # the caller's rows are not changed
    _, none_empty = scenes_batch(mean, std, rows, 99, 50, 0.0, torch.Generator().manual_seed(4))
    _, all_empty = scenes_batch(mean, std, rows, 99, 50, 1.0, torch.Generator().manual_seed(4))
    assert 99 not in none_empty.tolist() and set(all_empty.tolist()) == {99}


def test_noise_levels_other_than_ddpm_s_are_the_flow_model_s_alone(capsys):
    with pytest.raises(SystemExit):
        load_script("scripts/pretrain_tiny.py").parse_args(["--world", "scenes", "--arch", "sd", "--flow-times",
                                                             "uniform"])
    assert "--flow-times: the flow models' (--arch sd3 or sd-flow)" in capsys.readouterr().err
