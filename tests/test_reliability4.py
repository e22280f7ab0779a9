"""Issue 43, the fourth fault audit (the report and the run directory): each bad outcome it found, as a test that
failed before its fix, numbered as in the issue."""

import base64
import json
import os
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest

from ddpo_group.cli import inspect_main
from ddpo_group.runs.grids import save_epoch_samples
from ddpo_group.report.page import write_report


def write_run(path, rows, config=None):
    """A run directory as the trainer writes it: metrics.jsonl (and config.json)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def data_uri(data, kind="png"):
    return f"data:image/{kind};base64," + base64.b64encode(data).decode("ascii")


# 1. the report reads only files inside the run directory (links resolved); whatever a run names outside it is
# left out with a note, never embedded
def _secret(path, source):
    """A file outside the run: a real image (so that a reader would embed it) with a marker appended."""
    path.write_bytes(source.read_bytes() + b"SECRET-MARKER")
    return path


def _assert_not_leaked(report, *secrets):
    assert "SECRET-MARKER" not in report
    for secret in secrets:
        for kind in ("png", "webp"):
            assert data_uri(secret.read_bytes(), kind) not in report


def test_the_report_never_embeds_a_file_an_editing_run_names_outside_it(tmp_path):
    run = write_run(tmp_path / "run", [{"epoch": 0, "reward_mean": 0.5}])
    rng = np.random.default_rng(0)
    save_epoch_samples(run, 0, rng.random((4, 3, 8, 8)), ["p", "p", "q", "q"], [0.1, 0.2, 0.3, 0.4], np.zeros(4),
                       group_size=2, sources=rng.random((4, 3, 8, 8)))
    samples = run / "samples"
    secret = _secret(tmp_path / "secret.png", samples / "epoch_0000" / "000.png")
    (samples / "inner.png").symlink_to(secret)  # a link inside the run that leads out of it
    document = json.loads((samples / "epoch_0000.json").read_text())
    names = ["../../secret.png", str(secret), "inner.png", "epoch_0000/000.png"]
    for record, name in zip(document["records"], names):
        record["source_image"], record["image"] = name, names[(names.index(name) + 1) % 4]
    (samples / "epoch_0000.json").write_text(json.dumps(document))
    report = write_report(run).read_text()
    _assert_not_leaked(report, secret)
    assert data_uri((samples / "epoch_0000" / "000.png").read_bytes()) in report  # the run's own image is shown
    for name in names[:3]:
        assert f"not shown: {name} is outside the run directory" in report


def test_the_report_never_embeds_a_video_grid_named_outside_the_run(tmp_path):
    from ddpo_group.runs.grids import save_animation
    from PIL import Image

    run = write_run(tmp_path / "run", [{"epoch": 0, "reward_mean": 0.5}])
    samples = run / "samples"
    samples.mkdir()
    save_animation([Image.new("RGB", (8, 8), (9, 9, 9))] * 2, tmp_path / "clip.webp")
    secret = _secret(tmp_path / "secret.webp", tmp_path / "clip.webp")
    for epoch, grid in enumerate([str(secret), "../../secret.webp"]):
        (samples / f"epoch_{epoch:04d}.json").write_text(json.dumps(
            {"epoch": epoch, "group_size": 1, "grid": grid, "video": True, "records": []}))
    report = write_report(run).read_text()
    _assert_not_leaked(report, secret)
    assert f"not shown: {secret} is outside the run directory" in report
    assert "not shown: ../../secret.webp is outside the run directory" in report


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl", "failed.json", "stopped.json", "resumes.jsonl"])
def test_the_report_never_reads_a_run_file_that_links_out_of_the_run(tmp_path, name):
    run = write_run(tmp_path / "run", [{"epoch": 0, "reward_mean": 0.5}], {"num_epochs": 1})
    (run / "failed.json").write_text(json.dumps({"epoch": 0, "error": "own failure"}))
    secret = tmp_path / "secret.json"
    line = json.dumps({"epoch": 0, "error": "SECRET-MARKER", "reward_mean": 0.125, "SECRET-MARKER": 1})
    secret.write_text(line + "\n" if name.endswith(".jsonl") else line)
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(secret)
    report = write_report(run).read_text()
    assert "SECRET-MARKER" not in report and "0.125" not in report
    assert "links to files outside the run directory" in report and name in report


# 2. resuming a finished run with nothing to do (a requeued job, the printed resume command) changes nothing
def test_resuming_a_finished_run_with_nothing_to_do_changes_nothing(tmp_path):
    import subprocess
    import sys

    from ddpo_group.report.run import read_metrics
    from ddpo_group.training.trainer import train
    from helpers import ROOT, cheap, make_config, subprocess_env

    run_dir = train(make_config(tmp_path, **cheap(eval_freq=1, eval_images_per_prompt=1)))
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert [row.get("eval_only", False) for row in rows] == [False, True]  # the final evaluation's row is there
    files = sorted(p for p in Path(run_dir).rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    assert Path(run_dir, "finished.json") in before
    train(make_config(tmp_path, resume_from=run_dir, **cheap(eval_freq=1, eval_images_per_prompt=1)))
    result = subprocess.run([sys.executable, "scripts/train.py", f"--config.resume_from={run_dir}"], cwd=ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "nothing to do" in result.stderr + result.stdout
    assert sorted(p for p in Path(run_dir).rglob("*") if p.is_file()) == files
    assert {p: p.read_bytes() for p in files} == before


# 3. overwrite removes only what a run wrote: the user's files inside samples/ and checkpoints/ are kept and named,
# and a mark copied into a user's folder proves nothing (the mark records the config.json its run wrote)
def _started_run(tmp_path):
    from ddpo_group.runs.run_dir import RunDir
    from helpers import make_config

    run_dir, config = RunDir.resolve(make_config(tmp_path))
    run_dir.start(config, first_epoch=0)
    return run_dir


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def test_overwrite_keeps_and_names_the_files_a_user_put_inside_samples_and_checkpoints(tmp_path, caplog):
    from ddpo_group.runs.run_dir import RunDir, write_json_atomic
    from helpers import make_config

    run_dir = _started_run(tmp_path)
    run = Path(run_dir.path)
    run_dir.append_metrics({"epoch": 0})
    rng = np.random.default_rng(0)
    for prefix in ("epoch", "eval"):
        save_epoch_samples(run, 0, rng.random((2, 3, 8, 8)), ["p", "p"], [0.1, 0.2], np.zeros(2), group_size=2,
                           prefix=prefix)
    (run / "checkpoints" / "checkpoint_1").mkdir(parents=True)
    (run / "checkpoints" / "checkpoint_1" / "trainer_state.json").write_text("{}")
    (run / "debug").mkdir()
    write_json_atomic(str(run / "debug" / "epoch_0000_rank0.json"), {"rank": 0})
    mine = {"samples/cat.jpg": b"my photo", "samples/epoch_0000/my_note.txt": b"mine too",
            "checkpoints/best_by_hand/weights.bin": b"my weights", "checkpoints/README.txt": b"read me",
            "debug/notes.md": b"my notes", "notes.txt": b"mine"}
    for name, data in mine.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    run_dir.release()
    again, config = RunDir.resolve(make_config(tmp_path, overwrite=True))
    with caplog.at_level("WARNING", logger="ddpo_group"):
        again.start(config, first_epoch=0)
    again.release()
    left = _files(run)
    assert {name: left[name] for name in mine} == mine
    assert sorted(set(left) - set(mine)) == [".ddpo_group_run", "config.json"]  # the new run's, nothing of the old
    assert sorted(os.listdir(run / "samples" / "epoch_0000")) == ["my_note.txt"]
    notes = [r.getMessage() for r in caplog.records if "kept" in r.getMessage()]
    assert len(notes) == 1 and "\n" not in notes[0]
    for name in ("samples/cat.jpg", "samples/epoch_0000/my_note.txt", "checkpoints/best_by_hand",
                 "checkpoints/README.txt", "debug/notes.md", "notes.txt"):  # a folder of the user's by its name
        assert name in notes[0]


def test_overwrite_never_leaves_a_link_where_the_new_run_writes(tmp_path):
    """The re-audit's case: samples/epoch_0000 a link out of the run was kept as "not written by a run", and the new
    run wrote its images through it, outside the run directory. The link goes; what it points to stays untouched."""
    from ddpo_group.runs.run_dir import RunDir
    from helpers import make_config

    run_dir = _started_run(tmp_path)
    run = Path(run_dir.path)
    run_dir.append_metrics({"epoch": 0})
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "000.png").write_bytes(b"not the run's")
    (run / "samples").mkdir(exist_ok=True)
    os.symlink(outside, run / "samples" / "epoch_0000")
    os.symlink(outside / "000.png", run / "samples" / "epoch_0001.png")
    run_dir.release()
    again, config = RunDir.resolve(make_config(tmp_path, overwrite=True))
    again.start(config, first_epoch=0)
    again.release()
    assert not os.path.lexists(run / "samples" / "epoch_0000") and not os.path.lexists(run / "samples" / "epoch_0001.png")
    assert sorted(os.listdir(outside)) == ["000.png"] and (outside / "000.png").read_bytes() == b"not the run's"


@pytest.mark.parametrize("mark", ["copied", "older version"])
def test_overwrite_refuses_a_folder_whose_mark_did_not_write_its_config(tmp_path, mark):
    from ddpo_group.config.check import ConfigError
    from ddpo_group.runs.run_dir import RUN_MARK, RunDir
    from helpers import make_config

    source = _started_run(tmp_path / "elsewhere")
    source.release()
    folder = tmp_path / "logs" / "mine"
    (folder / "samples").mkdir(parents=True)
    (folder / "samples" / "epoch_0000.png").write_bytes(b"my picture")
    (folder / "config.json").write_text('{"my": "settings"}')
    if mark == "copied":
        shutil.copy(os.path.join(source.path, RUN_MARK), folder / RUN_MARK)
    else:  # the mark an older version wrote: it records no config.json
        (folder / RUN_MARK).write_text('{"created_by": "ddpo_group", "time": "2025-01-01T00:00:00"}')
    before = _files(folder)
    for resolve in (True, False):  # RunDir.start refuses too, whatever resolved it
        with pytest.raises(ConfigError) as info:
            config = make_config(tmp_path / "logs", run_name="mine", overwrite=True)
            if resolve:
                RunDir.resolve(config)
            else:
                RunDir(str(folder)).start(config, first_epoch=0)
        message = str(info.value)
        assert message.startswith("config.overwrite=True refuses to delete") and str(folder) in message
        assert RUN_MARK in message and "config.json" in message and "\n" not in message
    assert _files(folder) == before and sorted(os.listdir(folder)) == [RUN_MARK, "config.json", "samples"]


def test_a_copied_mark_does_not_make_a_users_folder_a_run(tmp_path):
    from ddpo_group.config.check import ConfigError
    from ddpo_group.runs.run_dir import RUN_MARK, RunDir
    from helpers import make_config

    source = _started_run(tmp_path / "elsewhere")
    source.release()
    folder = tmp_path / "logs" / "mine"
    (folder / "samples").mkdir(parents=True)
    (folder / "samples" / "epoch_0000.png").write_bytes(b"my picture")
    shutil.copy(os.path.join(source.path, RUN_MARK), folder / RUN_MARK)
    before = _files(folder)
    with pytest.raises(ConfigError, match="is not empty") as info:
        RunDir.resolve(make_config(tmp_path / "logs", run_name="mine"))
    assert "samples" in str(info.value) and "\n" not in str(info.value)
    assert _files(folder) == before


# 12. a malformed protocol_NAME.json leaves its protocol out with a note naming the file; the report goes on
@pytest.mark.parametrize("name,document", [
    ("geneval", '{"tags": [1, 2], "overall": 0.5}'), ("geneval", '{"tags": {"colors": 3}}'),
    ("geneval", '{"tags": {"colors": {"score": "high"}}}'), ("geneval", '{"overall": 1' + '0' * 400 + '}'),
    ("ocr", '{"mean": 1e400}'), ("ocr", '{"mean": 0.5, "std": 1' + '0' * 400 + '}'), ("ocr", '[1, 2]'),
    ("ocr", '"text"'), ("ocr", '{"mean": 0.5'), ("geneval", ''),
])
def test_a_malformed_protocol_file_is_left_out_with_a_note(tmp_path, name, document):
    run = write_run(tmp_path / "run", [{"epoch": 0, "reward_mean": 0.5}])
    good, bad = run / "checkpoints" / "checkpoint_1", run / "checkpoints" / "checkpoint_2"
    good.mkdir(parents=True)
    bad.mkdir()
    (good / "protocol_geneval.json").write_text(json.dumps({"overall": 0.625, "tags": {"colors": {"score": 0.75}}}))
    (good / "protocol_ocr.json").write_text(json.dumps({"mean": 0.25, "std": 0.125, "num_images": 8}))
    (bad / f"protocol_{name}.json").write_text(document)
    report = write_report(run).read_text()
    assert "<td>0.625</td>" in report and "<td>0.750</td>" in report and "<td>0.250</td>" in report
    assert f"left out: {os.path.join('checkpoints', 'checkpoint_2', f'protocol_{name}.json')}" in report
    assert "<tr><td>2</td>" not in report  # nothing of the malformed file is shown


def test_a_malformed_evaluation_json_is_left_out_with_a_note(tmp_path):
    run = write_run(tmp_path / "run", [{"epoch": 0, "reward_mean": 0.5}])
    for name, text in (("checkpoint_1", json.dumps({"mean": 0.375, "num_prompts": 2, "images_per_prompt": 4})),
                       ("checkpoint_2", '{"mean": 0.5'), ("checkpoint_3", "[1, 2]"),
                       ("checkpoint_best", json.dumps({"mean": 0.25}))):
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / "evaluation.json").write_text(text)
    report = write_report(run).read_text()
    assert "<td>checkpoint_1</td><td>0.375</td>" in report and "0.25" not in report
    for name in ("checkpoint_2", "checkpoint_3"):
        assert f"left out: {os.path.join('checkpoints', name, 'evaluation.json')}" in report


# 14. the commands printed at the end of a run paste into a shell whole, a logdir with spaces and quotes included
def test_the_printed_commands_keep_a_path_with_spaces_whole(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddpo_group.runs.metrics_log import MetricsLog
    from ddpo_group.runs.run_dir import STOPPED_FILE, RunDir
    from helpers import make_config

    logdir = tmp_path / "my runs" / "it's here"
    path = str(logdir / "r")
    config = make_config(logdir, log_images_every=0, num_epochs=3)
    AcceleratorState._reset_state()
    run_dir = RunDir(path)
    lines = MetricsLog(config, Accelerator(cpu=True), run_dir).summary(3, 1.0, os.path.join(path, "checkpoints"))
    commands = {line.split(":", 1)[0]: shlex.split(line.split(":", 1)[1], comments=True) for line in lines
                if line.startswith(("report:", "compare:", "resume:"))}
    assert commands["report"][-1] == path
    assert commands["compare"][-5:] == [path, "--compare", "OTHER_RUN_DIR", "--names", "A,B"]
    assert commands["resume"] == [f"--config.resume_from={path}", "--config.num_epochs=N"]
    os.makedirs(path)
    run_dir.mark_stopped(2, 15)
    with open(os.path.join(path, STOPPED_FILE)) as f:
        assert shlex.split(json.load(f)["resume"]) == [f"--config.resume_from={path}"]


# R. a run whose name, labels or prompts hold $...$ gets its report (matplotlib would read them as mathtext, and
# text such as "$_$" or "$\\foo$" is no mathtext it can parse)
def test_a_run_named_with_dollar_signs_gets_its_report(tmp_path, capsys):
    rows = [{"epoch": e, "reward_mean": 0.1 * e, "reward_std": 0.1, "reward/a$_$b": 0.2, "eval/reward_mean": 0.3 + e,
             "eval/gold/g$\\foo$_mean": 0.5 - 0.1 * e, "reward_info/r$^$/p$q$": 0.1, "time/sample": 1.0,
             "steps/approx_kl": [0.1 * e, 0.2]} for e in range(3)]
    run = write_run(tmp_path / "a$b$c", rows, {"num_epochs": 3, "reward_fn": "$f$"})
    other = write_run(tmp_path / "x$^$y", rows, {"num_epochs": 3, "variant": "v$_$w"})
    prompts = ["$x^2$ a red circle", "a $_$ square"]
    save_epoch_samples(run, 2, np.random.default_rng(0).random((4, 3, 8, 8)), [p for p in prompts for _ in range(2)],
                       [0.1, 0.2, 0.3, 0.4], np.zeros(4), group_size=2)
    assert inspect_main([str(run)]) == 0, capsys.readouterr().err
    report = (run / "report.html").read_text()
    assert "a$b$c" in report and "$x^2$ a red circle" in report and "g$\\foo$" in report
    assert inspect_main([str(run), "--compare", str(other)]) == 0, capsys.readouterr().err
    assert "v$_$w" in (run / "report_vs_x$^$y.html").read_text()


@pytest.mark.parametrize("name", ["samples/epoch_0001.png", "samples/epoch_0001.json",
                                  "checkpoints/checkpoint_1/evaluation.json",
                                  "checkpoints/checkpoint_1/protocol_geneval.json"])
def test_the_report_never_blocks_on_a_fifo_inside_the_run(tmp_path, name):
    """The re-audit's cases 2, 3: a named pipe where the report reads a file made it wait forever."""
    import subprocess
    import sys

    from ddpo_group.report.run import inside_run

    run = tmp_path / "run"
    (run / Path(name).parent).mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"epoch": 0, "reward_mean": 0.5}\n')
    (run / "config.json").write_text("{}")
    os.mkfifo(run / name)
    assert not inside_run(run / name, run)
    code = f"from ddpo_group.report.inspect import write_report; write_report({str(run)!r})"
    done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "report.html").is_file()
