"""benchmarks/scenes_ladder.py (issue 53's learning ladder): its verdicts recomputed by hand from synthetic metrics
files, the folder it refuses, the one-line errors; one run of two tiny epochs, stopped and resumed. The ladder's
real runs are benchmarks."""

import json
import math
import os
import shutil

import pytest
from helpers import load_script

ladder = load_script("benchmarks/scenes_ladder.py")


def write_run(results, rung, family, case, seed, rows, spec=None):
    run_dir = ladder.run_dir_of(str(results), rung, family, case, seed)
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(run_dir, "finished.json"), "w") as f:
        json.dump({"epoch": len(rows)}, f)
    if spec is not None:
        config = ladder.ladder_config(**spec, run_dir=run_dir)
        with open(os.path.join(run_dir, ladder.CONFIG_FILE), "w") as f:
            json.dump({"spec": spec, "set": [], "config": ladder.config_document(config)}, f)
    return run_dir


def edit_ladder_config(run_dir, change):
    """Rewrite a finished run's ladder_config.json with `change` applied to its config (a run of older code)."""
    path = os.path.join(run_dir, ladder.CONFIG_FILE)
    with open(path) as f:
        document = json.load(f)
    change(document["config"])
    with open(path, "w") as f:
        json.dump(document, f)


def strict_rows(values):
    return [{"epoch": e, "reward_mean": 0.5 + 0.1 * v, "reward_std": 0.2, "num_samples": 64,
             "reward_info/geneval/strict_correct": v, "time/sample": 2.0, "time/train": 1.0}
            for e, v in enumerate(values)]


def test_epochs_to_strict_correct_is_the_first_window_of_three_epochs_whose_mean_reaches_0_9():
    # windows: (0.5, 0.95, 0.85) 0.767, (0.95, 0.85, 0.9) 0.9 -> the window ending at epoch 4 (counted from 1)
    assert ladder.epochs_to_target([0.5, 0.95, 0.85, 0.9, 1.0]) == 4
    # one epoch at 1.0 among low ones is not enough
    assert ladder.epochs_to_target([0.6, 1.0, 0.6, 0.7]) is None


def test_rung_a_passes_when_the_reward_rises_by_more_than_two_standard_errors():
    rows = [{"epoch": e, "reward_mean": m, "reward_std": 0.4, "num_samples": 64} for e, m in
            enumerate([2.0, 2.1, 2.2, 2.3, 2.4, 2.5])]
    rise, error, passed = ladder.rising(rows)
    # first three 2.1, last three 2.4; each window's mean has variance 3 x 0.4^2 / 64 / 3^2
    assert rise == pytest.approx(0.3)
    assert error == pytest.approx(math.sqrt(2 * 3 * 0.16 / 64 / 9))
    assert passed
    flat = [dict(r, reward_mean=2.0 + 0.01 * (r["epoch"] % 2)) for r in rows]
    assert not ladder.rising(flat)[2]


def test_collect_gives_each_run_s_trajectory_and_a_case_passes_on_a_majority_of_seeds(tmp_path):
    spec = {"rung": "b", "family": "flow", "case": "counting", "prompt": "a photo of three semicircles",
            "epochs": 5, "images": 0, "model": ""}
    write_run(tmp_path, "b", "flow", "counting", 42, strict_rows([0.3, 0.9, 0.9, 0.95, 1.0]), {**spec, "seed": 42})
    write_run(tmp_path, "b", "flow", "counting", 43, strict_rows([0.3, 0.4, 0.5, 0.6, 0.7]), {**spec, "seed": 43})
    write_run(tmp_path, "b", "flow", "counting", 44, strict_rows([0.8, 0.9, 1.0, 1.0, 1.0]), {**spec, "seed": 44})
    rows, verdicts = ladder.main(["--collect", "--results", str(tmp_path)])
    by_seed = {r["seed"]: r for r in rows}
    assert by_seed[42]["epochs_to_strict_0.9"] == 4 and by_seed[42]["passed"]  # (0.9 + 0.9 + 0.95) / 3
    assert by_seed[43]["epochs_to_strict_0.9"] is None and not by_seed[43]["passed"]
    assert by_seed[44]["epochs_to_strict_0.9"] == 3  # (0.8 + 0.9 + 1.0) / 3
    assert by_seed[42]["first_reward"] == pytest.approx(0.53) and by_seed[42]["last_reward"] == pytest.approx(0.6)
    assert by_seed[42]["strict_correct"] == [0.3, 0.9, 0.9, 0.95, 1.0]
    assert by_seed[42]["seconds_per_epoch"] == pytest.approx(3.0)
    assert by_seed[42]["prompt"] == "a photo of three semicircles" and by_seed[42]["model"] == "tiny-scenes-sd3"
    assert verdicts["b"]["flow"]["cases"]["counting"] == {"seeds": [42, 43, 44], "seeds_passed": 2, "passed": True}
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["rungs"]["b"]["flow"]["cases"]["counting"]["passed"] and len(summary["runs"]) == 3
    # counting alone is one of rung b's five cases: the rung is not passed (it once read PASS)
    assert not summary["rungs"]["b"]["flow"]["passed"]
    assert summary["rungs"]["b"]["flow"]["missing_cases"] == ["two_object", "colors", "position", "color_attr"]
    assert (tmp_path / "ladder_b.png").stat().st_size > 1000


