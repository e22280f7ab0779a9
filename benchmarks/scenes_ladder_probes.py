"""One rung-b case of the scenes ladder (benchmarks/scenes_ladder.py) under several probes of its training, side by
side: which change to the trainer moves the case's strict-correct, and where each run's policy gradient fell.

    python benchmarks/scenes_ladder_probes.py --case two_object --seed 42 \\
        --probe "as shipped=benchmarks/results/scenes_ladder" \\
        --probe "warm-up 20 steps=benchmarks/results/scenes_ladder_probe_warmup20" \\
        --probe "last 2 steps untrained=benchmarks/results/scenes_ladder_probe_skip2" \\
        --probe "grpo_guard=benchmarks/results/scenes_ladder_probe_guard" \\
        --probe "strict reward=benchmarks/results/scenes_ladder_probe_strict" \\
        --output benchmarks/results/scenes_ladder_probes/two_object_seed42

Each --probe is LABEL=RESULTS, a ladder results folder whose runs/b/<family>/<case>/seed_<s>/metrics.jsonl is read
(a run stopped before its last epoch is read as far as it went, and says so). Prints a table and writes OUTPUT.json
(per probe: the epochs run, strict-correct and training reward per epoch, the approximate KL of each epoch's update,
the KL to the reference, each denoising step's mean share of the policy gradient's norm, and the lowest, best
3-epoch mean and last strict-correct) and OUTPUT.png (strict-correct and training reward per epoch, a line per
probe; the per-step gradient share as bars).

--steps also prints the sampler's per-step standard deviation of the family's base (DDIM with eta 1 for the UNet,
the variant's 10 steps), the scale every step's log-probability is measured on: a step of std s weighs an error
in its mean by 1 / s^2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from scenes_ladder import TARGET, WINDOW, best_window, run_dir_of, strict_key  # noqa: E402  (the ladder's rules and folders)


def read_run(results, family, case, seed):
    """The run's metrics rows that close an epoch (they carry the strict-correct), and whether it finished."""
    run_dir = run_dir_of(results, "b", family, case, seed)
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"--probe {results}: no {os.path.relpath(path, REPO_ROOT)} (run the ladder's case first)")
    with open(path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    key = strict_key(rows)  # the null control's true verdicts have their own key
    # a forward-process objective (DiffusionNFT, AWM) has no per-step policy gradient: its rows carry no shares
    forward = any("forward/old_decay" in r for r in rows)
    rows = [dict(r, strict_correct=r[key]) for r in rows if key in r and ("steps/grad_share" in r or forward)]
    return rows, os.path.isfile(os.path.join(run_dir, "finished.json"))


def summarise(label, rows, finished):
    strict = [r["strict_correct"] for r in rows]
    best = best_window(strict)  # the ladder's own window; a run shorter than it: its sum over the window's length
    shares = [r["steps/grad_share"] for r in rows if "steps/grad_share" in r]
    mean_share = []
    for k in range(len(shares[0]) if shares else 0):  # none: a forward-process objective's run
        values = [s[k] for s in shares if s[k] is not None]
        mean_share.append(sum(values) / len(values) if values else None)
    return {"label": label, "epochs": len(rows), "finished": finished, "strict_correct": strict,
            "reward": [r["reward_mean"] for r in rows], "approx_kl": [r.get("approx_kl") for r in rows],
            "ref_kl": [r.get("ref/kl") for r in rows], "grad_share_mean": mean_share,
            "strict_first": strict[0], "strict_last": strict[-1], "strict_lowest": min(strict),
            "strict_best_window": best[0] if best else sum(strict) / WINDOW}


def ddim_step_stds(model="tiny-scenes", num_steps=10):
    """[(t, t_prev, std)] of DDIM with eta 1 on the model's scheduler at num_steps: the alphas the trainer's own
    step takes (ddpo_group.diffusion.ddim._scheduler_alphas), in diffusers' variance formula."""
    import torch
    from diffusers import DDIMScheduler

    from ddpo_group.diffusion.ddim import _scheduler_alphas
    from ddpo_group.diffusion.loading import shipped_dir

    scheduler = DDIMScheduler.from_pretrained(shipped_dir(model), subfolder="scheduler")
    scheduler.set_timesteps(num_steps)
    timesteps = scheduler.timesteps.long()
    a_t, a_prev = _scheduler_alphas(scheduler, timesteps, len(timesteps), "cpu", torch.float64)
    variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    step = scheduler.config.num_train_timesteps // num_steps
    return [(int(t), int(t) - step, float(v.sqrt())) for t, v in zip(timesteps, variance)]


def figure(probes, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.4))
    for k, p in enumerate(probes):
        color = plt.get_cmap("tab10")(k % 10)
        suffix = "" if p["finished"] else f" (stopped at {p['epochs']})"
        axes[0].plot(range(p["epochs"]), p["strict_correct"], color=color, label=p["label"] + suffix)
        axes[1].plot(range(p["epochs"]), p["reward"], color=color)
        width = 0.8 / len(probes)
        shares = [s if s is not None else 0.0 for s in p["grad_share_mean"]]
        axes[2].bar([i + (k - (len(probes) - 1) / 2) * width for i in range(len(shares))], shares, width=width,
                    color=color)
    axes[0].axhline(TARGET, color="gray", linestyle=":")
    axes[0].set_ylim(-0.02, 1.02)
    axes[0].set_ylabel("strict-correct (training)")
    axes[0].set_xlabel("epoch")
    axes[0].legend(fontsize=7)
    axes[1].set_ylabel("training reward")
    axes[1].set_xlabel("epoch")
    axes[2].set_ylabel("share of the policy gradient's norm")
    axes[2].set_xlabel("denoising step (0 = noisiest)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", required=True, help="the rung-b case (its tag), e.g. two_object")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--family", default="unet", choices=("unet", "flow"))
    parser.add_argument("--probe", action="append", default=[], metavar="LABEL=RESULTS")
    parser.add_argument("--output", default="", help="OUTPUT.json and OUTPUT.png (default: print only)")
    parser.add_argument("--steps", action="store_true", help="also the UNet base's DDIM per-step std")
    args = parser.parse_args(argv)
    if not args.probe:
        parser.error("give at least one --probe LABEL=RESULTS")
    probes = []
    for item in args.probe:
        label, equals, results = item.partition("=")
        if not equals or not label or not results:
            parser.error(f"--probe {item!r}: write LABEL=RESULTS (a scenes_ladder results folder)")
        rows, finished = read_run(results, args.family, args.case, args.seed)
        if not rows:
            parser.error(f"--probe {item!r}: the run has no finished epoch yet")
        probes.append(summarise(label, rows, finished))
    print(f"rung b, {args.family}, {args.case}, seed {args.seed}: strict-correct (training)")
    print("| probe | epochs | first | lowest | best 3-epoch mean | last | approx. KL of epoch 0's update | "
          "gradient share of the most-weighted step |")
    print("|---|---|---|---|---|---|---|---|")
    for p in probes:
        shares = [(s, k) for k, s in enumerate(p["grad_share_mean"]) if s is not None]
        top = "{:.2f} (step {})".format(*max(shares)) if shares else "- (no per-step gradient)"
        kl = f"{p['approx_kl'][0]:.3f}" if p["approx_kl"][0] is not None else "-"
        epochs = f"{p['epochs']}" + ("" if p["finished"] else " (stopped)")
        print(f"| {p['label']} | {epochs} | {p['strict_first']:.3f} | {p['strict_lowest']:.3f} | "
              f"{p['strict_best_window']:.3f} | {p['strict_last']:.3f} | {kl} | {top} |")
    document = {"case": args.case, "seed": args.seed, "family": args.family, "probes": probes,
                "command": "python benchmarks/scenes_ladder_probes.py " + " ".join(
                    f"'{a}'" if " " in a else a for a in (argv if argv is not None else sys.argv[1:]))}
    if args.steps:
        stds = ddim_step_stds()
        document["ddim_step_std"] = [{"step": i, "t": t, "t_prev": prev, "std": s} for i, (t, prev, s) in enumerate(stds)]
        print("\nDDIM (eta 1) on tiny-scenes, 10 steps: | step | t -> t_prev | std | 1 / std^2 |")
        for i, (t, prev, s) in enumerate(stds):
            print(f"| {i} | {t} -> {prev} | {s:.4f} | {1 / s ** 2:.1f} |")
    if args.output:
        from ddpo_group.runs.run_dir import write_json_atomic

        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        write_json_atomic(args.output + ".json", document)
        figure(probes, args.output + ".png")
        print(f"\nwrote {args.output}.json and {args.output}.png")


if __name__ == "__main__":
    main()
