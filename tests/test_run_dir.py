"""The run directory (ddpo_group/runs/run_dir.py) on its own: resolving a run, starting it, markers, checkpoints."""

import json
import os

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from ddpo_group.config.check import ConfigError
from ddpo_group.runs.run_dir import (
    CONFIG_FILE,
    FAILED_FILE,
    METRICS_FILE,
    RESUMES_FILE,
    STOPPED_FILE,
    TRAINER_STATE,
    CheckpointError,
    RunDir,
    resumed_config,
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
    from ddpo_group.runs.run_dir import with_resolved_paths

    (tmp_path / "gold").mkdir()
    (tmp_path / "gold" / "mine.py").write_text("def score(images, prompts, metadata):\n    return images.mean((1, 2, 3)), {}\n")
    monkeypatch.chdir(tmp_path)
    config = make_config(tmp_path, eval_rewards="gold/mine.py:score, shapes_color", eval_freq=1)
    resolved = with_resolved_paths(config)
    assert resolved.eval_rewards == f"{tmp_path / 'gold' / 'mine.py'}:score,shapes_color"
    assert config.eval_rewards == "gold/mine.py:score, shapes_color"  # the given config is left as it is


# Issue 34, items 1-3: overwrite removes only a run this library created, and only its files; run_name is one name;
# the lock is held across the removal.
def test_overwrite_refuses_a_directory_that_is_not_a_marked_run(tmp_path):
    project = tmp_path / "project"
    (project / "logs").mkdir(parents=True)
    (project / "config.json").write_text("{}")  # a project's own file of that name
    (project / "train.py").write_text("print('source')")
    with pytest.raises(ConfigError) as info:
        RunDir.resolve(make_config(tmp_path, run_name="project", overwrite=True))
    message = str(info.value)
    assert "config.overwrite=True refuses" in message and ".ddpo_group_run" in message and "\n" not in message
    run_dir = RunDir(str(project))  # start() refuses too, whatever resolved it
    with pytest.raises(ConfigError, match="refuses"):
        run_dir.start(make_config(tmp_path, run_name="project", overwrite=True), first_epoch=0)
    assert sorted(p.name for p in project.iterdir()) == ["config.json", "logs", "train.py"]
    assert (project / "train.py").read_text() == "print('source')"


def test_overwrite_removes_only_the_files_a_run_wrote(tmp_path):
    run_dir, config = RunDir.resolve(make_config(tmp_path))
    run_dir.start(config, first_epoch=0)
    run_dir.append_metrics({"epoch": 0})
    os.makedirs(run_dir.file("samples"))
    open(run_dir.file("report.html"), "w").close()
    with open(run_dir.file("notes.txt"), "w") as f:  # the user's own file beside the run's
        f.write("mine")
    run_dir.release()
    again, config = RunDir.resolve(make_config(tmp_path, overwrite=True))
    again.start(config, first_epoch=0)
    again.release()
    assert sorted(os.listdir(again.path)) == [".ddpo_group_run", "config.json", "notes.txt"]  # release removed .lock


@pytest.mark.parametrize("name", ["..", ".", "../escaped", "a/b", "/abs/run"])
def test_a_run_name_that_is_not_one_directory_name_is_refused(tmp_path, name):
    (tmp_path / "logs").mkdir()
    with pytest.raises(ConfigError) as info:
        RunDir.resolve(make_config(tmp_path / "logs", run_name=name))
    assert str(info.value).startswith(f"config.run_name={name!r}") and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"] and not any((tmp_path / "logs").iterdir())


def test_a_second_overwrite_while_the_first_removes_the_run_is_refused(tmp_path, monkeypatch):
    import shutil

    first, config = RunDir.resolve(make_config(tmp_path))
    first.start(config, first_epoch=0)
    os.makedirs(first.file("checkpoints/checkpoint_1"))
    first.release()
    winner, config = RunDir.resolve(make_config(tmp_path, overwrite=True))
    loser, _ = RunDir.resolve(make_config(tmp_path, overwrite=True))
    outcome, real_rmtree = [], shutil.rmtree

    def rmtree_racing(path, *args, **kwargs):  # the second overwrite starts while the first removes the run
        if not outcome:
            outcome.append("racing")
            try:
                loser.start(config, first_epoch=0)
                outcome[0] = "started"
            except ConfigError as err:
                outcome[0] = str(err)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_racing)
    winner.start(config, first_epoch=0)
    winner.release()
    loser.release()
    assert len(outcome) == 1 and "in use by a live run" in outcome[0]
    assert read_json(winner.file(CONFIG_FILE))["run_name"] == "r"


