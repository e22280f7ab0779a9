import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddpo_group.cli import inspect_main
from ddpo_group.runs.grids import save_epoch_samples
from ddpo_group.report.inspect import build_report, choose_prompts, load_run, metric_series, read_metrics, write_report

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["a red circle", "a blue square", "a green triangle", "a white star"]
# Per-prompt rewards (2 copies each) at epoch 0 and epoch 2. Mean change per prompt:
# red +0.1, blue -0.6, green +0.4, white 0.0  ->  largest |change| first: blue, green, red.
REWARDS = {
    0: [0.2, 0.4, 0.9, 0.9, 0.1, 0.3, 0.5, 0.5],
    2: [0.3, 0.5, 0.2, 0.4, 0.5, 0.7, 0.5, 0.5],
}


def write_metrics(run_dir, rows):
    with open(run_dir / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_run(run_dir, seed=0, learning_rate=3e-4):
    """A fake run directory as the trainer writes it: metrics.jsonl, config.json, samples at epochs 0 and 2."""
    run_dir.mkdir(parents=True)
    rows = [
        {"epoch": e, "global_step": 2 * e, "num_processes": 1, "num_samples": 8, "reward_mean": 0.4 + 0.1 * e,
         "reward_std": 0.2, "reward/shapes_color": 0.3 + 0.1 * e, "kl": 0.01 * e, "clipfrac": 0.1, "loss": -0.05,
         "time/sample": 1.5, "time/reward": 0.1, "time/train": 2.5, "peak_rss_mb": 900.0}
        for e in range(3)
    ]
    write_metrics(run_dir, rows)
    (run_dir / "config.json").write_text(json.dumps({"seed": seed, "train": {"learning_rate": learning_rate}}))
    rng = np.random.default_rng(seed)
    prompts = [p for p in PROMPTS for _ in range(2)]
    for epoch, rewards in REWARDS.items():
        advantages = np.arange(8) - 3.5
        save_epoch_samples(run_dir, epoch, rng.random((8, 3, 8, 8)), prompts, rewards, advantages, group_size=2)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return make_run(root / "run_a", seed=0), make_run(root / "run_b", seed=1, learning_rate=1e-4)


@pytest.fixture(scope="module")
def compare_report(runs):
    """(path, html) of the side-by-side report of run_a and run_b, built once for the module."""
    path = write_report(runs[0], compare=runs[1])
    return path, path.read_text()


def data_uri(path):
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def test_read_metrics_names_file_and_line_of_a_malformed_row(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0}\n\n{"epoch": 1, "kl": \n')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'metrics.jsonl'} line 3: not valid JSON")):
        read_metrics(tmp_path / "metrics.jsonl")


def test_read_metrics_rejects_a_row_that_is_not_an_object(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"line 2: expected a JSON object"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_missing_run_dir_error_names_path_and_expected_content(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"run directory {tmp_path / 'nope'} does not exist") + ".*metrics.jsonl"):
        load_run(tmp_path / "nope")


def test_run_dir_without_metrics_error_names_the_file(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'metrics.jsonl'} not found") + ".*run directory"):
        load_run(tmp_path)


def test_cli_reports_errors_with_exit_code_2(tmp_path, capsys):
    assert inspect_main([str(tmp_path / "nope")]) == 2
    assert f"run directory {tmp_path / 'nope'} does not exist" in capsys.readouterr().err


def test_metric_series_skips_missing_and_non_finite_values():
    rows = [{"epoch": 0, "kl": 0.5}, {"epoch": 1}, {"epoch": 2, "kl": None}, {"epoch": 3, "kl": float("nan")},
            {"kl": 0.25}]
    # The last row has no epoch: its row index (4) is the x value.
    assert metric_series(rows, "kl") == ([0.0, 4], [0.5, 0.25])


def test_default_prompts_are_the_largest_reward_changes(runs):
    assert choose_prompts(load_run(runs[0]), num_prompts=3) == ["a blue square", "a green triangle", "a red circle"]


def test_report_embeds_every_grid_and_only_data_uris(runs, tmp_path):
    path = write_report(runs[0], output=tmp_path / "report.html")
    text = path.read_text()
    for epoch in (0, 2):
        assert data_uri(runs[0] / "samples" / f"epoch_{epoch:04d}.png") in text
    sources = re.findall(r'<img[^>]* src="([^"]*)"', text)
    assert len(sources) == text.count("<img")
    assert all(src.startswith("data:image/png;base64,") for src in sources)


def test_report_shows_config_and_metric_panels(runs):
    text = build_report(runs[0])
    assert "&quot;learning_rate&quot;: 0.0003" in text
    for key in ("reward_mean +- reward_std", "reward/shapes_color", "kl", "clipfrac", "loss", "peak_rss_mb",
                "time per phase"):
        assert f'alt="{key}"' in text


def test_report_best_and_worst_samples_of_a_prompt(runs):
    text = build_report(runs[0], prompts=["a green triangle"], top_k=1)
    section = text.split("<h3>a green triangle</h3>")[1]
    # Last epoch (2), "a green triangle" = samples 4 (r=0.5, a=+0.5) and 5 (r=0.7, a=+1.5).
    best, worst = section.split("<p>best</p>")[1].split("<p>worst</p>")
    assert "r=0.700 a=+1.50" in best and "r=0.500" not in best
    assert "r=0.500 a=+0.50" in worst and "r=0.700" not in worst
    assert data_uri(runs[0] / "samples" / "epoch_0002" / "005.png") in best


def test_unknown_prompt_is_an_error_listing_known_prompts(runs):
    with pytest.raises(ValueError, match=r"prompts: \['a purple moon'\] not sampled.*'a blue square'"):
        build_report(runs[0], prompts=["a purple moon"])


def test_report_without_samples_or_time_metrics(tmp_path):
    write_metrics(tmp_path, [{"epoch": 0, "reward_mean": 0.1}, {"epoch": 1, "loss": 0.2}])
    text = build_report(tmp_path)
    assert 'alt="reward_mean +- reward_std"' in text and 'alt="loss"' in text
    assert "time per phase" not in text
    assert "no sample grids" in text and "no config.json" in text


def test_compare_report_puts_both_runs_side_by_side(runs, compare_report):
    path, text = compare_report
    assert path == runs[0] / "report_vs_run_b.html"
    for run in runs:
        for epoch in (0, 2):
            assert data_uri(run / "samples" / f"epoch_{epoch:04d}.png") in text
    # The config difference table lists the differing keys with both values.
    assert "<tr><td>seed</td><td>0</td><td>1</td></tr>" in text
    assert "<tr><td>train.learning_rate</td><td>0.0003</td><td>0.0001</td></tr>" in text


def test_script_writes_report(runs, tmp_path):
    output = tmp_path / "out.html"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "inspect_run.py"), str(runs[0]), "--output", str(output),
         "--prompts", "a red circle", "--top-k", "2"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {output}"
    assert "<h3>a red circle</h3>" in output.read_text()


def chromium_driver(profile_dir):
    chromium, chromedriver = shutil.which("chromium") or "/usr/bin/chromium", "/usr/bin/chromedriver"
    if not (os.path.exists(chromium) and os.path.exists(chromedriver)):
        pytest.skip("headless Chromium not found: apt-get install chromium chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium not installed: pip install selenium (in the [dev] extra)")
    os.environ["SE_OFFLINE"] = "true"  # selenium-manager never downloads a driver
    options = webdriver.ChromeOptions()
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile_dir}"):
        options.add_argument(flag)
    options.binary_location = chromium
    return webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)