def test_a_rung_passes_only_with_every_case_on_three_seeds_and_a_partial_folder_reads_incomplete(tmp_path):
    prompts = {"two_object": "a photo of a star and a triangle", "counting": "a photo of three semicircles",
               "colors": "a photo of a magenta star", "position": "a photo of a star above a cross",
               "color_attr": "a photo of a magenta cross and a yellow star"}  # rung b's five cases

    def run(folder, case, seed, strict):
        spec = {"rung": "b", "family": "unet", "case": case, "prompt": prompts[case], "epochs": 3, "images": 0,
                "model": ""}
        write_run(folder, "b", "unet", case, seed, strict_rows(strict), {**spec, "seed": seed})

    partial = tmp_path / "partial"
    run(partial, "two_object", 42, [0.9, 0.9, 0.9])
    run(partial, "two_object", 43, [0.9, 0.9, 0.9])
    _, verdicts = ladder.main(["--collect", "--results", str(partial)])
    unet = verdicts["b"]["unet"]
    assert not unet["passed"] and not unet["complete"] and unet["short_of_seeds"] == ["two_object"]
    assert ladder.verdict_word(unet) == "INCOMPLETE"
    assert "unet INCOMPLETE: not run: counting, colors, position, color_attr; under 3 seeds: two_object" in \
        ladder.render(*ladder.collect(str(partial))[:2])
    run(partial, "counting", 42, [0.1, 0.1, 0.1])  # one failed seed of three: the case is not decided yet
    _, verdicts = ladder.main(["--collect", "--results", str(partial)])
    assert ladder.verdict_word(verdicts["b"]["unet"]) == "INCOMPLETE"
    run(partial, "counting", 43, [0.1, 0.1, 0.1])  # two of three: no third seed can give it a majority
    _, verdicts = ladder.main(["--collect", "--results", str(partial)])
    assert ladder.verdict_word(verdicts["b"]["unet"]) == "FAIL" and not verdicts["b"]["unet"]["passed"]
    for name, position in (("whole", [0.9, 0.9, 0.9]), ("failing", [0.1, 0.1, 0.1])):
        for case in prompts:
            for seed in (42, 43, 44):
                # in "failing", position passes on one seed of three
                run(tmp_path / name, case, seed, position if case == "position" and seed > 42 else [0.9, 0.9, 0.9])
        _, verdicts = ladder.main(["--collect", "--results", str(tmp_path / name)])
        assert verdicts["b"]["unet"]["complete"]
        assert ladder.verdict_word(verdicts["b"]["unet"]) == ("PASS" if name == "whole" else "FAIL")
        assert verdicts["b"]["unet"]["passed"] == (name == "whole")


