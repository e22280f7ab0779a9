"""Issue 34, the third fault audit: each bad outcome it found, as a test that failed before its fix.

The run directory's items (1-3) are in tests/test_run_dir.py and the reward server's (10, 11) in
tests/test_reward_server.py; the others are here, numbered as in the issue."""

import json
import os

import numpy as np
import pytest
import torch

from ddpo_group.report.inspect import load_run, write_report
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
    from ddpo_group.config.check import ConfigError
    from ddpo_group.diffusion.lora import add_lora
    from ddpo_group.diffusion.tiny import build_tiny_pipeline
    from ddpo_group.training.trainer import Trainer
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
    from ddpo_group.training.trainer import train
    from helpers import cheap, make_config

    config = make_config(tmp_path, **cheap(num_epochs=3, train__learning_rate=1e30, eval_freq=0))
    with pytest.raises(RuntimeError) as info:  # rollout.SamplesNotFiniteError
        train(config)
    line, total = one_line(info.value), config.sample.batch_size * config.sample.num_batches_per_epoch
    assert line.startswith(f"epoch 1: {total} of {total} sampled images are not finite") and "train.learning_rate=1e+30" in line
    failed = json.loads((tmp_path / "r" / "failed.json").read_text())
    assert failed["epoch"] == 1 and "not finite" in failed["error"]
    assert not (tmp_path / "r" / "finished.json").exists()


# 4. the evaluation honours reward_timeout, and a stop signal while its reward hangs
SLOW_REWARDS = '''
import os, signal, threading
from ddpo_group.rewards.registry import register_reward

@register_reward("fine")
def fine(images, prompts, metadata):
    return [0.5] * len(prompts), {{}}

CALLS = []


@register_reward("stuck")
def stuck(images, prompts, metadata):  # its first call as good as never returns: 20 s (a test that fails must end)
    CALLS.append(1)
    if len(CALLS) == 1:
        {before}
        threading.Event().wait(20)
        open({returned!r}, "w").close()
    return [0.5] * len(prompts), {{}}
'''


@pytest.mark.parametrize("where", ["reward_fn", "eval_rewards"])
def test_a_reward_that_hangs_in_the_evaluation_is_stopped_at_reward_timeout(tmp_path, where):
    from ddpo_group.rewards.registry import RewardError
    from ddpo_group.training.trainer import train
    from helpers import cheap, make_config

    plugin = tmp_path / "slow.py"
    plugin.write_text(SLOW_REWARDS.format(before="", returned=str(tmp_path / "returned")))
    rewards = {"reward_fn": "stuck"} if where == "reward_fn" else {"reward_fn": "fine", "eval_rewards": "stuck"}
    config = make_config(tmp_path, **cheap(plugins=str(plugin), eval_freq=1, reward_timeout=1.0, **rewards))
    with pytest.raises(RewardError) as info:
        train(config)
    assert "'stuck' did not return within reward_timeout=1 s" in str(info.value)
    assert not (tmp_path / "returned").exists()  # given up on, not waited for
    assert json.loads((tmp_path / "r" / "failed.json").read_text())["epoch"] == 0


def test_a_stop_signal_while_an_evaluation_reward_hangs_stops_the_run(tmp_path):
    from ddpo_group.training.trainer import train
    from helpers import cheap, make_config

    plugin = tmp_path / "slow.py"
    plugin.write_text(SLOW_REWARDS.format(before="os.kill(os.getpid(), signal.SIGTERM)",
                                          returned=str(tmp_path / "returned")))
    config = make_config(tmp_path, **cheap(plugins=str(plugin), eval_freq=1, reward_timeout=0.0,
                                           reward_fn="fine", eval_rewards="stuck"))
    run_dir = train(config)
    assert not (tmp_path / "returned").exists()  # the run stopped while the reward still hung
    stopped = json.loads((tmp_path / "r" / "stopped.json").read_text())
    assert stopped["epoch"] == 0 and stopped["signal"] == 15 and run_dir == str(tmp_path / "r")
    assert not (tmp_path / "r" / "finished.json").exists()


