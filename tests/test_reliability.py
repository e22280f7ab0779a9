"""The fault and bad-input audit: each case ends in a clear one-line error, a bounded wait, or a run
that continues correctly; nothing written before an error is lost."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from ddpo_group.algos.advantages import compute_grpo_advantages, compute_rloo_advantages
from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.data.prompts import load_prompts
from ddpo_group.rewards.combine import validate_rewards
from ddpo_group.rewards.registry import RewardError
from ddpo_group.runs.run_control import RunControl
from ddpo_group.training.trainer import CheckpointError, Trainer, find_checkpoint, train
from helpers import PYTHON, ROOT, cheap, make_config, read_metrics, subprocess_env


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-epoch run of the test variant with a checkpoint after each epoch (reference copied: no LoRA)."""
    root = tmp_path_factory.mktemp("finished")
    run_dir = train(make_config(root, num_epochs=2, save_freq=1, log_images_every=0))
    return run_dir


def _copy(run_dir, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(run_dir, target)
    return target


# 3. non-finite floats
@pytest.mark.parametrize("field", ["train__beta", "train__adv_clip_max", "train__learning_rate", "sample__eta"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_floats_are_refused_naming_the_field(tmp_path, field, value):
    with pytest.raises(ConfigError) as info:
        check_config(make_config(tmp_path, **{field: value}))
    assert field.replace("__", ".") in str(info.value) and "finite" in str(info.value)


# 4. scale: float64 group statistics; rewards that do not fit in float32
def test_huge_rewards_keep_their_advantages():
    mask = torch.ones(3, 2)
    expected = [-1.5 ** 0.5, 0.0, 1.5 ** 0.5]  # (r - mean) / population std of (1, 2, 3)
    for scale in (1.0, 1e30, 1e-30):
        rewards = torch.tensor([1.0, 2.0, 3.0]) * scale
        advantages, _ = compute_grpo_advantages(rewards, torch.zeros(3, dtype=torch.int64), mask, eps=0.0)
        assert advantages[:, 0].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)  # float32 inputs
    rloo, _ = compute_rloo_advantages(torch.tensor([1.0, 2.0, 3.0]) * 1e30, torch.zeros(3, dtype=torch.int64), mask)
    assert rloo[:, 0].tolist() == pytest.approx([-1.5e30, 0.0, 1.5e30], rel=1e-5, abs=1e24)  # float32 inputs


def test_a_reward_that_does_not_fit_in_float32_is_named():
    with pytest.raises(RewardError) as info:
        validate_rewards(np.array([1.0, 1e39]), "my_reward", ["a", "b"])
    assert "my_reward" in str(info.value) and "float32" in str(info.value) and "'b'" in str(info.value)


# 5-7. resume with the run's own config; other experiments refused without writing anything
def test_resume_refuses_another_experiment_and_changes_no_file(finished_run, tmp_path):
    run_dir = _copy(finished_run, tmp_path)
    before = {name: (run_dir / name).read_bytes() for name in ("config.json", "metrics.jsonl")}
    for changed in (dict(sample__group_size=4), dict(algorithm__adv_estimator="gae")):
        config = make_config(tmp_path, num_epochs=3, resume_from=str(run_dir), **changed)
        with pytest.raises(ConfigError) as info:
            Trainer(config)
        field = next(iter(changed)).replace("__", ".")
        assert field in str(info.value) and "resume_allow_changes" in str(info.value)
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    assert not (run_dir / "resumes.jsonl").exists()


def test_resume_with_only_resume_from_uses_the_stored_config(finished_run, tmp_path):
    run_dir = _copy(finished_run, tmp_path)
    # the command line named another variant (tiny_one_prompt-like settings) but overrode only these fields
    given = make_config(tmp_path, num_epochs=3, resume_from=str(run_dir), train__learning_rate=0.5,
                        sample__group_size=4, log_images_every=0)
    trainer = Trainer(given, overrides=["num_epochs", "resume_from"])
    stored = json.loads((run_dir / "config.json").read_text())
    assert trainer.config.train.learning_rate == stored["train"]["learning_rate"] != 0.5
    assert trainer.config.sample.group_size == stored["sample"]["group_size"] == 2
    assert trainer.config.num_epochs == 3
    trainer.run()
    assert [row["epoch"] for row in read_metrics(run_dir)] == [0, 1, 2]
    record = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[0])
    assert record["epoch"] == 2 and record["changed"]["num_epochs"] == [2, 3]


def test_an_allowed_change_is_applied_and_recorded(finished_run, tmp_path):
    run_dir = _copy(finished_run, tmp_path)
    # from checkpoint_1: an epoch left to do (a finished run resumed with nothing to do changes nothing, issue 43)
    given = make_config(tmp_path, num_epochs=2, resume_from=str(run_dir / "checkpoints" / "checkpoint_1"),
                        train__learning_rate=1e-3, resume_allow_changes=True)
    trainer = Trainer(given, overrides=["resume_from", "train.learning_rate", "resume_allow_changes"])
    assert trainer.config.train.learning_rate == 1e-3
    record = json.loads((run_dir / "resumes.jsonl").read_text())
    assert record["changed"]["train.learning_rate"][1] == 1e-3


def test_a_run_from_before_a_new_field_resumes_with_its_default_and_may_turn_on_checkpointing(finished_run, tmp_path):
    run_dir = _copy(finished_run, tmp_path)
    stored = json.loads((run_dir / "config.json").read_text())
    del stored["train"]["gradient_checkpointing"]  # a config.json written before the field existed
    for overrides in (["num_epochs", "resume_from"], None):
        (run_dir / "config.json").write_text(json.dumps(stored))
        trainer = Trainer(make_config(tmp_path, num_epochs=3, resume_from=str(run_dir)), overrides=overrides)
        assert trainer.config.train.gradient_checkpointing is False  # the default: what the run had
        assert trainer.config.train.learning_rate == stored["train"]["learning_rate"]
        trainer.files.release()
    # gradient checkpointing changes memory, not values: switching it on to resume is allowed and recorded
    given = make_config(tmp_path, num_epochs=3, resume_from=str(run_dir), train__gradient_checkpointing=True)
    trainer = Trainer(given, overrides=["num_epochs", "resume_from", "train.gradient_checkpointing"])
    assert trainer.config.train.gradient_checkpointing is True and trainer.trainable_module.is_gradient_checkpointing
    trainer.run()
    record = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["changed"]["train.gradient_checkpointing"] == [False, True]


# 6. a checkpoint directly inside the named run directory
def test_resume_keeps_the_run_directory_the_user_named(finished_run, tmp_path):
    run_dir = tmp_path / "D" / "myrun"
    run_dir.mkdir(parents=True)
    shutil.copytree(os.path.join(finished_run, "checkpoints", "checkpoint_2"), run_dir / "checkpoint_2")
    shutil.copy(os.path.join(finished_run, "config.json"), run_dir / "config.json")
    checkpoint, state, found_run_dir = find_checkpoint(str(run_dir))
    assert found_run_dir == str(run_dir) and checkpoint == str(run_dir / "checkpoint_2")
    assert find_checkpoint(str(run_dir / "checkpoint_2"))[2] == str(run_dir)
    trainer = Trainer(make_config(tmp_path, num_epochs=3, resume_from=str(run_dir)), overrides=["num_epochs", "resume_from"])
    assert trainer.run_dir == str(run_dir)
    trainer.run()
    assert os.listdir(tmp_path / "D") == ["myrun"]
    assert (run_dir / "checkpoints" / "checkpoint_3").is_dir()


# 10. a truncated reference model
def test_a_truncated_reference_checkpoint_names_the_file(finished_run, tmp_path):
    run_dir = _copy(finished_run, tmp_path)
    path = run_dir / "checkpoints" / "checkpoint_2" / "reference.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError) as info:
        Trainer(make_config(tmp_path, num_epochs=3, resume_from=str(run_dir)), overrides=["num_epochs", "resume_from"])
    assert "reference.safetensors" in str(info.value)


# 11. a torn last line of metrics.jsonl
def test_a_torn_last_metrics_line_is_dropped_on_resume(finished_run, tmp_path, caplog):
    run_dir = _copy(finished_run, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"epoch": 2, "reward_me')
    trainer = Trainer(make_config(tmp_path, num_epochs=3, resume_from=str(run_dir)), overrides=["num_epochs", "resume_from"])
    assert "torn last line" in caplog.text
    trainer.run()
    assert [row["epoch"] for row in read_metrics(run_dir)] == [0, 1, 2]


def test_a_bad_last_metrics_line_that_ends_with_its_newline_stops_the_resume_naming_it(finished_run, tmp_path):
    # the trainer writes a row and its newline in one write: a complete bad line is damage, not a torn write
    run_dir = _copy(finished_run, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"epoch": 2, "reward_me\n')
    before = metrics.read_bytes()
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl line 3: not valid JSON.*repair or delete that line"):
        Trainer(make_config(tmp_path, num_epochs=3, resume_from=str(run_dir)), overrides=["num_epochs", "resume_from"])
    assert metrics.read_bytes() == before


# 12. a full disk while a checkpoint is written
def test_a_full_disk_during_a_checkpoint_says_so_and_keeps_the_last_one(finished_run, tmp_path, monkeypatch):
    run_dir = _copy(finished_run, tmp_path)
    trainer = Trainer(make_config(tmp_path, num_epochs=3, resume_from=str(run_dir)), overrides=["num_epochs", "resume_from"])

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.accelerator, "save_state", no_space)
    with pytest.raises(CheckpointError) as info:
        trainer.save_checkpoint(3)
    message = str(info.value)
    assert "full" in message and "checkpoint_2" in message and "\n" not in message
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]


# 13. failures before the first epoch
def test_a_bad_prompt_file_leaves_no_run_directory(tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"a red \xff\xfe circle\n")
    with pytest.raises(ValueError) as info:
        Trainer(make_config(tmp_path, prompt_fn=str(bad)))
    assert str(bad) in str(info.value) and "UTF-8" in str(info.value)  # 9.
    assert not (tmp_path / "r").exists()


def test_a_run_that_fails_in_its_first_epoch_is_marked_failed(tmp_path):
    plugin = tmp_path / "bad_reward.py"
    plugin.write_text(textwrap.dedent('''
        from ddpo_group.rewards.registry import register_reward

        @register_reward("always_nan")
        def always_nan(images, prompts, metadata):
            return [float("nan")] * len(prompts), {}
    '''))
    config = make_config(tmp_path, **cheap(plugins=str(plugin), reward_fn="always_nan"))
    with pytest.raises(RewardError):
        train(config)
    failed = json.loads((tmp_path / "r" / "failed.json").read_text())
    assert failed["epoch"] == 0 and "always_nan" in failed["error"]


# 2. a reward that never returns
HANGING_REWARD = '''
import threading
from ddpo_group.rewards.registry import register_reward

@register_reward("never_returns")
def never_returns(images, prompts, metadata):
    threading.Event().wait()
'''


def test_a_reward_past_its_timeout_stops_the_run_naming_it(tmp_path):
    plugin = tmp_path / "hang.py"
    plugin.write_text(HANGING_REWARD)
    config = make_config(tmp_path, **cheap(plugins=str(plugin), reward_fn="never_returns", reward_timeout=1.0))
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        train(config)
    assert time.monotonic() - start < 60
    assert "never_returns" in str(info.value) and "reward_timeout=1" in str(info.value)


def test_a_second_signal_exits_at_once_while_a_reward_hangs(tmp_path):
    plugin = tmp_path / "hang.py"
    plugin.write_text(HANGING_REWARD)
    command = [
        PYTHON, os.path.join(ROOT, "scripts", "train.py"), "--config", "config/grpo.py:test",
        f"--config.logdir={tmp_path}", "--config.run_name=r", f"--config.plugins={plugin}",
        "--config.reward_fn=never_returns", "--config.reward_timeout=0", "--config.sample.num_steps=2",
    ]
    with open(tmp_path / "log.txt", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while "run " not in (tmp_path / "log.txt").read_text():  # the trainer's start line
                assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-2000:]
                time.sleep(0.2)
            time.sleep(2.0)  # sampling done, waiting on the reward
            process.send_signal(signal.SIGTERM)
            # a person's second signal: later than RunControl.SAME_REQUEST_S (2 s), inside which a signal is a copy of
            # the first (accelerate launch >= 1.16 forwards its own); 0.5 s apart was a second signal before that
            time.sleep(RunControl.SAME_REQUEST_S + 0.5)
            process.send_signal(signal.SIGTERM)
            returncode = process.wait(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert returncode == 128 + signal.SIGTERM


# 8. a typo in an override
def test_a_typo_in_an_override_is_one_line_with_the_closest_field(tmp_path):
    result = subprocess.run(
        [PYTHON, "scripts/train.py", "--config", "config/grpo.py:test", "--config.train.learnig_rate=1e-4",
         f"--config.logdir={tmp_path}"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "train.learnig_rate" in lines[0] and "train.learning_rate" in lines[0]
    assert not os.listdir(tmp_path)


def test_prompts_in_other_encodings_name_the_file(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.jsonl.*UTF-8"):
        load_prompts(str(path))


def test_a_successful_resume_moves_the_earlier_failure_into_resumes_jsonl(tmp_path):
    flag = tmp_path / "fail_now"
    plugin = tmp_path / "flaky_reward.py"
    plugin.write_text(textwrap.dedent(f'''
        import os
        from ddpo_group.rewards.registry import register_reward

        SEEN = {str(tmp_path / "seen")!r}

        @register_reward("flaky")
        def flaky(images, prompts, metadata):  # fails from its second epoch on while the flag exists
            value = float("nan") if os.path.exists({str(flag)!r}) and os.path.exists(SEEN) else 0.5
            open(SEEN, "w").close()
            return [value] * len(prompts), {{}}
    '''))
    config = make_config(tmp_path, **cheap(plugins=str(plugin), reward_fn="flaky", num_epochs=2, save_freq=1))
    flag.write_text("")
    with pytest.raises(RewardError):
        train(config)
    assert json.loads((tmp_path / "r" / "failed.json").read_text())["epoch"] == 1  # after checkpoint_1
    flag.unlink()
    train(make_config(tmp_path, **cheap(plugins=str(plugin), reward_fn="flaky", num_epochs=2, save_freq=1,
                                        resume_from=str(tmp_path / "r"))))
    assert not (tmp_path / "r" / "failed.json").exists()
    resumes = [json.loads(line) for line in (tmp_path / "r" / "resumes.jsonl").read_text().splitlines()]
    assert resumes[-1]["previous_failure"]["epoch"] == 1 and "flaky" in resumes[-1]["previous_failure"]["error"]


def test_a_stop_signal_during_an_evaluation_stops_between_its_batches(tmp_path):
    calls = tmp_path / "calls"
    plugin = tmp_path / "signalling_reward.py"
    plugin.write_text(textwrap.dedent(f'''
        import os, signal
        from ddpo_group.rewards.registry import register_reward

        @register_reward("signals_once")
        def signals_once(images, prompts, metadata):  # the first call is the epoch-0 evaluation's first batch
            with open({str(calls)!r}, "a") as f:
                f.write("x")
            if os.path.getsize({str(calls)!r}) == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return [0.5] * len(prompts), {{}}
    '''))
    config = make_config(tmp_path, **cheap(plugins=str(plugin), reward_fn="signals_once", num_epochs=3, eval_freq=1,
                                           eval_images_per_prompt=4, eval_batch_size=2))
    run_dir = train(config)
    # 2 evaluation images per batch, many batches: the stop came after the first, no training epoch ran
    assert calls.read_text() == "x"
    assert json.loads((tmp_path / "r" / "stopped.json").read_text())["epoch"] == 0
    assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl")) or not read_metrics(run_dir)


@pytest.mark.parametrize(
    "args,needle",
    [(["--serve", "no_such_reward"], "unknown reward 'no_such_reward'"), (["--serve", "aesthetic", "--kwargs", "{bad"], "--kwargs")],
)
def test_the_reward_server_refuses_an_unknown_reward_or_bad_kwargs_in_one_line(args, needle):
    result = subprocess.run(
        [PYTHON, "-m", "ddpo_group.rewards.server", *args], cwd=ROOT, env=subprocess_env(), capture_output=True,
        text=True, timeout=120,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert needle in lines[0] and "Traceback" not in result.stderr


def test_ctrl_c_while_the_run_starts_is_one_line_and_exit_130(tmp_path):
    # KeyboardInterrupt where a Ctrl-C during model loading raises it (inside train(), before the epochs, whose
    # own handler stops them cleanly); raised deterministically: a real SIGINT's moment cannot be chosen (one
    # that lands in an object's finalizer is swallowed by Python itself)
    code = (
        "import ddpo_group.training.trainer as trainer\n"
        "def interrupted(*args, **kwargs):\n"
        "    raise KeyboardInterrupt\n"
        "trainer.train = interrupted\n"
        "from ddpo_group.cli import train_main\n"
        "train_main()\n"
    )
    result = subprocess.run(
        [PYTHON, "-c", code, "--config", "config/grpo.py:test", f"--config.logdir={tmp_path}"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 130, result.stderr
    assert len(lines) == 1 and "interrupted" in lines[0], result.stderr


def test_a_new_run_into_a_directory_that_holds_a_run_is_refused_and_changes_nothing(finished_run, tmp_path):
    run_copy = tmp_path / "r"
    shutil.copytree(finished_run, run_copy)
    before = {p: p.read_bytes() for p in run_copy.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="already holds a run") as info:
        train(make_config(tmp_path, **cheap()))
    assert f"--config.resume_from={run_copy}" in str(info.value) and "\n" not in str(info.value)
    assert {p: p.read_bytes() for p in run_copy.rglob("*") if p.is_file()} == before


def test_overwrite_replaces_the_earlier_run(finished_run, tmp_path):
    run_copy = tmp_path / "r"
    shutil.copytree(finished_run, run_copy)
    (run_copy / "stopped.json").write_text("{}")  # from the earlier run
    (run_copy / "notes.txt").write_text("the user's own")  # not written by a run: kept (issue 34)
    run_dir = train(make_config(tmp_path, overwrite=True, **cheap()))
    assert run_dir == str(run_copy) and not (run_copy / "stopped.json").exists()
    assert (run_copy / "notes.txt").read_text() == "the user's own"
    assert [row["epoch"] for row in read_metrics(run_dir)] == [0]


def test_a_live_run_locks_its_directory(finished_run, tmp_path):
    from ddpo_group.training.trainer import _lock_run_dir

    run_copy = tmp_path / "r"
    shutil.copytree(finished_run, run_copy)
    held = _lock_run_dir(str(run_copy))  # as a live run holds it
    try:
        with pytest.raises(ConfigError, match="in use by a live run"):
            train(make_config(tmp_path, num_epochs=3, save_freq=1, log_images_every=0, resume_from=str(run_copy)))
        with pytest.raises(ConfigError, match="in use by a live run"):
            train(make_config(tmp_path, overwrite=True, **cheap()))
    finally:
        held.close()
    assert [row["epoch"] for row in read_metrics(str(run_copy))][:2] == [0, 1]  # untouched; free once the holder ends:
    train(make_config(tmp_path, num_epochs=3, save_freq=1, log_images_every=0, resume_from=str(run_copy)))
    assert [row["epoch"] for row in read_metrics(str(run_copy)) if not row.get("eval_only")] == [0, 1, 2]


@pytest.mark.parametrize("statement", ["sys.exit(0)", "raise SystemExit(3)", "raise KeyboardInterrupt"])
def test_a_reward_that_exits_stops_the_run_with_an_error_naming_it(tmp_path, statement):
    plugin = tmp_path / "exiting_reward.py"
    plugin.write_text(textwrap.dedent(f'''
        import sys
        from ddpo_group.rewards.registry import register_reward

        @register_reward("exits_early")
        def exits_early(images, prompts, metadata):
            {statement}
    '''))
    config = make_config(tmp_path, **cheap(plugins=str(plugin), reward_fn="exits_early"))
    with pytest.raises(RewardError, match="reward 'exits_early' tried to end the process"):
        train(config)
    assert json.loads((tmp_path / "r" / "failed.json").read_text())["epoch"] == 0


def test_rewards_get_their_own_cpu_float32_copy_and_their_info_is_logged(tmp_path):
    seen = tmp_path / "seen.json"
    plugin = tmp_path / "copy_rewards.py"
    plugin.write_text(textwrap.dedent(f'''
        import json
        import torch
        from ddpo_group.rewards.registry import register_reward

        @register_reward("vandal")
        def vandal(images, prompts, metadata):  # edits its images in place: nobody else may see it
            record = {{"device": images.device.type, "dtype": str(images.dtype), "numpy": images.numpy().shape[0]}}
            images.zero_()
            with open({str(seen)!r}, "w") as f:
                json.dump(record, f)
            return [0.5] * len(prompts), {{"count": len(prompts), "per_sample": torch.ones(len(prompts)), "note": "x"}}

        @register_reward("brightness")
        def brightness(images, prompts, metadata):
            return images.mean(dim=(1, 2, 3)), {{}}
    '''))
    config = make_config(tmp_path, **cheap(plugins=str(plugin), reward_fn="", log_images_every=1,
                                           reward_weights={"vandal": 1.0, "brightness": 1.0}))
    row = read_metrics(train(config))[0]
    assert json.loads(seen.read_text()) == {"device": "cpu", "dtype": "torch.float32", "numpy": 4}
    assert row["reward/brightness"] > 0.05  # computed on the unedited images
    assert row["reward_info/vandal/count"] == 4 and row["reward_info/vandal/per_sample"] == 1.0
    assert "reward_info/vandal/note" not in row


@pytest.mark.parametrize("value,why", [("[1 + 2j] * len(prompts)", "complex"), ("[2**60] * len(prompts)", "integers above"),
                                       ("['1'] * len(prompts)", "not numbers")])
def test_complex_overflowing_or_text_rewards_are_refused_not_truncated(tmp_path, value, why):
    plugin = tmp_path / "odd_reward.py"
    plugin.write_text(textwrap.dedent(f'''
        from ddpo_group.rewards.registry import register_reward

        @register_reward("odd")
        def odd(images, prompts, metadata):
            return {value}, {{}}
    '''))
    with pytest.raises(RewardError, match=why):
        train(make_config(tmp_path, **cheap(plugins=str(plugin), reward_fn="odd")))


def test_a_reward_can_ask_for_device_tensors():
    from ddpo_group.rewards.combine import CombinedReward
    from ddpo_group.rewards.registry import register_reward, wants_device_tensors

    got = {}

    @register_reward("test_device_tensors_reward", device_tensors=True)
    def on_device(images, prompts, metadata):
        got["images"] = images
        return [0.0] * len(prompts), {}

    assert wants_device_tensors(on_device)
    images = torch.rand(2, 3, 8, 8, dtype=torch.float64)
    CombinedReward({"test_device_tensors_reward": on_device})(images, ["a", "b"])
    # the reward's own copy, in the dtype and on the device it was given (the training device's)
    assert got["images"].dtype == torch.float64 and got["images"].data_ptr() != images.data_ptr()
    assert torch.equal(got["images"], images)


def test_a_stop_right_after_a_periodic_save_does_not_write_that_checkpoint_again(tmp_path, monkeypatch):
    from ddpo_group.training.trainer import Trainer

    plugin = tmp_path / "stopping_reward.py"
    calls = tmp_path / "calls"
    plugin.write_text(textwrap.dedent(f'''
        import os, signal
        from ddpo_group.rewards.registry import register_reward

        @register_reward("stops_in_epoch_one")
        def stops_in_epoch_one(images, prompts, metadata):  # one call per epoch: the 2nd is epoch 1's sampling
            with open({str(calls)!r}, "a") as f:
                f.write("x")
            if os.path.getsize({str(calls)!r}) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return [0.5] * len(prompts), {{}}
    '''))
    saved = []
    original = Trainer.save_checkpoint
    monkeypatch.setattr(Trainer, "save_checkpoint", lambda self, epoch: saved.append(epoch) or original(self, epoch))
    train(make_config(tmp_path, **cheap(plugins=str(plugin), reward_fn="stops_in_epoch_one", num_epochs=3, save_freq=1)))
    # the periodic save after epoch 0 holds the state the stop would save: checkpoint_1 is written once
    assert saved == [1]
    assert json.loads((tmp_path / "r" / "stopped.json").read_text())["epoch"] == 1
    assert os.path.isdir(tmp_path / "r" / "checkpoints" / "checkpoint_1")
