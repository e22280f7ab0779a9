"""benchmarks/critic_compute.py: model calls from a run's logged metrics and issue 35's targets, on hand-made runs
whose numbers are worked out here by hand."""

import json
import os
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import critic_compute  # noqa: E402


def _rows(evals, trained_steps, wall_per_epoch, reference=True, recompute=True, anchor=0, steps=10, n=8,
          optimizer_steps=4):
    """Training rows of len(evals) - 1 epochs (one evaluation before them and one after each) plus the evaluations;
    optimizer_steps a training epoch (cumulative train/global_step, as the trainer logs it)."""
    rows = []
    for epoch, reward in enumerate(evals):
        if epoch < len(evals) - 1:
            row = {"epoch": epoch, "reward_mean": 0.5, "num_samples": n, "steps/trained": [0] * steps,
                   "train/unet_steps_per_sample": trained_steps, "bench/wall_seconds": wall_per_epoch * (epoch + 1),
                   "num_processes": 1, "train/global_step": optimizer_steps * (epoch + 1), "train/skipped_steps": 0}
            if reference:
                row["ref/kl"] = 0.0
            if recompute:
                row["time/old_log_probs"] = 0.1
            if anchor:
                row["critic/anchor_decodes"] = anchor
            rows.append(row)
        rows.append({"epoch": epoch, "eval/reward_mean": reward})
    return rows


def test_epoch_calls_by_hand():
    (row,) = [r for r in _rows([0.5, 0.6], trained_steps=2, wall_per_epoch=1.0, anchor=16) if "reward_mean" in r]
    # sampling 8 x 10, training 8 x 2 fwd+bwd, the reference's 8 x 2 forwards, and the recompute pass over the
    # micro-batches after the first of 4 optimizer steps: 3/4 of 8 x 2
    assert critic_compute.epoch_calls(row, optimizer_steps=4) == (80 + 16 + 16 + 12, 8 + 16)
    assert critic_compute.epoch_calls(row, optimizer_steps=1) == (80 + 16 + 16, 8 + 16)  # no later micro-batch
    row["train/recompute_steps_per_sample"] = 1.0  # logged: 8 x 1, whatever the optimizer steps
    assert critic_compute.epoch_calls(row, optimizer_steps=4) == (80 + 16 + 16 + 8, 8 + 16)
    assert critic_compute.epoch_calls(row, optimizer_steps=4, inner_epochs=2) == (80 + 32 + 32 + 8, 8 + 16)
    del row["ref/kl"], row["time/old_log_probs"], row["train/recompute_steps_per_sample"]
    assert critic_compute.epoch_calls(row) == (80 + 16, 8 + 16)


def test_a_warm_up_epoch_counts_its_sampling_and_the_optimizer_steps_come_from_global_step():
    rows = _rows([0.5, 0.6, 0.7], trained_steps=1, wall_per_epoch=1.0, reference=False)
    warm_up = rows[0]  # epoch 0, the critic's warm-up epoch: sampled, nothing trained, no per-step metrics
    del warm_up["steps/trained"], warm_up["train/unet_steps_per_sample"], warm_up["time/old_log_probs"]
    warm_up["train/global_step"] = 0
    rows[2]["train/global_step"] = 4  # epoch 1's 4 optimizer steps, the first of the run
    calls = critic_compute.training_calls(rows)
    # epoch 0: 80 sampling calls only; epoch 1: 80 + 8 training + 8 x 3/4 recompute (4 optimizer steps: 0 -> 4)
    assert calls == [(0, (80, 8)), (1, (80 + 8 + 6, 8))]


def test_targets_by_hand(tmp_path):
    # free and critic: one trained step per trajectory; grpo: all 10
    free = {1: _rows([0.5, 0.6, 0.7, 0.8], 1, 1.0), 2: _rows([0.5, 0.6, 0.7, 0.7], 1, 1.0)}
    critic = {1: _rows([0.5, 0.8, 0.8, 0.8], 1, 2.0), 2: _rows([0.5, 0.7, 0.8, 0.9], 1, 2.0)}
    grpo = {1: _rows([0.5, 0.5, 0.8, 0.8], 10, 10.0), 2: _rows([0.5, 0.5, 0.5, 0.8], 10, 10.0)}
    paths = []
    for name, runs in (("a", {"free": free, "critic": critic}), ("b", {"grpo_kl": grpo})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"runs": {label: {str(s): rows for s, rows in by.items()} for label, by in runs.items()}}))
        paths.append(str(path))
    out = tmp_path / "out" / "cc.json"
    critic_compute.main([*paths, "--free", "free", "--critic", "critic", "--target", "0.75", "--output", str(out)])
    result = json.loads(out.read_text())
    # 80 sampling + 8 training + 8 reference + 6 recompute (3 of 4 optimizer steps' micro-batches) for free and
    # critic; grpo 80 + 80 + 80 + 60
    per_epoch = 80 + 8 + 8 + 6
    assert result["arms"]["free"]["model_calls_per_epoch"] == per_epoch
    assert result["arms"]["grpo_kl"]["model_calls_per_epoch"] == 300
    # free: finals 0.8 and 0.7 -> median 0.75, sample std |0.8 - 0.7| / sqrt(2); total calls 3 epochs x 102
    assert result["free_final_median"] == pytest.approx(0.75)
    assert result["free_final_std"] == pytest.approx(0.1 / 2**0.5)
    assert result["free_total_calls"] == 3 * per_epoch
    # critic reaches 0.75 after 1 epoch (seed 1) and 2 epochs (seed 2): median 1.5 epochs of calls = 0.5 of free's 3
    (verdict,) = result["critic_verdicts"]
    assert verdict["calls_to_free_final_fraction"] == pytest.approx(1.5 / 3)
    assert verdict["calls_met"]
    # at free's 306 calls: critic's finals 0.8 and 0.9 -> 0.85 >= 0.75 + 0.0707
    assert verdict["eval_at_free_calls"] == pytest.approx(0.85) and verdict["equal_calls_met"]
    assert result["critic_wins"]
    # seconds to 0.75: grpo 20 s (seed 1) and 30 s (seed 2); critic 2 s and 4 s -> fractions 0.1 and 0.133;
    # free 3 s (seed 1, 0.8 at epoch 3) and never (seed 2) -> 0.15
    assert result["arms"]["critic"]["fraction_of_grpo_seconds"]["median"] == pytest.approx((0.1 + 4 / 30) / 2)
    assert result["arms"]["free"]["fraction_of_grpo_seconds"]["median"] == pytest.approx(3 / 20)
    assert result["best_fraction_of_grpo_seconds"] == pytest.approx((0.1 + 4 / 30) / 2) and result["time_met"]
    assert (tmp_path / "out" / "cc.md").read_text().count("| critic | 2 |") == 1


def test_a_missing_label_is_one_line(tmp_path, capsys):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"runs": {"free": {"1": _rows([0.5, 0.6], 1, 1.0)}}}))
    with pytest.raises(SystemExit) as err:
        critic_compute.main([str(path), "--free", "free", "--critic", "window", "--output", str(tmp_path / "o.json")])
    assert "no runs labelled ['window']" in str(err.value) and "free" in str(err.value)