def test_a_later_collect_keeps_the_commands_that_wrote_the_folder(tmp_path):
    # --collect once replaced the summary's command, so the command that trained the runs was lost from it
    spec = {"rung": "b", "family": "flow", "case": "counting", "prompt": "a photo of three semicircles",
            "epochs": 5, "images": 0, "model": ""}
    write_run(tmp_path, "b", "flow", "counting", 42, strict_rows([0.3, 0.9, 0.9, 0.95, 1.0]), {**spec, "seed": 42})
    (tmp_path / "summary.json").write_text(json.dumps(
        {"command": "python benchmarks/scenes_ladder.py --rungs b --set train.beta=0.1"}))
    ladder.main(["--collect", "--results", str(tmp_path)])
    ladder.main(["--collect", "--results", str(tmp_path)])  # the same command again is not listed twice
    ladder.main(["--collect", "--samples", "0", "--results", str(tmp_path)])
    summary = json.load(open(tmp_path / "summary.json"))
    collect = f"python benchmarks/scenes_ladder.py --collect --results {tmp_path}"
    assert summary["commands"] == ["python benchmarks/scenes_ladder.py --rungs b --set train.beta=0.1", collect,
                                   f"python benchmarks/scenes_ladder.py --collect --samples 0 --results {tmp_path}"]
    assert summary["command"] == summary["commands"][-1]


def test_rung_b_is_judged_on_its_30_epochs_when_a_run_is_given_more(tmp_path):
    # a 40-epoch run whose 3-epoch mean first reaches 0.9 at epochs 31-33 reached the target, but not within the
    # rung's 30 epochs: it does not pass (the ladder once counted against the run's --epochs); one that reaches it
    # at epochs 28-30 does
    spec = {"rung": "b", "family": "unet", "case": "two_object", "prompt": "a photo of a star and a triangle",
            "epochs": 40, "images": 0, "model": ""}
    late = [0.5] * 30 + [0.9] * 10
    in_time = [0.5] * 27 + [0.9] * 13
    write_run(tmp_path, "b", "unet", "two_object", 42, strict_rows(late), {**spec, "seed": 42})
    write_run(tmp_path, "b", "unet", "two_object", 43, strict_rows(in_time), {**spec, "seed": 43})
    rows, _ = ladder.main(["--collect", "--results", str(tmp_path)])
    by_seed = {r["seed"]: r for r in rows}
    assert by_seed[42]["epochs_to_strict_0.9"] == 33 and not by_seed[42]["passed"]
    assert by_seed[43]["epochs_to_strict_0.9"] == 30 and by_seed[43]["passed"]


def test_a_null_control_s_strict_correct_is_its_images_true_verdicts_under_its_reward_s_name(tmp_path):
    # benchmarks/null_reward.py: the trainer sees shuffled scores, the images' true verdicts are logged under the
    # reward's own name; the ladder reports them as the run's strict-correct (rows with several such names refuse)
    spec = {"rung": "b", "family": "flow", "case": "colors", "prompt": "a photo of a magenta star", "epochs": 3,
            "images": 0, "model": ""}
    rows = [{k.replace("/geneval/", "/ShuffledGenEval/"): v for k, v in r.items()}
            for r in strict_rows([0.3, 0.1, 0.0])]
    write_run(tmp_path, "b", "flow", "colors", 42, rows, {**spec, "seed": 42})
    (row,), _ = ladder.main(["--collect", "--results", str(tmp_path)])
    assert row["strict_correct"] == [0.3, 0.1, 0.0] and not row["passed"]
    assert ladder.strict_key(strict_rows([0.5])) == ladder.STRICT and ladder.strict_key([{"reward_mean": 1}]) is None
    with pytest.raises(ValueError, match="several strict verdicts"):
        ladder.strict_key([{"reward_info/a/strict_correct": 1, "reward_info/b/strict_correct": 0}])


