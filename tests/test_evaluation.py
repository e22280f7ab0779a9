"""Fixed-noise evaluation (ddpo_group.evaluation.evaluator) and its rows in training: deterministic, independent of
batching and of the number of processes, at epoch 0, every eval_freq epochs and at the end, and a resumed
run neither repeats nor skips one."""

import json
import os
import subprocess

import numpy as np
import pytest
import torch

from ddpo_group.diffusion.policy import policy_for
from ddpo_group.diffusion.tiny import build_tiny_pipeline
from ddpo_group.evaluation.evaluator import evaluate
from ddpo_group.data.prompts import load_prompts
from ddpo_group.rewards import build_reward_fn
from ddpo_group.rewards.registry import register_reward
from ddpo_group.training.trainer import Trainer, train
from helpers import PYTHON, ROOT, free_port, make_config, read_metrics, subprocess_env

RECORDS = load_prompts("shapes")[:5]


@register_reward("test_eval_brightness")
def brightness(images, prompts, metadata):
    """A continuous reward: rounding-level changes of an image change it only at rounding level."""
    return images.float().mean(dim=(1, 2, 3)).cpu(), {}


def _evaluate(batch_size, seed=1234):
    policy = policy_for(build_tiny_pipeline(seed=0))
    return evaluate(policy, None, RECORDS, build_reward_fn("test_eval_brightness"), images_per_prompt=3, num_steps=3,
                    guidance_scale=3.0, eta=1.0, seed=seed, batch_size=batch_size, grid_prompts=2)


def test_two_evaluations_of_the_same_weights_are_identical():
    a, b = _evaluate(4), _evaluate(4)
    assert np.array_equal(a["rewards"], b["rewards"]) and a["reward_mean"] == b["reward_mean"]
    assert a["rewards"].shape == (5, 3) and a["images"].shape == (2 * 3, 3, 32, 32)
    assert a["reward_mean"] == pytest.approx(float(np.mean(a["rewards"])))
    assert a["per_prompt"].tolist() == pytest.approx(a["rewards"].mean(axis=1).tolist())


def test_the_noise_of_an_image_does_not_depend_on_batching():
    small, large = _evaluate(2), _evaluate(15)
    np.testing.assert_allclose(small["rewards"], large["rewards"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(_evaluate(15, seed=7)["rewards"], large["rewards"])


def test_eval_rows_at_epoch_0_every_eval_freq_and_at_the_end(tmp_path):
    run_dir = train(make_config(tmp_path, num_epochs=5, eval_freq=2, eval_images_per_prompt=1, eval_batch_size=64,
                                eval_prompt_fn="shapes_squares.txt", log_images_every=0, save_freq=0))
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows if "eval/reward_mean" in row] == [0, 2, 4, 5]
    final = rows[-1]
    assert final["epoch"] == 5 and final.get("eval_only") is True and "reward_mean" not in final
    assert all("eval/reward_std" in row and "eval/shapes_alignment" in row for row in rows if "eval/reward_mean" in row)
    assert os.path.exists(os.path.join(run_dir, "samples", "eval_0000.png"))
    assert os.path.exists(os.path.join(run_dir, "samples", "eval_0005.png"))


def test_a_resumed_run_neither_repeats_nor_skips_an_evaluation(tmp_path):
    common = dict(eval_freq=2, eval_images_per_prompt=1, eval_batch_size=64, eval_prompt_fn="shapes_squares.txt",
                  log_images_every=0, save_freq=1)
    whole = read_metrics(train(make_config(tmp_path, run_name="whole", num_epochs=4, **common)))
    first = train(make_config(tmp_path, run_name="parts", num_epochs=3, **common))
    Trainer(make_config(tmp_path, run_name="parts", num_epochs=4, resume_from=first, **common),
            overrides=["num_epochs", "resume_from"]).run()
    parts = read_metrics(first)
    evals = lambda rows: [row["epoch"] for row in rows if "eval/reward_mean" in row]  # noqa: E731
    assert evals(parts) == evals(whole) == [0, 2, 4]
    assert [row["eval/reward_mean"] for row in parts if "eval/reward_mean" in row] == pytest.approx(
        [row["eval/reward_mean"] for row in whole if "eval/reward_mean" in row], abs=1e-6)


def test_a_two_process_evaluation_equals_the_one_process_one(tmp_path):
    args = ["scripts/train.py", "--config", "config/grpo.py:test", "--config.num_epochs=1", "--config.eval_freq=1",
            "--config.eval_images_per_prompt=1", "--config.eval_batch_size=64",
            "--config.eval_prompt_fn=shapes_squares.txt", "--config.log_images_every=0", "--config.save_freq=0"]
    two = [os.path.join(os.path.dirname(PYTHON), "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port())]
    results = {}
    for name, launcher in (("one", [PYTHON]), ("two", two)):
        command = launcher + args + [f"--config.logdir={tmp_path}", f"--config.run_name={name}"]
        done = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        results[name] = read_metrics(tmp_path / name)
    assert results["two"][0]["num_processes"] == 2
    # epoch 0: the initial weights, before any update, on 36 prompts split over the processes
    assert results["two"][0]["eval/reward_mean"] == pytest.approx(results["one"][0]["eval/reward_mean"], abs=1e-6)


def test_the_evaluator_writes_the_evaluate_result_into_the_epoch_metrics(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddpo_group.evaluation.evaluator import Evaluator
    from ddpo_group.runs.run_dir import RunDir

    config = make_config(tmp_path, eval_prompt_fn="", eval_images_per_prompt=3, eval_batch_size=4, eval_grid_prompts=2,
                         eval_seed=1234, sample__num_steps=3, sample__guidance_scale=3.0, sample__eta=1.0)
    AcceleratorState._reset_state()
    (tmp_path / "r").mkdir()
    evaluator = Evaluator(config, Accelerator(cpu=True), RunDir(str(tmp_path / "r")), RECORDS,
                          build_reward_fn("test_eval_brightness"))
    metrics = {}
    evaluator(3, metrics, policy_for(build_tiny_pipeline(seed=0)), None)
    expected = _evaluate(4)  # the same prompts (the training ones: no eval_prompt_fn), seed and settings
    assert evaluator.prompts is RECORDS
    assert metrics["eval/reward_mean"] == pytest.approx(expected["reward_mean"], rel=1e-6)
    assert metrics["eval/reward_std"] == pytest.approx(expected["reward_std"], rel=1e-5)
    assert metrics["eval/grid"] == os.path.join("samples", "eval_0003.png")
    assert os.path.exists(tmp_path / "r" / metrics["eval/grid"])
    stopped = {}
    evaluator(4, stopped, policy_for(build_tiny_pipeline(seed=0)), None, should_stop=lambda: True)
    assert stopped == {}  # a stop between its batches logs no partial numbers
