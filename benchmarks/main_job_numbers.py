"""Check the documented main-job numbers (docs/results.md) against a run of the current code.

    python benchmarks/main_job_numbers.py RUN_DIR        # compare a finished main-job run directory
    python benchmarks/main_job_numbers.py --run          # run the main job first (README.md's command, 40
                                                         # epochs; into a new runs/main_job_check_XXXX/), then compare

It reads the fixed-noise evaluation docs/results.md states for the main job (the Results table's "main job" row:
`0.554 (epoch 0, ...) -> 0.597 (10) -> ...`) and the run's eval/reward_mean at those epochs, prints both side by
side, and exits 1 when one differs at the page's precision (3 decimals), 2 on bad input. The run must be
README.md's command (config/grpo.py:tiny, one torch thread): with another thread count the numbers differ in their
last digits (torch's CPU reductions split the work by thread), see docs/results.md, "Reproducing the numbers".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^\| main job: .*$", re.M)
POINT = re.compile(r"(\d+\.\d+) \((?:epoch )?(\d+)[,)]")


def readme_numbers(readme_text: str) -> dict[int, float]:
    """{epoch: eval/reward_mean} of the Results table's main-job row, e.g. {0: 0.554, 10: 0.597, ...}."""
    row = ROW.search(readme_text)
    if row is None:
        raise ValueError("no '| main job: ...' row in the Results table (docs/results.md)")
    points = {int(epoch): float(value) for value, epoch in POINT.findall(row.group(0))}
    if not points:
        raise ValueError("the Results table's main-job row states no 'VALUE (EPOCH)' evaluation")
    return points


def run_numbers(run_dir: str) -> dict[int, float]:
    """{epoch: eval/reward_mean} of a run directory's metrics.jsonl (the final weights' row at its epoch)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found: pass a run directory of the main job")
    numbers = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if "eval/reward_mean" in row:
                    numbers[int(row["epoch"])] = float(row["eval/reward_mean"])
    return numbers


def compare(stated: dict[int, float], measured: dict[int, float], decimals: int = 3) -> tuple[list[str], bool]:
    """(lines of a table, whether every stated number matches the measured one rounded to `decimals`)."""
    lines, same = [f"{'epoch':>5}  {'stated':>8}  {'this run':>10}"], True
    for epoch, value in sorted(stated.items()):
        got = measured.get(epoch)
        ok = got is not None and round(got, decimals) == round(value, decimals)
        same &= ok
        shown = "missing" if got is None else f"{got:.4f}"
        lines.append(f"{epoch:>5}  {value:>8.{decimals}f}  {shown:>10}  {'ok' if ok else 'DIFFERS'}")
    return lines, same


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="?", help="a finished run directory of the main job")
    parser.add_argument("--run", action="store_true", help="run the main job first, README.md's command (minutes)")
    parser.add_argument("--readme", default=os.path.join(ROOT, "docs", "results.md"),
                        help="the page whose Results table states the numbers (default docs/results.md)")
    args = parser.parse_args(argv)
    try:
        stated = readme_numbers(open(args.readme, encoding="utf-8").read())
        run_dir = args.run_dir
        if args.run:
            # a new folder of its own under runs/ (never config.overwrite: a runs/main_job_check the user keeps, or
            # an earlier check, is not written over)
            os.makedirs(os.path.join(ROOT, "runs"), exist_ok=True)
            logdir = tempfile.mkdtemp(prefix="main_job_check_", dir=os.path.join(ROOT, "runs"))
            run_dir = os.path.join(logdir, "main_job")
            print(f"main_job_numbers: training the main job into {run_dir}", file=sys.stderr, flush=True)
            accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
            env = dict(os.environ)
            env.pop("OMP_NUM_THREADS", None)  # as README.md runs it: the launcher's one thread
            subprocess.run([accelerate, "launch", "-q", "--config_file", "config/accelerate.yaml", "scripts/train.py",
                            "--config", "config/grpo.py:tiny", f"--config.logdir={logdir}",
                            "--config.run_name=main_job"], cwd=ROOT, env=env, check=True)
            if not os.path.exists(os.path.join(run_dir, "finished.json")):
                raise ValueError(f"the main job in {run_dir} did not finish (no finished.json)")
        if run_dir is None:
            raise ValueError("pass a run directory, or --run")
        lines, same = compare(stated, run_numbers(run_dir))
    except (OSError, ValueError, subprocess.CalledProcessError) as err:
        print(f"main_job_numbers: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print("the documented main-job numbers are this run's" if same else
          "the documented main-job numbers are NOT this run's: update the Results row of docs/results.md (and the "
          "set-up lines of README.md and docs/getting_started.md)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
