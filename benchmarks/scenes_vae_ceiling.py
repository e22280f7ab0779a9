"""The scenes world's ceiling through its VAE: how often a perfectly drawn scene is still judged correct once it has
gone through the models' latent space (issue 53; docs/scenes.md, "The coarse scale").

    python benchmarks/scenes_vae_ceiling.py                       # both object scales, the shipped VAE
    python benchmarks/scenes_vae_ceiling.py --images-per-prompt 8 --output /tmp/ceiling.json

For each object scale (``--scales``: fine, issue 42's 80-160 px objects, ``scenes.AREA_RANGE``; coarse, 150-260 px,
``scenes.COARSE_AREA_RANGE``) and each record of the held-out set (assets/prompts/geneval_scenes.jsonl), plus every
counting training record, `--images-per-prompt` scenes are rendered (``scenes.render_record``, numpy seed
`--seed`), encoded by the VAE of `--model` (its posterior mean), decoded, and scored by GenEval's rules with the
shapes detector (reward ``geneval``, score strict). A denoiser can do no better than its VAE lets it: a tag's strict
accuracy on the round-tripped scenes is the most any model of this latent space can reach on it, and a one-prompt
target of 0.9 is out of reach for a prompt whose ceiling is under it. The rendered scenes themselves are scored too
(1.0 expected: the detector is exact on them). Prints a table and writes JSON; an existing result is never
overwritten unless --output names it explicitly. One thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
from flip_rate import encode, rewards_of  # noqa: E402  (the flip-rate benchmark's VAE encoding and reward call)

RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results", "scenes_vae_ceiling")


def round_trip(policy, pixels: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [0, 1] through the policy's VAE (flip_rate.encode's posterior mean, then the policy's
    own decode)."""
    return policy.decode(encode(policy, pixels)).float()


def strict(reward, images: torch.Tensor, records: list[dict]) -> np.ndarray:
    return rewards_of({"strict": reward}, images, records)["strict"]


@torch.no_grad()
def measure(args) -> dict:
    from ddpo_group.data import scenes
    from ddpo_group.diffusion.policy import load_policy
    from ddpo_group.rewards.geneval.metadata import read_metadata
    from ddpo_group.rewards.geneval.reward import GenEvalReward

    torch.set_num_threads(args.threads)
    policy = load_policy(args.model, torch_dtype=torch.float32)
    reward = GenEvalReward(score="strict", detector="shapes")
    held_out = read_metadata(scenes.evaluation_prompts_path())
    counting = scenes.training_records()["counting"]
    scales = {"fine": scenes.AREA_RANGE, "coarse": scenes.COARSE_AREA_RANGE}
    result = {"model": args.model, "images_per_prompt": args.images_per_prompt, "seed": args.seed, "scales": {}}
    for name in args.scales.split(","):
        rng = np.random.default_rng(args.seed)
        row = {"object_area": list(scales[name]), "held_out": {}, "counting_training_prompts": {}}
        for split, records in (("held_out", held_out), ("counting_training_prompts", counting)):
            batch = [r for r in records for _ in range(args.images_per_prompt)]
            drawn = np.stack([scenes.render_record(r, rng, area_range=scales[name]) for r in batch])
            pixels = torch.as_tensor(drawn).permute(0, 3, 1, 2).float() / 255
            rendered = strict(reward, pixels, batch)
            decoded = np.concatenate([strict(reward, round_trip(policy, pixels[k:k + 64]), batch[k:k + 64])
                                      for k in range(0, len(batch), 64)])
            keys = [r["tag"] for r in batch] if split == "held_out" else [r["prompt"] for r in batch]
            for key in dict.fromkeys(keys):
                pick = np.asarray([k == key for k in keys])
                row[split][key] = {"rendered": float(rendered[pick].mean()), "through_vae": float(decoded[pick].mean()),
                                   "images": int(pick.sum())}
            if split == "held_out":
                row["held_out_overall"] = {"rendered": float(np.mean([v["rendered"] for v in row[split].values()])),
                                           "through_vae": float(np.mean([v["through_vae"]
                                                                         for v in row[split].values()]))}
        result["scales"][name] = row
    return result


def table(result: dict) -> str:
    scales = result["scales"]
    tags = list(next(iter(scales.values()))["held_out"])
    lines = [f"strict accuracy of rendered scenes through the VAE of {result['model']} "
             f"({result['images_per_prompt']} images a record, seed {result['seed']})",
             f"{'scale':<7} {'areas px':<11} " + " ".join(f"{t:>13}" for t in tags) + f" {'overall':>8}"]
    for name, row in scales.items():
        lines.append(f"{name:<7} {'-'.join(f'{a:g}' for a in row['object_area']):<11} "
                     + " ".join(f"{row['held_out'][t]['through_vae']:>13.3f}" for t in tags)
                     + f" {row['held_out_overall']['through_vae']:>8.3f}")
    lines.append("counting training prompts under 0.9 through the VAE:")
    for name, row in scales.items():
        low = {p: v["through_vae"] for p, v in row["counting_training_prompts"].items() if v["through_vae"] < 0.9}
        lines.append(f"  {name}: {len(low)} of {len(row['counting_training_prompts'])}"
                     + "".join(f"; {p.removeprefix('a photo of ')} {v:.2f}" for p, v in sorted(low.items())))
    rendered = min(v["rendered"] for row in scales.values() for split in ("held_out", "counting_training_prompts")
                   for v in row[split].values())
    lines.append(f"rendered scenes themselves: the lowest strict accuracy of any tag or prompt is {rendered:.3f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-scenes-sd3", help="a scenes model whose VAE is measured (both "
                        "shipped scenes models share one VAE)")
    parser.add_argument("--scales", default="fine,coarse", help="comma-separated: fine, coarse")
    parser.add_argument("--images-per-prompt", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/scenes_vae_ceiling/"
                        "<model>.json)")
    args = parser.parse_args(argv)
    unknown = set(args.scales.split(",")) - {"fine", "coarse"}
    if unknown or args.images_per_prompt < 1:
        parser.error(f"argument --scales: {sorted(unknown)} not among fine, coarse" if unknown
                     else "argument --images-per-prompt: at least 1")
    output = args.output or os.path.join(RESULTS, os.path.basename(os.path.normpath(args.model)) + ".json")
    if args.output is None and os.path.exists(output):
        parser.error(f"{output} exists; give --output to write over it or elsewhere")
    result = measure(args)
    print(table(result))
    from ddpo_group.runs.grids import save_json

    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    save_json(result, output)
    print(f"wrote {output}")
    return result


if __name__ == "__main__":
    main()