def test_rung_c_passes_when_its_tag_s_held_out_number_ends_above_the_base_by_two_standard_errors(tmp_path):
    """The held-out colors score is a share of 32 records x 2 images = 64 images (the shipped set, the variants'
    2 images a record): a lift of 0.05 from 0.30 is inside its noise, a lift of 0.30 is not. Rung d's overall is the
    mean of the six tags' shares. (Until 2026-12-06 any lift above 0 passed: one seed of rung c's two_object read
    "yes" on +0.083 over 36 images, which 288 images at the eval seed read as +0.010.)"""
    base = {"eval/geneval/overall": 0.2, "eval/geneval/colors": 0.30}
    rows = strict_rows([0.5, 0.6])
    rows[0].update(base)
    rows.append({"epoch": 2, "eval/geneval/overall": 0.19, "eval/geneval/colors": 0.35})
    write_run(tmp_path, "c", "unet", "colors", 42, rows)
    rows[-1]["eval/geneval/colors"] = 0.60
    write_run(tmp_path, "c", "unet", "colors", 43, rows)
    rows, verdicts = ladder.main(["--collect", "--results", str(tmp_path)])
    small, large = sorted(rows, key=lambda r: r["seed"])
    assert small["lift"] == pytest.approx(0.05)  # colors, not the overall that fell
    assert small["lift_error"] == pytest.approx(math.sqrt(0.3 * 0.7 / 64 + 0.35 * 0.65 / 64))  # 0.083
    assert not small["passed"]
    assert large["lift"] == pytest.approx(0.30)
    assert large["lift_error"] == pytest.approx(math.sqrt(0.3 * 0.7 / 64 + 0.6 * 0.4 / 64))  # 0.084
    assert large["passed"]
    # one seed of each way: the case has no majority yet, the rung is not judged
    assert ladder.verdict_word(verdicts["c"]["unet"]) == "INCOMPLETE" and not verdicts["c"]["unet"]["missing_cases"]
    # rung d: the overall's error from the six tags' (8 / 18 / 16 / 32 / 38 / 38 records x 2 images)
    tags = {"single_object": 0.5, "two_object": 0.5, "counting": 0.5, "colors": 0.5, "position": 0.5,
            "color_attr": 0.5}
    images = {"single_object": 16, "two_object": 36, "counting": 32, "colors": 64, "position": 76, "color_attr": 76}
    expected = math.sqrt(sum(0.25 / n for n in images.values())) / 6
    assert ladder.held_out_error(tags, "overall", {}) == pytest.approx(expected)
    assert ladder.held_out_error(tags, "counting", {"eval_images_per_prompt": 4}) == pytest.approx(math.sqrt(0.25 / 64))


def test_a_folder_whose_finished_run_had_another_config_is_refused_and_the_same_config_resumes(tmp_path):
    spec = {"rung": "a", "family": "flow", "case": "jpeg", "prompt": ladder.RUNG_A_PROMPT, "seed": 42,
            "epochs": 2, "images": 0, "model": ""}
    rows = [{"epoch": e, "reward_mean": 2.0 + e, "reward_std": 0.1, "num_samples": 64} for e in range(2)]
    write_run(tmp_path, "a", "flow", "jpeg", 42, rows, spec)
    args = ["--rungs", "a", "--families", "flow", "--seeds", "42", "--results", str(tmp_path)]
    with pytest.raises(SystemExit) as err:
        ladder.main(args + ["--epochs", "3"])  # another config: refused, nothing started
    assert "another config" in str(err.value) and "new --results" in str(err.value) and "\n" not in str(err.value)
    rows, verdicts = ladder.main(args + ["--epochs", "2"])  # the same config: nothing to run, collected
    assert [r["seed"] for r in rows] == [42] and rows[0]["rise"] == pytest.approx(1.0)


def test_a_finished_run_without_its_ladder_config_is_refused(tmp_path):
    write_run(tmp_path, "a", "flow", "jpeg", 42, [{"epoch": 0, "reward_mean": 1.0}])  # e.g. another script's
    with pytest.raises(SystemExit, match="another config"):
        ladder.main(["--rungs", "a", "--families", "flow", "--seeds", "42", "--results", str(tmp_path)])


def test_a_misspelt_set_field_is_one_line_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ladder.main(["--rungs", "a", "--families", "flow", "--results", str(tmp_path),
                     "--set", "train.learning_rat=1e-3"])
    err = capsys.readouterr().err
    assert "train.learning_rat" in err and "did you mean 'train.learning_rate'" in err
    assert not os.path.exists(tmp_path / "runs")


def test_images_per_epoch_are_whole_sampling_batches(tmp_path):
    config = ladder.ladder_config("b", "unet", "colors", "a photo of a magenta star", 42, str(tmp_path / "r"),
                                  images=128)
    assert config.sample.num_batches_per_epoch * config.sample.batch_size == 128
    assert dict(config.prompt_fn_kwargs) == {"prompt": "a photo of a magenta star"} and config.eval_freq == 0
    from ddpo_group.config.registry import ConfigError

    with pytest.raises(ConfigError, match="--images 100"):
        ladder.ladder_config("b", "unet", "colors", "a photo of a magenta star", 42, str(tmp_path / "r"), images=100)