def test_report_images_load_in_headless_chromium(compare_report, tmp_path):
    path, text = compare_report
    # Moved away from the run directories: the report must not depend on any other file.
    moved = tmp_path / "report.html"
    moved.write_text(text)
    driver = chromium_driver(tmp_path / "profile")
    try:
        driver.get(moved.as_uri())
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.alt]);"
        )
    finally:
        driver.quit()
    assert len(images) == text.count("<img") > 0
    broken = [alt for complete, width, alt in images if not (complete and width > 0)]
    assert broken == []


def _step_run(run_dir, rows):
    run_dir.mkdir(parents=True)
    write_metrics(run_dir, rows)
    return run_dir


def test_step_matrix_nan_for_null_pads_and_skips_rows_without_lists():
    from ddpo_group.report.inspect import step_matrix

    rows = [
        {"epoch": 0, "reward_mean": 0.1},  # a row from before the per-step metrics
        {"epoch": 1, "steps/adv_std": [1.0, None, 0.5]},
        {"epoch": 2, "steps/adv_std": [2.0, 3.0]},  # a shorter trajectory
    ]
    epochs, matrix = step_matrix(rows, "steps/adv_std")
    assert epochs == [1, 2]
    assert matrix[0][0] == 1.0 and np.isnan(matrix[0][1]) and matrix[0][2] == 0.5
    assert matrix[1][:2] == [2.0, 3.0] and np.isnan(matrix[1][2])
    assert step_matrix(rows, "steps/grad_share") == ([], [])


