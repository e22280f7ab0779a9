"""benchmarks/bench_training.py: the JSON / markdown it writes and the numbers it derives.

One real run (two methods, 1 epoch, 2 denoising steps, 8 trajectories, the random "tiny" model)
feeds the structure tests; the derived numbers are recomputed here by hand from the per-epoch
rows. Timings are never asserted.
"""

import json
import os

import pytest
from helpers import load_script

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["ddpo", "group_ppo_endpoints"]


def _load_bench():
    return load_script("benchmarks/bench_training.py")


bench = _load_bench()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench.main([
        "--model", "tiny", "--quick", "--epochs", "1", "--num-steps", "2", "--sample-batch-size", "8",
        "--num-batches", "1", "--methods", ",".join(METHODS), "--no-warmup", "--output-dir", str(out),
    ])
    with open(out / "bench_quick.json") as f:
        results = json.load(f)
    markdown = (out / "bench_quick.md").read_text()
    return results, markdown, out


def test_json_names_machine_settings_and_every_method(run):
    results, _, _ = run
    assert results["mode"] == "quick"
    assert results["machine"]["cpu_count"] == os.cpu_count()
    assert results["machine"]["torch_version"]
    assert results["settings"]["model"] == "tiny"
    assert results["settings"]["num_epochs"] == 1
    assert results["settings"]["final_window"] == 3
    assert list(results["methods"]) == METHODS
    for key in ("final_reward", "reward_per_second", "time_to_reach_ddpo_final", "unet_steps"):
        assert key in results["definitions"]


def test_per_epoch_rows_are_the_runs_metrics(run):
    results, _, _ = run
    for name in METHODS:
        rows = results["methods"][name]["rows"]
        assert [row["epoch"] for row in rows] == [0]
        for key in ("reward_mean", "time/sample", "time/reward", "time/train", "train/unet_calls",
                    "train/unet_steps_per_sample", "peak_rss_mb", "bench/epoch_seconds", "bench/wall_seconds"):
            assert key in rows[0], (name, key)
        assert rows[0]["num_samples"] == 8


def test_methods_share_the_sampling_work_and_differ_in_training(run):
    results, _, _ = run
    ddpo, gp = (results["methods"][m]["config"] for m in METHODS)
    assert ddpo["sample"] == gp["sample"]
    assert ddpo["sample"]["num_steps"] == 2 and ddpo["sample"]["batch_size"] == 8
    assert ddpo["seed"] == gp["seed"]
    assert ddpo["train"]["batch_size"] == gp["train"]["batch_size"]
    assert ddpo["algorithm"]["adv_estimator"] == "ddpo" and ddpo["train"]["timestep_selection"] == "all"
    assert gp["algorithm"]["adv_estimator"] == "group_ppo" and gp["train"]["timestep_selection"] == "endpoints"


def test_same_seed_gives_the_same_epoch_zero_samples(run):
    results, _, _ = run
    first = [results["methods"][m]["rows"][0]["reward_mean"] for m in METHODS]
    assert first[0] == first[1]


def test_derived_numbers_match_a_hand_computation_from_the_rows(run):
    results, _, _ = run
    ddpo_rows = results["methods"]["ddpo"]["rows"]
    ddpo_final = sum(r["reward_mean"] for r in ddpo_rows[-3:]) / len(ddpo_rows[-3:])
    ddpo_train = sum(r["time/train"] for r in ddpo_rows) / len(ddpo_rows)
    ddpo_wall = sum(r["bench/epoch_seconds"] for r in ddpo_rows)
    for name in METHODS:
        rows = results["methods"][name]["rows"]
        s = results["methods"][name]["summary"]
        wall = sum(r["bench/epoch_seconds"] for r in rows)
        final = sum(r["reward_mean"] for r in rows[-3:]) / len(rows[-3:])
        assert s["total_wall_seconds"] == pytest.approx(wall)
        assert s["final_reward"] == pytest.approx(final)
        assert s["reward_per_second"] == pytest.approx((final - rows[0]["reward_mean"]) / wall)
        assert s["train_speedup_vs_ddpo"] == pytest.approx(ddpo_train / (sum(r["time/train"] for r in rows) / len(rows)))
        # one epoch: the trailing mean at epoch 0 is epoch 0's reward, equal for both methods (same samples)
        reach = rows[0]["bench/epoch_seconds"] if rows[0]["reward_mean"] >= ddpo_final else None
        assert s["time_to_reach_ddpo_final"] == pytest.approx(reach)
        assert s["time_to_reach_fraction"] == pytest.approx(reach / ddpo_wall)
        assert s["unet_calls"] == rows[0]["train/unet_calls"]
        assert s["unet_steps"] == pytest.approx(rows[0]["train/unet_steps_per_sample"] * 8)
    # ddpo trains both steps of all 8 trajectories; Group-PPO only the endpoint steps
    assert results["methods"]["ddpo"]["summary"]["unet_steps"] == 16


def test_markdown_has_both_tables_one_row_per_method_and_the_targets(run):
    results, markdown, _ = run
    assert markdown.startswith("# Training benchmark (quick)")
    assert "| method | sample s | reward s | train s | other s | epoch s | train speedup vs ddpo" in markdown
    assert "| method | first | last | best | final | total wall s | reward gained / s" in markdown
    for name in METHODS:
        assert sum(line.startswith(f"| {name} |") for line in markdown.splitlines()) == 3
    assert "## Targets" in markdown
    assert markdown.count("(bound ") == 2
    s = results["methods"]["ddpo"]["summary"]
    assert f"| ddpo | {s['reward_first']:.4f} | {s['reward_last']:.4f} |" in markdown


def _rows(rewards, seconds, train_seconds):
    rows, wall = [], 0.0
    for epoch, (reward, sec, train) in enumerate(zip(rewards, seconds, train_seconds)):
        wall += sec
        rows.append({
            "epoch": epoch, "reward_mean": reward, "bench/epoch_seconds": sec, "bench/wall_seconds": wall,
            "time/sample": 0.5, "time/reward": 0.0, "time/advantages": 0.0, "time/train": train,
            "train/unet_calls": 4, "train/unet_steps_per_sample": 2.0, "num_samples": 8, "peak_rss_mb": 100.0,
        })
    return rows


def _hand_results():
    config = {"train": {"num_inner_epochs": 1}}
    runs = {
        # final = (0.4 + 0.3 + 0.5) / 3 = 0.4, total wall 12 s
        "ddpo": {"config": config, "rows": _rows([0.1, 0.2, 0.4, 0.3, 0.5], [2, 2, 3, 3, 2], [1.0] * 5)},
        # trailing means 0.1, 0.3, 0.4333...: reaches 0.4 at the end of epoch 2, after 1 + 1 + 1 = 3 s
        "group_ppo_endpoints": {"config": config, "rows": _rows([0.1, 0.5, 0.7, 0.2, 0.2], [1, 1, 1, 1, 1], [0.2] * 5)},
        # trailing means 0.25, 0.25, 0.25: never reaches 0.4
        "grpo_kl": {"config": config, "rows": _rows([0.25, 0.25, 0.25], [4, 4, 4], [2.0] * 3)},
    }
    settings = {"command": "test", "model": "tiny", "num_epochs": 5, "seed": 0, "samples_per_epoch": 8, "num_steps": 2,
                "group_size": 8}
    machine = {"device": "cpu", "cpu_count": 2, "torch_version": "x", "torch_num_threads": 1}
    return bench.build_results("quick", settings, machine, runs)


