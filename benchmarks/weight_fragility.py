"""How much a base's images change when its weights take a step that carries no information (docs/scenes.md, "The
flow fall is drift"). Adam's first update moves every trainable weight by the learning rate, whatever the size of its
gradient (m / sqrt(v) = g / |g|): on a gradient that is noise, that is eps * sign(z) with z random. This script adds
such a step, eps * sign(z) with z ~ N(0, 1) drawn from a seeded generator, to every weight of the denoiser (the model
RL trains), then samples the same prompts from the same noise as the base and scores them with GenEval's protocol:

    python benchmarks/weight_fragility.py --model tiny-scenes-sd3 --eps 0,5e-5,2e-4,8e-4 --seeds 0,1 \
        --num-steps 20 --guidance-scale 4.5 --output benchmarks/results/weight_fragility/tiny_scenes_sd3.json

Prints a table (one row per eps and seed: the perturbation's size against the weights', GenEval's overall and strict
accuracy, the mean absolute change of the images' pixels against the base's, 0-255, and the fraction of images
whose strict verdict flipped) and writes it as JSON (--output; a file that exists is refused). eps 2e-4 is one Adam
step at the variants' learning rate; 8e-4 about an epoch's four. Defaults: the shipped held-out set
(geneval_scenes.jsonl), one image a prompt, eval seed 1234, the shapes detector.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model name (tiny-scenes, tiny-scenes-sd3) or a pipeline folder")
    parser.add_argument("--eps", type=_floats, default=[0.0, 5e-5, 2e-4, 8e-4], help="step sizes, comma-separated")
    parser.add_argument("--seeds", type=_ints, default=[0], help="seeds of the random signs, comma-separated")
    parser.add_argument("--prompts", default="geneval_scenes.jsonl", help="GenEval records (default the held-out set)")
    parser.add_argument("--images-per-prompt", type=int, default=1)
    parser.add_argument("--num-steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--eta", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234, help="the evaluation noise (the same for every row)")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--output", default="", help="JSON of the table (refused if it exists)")
    args = parser.parse_args(argv)
    if args.output and os.path.exists(args.output):
        parser.error(f"--output {args.output} exists; give a new file (a measurement is never written over)")
    if any(e < 0 for e in args.eps):
        parser.error("--eps: step sizes are >= 0")
    return args


def perturb(module, eps, seed):
    """Add eps * sign(z), z ~ N(0, 1) from torch.Generator(seed) drawn parameter by parameter in named order, to
    every parameter of `module` in place; (the step's L2 norm, the weights' L2 norm before it)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    step_sq, weight_sq = 0.0, 0.0
    with torch.no_grad():
        for _, param in sorted(module.named_parameters(), key=lambda item: item[0]):
            z = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            step = eps * torch.sign(z)
            weight_sq += float(param.detach().float().pow(2).sum())
            step_sq += float(step.pow(2).sum())
            param.add_(step.to(param.device, param.dtype))
    return step_sq ** 0.5, weight_sq ** 0.5


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import torch

    from ddpo_group.diffusion.policy import load_policy
    from ddpo_group.evaluation.protocols import get_protocol, score_policy

    torch.set_num_threads(1)
    protocol = get_protocol("geneval", detector="shapes")
    records = protocol.load_records(args.prompts, {})
    rows, base = [], None
    for eps in args.eps:
        for seed in (args.seeds if eps > 0 else [None]):
            start = time.perf_counter()
            policy = load_policy(args.model)
            module = policy.trainable_module
            step_norm, weight_norm = perturb(module, eps, seed or 0) if eps > 0 else (0.0, None)
            with torch.no_grad():
                results, images = score_policy(protocol, policy, records, args.images_per_prompt, args.num_steps,
                                               args.guidance_scale, args.eta, seed=args.seed,
                                               batch_size=args.batch_size, keep_images=True)
            strict = np.array([r["strict_correct"] for r in results], dtype=float)
            summary = protocol.summarize(results)
            if base is None:
                base = {"images": images.astype(np.float32), "strict": strict}
            row = {"eps": eps, "seed": seed, "step_over_weights": step_norm / weight_norm if weight_norm else 0.0,
                   "parameters": sum(p.numel() for p in module.parameters()),
                   "overall": summary["overall"], "strict_accuracy": float(strict.mean()),
                   "tags": {tag: value for tag, value in summary.items() if isinstance(value, float) and tag != "overall"},
                   "pixel_change": float(np.abs(images.astype(np.float32) - base["images"]).mean()),
                   "verdicts_flipped": float((strict != base["strict"]).mean()),
                   "seconds": time.perf_counter() - start}
            rows.append(row)
            print(f"eps {eps:g} seed {seed}: step/weights {row['step_over_weights']:.4f}, overall {row['overall']:.3f}, "
                  f"strict {row['strict_accuracy']:.3f}, pixel change {row['pixel_change']:.1f}, verdicts flipped "
                  f"{row['verdicts_flipped']:.3f} ({row['seconds']:.0f} s)", flush=True)
    print()
    print("| eps | seed | step / weights (L2) | overall | strict accuracy | pixel change (0-255) | verdicts flipped |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['eps']:g} | {'' if row['seed'] is None else row['seed']} | {row['step_over_weights']:.4f} | "
              f"{row['overall']:.3f} | {row['strict_accuracy']:.3f} | {row['pixel_change']:.1f} | {row['verdicts_flipped']:.3f} |")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        document = {"command": "python benchmarks/weight_fragility.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    "model": args.model, "prompts": args.prompts, "images_per_prompt": args.images_per_prompt,
                    "num_steps": args.num_steps, "guidance_scale": args.guidance_scale, "eta": args.eta,
                    "seed": args.seed, "rows": rows}
        with open(args.output + ".tmp", "w") as f:
            json.dump(document, f, indent=2)
        os.replace(args.output + ".tmp", args.output)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
