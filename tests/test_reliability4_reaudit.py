"""Issue 43's last items and its re-audit: the report leaves out a folder or a decompression-bomb image where it
expects a file, scripts/pretrain_tiny.py refuses a resume that would change what its run recorded, and the cases of
the hostile re-audit (docs/reliability_audits.md, "Round 4 re-audit"), each as a test that failed before its fix."""

import json
import struct
import zlib

import numpy as np
import pytest

from ddpo_group.cli import inspect_main
from ddpo_group.runs.grids import save_epoch_samples


def editing_run(path):
    """A run directory as an editing run writes it: two metrics rows, samples of epoch 1 with their sources."""
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text('{"epoch": 0, "reward_mean": 0.5}\n{"epoch": 1, "reward_mean": 0.6}\n')
    (path / "config.json").write_text("{}")
    rng = np.random.default_rng(0)
    save_epoch_samples(path, 1, rng.random((4, 3, 8, 8)), ["p", "p", "q", "q"], [0.1, 0.2, 0.3, 0.4], np.zeros(4),
                       group_size=2, sources=rng.random((4, 3, 8, 8)))
    return path


def bomb_png(width=100_000, height=100_000):
    """A valid PNG header declaring width x height pixels (10^10 by default: past PIL's decompression-bomb limit),
    in a file of a few dozen bytes."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + chunk(b"IEND", b""))


SAMPLE_FILES = ["samples/epoch_0001.png", "samples/epoch_0001.json", "samples/epoch_0001/000.png",
                "samples/epoch_0001/000_source.png"]


# 1. a folder where the report expects a file (a sample grid, its records, a sample, an edit's source) is left out
# with a note naming it; the report is still written
@pytest.mark.parametrize("name", SAMPLE_FILES)
def test_a_folder_named_like_a_sample_file_is_left_out_with_a_note(tmp_path, capsys, name):
    run = editing_run(tmp_path / "run")
    (run / name).unlink()
    (run / name).mkdir()
    assert inspect_main([str(run)]) == 0, capsys.readouterr().err
    report = (run / "report.html").read_text()
    assert name.removeprefix("samples/") in report and "not a file" in report


# 2. a decompression bomb (a PNG whose header declares 10^10 pixels) where the report embeds an image: left out with
# a note naming the file, never embedded
@pytest.mark.parametrize("name", [n for n in SAMPLE_FILES if n.endswith(".png")])
def test_a_decompression_bomb_image_is_left_out_with_a_note(tmp_path, capsys, name):
    run = editing_run(tmp_path / "run")
    (run / name).write_bytes(bomb_png())
    assert inspect_main([str(run)]) == 0, capsys.readouterr().err
    report = (run / "report.html").read_text()
    assert name.removeprefix("samples/") in report and "DecompressionBomb" in report
    import base64

    assert base64.b64encode(bomb_png()).decode("ascii") not in report


def test_an_image_between_the_warning_and_the_error_limits_is_left_out_too(tmp_path, capsys):
    """PIL only warns (DecompressionBombWarning) from its limit up to twice it: the report leaves that out too."""
    from PIL import Image

    run = editing_run(tmp_path / "run")
    side = int((Image.MAX_IMAGE_PIXELS * 1.5) ** 0.5)
    (run / "samples/epoch_0001/000.png").write_bytes(bomb_png(side, side))
    assert inspect_main([str(run)]) == 0, capsys.readouterr().err
    report = (run / "report.html").read_text()
    assert "epoch_0001/000.png" in report and "DecompressionBomb" in report


# 3. scripts/pretrain_tiny.py: a resume goes on with the options its state was made with, or refuses in one line
# naming the option, the recorded value and the fix; numeric options are checked when parsed
SCENES_QUICK = ["--world", "scenes", "--arch", "sd3", "--quick", "--dataset-size", "8", "--eval-steps", "0"]


@pytest.fixture(scope="module")
def pretrain():
    from helpers import load_script

    return load_script("scripts/pretrain_tiny.py")


@pytest.fixture
def stopped_state(pretrain, tmp_path):
    """A scenes pretraining stopped at its denoiser's step 1: the state a resume starts from."""
    state = tmp_path / "state"
    args = SCENES_QUICK + ["--output-dir", str(tmp_path / "out"), "--state-dir", str(state)]
    assert "stopped" in pretrain.main(args + ["--stop-at-step", "1"])
    return args, state


@pytest.mark.parametrize("option,value,recorded", [("--seed", "1", "0"), ("--unet-lr", "0.002", "0.001"),
                                                   ("--unet-steps", "5", "3"), ("--arch", "sd", "sd3"),
                                                   ("--patch", "1", "2"), ("--object-scale", "coarse", "fine"),
                                                   ("--flow-times", "uniform", "logit-normal"),
                                                   ("--init", "adaln-zero", "default")])