def test_rung_b_s_prompts_are_training_prompts_one_per_tag_with_training_records():
    from ddpo_group.data import scenes

    training = scenes.training_records()
    assert set(ladder.RUNG_B_PROMPTS) == {tag for tag, records in training.items() if records}
    for tag, prompt in ladder.RUNG_B_PROMPTS.items():
        assert scenes.scene_training_prompts(prompt=prompt)[0]["tag"] == tag


def test_draw_0_is_the_ladder_s_own_prompts_and_another_draw_gives_other_training_prompts_of_each_tag():
    from ddpo_group.data import scenes

    assert ladder.rung_b_prompts(0) == ladder.RUNG_B_PROMPTS
    # draw 1, as docs/scenes.md lists it: numpy default_rng(1).integers(n) of each tag's n training records
    drawn = {"two_object": "a photo of a semicircle and a circle", "counting": "a photo of two squares",
             "colors": "a photo of a cyan diamond", "position": "a photo of a cross left of a circle",
             "color_attr": "a photo of a yellow diamond and a green triangle"}
    assert ladder.rung_b_prompts(1) == drawn
    assert dict(ladder.cases("b", draw=1)) == drawn
    for tag, prompt in drawn.items():
        assert scenes.scene_training_prompts(prompt=prompt)[0]["tag"] == tag
        assert prompt != ladder.RUNG_B_PROMPTS[tag]


def test_a_draw_s_runs_are_refused_beside_the_ladder_s_own_and_a_negative_draw_is_one_line(tmp_path, capsys):
    spec = {"rung": "b", "family": "unet", "case": "counting", "prompt": ladder.RUNG_B_PROMPTS["counting"],
            "seed": 42, "epochs": 2, "images": 0, "model": ""}
    write_run(tmp_path, "b", "unet", "counting", 42, strict_rows([0.5, 0.6]), spec)
    args = ["--rungs", "b", "--families", "unet", "--cases", "counting", "--seeds", "42", "--epochs", "2",
            "--results", str(tmp_path)]
    rows, _ = ladder.main(args)  # draw 0: the finished run is this config
    assert [r["prompt"] for r in rows] == [ladder.RUNG_B_PROMPTS["counting"]]
    with pytest.raises(SystemExit) as err:  # another prompt for the same case and seed: never mixed in
        ladder.main(args + ["--draw", "1"])
    assert "another config" in str(err.value) and "b/unet/counting/seed_42" in str(err.value)
    assert sorted(os.listdir(ladder.run_dir_of(str(tmp_path), "b", "unet", "counting", 42))) == sorted(
        ["metrics.jsonl", "finished.json", ladder.CONFIG_FILE])  # untouched
    with pytest.raises(SystemExit):
        ladder.main(args + ["--draw", "-1"])
    assert "--draw -1" in capsys.readouterr().err


def test_the_run_pool_runs_each_command_on_one_thread_with_its_log_and_returns_its_exit_code(tmp_path):
    import sys

    pool = load_script("benchmarks/run_pool.py")
    tasks = [(name, [sys.executable, "-c", f"import os; print(os.environ['OMP_NUM_THREADS']); raise SystemExit({code})"],
              str(tmp_path / "runs" / name)) for name, code in (("ok", 0), ("bad", 3))]
    assert pool.run_pool(tasks, jobs=2, poll_seconds=0.05) == {"ok": 0, "bad": 3}
    lines = (tmp_path / "runs" / "bad.log").read_text().splitlines()
    assert lines[0].startswith("=== bad: started ") and lines[1:] == ["1"]
    # a run started again (it goes on from its checkpoint) appends to its log: the first attempt's lines stay
    assert pool.run_pool(tasks[1:], jobs=1, poll_seconds=0.05) == {"bad": 3}
    lines = (tmp_path / "runs" / "bad.log").read_text().splitlines()
    assert [line for line in lines if not line.startswith("=== bad: started ")] == ["1", "1"] and len(lines) == 4


