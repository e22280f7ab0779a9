"""Is the shapes detector's score calibrated? (issue 53; docs/scenes.md, "The detector's score")

    python benchmarks/detector_calibration.py                         # the VAE of tiny-scenes-sd3
    python benchmarks/detector_calibration.py --model tiny-scenes     # the VAE of the UNet model

Rendered scenes of random scenes-world records (``scenes.sample_scene``: 1-4 objects, their classes known) are
degraded by a model's VAE: encoded, Gaussian noise of std `level` added to the latents (levels 0 to 1.5; the
larger ones turn shapes into blobs with near-ties), decoded. The calibrated detector
(``ShapesDetector()``) runs on them; each object is matched to the rendered object its mask overlaps most
(mask IoU > 0.5 with the object's coverage > 0.5; else it is a fragment, of no class). Every reported
(object, class, score) pair is a forecast "this object is a <class>": the reliability table bins the pairs by
score and compares the mean score with the share of pairs whose class is the object's true one; the expected
calibration error (ECE) is their gap weighted by the bin's share of pairs. The temperature T of the softmax is
also refitted here (the T of the grid that minimises the mean negative log-probability of the true class over the
matched objects) to show where the shipped T lies. One thread; prints the table, writes JSON (an existing result
only with --output naming it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks.flip_rate import RESULTS, encode, model_label, write_atomic  # noqa: E402

LEVELS = (0.0, 0.5, 1.0, 1.5)
TEMPERATURES = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.07, 0.1)
BINS = np.linspace(0.0, 1.0, 11)


@torch.no_grad()
def collect(args) -> tuple[list, list]:
    """(pairs [(score, correct)], matched [(overlaps, true shape)]) over the degraded scenes."""
    from ddpo_group.data.scenes import render_objects, sample_scene, world_records
    from ddpo_group.diffusion.policy import load_policy
    from ddpo_group.rewards.base import to_uint8_images
    from ddpo_group.rewards.geneval.shapes_scenes import ShapesDetector

    policy = load_policy(args.model, torch_dtype=torch.float32)
    detector = ShapesDetector()
    records = [r for tag_records in world_records().values() for r in tag_records]
    rng = np.random.default_rng(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    pairs, matched = [], []
    for _ in range(0, args.scenes, args.batch_size):
        scenes = [sample_scene(records[rng.integers(len(records))], rng) for _ in range(args.batch_size)]
        pixels = np.stack([render_objects(objects, background) for objects, background in scenes])
        latents = encode(policy, torch.as_tensor(pixels).permute(0, 3, 1, 2).float() / 255)
        for level in args.levels:
            noisy = latents + level * torch.randn(latents.shape, generator=generator)
            for (objects, _), image in zip(scenes, to_uint8_images(policy.decode(noisy))):
                for obj in detector.objects(image):
                    ious = [float((obj["mask"] & (cov > 0.5)).sum() / max(1, (obj["mask"] | (cov > 0.5)).sum()))
                            for _, _, cov in objects]
                    j = int(np.argmax(ious))
                    truth = objects[j][0] if ious[j] > 0.5 else None
                    pairs += [(score, shape == truth) for shape, score in obj["scores"].items()]
                    if truth is not None:
                        matched.append((obj["overlaps"], truth))
    return pairs, matched


def reliability(pairs) -> dict:
    scores = np.array([p[0] for p in pairs])
    correct = np.array([p[1] for p in pairs], dtype=np.float64)
    rows, ece = [], 0.0
    for low, high in zip(BINS[:-1], BINS[1:]):
        inside = (scores >= low) & ((scores < high) if high < 1 else (scores <= high))
        if inside.any():
            gap = abs(scores[inside].mean() - correct[inside].mean())
            ece += inside.mean() * gap
            rows.append({"bin": [float(low), float(high)], "pairs": int(inside.sum()),
                         "mean_score": float(scores[inside].mean()), "share_correct": float(correct[inside].mean())})
    return {"pairs": len(pairs), "ece": float(ece), "bins": rows}


def fit_temperature(matched) -> dict:
    """Mean -log softmax(true class) per temperature of the grid, and the best one."""
    nll = {}
    for temperature in TEMPERATURES:
        total = 0.0
        for overlaps, truth in matched:
            values = np.array(list(overlaps.values()))
            logits = (values - values.max()) / temperature
            total -= logits[list(overlaps).index(truth)] - np.log(np.exp(logits).sum())
        nll[str(temperature)] = total / max(1, len(matched))
    return {"mean_nll": nll, "best": float(min(nll, key=nll.get)), "objects": len(matched)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-scenes-sd3", help="tiny-scenes-sd3, tiny-scenes or a pipeline dir")
    parser.add_argument("--scenes", type=int, default=128)
    parser.add_argument("--levels", type=lambda s: [float(v) for v in s.split(",")], default=list(LEVELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", default=None,
                        help="JSON path (default benchmarks/results/flip_rate/calibration_<model>.json)")
    args = parser.parse_args(argv)
    output = args.output or os.path.join(RESULTS, f"calibration_{model_label(args.model)}.json")
    if args.output is None and os.path.exists(output):
        parser.error(f"{output} exists: pass --output {output} to replace it, or another path")
    torch.set_num_threads(1)
    start = time.perf_counter()
    pairs, matched = collect(args)
    result = {"model": args.model, "levels": args.levels, "scenes": args.scenes, "seed": args.seed,
              "reliability": reliability(pairs), "temperature": fit_temperature(matched),
              "seconds": round(time.perf_counter() - start, 1),
              "command": "python benchmarks/detector_calibration.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(f"reliability of the calibrated score, {args.model}'s VAE, latent noise {args.levels}:")
    print(f"{'score bin':<12} {'pairs':>6} {'mean score':>10} {'correct':>8}")
    for row in result["reliability"]["bins"]:
        print(f"[{row['bin'][0]:.1f}, {row['bin'][1]:.1f}) {row['pairs']:>6} {row['mean_score']:>10.3f} "
              f"{row['share_correct']:>8.3f}")
    print(f"ECE {result['reliability']['ece']:.4f} over {result['reliability']['pairs']} pairs; temperature with the "
          f"least NLL of the true class: {result['temperature']['best']} ({result['temperature']['objects']} objects)")
    write_atomic(output, result)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
