"""The report package (ddpo_group/report/): run directories written here by hand, as the trainer would, without
training; each expected value is computed in the test from the numbers it wrote."""

import json
import re

import pytest

from ddpo_group.report.page import build_report
from ddpo_group.report.run import finite, load_run


def write_run(path, rows, config=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_huge_integer_and_a_link_loop_are_read_without_an_error(tmp_path):
    huge = "1" * 401  # JSON allows it; float() of it overflows
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"epoch": 0, "reward_mean": 0.5, "loss": %s}\n' % huge)
    samples = run / "samples"
    samples.mkdir()
    (samples / "a.png").symlink_to(samples / "b.png")
    (samples / "b.png").symlink_to(samples / "a.png")  # a loop
    assert finite(int(huge)) is None and finite(0.25) == 0.25 and finite(True) is None
    data = load_run(run)
    assert data.metrics[0]["reward_mean"] == 0.5
    assert "samples/a.png" in data.outside and "samples/b.png" in data.outside
    assert "reward_mean" in build_report(run)


# ---- the per-prompt table: start -> end, change, sorted, most regressed and improved shown as images ----

PROMPTS = ["a red square", "a green square", "a blue square"]
START = [[0.6, 0.8], [0.7, 0.66], [0.1, 0.3]]  # (P, J) rewards of the first evaluation
END = [[0.9, 0.9], [0.4, 0.476], [0.2, 0.4]]  # ... of the last
COLOR = {"start": [[1.0, 0.8], [0.9, 0.88], [0.5, 0.5]], "end": [[1.0, 1.0], [0.6, 0.54], [0.5, 0.7]]}


def _image(path, value):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (value, value, value)).save(path)


def eval_run(path, variant="tiny", start=START, end=END, epochs=(0, 4), prompts=PROMPTS, with_info=True):
    """A run directory with two evaluations (samples/eval_XXXX.json + images) and metrics rows, as the trainer
    writes them."""
    rows = [{"epoch": e, "reward_mean": 0.5, "time/sample": 2.0, "time/train": 3.0, "train/unet_calls": 40,
             "reward_info/shapes_alignment/color": 0.9 - 0.1 * e, "reward_info/shapes_alignment/shape": 0.5 + 0.1 * e}
            for e in range(epochs[1])]
    for epoch, rewards in zip(epochs, (start, end)):
        row = next((r for r in rows if r["epoch"] == epoch), None)
        if row is None:
            row = {"epoch": epoch, "eval_only": True}
            rows.append(row)
        row["eval/reward_mean"] = sum(map(sum, rewards)) / sum(map(len, rewards))
        row["eval/reward_info/shapes_alignment/color"] = 0.7 if epoch == epochs[0] else 0.8
        records = []
        for i, prompt in enumerate(prompts):
            for j, reward in enumerate(rewards[i]):
                name = f"eval_{epoch:04d}/{i * 2 + j:03d}.png"
                _image(path / "samples" / name, 10 * i + j + epoch)
                records.append({"index": i * 2 + j, "prompt": prompt, "reward": reward, "advantage": None,
                                "image": name, "prompt_index": i, "image_index": j})
        document = {"epoch": epoch, "group_size": 2, "final": epoch == epochs[1], "seed": 1234, "prompts": prompts,
                    "rewards": rewards, "records": records}
        if with_info:
            document["reward_info"] = {"shapes_alignment/color": COLOR["start" if epoch == epochs[0] else "end"]}
        (path / "samples" / f"eval_{epoch:04d}.json").write_text(json.dumps(document))
    write_run(path, rows, {"variant": variant, "eval_images_per_prompt": 2, "eval_grid_prompts": 8,
                           "train": {"use_reference_model": True, "kl_type": "gaussian",
                                     "loss_agg_mode": "token-mean"}})
    return path


