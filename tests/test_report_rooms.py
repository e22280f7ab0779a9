"""The report package (ddpo_group/report/): run directories written here by hand, as the trainer would, without
training; each expected value is computed in the test from the numbers it wrote."""

import json

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
