"""Issue 54's cases on the command line (ddpo_group/cli/): the package's shipped files are read-only to every command,
every pretrain option is honoured or refused, every output path is checked before the work that writes to it, a
damaged state file is one line naming it and the fix, and a newcomer's first hour (a fast --help, the command named
as typed, unambiguous help)."""

import json
import os
import subprocess
import sys

import pytest
from helpers import PYTHON, ROOT, load_script, subprocess_env

from ddpo_group.cli import main

PACKAGE = os.path.join(ROOT, "ddpo_group")
ASSETS = os.path.join(PACKAGE, "assets")


@pytest.fixture(scope="module")
def pretrain():
    return load_script("scripts/pretrain_tiny.py")


def _inside(path):
    package = os.path.realpath(PACKAGE)
    return os.path.commonpath([package, os.path.realpath(path)]) == package


# 1. shipped assets are read-only: pretrain's default output is a new folder under runs/, never the package's


@pytest.mark.parametrize("flags", [["--quick"], [], ["--world", "scenes", "--quick"], ["--world", "scenes"],
                                   ["--world", "scenes", "--arch", "sd3", "--quick"]])
def test_pretrain_without_output_dir_writes_a_new_folder_under_runs(pretrain, tmp_path, monkeypatch, flags):
    # --quick wrote its 3-step model over ddpo_group/assets/tiny_shapes (rc 0)
    monkeypatch.chdir(tmp_path)
    args = pretrain.parse_args(flags)
    assert os.path.dirname(args.output_dir) == str(tmp_path / "runs")
    assert not os.path.exists(args.output_dir) and not _inside(args.output_dir)


