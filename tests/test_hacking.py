"""The reward-hacking monitor: evaluation-only ("gold") rewards, the divergence rule, its console line and
metrics flag, the report section, and the config errors of config.eval_rewards."""

import json
import logging
import os
import subprocess

import numpy as np
import pytest

from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.diffusion.policy import policy_for
from ddpo_group.diffusion.tiny import build_tiny_pipeline
from ddpo_group.evaluation.evaluator import Evaluator, evaluate, gold_reward_fn
from ddpo_group.evaluation.hacking import MARGIN, diverged_at, divergence, gold_names
from ddpo_group.report.inspect import build_report
from ddpo_group.data.prompts import load_prompts
from ddpo_group.rewards import build_reward_fn
from ddpo_group.rewards.registry import register_reward
from ddpo_group.training.trainer import train
from helpers import PYTHON, ROOT, make_config, read_metrics, subprocess_env

RECORDS = load_prompts("shapes")[:4]


@register_reward("test_gold_red")
def red(images, prompts, metadata):
    """Mean of the red channel (a gold reward in the tests)."""
    return images.float()[:, 0].mean(dim=(1, 2)).cpu(), {}


@register_reward("test_gold_dark")
def dark(images, prompts, metadata):
    """1 - mean brightness (a second gold reward)."""
    return 1.0 - images.float().mean(dim=(1, 2, 3)).cpu(), {}


@register_reward("test_proxy_bright")
def bright(images, prompts, metadata):
    return images.float().mean(dim=(1, 2, 3)).cpu(), {}


# ---------------------------------------------------------------------------------------------- the rule


def test_proxy_up_and_gold_down_flags_the_first_evaluation_past_both_margins():
    # stds 0.2 at the first evaluation: both margins are 0.25 * 0.2 = 0.05
    proxy = [0.50, 0.56, 0.60, 0.70, 0.72]
    gold = [0.60, 0.62, 0.59, 0.50, 0.45]
    # n=1: gold at its best (fall 0); n=2: best 0.62, fall 0.03 < 0.05; n=3: rise 0.20, fall 0.12 -> flagged
    assert diverged_at(proxy, gold, 0.2, 0.2) == [False, False, False, True, True]
    assert divergence(proxy, gold, 0.2, 0.2) == 3


@pytest.mark.parametrize("proxy, gold", [
    ([0.5, 0.5, 0.5, 0.5], [0.6, 0.6, 0.6, 0.6]),  # flat
    ([0.5, 0.6, 0.7, 0.8], [0.5, 0.6, 0.7, 0.8]),  # both rise: learning, not hacking
    ([0.5, 0.4, 0.3, 0.2], [0.6, 0.5, 0.4, 0.3]),  # both fall: a broken run, not hacking
    ([0.5, 0.4, 0.3, 0.2], [0.6, 0.7, 0.8, 0.9]),  # the proxy falls while the gold rises
    ([0.5, 0.9, 0.9, 0.9], [0.6, 0.58, 0.57, 0.56]),  # the gold dips by less than its margin (0.05)
])
def test_no_flag_unless_the_proxy_rises_while_the_gold_falls(proxy, gold):
    assert divergence(proxy, gold, 0.2, 0.2) is None
    assert not any(diverged_at(proxy, gold, 0.2, 0.2))


def test_a_gold_that_peaks_and_falls_back_is_flagged_over_optimisation():
    proxy = [0.1, 0.3, 0.5, 0.7]
    gold = [0.4, 0.6, 0.58, 0.52]  # above its start throughout, 0.08 below its peak at the end
    assert diverged_at(proxy, gold, 0.2, 0.2) == [False, False, False, True]


def test_short_series_never_flag():
    assert divergence([], [], 0.1, 0.1) is None
    assert divergence([0.5], [0.1], 0.1, 0.1) is None  # one evaluation: nothing to compare with


def test_the_margins_are_in_units_of_the_first_spread_so_the_scale_does_not_matter():
    proxy, gold = [0.5, 0.53, 0.58], [0.6, 0.58, 0.52]
    assert divergence(proxy, gold, 0.2, 0.2) == 2  # rise 0.08, fall 0.08 >= 0.05
    assert divergence(proxy, gold, 0.4, 0.2) is None  # the proxy margin is now 0.1
    # a proxy in kilobytes (x100, spread x100) is judged exactly as before
    assert divergence([100 * p for p in proxy], gold, 20.0, 0.2) == 2
    assert divergence(proxy, gold, 0.2, 0.2, margin=0.5) is None  # 0.08 < 0.5 * 0.2
    assert MARGIN == 0.25


def test_zero_spread_counts_as_a_tiny_one():
    assert divergence([1.0, 1.1], [1.0, 0.9], 0.0, 0.0) == 1
    assert divergence([1.0, 1.0], [1.0, 0.9], 0.0, 0.0) is None  # the proxy did not rise at all


