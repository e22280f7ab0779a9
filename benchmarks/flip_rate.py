"""The GenEval reward's flip rate on a scenes model (issue 53; docs/scenes.md, "The detector's score").

    python benchmarks/flip_rate.py                                   # tiny-scenes-sd3, the shipped flow model
    python benchmarks/flip_rate.py --model tiny-scenes               # the shipped UNet (DDIM, eta 1)
    python benchmarks/flip_rate.py --model path/to/pipeline --output /tmp/flip.json

For each split of scenes prompts (the held-out set, assets/prompts/geneval_scenes.jsonl, and the RL training prompts,
``scenes.scene_training_prompts``), `--prompts` records drawn at random, `--images-per-prompt` images each, sampled as
the trainer samples them: the model's scenes variant (config/grpo.py tiny_scenes for a flow model, tiny_scenes_sd for
a UNet, tiny_scenes_flow for a flow-matching UNet) gives the steps, the noise level eta, the SDE type and the
guidance. Then Gaussian noise the size of the last SDE step (its std sigma_T, from the policy's own ``step_log_prob``
of that step) is added to the final latents, x' = x_T + sigma_T eps, and x' is decoded. The flip rate is the share of
images whose training reward (reward ``geneval``'s score, the variant's: Flow-GRPO's partial score) differs between
x_T's image and x''s (|r' - r| > 1e-9). Rendered scenes (``scenes.sample_scene``, the same records) go through the
model's VAE (encode, decode: the clean image) and the same noise on their latents (the noisy one), their objects at
the areas the model was pretrained on (``scenes.area_range_of_pipeline``: issue 42's, or ``pretrain --object-scale
coarse``'s).

Three shapes detectors are measured (``DETECTORS``): "unit" (issue 42's: palette segmentation, every object 1.0,
fragments of 4 px and more), "calibrated" (issue 53's first: palette segmentation, the calibrated score) and
"shape" (the default: colour-agnostic segmentation, the calibrated score; docs/scenes.md). One thread (torch.set_num_threads(1)).
Prints a table and writes JSON; an existing result is never overwritten unless --output names it explicitly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results", "flip_rate")
# column name -> ShapesDetector(**kwargs)
DETECTORS = {"unit": {"confidence": "unit", "segmentation": "palette"},
             "calibrated": {"confidence": "calibrated", "segmentation": "palette"},
             "shape": {"confidence": "calibrated", "segmentation": "shape"}}
FLIP_TOLERANCE = 1e-9


def model_label(model: str) -> str:
    """The result's file stem: the shipped model's directory name (loading.SHIPPED_SCENES, named here so that the
    overwrite check runs before diffusers is imported), or the directory's own name."""
    shipped = {"tiny-scenes": "tiny_scenes", "tiny-scenes-sd3": "tiny_scenes_sd3",
               "tiny-scenes-flow": "tiny_scenes_flow"}
    return shipped[model] if model in shipped else Path(model).resolve().name


def sampling_config(policy):
    """config.sample of the scenes variant of the policy's family (flow: tiny_scenes, UNet: tiny_scenes_sd, flow
    UNet: tiny_scenes_flow)."""
    from ddpo_group.config.variants.tasks import tiny_scenes, tiny_scenes_flow, tiny_scenes_sd

    if policy.family in ("stable_diffusion", "sdxl"):
        return tiny_scenes_sd()
    return tiny_scenes_flow() if policy.family == "sd_flow" else tiny_scenes()


def split_records(split: str, n: int, seed: int) -> list[dict]:
    """n records drawn at random (seed) from the held-out set ("heldout") or the RL training prompts ("train")."""
    from ddpo_group.data.scenes import evaluation_prompts_path, scene_training_prompts
    from ddpo_group.rewards.geneval.metadata import read_metadata

    if split == "heldout":
        pool = read_metadata(evaluation_prompts_path())
    elif split == "train":
        pool = [{**dict(r.metadata), "prompt": r.prompt} if hasattr(r, "metadata") else dict(r)
                for r in scene_training_prompts(n_per_tag=100, seed=0)]
    else:
        raise ValueError(f"--splits: {split!r} is not 'heldout' or 'train'")
    rng = np.random.default_rng([seed, len(split)])
    picks = rng.choice(len(pool), size=min(n, len(pool)), replace=False)
    return [pool[int(i)] for i in sorted(picks)]


def encode(policy, images: torch.Tensor) -> torch.Tensor:
    """Latents of images (B, 3, H, W) in [0, 1]: the VAE's posterior mean, scaled as ``policy.decode`` unscales it
    (latents = (z - shift_factor) * scaling_factor)."""
    vae = policy.pipeline.vae
    z = vae.encode(images.to(vae.dtype) * 2 - 1).latent_dist.mean.float()
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return (z - shift) * vae.config.scaling_factor


def rewards_of(scorers: dict, images: torch.Tensor, records: list[dict]) -> dict:
    """{detector: float64 (B,) training rewards} of images (B, 3, H, W) in [0, 1]."""
    prompts = [r["prompt"] for r in records]
    meta = [{k: v for k, v in r.items() if k != "prompt"} for r in records]
    return {name: reward(images, prompts, meta)[0] for name, reward in scorers.items()}


def build_rewards(config) -> dict:
    """The variant's training reward once per shapes detector of ``DETECTORS``."""
    from ddpo_group.rewards.geneval.reward import GenEvalReward
    from ddpo_group.rewards.geneval.shapes_scenes import ShapesDetector

    rewards = {}
    for name, kwargs in DETECTORS.items():
        reward = GenEvalReward(**dict(config.reward_kwargs["geneval"]))
        reward.scorer.detector = ShapesDetector(**kwargs)
        rewards[name] = reward
    return rewards


