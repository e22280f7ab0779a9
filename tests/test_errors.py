"""One-line errors and the small things a newcomer meets first: rewards named with "did you mean", flag values and
config files that do not parse, scripts/evaluate.py's bad inputs, one torch thread per process, paths stored
resolved (a resume from another directory), reward_weights keyed by a URL, and the tensorboard tracker."""

import io
import json
import os
import shutil
import subprocess

import ml_collections
import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.training import models as models_module
from ddpo_group.config.check import ConfigError, check_config
from helpers import PYTHON, ROOT, cheap, make_config, read_json, read_metrics, subprocess_env


@pytest.fixture
def no_model_loading(monkeypatch):
    def load_policy(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(models_module, "load_policy", load_policy)


def _one_line(result):
    """The non-empty lines a failed command printed (stdout and stderr), asserted to be exactly one."""
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode != 0, result.stdout + result.stderr
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0]


# --- rewards: did you mean, before any model loads ---

def test_a_misspelt_reward_name_suggests_the_registered_one(tmp_path, no_model_loading):
    config = make_config(tmp_path, reward_fn="shapes_alignmnt")
    with pytest.raises(ConfigError) as info:
        check_config(config)
    message = str(info.value)
    assert message.startswith("config.reward_fn: unknown reward 'shapes_alignmnt'")
    assert "did you mean 'shapes_alignment'?" in message and "\n" not in message


def test_a_misspelt_reward_weights_key_suggests_the_registered_one(tmp_path, no_model_loading):
    config = make_config(tmp_path)
    config.reward_weights = {"shapes_colour": 1.0, "shapes_area": 0.5}
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert "config.reward_weights" in str(info.value) and "did you mean 'shapes_color'?" in str(info.value)


def test_a_reward_file_that_does_not_exist_is_named(tmp_path, no_model_loading):
    config = make_config(tmp_path, reward_fn=str(tmp_path / "missing.py") + ":score")
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert "config.reward_fn" in str(info.value) and "missing.py" in str(info.value)


def test_reward_kwargs_of_a_reward_not_in_use_are_refused(tmp_path, no_model_loading):
    config = make_config(tmp_path, reward_fn="shapes_color")
    config.reward_kwargs = {"shapes_area": {"x": 1}}
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert "config.reward_kwargs" in str(info.value) and "shapes_area" in str(info.value)


def test_a_misspelt_reward_argument_stops_the_run_before_any_model_loads(tmp_path, no_model_loading):
    from ddpo_group.training.trainer import Trainer

    config = make_config(tmp_path, reward_fn="jpeg_compressibility")
    config.reward_kwargs = {"jpeg_compressibility": {"qualty": 5}}  # it used to fail on the first images, after sampling
    with pytest.raises(ConfigError, match=r"config.reward_kwargs\['jpeg_compressibility'\]: reward "
                                          "'jpeg_compressibility' takes no keyword argument 'qualty'; it takes none"):
        Trainer(config)
    assert not os.listdir(tmp_path)


def test_reward_kwargs_of_a_class_reward_or_not_a_mapping_are_named_before_any_model_loads(tmp_path, no_model_loading):
    plugin = tmp_path / "classy.py"
    plugin.write_text("class Scaled:\n    def __init__(self, scale=1.0):\n        self.scale = scale\n"
                      "    def __call__(self, images, prompts, metadata):\n        return [self.scale] * len(prompts), {}\n")
    spec = f"{plugin}:Scaled"
    config = make_config(tmp_path / "runs", reward_fn=spec)
    config.reward_kwargs = ml_collections.ConfigDict({spec: {"scal": 2.0}}, allow_dotted_keys=True)  # as the CLI gives
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert str(info.value) == (f"config.reward_kwargs[{spec!r}]: reward {spec!r} takes no keyword argument 'scal'; "
                               "it takes 'scale'")
    config.reward_kwargs = ml_collections.ConfigDict({spec: 5}, allow_dotted_keys=True)
    with pytest.raises(ConfigError, match=r"config.reward_kwargs\[.*\] must be a mapping of keyword arguments"):
        check_config(config)