def test_summary_of_hand_written_rows():
    s = _hand_results()["methods"]["ddpo"]["summary"]
    assert s["reward_first"] == 0.1 and s["reward_last"] == 0.5 and s["reward_best"] == 0.5
    assert s["final_reward"] == pytest.approx(0.4)
    assert s["total_wall_seconds"] == pytest.approx(12.0)
    assert s["reward_per_second"] == pytest.approx((0.4 - 0.1) / 12.0)
    assert s["epoch_seconds"] == pytest.approx(12.0 / 5)
    assert s["other_seconds"] == pytest.approx(12.0 / 5 - 0.5 - 0.0 - 1.0)
    assert s["unet_steps"] == pytest.approx(16.0)


def test_time_to_reach_uses_the_trailing_three_epoch_mean():
    methods = _hand_results()["methods"]
    assert methods["group_ppo_endpoints"]["summary"]["time_to_reach_ddpo_final"] == pytest.approx(3.0)
    assert methods["group_ppo_endpoints"]["summary"]["time_to_reach_fraction"] == pytest.approx(3.0 / 12.0)
    # ddpo's trailing means are 0.1, 0.15, 0.2333, 0.3, 0.4: it reaches its own final at its last epoch
    assert methods["ddpo"]["summary"]["time_to_reach_ddpo_final"] == pytest.approx(12.0)
    assert methods["grpo_kl"]["summary"]["time_to_reach_ddpo_final"] is None


def test_targets_compare_group_ppo_endpoints_with_ddpo():
    results = _hand_results()
    assert results["methods"]["group_ppo_endpoints"]["summary"]["train_speedup_vs_ddpo"] == pytest.approx(5.0)
    speed, reach = results["targets"]["train_speedup"], results["targets"]["time_to_ddpo_final"]
    assert speed["measured"] == pytest.approx(5.0) and speed["met"] is True
    assert reach["measured"] == pytest.approx(0.25) and reach["met"] is True
    markdown = bench.render_markdown(results)
    assert "| grpo_kl | 0.2500 | 0.2500 | 0.2500 | 0.2500 | 12.0 | 0.000e+00 | - | - |" in markdown


def test_without_ddpo_the_comparisons_and_targets_are_not_measured():
    results = _hand_results()
    runs = {"grpo_kl": {"config": results["methods"]["grpo_kl"]["config"], "rows": results["methods"]["grpo_kl"]["rows"]}}
    alone = bench.build_results("quick", results["settings"], results["machine"], runs)
    assert alone["methods"]["grpo_kl"]["summary"]["train_speedup_vs_ddpo"] is None
    assert alone["targets"]["train_speedup"]["met"] is None
    assert alone["targets"]["time_to_ddpo_final"]["met"] is None
    assert "**not measured**" in bench.render_markdown(alone)


def test_unknown_method_is_rejected_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--methods", "ddpo,ppo2"])
    err = capsys.readouterr().err
    assert "ppo2" in err and "group_ppo_endpoints" in err


def test_time_to_reach_target_is_not_meaningful_when_ddpo_did_not_improve():
    results = _hand_results()
    runs = {name: {"config": m["config"], "rows": m["rows"]} for name, m in results["methods"].items()}
    for row in runs["ddpo"]["rows"]:
        row["reward_mean"] = 0.5 - row["reward_mean"]  # 0.4, 0.3, 0.1, 0.2, 0.0: final 0.1 < initial 0.4
    flat = bench.build_results("quick", results["settings"], results["machine"], runs)
    assert flat["targets"]["time_to_ddpo_final"]["met"] is None
    assert "not meaningful" in bench.render_markdown(flat)


def test_from_json_rebuilds_the_same_tables_without_training(run, tmp_path):
    results, markdown, out = run
    rebuilt = bench.main(["--from-json", str(out / "bench_quick.json"), "--output-dir", str(tmp_path)])
    assert rebuilt["methods"]["ddpo"]["summary"] == results["methods"]["ddpo"]["summary"]
    assert (tmp_path / "bench_quick.md").read_text() == markdown


@pytest.fixture(scope="module")
def seeds_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("seeds")
    bench.main([
        "--model", "tiny", "--seeds", "2", "--epochs", "2", "--eval-freq", "1", "--num-steps", "2",
        "--sample-batch-size", "8", "--num-batches", "1", "--methods", "ddpo,group_ppo_sampled,early_window",
        "--output-dir", str(out),
    ])
    with open(out / "bench_seeds.json") as f:
        return json.load(f), (out / "bench_seeds.md").read_text()


def test_seeds_json_has_seeds_and_summary_statistics(seeds_run):
    results, markdown = seeds_run
    assert results["seeds"] == [42, 43]
    for method in ("ddpo", "group_ppo_sampled", "early_window"):
        stats = results["summary"][method]
        for key in ("initial_reward", "final_reward", "time_to_reach_fraction", "train_seconds_per_epoch", "epoch_seconds"):
            assert set(stats[key]) >= {"median", "min", "max"}
        assert f"| {method} |" in markdown


def test_seed_statistics_are_recomputed_from_the_evaluation_rows(seeds_run):
    results, _ = seeds_run
    for method, by_seed in results["runs"].items():
        finals = []
        for rows in by_seed.values():
            evaluations = [row for row in rows if "eval/reward_mean" in row]
            assert [row["epoch"] for row in evaluations] == [0, 1, 2]  # eval every epoch and the final weights
            finals.append(evaluations[-1]["eval/reward_mean"])
        stats = results["summary"][method]["final_reward"]
        assert stats["min"] == pytest.approx(min(finals)) and stats["max"] == pytest.approx(max(finals))
        assert stats["median"] == pytest.approx(sum(finals) / 2)  # the median of two values is their mean
    # ddpo reaches its own final reward at or before its end: a fraction in [0, 1]
    ddpo = results["summary"]["ddpo"]["time_to_reach_fraction"]
    assert ddpo["reached"] == 2 and 0.0 <= ddpo["min"] <= ddpo["max"] <= 1.0


def test_merge_reads_plain_and_gzip_parts_into_the_same_summary(seeds_run, tmp_path):
    import gzip

    results, _ = seeds_run
    first = dict(results, runs={"ddpo": results["runs"]["ddpo"]})
    second = dict(results, runs={m: r for m, r in results["runs"].items() if m != "ddpo"})
    (tmp_path / "a.json").write_text(json.dumps(first))
    with gzip.open(tmp_path / "b.json.gz", "wt") as f:
        json.dump(second, f)
    merged = bench.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json.gz"), "--output-dir", str(tmp_path / "m")])
    assert set(merged["runs"]) == set(results["runs"])
    for method in results["runs"]:
        assert merged["summary"][method]["final_reward"] == results["summary"][method]["final_reward"]


def test_method_specs_name_a_method_and_change_fields():
    label, method, fields = bench.parse_method_spec("w4=group_ppo_start:sample.sde_window_size=4:group_ppo.advantage_norm=group")
    assert (label, method) == ("w4", "group_ppo_start")
    assert fields == {"sample.sde_window_size": 4, "group_ppo.advantage_norm": "group"}
    assert bench.parse_method_spec("ddpo") == ("ddpo", "ddpo", {})
    config = bench.build_method_config("w4=group_ppo_start:sample.sde_window_size=4:train.learning_rate=1e-4",
                                       "tiny", 1, "/tmp/unused/w4")
    assert config.sample.sde_window_size == 4 and config.train.learning_rate == 1e-4
    assert config.train.timestep_selection == "segment_start"
    with pytest.raises(ValueError, match="unknown method"):
        bench.parse_method_spec("x=nope:train.learning_rate=1")