def test_the_per_prompt_table_sorts_by_change_and_names_what_got_worse(tmp_path):
    from ddpo_group.report.tables import prompt_changes

    run = eval_run(tmp_path / "run")
    first, last, changes = prompt_changes(load_run(run))
    assert (first, last) == (0, 4)
    expected = {p: (sum(e) / 2 - sum(s) / 2) for p, s, e in zip(PROMPTS, START, END)}
    # by hand: red 0.7 -> 0.9 (+0.2), green 0.68 -> 0.438 (-0.242), blue 0.2 -> 0.3 (+0.1)
    assert expected["a green square"] == pytest.approx(-0.242)
    assert [c.prompt for c in changes] == ["a green square", "a blue square", "a red square"]
    for change in changes:
        assert change.change == pytest.approx(expected[change.prompt])
    green = changes[0]
    assert green.start == pytest.approx(0.68) and green.end == pytest.approx(0.438)
    assert green.components["shapes_alignment/color"] == (pytest.approx(0.89), pytest.approx(0.57))
    html = build_report(run)
    section = html.split("<h2>Per-prompt evaluation</h2>")[1].split("<h2>")[0]
    assert "1 of 3 prompts got worse, 2 better" in section
    rows = re.findall(r'<tr class="(\w+)"><td>(\d+)</td><td>([^<]+)</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>',
                      section)
    assert rows[0] == ("worse", "1", "a green square", "0.68", "0.438", "-0.242")
    assert [r[2] for r in rows] == ["a green square", "a blue square", "a red square"]
    assert "0.89 &rarr; 0.57" in section
    # the most regressed and the most improved as images of both evaluations (the same noise)
    regressed = section.split("Most regressed: a green square")[1].split("<h3>")[0]
    assert data_uri(run / "samples" / "eval_0000" / "002.png") in regressed
    assert data_uri(run / "samples" / "eval_0004" / "003.png") in regressed
    improved = section.split("Most improved: a red square")[1].split("<h3>")[0]
    assert data_uri(run / "samples" / "eval_0004" / "000.png") in improved


def data_uri(path):
    import base64

    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def test_component_curves_are_drawn_for_training_and_evaluation(tmp_path):
    from ddpo_group.report.figures import component_keys, plot_components

    run = load_run(eval_run(tmp_path / "run"))
    assert component_keys([run], "reward_info/") == {"shapes_alignment": ["color", "shape"]}
    assert component_keys([run], "eval/reward_info/") == {"shapes_alignment": ["color"]}
    assert [key for key, _ in plot_components([run])] == ["reward_info/shapes_alignment",
                                                          "eval/reward_info/shapes_alignment"]
    html = build_report(run.path)
    assert 'alt="reward_info/shapes_alignment"' in html and 'alt="eval/reward_info/shapes_alignment"' in html
    # the evaluation's components are not drawn a second time as separate eval/* panels
    assert 'alt="eval/reward_info/shapes_alignment/color"' not in html


def test_compare_labels_runs_by_letter_and_variant_and_shows_per_prompt_differences(tmp_path):
    a = eval_run(tmp_path / "2026.11.25_10.00.00", variant="tiny")
    b = eval_run(tmp_path / "2026.11.25_11.00.00", variant="tiny_group_ppo",
                 end=[[0.5, 0.7], [0.8, 0.9], [0.2, 0.4]])
    html = build_report(a, compare=b)
    assert "<th>A: tiny</th><th>B: tiny_group_ppo</th>" in html  # the headline's columns
    assert "2026.11.25_10.00.00</th>" not in html and "2026.11.25_10.00.00:" not in html
    section = html.split("<h2>Per-prompt evaluation</h2>")[1].split("<h2>")[0]
    # B - A at the last evaluation, by hand: red 0.6 - 0.9 = -0.3, green 0.85 - 0.438 = +0.412, blue 0.3 - 0.3 = 0
    rows = re.findall(r"<tr[^>]*><td>([^<]+)</td>(?:<td>[^<]*</td>){4}<td>([^<]+)</td></tr>", section)
    assert rows == [("a red square", "-0.300"), ("a blue square", "+0.000"), ("a green square", "+0.412")]
    assert "mean over the 3 common prompts +0.037" in section  # (-0.3 + 0.412 + 0) / 3
    named = build_report(a, compare=b, names=["GRPO", "Group-PPO"])
    assert "<th>GRPO</th><th>Group-PPO</th>" in named
    with pytest.raises(ValueError, match="names: expected 2 labels"):
        build_report(a, compare=b, names=["only one"])
    # the cost row and the seconds to the target (the lower best evaluation: both reach it)
    assert "<th>cost per epoch</th><td>5.0 s of training" in html and "40 training calls" in html
    best_b = max(sum(map(sum, r)) / 6 for r in (START, [[0.5, 0.7], [0.8, 0.9], [0.2, 0.4]]))
    best_a = max(sum(map(sum, r)) / 6 for r in (START, END))
    assert f"seconds to eval &gt;= {min(best_a, best_b):.4f} (the lower best)" in html


def test_the_cli_takes_names_as_a_comma_list(tmp_path):
    from ddpo_group.cli import inspect_main

    a, b = eval_run(tmp_path / "a"), eval_run(tmp_path / "b", variant="tiny_ddpo")
    assert inspect_main([str(a), "--compare", str(b), "--names", "A,B", "--output", str(tmp_path / "c.html")]) == 0
    assert "<th>A</th><th>B</th>" in (tmp_path / "c.html").read_text()


