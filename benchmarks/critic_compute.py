"""Issue 35's same-budget comparison: each arm's evaluation against its compute in model calls, and the targets.

    python benchmarks/critic_compute.py RUNS.json [RUNS2.json ...] --free free --grpo grpo_kl \\
        --critic window,everywhere --output benchmarks/results/critic_study/critic_compute.json

RUNS.json: bench_training.py's bench_seeds.json (or .json.gz) files; their runs are merged by label and seed.
Per training epoch, from the metrics each run logged (metrics.jsonl's rows), in trajectory-step units (one
denoiser evaluation of one trajectory at one step; classifier-free guidance is the same for every arm and counted
once):

    sampling      num_samples x T                  every step of every trajectory, ODE steps included (a group
                                                   sharing its prefix still computes it once per trajectory)
    training      num_samples x unet_steps_per_sample x --inner-epochs   forward + backward passes, each one call
    reference     the training count, when the run logged ref/kl (a no-grad forward of pi_ref per trained step)
    recompute     the pass that recomputes pi_old for the micro-batches after the first optimizer step:
                  num_samples x train/recompute_steps_per_sample when logged; for runs logged before that
                  metric, the training count x (1 - 1/S), S = the epoch's optimizer steps (the change of
                  train/global_step + train/skipped_steps), the micro-batches being equal
    model calls   the sum of the four
    reward calls  num_samples + critic/anchor_decodes x num_processes (the anchor decodes and scores x0_hat at each
                  step it values); the ValueNetwork's own calls (a small conv net) are in the seconds only

An evaluation at epoch k follows k training epochs (epochs 0 .. k-1): its calls are theirs. Seconds are the runs'
training seconds (bench/wall_seconds: evaluation excluded). The table: final evaluation (median [min, max] and the
sample standard deviation over seeds), model calls per epoch, model calls and seconds until the first evaluation at
or above --target, its fraction of --grpo's seconds (same seed), the evaluation at --free's total calls (the last
evaluation within them). The targets (issue 35):

    calls         an arm of --critic reaches --free's median final evaluation with at most 70 % of --free's total
                  model calls (median over seeds of its calls to reach it), or
    equal calls   its median evaluation at --free's total calls is at least one seed standard deviation (of --free's
                  final evaluations) above --free's median final evaluation
    time          some arm reaches --target in at most 15 % of --grpo's seconds to --target (median of per-seed
                  fractions)
"""

import argparse
import gzip
import json
import os
import statistics
import sys

CALLS_FRACTION, TIME_FRACTION = 0.70, 0.15


def load_runs(paths):
    """{label: {seed: rows}} merged from bench_seeds.json files (later files win a (label, seed) pair)."""
    runs = {}
    for path in paths:
        with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
            part = json.load(f)
        for label, by_seed in part["runs"].items():
            runs.setdefault(label, {}).update({int(seed): rows for seed, rows in by_seed.items()})
    return runs


def epoch_calls(row, steps=None, optimizer_steps=None, inner_epochs=1):
    """(model calls, reward calls) of one training epoch's metrics row (module docstring). steps: the run's number
    of denoising steps for a row without steps/trained (a critic warm-up epoch, a forward objective's epoch);
    optimizer_steps: the epoch's optimizer steps, for a row without train/recompute_steps_per_sample."""
    n = row["num_samples"]
    steps = len(row.get("steps/trained") or []) or steps or 0
    trained = n * row.get("train/unet_steps_per_sample", 0.0) * inner_epochs
    model = n * steps + trained
    model += trained if "ref/kl" in row else 0
    if "train/recompute_steps_per_sample" in row:
        model += n * row["train/recompute_steps_per_sample"]
    elif "time/old_log_probs" in row and optimizer_steps:
        model += trained * (1.0 - 1.0 / optimizer_steps)
    rewards = n + row.get("critic/anchor_decodes", 0) * row.get("num_processes", 1)
    return model, rewards


def training_calls(rows, inner_epochs=1):
    """[(epoch, (model calls, reward calls))] of a run's training rows, in epoch order (module docstring)."""
    training = sorted((r for r in rows if "reward_mean" in r), key=lambda r: r["epoch"])
    steps = max((len(r.get("steps/trained") or []) for r in training), default=0)
    out, before = [], 0.0
    for row in training:
        done = row.get("train/global_step", 0) + row.get("train/skipped_steps", 0)
        out.append((row["epoch"], epoch_calls(row, steps, done - before, inner_epochs)))
        before = done
    return out


