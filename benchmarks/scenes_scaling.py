"""The scenes bases' scaling table: denoiser size x training time -> loss on fresh scenes, held-out GenEval per tag.

Each (arch, size) pair is one ``ddpo-group pretrain --world scenes`` run, all of them at once (on one GPU, or one
thread each on a CPU), on one shared rendered data set, each with the same time budget for its denoiser
(``--denoiser-minutes``: the step count is set from the run's own speed) and the shipped VAE of its family
(``--vae-from``: the VAE is not what limits the scenes models, docs/scenes.md). Then a table, and JSON:

    python benchmarks/scenes_scaling.py --device cuda --minutes 4.5 --out OUT      # on a lent GPU (device_session.sh)
    python benchmarks/scenes_scaling.py --collect OUT                              # the table again

OUT gets one pipeline directory per run (OUT/<arch>_<size>/ with pretrain_log.json), their state directories
(OUT/state/<arch>_<size>/, resumable: the same command goes on where a run stopped) and OUT/scaling.json:
{"rows": [{"arch", "size", "parameters", "steps", "batch_size", "denoiser_seconds", "loss_train_scenes",
"loss_fresh_scenes", "overall", <tag>: score, ...}], "command": ...}. OUT must be a new or empty folder, or one
this script made (it holds its scaling_plan.json); nothing else is written or removed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED_VAE = {"sd3": os.path.join(ROOT, "ddpo_group", "assets", "tiny_scenes_sd3"),
               "sd": os.path.join(ROOT, "ddpo_group", "assets", "tiny_scenes")}
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
PLAN = "scaling_plan.json"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the results folder (new, empty, or one this script made)")
    parser.add_argument("--collect", metavar="OUT", help="only print and write the table of OUT's finished runs")
    parser.add_argument("--archs", default="sd3,sd")
    parser.add_argument("--sizes", default="s,m,l")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--minutes", type=float, default=4.5, help="each run's denoiser budget")
    parser.add_argument("--dataset-size", type=int, default=60000)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--render-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-steps", type=int, default=20, help="the held-out evaluation's sampling steps")
    parser.add_argument("--eval-images-per-prompt", type=int, default=4)
    args = parser.parse_args(argv)
    if not args.out and not args.collect:
        parser.error("give --out OUT (a run) or --collect OUT (the table of a finished one)")
    return args


def check_out(out: str) -> None:
    if os.path.exists(out) and os.listdir(out) and not os.path.exists(os.path.join(out, PLAN)):
        raise SystemExit(f"scenes_scaling.py: error: --out {out} holds files this script did not make; give a new "
                         "or empty folder")


def collect(out: str) -> list[dict]:
    rows = []
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name, "pretrain_log.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            log = json.load(f)
        evaluation = log.get("evaluation") or {}
        losses = log.get("denoiser_loss") or {}
        rows.append({"arch": log["arch"], "size": log.get("size", "s"), "parameters": log.get("denoiser_parameters"),
                     "steps": log["denoiser"]["steps"], "batch_size": log["denoiser"]["batch_size"],
                     "denoiser_seconds": round(log["denoiser"]["seconds"], 1), "device": log.get("device"),
                     "loss_train_scenes": losses.get("train_scenes"), "loss_fresh_scenes": losses.get("fresh_scenes"),
                     "overall": evaluation.get("overall"), **(evaluation.get("tags") or {})})
    header = ["arch", "size", "params (M)", "steps", "seconds", "loss train", "loss fresh", "overall", *TAGS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["arch"], r["size"], f"{(r['parameters'] or 0) / 1e6:.2f}", r["steps"], r["denoiser_seconds"],
                 *(f"{v:.4f}" if isinstance(v, float) else "-" for v in (r["loss_train_scenes"], r["loss_fresh_scenes"])),
                 *(f"{r[k]:.3f}" if isinstance(r.get(k), float) else "-" for k in ("overall", *TAGS))]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    print("\n".join(lines))
    tmp = os.path.join(out, "scaling.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"rows": rows, "table": lines}, f, indent=2)
    os.replace(tmp, os.path.join(out, "scaling.json"))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.collect:
        collect(args.collect)
        return 0
    out = args.out
    check_out(out)
    os.makedirs(os.path.join(out, "state"), exist_ok=True)
    with open(os.path.join(out, PLAN), "w") as f:
        json.dump(vars(args), f, indent=2)
    runs = [(arch, size) for arch in args.archs.split(",") for size in args.sizes.split(",")]
    # one rendering of the data set for every run: each run's state directory starts with a link to it
    shared = os.path.join(out, "state", "data")
    start = time.time()
    if not os.path.exists(os.path.join(shared, "data.npz")):
        from ddpo_group.data.scenes import sample_dataset
        import numpy as np

        images, prompts = sample_dataset(args.dataset_size, seed=args.seed, workers=args.render_workers)
        unique = sorted(set(prompts))
        row_of = {p: i for i, p in enumerate(unique)}
        os.makedirs(shared, exist_ok=True)
        np.savez(os.path.join(shared, "data.tmp.npz"), images=images,
                 rows=np.asarray([row_of[p] for p in prompts], dtype=np.int64), prompts=np.asarray(unique))
        os.replace(os.path.join(shared, "data.tmp.npz"), os.path.join(shared, "data.npz"))
    print(f"data: {args.dataset_size} scenes in {time.time() - start:.0f} s", flush=True)
    processes = []
    for arch, size in runs:
        name = f"{arch}_{size}"
        state = os.path.join(out, "state", name)
        os.makedirs(state, exist_ok=True)
        if not os.path.exists(os.path.join(state, "data.npz")):
            os.link(os.path.join(shared, "data.npz"), os.path.join(state, "data.npz"))
        command = [sys.executable, "-m", "ddpo_group.cli", "pretrain", "--world", "scenes", "--arch", arch,
                   "--size", size, "--device", args.device, "--vae-from", SHIPPED_VAE[arch],
                   "--dataset-size", str(args.dataset_size), "--seed", str(args.seed),
                   "--batch-size", str(args.batch_size), "--unet-lr", str(args.lr),
                   "--warmup-steps", str(args.warmup_steps), "--denoiser-minutes", str(args.minutes),
                   "--eval-steps", str(args.eval_steps), "--eval-images-per-prompt", str(args.eval_images_per_prompt),
                   "--checkpoint-every", "1000", "--render-workers", "2", "--threads", "1",
                   "--state-dir", state, "--output-dir", os.path.join(out, name),
                   "--samples-path", os.path.join(out, name, "samples.png")]
        os.makedirs(os.path.join(out, name), exist_ok=True)
        log = open(os.path.join(out, f"{name}.log"), "w")
        processes.append((name, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)))
        print("started", name, flush=True)
    failed = []
    for name, process in processes:
        if process.wait() != 0:
            failed.append(name)
        print(f"{name}: exit {process.returncode} ({time.time() - start:.0f} s)", flush=True)
    collect(out)
    if failed:
        print(f"failed: {', '.join(failed)} (their logs: {out}/<name>.log)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
