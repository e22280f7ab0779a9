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