def run_curve(rows, inner_epochs=1):
    """[(epoch k, eval reward, model calls, reward calls, training seconds)] of one run's evaluations."""
    training = sorted((r for r in rows if "reward_mean" in r), key=lambda r: r["epoch"])
    calls = training_calls(rows, inner_epochs)
    out = []
    for row in rows:
        if "eval/reward_mean" not in row:
            continue
        k = row["epoch"]
        before = [c for epoch, c in calls if epoch < k]
        seconds = [r for r in training if r["epoch"] < k][-1]["bench/wall_seconds"] if before else 0.0
        out.append((k, row["eval/reward_mean"], sum(c[0] for c in before), sum(c[1] for c in before), seconds))
    return out


def first_reaching(curve, value):
    """The first evaluation at or above value: (model calls, seconds), or None."""
    return next(((calls, seconds) for _, reward, calls, _, seconds in curve if reward >= value - 1e-12), None)


def at_calls(curve, budget):
    """The reward of the last evaluation whose calls are within budget (None: none is)."""
    within = [reward for _, reward, calls, _, _ in curve if calls <= budget + 1e-9]
    return within[-1] if within else None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values):
    values = [v for v in values if v is not None]
    return {"median": _median(values), "min": min(values) if values else None, "max": max(values) if values else None,
            "n": len(values)}


def compare(runs, free, grpo, critic, target=0.75, inner_epochs=1):
    """The table's numbers and the targets' verdicts (module docstring)."""
    curves = {label: {seed: run_curve(rows, inner_epochs) for seed, rows in by_seed.items()}
              for label, by_seed in runs.items()}
    free_finals = [c[-1][1] for c in curves[free].values()]
    free_final = _median(free_finals)
    free_std = statistics.stdev(free_finals) if len(free_finals) > 1 else 0.0
    free_calls = _median([c[-1][2] for c in curves[free].values()])
    grpo_seconds = {seed: (first_reaching(c, target) or (None, None))[1] for seed, c in curves.get(grpo, {}).items()}
    arms = {}
    for label, by_seed in curves.items():
        finals = [c[-1][1] for c in by_seed.values()]
        reach = {seed: first_reaching(c, target) for seed, c in by_seed.items()}
        reach_free = [first_reaching(c, free_final) for c in by_seed.values()]
        fractions = [reach[s][1] / grpo_seconds[s] for s in by_seed
                     if reach[s] is not None and grpo_seconds.get(s)]
        per_epoch = [c for rows in runs[label].values() for _, c in training_calls(rows, inner_epochs)]
        arms[label] = {
            "seeds": sorted(by_seed),
            "final": _spread(finals),
            "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "model_calls_per_epoch": _median([c[0] for c in per_epoch]),
            "reward_calls_per_epoch": _median([c[1] for c in per_epoch]),
            "reached_target": sum(r is not None for r in reach.values()),
            "calls_to_target": _spread([r[0] for r in reach.values() if r is not None]),
            "seconds_to_target": _spread([r[1] for r in reach.values() if r is not None]),
            "fraction_of_grpo_seconds": _spread(fractions),
            "reached_free_final": sum(r is not None for r in reach_free),
            "calls_to_free_final": _spread([r[0] for r in reach_free if r is not None]),
            "eval_at_free_calls": _spread([at_calls(c, free_calls) for c in by_seed.values()]),
            "curves": {str(seed): c for seed, c in by_seed.items()},
        }
    verdicts = []
    for label in critic:
        arm = arms[label]
        # a median over all seeds: a seed that never reaches it counts as never (more than free's calls)
        reached = [first_reaching(c, free_final) for c in curves[label].values()]
        calls = _median([float("inf") if r is None else r[0] for r in reached]) if reached else None
        at_equal = arm["eval_at_free_calls"]["median"]
        verdicts.append({
            "arm": label,
            "calls_to_free_final_fraction": None if calls is None or calls == float("inf") else calls / free_calls,
            "calls_met": calls is not None and calls <= CALLS_FRACTION * free_calls,
            "eval_at_free_calls": at_equal,
            "equal_calls_met": at_equal is not None and at_equal >= free_final + free_std,
        })
    best_time = min((a["fraction_of_grpo_seconds"]["median"] for a in arms.values()
                     if a["fraction_of_grpo_seconds"]["median"] is not None), default=None)
    return {
        "free": free, "grpo": grpo, "critic": list(critic), "target": target,
        "free_final_median": free_final, "free_final_std": free_std, "free_total_calls": free_calls,
        "arms": arms, "critic_verdicts": verdicts,
        "critic_wins": any(v["calls_met"] or v["equal_calls_met"] for v in verdicts),
        "best_fraction_of_grpo_seconds": best_time,
        "time_met": best_time is not None and best_time <= TIME_FRACTION,
        "limits": {"calls_fraction": CALLS_FRACTION, "time_fraction": TIME_FRACTION},
    }


