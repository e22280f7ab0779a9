"""The run directory (ddpo_group/run_dir.py) on its own: resolving a run, starting it, markers, checkpoints."""

import json
import os

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from ddpo_group.config_check import ConfigError
from ddpo_group.run_dir import (
    CONFIG_FILE,
    FAILED_FILE,
    METRICS_FILE,
    RESUMES_FILE,
    STOPPED_FILE,
    TRAINER_STATE,
    CheckpointError,
    RunDir,
)
from helpers import make_config, read_json


class Holder:
    """A weight copy as the reference policy keeps one: tensors under "params", plain values beside them."""

    def __init__(self, value):
        self.params = {"w": torch.full((2, 3), float(value))}
        self.count = int(value)

    def state_dict(self):
        return {"params": dict(self.params), "count": self.count}

    def load_state_dict(self, state):
        self.params, self.count = dict(state["params"]), state["count"]


def test_resolving_a_new_run_writes_nothing(tmp_path):
    run_dir, config = RunDir.resolve(make_config(tmp_path, run_name="fresh"))
    assert run_dir.path == str(tmp_path / "fresh") and config.run_name == "fresh"
    assert run_dir.resume_checkpoint is None
    assert not (tmp_path / "fresh").exists()


def test_start_writes_the_config_and_refuses_a_second_run_into_it(tmp_path):
    config = make_config(tmp_path)
    run_dir, config = RunDir.resolve(config)
    run_dir.start(config, first_epoch=0)
    try:
        assert read_json(os.path.join(run_dir.path, CONFIG_FILE))["run_name"] == "r"
        assert os.path.exists(os.path.join(run_dir.path, ".lock"))
    finally:
        run_dir.release()
    with pytest.raises(ConfigError, match="already holds a run"):
        RunDir.resolve(make_config(tmp_path))


def test_markers_and_metrics_rows(tmp_path):
    run_dir = RunDir(str(tmp_path))
    run_dir.append_metrics({"epoch": 0, "reward_mean": 0.5})
    run_dir.append_metrics({"epoch": 1, "reward_mean": 0.75})
    rows = [json.loads(line) for line in open(tmp_path / METRICS_FILE)]
    assert rows == [{"epoch": 0, "reward_mean": 0.5}, {"epoch": 1, "reward_mean": 0.75}]
    run_dir.mark_stopped(3, 15)
    stopped = read_json(tmp_path / STOPPED_FILE)
    assert stopped["epoch"] == 3 and stopped["signal"] == 15
    assert stopped["resume"] == f"--config.resume_from={tmp_path}"
    run_dir.mark_failed(2, ValueError("bad reward"))
    assert read_json(tmp_path / FAILED_FILE)["error"] == "ValueError: bad reward"


def test_a_checkpoint_round_trip_and_what_a_resume_does_to_the_run_files(tmp_path):
    config = make_config(tmp_path, num_checkpoint_limit=2)
    run_dir, config = RunDir.resolve(config)
    run_dir.start(config, first_epoch=0)
    AcceleratorState._reset_state()  # another test's mixed precision is not this one's
    acc = Accelerator(cpu=True)
    module = acc.prepare(torch.nn.Linear(3, 2))
    for epoch in (1, 2, 3):
        run_dir.append_metrics({"epoch": epoch - 1})
        with torch.no_grad():
            module.weight.fill_(float(epoch))
        path = run_dir.save_checkpoint(acc, epoch, {"epoch": epoch, "global_step": 10 * epoch}, {"reference": Holder(epoch)},
                                       limit=config.num_checkpoint_limit)
    run_dir.mark_failed(3, RuntimeError("boom"))
    run_dir.release()
    checkpoints = sorted(os.listdir(tmp_path / "r" / "checkpoints"))
    assert checkpoints == ["checkpoint_2", "checkpoint_3"]  # the limit keeps the newest two
    state = read_json(os.path.join(path, TRAINER_STATE))
    assert state == {"epoch": 3, "global_step": 30, "reference": {"count": 3}}

    # resume from checkpoint_2: rows of epochs >= 2 are dropped, the weights and the copy come back
    resumed_config = make_config(tmp_path, resume_from=str(tmp_path / "r" / "checkpoints" / "checkpoint_2"))
    resumed, _ = RunDir.resolve(resumed_config)
    holder = Holder(0)
    with torch.no_grad():
        module.weight.zero_()
    loaded = resumed.load_checkpoint(acc, {"reference": holder})
    assert loaded["epoch"] == 2 and loaded["global_step"] == 20
    assert torch.equal(holder.params["w"], torch.full((2, 3), 2.0)) and holder.count == 2
    assert torch.equal(module.weight.detach(), torch.full((2, 3), 2.0))
    assert [json.loads(line)["epoch"] for line in open(tmp_path / "r" / METRICS_FILE)] == [0, 1]
    resumed.start(resumed_config, first_epoch=2)
    resumed.release()
    assert not (tmp_path / "r" / FAILED_FILE).exists()  # the earlier failure moves into resumes.jsonl
    record = json.loads(open(tmp_path / "r" / RESUMES_FILE).read())
    assert record["epoch"] == 2 and record["previous_failure"]["error"] == "RuntimeError: boom"


def test_a_missing_checkpoint_is_named(tmp_path):
    (tmp_path / "r").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint_N"):
        RunDir.resolve(make_config(tmp_path, resume_from=str(tmp_path / "r")))


def test_relative_file_specs_of_eval_rewards_are_stored_absolute(tmp_path, monkeypatch):
    from ddpo_group.run_dir import with_resolved_paths

    (tmp_path / "gold").mkdir()
    (tmp_path / "gold" / "mine.py").write_text("def score(images, prompts, metadata):\n    return images.mean((1, 2, 3)), {}\n")
    monkeypatch.chdir(tmp_path)
    config = make_config(tmp_path, eval_rewards="gold/mine.py:score, shapes_color", eval_freq=1)
    resolved = with_resolved_paths(config)
    assert resolved.eval_rewards == f"{tmp_path / 'gold' / 'mine.py'}:score,shapes_color"
    assert config.eval_rewards == "gold/mine.py:score, shapes_color"  # the given config is left as it is