def test_a_folder_is_one_ladder_config_a_finished_run_of_another_rung_with_other_epochs_is_refused(tmp_path):
    spec = {"rung": "a", "family": "flow", "case": "jpeg", "prompt": ladder.RUNG_A_PROMPT, "seed": 42,
            "epochs": 2, "images": 0, "model": ""}
    write_run(tmp_path, "a", "flow", "jpeg", 42, [{"epoch": 0, "reward_mean": 1.0}], spec)
    with pytest.raises(SystemExit) as err:  # rung b at 3 epochs beside rung a's 2-epoch run: two configs in one folder
        ladder.main(["--rungs", "b", "--families", "flow", "--seeds", "42", "--epochs", "3", "--results", str(tmp_path)])
    assert "a/flow/jpeg/seed_42" in str(err.value)
    assert not os.path.exists(ladder.run_dir_of(str(tmp_path), "b", "flow", "counting", 42))


def test_a_missing_model_directory_is_one_line_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ladder.main(["--rungs", "a", "--families", "flow", "--model-flow", str(tmp_path / "no_model"),
                     "--results", str(tmp_path)])
    assert "--model-flow" in capsys.readouterr().err and not os.path.exists(tmp_path / "runs")


def test_cases_runs_only_the_named_case_of_a_rung(tmp_path, capsys):
    prompt = ladder.RUNG_B_PROMPTS["two_object"]
    spec = {"rung": "b", "family": "unet", "case": "two_object", "prompt": prompt, "seed": 42, "epochs": 2,
            "images": 0, "model": ""}
    write_run(tmp_path, "b", "unet", "two_object", 42, strict_rows([0.5, 0.6]), spec)
    args = ["--rungs", "b", "--families", "unet", "--seeds", "42", "--epochs", "2", "--results", str(tmp_path)]
    rows, _ = ladder.main(args + ["--cases", "two_object"])  # the one case is finished: nothing else starts
    assert [(r["case"], r["seed"]) for r in rows] == [("two_object", 42)]
    assert sorted(os.listdir(tmp_path / "runs" / "b" / "unet")) == ["two_object"]
    with pytest.raises(SystemExit):
        ladder.main(args + ["--cases", "single_object"])  # no training prompt: not a case of rung b
    assert "--cases 'single_object': choose from" in capsys.readouterr().err


def test_samples_figure_shows_base_and_final_images_of_runs_whose_checkpoint_is_there(tmp_path, monkeypatch):
    import numpy as np

    prompt = ladder.RUNG_B_PROMPTS["two_object"]
    spec = {"rung": "b", "family": "unet", "case": "two_object", "prompt": prompt, "seed": 42, "epochs": 2,
            "images": 0, "model": ""}
    run_dir = write_run(tmp_path, "b", "unet", "two_object", 42, strict_rows([0.5, 0.6]), spec)
    write_run(tmp_path, "b", "unet", "colors", 42, strict_rows([0.9, 1.0]),  # no checkpoint left: not sampled
              dict(spec, case="colors", prompt=ladder.RUNG_B_PROMPTS["colors"]))
    os.makedirs(os.path.join(run_dir, "checkpoints", "checkpoint_1"))
    os.makedirs(os.path.join(run_dir, "checkpoints", "checkpoint_2"))
    calls = []

    def fake_sample(model_args, record, count, sampler, workdir, label):
        calls.append((tuple(model_args), record["prompt"], sampler["num_steps"], label))
        verdicts = [i < (1 if label == "base" else 3) for i in range(count)]
        return np.zeros((count, 64, 64, 3), dtype=np.uint8), verdicts

    monkeypatch.setattr(ladder, "sample_prompt", fake_sample)
    ladder.main(["--collect", "--samples", "4", "--results", str(tmp_path)])
    final = os.path.join(run_dir, "checkpoints", "checkpoint_2")
    assert calls == [(("--model", "tiny-scenes"), prompt, 10, "base"), (("--checkpoint", final), prompt, 10, "final")]
    with open(tmp_path / "samples.json") as f:
        numbers = json.load(f)["runs"]
    assert [(n["case"], n["base_strict"], n["final_strict"]) for n in numbers] == [("two_object", 0.25, 0.75)]
    assert (tmp_path / "ladder_b_samples.png").exists()