def test_two_default_outputs_in_the_same_second_are_two_folders(pretrain, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = pretrain.parse_args(["--quick"]).output_dir
    os.makedirs(first)
    assert pretrain.parse_args(["--quick"]).output_dir != first


def test_replace_shipped_is_the_one_way_to_the_shipped_folder(pretrain, capsys):
    assert pretrain.parse_args(["--replace-shipped"]).output_dir == os.path.join(ASSETS, "tiny_shapes")
    assert (pretrain.parse_args(["--world", "scenes", "--arch", "sd3", "--replace-shipped"]).output_dir
            == os.path.join(ASSETS, "tiny_scenes_sd3"))
    with pytest.raises(SystemExit):
        pretrain.parse_args(["--replace-shipped", "--quick"])  # a smoke run's weights over the shipped model
    assert "--replace-shipped" in capsys.readouterr().err and "--quick" in capsys.readouterr().err + "--quick"


def _package_paths(tmp_path):
    """Paths that resolve inside the package: absolute, through '..', through a symlink."""
    link = tmp_path / "link"
    link.symlink_to(ASSETS)
    dotted = os.path.join(str(tmp_path), os.path.relpath(os.path.join(ASSETS, "tiny_shapes"), str(tmp_path)))
    return {"absolute": os.path.join(ASSETS, "tiny_shapes"), "dotdot": dotted, "symlink": str(link / "tiny_shapes")}


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink"])
@pytest.mark.parametrize("option", ["--output-dir", "--state-dir", "--samples-path"])
def test_a_pretrain_path_inside_the_package_is_refused_in_one_line(pretrain, tmp_path, capsys, kind, option):
    path = _package_paths(tmp_path)[kind] + (".png" if option == "--samples-path" else "")
    with pytest.raises(SystemExit) as stop:
        pretrain.parse_args(["--world", "scenes", option, path])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and "inside the package" in lines[0], lines


def _train(*args):
    """`ddpo-group train ARGS` in a fresh interpreter (absl's flags are defined once a process); its stderr."""
    result = subprocess.run([PYTHON, "-m", "ddpo_group.cli", "train", *args], cwd=ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stdout[-1000:]
    return result.stderr.strip()


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink"])
def test_a_path_resolving_inside_the_package_is_named_with_its_option(tmp_path, kind):
    from ddpo_group.cli.common import inside_package

    path = _package_paths(tmp_path)[kind]
    assert inside_package(path, "--output-dir").startswith(f"--output-dir {path}: resolves to ")
    assert inside_package(str(tmp_path / "elsewhere"), "--output-dir") is None
    assert inside_package(PACKAGE + "_not_it", "--output-dir") is None  # a sibling whose name begins the same


def test_a_training_logdir_inside_the_package_is_refused_in_one_line(tmp_path):
    before = sorted(os.listdir(ASSETS))
    message = _train("--config", "test", f"--config.logdir={_package_paths(tmp_path)['symlink']}",
                     "--config.run_name=r")
    assert message.startswith("ddpo-group train: error: --config.logdir") and "inside the package" in message
    assert "\n" not in message and sorted(os.listdir(ASSETS)) == before


@pytest.mark.parametrize("flags", [["--output", os.path.join(ASSETS, "evaluation.json")],
                                   ["--protocol", "geneval", "--output", os.path.join(ASSETS, "geneval.json")],
                                   ["--protocol", "geneval", "--save-images", os.path.join(ASSETS, "images")]])
def test_an_evaluation_output_inside_the_package_is_refused_in_one_line(flags):
    with pytest.raises(SystemExit) as stop:
        main(["evaluate", *flags])
    message = str(stop.value.code)
    assert message.startswith("ddpo-group evaluate: error: --") and "inside the package" in message
    assert flags[-2] in message and "\n" not in message


# 6. a variant given as a positional argument: read as the variant, or refused; never the default trained


def test_a_leading_variant_is_read_as_the_config():
    from ddpo_group.cli import train as train_cli

    assert train_cli._leading_variant(["ddpo-group train", "tiny_scenes", "--config.num_epochs=1"]) == (
        ["ddpo-group train", "--config", "tiny_scenes", "--config.num_epochs=1"], None)


@pytest.mark.parametrize("argv,expected", [(["tiny_scnes"], "did you mean 'tiny_scenes'?"),
                                           (["tiny", "--config", "test"], "both name a config"),
                                           (["--config", "test", "tiny_scenes"], "unexpected argument 'tiny_scenes'"),
                                           (["--config", "test", "--config.use_lora", "False"],
                                            "unexpected argument 'False'")])
def test_a_stray_or_doubled_positional_argument_is_refused_in_one_line(argv, expected):
    # `ddpo-group train tiny_scenes` trained the default tiny (rc 0): absl leaves positional arguments unparsed
    message = _train(*argv)
    assert message.startswith("ddpo-group train: error: ") and expected in message and "\n" not in message


# 7. every pretrain option is honoured or refused, never replaced silently


@pytest.mark.parametrize("flags,name,value", [(["--world", "scenes", "--batch-size", "64"], "batch_size", 64),
                                              (["--world", "scenes", "--unet-steps", "3000"], "unet_steps", 3000),
                                              (["--world", "scenes", "--arch", "sd3", "--guidance-scale", "5"],
                                               "guidance_scale", 5.0),
                                              (["--quick", "--eval-steps", "50"], "eval_steps", 50),
                                              (["--quick", "--batch-size=64"], "batch_size", 64),
                                              (["--world", "scenes", "--batch", "64"], "batch_size", 64)])
def test_an_option_given_at_the_shapes_default_is_honoured(pretrain, flags, name, value):
    # the scenes world's (32) or --quick's (8) value replaced a --batch-size 64 given, as 64 is the shapes default
    assert getattr(pretrain.parse_args(flags), name) == value


@pytest.mark.parametrize("option,value", [("--stop-at-step", "2"), ("--max-minutes", "1"), ("--state-dir", "s"),
                                          ("--checkpoint-every", "5"), ("--vae-crop", "16"), ("--stop-at-step", "0")])
def test_a_scenes_only_option_on_the_shapes_world_is_refused_in_one_line(pretrain, capsys, option, value):
    # the shapes world ignored them and ran to its end
    with pytest.raises(SystemExit) as stop:
        pretrain.parse_args([option, value])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and "--world scenes" in lines[0], lines


# 9. every output path is checked before the work that writes to it; the log survives a late failure


@pytest.mark.parametrize("kind", ["missing folder", "a directory", "no evaluation"])
def test_a_samples_path_that_cannot_be_written_is_refused_when_parsed(pretrain, tmp_path, capsys, kind):
    # a missing folder failed after the whole pretraining, with a traceback, and no pretrain_log.json
    path = {"missing folder": str(tmp_path / "missing" / "x.png"), "a directory": str(tmp_path),
            "no evaluation": str(tmp_path / "x.png")}[kind]
    extra = ["--eval-steps", "0"] if kind == "no evaluation" else []
    with pytest.raises(SystemExit) as stop:
        pretrain.parse_args(["--samples-path", path, *extra])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--samples-path" in lines[0], lines


def test_pretrain_log_is_written_when_the_evaluation_fails(pretrain, tmp_path, monkeypatch):
    def failing_evaluation(pipeline, args):
        raise OSError("disk full")

    monkeypatch.setattr(pretrain.pretrain, "evaluate", failing_evaluation)
    output = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        main(["pretrain", "--quick", "--dataset-size", "8", "--output-dir", str(output)])
    assert str(stop.value.code) == ("ddpo-group pretrain: error: OSError: disk full (DDPO_GROUP_DEBUG=1 shows the "
                                    "traceback)")
    log = json.loads((output / "pretrain_log.json").read_text())
    assert log["unet"]["steps"] == 3 and log["evaluation"] == {"error": "OSError: disk full (DDPO_GROUP_DEBUG=1 shows "
                                                                        "the traceback)"}


# 10. a cut or damaged state file on resume: one line naming the file and the fix

SCENES_QUICK = ["--world", "scenes", "--arch", "sd3", "--quick", "--dataset-size", "8", "--eval-steps", "0"]


@pytest.fixture
def stopped_state(pretrain, tmp_path):
    """A scenes pretraining stopped at its denoiser's step 1: its state.pt, data.npz, latents.pt, options.json."""
    state = tmp_path / "state"
    args = SCENES_QUICK + ["--output-dir", str(tmp_path / "out"), "--state-dir", str(state)]
    assert "stopped" in pretrain.main(args + ["--stop-at-step", "1"])
    return args, state


@pytest.mark.parametrize("name", ["state.pt", "data.npz", "latents.pt", "options.json"])
def test_a_cut_state_file_is_one_line_naming_it_and_the_fix(stopped_state, name):
    # a cut state.pt ended in a torch traceback
    args, state = stopped_state
    path = state / name
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2])
    with pytest.raises(SystemExit) as stop:
        main(["pretrain", *args])
    message = str(stop.value.code)
    assert message.startswith("ddpo-group pretrain: error: ") and "\n" not in message, message
    assert str(path if name != "options.json" else state) in message and name in message
    assert "--state-dir" in message  # the fix: remove the file or start afresh elsewhere