def test_a_resume_with_another_option_than_its_state_refuses_in_one_line(pretrain, stopped_state, option, value,
                                                                        recorded):
    args, state = stopped_state
    before = (state / "state.pt").read_bytes()
    with pytest.raises(SystemExit) as stop:
        pretrain.main(args + [option, value])
    message = str(stop.value.code)
    assert "\n" not in message and option in message and recorded in message and value in message
    assert "--state-dir" in message  # the fix: the recorded value, or another state directory
    assert (state / "state.pt").read_bytes() == before  # nothing changed


def test_a_resume_with_its_own_options_goes_on(pretrain, stopped_state):
    args, state = stopped_state
    log = pretrain.main(args + ["--checkpoint-every", "7", "--eval-steps", "0"])  # options of the session only
    assert log["denoiser"]["steps"] == 3


def test_a_state_of_another_arch_without_a_record_is_one_line(pretrain, stopped_state):
    """A state directory from before the options were recorded: the arch is found out from its weights."""
    args, state = stopped_state
    (state / "options.json").unlink()
    with pytest.raises(SystemExit) as stop:
        pretrain.main([a if a != "sd3" else "sd" for a in args])
    message = str(stop.value.code)
    assert "\n" not in message and "--arch" in message and str(state) in message


@pytest.mark.parametrize("option,value", [("--unet-lr", "nan"), ("--unet-lr", "0"), ("--vae-lr", "inf"),
                                          ("--vae-lr", "-1"), ("--kl-weight", "nan"), ("--ema-decay", "1.5"),
                                          ("--cond-dropout", "nan"), ("--guidance-scale", "inf"), ("--eta", "nan"),
                                          ("--max-minutes", "nan"), ("--checkpoint-every", "0"),
                                          ("--unet-steps", "0"), ("--warmup-steps", "-1"), ("--vae-crop", "0"),
                                          ("--eval-images-per-prompt", "0"), ("--dataset-size", "0")])
def test_a_bad_numeric_option_is_one_line_when_parsed(pretrain, capsys, option, value):
    with pytest.raises(SystemExit) as stop:
        pretrain.parse_args([option, value])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert option in error and value in error


def test_quick_keeps_the_options_given_with_it(pretrain):
    """--quick set its step counts over options given with it (--eval-steps 0 still evaluated, --dataset-size 16
    rendered 64 scenes)."""
    args = pretrain.parse_args(["--quick", "--eval-steps", "0", "--dataset-size", "16"])
    assert (args.eval_steps, args.dataset_size, args.unet_steps) == (0, 16, 3)
    args = pretrain.parse_args(["--world", "scenes", "--quick", "--unet-steps", "5"])
    assert (args.unet_steps, args.vae_steps, args.dataset_size) == (5, 3, 64)


# Re-audit case: a samples file that cannot be read (not JSON, or records without a reward) stopped the whole report
# (exit 2, nothing written), where an unreadable evaluation.json or protocol file is left out with a note
@pytest.mark.parametrize("content", ["{", json.dumps({"records": [{"prompt": "p"}]}), "[1, 2]"])
@pytest.mark.parametrize("name", ["samples/epoch_0001.json", "samples/eval_0001.json"])
def test_an_unreadable_samples_file_is_left_out_with_a_note(tmp_path, capsys, name, content):
    run = editing_run(tmp_path / "run")
    (run / name).write_text(content)
    assert inspect_main([str(run)]) == 0, capsys.readouterr().err
    report = (run / "report.html").read_text()
    assert "left out" in report and name.removeprefix("samples/") in report


# Re-audit case: config.seed=-1 ended in numpy's "Seed must be between 0 and 2**32 - 1", naming no field
@pytest.mark.parametrize("field", ["seed", "eval_seed"])
@pytest.mark.parametrize("value", [-1, 2**40])
def test_a_seed_out_of_range_is_named_by_its_field(tmp_path, field, value):
    from helpers import make_config

    from ddpo_group.config.check import ConfigError, check_config

    with pytest.raises(ConfigError, match=rf"config\.{field}={value} must be .*2\*\*31 - 1"):
        check_config(make_config(tmp_path, **{field: value}))
    check_config(make_config(tmp_path, **{field: 2**31 - 1}))


# Re-audit cases: pretrain_tiny.py with --state-dir or --output-dir naming a file (a FileExistsError traceback, the
# output's only after the whole pretraining) or a missing --vae-from (diffusers' traceback about the internet)
@pytest.mark.parametrize("option", ["--state-dir", "--output-dir", "--vae-from"])
def test_a_pretrain_path_that_cannot_serve_is_one_line_when_parsed(pretrain, tmp_path, capsys, option):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    path = str(tmp_path / "missing") if option == "--vae-from" else str(a_file)
    with pytest.raises(SystemExit) as stop:
        pretrain.parse_args(["--world", "scenes", option, path])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert option in error and path in error


# Re-audit case: evaluate.py --seed -1 ended in "ValueError: expected non-negative integer", naming no option
@pytest.mark.parametrize("value", ["-1", str(2**40)])
def test_evaluate_refuses_a_seed_out_of_range_when_parsed(capsys, value):
    from helpers import load_script

    with pytest.raises(SystemExit) as stop:
        load_script("scripts/evaluate.py").main(["--seed", value])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--seed" in error and value in error and "2**31 - 1" in error