def test_a_negative_sample_count_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ladder.main(["--collect", "--samples", "-1", "--results", str(tmp_path)])
    assert "--samples -1: a number of images" in capsys.readouterr().err


def test_a_field_the_code_added_since_a_run_at_its_default_is_the_same_config(tmp_path):
    spec = {"rung": "b", "family": "unet", "case": "two_object", "prompt": ladder.RUNG_B_PROMPTS["two_object"],
            "seed": 42, "epochs": 2, "images": 0, "model": ""}
    run_dir = write_run(tmp_path, "b", "unet", "two_object", 42, strict_rows([0.5, 0.6]), spec)
    # a run finished before the field existed
    edit_ladder_config(run_dir, lambda config: config["train"].pop("lr_warmup_steps"))
    args = ["--rungs", "b", "--cases", "two_object", "--families", "unet", "--seeds", "42", "--epochs", "2",
            "--results", str(tmp_path)]
    rows, _ = ladder.main(args)  # the same config: nothing to run, collected
    assert [(r["case"], r["seed"]) for r in rows] == [("two_object", 42)]
    with pytest.raises(SystemExit, match="trained with another config"):  # the new field set away from its default
        ladder.main(args + ["--set", "train.lr_warmup_steps=8"])


def test_best_window_is_the_highest_three_epoch_mean_within_the_rung_and_ties_go_to_the_earliest():
    strict = [0.2, 0.5, 0.8, 0.5, 0.8, 0.5, 0.2]
    # windows from epoch 0: 0.5, 0.6, 0.7, 0.6, 0.5: the best starts at epoch 2
    mean, first, last = ladder.best_window(strict)
    assert [first, last] == [2, 4] and mean == pytest.approx(0.7)
    # (0.9, 0.9, 0.9) twice: the earlier window; a better window past the limit is not counted
    assert ladder.best_window([0.9, 0.9, 0.9, 0.9, 1.0, 1.0, 1.0], limit=4)[1:] == [0, 2]
    assert ladder.best_window([0.9, 0.9, 0.9, 0.9, 1.0, 1.0, 1.0])[1:] == [4, 6]
    assert ladder.best_window([0.9, 0.9]) is None
    blocks = ladder.means_by_ten([0.1] * 10 + [0.3] * 10 + [0.5, 0.7])
    assert [b[:2] for b in blocks] == [[0, 9], [10, 19], [20, 21]]
    assert [b[2] for b in blocks] == pytest.approx([0.1, 0.3, 0.6])


def test_a_rung_b_row_reports_its_best_window_within_thirty_epochs_in_the_summary_and_the_table(tmp_path):
    # 33 epochs: 0.5 throughout, 0.8 at epochs 10-12, 1.0 at epochs 30-32 (past the rung's 30)
    values = [0.5] * 33
    values[10:13] = [0.8] * 3
    values[30:33] = [1.0] * 3
    spec = {"rung": "b", "family": "unet", "case": "colors", "prompt": "a photo of a magenta star",
            "epochs": 33, "images": 0, "model": "", "seed": 42}
    write_run(tmp_path, "b", "unet", "colors", 42, strict_rows(values), spec)
    rows, verdicts = ladder.main(["--collect", "--results", str(tmp_path)])
    row = rows[0]
    assert row["best_window"][1:] == [10, 12]
    assert row["best_window"][0] == pytest.approx(0.8)
    assert [b[2] for b in row["strict_by_ten"]] == pytest.approx([0.5, (3 * 0.8 + 7 * 0.5) / 10, 0.5, 1.0])
    assert row["epochs_to_strict_0.9"] == 33 and not row["passed"]
    with open(tmp_path / "summary.json") as f:
        saved = json.load(f)["runs"][0]
    assert saved["best_window"][1:] == [10, 12]
    table = ladder.render(rows, verdicts)
    assert "| 0.800 (10-12) | 33 |" in table


