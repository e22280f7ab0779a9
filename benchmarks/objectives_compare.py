"""Issue 55's comparison: the new objectives beside GRPO + KL on the main job's task, several seeds each.

    python benchmarks/objectives_compare.py --jobs 15                     # 5 variants x 3 seeds, 15 runs at once
    python benchmarks/objectives_compare.py --collect                     # the table and summary.json from what ran
    python benchmarks/objectives_compare.py --variants tiny --seeds 42 --set num_epochs=1 --results /tmp/probe

VARIANTS (default tiny, tiny_dppo, tiny_grpo_guard, tiny_dgpo, tiny_dpo) are config/grpo.py variants of the main
job (`tiny`: GRPO + KL on the 18 big-square prompts of tiny-shapes, 40 epochs, fixed-noise evaluation of 18 x 8
images every 10 epochs) with only their objective changed; `tiny` is the baseline. A name config/grpo.py does not
have is refused in one line before anything runs. Each run trains in a process of its own on one torch thread
(OMP_NUM_THREADS=1; --jobs N runs at once) into RESULTS/runs/<variant>/seed_<seed>/ (its log beside it,
seed_<seed>.log), with --set FIELD=VALUE applied to every run (a probe: give it a --results of its own).

Results are never overwritten: a run whose directory holds finished.json is kept, not run again, and the table
counts it as an earlier run's (column "runs": new this invocation / kept from before); a directory with files
tracked by git is never touched; RESULTS/settings.json records the --set of its runs, and another --set there is
refused (a probe's runs do not mix with the comparison's). A run that fails (non-zero exit) makes the command
exit 1 after the table, naming it and its log.

From each run's metrics.jsonl:

    final            eval/reward_mean of the last evaluation (the final weights; fixed noise, 8 images per prompt)
    train_seconds    the sum over training epochs of time/sample + time/reward + time/advantages + time/train
                     + time/critic (evaluations and checkpoints excluded), one thread
    model_calls      denoiser evaluations in trajectory-step units, benchmarks/critic_compute.py's rules (sampling,
                     training forward + backward, the reference's forwards when the run logs ref/kl, the
                     recompute pass)
    to target        training seconds and model calls of the epochs before the first evaluation whose
                     eval/reward_mean reaches the target (default 0.75: docs/results.md, the main job's eval reward
                     at its 40 epochs, 0.756 at epoch 30 and 0.749 at 40, and its "epochs to 0.75"; at an
                     evaluation every 10 epochs, the first of epochs 10, 20, 30, 40 at or above it)
    ratio            a variant's median seconds (calls) to the target over tiny's median seconds (calls) to it;
                     a variant where at most half the seeds reach the target has none

The main job has no held-out evaluation (docs/results.md: it evaluates its 18 training prompts with fixed noise),
so there is no held-out column. Writes RESULTS/summary.json (every run's numbers, the table, the definitions, the
command) and prints the table as markdown: per variant median [min, max] over seeds. To commit a comparison, commit
RESULTS/summary.json and each run's config.json, finished.json and metrics.jsonl (not its checkpoints/ or samples/),
as benchmarks/results/scenes_study/ does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

DEFAULT_RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results", "objectives")
DEFAULT_VARIANTS = ("tiny", "tiny_dppo", "tiny_grpo_guard", "tiny_dgpo", "tiny_dpo")
BASELINE = "tiny"
TARGET = 0.75
TIME_KEYS = ("time/sample", "time/reward", "time/advantages", "time/train", "time/critic")
PROG = "objectives_compare.py"


class CompareError(ValueError):
    """A bad input of this command (the message is one line naming it)."""


def run_config(variant, seed, run_dir, overrides=()):
    """The config of one run: the variant, the seed, --set's FIELD=VALUE items, the run directory."""
    from ddpo_group.config import grpo
    from ddpo_group.config.fields import set_field

    config = grpo.get_config(variant)
    config.seed = seed
    for item in overrides:
        set_field(config, item)
    config.logdir, config.run_name = os.path.dirname(run_dir), os.path.basename(run_dir)
    config.overwrite = True  # only ever a directory without finished.json and without committed files (main)
    config.log_images_every = 0
    config.save_freq = 0  # the final checkpoint only (finished.json needs it)
    config.log_with = "none"
    return config


def run_one(variant, seed, run_dir, overrides=()):
    """Train one run in this process (`main` starts it in a process of its own)."""
    import torch

    torch.set_num_threads(1)
    from ddpo_group.training.trainer import Trainer

    Trainer(run_config(variant, seed, run_dir, overrides)).run()


def read_rows(run_dir):
    rows = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return rows


