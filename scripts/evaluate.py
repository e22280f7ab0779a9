"""Mean reward of a model (or a training checkpoint) over every prompt of a prompt set, with fixed seeds.

    python scripts/evaluate.py --model tiny-shapes --prompts shapes --reward shapes_alignment
    python scripts/evaluate.py --checkpoint runs/demo/checkpoints/checkpoint_40

A checkpoint is read with the settings of its run (config.json beside checkpoints/). The training
log's reward_mean is measured on each epoch's random prompt draw; this evaluates every prompt with
the same initial noise, so two models can be compared directly. Prints a summary and writes JSON.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_group.diffusion.loading import load_pipeline  # noqa: E402
from ddpo_group.diffusion.sampling import sample_trajectories  # noqa: E402
from ddpo_group.prompts import load_prompts  # noqa: E402
from ddpo_group.rewards import build_reward_fn  # noqa: E402


def load_checkpoint_pipeline(checkpoint):
    """The run's pipeline with the checkpoint's UNet (full weights or LoRA) loaded."""
    from ddpo_group.diffusion.policy import policy_for

    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    pipeline = load_pipeline(config["pretrained"]["model"])
    if config["use_lora"]:
        pipeline.load_lora_weights(os.path.join(checkpoint, "lora"))
    else:
        policy = policy_for(pipeline)
        policy.load_trainable(policy.trainable_module, checkpoint, use_lora=False)
    return pipeline, config


def evaluate(pipeline, records, reward_fn, images_per_prompt, num_steps, guidance_scale, eta, seed, batch_size):
    """Per-prompt mean rewards (len(records),); image j of every prompt starts from the same noise."""
    rewards = np.zeros((len(records), images_per_prompt))
    for j in range(images_per_prompt):
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            generator = torch.Generator().manual_seed(seed + 1000 * j + start)
            trajectories = sample_trajectories(
                pipeline, [r.prompt for r in chunk], num_steps, guidance_scale, eta, generator=generator
            )
            values, _, _ = reward_fn(trajectories.images, [r.prompt for r in chunk], [r.metadata for r in chunk])
            rewards[start : start + len(chunk), j] = values
    return rewards.mean(axis=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-shapes", help="model to evaluate (ignored with --checkpoint)")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint_N directory of a run")
    parser.add_argument("--prompts", default=None, help="prompt set (default: the run's, or shapes)")
    parser.add_argument("--reward", default=None, help="reward (default: the run's, or shapes_alignment)")
    parser.add_argument("--images-per-prompt", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=None, help="DDIM steps (default: the run's, or 10)")
    parser.add_argument("--guidance-scale", type=float, default=None)
    parser.add_argument("--eta", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output", default=None, help="JSON file to write (default: beside the checkpoint, or print only)")
    args = parser.parse_args(argv)

    config = None
    if args.checkpoint:
        pipeline, config = load_checkpoint_pipeline(args.checkpoint)
    else:
        pipeline = load_pipeline(args.model)
    run = config or {}
    prompts = args.prompts or run.get("prompt_fn", "shapes")
    reward = args.reward or run.get("reward_fn", "shapes_alignment")
    num_steps = args.num_steps or run.get("sample", {}).get("num_steps", 10)
    guidance = args.guidance_scale or run.get("sample", {}).get("guidance_scale", 3.0)
    records = load_prompts(prompts)
    reward_fn = build_reward_fn(reward)
    reward_fn.check_ready()
    start = time.perf_counter()
    with torch.no_grad():
        per_prompt = evaluate(
            pipeline, records, reward_fn, args.images_per_prompt, num_steps, guidance, args.eta, args.seed, args.batch_size
        )
    result = {
        "model": args.checkpoint or args.model,
        "prompts": prompts,
        "reward": reward,
        "num_prompts": len(records),
        "images_per_prompt": args.images_per_prompt,
        "num_steps": num_steps,
        "guidance_scale": guidance,
        "eta": args.eta,
        "seed": args.seed,
        "mean": float(per_prompt.mean()),
        "fraction_of_prompts_at_least_0.9": float((per_prompt >= 0.9).mean()),
        "per_prompt": {r.prompt: float(v) for r, v in zip(records, per_prompt)},
        "seconds": time.perf_counter() - start,
    }
    print(
        f"{result['model']}: mean {reward} {result['mean']:.4f} over {len(records)} prompts x "
        f"{args.images_per_prompt} images ({result['fraction_of_prompts_at_least_0.9']:.0%} of prompts >= 0.9), "
        f"{result['seconds']:.0f} s"
    )
    output = args.output or (os.path.join(args.checkpoint, "evaluation.json") if args.checkpoint else None)
    if output:
        with open(output, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {output}")
    return result


if __name__ == "__main__":
    main()
