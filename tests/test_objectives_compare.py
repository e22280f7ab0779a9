"""benchmarks/objectives_compare.py: issue 55's comparison of the objectives beside GRPO + KL. The table from
hand-written metrics (numbers worked out here), a real one-epoch run of `tiny`, and its refusals."""

import json
import os

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def compare():
    return load_script("benchmarks/objectives_compare.py")


def write_run(root, variant, seed, evals, seconds_per_epoch, n=64, steps=9, unet_steps=9):
    """A finished run's metrics.jsonl: training epochs 0..E-1 (n samples, `steps` trained steps each: critic_compute
    counts n x steps sampling + n x unet_steps training calls an epoch; no reference, no recompute) and evaluations
    {epoch: eval reward}."""
    run_dir = root / "runs" / variant / f"seed_{seed}"
    run_dir.mkdir(parents=True)
    rows = []
    last = max(evals)
    for epoch in range(last + 1):
        if epoch in evals:
            rows.append({"epoch": epoch, "eval/reward_mean": evals[epoch]})
        if epoch < last:
            rows.append({"epoch": epoch, "reward_mean": 0.5, "num_samples": n, "steps/trained": list(range(steps)),
                         "train/unet_steps_per_sample": unet_steps, "train/global_step": epoch + 1,
                         "time/sample": seconds_per_epoch / 2, "time/train": seconds_per_epoch / 2,
                         "time/eval": 100.0})  # evaluation time is not training time
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "finished.json").write_text("{}")


def test_the_table_from_hand_written_metrics(compare, tmp_path, capsys):
    calls_per_epoch = 64 * 9 + 64 * 9  # sampling + training, 1152
    # tiny: reaches 0.75 at epoch 20 on seeds 42 and 43 (20 epochs of 5 s), at 30 on 44 (30 epochs)
    write_run(tmp_path, "tiny", 42, {0: 0.55, 10: 0.6, 20: 0.76, 30: 0.74, 40: 0.79}, 5.0)
    write_run(tmp_path, "tiny", 43, {0: 0.55, 10: 0.7, 20: 0.75, 30: 0.8, 40: 0.81}, 5.0)
    write_run(tmp_path, "tiny", 44, {0: 0.55, 10: 0.6, 20: 0.7, 30: 0.77, 40: 0.74}, 5.0)
    # tiny_ddpo: reaches it at epoch 10 on two seeds (10 epochs of 2 s), never on the third
    write_run(tmp_path, "tiny_ddpo", 42, {0: 0.55, 10: 0.8, 20: 0.82}, 2.0)
    write_run(tmp_path, "tiny_ddpo", 43, {0: 0.55, 10: 0.9, 20: 0.85}, 2.0)
    write_run(tmp_path, "tiny_ddpo", 44, {0: 0.55, 10: 0.6, 20: 0.65}, 2.0)
    table = compare.main(["--collect", "--variants", "tiny,tiny_ddpo,tiny_gae", "--results", str(tmp_path)])
    tiny, ddpo, gae = table
    assert tiny["final"] == {"median": 0.79, "min": 0.74, "max": 0.81}
    assert tiny["reached"] == "3/3" and tiny["seconds_to_target"] == {"median": 100.0, "min": 100.0, "max": 150.0}
    assert tiny["calls_to_target"]["median"] == 20 * calls_per_epoch
    assert tiny["train_seconds"]["median"] == 200.0 and tiny["model_calls"]["median"] == 40 * calls_per_epoch
    assert ddpo["final"] == {"median": 0.82, "min": 0.65, "max": 0.85} and ddpo["reached"] == "2/3"
    assert ddpo["seconds_to_target"]["median"] == 20.0 and ddpo["calls_to_target"]["median"] == 10 * calls_per_epoch
    assert ddpo["seconds_ratio"] == pytest.approx(20.0 / 100.0) and ddpo["calls_ratio"] == pytest.approx(0.5)
    assert tiny["seconds_ratio"] == 1.0 and gae["runs"] == "not run"
    assert tiny["runs"] == "0 new / 3 kept"  # found, not run by this invocation
    printed = capsys.readouterr().out
    assert "| tiny_ddpo | 42,43,44 | 0 new / 3 kept | 0.820 [0.650, 0.850] | 2/3 | 20 [20, 20] |" in printed
    assert "| tiny_gae | - | not run |" in printed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["target"] == 0.75 and summary["baseline"] == "tiny" and len(summary["runs"]) == 6


def test_a_variant_most_seeds_miss_has_no_time_to_target(compare, tmp_path):
    write_run(tmp_path, "tiny", 42, {0: 0.55, 10: 0.76}, 1.0)
    write_run(tmp_path, "tiny_nft", 42, {0: 0.55, 10: 0.8}, 1.0)
    write_run(tmp_path, "tiny_nft", 43, {0: 0.55, 10: 0.6}, 1.0)
    _, nft = compare.main(["--collect", "--variants", "tiny,tiny_nft", "--results", str(tmp_path)])
    assert nft["reached"] == "1/2" and nft["seconds_to_target"] is None and nft["seconds_ratio"] is None


def test_an_unknown_variant_is_refused_in_one_line_before_anything_runs(compare, tmp_path):
    results = tmp_path / "results"
    with pytest.raises(SystemExit) as err:
        compare.main(["--variants", "tiny,tiny_nope", "--results", str(results)])
    message = str(err.value.code)
    assert "\n" not in message and "unknown variant tiny_nope" in message and "tiny_gae" in message
    assert not results.exists()
    with pytest.raises(SystemExit, match="--set 'num_epoch=1'"):
        compare.main(["--variants", "tiny", "--set", "num_epoch=1", "--results", str(results)])
    assert not results.exists()


@pytest.mark.slow
def test_one_epoch_of_tiny_runs_collects_and_is_kept_afterwards(compare, tmp_path, capsys):
    settings = ["num_epochs=1", "eval_freq=1", "eval_images_per_prompt=1", "sample.num_steps=2", "sample.batch_size=8",
                "sample.num_batches_per_epoch=1", "train.batch_size=8"]  # one small epoch: seconds of CPU
    probe = ["--variants", "tiny", "--seeds", "42", "--results", str(tmp_path)] + \
        [arg for item in settings for arg in ("--set", item)]
    (row,) = compare.main(probe)
    assert row["runs"] == "1 new / 0 kept" and row["seeds"] == [42]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (run,) = summary["runs"]
    assert [k for k, _ in run["evaluations"]] == [0, 1] and run["train_seconds"] > 0 and run["wall_seconds"] > 0
    # 8 trajectories x 2 steps sampled, both steps trained (forward + backward), the KL's reference forward of each
    assert run["model_calls"] == 8 * 2 + 8 * 2 + 8 * 2
    assert summary["set"] == settings
    assert "done tiny seed 42: exit 0" in capsys.readouterr().out
    (again,) = compare.main(probe)  # finished: kept, not run again, and not counted as this invocation's
    assert again["runs"] == "0 new / 1 kept" and again["final"] == row["final"]
    with pytest.raises(SystemExit, match="made with --set"):  # another probe's settings never mix into these runs
        compare.main(probe[:-2])


@pytest.mark.slow
def test_a_failed_run_makes_the_command_exit_non_zero_naming_its_log(compare, tmp_path):
    with pytest.raises(SystemExit) as err:
        compare.main(["--variants", "tiny", "--seeds", "7", "--results", str(tmp_path),
                      "--set", "pretrained.model=/no/such/model"])
    assert "1 run failed" in str(err.value.code) and os.path.join("tiny", "seed_7.log") in str(err.value.code)