def _critic_compute():
    import importlib.util

    spec = importlib.util.spec_from_file_location("critic_compute",
                                                  os.path.join(REPO_ROOT, "benchmarks", "critic_compute.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_curve(rows):
    """[(epoch k, eval reward, model calls, training seconds)] of a run's evaluations; calls and seconds are those
    of the training epochs before k (epochs 0 .. k-1)."""
    calls = _critic_compute().training_calls(rows)
    training = [r for r in rows if "reward_mean" in r]
    curve = []
    for row in rows:
        if "eval/reward_mean" not in row:
            continue
        k = row["epoch"]
        seconds = sum(sum(r.get(key, 0.0) for key in TIME_KEYS) for r in training if r["epoch"] < k)
        curve.append((k, row["eval/reward_mean"], sum(c[0] for epoch, c in calls if epoch < k), seconds))
    return curve


def first_reaching(curve, target):
    """(model calls, seconds) at the first evaluation at or above `target`, or None."""
    return next(((calls, seconds) for _, reward, calls, seconds in curve if reward >= target - 1e-12), None)


def _spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def collect(results, variants, target=TARGET, new=()):
    """(runs, table) from the finished runs of `variants` under RESULTS/runs; `new`: the (variant, seed) pairs this
    invocation ran (the others are counted as kept from before)."""
    runs = []
    for variant in variants:
        root = os.path.join(results, "runs", variant)
        names = sorted(n for n in os.listdir(root) if n.startswith("seed_") and os.path.isdir(os.path.join(root, n))) \
            if os.path.isdir(root) else []
        for name in names:
            run_dir = os.path.join(root, name)
            if not os.path.exists(os.path.join(run_dir, "finished.json")):
                continue
            rows = read_rows(run_dir)
            curve = run_curve(rows)
            if not curve:
                continue
            seed = int(name[len("seed_"):])
            _, final, calls, seconds = curve[-1]
            hit = first_reaching(curve, target)
            runs.append({"variant": variant, "seed": seed, "final": final, "final_epoch": curve[-1][0],
                         "train_seconds": round(seconds, 3), "model_calls": calls,
                         "calls_to_target": None if hit is None else hit[0],
                         "seconds_to_target": None if hit is None else round(hit[1], 3),
                         "evaluations": [[k, r] for k, r, _, _ in curve], "new": (variant, seed) in set(new)})
    table = []
    for variant in variants:
        rows = [r for r in runs if r["variant"] == variant]
        if not rows:
            table.append({"variant": variant, "seeds": [], "runs": "not run"})
            continue
        hits = [r for r in rows if r["seconds_to_target"] is not None]
        enough = len(hits) * 2 > len(rows)
        table.append({
            "variant": variant, "seeds": [r["seed"] for r in rows],
            "runs": f"{sum(r['new'] for r in rows)} new / {sum(not r['new'] for r in rows)} kept",
            "final": _spread([r["final"] for r in rows]),
            "train_seconds": _spread([r["train_seconds"] for r in rows]),
            "model_calls": _spread([r["model_calls"] for r in rows]),
            "reached": f"{len(hits)}/{len(rows)}",
            "seconds_to_target": _spread([r["seconds_to_target"] for r in hits]) if enough else None,
            "calls_to_target": _spread([r["calls_to_target"] for r in hits]) if enough else None,
        })
    base = next((t for t in table if t["variant"] == BASELINE), None)
    for row in table:
        for key, ratio in (("seconds_to_target", "seconds_ratio"), ("calls_to_target", "calls_ratio")):
            mine, theirs = row.get(key), (base or {}).get(key)
            row[ratio] = mine["median"] / theirs["median"] if mine and theirs and theirs["median"] else None
    return runs, table


def render(table, target):
    def cell(spread, digits=3):
        if spread is None:
            return "-"
        return f"{spread['median']:.{digits}f} [{spread['min']:.{digits}f}, {spread['max']:.{digits}f}]"

    def ratio(value):
        return "-" if value is None else f"{value:.2f}"

    lines = [f"target: eval reward >= {target:.3f} (the main job's, docs/results.md); median [min, max] over seeds; "
             f"ratios: median to the target over {BASELINE}'s",
             "| variant | seeds | runs | final eval reward | reached | train s to target | model calls to target "
             f"| s ratio to {BASELINE} | calls ratio to {BASELINE} | train s (all epochs) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in table:
        if not row["seeds"]:
            lines.append(f"| {row['variant']} | - | not run | - | - | - | - | - | - | - |")
            continue
        lines.append(f"| {row['variant']} | {','.join(map(str, row['seeds']))} | {row['runs']} | {cell(row['final'])} "
                     f"| {row['reached']} | {cell(row['seconds_to_target'], 0)} | {cell(row['calls_to_target'], 0)} "
                     f"| {ratio(row['seconds_ratio'])} | {ratio(row['calls_ratio'])} | {cell(row['train_seconds'], 0)} |")
    return "\n".join(lines)


def write_json(path, document):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1)
    os.replace(tmp, path)


def committed_files(path):
    """Files under `path` that git tracks (empty outside a git checkout or without git)."""
    try:
        out = subprocess.run(["git", "ls-files", "--", os.path.abspath(path)], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def check_inputs(args):
    """(variants, seeds), every input checked before anything runs or is written: one-line CompareError."""
    from ddpo_group.config.grpo import VARIANTS

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise CompareError(f"--variants: unknown variant{'s' * (len(unknown) > 1)} {', '.join(unknown) or '(none)'} "
                           f"(config/grpo.py has no such variant); choose from the tiny ones: "
                           f"{', '.join(sorted(v for v in VARIANTS if v.startswith('tiny')))}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise CompareError(f"--seeds {args.seeds!r}: comma-separated whole numbers, e.g. 42,43,44") from None
    if not seeds:
        raise CompareError("--seeds: give at least one seed, e.g. 42,43,44")
    if args.jobs < 1:
        raise CompareError(f"--jobs {args.jobs}: a whole number >= 1")
    if args.set:  # a misspelt field is one line here, not a traceback in every run's log
        from ddpo_group.config.registry import ConfigError

        try:
            run_config(variants[0], seeds[0], os.path.join(args.results, "check"), args.set)
        except ConfigError as err:
            raise CompareError(" ".join(str(err).split())) from None
    return variants, seeds


def launch(args, variants, seeds):
    """Run every (variant, seed) without a finished run, --jobs at a time; returns (ran, failed, seconds): the
    pairs run now, the failed ones (with their logs), the wall seconds of each run."""
    settings_path = os.path.join(args.results, "settings.json")
    settings = {"set": list(args.set)}
    if os.path.exists(settings_path):
        with open(settings_path, encoding="utf-8") as f:
            earlier = json.load(f)
        if earlier.get("set") != settings["set"]:
            raise CompareError(f"--results {args.results}: its runs were made with --set {earlier.get('set')}, not "
                               f"{settings['set']}; give another --results for a probe")
    pending, kept = [], []
    for variant in variants:
        for seed in seeds:
            run_dir = os.path.join(args.results, "runs", variant, f"seed_{seed}")
            if os.path.exists(os.path.join(run_dir, "finished.json")):
                kept.append((variant, seed))
            elif os.path.exists(run_dir) and committed_files(run_dir):
                raise CompareError(f"{run_dir}: unfinished, but git tracks files in it (committed results are never "
                                   "overwritten); give another --results")
            else:
                pending.append((variant, seed))
    for variant, seed in kept:
        print(f"kept {variant} seed {seed}: finished earlier (counted as kept, not as this invocation's run)")
    os.makedirs(args.results, exist_ok=True)
    write_json(settings_path, settings)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    running, ran, failed, seconds = [], [], [], {}
    while pending or running:
        while pending and len(running) < args.jobs:
            variant, seed = pending.pop(0)
            run_dir = os.path.join(args.results, "runs", variant, f"seed_{seed}")
            os.makedirs(os.path.dirname(run_dir), exist_ok=True)
            log = open(run_dir + ".log", "w", encoding="utf-8")
            print(f"start {variant} seed {seed}", flush=True)
            command = [sys.executable, os.path.abspath(__file__), "--run-one", variant, str(seed), run_dir] + \
                [f"--set={item}" for item in args.set]
            running.append((variant, seed, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT),
                            log, time.time()))
        time.sleep(0.5)
        for item in list(running):
            variant, seed, process, log, began = item
            if process.poll() is None:
                continue
            log.close()
            running.remove(item)
            seconds[(variant, seed)] = time.time() - began
            print(f"done {variant} seed {seed}: exit {process.returncode} after {seconds[(variant, seed)]:.0f} s",
                  flush=True)
            (failed if process.returncode else ran).append((variant, seed))
    return ran, failed, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated config/grpo.py variants (default: {','.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each)")
    parser.add_argument("--results", default=DEFAULT_RESULTS)
    parser.add_argument("--collect", action="store_true", help="only build the table and summary.json from finished runs")
    parser.add_argument("--target", type=float, default=TARGET, help=f"eval reward target (default {TARGET})")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field of every run (a JSON value; repeatable), for a probe in its own "
                             "--results, e.g. --set num_epochs=1")
    parser.add_argument("--run-one", nargs=3, metavar=("VARIANT", "SEED", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        variant, seed, run_dir = args.run_one
        return run_one(variant, int(seed), run_dir, args.set)
    try:
        variants, seeds = check_inputs(args)
        ran, failed, seconds = ([], [], {}) if args.collect else launch(args, variants, seeds)
    except CompareError as err:
        sys.exit(f"{PROG}: error: {err}")
    runs, table = collect(args.results, variants, args.target, new=ran)
    for run in runs:
        if (run["variant"], run["seed"]) in seconds:
            run["wall_seconds"] = round(seconds[(run["variant"], run["seed"])], 1)
    os.makedirs(args.results, exist_ok=True)
    write_json(os.path.join(args.results, "summary.json"), {
        "target": args.target, "baseline": BASELINE, "variants": variants, "seeds": seeds, "set": list(args.set),
        "table": table, "runs": runs,
        "definitions": __doc__.split("From each run's metrics.jsonl:")[1].split("The main job has")[0].strip(),
        "command": f"python benchmarks/{PROG} " + " ".join(argv if argv is not None else sys.argv[1:]),
    })
    print(render(table, args.target))
    if failed:
        logs = ", ".join(os.path.join(args.results, "runs", v, f"seed_{s}.log") for v, s in failed)
        sys.exit(f"{PROG}: {len(failed)} run{'s' * (len(failed) > 1)} failed: {logs}")
    return table


if __name__ == "__main__":
    main()