def test_a_state_file_of_another_kind_is_one_line(stopped_state):
    import torch

    args, state = stopped_state
    torch.save([1, 2, 3], state / "state.pt")  # loads, but is no state
    with pytest.raises(SystemExit) as stop:
        main(["pretrain", *args])
    assert "state.pt is cut or damaged" in str(stop.value.code)


def test_removing_a_cut_data_file_renders_it_again_and_goes_on(pretrain, stopped_state):
    args, state = stopped_state
    (state / "data.npz").write_bytes(b"cut")
    (state / "data.npz").unlink()  # the fix the message gives
    assert pretrain.main(args)["denoiser"]["steps"] == 3


# the newcomer's first hour


@pytest.mark.parametrize("name", ["pretrain", "train", "evaluate", "inspect"])
def test_a_subcommands_help_imports_no_torch(name):
    # `ddpo-group pretrain --help` took 26 s (torch, diffusers and the rewards imported for the help text)
    code = (f"import sys\nfrom ddpo_group.cli import main\ntry:\n    main([{name!r}, '--help'])\nexcept SystemExit:\n"
            "    pass\nassert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([PYTHON, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-500:]


def test_pretrain_help_says_where_the_output_goes(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: a new folder runs/pretrain_WORLD" in text and "--replace-shipped" in text


def test_a_pretrain_error_names_the_command_as_typed(stopped_state):
    # errors said pretrain_tiny.py when run as `ddpo-group pretrain`
    args, state = stopped_state
    with pytest.raises(SystemExit) as stop:
        main(["pretrain", *args, "--seed", "5"])
    assert str(stop.value.code).startswith("ddpo-group pretrain: error: --seed")


def test_train_help_lists_a_the_same_variant_after_the_one_it_means(capsys):
    # tiny_squares ("the same on all 36 square prompts") was listed under tiny_all, not tiny
    from ddpo_group.config import grpo

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()
              if line.startswith("  ") and line.split()[0] in grpo.VARIANTS]
    documented = [line.split()[0] for line in grpo.__doc__.splitlines() if line.strip().split(" ")[0] in grpo.VARIANTS]
    assert listed[: len(documented)] == documented and sorted(listed) == sorted(grpo.VARIANTS)
    assert listed[listed.index("tiny_squares") - 1] == "tiny"


def test_serve_help_shows_the_reward_first_not_a_required_flag(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: ddpo-group serve REWARD [-h]") and "--serve REWARD_NAME [" not in out.split("\n\n")[0]


def test_evaluating_the_scenes_set_without_the_shapes_detector_hints_at_it():
    with pytest.raises(SystemExit) as stop:
        main(["evaluate", "--protocol", "geneval", "--model", "tiny-scenes-sd3", "--prompts", "geneval_scenes.jsonl"])
    message = str(stop.value.code)
    assert "is not one the detector finds" in message and "--protocol-option detector=shapes" in message


def test_the_end_of_run_summary_gives_genevals_overall_beside_the_partial_score(tmp_path):
    # the tiny_scenes summary printed only eval/reward_mean, the geneval reward's partial score, where the docs report
    # the held-out overall (eval/geneval/overall)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from helpers import make_config

    from ddpo_group.runs.metrics_log import MetricsLog
    from ddpo_group.runs.run_dir import RunDir

    AcceleratorState._reset_state()
    log = MetricsLog(make_config(tmp_path, log_images_every=0, num_epochs=2), Accelerator(cpu=True),
                     RunDir(str(tmp_path)))
    for epoch, partial, overall in [(0, 0.30, 0.10), (1, 0.40, 0.125)]:
        log.write({"epoch": epoch, "eval/reward_mean": partial, "eval/geneval/overall": overall})
    lines = log.summary(2, 10.0, None)
    assert lines[1] == ("eval reward (the reward's mean: GenEval's partial score): 0.3000 (epoch 0) -> 0.4000 "
                        "(epoch 1); best 0.4000 (epoch 1)")
    assert lines[2] == ("eval geneval overall (GenEval's score of the held-out prompts, eval/geneval/overall): "
                        "0.1000 (epoch 0) -> 0.1250 (epoch 1); best 0.1250 (epoch 1)")


@pytest.mark.parametrize("option", ["--output", "--steps-png"])
def test_an_inspect_output_inside_the_package_is_refused_in_one_line(tmp_path, capsys, option):
    path = str(_package_paths(tmp_path)["symlink"]) + (".png" if option == "--steps-png" else ".html")
    assert main(["inspect", str(tmp_path), option, path]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ddpo-group inspect: error: {option}") and "inside the package" \
        in lines[0], lines


@pytest.mark.parametrize("option", ["--output-dir", "--state-dir"])
def test_a_pretrain_folder_under_a_file_is_refused_when_parsed(pretrain, tmp_path, capsys, option):
    # makedirs failed only after the whole pretraining
    (tmp_path / "a_file").write_text("x")
    path = str(tmp_path / "a_file" / "out")
    with pytest.raises(SystemExit):
        pretrain.parse_args(["--world", "scenes", option, path])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and "is a file" in lines[0], lines