@torch.no_grad()
def measure(args) -> dict:
    from ddpo_group.diffusion.base import configure_from_sample
    from ddpo_group.diffusion.policy import load_policy
    from ddpo_group.data.scenes import area_range_of_pipeline, render_objects, sample_scene

    policy = load_policy(args.model, torch_dtype=torch.float32)
    config = sampling_config(policy)
    s = config.sample
    configure_from_sample(policy, s)
    model = policy.prepare(torch.device("cpu"), torch.float32, False)
    model.eval()
    rewards = build_rewards(config)
    area_range = area_range_of_pipeline(getattr(policy.pipeline.config, "_name_or_path", None))
    result = {"model": args.model, "family": policy.family, "num_steps": s.num_steps, "eta": s.eta,
              "sde_type": s.sde_type, "guidance_scale": s.guidance_scale, "object_area": list(area_range), "splits": {}}
    for split in args.splits.split(","):
        records = split_records(split, args.prompts, args.seed)
        batch_records = [r for r in records for _ in range(args.images_per_prompt)]
        clean = {name: [] for name in rewards}
        noisy = {name: [] for name in rewards}
        stds = []
        rendered_clean = {name: [] for name in rewards}
        rendered_noisy = {name: [] for name in rewards}
        start = time.perf_counter()
        for b in range(0, len(batch_records), args.batch_size):
            chunk = batch_records[b:b + args.batch_size]
            generator = torch.Generator().manual_seed(int(np.random.default_rng([args.seed, len(split), b]).integers(2**62)))
            batch = policy.sample([r["prompt"] for r in chunk], num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                                  eta=s.eta, generator=generator, keep_steps=True)
            last = torch.full((len(chunk),), s.num_steps - 1, dtype=torch.long)
            _, _, std = policy.step_log_prob(model, batch, torch.arange(len(chunk)), last, s.guidance_scale, s.eta)
            std = std.float().reshape((len(chunk),) + (1,) * (batch.latents.dim() - 2))
            stds.append(std.flatten())
            final = batch.latents[:, -1].float()
            noise = torch.randn(final.shape, generator=generator)
            images_noisy = policy.decode(final + std * noise)
            for name, value in rewards_of(rewards, batch.images.float(), chunk).items():
                clean[name].append(value)
            for name, value in rewards_of(rewards, images_noisy, chunk).items():
                noisy[name].append(value)
            # rendered scenes of the same records, through the VAE and the same noise
            rng = np.random.default_rng([args.seed, len(split), b, 1])
            size = batch.images.shape[-1]
            drawn = np.stack([render_objects(*sample_scene(r, rng, size, area_range), size) for r in chunk])
            pixels = torch.as_tensor(drawn).permute(0, 3, 1, 2).float() / 255
            latents = encode(policy, pixels)
            for name, value in rewards_of(rewards, policy.decode(latents), chunk).items():
                rendered_clean[name].append(value)
            for name, value in rewards_of(rewards, policy.decode(latents + std * noise), chunk).items():
                rendered_noisy[name].append(value)
        row = {"records": len(records), "images": len(batch_records), "seconds": round(time.perf_counter() - start, 1),
               "last_step_std": float(torch.cat(stds).mean())}
        for name in rewards:
            for kind, before, after in (("generated", clean, noisy), ("rendered", rendered_clean, rendered_noisy)):
                r0, r1 = np.concatenate(before[name]), np.concatenate(after[name])
                row[f"{kind}/{name}"] = {"flip_rate": float(np.mean(np.abs(r1 - r0) > FLIP_TOLERANCE)),
                                         "mean_reward": float(np.mean(r0)), "mean_reward_noisy": float(np.mean(r1))}
        result["splits"][split] = row
    return result


def table(result: dict) -> str:
    lines = [f"flip rate of the training reward, {result['model']} ({result['family']}, {result['num_steps']} steps, "
             f"eta {result['eta']}): noise of the last SDE step's std on the final latents",
             f"{'split':<8} {'images':>6} {'std':>7}  {'images':<10} {'detector':<11} {'flip rate':>9} {'reward':>7}"]
    for split, row in result["splits"].items():
        for kind in ("generated", "rendered"):
            for name in DETECTORS:
                if f"{kind}/{name}" not in row:  # a result measured before the detector was added
                    continue
                cell = row[f"{kind}/{name}"]
                lines.append(f"{split:<8} {row['images']:>6} {row['last_step_std']:>7.4f}  {kind:<10} {name:<11} "
                             f"{cell['flip_rate']:>9.2%} {cell['mean_reward']:>7.3f}")
    return "\n".join(lines)


def write_atomic(path: str, document: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(document, handle, indent=1)
        handle.write("\n")
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-scenes-sd3", help="tiny-scenes-sd3, tiny-scenes or a pipeline dir")
    parser.add_argument("--splits", default="heldout,train", help="comma-separated: heldout, train")
    parser.add_argument("--prompts", type=int, default=48, help="records per split")
    parser.add_argument("--images-per-prompt", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/flip_rate/<model>.json)")
    args = parser.parse_args(argv)
    output = args.output or os.path.join(RESULTS, f"{model_label(args.model)}.json")
    if args.output is None and os.path.exists(output):
        parser.error(f"{output} exists: pass --output {output} to replace it, or another path")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    result = measure(args)
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["command"] = "python benchmarks/flip_rate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result["threads"] = args.threads
    print(table(result))
    write_atomic(output, result)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
