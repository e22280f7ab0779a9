"""Metrics writing (ddpo_group/runs/metrics_log.py): rows of metrics.jsonl with the epoch's reward statistics."""

import json

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from ddpo_group.training.batch import EpochBatch, GatheredBatch
from ddpo_group.runs.metrics_log import MetricsLog, flatten_config
from ddpo_group.runs.run_dir import RunDir
from helpers import make_config


def _batch(rewards, prompt_ids):
    b = len(rewards)
    rewards = torch.tensor(rewards, dtype=torch.float32)
    samples = EpochBatch(
        images=torch.rand(b, 3, 8, 8), latents=torch.zeros(b, 3, 1, 2, 2), log_probs=torch.zeros(b, 2),
        timesteps=torch.zeros(b, 2, dtype=torch.int64), prompt_embeds=torch.zeros(b, 1, 2), negative_prompt_embeds=None,
        mask=torch.ones(b, 2), prompts=["p"] * b, prompt_ids=torch.tensor(prompt_ids),
    )
    samples.gathered = GatheredBatch(rewards=rewards, components={"jpeg": rewards * 2}, prompt_ids=samples.prompt_ids,
                                     mask=samples.mask, advantages=torch.zeros(b, 2))
    return samples


def test_an_epoch_row_holds_the_reward_statistics_and_is_on_disk(tmp_path):
    config = make_config(tmp_path, log_images_every=0)
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    run_dir = RunDir(str(tmp_path))
    log = MetricsLog(config, acc, run_dir)
    metrics = {"time/sample": 1.5}
    log.epoch_row(4, _batch([0.0, 1.0, 3.0, 4.0], [0, 0, 1, 1]), metrics, global_step=7, prompts=[])
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["epoch"] == 4 and row["global_step"] == 7 and row["num_samples"] == 4
    assert row["reward_mean"] == 2.0
    assert np.isclose(row["reward_std"], np.std([0.0, 1.0, 3.0, 4.0]))
    assert row["reward/jpeg"] == 4.0 and row["time/sample"] == 1.5 and row["peak_rss_mb"] > 0
    log.write({"epoch": 5, "eval_only": True})
    assert [json.loads(line)["epoch"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [4, 5]


def test_the_trackers_get_the_config_flattened():
    assert flatten_config({"a": 1, "b": {"c": [1, 2], "d": None}}) == {"a": 1, "b.c": "[1, 2]", "b.d": None}


def test_the_console_summary_tells_the_story_of_the_run(tmp_path):
    config = make_config(tmp_path, log_images_every=0, num_epochs=3)
    AcceleratorState._reset_state()
    log = MetricsLog(config, Accelerator(cpu=True), RunDir(str(tmp_path)))
    for epoch, value in [(0, 0.5), (1, 0.9), (2, 0.7)]:
        log.write({"epoch": epoch, "eval/reward_mean": value, "time/sample": 2.0, "time/eval": 1.0})
    lines = log.summary(3, 12.4, str(tmp_path / "checkpoints" / "checkpoint_3"))
    assert lines[0] == "run ended at epoch 3 of 3 after 12 s (sample 6 s, eval 3 s)"
    assert lines[1] == "eval reward: 0.5000 (epoch 0) -> 0.7000 (epoch 2); best 0.9000 (epoch 1)"
    assert str(tmp_path / "checkpoints" / "checkpoint_3") in lines[2]
    assert any(line.startswith("resume:  --config.resume_from=") for line in lines)