def test_reward_weights_that_are_all_zero_are_refused(tmp_path, no_model_loading):
    config = make_config(tmp_path)
    config.reward_weights = {"shapes_alignment": 0.0, "shapes_area": 0}
    with pytest.raises(ConfigError, match="config.reward_weights: every weight is 0"):
        check_config(config)


def test_a_logdir_that_is_a_file_or_a_resume_from_that_is_a_file_is_named(tmp_path, no_model_loading):
    from ddpo_group.runs.run_dir import CheckpointError
    from ddpo_group.training.trainer import Trainer

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="config.logdir=.*a_file' is a file; give a directory"):
        check_config(make_config(a_file))
    config = make_config(tmp_path, resume_from=str(a_file))
    with pytest.raises(CheckpointError, match="config.resume_from=.*a_file' is a file; give the run directory"):
        Trainer(config)


@pytest.mark.parametrize("field", ["prompt_fn", "eval_prompt_fn"])
@pytest.mark.parametrize("content, needle", [(None, "does not exist"), ("\n  \n", "has no prompts"),
                                             ("directory", "is a directory; give a .txt, .json or .jsonl file")])
def test_a_bad_prompt_file_is_named_by_its_field_before_any_model_loads(tmp_path, no_model_loading, field, content,
                                                                        needle):
    from ddpo_group.training.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    if content == "directory":
        prompts.mkdir()
    elif content is not None:
        prompts.write_text(content)
    config = make_config(tmp_path / "runs", **{field: str(prompts)})
    with pytest.raises(ConfigError) as info:
        Trainer(config)
    message = str(info.value)
    assert message.startswith(f"config.{field}='{prompts}': prompt file") and needle in message, message
    assert "(nor" not in message  # an absolute path is not looked for among the shipped prompt sets
    assert not (tmp_path / "runs").exists()  # the eval prompts were read after the run directory was written


# --- the training command line ---