def test_a_finished_run_saved_at_another_frequency_is_the_same_config(tmp_path):
    # runs finished before --save-every saved at their end only (save_freq 0): how often a run saves changes
    # nothing it trains, so a folder of them takes more seeds at the new default
    spec = {"rung": "b", "family": "unet", "case": "colors", "prompt": ladder.RUNG_B_PROMPTS["colors"],
            "seed": 42, "epochs": 2, "images": 0, "model": ""}
    run_dir = write_run(tmp_path, "b", "unet", "colors", 42, strict_rows([0.5, 0.6]), spec)
    edit_ladder_config(run_dir, lambda config: config.update(save_freq=0))
    args = ["--rungs", "b", "--cases", "colors", "--families", "unet", "--seeds", "42", "--epochs", "2",
            "--results", str(tmp_path)]
    for every in ("5", "1"):
        rows, _ = ladder.main(args + ["--save-every", every])  # nothing to run, collected
        assert [(r["case"], r["seed"]) for r in rows] == [("colors", 42)]
    assert "save_freq" not in ladder.config_document(ladder.ladder_config(**spec, run_dir=run_dir))


def test_a_negative_save_frequency_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ladder.main(["--rungs", "a", "--results", str(tmp_path), "--save-every", "-1"])
    assert "--save-every -1: a number of epochs" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the ladder sets how often a run saves: --set would be ignored
        ladder.main(["--rungs", "a", "--results", str(tmp_path), "--set", "save_freq=1"])
    assert "use --save-every" in capsys.readouterr().err


def test_an_interrupted_run_goes_on_from_its_checkpoint_and_trains_what_one_run_trains(tmp_path):
    import torch

    threads = torch.get_num_threads()
    spec = {"rung": "a", "family": "flow", "case": "jpeg", "prompt": ladder.RUNG_A_PROMPT, "seed": 42, "epochs": 2,
            "images": 0, "model": "tiny-scenes-flow", "save_every": 1,
            "run_dir": ladder.run_dir_of(str(tmp_path), "a", "flow", "jpeg", 42)}
    tiny = ["sample.num_steps=2", "sample.batch_size=8", "train.batch_size=8", "sample.num_batches_per_epoch=1"]
    run_dir = spec["run_dir"]
    try:
        ladder.run_one(spec, tiny)  # two epochs, a checkpoint after each
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            whole = [json.loads(line) for line in f]
        assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["checkpoint_1", "checkpoint_2"]
        # killed during epoch 1: its checkpoint, finished.json and the ladder's record never written
        for name in ("finished.json", ladder.CONFIG_FILE):
            os.remove(os.path.join(run_dir, name))
        shutil.rmtree(os.path.join(run_dir, "checkpoints", "checkpoint_2"))
        assert ladder.has_checkpoint(run_dir) and not ladder.has_checkpoint(str(tmp_path / "nowhere"))
        ladder.run_one(spec, tiny)
    finally:
        torch.set_num_threads(threads)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        resumed = [json.loads(line) for line in f]
    assert [r["epoch"] for r in resumed] == [0, 1]
    timing = ("time/", "perf/", "peak_rss")
    for before, after in zip(whole, resumed):  # the same numbers, the seconds aside
        assert {k: v for k, v in before.items() if not k.startswith(timing)} == \
            {k: v for k, v in after.items() if not k.startswith(timing)}
    assert os.path.exists(os.path.join(run_dir, "finished.json"))
    with open(os.path.join(run_dir, "resumes.jsonl")) as f:
        assert json.loads(f.readline())["epoch"] == 1
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["checkpoint_1", "checkpoint_2"]
    assert ladder.final_checkpoint(run_dir).endswith("checkpoint_2")
    # unfinished again, and asked to go on with other epochs: refused in one line before anything is trained
    os.remove(os.path.join(run_dir, "finished.json"))
    with pytest.raises(SystemExit, match="started with another config") as err:
        ladder.run_one(dict(spec, epochs=3), tiny)
    assert "\n" not in str(err.value.code) and not os.path.exists(os.path.join(run_dir, "finished.json"))
    # the same config with nothing left to do ends without finished.json: a failure, no ladder record
    os.remove(os.path.join(run_dir, ladder.CONFIG_FILE))
    try:
        with pytest.raises(SystemExit, match="did not finish"):
            ladder.run_one(spec, tiny)
    finally:
        torch.set_num_threads(threads)
    assert not os.path.exists(os.path.join(run_dir, ladder.CONFIG_FILE))


def test_the_ladder_reads_the_trainer_s_own_finished_mark():
    from ddpo_group.runs.run_dir import FINISHED_FILE

    assert ladder.FINISHED == FINISHED_FILE