def test_heat_maps_leave_out_flat_panels_and_share_one_scale(tmp_path):
    from ddpo_group.report.figures import flat_over_steps, step_scale

    rows_a = [{"epoch": e, "steps/adv_mean": [0.0, 0.0, 0.0], "steps/approx_kl": [0.0, 0.001 * e, 0.002]}
              for e in range(50)]
    rows_a[0]["steps/approx_kl"] = [2.5, 0.001, 0.002]  # one saturating cell in epoch 0
    rows_b = [{"epoch": e, "steps/adv_mean": [0.1, -0.2, 0.3], "steps/approx_kl": [0.003, 0.004, 0.001]}
              for e in range(50)]
    a, b = load_run(write_run(tmp_path / "a", rows_a)), load_run(write_run(tmp_path / "b", rows_b))
    assert flat_over_steps([a], "steps/adv_mean") and not flat_over_steps([a, b], "steps/adv_mean")
    low, high, note = step_scale([a, b], "steps/approx_kl")
    values = sorted(v for rows in (rows_a, rows_b) for r in rows for v in r["steps/approx_kl"])
    import numpy as np

    assert (low, high) == (pytest.approx(np.percentile(values, 2)), pytest.approx(np.percentile(values, 98)))
    assert note.startswith("robust scale") and "2.5" in note
    html = build_report(a.path)
    assert "Not drawn: advantage mean" in html


def test_eval_grid_captions_and_repeated_rows(tmp_path):
    import numpy as np
    from PIL import Image

    from ddpo_group.runs.grids import make_grid, save_epoch_samples

    images = np.zeros((3, 3, 4, 4))
    path = save_epoch_samples(tmp_path, 0, images, ["p", "q", "p"], [0.5, 0.25, 1.0], None, group_size=1,
                              prefix="eval")
    expected = make_grid([images[0], images[2], images[1]], 1, captions=["r=0.50", "r=1.00", "r=0.25"],
                         row_labels=["p", "(same prompt, same group as the row above) p", "q"])
    assert np.array_equal(np.asarray(Image.open(path)), np.asarray(expected))


def test_a_finished_run_leaves_no_lock_and_the_summary_prints_commands_that_run(tmp_path):
    import os
    import sys

    from ddpo_group.runs.metrics_log import inspect_command, phase_text
    from ddpo_group.runs.run_dir import RunDir
    from helpers import make_config

    run_dir, config = RunDir.resolve(make_config(tmp_path))
    run_dir.start(config, first_epoch=0)
    assert (tmp_path / "r" / ".lock").exists()
    run_dir.release()
    assert not (tmp_path / "r" / ".lock").exists()
    again = RunDir(str(tmp_path / "r"))
    again.lock()  # the directory can be locked again (a resume)
    again.release()
    command = inspect_command()
    assert command.endswith("ddpo-group-inspect") or command.endswith("inspect_run.py")
    executable = command.split()[-1] if command.endswith(".py") else command
    assert os.path.isfile(executable) or os.path.isfile(os.path.join(os.getcwd(), executable)), sys.executable
    assert phase_text({"sample": 6.0, "train": 40.0, "old_log_probs": 5.0}) == \
        "train 40 s (old_log_probs 5 s of it), sample 6 s"


def test_misleading_constant_curves_are_explained_and_a_target_needs_both_runs_to_rise(tmp_path):
    from ddpo_group.report.figures import constant_notes, plot_curves
    from ddpo_group.report.tables import kl_note, target_row

    rows = [{"epoch": e, "reward_mean": 0.5, "kl": 0.1, "group/efficiency_gain": 1.0, "group/threshold": 1 - e / 10}
            for e in range(3)]
    run = load_run(write_run(tmp_path / "gppo", rows, {"train": {"use_reference_model": True, "kl_type": "gaussian",
                                                                  "loss_agg_mode": "token-mean"}}))
    keys = [key for key, _ in plot_curves([run])]
    assert "group/efficiency_gain" not in keys and "group/threshold" in keys
    assert constant_notes([run])[0].startswith("group/efficiency_gain = 1 at every epoch, not drawn: N / K")
    assert "the mean over the trained (trajectory, step) pairs of the exact KL" in kl_note([run])
    # A falls below its first evaluation, B rises: no common target
    a = load_run(eval_run(tmp_path / "a", end=[[0.1, 0.1], [0.1, 0.1], [0.1, 0.1]]))
    b = load_run(eval_run(tmp_path / "b"))
    key, cells = target_row([a, b])
    assert key == "seconds to a common target" and cells[0].startswith("never rose")