# Issue 34, item 13: safetensors' own error for a full disk is the one-line checkpoint error, and leaves no temporary
@pytest.mark.parametrize("where", ["accelerator state", "weight copy"])
def test_safetensors_failing_on_a_full_disk_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch, where):
    import ddpo_group.runs.run_dir as run_dir_module
    from safetensors import SafetensorError

    run_dir, config = RunDir.resolve(make_config(tmp_path))
    run_dir.start(config, first_epoch=0)
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    acc.prepare(torch.nn.Linear(3, 2))
    run_dir.save_checkpoint(acc, 1, {"epoch": 1, "global_step": 1}, {"reference": Holder(1)})

    def no_space(*args, **kwargs):  # what safetensors raises when the disk fills while it writes
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    if where == "accelerator state":
        monkeypatch.setattr(acc, "save_state", no_space)
    else:
        monkeypatch.setattr(run_dir_module, "save_file", no_space)
    with pytest.raises(CheckpointError) as info:
        run_dir.save_checkpoint(acc, 2, {"epoch": 2, "global_step": 2}, {"reference": Holder(2)})
    run_dir.release()
    message = str(info.value)
    assert "checkpoint_2" in message and "is full" in message and "checkpoint_1 is kept" in message
    assert "\n" not in message
    assert os.listdir(tmp_path / "r" / "checkpoints") == ["checkpoint_1"]


