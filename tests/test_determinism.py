"""The same command gives the same numbers: two trainings of one config in separate processes, under different
PYTHONHASHSEEDs, one of them writing checkpoints, sample grids and evaluation grids inside the run and the other
none, log the same metrics bit for bit (every number but the wall-clock times and the memory).

What may differ between the two: the process (hash seed, import order of sets and dicts), whether a checkpoint
or an image is written between epochs (nothing there may draw from a random state the training uses), and the
interleaving of the reward thread with sampling under load (the two run at the same time on the same cores).
What is the same: the command, the torch thread count (OMP_NUM_THREADS=1), the packages."""

import json
import os
import subprocess

import pytest
from helpers import PYTHON, ROOT, subprocess_env

pytestmark = pytest.mark.slow

# A short run of the `test` variant (random-weight tiny pipeline, GRPO + KL, shapes_alignment in the reward thread)
# with a fixed-noise evaluation before the first update, after each epoch and of the final weights.
COMMON = [
    "--config", "config/grpo.py:test", "--config.num_epochs=2", "--config.prompt_fn=shapes_big_squares.txt",
    "--config.reward_fn=shapes_alignment", "--config.eval_freq=1", "--config.eval_images_per_prompt=1",
]
WRITES = ["--config.save_freq=1", "--config.log_images_every=1", "--config.eval_grid_prompts=4"]
NO_WRITES = ["--config.save_freq=0", "--config.log_images_every=0", "--config.eval_grid_prompts=0"]


def _numbers(row):
    """The row's numbers (lists of numbers included), without wall-clock times and costs (time/*, perf/*: a run
    that writes no checkpoint has no checkpoint phase), memory and file names."""
    return {
        key: value for key, value in row.items()
        if not key.startswith(("time/", "perf/")) and key != "peak_rss_mb" and not isinstance(value, str)
    }


def test_two_processes_log_identical_metrics(tmp_path):
    runs = []
    for name, hash_seed, writes in (("a", "0", WRITES), ("b", "4242", NO_WRITES)):
        command = [PYTHON, os.path.join(ROOT, "scripts", "train.py"), *COMMON, *writes,
                   f"--config.logdir={tmp_path}", f"--config.run_name={name}"]
        runs.append(subprocess.Popen(command, cwd=ROOT, env=subprocess_env(PYTHONHASHSEED=hash_seed),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for process in runs:
        output = process.communicate(timeout=600)[0]
        assert process.returncode == 0, output[-3000:]
    rows = []
    for name in ("a", "b"):
        with open(tmp_path / name / "metrics.jsonl") as f:
            rows.append([json.loads(line) for line in f if line.strip()])
    assert (tmp_path / "a" / "checkpoints").is_dir() and list((tmp_path / "a" / "samples").glob("epoch_*.png"))
    assert not list((tmp_path / "b" / "samples").glob("epoch_*.png")) if (tmp_path / "b" / "samples").is_dir() else True
    assert len(rows[0]) == len(rows[1]) == 3  # 2 epochs and the final weights' evaluation row
    assert any("eval/reward_mean" in row for row in rows[0][1:])
    for row_a, row_b in zip(*rows):
        assert _numbers(row_a) == _numbers(row_b), row_a.get("epoch")


def test_the_main_job_check_reads_the_results_page_and_compares_at_its_precision(tmp_path):
    from helpers import load_script

    check = load_script("benchmarks/main_job_numbers.py")
    with open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8") as f:
        stated = check.readme_numbers(f.read())
    assert sorted(stated) == [0, 10, 20, 30, 40] and all(0 < v < 1 for v in stated.values())
    row = ("| main job: GRPO | `cmd` | 5 min | 0.554 (epoch 0, before any update) -> 0.597 (10) -> 0.7 (20): +0.1; "
           "training `reward_mean` |")
    assert check.readme_numbers(row) == {0: 0.554, 10: 0.597, 20: 0.7}
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"epoch": 0, "eval/reward_mean": 0.55404}, {"epoch": 5, "reward_mean": 0.6},
        {"epoch": 10, "eval/reward_mean": 0.59673}, {"epoch": 20, "eval_only": True, "eval/reward_mean": 0.7004})))
    lines, same = check.compare({0: 0.554, 10: 0.597, 20: 0.7}, check.run_numbers(str(run)))
    assert same and lines[1].split() == ["0", "0.554", "0.5540", "ok"]
    lines, same = check.compare({0: 0.554, 10: 0.598}, check.run_numbers(str(run)))
    assert not same and lines[2].split()[-1] == "DIFFERS"
    readme = tmp_path / "README.md"
    readme.write_text(row + "\n")
    assert check.main([str(run), "--readme", str(readme)]) == 0
    assert check.main([str(tmp_path / "nope"), "--readme", str(readme)]) == 2