def test_step_heatmaps_png_for_per_step_runs_and_report_section(tmp_path):
    from PIL import Image

    from ddpo_group.report.inspect import write_step_heatmaps

    rows = [
        {"epoch": e, "reward_mean": 0.5, "steps/trained": [1, 0, 0], "steps/adv_mean": [0.0, None, None],
         "steps/grad_share": [1.0, None, None], "steps/explained_variance": [0.0, 0.4, 0.8]}
        for e in range(4)
    ]
    one_step = [{"epoch": e, "steps/trained": [1], "steps/adv_std": [1.0]} for e in range(2)]  # 1-step trajectory
    run = _step_run(tmp_path / "gp", rows)
    short = _step_run(tmp_path / "one", one_step)
    out = write_step_heatmaps([run, short], tmp_path / "steps.png", names=["GP", "one step"])
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[0] > 300
    # the CLI: three runs side by side in one picture; the report itself compares two at most
    assert inspect_main([str(run), "--compare", str(short), str(run), "--steps-png", str(tmp_path / "3.png")]) == 0
    with Image.open(tmp_path / "3.png") as three:
        assert three.size[0] > image.size[0]
    assert inspect_main([str(run), "--compare", str(short), str(run)]) == 2
    html = build_report(run)
    assert "Per-step view" in html and "per-step heat maps" in html


def test_step_heatmaps_of_an_old_run_is_a_clear_error_and_report_still_builds(tmp_path, capsys):
    old = _step_run(tmp_path / "old", [{"epoch": 0, "reward_mean": 0.3}, {"epoch": 1, "reward_mean": 0.4}])
    assert "no per-step metrics" in build_report(old)
    assert inspect_main([str(old), "--steps-png", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "no per-step metrics" in err and str(old) in err
    assert not (tmp_path / "x.png").exists()
    assert inspect_main([str(old), "--steps-png", str(tmp_path / "x.png"), "--steps-keys", "steps/nope"]) == 2
    assert "steps/nope" in capsys.readouterr().err


def test_report_never_embeds_a_file_outside_the_run_directory(tmp_path):
    run = make_run(tmp_path / "run", seed=0)
    secret = tmp_path / "secret.png"
    secret.write_bytes((run / "samples" / "epoch_0002" / "005.png").read_bytes() + b"SECRET")
    samples = run / "samples" / "epoch_0002.json"
    document = json.loads(samples.read_text())
    records = document["records"] if isinstance(document, dict) else document
    for record in records:
        record["image"] = "../../secret.png"
    samples.write_text(json.dumps(document))
    html = build_report(run, prompts=["a green triangle"], top_k=1)
    assert data_uri(secret) not in html
    assert "../../secret.png is outside the run directory" in html


def test_report_never_follows_a_link_out_of_the_run_directory(tmp_path):
    # grids are found by listing samples/: a link there to a file elsewhere is left out and said, never embedded
    run = make_run(tmp_path / "run", seed=0)
    secret = tmp_path / "secret.png"
    secret.write_bytes((run / "samples" / "epoch_0002.png").read_bytes() + b"SECRET")
    linked = sorted(p.name for p in (run / "samples").glob("e*_*.png"))[:2]
    assert linked, "make_run writes grids"
    for name in linked:
        (run / "samples" / name).unlink()
        (run / "samples" / name).symlink_to(secret)
    html = build_report(run)
    assert data_uri(secret) not in html and "SECRET" not in html
    assert "links to files outside the run directory" in html
    assert all(f"samples/{name}" in html for name in linked)


def test_a_torn_last_line_of_a_killed_run_is_left_out_and_said(tmp_path):
    # the trainer writes each row with its newline in one write: a run killed mid-write leaves a line without one
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0, "reward_mean": 0.5}\n{"epoch": 1, "reward_mean": 0.6}\n{"epo')
    with pytest.raises(ValueError, match="line 3: not valid JSON"):
        read_metrics(tmp_path / "metrics.jsonl")  # asked for no leniency: an error like any bad line
    torn = []
    assert [row["epoch"] for row in read_metrics(tmp_path / "metrics.jsonl", torn=torn)] == [0, 1] and torn == [3]
    run = load_run(tmp_path)
    assert run.torn_metrics_line == 3 and len(run.metrics) == 2
    html = build_report(tmp_path)
    assert "metrics.jsonl line 3, its last, was cut off mid-write" in html


def test_a_bad_last_line_that_ends_with_its_newline_is_still_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0}\n{"epoch": 1, "kl": \n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        load_run(tmp_path)