def test_series_of_different_lengths_are_an_error():
    with pytest.raises(ValueError, match="length"):
        diverged_at([0.1, 0.2], [0.1], 0.1, 0.1)


# ---------------------------------------------------------------------------------------------- evaluation


def test_the_evaluation_scores_its_images_with_each_gold_reward():
    policy = policy_for(build_tiny_pipeline(seed=0))
    gold_fn = gold_reward_fn("test_gold_red, test_gold_dark")
    result = evaluate(policy, None, RECORDS, build_reward_fn("test_proxy_bright"), images_per_prompt=2, num_steps=3,
                      guidance_scale=3.0, eta=1.0, seed=1234, batch_size=3, grid_prompts=len(RECORDS), gold_fn=gold_fn)
    images = result["images"]  # every image: image j of prompt i at row 2 i + j
    assert images.shape == (8, 3, 32, 32)
    red_by_hand = images[:, 0].double().mean(dim=(1, 2)).numpy().reshape(4, 2)
    dark_by_hand = 1.0 - images.double().mean(dim=(1, 2, 3)).numpy().reshape(4, 2)
    assert sorted(result["gold"]) == ["test_gold_dark", "test_gold_red"]
    np.testing.assert_allclose(result["gold"]["test_gold_red"], red_by_hand, rtol=1e-5)
    np.testing.assert_allclose(result["gold"]["test_gold_dark"], dark_by_hand, rtol=1e-5)
    np.testing.assert_allclose(result["rewards"], 1.0 - dark_by_hand, rtol=1e-5)  # the proxy: unchanged
    assert gold_reward_fn("") is None and gold_reward_fn(" , ") is None


def test_training_logs_the_gold_rewards_at_every_evaluation(tmp_path):
    run_dir = train(make_config(tmp_path, num_epochs=2, eval_freq=1, eval_images_per_prompt=1, eval_batch_size=64,
                                eval_prompt_fn="shapes_squares.txt", eval_grid_prompts=0, log_images_every=0,
                                save_freq=0, eval_rewards="test_gold_red,shapes_alignment"))
    rows = [row for row in read_metrics(run_dir) if "eval/reward_mean" in row]
    assert [row["epoch"] for row in rows] == [0, 1, 2]
    for row in rows:
        for name in ("test_gold_red", "shapes_alignment"):
            assert 0.0 <= row[f"eval/gold/{name}_mean"] <= 1.0 and row[f"eval/gold/{name}_std"] >= 0.0
            assert row[f"eval/gold/{name}_diverged"] in (0.0, 1.0)
    # the training reward of the test variant is shapes_alignment: as a gold reward it scores the same images
    assert rows[0]["eval/gold/shapes_alignment_mean"] == pytest.approx(rows[0]["eval/reward_mean"], rel=1e-9)
    assert gold_names(rows) == ["test_gold_red", "shapes_alignment"]


def _evaluator(tmp_path, eval_rewards="test_gold_red"):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddpo_group.runs.run_dir import RunDir

    AcceleratorState._reset_state()
    (tmp_path / "r").mkdir(exist_ok=True)
    config = make_config(tmp_path, eval_freq=10, eval_rewards=eval_rewards)
    return Evaluator(config, Accelerator(cpu=True), RunDir(str(tmp_path / "r")), RECORDS, None)


def _row(epoch, proxy, gold, std=0.2):
    return {"epoch": epoch, "eval/reward_mean": proxy, "eval/reward_std": std, "eval/gold/test_gold_red_mean": gold,
            "eval/gold/test_gold_red_std": std}


SERIES = [(0, 0.50, 0.60), (10, 0.60, 0.61), (20, 0.70, 0.50), (30, 0.75, 0.45)]


def test_the_evaluator_flags_each_evaluation_and_announces_the_first_divergence_once(tmp_path):
    evaluator = _evaluator(tmp_path)
    flags, lines = [], []
    for epoch, proxy, gold in SERIES:
        metrics = _row(epoch, proxy, gold)
        lines.append(evaluator._divergence(epoch, metrics))
        flags.append(metrics["eval/gold/test_gold_red_diverged"])
    assert flags == [0.0, 0.0, 1.0, 1.0]  # at 20: rise 0.20, fall 0.11 below the peak of epoch 10
    assert [len(found) for found in lines] == [0, 0, 1, 0]
    line = lines[2][0]
    assert "\n" not in line and "epoch 20" in line and "test_gold_red" in line and "+0.2000" in line
    assert "0.1100" in line and "(epoch 10)" in line


