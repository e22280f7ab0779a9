"""Issue 34, the third fault audit: each bad outcome it found, as a test that failed before its fix.

The run directory's items (1-3) are in tests/test_run_dir.py and the reward server's (10, 11) in
tests/test_reward_server.py; the others are here, numbered as in the issue."""

import json
import os

import numpy as np
import pytest
import torch

from ddpo_group.inspect import load_run, write_report
from ddpo_group.rewards.combine import CombinedReward


# 7. a reward that edits its prompts or metadata in place changes nothing anyone else sees
def test_a_reward_that_edits_its_prompts_and_metadata_changes_nothing_else():
    seen = []

    def vandal(images, prompts, metadata):
        for record in metadata:
            record["tags"].append("vandalised")
            record["colour"] = "none"
        prompts[:] = ["x"] * len(prompts)
        return [0.0] * len(prompts), {}

    def observer(images, prompts, metadata):
        seen.append((list(prompts), json.loads(json.dumps(metadata))))
        return [1.0] * len(prompts), {}

    prompts = ["a red circle", "a blue square"]
    metadata = [{"colour": "red", "tags": ["round"]}, {"colour": "blue", "tags": []}]
    expected = json.loads(json.dumps(metadata))
    reward = CombinedReward({"vandal": vandal, "observer": observer}, batch_size=1)
    images = torch.rand(2, 3, 8, 8)
    for _ in range(2):  # a later call (a later epoch, the evaluation) gets the same records
        reward(images, prompts, metadata)
    assert metadata == expected and prompts == ["a red circle", "a blue square"]
    assert seen == [(["a red circle"], expected[:1]), (["a blue square"], expected[1:])] * 2


# 12. the report reads a metrics file with a huge integer, and a samples directory with a symlink loop
def _run_with_metrics(tmp_path, rows):
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run


def test_the_report_leaves_out_an_integer_too_large_for_a_float(tmp_path):
    run = _run_with_metrics(tmp_path, [{"epoch": 0, "reward_mean": 0.25, "huge": 10**400},
                                       {"epoch": 1, "reward_mean": 0.5, "huge": 3}])
    assert [row["reward_mean"] for row in load_run(run).metrics] == [0.25, 0.5]
    report = write_report(run)
    assert report == run / "report.html" and "reward_mean" in report.read_text()


def test_the_report_leaves_out_a_symlink_loop_under_samples(tmp_path):
    run = _run_with_metrics(tmp_path, [{"epoch": 0, "reward_mean": 0.25}])
    (run / "samples" / "loop_a").symlink_to(run / "samples" / "loop_b")
    (run / "samples" / "loop_b").symlink_to(run / "samples" / "loop_a")
    assert sorted(load_run(run).outside) == [os.path.join("samples", "loop_a"), os.path.join("samples", "loop_b")]
    assert "loop_a" in write_report(run).read_text()


# 8. a LoRA rank above what the adapted layers can use is refused, naming the field and the bound
def test_a_lora_rank_above_the_adapted_layers_width_is_refused_naming_the_bound(tmp_path):
    from ddpo_group.config_check import ConfigError
    from ddpo_group.diffusion.lora import add_lora
    from ddpo_group.diffusion.tiny import build_tiny_pipeline
    from ddpo_group.trainer import Trainer
    from helpers import cheap, make_config

    # the tiny UNet (diffusion/tiny.py): attention at 32 channels (outer blocks) and 64 (the middle block); every
    # adapted projection is C x C or C x 32 (cross-attention), so min(d_in, d_out) <= 64, reached in the middle
    with pytest.raises(ConfigError) as info:
        Trainer(make_config(tmp_path, use_lora=True, lora_rank=100000, **cheap()))
    message = str(info.value)
    assert message.startswith("config.lora_rank=100000") and "config.lora_rank <= 64" in message and "\n" not in message
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="<= 64"):
        add_lora(build_tiny_pipeline().unet, 65)
    assert add_lora(build_tiny_pipeline().unet, 64)


# 9. a run whose weights diverged (non-finite samples) stops with one line naming the epoch, and failed.json
def test_non_finite_samples_stop_the_run_naming_the_epoch(tmp_path):
    from ddpo_group.cli import one_line
    from ddpo_group.trainer import train
    from helpers import cheap, make_config

    config = make_config(tmp_path, **cheap(num_epochs=3, train__learning_rate=1e30, eval_freq=0))
    with pytest.raises(RuntimeError) as info:  # rollout.SamplesNotFiniteError
        train(config)
    line, total = one_line(info.value), config.sample.batch_size * config.sample.num_batches_per_epoch
    assert line.startswith(f"epoch 1: {total} of {total} sampled images are not finite") and "train.learning_rate=1e+30" in line
    failed = json.loads((tmp_path / "r" / "failed.json").read_text())
    assert failed["epoch"] == 1 and "not finite" in failed["error"]
    assert not (tmp_path / "r" / "finished.json").exists()