@pytest.mark.parametrize("argument, needle", [
    ("--config.num_epochs=abc", "--config.num_epochs=abc"),
    ("--config.reward_weights=[1, 2]", "not a dict literal"),
])
def test_a_flag_value_that_does_not_parse_is_one_line(tmp_path, argument, needle):
    result = subprocess.run(
        [PYTHON, "scripts/train.py", "--config", "config/grpo.py:test", argument, f"--config.logdir={tmp_path}"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )
    line = _one_line(result)
    assert line.startswith("ddpo-group-train: error:") and needle in line
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("arguments, needle", [
    # allow_unquoted reaches the OCR prompt check (the test prompts have no quotes), so the next error is the engine's
    (["--config.reward_kwargs.ocr.allow_unquoted=True", "--config.reward_kwargs.ocr.engine", "bogus"],
     "engine='bogus' is not one of"),
    # a reward that is not in use: the entry was created, and the config check names it
    (["--config.reward_kwargs.ocr.allow_unquoted=True", "--config.reward_kwargs.nosuch.x=1"],
     "config.reward_kwargs names ['nosuch'], which are not rewards in use (['ocr'])"),
])
def test_a_reward_keyword_set_by_a_dotted_flag_creates_the_rewards_entry(tmp_path, arguments, needle):
    result = subprocess.run(
        [PYTHON, "scripts/train.py", "--config", "config/grpo.py:test", "--config.reward_fn=ocr", *arguments,
         f"--config.logdir={tmp_path}"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )
    line = _one_line(result)
    assert line.startswith("ddpo-group-train: error:") and needle in line, line
    assert "KeyError" not in line and "no quoted text" not in line and not os.listdir(tmp_path)


def test_dotted_reward_keywords_join_a_variants_own_entry():
    from ddpo_group.cli import _set_reward_kwargs, _split_reward_kwargs_flags
    from ddpo_group.config import grpo

    config = grpo.get_config("sd35_ocr")  # reward_kwargs.ocr = {"engine": ...}, assigned as a plain dict
    config.lock()
    argv, settings = _split_reward_kwargs_flags(["train.py", "--config.num_epochs=2",
                                                 "--config.reward_kwargs.ocr.allow_unquoted=True",
                                                 "--config.reward_kwargs.ocr.max_new_tokens", "64"])
    assert argv == ["train.py", "--config.num_epochs=2"]
    assert _set_reward_kwargs(config, settings) is None
    assert config.reward_kwargs.ocr.to_dict() == {"engine": grpo.get_config("sd35_ocr").reward_kwargs.ocr.engine,
                                                  "allow_unquoted": True, "max_new_tokens": 64}
    problem = _set_reward_kwargs(config, [("ocr.engine.name", "x")])
    assert "config.reward_kwargs.ocr.engine is" in problem and "not a dict" in problem


def test_a_config_file_that_does_not_exist_is_one_line(tmp_path):
    result = subprocess.run(
        [PYTHON, "scripts/train.py", "--config", "my_config.py:big"], cwd=ROOT, env=subprocess_env(),
        capture_output=True, text=True, timeout=120,
    )
    line = _one_line(result)
    assert "config file 'my_config.py' does not exist" in line


@pytest.mark.parametrize("value, needles", [
    ("config", ["--config 'config' is a directory", "config/grpo.py:tiny"]),
    # a file whose get_config takes no argument: ml_collections' message holds the whole traceback
    ("ddpo_group/config/base.py:tiny", ["TypeError: get_config() takes 0 positional arguments but 1 was given",
                                        "without ':ARG'"]),
])
def test_a_config_that_is_not_a_config_file_is_one_line(tmp_path, value, needles):
    result = subprocess.run(
        [PYTHON, "scripts/train.py", "--config", value, f"--config.logdir={tmp_path}"], cwd=ROOT,
        env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )
    line = _one_line(result)
    assert line.startswith("ddpo-group-train: error:") and all(n in line for n in needles), line
    assert "Traceback" not in line and "File " not in line and not os.listdir(tmp_path)


def test_cpu_threads_follow_omp_num_threads_else_one(monkeypatch):
    from ddpo_group.cli import cpu_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        assert cpu_threads() == 1 and torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"  # what the processes it starts inherit
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert cpu_threads() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# --- a short run with the tensorboard tracker: its scalars and grids; scripts/evaluate.py on it ---

@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    pytest.importorskip("tensorboard")
    from ddpo_group.training.trainer import train

    tmp_path = tmp_path_factory.mktemp("tb")
    config = make_config(tmp_path, **cheap(log_with="tensorboard", eval_freq=1, eval_images_per_prompt=1,
                                           log_images_every=1, eval_grid_prompts=2))
    return train(config)


def test_tensorboard_holds_the_scalars_of_metrics_jsonl_and_the_grids(tensorboard_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = read_metrics(tensorboard_run)
    assert [row["epoch"] for row in rows] == [0, 1] and "eval/grid" in rows[0] and "eval/grid" in rows[1]
    # the tracker writes tensorboard/<project_name>/ (and the config as hparams in a directory below it)
    project = read_json(os.path.join(tensorboard_run, "config.json"))["project_name"]
    board = EventAccumulator(os.path.join(tensorboard_run, "tensorboard", project), size_guidance={"scalars": 0, "images": 0})
    board.Reload()
    checked = 0
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)):  # what a tracker takes; paths and lists are not scalars
                logged = {event.step: event.value for event in board.Scalars(key)}
                assert logged[row["epoch"]] == pytest.approx(float(value), rel=1e-6, abs=1e-6), key
                checked += 1
    assert checked > 20 and "eval/reward_mean" in board.Tags()["scalars"]
    for key, steps in (("eval/grid", [0, 1]), ("samples/grid", [0])):
        images = board.Images(key)
        assert [image.step for image in images] == steps
        for image, row in zip(images, [row for row in rows if key in row]):
            with Image.open(os.path.join(tensorboard_run, row[key])) as png:
                expected = np.asarray(png.convert("RGB"))
            logged = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))
            assert (image.height, image.width) == expected.shape[:2]
            assert np.array_equal(logged, expected)