def test_a_resumed_evaluator_reads_the_earlier_evaluations_and_does_not_announce_again(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    evaluator = _evaluator(tmp_path)
    rows = []
    for epoch, proxy, gold in SERIES[:3]:
        rows.append(_row(epoch, proxy, gold))
        evaluator._divergence(epoch, rows[-1])
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:2]) + '{"torn')
    resumed = _evaluator(tmp_path)  # resumed at epoch 20: sees epochs 0 and 10 in metrics.jsonl
    again = _row(20, 0.70, 0.50)
    assert len(resumed._divergence(20, again)) == 1 and again["eval/gold/test_gold_red_diverged"] == 1.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    later = _evaluator(tmp_path)  # resumed at epoch 30, after the divergence was logged and announced
    last = _row(30, 0.75, 0.45)
    assert later._divergence(30, last) == [] and last["eval/gold/test_gold_red_diverged"] == 1.0


def test_the_console_line_of_an_evaluation_names_each_gold_reward(tmp_path, caplog):
    evaluator = _evaluator(tmp_path, eval_rewards="test_gold_red")
    evaluator.config.eval_grid_prompts = 0
    evaluator.config.eval_images_per_prompt = 1
    evaluator.config.sample.num_steps = 2
    metrics = {"epoch": 0}
    with caplog.at_level(logging.INFO, logger="ddpo_group"):
        evaluator.reward_fn = build_reward_fn("test_proxy_bright")
        evaluator(0, metrics, policy_for(build_tiny_pipeline(seed=0)), None)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("eval epoch 0"))
    assert f"gold test_gold_red {metrics['eval/gold/test_gold_red_mean']:.4f} (+0.0000)" in line
    assert metrics["eval/gold/test_gold_red_diverged"] == 0.0


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("value, words", [
    ("no_such_reward", ["config.eval_rewards", "'no_such_reward'", "shapes_alignment"]),
    ("shapes_alignment,missing_file.py:fn", ["config.eval_rewards", "missing_file.py"]),
])
def test_an_unknown_gold_reward_is_one_line_naming_the_field(tmp_path, value, words):
    with pytest.raises(ConfigError) as info:
        check_config(make_config(tmp_path, eval_freq=1, eval_rewards=value))
    message = str(info.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_gold_rewards_need_evaluations(tmp_path):
    with pytest.raises(ConfigError, match=r"config.eval_rewards=.*config.eval_freq"):
        check_config(make_config(tmp_path, eval_freq=0, eval_rewards="shapes_alignment"))
    check_config(make_config(tmp_path, eval_freq=0, eval_rewards=""))
    plugin = tmp_path / "gold.py"
    plugin.write_text("def score(images, prompts, metadata):\n    return images.mean(dim=(1, 2, 3)), {}\n")
    check_config(make_config(tmp_path, eval_freq=5, eval_rewards=f"shapes_color, {plugin}:score"))


def test_the_train_command_prints_the_gold_reward_error_in_one_line(tmp_path):
    result = subprocess.run(
        [PYTHON, os.path.join(ROOT, "scripts", "train.py"), "--config", "config/grpo.py:test",
         f"--config.logdir={tmp_path}", "--config.eval_freq=1", "--config.eval_rewards=shapes_alignmnet"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "config.eval_rewards" in result.stderr and "'shapes_alignmnet'" in result.stderr
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- report


def _write_run(path, rows):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (path / "config.json").write_text(json.dumps({"reward_fn": "shapes_color", "eval_rewards": "test_gold_red"}))
    return path


def test_the_report_draws_proxy_vs_gold_and_states_the_divergence(tmp_path):
    hacked = _write_run(tmp_path / "hacked", [_row(e, p, g) for e, p, g in SERIES])
    honest = _write_run(tmp_path / "honest", [_row(e, p, p + 0.1) for e, p, _ in SERIES])
    report = build_report(hacked, compare=honest)
    assert "Reward hacking: proxy vs gold" in report
    assert 'alt="proxy vs gold test_gold_red"' in report
    assert "hacked: DIVERGED at epoch 20</b>" in report  # the first evaluation the rule holds (see above)
    assert "honest: no divergence over 4 evaluations" in report
    alone = build_report(honest)
    assert "DIVERGED" not in alone and "no divergence" in alone


def test_a_run_without_gold_rewards_still_reports(tmp_path):
    old = _write_run(tmp_path / "old", [{"epoch": e, "reward_mean": 0.1 * e, "eval/reward_mean": 0.2 * e,
                                         "eval/reward_std": 0.1} for e in range(3)])
    report = build_report(old)
    assert "no gold rewards logged" in report and "config.eval_rewards" in report
    assert "<h2>Evaluation</h2>" in report  # the rest of the report as before



def test_the_hacking_variant_passes_the_check_and_watches_a_gold_reward(tmp_path):
    config = check_config(make_config(tmp_path, "tiny_hacking"))
    assert config.eval_rewards == "shapes_alignment" and config.reward_fn == "jpeg_incompressibility"
    assert config.eval_freq > 0


def test_the_monitor_module_imports_nothing_of_the_package():
    from test_architecture import _reachable

    assert _reachable("ddpo_group.evaluation.hacking") == set()
