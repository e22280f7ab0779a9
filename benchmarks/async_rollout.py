"""Issue 44 item 4: reward per wall second of train.async_rollout against the synchronous loop (docs/async_rollout.md).

    python benchmarks/async_rollout.py --config tiny --epochs 10 --seeds 0,1,2 --threads 2 \\
        --output benchmarks/results/async_rollout/result.json

For each seed, the variant trained `--epochs` epochs from the same seed in each of `--modes`: sync (the synchronous
loop), async (train.async_rollout=True: the rollout in a thread), async_process (its rollout in a process of its
own), one after the other in this process, with the same torch thread count (`--threads`: the
synchronous loop uses them all, the async run splits them between its sampler and its loop), evaluated every
`--eval-freq` epochs and at the end (fixed noise, `--eval-images` images per prompt). Throw-away run directories
under --logdir (each LOGDIR/<mode>_seed<seed> must not exist yet; default: a temporary folder). The default
--output holds committed results: a run that replaces them names it. A run that fails or stops before its end ends
the benchmark with exit status 1.

Seconds: the wall clock from the start of the epochs to the end of each epoch's row, less the evaluations' seconds
(time/eval: measurement, not training). An async run's evaluation first waits for its pending rollout, so that it
runs alone as in the synchronous run and the rollout's seconds stay counted. An evaluation at epoch e (the weights
after e epochs) is placed at the end of epoch e - 1.

Per run: final_eval (the last evaluation's reward), seconds, gain_per_second = (final_eval - first eval) / seconds,
mean_reward_over_time = the area under eval reward vs seconds over [0, the synchronous run's seconds] divided by
that span (a run that finished earlier keeps its last reward to the end: it could only have improved), and every
evaluation (epoch, seconds, reward). The table: mean +- std over the seeds. The load average (os.getloadavg) before
and after each run is written beside it: on a shared machine a run's seconds stretch with the load.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_outputs import BenchmarkError, fail, fresh_run_dir, refuse_committed_default, require_finished  # noqa: E402

MODES = ("sync", "async", "async_process")  # async_process: train.async_rollout_processes=1
DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                              "async_rollout", "result.json")


def load_variant(name):
    import grpo

    return grpo.get_config(name)


def run_once(args, seed, mode, logdir):
    """One training run; returns its record (evaluations with their seconds, per-epoch seconds, loads)."""
    from ddpo_group.training.trainer import Trainer

    config = load_variant(args.config)
    config.seed = seed
    config.num_epochs = args.epochs
    config.eval_freq = args.eval_freq
    config.eval_images_per_prompt = args.eval_images
    config.save_freq = 0
    config.log_images_every = 0
    config.logdir = logdir
    config.run_name = f"{mode}_seed{seed}"
    config.train.async_rollout = mode != "sync"
    config.train.async_rollout_processes = int(mode == "async_process")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    trainer = Trainer(config)
    ends, rows = {}, {}
    log_epoch = trainer.log_epoch

    def timed_log_epoch(epoch, samples, metrics):
        log_epoch(epoch, samples, metrics)
        ends[epoch] = time.perf_counter()
        rows[epoch] = dict(metrics)

    trainer.log_epoch = timed_log_epoch
    evaluate = trainer.evaluate

    def evaluate_alone(epoch, metrics):
        # an async run's pending rollout ends first: the evaluation runs alone, as in the synchronous run, and the
        # rollout's seconds stay in the training's (time/eval, left out, is the evaluation's only)
        rollout = trainer.async_rollout
        if rollout is not None and rollout.pending is not None:
            rollout.pending[2].result()
        evaluate(epoch, metrics)

    trainer.evaluate = evaluate_alone
    start = time.perf_counter()
    run_dir = trainer.run()
    require_finished(run_dir)  # a stopped run's seconds are not its epochs'
    from ddpo_group.report.run import read_metrics

    metrics = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    eval_seconds = {row["epoch"]: row.get("time/eval", 0.0) for row in metrics if "eval/reward_mean" in row}
    # seconds at the end of each epoch, less the evaluations made up to then
    seconds, spent = {}, 0.0
    for epoch in sorted(ends):
        spent += eval_seconds.get(epoch, 0.0)
        seconds[epoch] = ends[epoch] - start - spent
    evals = [{"epoch": row["epoch"], "seconds": seconds.get(row["epoch"] - 1, 0.0),
              "reward": row["eval/reward_mean"]} for row in metrics if "eval/reward_mean" in row]
    return {
        "seed": seed, "mode": mode, "seconds": seconds[max(seconds)], "evals": evals,
        "reward_mean": [rows[e]["reward_mean"] for e in sorted(rows)],
        "epoch_seconds": [seconds[e] - seconds.get(e - 1, 0.0) for e in sorted(seconds)],
        "wait_seconds": [rows[e].get("async/wait_seconds") for e in sorted(rows)],
        # what overlaps: the rollout's own seconds (sampling + rewards) and the update's (time/train)
        "rollout_seconds": [rows[e].get("async/rollout_seconds", rows[e].get("time/sample", 0.0)
                                        + rows[e].get("time/reward", 0.0)) for e in sorted(rows)],
        "train_seconds": [rows[e].get("time/train") for e in sorted(rows)],
        "load_before": load_before, "load_after": os.getloadavg(),
    }


def mean_reward_over(evals, horizon):
    """Area under the eval reward (a step held from each evaluation to the next) over [0, horizon] / horizon."""
    points = sorted((e["seconds"], e["reward"]) for e in evals)
    area = 0.0
    for (t, reward), following in zip(points, points[1:] + [(horizon, None)]):
        end = min(following[0], horizon)
        if end > t:
            area += reward * (end - t)
    return area / horizon


def summarise(records):
    """Per-run derived numbers (in place) and {mode: {name: (mean, std)}} over the seeds."""
    by_seed = {}
    for record in records:
        by_seed.setdefault(record["seed"], {})[record["mode"]] = record
    for pair in by_seed.values():
        horizon = pair["sync"]["seconds"] if "sync" in pair else max(r["seconds"] for r in pair.values())
        for record in pair.values():
            evals = record["evals"]
            record["final_eval"] = evals[-1]["reward"]
            record["gain_per_second"] = (evals[-1]["reward"] - evals[0]["reward"]) / record["seconds"]
            record["mean_reward_over_time"] = mean_reward_over(evals, horizon)
    summary = {}
    for mode in MODES:
        mine = [r for r in records if r["mode"] == mode]
        if not mine:
            continue
        summary[mode] = {}
        for name in ("final_eval", "seconds", "gain_per_second", "mean_reward_over_time"):
            values = [r[name] for r in mine]
            summary[mode][name] = (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
    return summary


def table(summary, records):
    lines = ["| mode | final eval reward | seconds | eval gain / s | mean eval reward over the sync run's seconds |",
             "|---|---|---|---|---|"]
    for mode, numbers in summary.items():
        cells = [f"{numbers[n][0]:.4g} +- {numbers[n][1]:.2g}" for n in
                 ("final_eval", "seconds", "gain_per_second", "mean_reward_over_time")]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += ["", "| seed | mode | eval reward by epoch (seconds) | load before / after |", "|---|---|---|---|"]
    for r in records:
        evals = ", ".join(f"{e['epoch']}: {e['reward']:.3f} ({e['seconds']:.0f} s)" for e in r["evals"])
        lines.append(f"| {r['seed']} | {r['mode']} | {evals} | {r['load_before'][0]:.1f} / {r['load_after'][0]:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="the variant of config/grpo.py")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--modes", default="sync,async,async_process")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of a run (async: split in two)")
    parser.add_argument("--eval-freq", type=int, default=5)
    parser.add_argument("--eval-images", type=int, default=4, help="evaluation images per prompt")
    parser.add_argument("--logdir", default=None, help="run directories LOGDIR/<mode>_seed<seed>, which must not "
                        "exist yet (default: a temporary directory)")
    parser.add_argument("--output", default=None, help="the JSON (default benchmarks/results/async_rollout/result.json, committed: replaced "
                        "only when --output names it)")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: {unknown} not among {list(MODES)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    given, args.output = args.output is not None, args.output or DEFAULT_OUTPUT
    try:
        refuse_committed_default("--output", args.output, given)
        for seed in seeds if args.logdir else []:  # before the first run: none of them writes over a folder
            for mode in modes:
                fresh_run_dir("--logdir", os.path.join(os.path.abspath(args.logdir), f"{mode}_seed{seed}"))
    except BenchmarkError as err:
        parser.error(str(err))
    records = []
    with tempfile.TemporaryDirectory(prefix="async_rollout_") as tmp:
        for seed in seeds:
            for mode in modes:
                try:
                    record = run_once(args, seed, mode, args.logdir or tmp)
                except BenchmarkError as err:  # the runs before it are in --output already
                    fail(parser.prog, err, code=1)
                records.append(record)
                print(f"seed {seed} {mode}: {record['seconds']:.1f} s, evals "
                      f"{[round(e['reward'], 4) for e in record['evals']]}, load {record['load_after'][0]:.1f}",
                      flush=True)
                result = write_result(args, records)  # after each run: a cut-short measurement keeps its runs
    print(result["table"])
    return result


def write_result(args, records):
    summary = summarise(records)
    result = {"config": args.config, "epochs": args.epochs, "threads": args.threads, "eval_freq": args.eval_freq,
              "eval_images_per_prompt": args.eval_images, "machine": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "torch": torch.__version__, "summary": summary, "runs": records,
              "table": table(summary, records)}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tmp_path = args.output + ".tmp"
    with open(tmp_path, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp_path, args.output)
    return result


if __name__ == "__main__":
    main()
