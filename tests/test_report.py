"""The run report a researcher trusts at a glance (ddpo_group.report.inspect): the headline, best / worst samples of the
final weights, compare mode's paired evaluation cells, the size cap, failed runs, readable images and plots.

Two real runs of the `test` variant (seconds) are shared by the module; other run directories are written here
file by file, as the trainer would, without training."""

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import cheap, make_config, read_metrics
from PIL import Image

from ddpo_group.cli import inspect_main
from ddpo_group.runs.grids import save_epoch_samples
from ddpo_group.report.inspect import (
    MAX_REPORT_BYTES,
    build_report,
    evaluation_figure,
    load_run,
    shown_width,
    thin_evenly,
    write_report,
)
from ddpo_group.data.prompts import load_prompts
from ddpo_group.rewards.registry import register_reward
from ddpo_group.runs.run_dir import RunDir
from ddpo_group.training.trainer import train


@register_reward("test_report_brightness")
def brightness(images, prompts, metadata):
    """A continuous reward, so that best and worst differ."""
    return images.float().mean(dim=(1, 2, 3)).cpu(), {}


def data_uri(path):
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def write_metrics(run_dir, rows):
    with open(run_dir / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def section(html, heading):
    """The HTML from the <h2> `heading` to the next <h2>."""
    start = html.index(f"<h2>{heading}")
    end = html.find("<h2>", start + 4)
    return html[start : end if end > 0 else len(html)]


def headline_rows(html):
    """{field: [value per run]} of the headline table."""
    table = re.search(r'<table class="headline">(.*?)</table>', html, re.S).group(1)
    rows = {}
    for row in re.findall(r"<tr><th>([^<]+)</th>((?:<td>.*?</td>)+)</tr>", table):
        rows[row[0]] = re.findall(r"<td>(.*?)</td>", row[1])
    return rows


# ---------------------------------------------------------------- real runs of the test variant

EPOCHS = 3
EVAL_PROMPTS = "shapes_squares.txt"  # 36 prompts


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """Two real 3-epoch runs that differ only by the learning rate, evaluated every epoch with fixed noise."""
    root = tmp_path_factory.mktemp("real")
    runs = []
    for name, lr in (("lr_small", 3e-4), ("lr_big", 3e-3)):
        config = make_config(root, run_name=name, **cheap(
            num_epochs=EPOCHS, eval_freq=1, eval_images_per_prompt=2, eval_prompt_fn=EVAL_PROMPTS, eval_grid_prompts=4,
            log_images_every=1, reward_fn="test_report_brightness", train__learning_rate=lr))
        runs.append(Path(train(config)))
    return runs


def test_a_run_keeps_its_variant_and_every_image_of_its_final_evaluation(real_runs):
    run = real_runs[0]
    assert json.loads((run / "config.json").read_text())["variant"] == "test"
    document = json.loads((run / "samples" / f"eval_{EPOCHS:04d}.json").read_text())
    assert document["final"] is True and document["seed"] == 1234
    assert document["prompts"] == [record.prompt for record in load_prompts(EVAL_PROMPTS)] and len(document["prompts"]) == 36
    records = document["records"]
    assert len(records) == 32 * 2  # the first FINAL_IMAGE_PROMPTS prompts' images, not only the grid's 4 prompts
    for record in records:
        i, j = record["prompt_index"], record["image_index"]
        assert record["prompt"] == document["prompts"][i] and record["reward"] == document["rewards"][i][j]
        assert (run / "samples" / record["image"]).is_file()
    # the final evaluation's row is the mean of these rewards; the grid image shows the first 4 prompts only
    final_row = read_metrics(run)[-1]
    assert final_row["eval_only"] and final_row["epoch"] == EPOCHS
    assert final_row["eval/reward_mean"] == pytest.approx(np.mean(document["rewards"]), rel=1e-9)
    with Image.open(run / "samples" / f"eval_{EPOCHS:04d}.png") as grid:
        rows_of_96px = grid.size[1] // 96
    assert rows_of_96px == 4
    earlier = json.loads((run / "samples" / "eval_0001.json").read_text())
    assert earlier["final"] is False and len(earlier["records"]) == 4 * 2 and len(earlier["rewards"]) == 36


def test_headline_of_a_real_run_names_its_variant_and_final_evaluation(real_runs):
    html = build_report(real_runs[0])
    rows = headline_rows(html)
    assert rows["variant"] == ["test"]
    assert rows["reward(s)"] == ["test_report_brightness"]
    assert rows["epochs"] == [f"{EPOCHS} of {EPOCHS}"]
    final = read_metrics(real_runs[0])[-1]["eval/reward_mean"]
    assert rows["final eval"][0].startswith(f"{final:.4f} (the final weights, after {EPOCHS} epochs")
    assert rows["samples shown"] == [f"final weights (after {EPOCHS} epochs)"]
    assert '<p class="status ok">finished: 3 of 3 epochs</p>' in html


def test_best_and_worst_come_from_the_final_evaluation(real_runs):
    run = real_runs[0]
    document = json.loads((run / "samples" / f"eval_{EPOCHS:04d}.json").read_text())
    prompt = document["prompts"][5]
    mine = sorted((r for r in document["records"] if r["prompt"] == prompt), key=lambda r: r["reward"])
    html = build_report(run, prompts=[prompt], top_k=1)
    part = section(html, "Best and worst samples")
    assert f"from the final evaluation: the final weights, after {EPOCHS} epochs" in part
    best, worst = part.split(f"<h3>{prompt}</h3>")[1].split("<p>best</p>")[1].split("<p>worst</p>")
    assert data_uri(run / "samples" / mine[-1]["image"]) in best and f"r={mine[-1]['reward']:.3f}" in best
    assert data_uri(run / "samples" / mine[0]["image"]) in worst and f"r={mine[0]['reward']:.3f}" in worst
    # nothing of the training samples (epoch_XXXX/) is shown there
    for epoch in range(EPOCHS):
        for image in (run / "samples" / f"epoch_{epoch:04d}").iterdir():
            assert data_uri(image) not in part


def test_compare_cells_hold_the_same_prompt_and_noise_of_both_runs(real_runs):
    a, b = real_runs
    html = build_report(a, compare=b)
    part = section(html, "Evaluation")
    tables = part.split("<h4>")[1:]
    titles = [t.split("</h4>")[0] for t in tables]
    assert titles == ["after 0 epochs", "after 2 epochs", "after 3 epochs (the final weights)"]
    docs = {(run, e): json.loads((run / "samples" / f"eval_{e:04d}.json").read_text()) for run in (a, b) for e in (0, 3)}
    for table, epoch in ((tables[0], 0), (tables[2], 3)):
        cells = re.findall(r'<td class="cell" data-cell="(\d+),(\d+)" data-same-noise="(\w+)">(.*?)</td>', table, re.S)
        # the grid's 4 prompts at epoch 0; the final evaluation kept 32 prompts, the table shows the first 8
        assert len(cells) == (4 if epoch == 0 else 8) * 2
        for i, j, same, content in cells:
            i, j = int(i), int(j)
            sources = re.findall(r'src="([^"]+)"', content)
            expected = []
            for run in (a, b):
                record = next(r for r in docs[(run, epoch)]["records"] if (r["prompt_index"], r["image_index"]) == (i, j))
                assert record["prompt"] == docs[(a, epoch)]["prompts"][i]
                expected.append(data_uri(run / "samples" / record["image"]))
            assert same == "true" and sources == expected
            if epoch == 0:  # before any update both runs hold the same weights: same prompt + same noise = same image
                assert sources[0] == sources[1]
    final_cells = re.findall(r'src="([^"]+)"', tables[2])
    assert any(x != y for x, y in zip(final_cells[::2], final_cells[1::2]))  # trained apart: the pictures differ


def test_per_step_view_in_single_and_compare_reports(real_runs):
    assert any("steps/trained" in row for row in read_metrics(real_runs[0]))
    for html in (build_report(real_runs[0]), build_report(real_runs[0], compare=real_runs[1])):
        part = section(html, "Per-step view")
        assert 'alt="per-step heat maps"' in part and "a column per run" in part


def test_report_images_are_readable_in_headless_chromium(real_runs, tmp_path):
    from test_inspect import chromium_driver

    path = write_report(real_runs[0], compare=real_runs[1], output=tmp_path / "report.html")
    driver = chromium_driver(tmp_path / "profile")
    try:
        driver.set_window_size(1280, 1000)
        driver.get(path.as_uri())
        shown = driver.execute_script(
            "return Array.from(document.images).filter(i => i.classList.contains('grid') || "
            "i.classList.contains('sample')).map(i => [i.naturalWidth, i.getBoundingClientRect().width, i.alt]);"
        )
    finally:
        driver.quit()
    assert shown
    shrunk = [(alt, natural, width) for natural, width, alt in shown if width < natural / 2 or width < 64]
    assert shrunk == []


# ---------------------------------------------------------------- run directories written by hand

CONFIG = {
    "variant": "tiny", "seed": 7, "eval_seed": 99, "num_epochs": 4, "use_lora": True, "lora_rank": 8,
    "prompt_fn": "shapes_big_squares.txt", "eval_prompt_fn": "", "reward_fn": "shapes_alignment",
    "reward_weights": {}, "pretrained": {"model": "tiny-shapes", "revision": ""},
    "algorithm": {"adv_estimator": "grpo"},
    "train": {"policy_loss": "vanilla", "objective": "stepwise", "use_kl_loss": True, "kl_type": "gaussian",
              "beta": 0.004},
}


def fake_run(run_dir, config=CONFIG, epochs=4, final=True):
    """metrics.jsonl as the trainer writes it: a training row per epoch (evaluations at 0 and 2) and the final
    weights' eval_only row."""
    run_dir.mkdir(parents=True)
    rows = []
    for e in range(epochs):
        row = {"epoch": e, "reward_mean": 0.5, "time/sample": 10.0, "time/reward": 2.0, "time/advantages": 0.5,
               "time/train": 20.0, "time/old_log_probs": 5.0}
        if e in (0, 2):
            row.update({"eval/reward_mean": {0: 0.40, 2: 0.70}[e], "time/eval": 4.0})
        rows.append(row)
    if final:
        rows.append({"epoch": epochs, "eval_only": True, "eval/reward_mean": 0.65, "time/eval": 4.0})
    write_metrics(run_dir, rows)
    if config is not None:
        (run_dir / "config.json").write_text(json.dumps(config))
    return run_dir


def test_headline_fields_come_from_the_config_and_the_metrics(tmp_path):
    html = build_report(fake_run(tmp_path / "run"))
    rows = headline_rows(html)
    # by hand: 4 epochs x (10 + 2 + 0.5 + 20) s + 3 evaluations x 4 s = 142 s (time/old_log_probs is within time/train)
    assert rows == {
        "variant": ["tiny"],
        "algorithm": ["grpo, policy loss vanilla, KL gaussian beta 0.004"],
        "model": ["tiny-shapes, LoRA r8"],
        "reward(s)": ["shapes_alignment"],
        "prompt set": ["shapes_big_squares.txt; evaluation: the training prompts"],
        "epochs": ["4 of 4"],
        "wall time": ["2 min 22 s in the logged phases"],
        "seed": ["7 (evaluation noise 99)"],
        "final eval": ["0.6500 (the final weights, after 4 epochs; 0.4000 after 0 epochs)"],
        "best eval": ["0.7000 (after 2 epochs)"],
        "samples shown": ["none (no sample records)"],
    }


def test_headline_of_an_old_run_says_what_was_not_recorded(tmp_path):
    old_config = {k: v for k, v in CONFIG.items() if k != "variant"}
    rows = headline_rows(build_report(fake_run(tmp_path / "old", config=old_config, final=False)))
    assert rows["variant"] == ["not recorded (config.json from before the variant was kept)"]
    assert rows["final eval"] == ["none (no evaluation of the final weights); the last: 0.7000 after 2 epochs"]
    rows = headline_rows(build_report(fake_run(tmp_path / "none", config=None)))
    assert rows["variant"] == ["not recorded (no config.json)"] and rows["epochs"] == ["4"]


def test_a_failed_run_shows_why(tmp_path, capsys):
    run = fake_run(tmp_path / "failed", epochs=3, final=False)
    RunDir(str(run)).mark_failed(3, RuntimeError("CUDA out of memory while sampling"))
    html = build_report(run)
    assert '<p class="status failed">FAILED at epoch 3: RuntimeError: CUDA out of memory while sampling' in html
    assert headline_rows(html)["epochs"] == ["3 of 4"]
    # a run that failed before its first row has no metrics.jsonl: the report still says why
    early = tmp_path / "early"
    early.mkdir()
    (early / "config.json").write_text(json.dumps(CONFIG))
    RunDir(str(early)).mark_failed(0, ValueError("reward server http://localhost:1 unreachable"))
    assert inspect_main([str(early)]) == 0
    assert "FAILED at epoch 0: ValueError: reward server http://localhost:1 unreachable" in (early / "report.html").read_text()
    capsys.readouterr()


def test_a_stopped_and_a_resumed_run_say_so(tmp_path):
    run = fake_run(tmp_path / "stopped", epochs=2, final=False)
    RunDir(str(run)).mark_stopped(2, 15)
    assert f"stopped by signal 15 after epoch 2 (stopped.json); resume with --config.resume_from={run}" in build_report(run)
    resumed = fake_run(tmp_path / "resumed")
    (resumed / "resumes.jsonl").write_text(json.dumps(
        {"epoch": 2, "changed": {}, "previous_failure": {"epoch": 2, "error": "OSError: disk full"}}) + "\n")
    html = build_report(resumed)
    assert "resumed at epoch 2 after a failure at epoch 2: OSError: disk full" in html
    assert '<p class="status ok">finished: 4 of 4 epochs</p>' in html


def eval_files(run_dir, epoch, prompts, rewards, seed=1234, final=False, rng=None):
    """samples/eval_XXXX.* as the Evaluator writes them: image j of prompt i, 2 images per prompt."""
    rng = rng or np.random.default_rng(epoch)
    n = len(prompts) * 2
    save_epoch_samples(run_dir, epoch, rng.random((n, 3, 8, 8)), [p for p in prompts for _ in range(2)],
                       np.asarray(rewards, dtype=float), None, 2, max_rows=len(prompts), prefix="eval",
                       record_fields=[{"prompt_index": i, "image_index": j} for i in range(len(prompts)) for j in range(2)],
                       extra={"final": final, "seed": seed, "prompts": list(prompts),
                              "rewards": np.asarray(rewards, dtype=float).reshape(-1, 2).tolist()})


def test_compare_pairs_by_prompt_when_the_prompt_lists_differ_and_says_the_noise_differs(tmp_path):
    prompts = ["a red circle", "a blue square", "a green triangle"]
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    eval_files(a, 0, prompts, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    eval_files(b, 0, prompts[::-1], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1], seed=5)
    html = build_report(a, compare=b)
    assert "the runs&#x27; evaluation seeds differ (1234 vs 5)" in html
    b_records = json.loads((b / "samples" / "eval_0000.json").read_text())["records"]
    cells = re.findall(r'<td class="cell" data-cell="(\d+),(\d+)" data-same-noise="(\w+)">(.*?)</td>', html, re.S)
    assert len(cells) == 6
    for i, j, same, content in cells:
        prompt = prompts[int(i)]
        record = next(r for r in b_records if r["prompt"] == prompt and r["image_index"] == int(j))
        assert re.findall(r'src="([^"]+)"', content)[1] == data_uri(b / "samples" / record["image"])
        assert same == "false" and "not the same noise" in content


def test_without_final_records_best_and_worst_come_from_the_last_epoch_and_say_so(tmp_path):
    run = fake_run(tmp_path / "old")
    prompts = ["a red circle", "a red circle", "a blue square", "a blue square"]
    for epoch in (0, 3):
        save_epoch_samples(run, epoch, np.random.default_rng(epoch).random((4, 3, 8, 8)), prompts,
                           [0.1, 0.9, 0.2, 0.3], [-1.0, 1.0, -1.0, 1.0], group_size=2)
    eval_files(run, 0, ["a red circle"], [0.5, 0.6])  # an evaluation, but not of the final weights
    html = build_report(run, prompts=["a red circle"], top_k=1)
    part = section(html, "Best and worst samples")
    assert "from the training samples of epoch 3" in part and "not the final weights" in part
    best = part.split("<p>best</p>")[1].split("<p>worst</p>")[0]
    assert data_uri(run / "samples" / "epoch_0003" / "001.png") in best and "r=0.900 a=+1.00" in best
    assert headline_rows(html)["samples shown"] == ["training samples of epoch 3, not the final weights"]


def test_the_size_cap_thins_the_epochs_evenly_and_says_what_it_left_out(tmp_path):
    run = fake_run(tmp_path / "long", epochs=4)
    rng = np.random.default_rng(0)
    epochs = 300
    samples = run / "samples"
    samples.mkdir()
    for epoch in range(epochs):  # noise does not compress: about 43 KB a grid, 13 MB in all
        Image.fromarray(rng.integers(0, 256, (120, 120, 3), dtype=np.uint8)).save(samples / f"epoch_{epoch:04d}.png")
    total = sum(f.stat().st_size for f in samples.iterdir())
    assert total > 1.5 * MAX_REPORT_BYTES
    path = write_report(run)
    html = path.read_text()
    assert path.stat().st_size <= MAX_REPORT_BYTES
    shown = [int(e) for e in re.findall(r"<h3>epoch (\d+)</h3>", html)]
    assert shown[0] == 0 and shown[-1] == epochs - 1 and 10 < len(shown) < epochs
    gaps = np.diff(shown)
    assert gaps.max() - gaps.min() <= 1  # evenly spaced
    for epoch in (shown[0], shown[len(shown) // 2], shown[-1]):
        assert data_uri(samples / f"epoch_{epoch:04d}.png") in html
    left = epochs - len(shown)
    assert f"Left out of this report to keep it under 8.0 MB: {left} of {epochs} per-epoch sample grids" in html
    links = re.findall(r'<a class="linked" href="([^"]+)">', html)
    assert len(links) == left
    assert all((path.parent / link).is_file() for link in links)
    assert {int(re.search(r"epoch_(\d+)", link).group(1)) for link in links} == set(range(epochs)) - set(shown)


def test_a_small_cap_links_evaluation_images_too_and_counts_them(tmp_path):
    run = fake_run(tmp_path / "run")
    rng = np.random.default_rng(1)
    for epoch in (0, 2, 4):
        eval_files(run, epoch, ["a", "b"], [0.1, 0.2, 0.3, 0.4], final=epoch == 4, rng=rng)
    big = Image.fromarray(rng.integers(0, 256, (300, 300, 3), dtype=np.uint8))
    for epoch in (0, 2, 4):
        big.save(run / "samples" / f"eval_{epoch:04d}.png")  # 270 KB each
    html = build_report(run, max_bytes=700 * 1024)
    assert len(html.encode()) <= 700 * 1024
    assert re.search(r"Left out of this report to keep it under 0\.7 MB: .*\d+ evaluation grids", html)


def test_thin_evenly_keeps_the_first_and_the_last():
    assert thin_evenly(10, 4) == [0, 3, 6, 9]
    assert thin_evenly(5, 9) == [0, 1, 2, 3, 4]
    assert thin_evenly(5, 1) == [4] and thin_evenly(5, 0) == []
    kept = thin_evenly(5000, 37)
    assert kept[0] == 0 and kept[-1] == 4999 and len(kept) == 37


def test_images_are_shown_at_least_at_half_their_size():
    assert [shown_width(w) for w in (8, 32, 64, 96, 256, 512, 1024, 2048)] == [96, 96, 128, 96, 256, 384, 512, 1024]


def test_evaluation_plot_title_fits_and_the_legend_covers_no_curve(tmp_path):
    a = fake_run(tmp_path / "a_run_with_a_rather_long_name_for_the_legend")
    b = fake_run(tmp_path / "another_run_with_an_even_longer_name_for_the_legend")
    fig = evaluation_figure([load_run(a), load_run(b)])
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    figure_box, axes_box = fig.bbox, ax.get_window_extent(renderer)
    title = ax.title.get_window_extent(renderer)
    assert figure_box.x0 <= title.x0 and title.x1 <= figure_box.x1 and title.y1 <= figure_box.y1
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert not box.overlaps(axes_box) and figure_box.y0 <= box.y0
    assert len(legend.get_texts()) == 4  # both runs: eval/reward_mean and the smoothed training reward