def _evaluate(*args, cwd=ROOT, **env):
    environment = subprocess_env(**env)
    environment.pop("OMP_NUM_THREADS", None)
    return subprocess.run([PYTHON, os.path.join(ROOT, "scripts", "evaluate.py"), *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=300)


def test_evaluate_takes_a_run_directory_and_runs_with_one_thread(tensorboard_run):
    result = _evaluate("--checkpoint", tensorboard_run)
    assert result.returncode == 0, result.stderr[-2000:]
    written = os.path.join(tensorboard_run, "checkpoints", "checkpoint_1", "evaluation.json")
    summary = read_json(written)
    assert summary["torch_threads"] == 1  # OMP_NUM_THREADS was not set
    assert summary["model"] == os.path.dirname(written)  # the latest checkpoint of the run
    assert summary["images_per_prompt"] == 1 and summary["seed"] == 1234  # the run's evaluation settings
    # the final weights with the run's prompts, images and noise: the trainer's last evaluation
    final = [row for row in read_metrics(tensorboard_run) if row["epoch"] == 1][0]
    assert summary["mean"] == pytest.approx(final["eval/reward_mean"], abs=1e-4)


@pytest.mark.parametrize("args, status, needle", [
    (["--images-per-prompt", "0"], 2, "argument --images-per-prompt: expected a whole number >= 1, got '0'"),
    (["--images-per-prompt", "100000"], 2, "argument --images-per-prompt: expected at most 1024"),
    (["--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
    (["--checkpoint", "runs/none/checkpoints/checkpoint_3"], 1, "--checkpoint runs/none/checkpoints/checkpoint_3: "
                                                                 "no such directory"),
    (["--prompts", "no_such_prompts.txt"], 1, "no_such_prompts.txt"),
])
def test_evaluate_bad_input_is_one_line(args, status, needle):
    result = _evaluate(*args)
    line = _one_line(result)
    assert result.returncode == status and line.startswith("evaluate.py: error:") and needle in line, line


def test_evaluate_names_the_runs_prompt_field_when_its_file_is_gone(tensorboard_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tensorboard_run, run)
    stored = json.loads((run / "config.json").read_text())
    stored["prompt_fn"], stored["eval_prompt_fn"] = str(tmp_path / "deleted.txt"), ""
    (run / "config.json").write_text(json.dumps(stored))
    line = _one_line(_evaluate("--checkpoint", str(run)))
    assert line == (f"evaluate.py: error: prompt file '{tmp_path / 'deleted.txt'}' does not exist (from the run's "
                    "config.prompt_fn; --prompts PATH evaluates other prompts)"), line


def test_evaluate_a_directory_without_checkpoints_is_one_line(tmp_path):
    line = _one_line(_evaluate("--checkpoint", str(tmp_path)))
    assert "neither a checkpoint_N directory nor a run directory" in line


def test_evaluate_a_checkpoint_with_missing_or_broken_weights_is_one_line(tensorboard_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tensorboard_run, run, ignore=shutil.ignore_patterns(".lock"))
    checkpoint = run / "checkpoints" / "checkpoint_1"
    (trained,) = [checkpoint / name for name in os.listdir(checkpoint) if (checkpoint / name).is_dir()]  # lora/, unet/
    weights = [name for name in os.listdir(trained) if name.endswith(".safetensors")]
    with open(trained / weights[0], "r+b") as f:  # a torn file
        f.truncate(100)
    line = _one_line(_evaluate("--checkpoint", str(checkpoint)))
    assert "could not load the trained weights of checkpoint" in line
    shutil.rmtree(trained)
    line = _one_line(_evaluate("--checkpoint", str(run)))
    assert "could not load the trained weights of checkpoint" in line or "has no lora/ directory" in line
    os.remove(run / "config.json")
    line = _one_line(_evaluate("--checkpoint", str(run)))
    assert "config.json are missing or unreadable" in line


# --- relative paths stored resolved, reward_weights keyed by a URL: start here, resume from elsewhere ---

def test_a_run_with_relative_paths_and_a_url_keyed_reward_resumes_from_another_directory(tmp_path):
    from ddpo_group.rewards import get_reward
    from ddpo_group.rewards.server import make_server

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    (start / "my.rewards").mkdir(parents=True)
    elsewhere.mkdir()
    (start / "prompts.txt").write_text("a big red square on a white background\na big blue circle on a black background\n")
    (start / "eval.txt").write_text("a small green triangle on a gray background\n")
    (start / "my.rewards" / "brightness.py").write_text(
        "def score(images, prompts, metadata):\n    return images.mean(dim=(1, 2, 3)), {}\n")
    server = make_server(get_reward("shapes_color"), "127.0.0.1", 0, name="shapes_color")  # a real reward server, in a thread
    url = server.start()
    try:
        weights = {"my.rewards/brightness.py:score": 1.0, url: 0.5}
        first = subprocess.run(
            [PYTHON, os.path.join(ROOT, "scripts", "train.py"), "--config", "test", "--config.logdir=runs",
             "--config.run_name=r", "--config.num_epochs=1", "--config.sample.num_steps=2", "--config.log_images_every=0",
             "--config.prompt_fn=prompts.txt", "--config.eval_prompt_fn=eval.txt", "--config.eval_freq=1",
             "--config.eval_images_per_prompt=1", f"--config.reward_weights={json.dumps(weights)}",
             f"--config.reward_kwargs={json.dumps({url: {'timeout': 30.0}})}"],
            cwd=start, env=subprocess_env(), capture_output=True, text=True, timeout=600,
        )
        assert first.returncode == 0, first.stderr[-3000:]
        run = start / "runs" / "r"
        stored = read_json(run / "config.json")
        assert stored["prompt_fn"] == str(start / "prompts.txt")
        assert stored["eval_prompt_fn"] == str(start / "eval.txt")
        assert stored["reward_weights"] == {str(start / "my.rewards" / "brightness.py") + ":score": 1.0, url: 0.5}
        assert stored["reward_kwargs"] == {url: {"timeout": 30.0}}
        second = subprocess.run(
            [PYTHON, os.path.join(ROOT, "scripts", "train.py"), "--config", "test", f"--config.resume_from={run}",
             "--config.num_epochs=2"],
            cwd=elsewhere, env=subprocess_env(), capture_output=True, text=True, timeout=600,
        )
        assert second.returncode == 0, second.stderr[-3000:]
    finally:
        server.stop()
    rows = read_metrics(run)
    assert [row["epoch"] for row in rows if not row.get("eval_only")] == [0, 1]
    assert all("reward/score" in row and "reward/shapes_color" in row for row in rows if not row.get("eval_only"))
    assert [row["epoch"] for row in rows if "eval/reward_mean" in row] == [0, 1, 2]
    assert not os.listdir(elsewhere)


def test_evaluate_scores_a_run_with_its_weighted_rewards_as_the_trainer_did(tmp_path):
    """A run trained on reward_weights (two rewards, not reward_fn): evaluate.py builds the run's reward as the
    trainer did, so the final weights score what the trainer's last evaluation logged."""
    from ddpo_group.training.trainer import train

    config = make_config(tmp_path, **cheap(eval_freq=1, eval_images_per_prompt=1, num_epochs=1, reward_fn="",
                                           reward_weights={"shapes_color": 1.0, "shapes_area": 0.5}))
    run = train(config)
    result = _evaluate("--checkpoint", run)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = read_json(os.path.join(run, "checkpoints", "checkpoint_1", "evaluation.json"))
    final = [row for row in read_metrics(run) if row.get("eval_only")][0]
    assert set(summary["components"]) == {"shapes_color", "shapes_area"}
    assert summary["mean"] == pytest.approx(final["eval/reward_mean"], abs=1e-4)