# 14. a config file that raises at import, has no get_config, returns a dict or lacks the fields: one line naming it
@pytest.mark.parametrize("source,says", [
    ('raise RuntimeError("boom at import")\n', "could not be loaded (RuntimeError: boom at import)"),
    ("x = 1\n", "could not be loaded (AttributeError:"),
    ('def get_config():\n    return {"logdir": "logs"}\n', "get_config returned a dict, not a ConfigDict"),
    ('import ml_collections\ndef get_config():\n    return ml_collections.ConfigDict({"num_epochs": 1})\n',
     "get_config returned a ConfigDict without the fields"),
])
def test_a_config_file_that_is_not_a_config_is_one_line_naming_it(tmp_path, source, says):
    import subprocess
    import sys

    from helpers import ROOT, subprocess_env

    config_file = tmp_path / "my_config.py"
    config_file.write_text(source)
    result = subprocess.run([sys.executable, "scripts/train.py", "--config", str(config_file)], cwd=ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert f"config file {str(config_file)!r}" in lines[0] and says in lines[0]
    assert "get_config() (or get_config(ARG) for FILE.py:ARG) returning an ml_collections.ConfigDict" in lines[0]
    assert not (tmp_path / "logs").exists()


# 6. a run directory says whether the run finished: finished.json, written last; a reward that calls os._exit(0)
# ends the process with exit code 0 (nothing in the process can stop that), and its run has no finished.json
def test_a_finished_run_says_so_and_a_run_ended_by_os_exit_does_not(tmp_path):
    import subprocess
    import sys
    import textwrap

    from ddpo_group.training.trainer import train
    from helpers import ROOT, cheap, make_config, subprocess_env

    run_dir = train(make_config(tmp_path, run_name="done", **cheap()))
    finished = json.loads((tmp_path / "done" / "finished.json").read_text())
    assert finished["epoch"] == 1 and finished["checkpoint"] == os.path.join(run_dir, "checkpoints", "checkpoint_1")

    plugin = tmp_path / "exits.py"
    plugin.write_text(textwrap.dedent('''
        import os
        from ddpo_group.rewards.registry import register_reward

        @register_reward("hard_exit")
        def hard_exit(images, prompts, metadata):
            os._exit(0)
    '''))
    result = subprocess.run(
        [sys.executable, "scripts/train.py", "--config", "config/grpo.py:test", f"--config.logdir={tmp_path}",
         "--config.run_name=exited", f"--config.plugins={plugin}", "--config.reward_fn=hard_exit",
         "--config.sample.num_steps=2", "--config.num_epochs=1"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0  # what os._exit(0) gives: the run directory is the record
    names = set(os.listdir(tmp_path / "exited"))
    assert "config.json" in names and not names & {"finished.json", "failed.json", "stopped.json"}


# 5. a hub that accepts connections and never answers: a bounded wait and one line saying what to set
def test_a_hub_that_never_answers_is_one_line_within_the_deadline(tmp_path, monkeypatch):
    import socket
    import threading

    from huggingface_hub import constants

    from ddpo_group.cli import one_line
    from ddpo_group.diffusion.policy import load_policy
    from ddpo_group.rewards.clip_models import load_clip_model

    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(16)  # the kernel completes the connections; nothing ever reads or answers them
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{black_hole.getsockname()[1]}")
    monkeypatch.setenv("HF_ENDPOINT", constants.ENDPOINT)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("DDPO_GROUP_HUB_TIMEOUT", "1")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    outcome = {}

    from ddpo_group.rewards.clip_models import load_tokenizer
    from ddpo_group.rewards.geneval.detectors import Mask2FormerDetector
    from ddpo_group.rewards.judge import TransformersJudge
    from ddpo_group.rewards.ocr import GotOcr2Recogniser

    def load():
        for what, call in (("model", lambda: load_policy("some-org/some-model")),
                           ("clip", lambda: load_clip_model("some-org/some-clip", "aesthetic")),
                           # every other reward model loaded by hub id
                           ("tokenizer", lambda: load_tokenizer("some-org/some-tok", "pickscore_rank")),
                           ("ocr", lambda: GotOcr2Recogniser("some-org/some-ocr", device="cpu").load()),
                           ("judge", lambda: TransformersJudge("some-org/some-vlm", device="cpu").load()),
                           ("geneval", lambda: Mask2FormerDetector("some-org/some-det", device="cpu").check_ready())):
            try:
                call()
            except Exception as err:  # what the run would print
                outcome[what] = one_line(err)

    worker = threading.Thread(target=load, daemon=True)  # a wait of minutes must not hold the test
    worker.start()
    worker.join(timeout=60)
    black_hole.close()
    assert not worker.is_alive(), "still waiting on the hub after 60 s"
    assert outcome["model"].startswith("config.pretrained.model='some-org/some-model': the model hub")
    assert "did not answer within 1 s" in outcome["model"] and "set HF_HUB_OFFLINE=1" in outcome["model"]
    assert outcome["clip"].startswith("reward_kwargs.aesthetic.clip_model='some-org/some-clip': the model hub")
    for what, line in (("tokenizer", "reward_kwargs.pickscore_rank.tokenizer='some-org/some-tok'"),
                       ("ocr", "reward_kwargs.ocr.model='some-org/some-ocr'"),
                       ("judge", "reward_kwargs.vlm_judge.model='some-org/some-vlm'"),
                       ("geneval", "reward_kwargs.geneval.detector_model='some-org/some-det'")):
        assert outcome[what].startswith(f"{line}: the model hub"), (what, outcome[what])


# Audit 2: a negative reward_timeout is refused by the config check, not blamed on a healthy reward later
def test_a_negative_reward_timeout_is_refused_naming_the_field(tmp_path):
    from ddpo_group.config.check import ConfigError, check_config
    from helpers import make_config

    with pytest.raises(ConfigError) as info:
        check_config(make_config(tmp_path, reward_timeout=-1.0))
    assert str(info.value).startswith("config.reward_timeout=-1.0 must be >= 0") and "\n" not in str(info.value)
    check_config(make_config(tmp_path, reward_timeout=0.0))  # 0: no limit


# Audit 2: a DDPO_GROUP_HUB_TIMEOUT that is not a positive number is one line naming it, not a silent 10 s
@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf"])
def test_a_bad_hub_timeout_is_one_line_naming_the_variable(monkeypatch, value):
    from ddpo_group.diffusion.hub import check_hub, hub_timeout

    monkeypatch.setenv("DDPO_GROUP_HUB_TIMEOUT", value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ValueError) as info:
        hub_timeout()
    message = str(info.value)
    assert message.startswith(f"DDPO_GROUP_HUB_TIMEOUT={value!r} must be a positive number") and "\n" not in message
    with pytest.raises(ValueError, match="DDPO_GROUP_HUB_TIMEOUT"):  # before anything is asked of the hub
        check_hub("some-org/some-model", "config.pretrained.model")
    monkeypatch.setenv("DDPO_GROUP_HUB_TIMEOUT", "2.5")
    assert hub_timeout() == 2.5
    monkeypatch.delenv("DDPO_GROUP_HUB_TIMEOUT")
    assert hub_timeout() == 10.0


# Audit 2: inspect when RUN/report.html is a directory: one line naming the path, the directory left alone
def test_inspect_onto_a_report_that_is_a_directory_is_one_line(tmp_path, capsys):
    from ddpo_group.cli import inspect_main

    run = _run_with_metrics(tmp_path, [{"epoch": 0, "reward_mean": 0.5}])
    (run / "report.html").mkdir()
    assert inspect_main([str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"ddpo-group-inspect: error: cannot write the report to {run / 'report.html'}: it is a "
                   "directory; remove it, or pass --output with the path of an .html file")
    assert (run / "report.html").is_dir() and not [p for p in run.iterdir() if p.name.endswith(".tmp")]
    assert inspect_main([str(run), "--output", str(run / "r.html")]) == 0
