"""benchmarks/scenes_ladder_probes.py (issue 53: a rung-b case under several probes of its training): its numbers
recomputed by hand from synthetic metrics files, a stopped run read as far as it went, the DDIM step scale from the
beta schedule's own formula. No training here."""

import json
import os

import numpy as np
import pytest
from helpers import load_script

probes = load_script("benchmarks/scenes_ladder_probes.py")


def write_run(results, case, seed, strict, shares, finished=True, key="reward_info/geneval/strict_correct"):
    run_dir = os.path.join(results, "runs", "b", "unet", case, f"seed_{seed}")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for epoch, (value, share) in enumerate(zip(strict, shares)):
            f.write(json.dumps({"epoch": epoch, "time/sample": 1.0}) + "\n")  # a row without the epoch's numbers
            f.write(json.dumps({"epoch": epoch, "reward_mean": value / 2, "approx_kl": 0.1 / (epoch + 1),
                                "ref/kl": 0.01 * epoch, key: value,
                                "steps/grad_share": share}) + "\n")
    if finished:
        with open(os.path.join(run_dir, "finished.json"), "w") as f:
            json.dump({"epoch": len(strict)}, f)


def test_each_probe_s_strict_correct_windows_and_gradient_shares_are_read_from_its_run(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_run(a, "two_object", 42, [0.1, 0.5, 0.2, 0.8, 0.5], [[0.2, 0.8]] * 5)
    # a stopped run (no finished.json); a skipped step's share is None and is left out of its mean
    write_run(b, "two_object", 42, [0.1, 0.0, 0.3], [[0.6, None], [0.2, None], [0.4, None]], finished=False)
    out = str(tmp_path / "out" / "probes")
    probes.main(["--case", "two_object", "--seed", "42", "--probe", f"shipped={a}", "--probe", f"skip={b}",
                 "--output", out])
    document = json.load(open(out + ".json"))
    first, second = document["probes"]
    assert first["label"] == "shipped" and first["finished"] and first["epochs"] == 5
    assert first["strict_best_window"] == pytest.approx((0.2 + 0.8 + 0.5) / 3)  # epochs 2-4
    assert (first["strict_lowest"], first["strict_last"]) == (0.1, 0.5)
    assert first["grad_share_mean"] == pytest.approx([0.2, 0.8])
    assert first["approx_kl"][0] == pytest.approx(0.1)
    assert not second["finished"] and second["epochs"] == 3
    assert second["strict_best_window"] == pytest.approx(0.4 / 3)
    assert second["grad_share_mean"][0] == pytest.approx(0.4) and second["grad_share_mean"][1] is None
    assert os.path.getsize(out + ".png") > 0
    table = capsys.readouterr().out
    assert "| shipped | 5 | 0.100 | 0.100 | 0.500 | 0.500 | 0.100 | 0.80 (step 1) |" in table
    assert "| skip | 3 (stopped) |" in table


def test_a_null_control_s_true_verdicts_are_read_under_its_reward_s_own_name(tmp_path, capsys):
    # benchmarks/null_reward.py logs the images' true strict verdicts as reward_info/ShuffledGenEval/strict_correct
    null = str(tmp_path / "null")
    write_run(null, "colors", 42, [0.25, 0.1, 0.05], [[0.5, 0.5]] * 3, key="reward_info/ShuffledGenEval/strict_correct")
    probes.main(["--case", "colors", "--seed", "42", "--probe", f"null={null}", "--output", str(tmp_path / "o")])
    (row,) = json.load(open(tmp_path / "o.json"))["probes"]
    assert row["strict_correct"] == [0.25, 0.1, 0.05] and row["strict_best_window"] == pytest.approx(0.4 / 3)


def test_a_probe_without_its_run_or_with_a_bad_label_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no .*metrics.jsonl"):
        probes.main(["--case", "colors", "--probe", f"x={tmp_path}"])
    with pytest.raises(SystemExit):
        probes.main(["--case", "colors", "--probe", str(tmp_path)])
    assert "write LABEL=RESULTS" in capsys.readouterr().err


def test_the_ddim_step_std_is_diffusers_variance_on_the_shipped_unet_s_schedule():
    """Recomputed from the scaled-linear betas (SD's schedule, tiny-scenes' scheduler_config.json: 0.00085 to 0.012
    over 1000 steps, steps_offset 1, set_alpha_to_one false): sigma^2 = (1 - a_prev) / (1 - a_t) (1 - a_t / a_prev)."""
    betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=np.float64) ** 2
    alphas = np.cumprod(1 - betas)
    rows = probes.ddim_step_stds("tiny-scenes", 10)
    assert [(t, prev) for t, prev, _ in rows] == [(901 - 100 * k, 801 - 100 * k) for k in range(10)]
    for t, prev, std in rows:
        a_prev = alphas[prev] if prev >= 0 else alphas[0]
        assert std == pytest.approx(np.sqrt((1 - a_prev) / (1 - alphas[t]) * (1 - alphas[t] / a_prev)), rel=1e-4)
    assert rows[8][2] < rows[7][2] / 6  # t 101 -> 1: the step whose log-probability dominates (docs/scenes.md)


def test_a_forward_process_run_is_read_without_per_step_gradient_shares(tmp_path, capsys):
    """A DiffusionNFT / AWM run logs no steps/grad_share (no per-step policy gradient) but forward/old_decay: its
    epochs are read, its shares are empty, and the table says so."""
    results = str(tmp_path / "nft")
    run_dir = os.path.join(results, "runs", "b", "unet", "counting", "seed_42")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for epoch, value in enumerate([0.4, 0.6, 0.5]):
            f.write(json.dumps({"epoch": epoch, "reward_mean": value, "forward/old_decay": 0.001 * epoch,
                                "reward_info/geneval/strict_correct": value}) + "\n")
    out = str(tmp_path / "out" / "probes")
    probes.main(["--case", "counting", "--probe", f"nft={results}", "--output", out])
    (probe,) = json.load(open(out + ".json"))["probes"]
    assert probe["epochs"] == 3 and probe["strict_best_window"] == pytest.approx(0.5)
    assert probe["grad_share_mean"] == [] and probe["approx_kl"] == [None, None, None]
    assert "| nft | 3 (stopped) | 0.400 | 0.400 | 0.500 | 0.500 | - | - (no per-step gradient) |" in capsys.readouterr().out