def test_parallel_jobs_train_each_method_and_seed_in_its_own_process_and_merge(tmp_path):
    results = bench.main([
        "--model", "tiny", "--seeds", "2", "--epochs", "1", "--eval-freq", "1", "--num-steps", "2",
        "--sample-batch-size", "8", "--num-batches", "1", "--jobs", "2", "--target", "-1",
        "--methods", "ddpo,w1=sde_window2:sample.sde_window_size=1", "--reference", "ddpo", "--output-dir", str(tmp_path),
    ])
    assert results["seeds"] == [42, 43] and set(results["runs"]) == {"ddpo", "w1"}
    for label in ("ddpo", "w1"):
        for seed in (42, 43):
            log = (tmp_path / "parts" / f"{label}_{seed}" / "log.txt").read_text()
            assert (tmp_path / "parts" / f"{label}_{seed}" / "bench_seeds.json").exists(), log
    # the window run trains one step per trajectory: its training rows say so
    rows = [row for row in results["runs"]["w1"][42] if "steps/trained" in row]
    assert rows and all(sum(row["steps/trained"]) == 1 for row in rows)
    # every run reaches a target of -1 at its first evaluation (epoch 0, no training seconds yet)
    assert results["summary"]["w1"]["epochs_to_target"]["median"] == 0
    assert results["per_seed"]["w1"][42]["seconds_to_target"] == 0.0