def render(result):
    def cell(s, spec=".3f"):
        if s["median"] is None:
            return "-"
        return f"{s['median']:{spec}} [{s['min']:{spec}}, {s['max']:{spec}}]"

    target, free = result["target"], result["free"]
    lines = [
        f"# Same-budget comparison (median [min, max] over seeds); reference critic-free arm: {free} "
        f"(final {result['free_final_median']:.3f}, seed std {result['free_final_std']:.3f}, "
        f"{result['free_total_calls']:,.0f} model calls)",
        "",
        f"| arm | seeds | eval final | seed std | model calls / epoch | reward calls / epoch | calls to {target} (reached) "
        f"| seconds to {target} | / {result['grpo']} seconds | calls to {free}'s final (reached) | eval at {free}'s calls |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, a in result["arms"].items():
        n = len(a["seeds"])
        lines.append(
            f"| {label} | {n} | {cell(a['final'])} | {a['final_std']:.3f} | {a['model_calls_per_epoch']:,.0f} | "
            f"{a['reward_calls_per_epoch']:,.0f} | {cell(a['calls_to_target'], ',.0f')} ({a['reached_target']}/{n}) | "
            f"{cell(a['seconds_to_target'], '.1f')} | {cell(a['fraction_of_grpo_seconds'], '.2f')} | "
            f"{cell(a['calls_to_free_final'], ',.0f')} ({a['reached_free_final']}/{n}) | {cell(a['eval_at_free_calls'])} |"
        )
    lines += ["", "Targets (issue 35):", ""]
    for v in result["critic_verdicts"]:
        fraction, equal = v["calls_to_free_final_fraction"], v["eval_at_free_calls"]
        lines.append(
            f"- {v['arm']}: calls to {free}'s final evaluation "
            f"{'never (median)' if fraction is None else f'{fraction:.2f} of its calls'} "
            f"(limit {result['limits']['calls_fraction']:.2f}: {'met' if v['calls_met'] else 'not met'}); "
            f"at equal calls {'-' if equal is None else f'{equal:.3f}'} "
            f"vs {result['free_final_median']:.3f} + {result['free_final_std']:.3f} "
            f"({'met' if v['equal_calls_met'] else 'not met'})"
        )
    best = result["best_fraction_of_grpo_seconds"]
    lines.append(
        f"- fastest arm to {target}: {'-' if best is None else f'{best:.2f}'} of {result['grpo']}'s seconds "
        f"(limit {result['limits']['time_fraction']:.2f}: {'met' if result['time_met'] else 'not met'})"
    )
    lines.append(f"- a critic design wins: {'yes' if result['critic_wins'] else 'no'}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="bench_seeds.json files (or .json.gz)")
    parser.add_argument("--free", required=True, help="label of the best critic-free arm (the reference)")
    parser.add_argument("--grpo", default="grpo_kl", help="label of the GRPO + KL main job (the time target)")
    parser.add_argument("--critic", required=True, help="comma-separated labels of the arms with a critic")
    parser.add_argument("--target", type=float, default=0.75)
    parser.add_argument("--inner-epochs", type=int, default=1, help="train.num_inner_epochs of the runs (the logged "
                        "unet_steps_per_sample is per pass over the samples)")
    parser.add_argument("--output", required=True, help="JSON path; the table also goes beside it as .md")
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    critic = [label for label in args.critic.split(",") if label]
    missing = [label for label in [args.free, *critic] if label not in runs]
    if missing:
        sys.exit(f"critic_compute: no runs labelled {missing} in {args.runs} (labels there: {sorted(runs)})")
    result = compare(runs, args.free, args.grpo, critic, args.target, args.inner_epochs)
    result["command"] = "python benchmarks/critic_compute.py " + " ".join(argv if argv is not None else sys.argv[1:])
    markdown = render(result)
    print(markdown)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    for path, text in ((args.output, json.dumps(result, indent=1)), (os.path.splitext(args.output)[0] + ".md", markdown)):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