# Audit 2, the run directory mixing into user data: a new run writes only into a directory of its own.
def test_a_new_run_into_a_non_empty_directory_that_is_not_a_run_is_refused(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    for overwrite in (False, True):
        with pytest.raises(ConfigError) as info:
            RunDir.resolve(make_config(tmp_path, run_name="mine", overwrite=overwrite))
        message = str(info.value)
        assert message.startswith(f"config.logdir={str(tmp_path)!r} / config.run_name='mine'") and "\n" not in message
        assert "keep.txt" in message and "pick another config.run_name" in message
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt"]
    (tmp_path / "empty").mkdir()  # an empty directory is the run's to use
    run_dir, _ = RunDir.resolve(make_config(tmp_path, run_name="empty"))
    assert run_dir.path == str(tmp_path / "empty")


def test_a_run_name_that_links_to_a_non_empty_user_directory_is_refused(tmp_path):
    (tmp_path / "userdata").mkdir()
    (tmp_path / "userdata" / "keep.txt").write_text("x")
    (tmp_path / "logs").mkdir()
    os.symlink(tmp_path / "userdata", tmp_path / "logs" / "lnk")
    with pytest.raises(ConfigError) as info:
        RunDir.resolve(make_config(tmp_path / "logs", run_name="lnk"))
    message = str(info.value)
    assert "config.run_name='lnk'" in message and f"a link to {tmp_path / 'userdata'}" in message
    assert "\n" not in message and sorted(os.listdir(tmp_path / "userdata")) == ["keep.txt"]


@pytest.mark.parametrize("where", ["samples", "samples/deeper"])
def test_a_run_inside_another_runs_directory_is_refused(tmp_path, where):
    first, config = RunDir.resolve(make_config(tmp_path, run_name="ed"))
    first.start(config, first_epoch=0)
    first.release()
    os.makedirs(first.file("samples"))
    logdir = os.path.dirname(os.path.join(first.path, where))
    with pytest.raises(ConfigError) as info:  # logdir=RUN/, run_name=samples; or any path below the run
        RunDir.resolve(make_config(logdir, run_name=os.path.basename(where)))
    message = str(info.value)
    assert message.startswith(f"config.logdir={logdir!r}") and f"inside the run directory {first.path}" in message
    assert "config.logdir outside every run directory" in message and "\n" not in message
    assert os.listdir(first.file("samples")) == []


def test_logdir_and_resume_from_expand_the_users_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    run_dir, config = RunDir.resolve(make_config("~/runs", run_name="t1"))
    assert run_dir.path == str(tmp_path / "home" / "runs" / "t1") and config.logdir == str(tmp_path / "home" / "runs")
    run_dir.start(config, first_epoch=0)
    run_dir.release()
    assert not (tmp_path / "~").exists() and (tmp_path / "home" / "runs" / "t1" / CONFIG_FILE).is_file()
    with pytest.raises(CheckpointError) as info:  # resume_from reads the expanded path (it holds no checkpoint)
        RunDir.resolve(make_config(tmp_path, resume_from="~/runs/t1"))
    assert str(tmp_path / "home" / "runs" / "t1") in str(info.value) and "no checkpoint_N" in str(info.value)


def test_a_run_name_longer_than_a_directory_name_may_be_is_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        RunDir.resolve(make_config(tmp_path, run_name="a" * 300))
    message = str(info.value)
    assert message.startswith("config.run_name=") and "300 bytes" in message and "255" in message
    assert "\n" not in message and list(tmp_path.iterdir()) == []
    RunDir.resolve(make_config(tmp_path, run_name="a" * 255))  # the longest name allowed
    with pytest.raises(ConfigError, match="256 bytes"):  # bytes, not characters: 128 two-byte characters
        RunDir.resolve(make_config(tmp_path, run_name="é" * 128))


def test_resume_from_with_overwrite_is_refused_naming_both(tmp_path):
    first, config = RunDir.resolve(make_config(tmp_path, run_name="base"))
    first.start(config, first_epoch=0)
    first.release()
    os.makedirs(first.file("checkpoints/checkpoint_1"))
    with open(first.file(f"checkpoints/checkpoint_1/{TRAINER_STATE}"), "w") as f:
        json.dump({"epoch": 1}, f)
    RunDir.resolve(make_config(tmp_path, run_name="base", resume_from=first.path))  # resumable on its own
    with pytest.raises(ConfigError) as info:
        RunDir.resolve(make_config(tmp_path, run_name="base", resume_from=first.path, overwrite=True))
    message = str(info.value)
    assert message.startswith(f"config.resume_from={first.path!r} and config.overwrite=True") and "\n" not in message
    assert sorted(os.listdir(first.path)) == [".ddpo_group_run", "checkpoints", CONFIG_FILE]


def test_a_run_started_with_overwrite_resumes_when_every_field_is_compared(tmp_path):
    # overwrite says what a new run does to an earlier one; a resume always has it off (resolve refuses both), so a
    # run started with overwrite=True resumed by code (overrides=None: every field compared) is not another experiment
    with open(tmp_path / "config.json", "w") as f:
        json.dump(make_config(tmp_path, overwrite=True).to_dict(), f)
    given = make_config(tmp_path, resume_from=str(tmp_path))
    _, changes = resumed_config(given, str(tmp_path), overrides=None)
    assert changes["overwrite"] == [True, False]
    with pytest.raises(ConfigError, match="seed"):  # a field of the experiment is still refused
        resumed_config(make_config(tmp_path, resume_from=str(tmp_path), seed=7), str(tmp_path), overrides=None)


def test_a_resume_is_a_resume_whatever_the_override_list_names(tmp_path):
    # an override list that omits resume_from (code calling Trainer(config, overrides=["num_epochs"])) once gave the
    # stored config's resume_from "" and overwrite True: start() would have emptied the run it was resuming
    run_dir, config = RunDir.resolve(make_config(tmp_path, overwrite=True))
    run_dir.start(config, first_epoch=0)
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    run_dir.save_checkpoint(acc, 1, {"epoch": 1, "global_step": 1}, {})
    run_dir.release()
    given = make_config(tmp_path, resume_from=str(tmp_path / "r"), num_epochs=3)
    resumed, resolved = RunDir.resolve(given, overrides=["num_epochs"])
    assert resolved.resume_from == str(tmp_path / "r") and resolved.overwrite is False
    assert resumed.resume_checkpoint.endswith("checkpoint_1") and resolved.num_epochs == 3