def test_the_device_session_script_says_how_to_use_it():
    import subprocess

    result = subprocess.run(["bash", os.path.join(REPO_ROOT, "benchmarks", "device_session.sh")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "usage: bash benchmarks/device_session.sh download | tests" in result.stdout


def test_the_scenes_study_measures_only_the_flow_models_runs_against_the_flow_target(tmp_path):
    """The target is the best flow_grpo run's final GenEval overall on tiny-scenes-sd3; a run of the UNet model
    tiny-scenes starts from another base (0.196 > 0.165 here), so 'reached at 0 s' would be meaningless for it."""
    import shutil

    root = REPO_ROOT
    committed = os.path.join(root, "benchmarks", "results", "scenes_study", "runs")
    for method in ("flow_grpo", "grpo_kl"):
        shutil.copytree(os.path.join(committed, method, "seed_42"), tmp_path / "runs" / method / "seed_42")
    study = load_script("benchmarks/scenes_study.py")
    summary, table, target, _ = study.collect(str(tmp_path))
    rows = {row["method"]: row for row in table}
    flow_final = [r["overall"] for r in summary if r["method"] == "flow_grpo"][0]
    assert target == flow_final
    assert rows["flow_grpo"]["reached_target"] == "1/1" and rows["flow_grpo"]["ratio_to_flow_grpo"] == 1.0
    assert rows["grpo_kl"]["model"] == "tiny-scenes"
    assert rows["grpo_kl"]["reached_target"].startswith("n/a") and rows["grpo_kl"]["seconds_to_target"] is None


def test_a_scenes_study_probe_overrides_a_field_after_the_methods_fields():
    """--set FIELD=VALUE (a probe: a larger learning rate, longer runs) lands in every run's config after the method's
    own fields, typed as the field is; the committed lr probe's config.json holds what the command gives."""
    import json

    root = REPO_ROOT
    study = load_script("benchmarks/scenes_study.py")
    plain = study.method_config("flow_grpo", 42, "/nonexistent/runs/flow_grpo/seed_42")
    probe = study.method_config("flow_grpo", 42, "/nonexistent/runs/flow_grpo/seed_42", 80,
                                ["train.learning_rate=1e-3", "train.beta=0"])
    assert plain.train.learning_rate == 2e-4 and plain.num_epochs == 40
    assert probe.train.learning_rate == 1e-3 and probe.num_epochs == 80
    assert probe.train.beta == 0.0 and isinstance(probe.train.beta, float)
    committed = os.path.join(root, "benchmarks", "results", "scenes_study_lr1e-3", "runs", "flow_grpo", "seed_42")
    with open(os.path.join(committed, "config.json")) as f:
        stored = json.load(f)
    assert stored["train"]["learning_rate"] == 1e-3 and stored["num_epochs"] == 80


def test_the_scenes_study_table_takes_the_reevaluations_and_the_base_of_the_variants_own_sampler(tmp_path):
    """--reevaluate writes each run's reeval.json (its final weights at several eval seeds, one sampler) and the
    bases' reeval_base_<variant>.json; collect puts their means beside the logged finals. A cps run evaluates with
    its own SDE (epoch 0: 0.126), so the base row comes from a run on the variant's sampler (flow_grpo: 0.142)
    even when the cps run is read first."""
    import json
    import shutil

    root = REPO_ROOT
    committed = os.path.join(root, "benchmarks", "results", "scenes_study", "runs")
    for method in ("cps", "flow_grpo"):
        shutil.copytree(os.path.join(committed, method, "seed_42"), tmp_path / "runs" / method / "seed_42",
                        ignore=shutil.ignore_patterns("reeval.json"))  # the test writes its own
    study = load_script("benchmarks/scenes_study.py")
    study.METHODS = {"cps": study.METHODS["cps"], "flow_grpo": study.METHODS["flow_grpo"]}  # cps read first
    tags = dict.fromkeys(study.TAGS, 0.5)
    settings = {"eval_seeds": [1, 2], "eta": 0.0, "images_per_record": 4}
    (tmp_path / "runs" / "flow_grpo" / "seed_42" / "reeval.json").write_text(json.dumps(
        {"settings": settings, "rows": [{"eval_seed": 1, "overall": 0.2, **tags}, {"eval_seed": 2, "overall": 0.4, **tags}]}))
    (tmp_path / "reeval_base_tiny_scenes.json").write_text(json.dumps(
        {"settings": settings, "rows": [{"eval_seed": 1, "overall": 0.1, **tags}, {"eval_seed": 2, "overall": 0.2, **tags}]}))
    summary, table, _, _ = study.collect(str(tmp_path))
    base = [r for r in summary if r["method"] == "base"][0]
    first_flow_row = json.loads((tmp_path / "runs" / "flow_grpo" / "seed_42" / "metrics.jsonl").read_text().splitlines()[0])
    assert base["overall"] == first_flow_row["eval/geneval/overall"]
    assert abs(base["reeval"]["overall"] - 0.15) < 1e-12 and base["reeval"]["images_per_record"] == 4
    flow = [r for r in summary if r["method"] == "flow_grpo"][0]
    assert abs(flow["reeval"]["overall"] - 0.3) < 1e-12 and abs(flow["reeval"]["colors"] - 0.5) < 1e-12
    rows = {row["method"]: row for row in table}
    assert abs(rows["flow_grpo"]["reeval_overall"]["median"] - 0.3) < 1e-12
    assert rows["cps"]["reeval_overall"] is None  # not re-evaluated yet
    assert "| tiny-scenes-sd3 | base | " in study.render(table, 0.1, summary)


def test_the_scenes_study_collects_without_flow_grpo_runs_and_its_table_rows_have_the_headers_cells(tmp_path):
    """collect failed (None - float) when no flow_grpo run was there to set the target; and the table's separator row
    had one cell more than its header."""
    import shutil

    committed = os.path.join(REPO_ROOT, "benchmarks", "results", "scenes_study", "runs")
    shutil.copytree(os.path.join(committed, "grpo_kl", "seed_42"), tmp_path / "runs" / "grpo_kl" / "seed_42")
    study = load_script("benchmarks/scenes_study.py")
    summary, table, target, _ = study.collect(str(tmp_path))
    assert target is None and [row["method"] for row in table] == ["grpo_kl"]
    assert table[0]["seconds_to_target"] is None
    lines = [line for line in study.render(table, 0.5, summary).splitlines() if line.startswith("|")]
    cells = {line.count("|") for line in lines}
    assert len(cells) == 1, lines[:3]


# Issue 54: a benchmark never writes over a folder it did not make, refuses the committed results' folder unless
# told where to write, checks its flags with the trainer's own checks before anything runs, and exits non-zero
# when a run it started failed.


def _finished_run(run_dir, variant="tiny"):
    """A finished run as the trainer leaves one: config.json, the library's mark, metrics.jsonl, finished.json."""
    from ddpo_group.config.grpo import get_config
    from ddpo_group.runs.run_dir import RunDir

    config = get_config(variant)
    config.logdir, config.run_name = os.path.dirname(str(run_dir)), os.path.basename(str(run_dir))
    files = RunDir(str(run_dir))
    files.start(config, 0)
    files.append_metrics({"epoch": 0, "reward_mean": 0.5})
    files.mark_finished(1, None)
    files.release()
    return {name: (run_dir / name).read_bytes() for name in os.listdir(run_dir)}


def _last_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


def test_overhead_never_writes_over_a_finished_run_in_its_logdir(tmp_path, capsys):
    """It forced config.overwrite, so `--logdir DIR` deleted the finished run DIR/tiny (rc 0)."""
    overhead = load_script("benchmarks/overhead.py")
    before = _finished_run(tmp_path / "tiny")
    with pytest.raises(SystemExit) as exit_info:
        overhead.main(["--config", "tiny", "--epochs", "1", "--logdir", str(tmp_path)])
    assert exit_info.value.code == 2
    line = _last_error_line(capsys)
    assert "--logdir" in line and str(tmp_path / "tiny") in line and "Traceback" not in line
    assert {name: (tmp_path / "tiny" / name).read_bytes() for name in os.listdir(tmp_path / "tiny")} == before


def test_overhead_refuses_a_set_value_the_trainers_check_refuses_in_one_line_before_anything_runs(tmp_path, capsys):
    """`--set sample.num_steps=-1` passed the script's own check (an int field) and ended in the trainer's
    ConfigError traceback after the models were built."""
    overhead = load_script("benchmarks/overhead.py")
    with pytest.raises(SystemExit) as exit_info:
        overhead.main(["--config", "tiny", "--epochs", "1", "--logdir", str(tmp_path), "--set", "sample.num_steps=-1"])
    assert exit_info.value.code == 2
    assert "sample.num_steps" in _last_error_line(capsys)
    assert os.listdir(tmp_path) == []  # nothing was created


def test_overhead_refuses_a_logdir_that_is_a_file_or_holds_a_folder_not_a_run(tmp_path, capsys):
    """A --logdir that is a file, or whose <variant> folder holds the user's files: the trainer's ConfigError
    traceback; now one line naming --logdir and the path."""
    overhead = load_script("benchmarks/overhead.py")
    (tmp_path / "a_file").write_text("mine")
    (tmp_path / "mine" / "tiny").mkdir(parents=True)
    (tmp_path / "mine" / "tiny" / "notes.txt").write_text("mine")
    for logdir, named in ((tmp_path / "a_file", tmp_path / "a_file"), (tmp_path / "mine", tmp_path / "mine" / "tiny")):
        with pytest.raises(SystemExit) as exit_info:
            overhead.main(["--config", "tiny", "--epochs", "1", "--logdir", str(logdir)])
        assert exit_info.value.code == 2
        line = _last_error_line(capsys)
        assert ": error: --logdir" in line and str(named) in line
    assert (tmp_path / "a_file").read_text() == "mine" and os.listdir(tmp_path / "mine" / "tiny") == ["notes.txt"]


def test_the_scenes_study_refuses_its_committed_folder_unless_results_names_it(monkeypatch, capsys):
    """`--set ...` without --results ran nothing (the committed runs were "finished"), printed the committed table
    as the probe's and rewrote the committed study.json and metrics, rc 0."""
    study = load_script("benchmarks/scenes_study.py")

    def no_write(*args, **kwargs):
        raise AssertionError("the committed study's files were written")

    monkeypatch.setattr(study, "write_json", no_write)
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--methods", "flow_grpo", "--seeds", "42", "--set", "train.learning_rate=1e-3"])
    assert exit_info.value.code == 2
    line = _last_error_line(capsys)
    assert "--results" in line and "committed" in line and "benchmarks/results/scenes_study" in line


def _study_refusal(tmp_path, capsys, argv):
    """(the study module, the error line) of `argv` run against a copy of the committed flow_grpo seed-42 run (the
    default command's: tiny-scenes-sd3, 40 epochs, lr 2e-4) in tmp_path; the exit status must be 2."""
    import shutil

    committed = os.path.join(REPO_ROOT, "benchmarks", "results", "scenes_study", "runs", "flow_grpo", "seed_42")
    shutil.copytree(committed, tmp_path / "runs" / "flow_grpo" / "seed_42")
    study = load_script("benchmarks/scenes_study.py")
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--methods", "flow_grpo", "--seeds", "42", *argv, "--results", str(tmp_path)])
    assert exit_info.value.code == 2
    return study, _last_error_line(capsys)


def test_the_scenes_study_refuses_a_finished_run_of_other_fields_in_its_results(tmp_path, capsys):
    """A probe (--set train.learning_rate=1e-3) whose --results holds finished runs of the default learning rate
    reported those as its own; now refused before anything runs, naming the field, both values and the run."""
    _, line = _study_refusal(tmp_path, capsys, ["--set", "train.learning_rate=1e-3"])
    assert "train.learning_rate: stored 0.0002, this command 0.001" in line
    assert str(tmp_path / "runs" / "flow_grpo" / "seed_42") in line
    assert not (tmp_path / "study.json").exists()


def test_a_finished_run_of_the_commands_own_fields_is_not_refused():
    """The committed flow_grpo runs are the default command's (seed, 40 epochs): the study resumes past them."""
    study = load_script("benchmarks/scenes_study.py")
    results = os.path.join(REPO_ROOT, "benchmarks", "results", "scenes_study")
    study.check_run_dirs(results, ["flow_grpo"], [42, 43, 44], 0, [])
    lr = os.path.join(REPO_ROOT, "benchmarks", "results", "scenes_study_lr1e-3")
    study.check_run_dirs(lr, ["flow_grpo"], [42], 80, ["train.learning_rate=1e-3"])


def _failing_python(tmp_path):
    """An interpreter stand-in whose every run fails at once (exit 3): a run process that crashed."""
    path = tmp_path / "failing_python"
    path.write_text("#!/bin/sh\necho 'a run that failed' >&2\nexit 3\n")
    path.chmod(0o755)
    return str(path)


def test_the_scenes_study_exits_non_zero_when_its_runs_fail(tmp_path, monkeypatch, capsys):
    """Every run failing ended in exit 0 and a table of nothing."""
    import sys

    study = load_script("benchmarks/scenes_study.py")
    import run_pool  # the study's launcher (benchmarks/run_pool.py, on the path the study put it on)

    monkeypatch.setattr(run_pool.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(sys, "executable", _failing_python(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--methods", "flow_grpo", "--seeds", "42,43", "--jobs", "2", "--results", str(tmp_path / "r")])
    assert exit_info.value.code == 1
    line = _last_error_line(capsys)
    assert "2 runs failed" in line and "flow_grpo seed 42 (exit 3" in line and "flow_grpo seed 43 (exit 3" in line
    assert not (tmp_path / "r" / "study.json").exists()


def test_bench_training_never_removes_a_runs_folder_it_did_not_make(tmp_path, capsys):
    """It removed OUTPUT_DIR/runs/<mode>/<method> with shutil.rmtree, whatever was there."""
    mine = tmp_path / "runs" / "quick" / "ddpo"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--model", "tiny", "--quick", "--epochs", "1", "--num-steps", "2", "--sample-batch-size", "8",
                    "--num-batches", "1", "--methods", "ddpo", "--no-warmup", "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 1
    line = _last_error_line(capsys)
    assert "--output-dir" in line and str(tmp_path / "runs") in line and "not made by bench_training.py" in line
    assert (mine / "notes.txt").read_text() == "mine"


def test_bench_training_refuses_the_committed_full_results_as_its_default_output(capsys):
    """The full run's default output, benchmarks/results/bench_full.json, is committed: only --output-dir naming it
    replaces it; --quick's bench_quick.json there is not committed and stays the default."""
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args([])
    assert exit_info.value.code == 2
    line = _last_error_line(capsys)
    assert "--output-dir" in line and "bench_full" in line
    assert bench.parse_args(["--quick"]).output_dir == os.path.join(REPO_ROOT, "benchmarks", "results")
    named = os.path.join(REPO_ROOT, "benchmarks", "results")
    assert bench.parse_args(["--output-dir", named]).output_dir == named


def test_bench_training_exits_non_zero_without_a_summary_when_a_parallel_training_fails(tmp_path, monkeypatch, capsys):
    """A --jobs training that failed was left out and the rest summarized as the study, exit 0."""
    import sys

    monkeypatch.setattr(sys, "executable", _failing_python(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--model", "tiny", "--seeds", "2", "--epochs", "1", "--jobs", "2", "--methods", "ddpo",
                    "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    line = _last_error_line(capsys)
    assert "2 of 2 trainings failed" in line and "ddpo seed 42 (exit 3" in line
    assert not (tmp_path / "out" / "bench_seeds.json").exists()


def test_async_rollout_refuses_its_committed_default_output_and_a_logdir_run_before_any_run(tmp_path, monkeypatch,
                                                                                          capsys):
    """Without --output it wrote over the committed result.json; a --logdir holding a run ended in the trainer's
    ConfigError traceback."""
    script = load_script("benchmarks/async_rollout.py")

    def no_run(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(script, "run_once", no_run)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--epochs", "1", "--seeds", "0", "--modes", "sync"])
    assert exit_info.value.code == 2
    line = _last_error_line(capsys)
    assert "--output" in line and "benchmarks/results/async_rollout/result.json" in line
    _finished_run(tmp_path / "sync_seed0")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--epochs", "1", "--seeds", "0", "--modes", "sync", "--logdir", str(tmp_path),
                     "--output", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    assert "--logdir" in _last_error_line(capsys) and (tmp_path / "sync_seed0" / "finished.json").exists()


def test_variance_decomposition_refuses_its_committed_defaults(capsys):
    """Its defaults are the committed result and the docs' figure: written over by any run without --output."""
    script = load_script("benchmarks/variance_decomposition.py")
    for argv, option in (([], "--output"), (["--output", "/nonexistent/x.json"], "--png")):
        with pytest.raises(SystemExit) as exit_info:
            script.main(argv)
        assert exit_info.value.code == 2
        assert f": error: {option} defaults to" in _last_error_line(capsys)


def test_main_job_numbers_trains_into_a_new_folder_never_overwriting(tmp_path, monkeypatch):
    """--run passed --config.overwrite=True on runs/main_job_check, a folder it may not have made."""
    script = load_script("benchmarks/main_job_numbers.py")
    (tmp_path / "runs" / "main_job_check").mkdir(parents=True)
    (tmp_path / "runs" / "main_job_check" / "notes.txt").write_text("mine")
    commands = []

    def fake_run(command, **kwargs):  # the launcher: a run that finishes at once with no metrics
        commands.append(command)
        logdir = next(a.split("=", 1)[1] for a in command if a.startswith("--config.logdir="))
        os.makedirs(os.path.join(logdir, "main_job"))
        open(os.path.join(logdir, "main_job", "finished.json"), "w").close()

    monkeypatch.setattr(script, "ROOT", str(tmp_path))
    monkeypatch.setattr(script.subprocess, "run", fake_run)
    assert script.main(["--run", "--readme", os.path.join(REPO_ROOT, "docs", "results.md")]) == 2  # no metrics.jsonl
    (command,) = commands
    assert not any("overwrite" in a for a in command)
    logdir = next(a.split("=", 1)[1] for a in command if a.startswith("--config.logdir="))
    assert os.path.dirname(logdir) == str(tmp_path / "runs") and logdir != str(tmp_path / "runs" / "main_job_check")
    assert (tmp_path / "runs" / "main_job_check" / "notes.txt").read_text() == "mine"


def test_a_benchmark_run_that_did_not_finish_is_an_error_naming_it(tmp_path):
    outputs = load_script("benchmarks/bench_outputs.py")
    (tmp_path / "failed.json").write_text("{}")
    with pytest.raises(outputs.BenchmarkError, match="did not finish.*failed.json"):
        outputs.require_finished(str(tmp_path))
    (tmp_path / "finished.json").write_text("{}")
    outputs.require_finished(str(tmp_path))


def test_a_committed_default_is_refused_and_a_named_or_uncommitted_one_is_not(tmp_path):
    outputs = load_script("benchmarks/bench_outputs.py")
    committed = os.path.join(REPO_ROOT, "benchmarks", "results", "overhead", "tiny.json")
    with pytest.raises(outputs.BenchmarkError, match="--output defaults to benchmarks/results/overhead/tiny.json"):
        outputs.refuse_committed_default("--output", committed, given=False)
    outputs.refuse_committed_default("--output", committed, given=True)
    outputs.refuse_committed_default("--output", str(tmp_path / "new.json"), given=False)


def test_the_scenes_study_refuses_a_set_value_the_trainer_refuses_for_one_of_its_methods(tmp_path, capsys):
    """--set sample.num_steps=3 passed the study's own check (an int field) and failed every mixgrpo run (its
    4-step SDE window) in its log; now one line naming the field and the method before any run starts."""
    study = load_script("benchmarks/scenes_study.py")
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--methods", "flow_grpo,mixgrpo", "--seeds", "42", "--set", "sample.num_steps=3",
                    "--results", str(tmp_path)])
    assert exit_info.value.code == 2
    line = _last_error_line(capsys)
    assert "sample.sde_window_size=4" in line and "sample.num_steps=3" in line and "(method mixgrpo)" in line
    assert os.listdir(tmp_path) == []


def test_the_null_reward_hands_back_the_true_scores_shuffled_and_logs_them_unshuffled():
    """benchmarks/null_reward.py (docs/scenes.md, the flow fall): the rewards are a permutation of GenEval's own
    partial scores on the same images (here rendered scenes of the prompt, which score 1, and blank images, which
    score 0), its info is the true one, and a run shuffles the same way every time."""
    import numpy as np
    import torch

    from ddpo_group.data.scenes import render_record, scene_training_prompts
    from ddpo_group.rewards.geneval.reward import GenEvalReward

    (record,) = scene_training_prompts(prompt="a photo of a magenta star")
    rng = np.random.default_rng(0)
    scenes = [torch.from_numpy(render_record(record, rng)).permute(2, 0, 1).float() / 255 for _ in range(4)]
    images = torch.stack(scenes + [torch.zeros_like(scenes[0])] * 4)
    prompts, metadata = [record["prompt"]] * 8, [dict(record) for _ in range(8)]
    true = GenEvalReward(score="partial", detector="shapes")
    expected, expected_info = true(images, prompts, metadata)
    assert list(np.asarray(expected)) == [1.0] * 4 + [0.0] * 4  # the drawn star is found, a blank image scores 0

    null = load_script("benchmarks/null_reward.py")
    calls = [null.ShuffledGenEval()(images, prompts, metadata) for _ in range(2)]
    for rewards, info in calls:
        assert sorted(np.asarray(rewards)) == sorted(np.asarray(expected))
        assert info.keys() == expected_info.keys()
        for key, value in expected_info.items():
            assert np.array_equal(np.asarray(info[key]), np.asarray(value)), key
    one_run = null.ShuffledGenEval()
    first, second = one_run(images, prompts, metadata)[0], one_run(images, prompts, metadata)[0]
    assert list(first) == list(calls[0][0])  # a fresh run shuffles as the last one did, call for call
    assert list(first) != list(second) or list(first) != list(one_run(images, prompts, metadata)[0])


def test_the_fragility_step_moves_every_weight_by_eps_and_reports_its_size():
    """benchmarks/weight_fragility.py's perturbation: every weight moves by exactly +-eps (Adam's first step on a
    gradient of noise), the same seed draws the same signs, and the sizes it reports are the L2 norms of the step
    (eps * sqrt(number of weights)) and of the weights before it."""
    import torch

    fragility = load_script("benchmarks/weight_fragility.py")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = [p.detach().clone() for p in module.parameters()]
    weight_norm = torch.cat([p.flatten() for p in before]).norm().item()
    step_norm, reported_weights = fragility.perturb(module, 0.01, seed=5)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(module.parameters(), before)])
    assert moved.numel() == 3 * 4 + 4 + 4 * 2 + 2
    assert torch.allclose(moved.abs(), torch.full_like(moved, 0.01), atol=1e-7)
    assert step_norm == pytest.approx(0.01 * moved.numel() ** 0.5)
    assert reported_weights == pytest.approx(weight_norm)
    again = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    again.load_state_dict({k: v for k, v in zip(again.state_dict(), before)})
    fragility.perturb(again, 0.01, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), module.parameters()))


def _write_two_object_folder(path, scenes):
    """scripts/evaluate.py --save-images' layout for one two_object record ("a star and a triangle") and one colors
    record, its images rendered scenes."""
    from PIL import Image

    from ddpo_group.rewards.geneval.shapes_scenes import render_scene

    records = [{"tag": "two_object", "include": [{"class": "star", "count": 1}, {"class": "triangle", "count": 1}],
                "exclude": [], "prompt": "a photo of a star and a triangle"},
               {"tag": "colors", "include": [{"class": "star", "count": 1, "color": "magenta"}], "exclude": [],
                "prompt": "a photo of a magenta star"}]
    for index, (record, images) in enumerate(zip(records, (scenes, scenes[:1]))):
        samples = path / f"{index:05d}" / "samples"
        samples.mkdir(parents=True)
        (path / f"{index:05d}" / "metadata.jsonl").write_text(json.dumps(record) + "\n")
        for j, scene in enumerate(images):
            Image.fromarray(render_scene(scene)).save(samples / f"{j:04d}.png")
    return str(path)


def test_the_composition_of_a_two_object_prompt_against_one_coin_per_object(tmp_path, capsys):
    """benchmarks/scenes_composition.py (docs/scenes.md, two_object's plateau): five rendered images of "a star and
    a triangle": a star and a triangle twice, two stars, two triangles, one circle. By hand: shares 2/5, 1/5, 1/5,
    1/5; four images of two objects from {star, triangle} hold 4 stars of 8 objects, p = 1/2; one coin per object
    gives a star and a triangle 2 p (1 - p) = 1/2 of those four, 2/5 of all five, and that is also its ceiling
    (1/2 x 4/5). The colors record is not a two-object record and is left out."""
    from ddpo_group.rewards.geneval.shapes_scenes import SceneObject

    def obj(shape, color, x, y):
        return SceneObject(shape, color, (x, y), 130.0)

    scenes = [[obj("star", "red", 18, 18), obj("triangle", "blue", 46, 44)],
              [obj("triangle", "green", 16, 44), obj("star", "magenta", 44, 18)],
              [obj("star", "yellow", 18, 18), obj("star", "blue", 46, 44)],
              [obj("triangle", "red", 18, 18), obj("triangle", "cyan", 46, 44)],
              [obj("circle", "blue", 32, 32)]]
    folder = _write_two_object_folder(tmp_path / "images", scenes)
    composition = load_script("benchmarks/scenes_composition.py")
    output = tmp_path / "out" / "composition.json"
    results = composition.main(["--images", f"made by hand={folder}", "--output", str(output)])
    (row,) = results["made by hand"]
    assert row["prompt"] == "a photo of a star and a triangle" and row["images"] == 5
    assert row["shares"] == pytest.approx({"A + B": 0.4, "A + A": 0.2, "B + B": 0.2, "other": 0.2})
    assert row["p"] == pytest.approx(0.5)
    assert row["one_coin_per_object"] == pytest.approx({"A + B": 0.4, "A + A": 0.2, "B + B": 0.2})
    assert row["ceiling"] == pytest.approx(0.4)
    assert json.loads(output.read_text())["results"]["made by hand"][0]["ceiling"] == pytest.approx(0.4)
    assert "| made by hand | a photo of a star and a triangle | 5 | 0.400 |" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_info:  # a measurement is never written over
        composition.main(["--images", f"made by hand={folder}", "--output", str(output)])
    assert exit_info.value.code == 2


def test_the_composition_refuses_a_folder_that_is_not_evaluate_s_images(tmp_path, capsys):
    composition = load_script("benchmarks/scenes_composition.py")
    with pytest.raises(SystemExit) as exit_info:
        composition.main(["--images", f"empty={tmp_path}"])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("scenes_composition.py: error: --images ") and "scripts/evaluate.py --save-images" in line


def test_the_vae_ceiling_scores_rendered_scenes_exact_and_counts_every_held_out_record(tmp_path, capsys):
    ceiling = load_script("benchmarks/scenes_vae_ceiling.py")
    output = tmp_path / "ceiling.json"
    ceiling.main(["--scales", "coarse", "--images-per-prompt", "1", "--output", str(output)])
    result = json.loads(output.read_text())
    row = result["scales"]["coarse"]
    assert row["object_area"] == [150.0, 260.0]
    # the held-out set's records per tag (docs/scenes.md: 8 / 18 / 16 / 32 / 38 / 38), one image each
    assert {tag: v["images"] for tag, v in row["held_out"].items()} == {
        "single_object": 8, "two_object": 18, "counting": 16, "colors": 32, "position": 38, "color_attr": 38}
    assert len(row["counting_training_prompts"]) == 8
    # the detector is exact on rendered scenes: every one strict-correct before the VAE
    assert all(v["rendered"] == 1.0 for split in ("held_out", "counting_training_prompts") for v in row[split].values())
    assert all(0.0 <= v["through_vae"] <= 1.0 for v in row["held_out"].values())
    assert "coarse  150-260" in capsys.readouterr().out


def test_the_vae_ceiling_refuses_an_unknown_scale(capsys):
    with pytest.raises(SystemExit):
        load_script("benchmarks/scenes_vae_ceiling.py").main(["--scales", "medium"])
    assert "--scales" in capsys.readouterr().err


def test_the_samples_grid_draws_one_tile_a_held_out_record_eight_a_row(tmp_path):
    import numpy as np
    from PIL import Image

    grid = load_script("benchmarks/scenes_samples_grid.py")
    output = tmp_path / "grid.png"
    grid.main(["tiny-scenes", str(output), "--records", "3", "--num-steps", "2"])
    pixels = np.asarray(Image.open(output))
    assert pixels.shape == (64, 8 * 64, 3)  # one row of 8 tiles of the 64-px world, 3 of them drawn
    tiles = [pixels[:, 64 * k : 64 * (k + 1)] for k in range(8)]
    assert all(tile.std() > 0 for tile in tiles[:3]) and all(tile.max() == 0 for tile in tiles[3:])


def test_the_samples_grid_refuses_a_folder_that_does_not_exist(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script("benchmarks/scenes_samples_grid.py").main(["tiny-scenes", str(tmp_path / "no" / "grid.png")])
    assert exit_info.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_split_half_cosines_estimate_the_gradient_s_signal_to_noise():
    import numpy as np

    snr = load_script("benchmarks/gradient_snr.py")
    rng = np.random.default_rng(0)
    # each image's score gradient: r_i mu + z_i, z ~ N(0, noise^2 I_d), rewards 0 / 1 at random, ||mu|| = 1. A batch of
    # n with its own advantages A = (r - mean) / std: g = n std(r) mu + sum_i A_i z_i, whose noise has variance
    # n noise^2 d (sum A_i^2 = n); so cos = n^2 var(r) / (n^2 var(r) + n noise^2 d) = n / (n + 4 noise^2 d)
    d, images, noise = 1000, 400, 0.05
    mu = rng.normal(size=d)
    mu /= np.linalg.norm(mu)
    rewards = rng.integers(0, 2, images).astype(float)
    signal = rewards[:, None] * mu + noise * rng.normal(size=(images, d))
    pure_noise = noise * rng.normal(size=(images, d))  # a step whose score the reward does not see
    scores = np.stack([signal, pure_noise], axis=1).astype(np.float32)
    sizes = snr.half_sizes(images)
    assert sizes == [8, 16, 32, 64, 128, 200]
    cos, dot, spread = snr.split_half_stats(scores, rewards, sizes, splits=30, rng=rng, clip=5.0)
    assert cos.shape == dot.shape == spread.shape == (6, 3)  # two steps and their sum
    for k, n in enumerate(sizes):
        assert cos[k, 0] == pytest.approx(n / (n + 4 * noise**2 * d), abs=0.06)
        assert abs(cos[k, 1]) < 0.06  # no signal: the two batches agree by chance only
    null, _, null_spread = snr.split_half_stats(scores, rewards, sizes, splits=30, rng=rng, clip=5.0, shuffle=True)
    assert np.all(np.abs(null[:, 0]) < 0.08) and np.all(null_spread[:, 0] > 0)
    assert snr.images_for_even_odds(0.5, 64) == 64 and snr.images_for_even_odds(0.2, 64) == 256
    assert snr.images_for_even_odds(0.0, 64) == float("inf")


def test_grpo_advantages_of_one_prompt_and_the_count_sketch_s_inner_products():
    import numpy as np
    import torch

    snr = load_script("benchmarks/gradient_snr.py")
    # rewards 0, 1, 1, 1: mean 0.75, population std sqrt(3) / 4; clipped at 1.5
    np.testing.assert_allclose(snr.grpo_advantages([0, 1, 1, 1], 1.5), [-1.5, 1 / 3**0.5, 1 / 3**0.5, 1 / 3**0.5],
                               rtol=1e-5)  # the trainer's std + 1e-6
    assert not snr.grpo_advantages([0.5, 0.5], 5.0).any()
    params = [torch.nn.Parameter(torch.zeros(30000)), torch.nn.Parameter(torch.zeros(100, 100))]
    sketch = snr.CountSketch(params, buckets=4096, seed=0)
    g = torch.Generator().manual_seed(1)
    a = [torch.randn(p.shape, generator=g) for p in params]
    b = [0.6 * x + 0.8 * torch.randn(x.shape, generator=g) for x in a]  # correlated with a: cosine about 0.6
    sketches = []
    for grads in (a, b):
        for p, x in zip(params, grads):
            p.grad = x.clone()
        sketches.append(sketch.of_grads().numpy())
    exact = sum(float((x * y).sum()) for x, y in zip(a, b))
    norms = [sum(float((x * x).sum()) for x in v) ** 0.5 for v in (a, b)]
    estimate = float(np.dot(*sketches))
    assert estimate == pytest.approx(exact, rel=0.05)
    assert estimate / np.prod([np.linalg.norm(s) for s in sketches]) == pytest.approx(exact / np.prod(norms), abs=0.03)


def test_the_sign_agreement_is_one_for_a_clean_signal_and_about_zero_for_noise_or_shuffled_rewards():
    import numpy as np

    snr = load_script("benchmarks/gradient_snr.py")
    rng = np.random.default_rng(0)
    n, steps, entries = 64, 2, 2000
    rewards = rng.normal(size=n)
    direction = rng.choice([-1.0, 1.0], size=entries)
    clean = np.einsum("i,e->ie", rewards, direction)[:, None, :].repeat(steps, axis=1)  # each image: r_i u
    agree, spread = snr.sign_agreement(clean, rewards, [8, 32], splits=5, rng=rng, clip=5.0)
    # sum_i A_i r_i > 0 in any batch: both batches' gradients point along u, every entry agrees
    np.testing.assert_allclose(agree, 1.0) and np.testing.assert_allclose(spread, 0.0, atol=1e-12)
    noise = rng.normal(size=(n, steps, entries))
    agree, _ = snr.sign_agreement(noise, rewards, [32], splits=40, rng=rng, clip=5.0)
    assert np.abs(agree).max() < 0.1  # 2,000 independent signs: one draw's spread 0.022 (draws share the 64 images)
    agree, spread = snr.sign_agreement(clean, rewards, [32], splits=40, rng=rng, clip=5.0, shuffle=True)
    # the null: each batch's shuffled rewards give +u or -u at random, so a draw agrees +1 or -1 entirely; 40 draws
    # average to 0 +- 0.16 (one spread 0.5 is three of them) and a single draw's spread is about 1
    assert np.abs(agree).max() < 0.5 and (spread > 0.9).all()


def test_the_gradient_snr_runs_on_the_shipped_unet_and_refuses_a_bad_batch(tmp_path, capsys):
    import numpy as np

    snr = load_script("benchmarks/gradient_snr.py")
    output = tmp_path / "snr.json"
    result = snr.main(["--images", "8", "--chunk", "4", "--splits", "4", "--buckets", "512", "--output", str(output)])
    saved = json.loads(output.read_text())
    assert saved["prompt"] == "a photo of a star and a triangle" and saved["half_sizes"] == [2, 4]
    assert saved["command"] == ("python benchmarks/gradient_snr.py --images 8 --chunk 4 --splits 4 --buckets 512 "
                                f"--output {output}")
    assert sum(saved["norm_share"]) == pytest.approx(1.0) and len(saved["norm_share"]) == 10
    for name in ("real", "null"):
        rows = saved["advantages"][name]
        assert [row["step"] for row in rows["steps"]] == list(range(10)) + ["all"]
        assert all(-1 <= c <= 1 for line in rows["cos"] for c in line)
    assert result["images"] == 8 and saved["reward"] == "partial" and list(saved["rewards"]) == ["partial"]
    # several rewards on the same trajectories: the positive control's (jpeg, kB) and the expected strict verdict
    both = snr.main(["--images", "4", "--chunk", "4", "--splits", "2", "--buckets", "64", "--entries", "32",
                     "--reward", "jpeg_incompressibility,expected"])
    assert list(both["rewards"]) == ["jpeg_incompressibility", "expected"] and both["entries"] == 32
    assert both["rewards"]["jpeg_incompressibility"]["reward_mean"] > 1 and both["reward"] == "jpeg_incompressibility"
    assert 0 <= both["rewards"]["expected"]["reward_mean"] <= 1
    agree = np.asarray(both["rewards"]["expected"]["advantages"]["real"]["sign_agreement"])
    assert agree.shape == (1, 11) and (np.abs(agree) <= 1).all()
    with pytest.raises(SystemExit):
        snr.main(["--images", "8", "--chunk", "4", "--reward", "partial,soft"])
    assert "--reward" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        snr.main(["--images", "10", "--chunk", "4"])
    assert exit_info.value.code == 2 and "--images" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        snr.main(["--images", "8", "--chunk", "4", "--output", str(output)])  # never written over
    assert "exists" in capsys.readouterr().err


def test_the_sft_ceiling_fine_tunes_the_unet_and_scores_each_measurement_with_geneval_s_strict_verdict(tmp_path, capsys):
    """benchmarks/scenes_sft_ceiling.py (docs/scenes.md): two measurements (the base, then 2 optimizer steps of 2
    rendered scenes) of rung b's two_object prompt, 2 images each. Each row's strict-correct is the share of strict
    verdicts in the images' own verdict file, its scenes seen the steps times the batch; the base row has no loss."""
    ceiling = load_script("benchmarks/scenes_sft_ceiling.py")
    output = tmp_path / "two_object"
    document = ceiling.main(["--case", "two_object", "--steps", "0,2", "--scenes", "4", "--batch", "2",
                             "--images", "2", "--output", str(output)])
    assert document["record"]["prompt"] == "a photo of a star and a triangle"
    assert document["area_range"] == [150.0, 260.0]  # the shipped tiny-scenes' coarse scale
    assert [(r["step"], r["scenes_seen"]) for r in document["rows"]] == [(0, 0), (2, 4)]
    assert document["rows"][0]["loss"] is None and document["rows"][1]["loss"] > 0
    for row in document["rows"]:
        verdicts = [json.loads(line)["strict_correct"]
                    for line in (output / f"images_{row['step']}" / "verdicts.jsonl").read_text().splitlines()]
        assert len(verdicts) == 2 and row["strict_correct"] == sum(verdicts) / 2
    assert json.loads((output / "ceiling.json").read_text())["rows"] == document["rows"]
    assert "step     2  scenes seen      4" in capsys.readouterr().out
    import numpy as np
    from PIL import Image

    figure = np.asarray(Image.open(output / "samples.png"))
    assert figure.shape == (2 * 72, 16 * 72, 3)  # a row per measurement, 16 tiles of 72 px, 2 of them drawn
    assert (figure[:, 2 * 72 :] == 255).all() and figure[:, : 2 * 72].std() > 0

    with pytest.raises(SystemExit) as exit_info:  # a measurement is never written over
        ceiling.main(["--case", "two_object", "--steps", "0", "--output", str(output)])
    assert exit_info.value.code == 2
    assert "holds a measurement" in capsys.readouterr().err


@pytest.mark.parametrize("arguments, message", [
    (["--steps", "0,ten"], "--steps '0,ten'"),
    (["--lr", "0"], "a learning rate > 0"),
    (["--model", "tiny-scenes-sd3"], "--model tiny-scenes-sd3: not a UNet pipeline"),
])
def test_the_sft_ceiling_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, capsys, arguments, message):
    with pytest.raises(SystemExit) as exit_info:
        load_script("benchmarks/scenes_sft_ceiling.py").main([*arguments, "--output", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ceiling.json").exists()


# The study on the flow-matching UNet (docs/scenes.md): --flow-model puts every flow method on tiny_scenes_flow.


def test_the_scenes_study_puts_every_flow_method_on_the_flow_unet_with_flow_model_and_the_unet_methods_stay():
    """`--set pretrained.model=tiny-scenes-flow` kept tiny_scenes's 16 T5 tokens (the UNet's CLIP refuses them) and
    labelled its rows tiny-scenes-sd3; --flow-model takes the flow UNet's own variant, which the trainer's checks
    accept for every flow method, and leaves the UNet methods on tiny-scenes."""
    from ddpo_group.config.check import check_config

    study = load_script("benchmarks/scenes_study.py")
    unet_methods = {"grpo_kl", "ddpo", "group_ppo_sd", "alg2"}
    for method in study.METHODS:
        config = study.method_config(method, 42, "/nonexistent/runs/m/seed_42", flow_model="tiny-scenes-flow")
        default = study.method_config(method, 42, "/nonexistent/runs/m/seed_42")
        if method in unet_methods:
            assert config.pretrained.model == default.pretrained.model == "tiny-scenes"
            continue
        assert default.pretrained.model == "tiny-scenes-sd3" and default.sample.max_sequence_length == 16
        assert config.pretrained.model == "tiny-scenes-flow" and config.sample.max_sequence_length == 0
        # the method's own fields, the same on either flow base
        for field in ("train.objective", "train.beta", "sample.sde_type", "sample.sde_window_size",
                      "algorithm.adv_estimator", "train.num_inner_epochs", "forward.num_timesteps"):
            section, name = field.split(".")
            assert config[section][name] == default[section][name], (method, field)
        check_config(config, num_processes=1)
    nft_kl = study.method_config("nft_kl", 42, "/nonexistent/runs/nft_kl/seed_42", flow_model="tiny-scenes-flow")
    assert (nft_kl.train.objective, nft_kl.train.beta, nft_kl.train.use_kl_loss, nft_kl.train.num_inner_epochs,
            nft_kl.train.cfg, nft_kl.forward.num_timesteps) == ("nft", 0.1, True, 4, False, 9)


def test_the_scenes_study_refuses_a_run_of_the_other_flow_model_and_labels_rows_by_the_runs_model(tmp_path, capsys):
    """A committed tiny-scenes-sd3 run in the folder of a --flow-model tiny-scenes-flow study would be skipped as
    finished and reported as the flow UNet's; it is refused, naming the field. collect labels each row with the
    model its run trained."""
    study, line = _study_refusal(tmp_path, capsys, ["--flow-model", "tiny-scenes-flow"])
    assert 'pretrained.model: stored "tiny-scenes-sd3", this command "tiny-scenes-flow"' in line
    summary, _, _, _ = study.collect(str(tmp_path), flow_model="tiny-scenes-flow")
    assert {row["model"] for row in summary} == {"tiny-scenes-sd3"}
