"""Mean reward of a model (or a training checkpoint) over every prompt of a prompt set, with fixed noise.

    .venv/bin/python scripts/evaluate.py --model tiny-shapes --prompts shapes_squares.txt --images-per-prompt 4
    .venv/bin/python scripts/evaluate.py --checkpoint runs/NAME/checkpoints/checkpoint_60

A checkpoint is read with the settings of its run (config.json beside checkpoints/): its prompts,
reward, steps, guidance, eta and evaluation seed and images per prompt, unless a flag says otherwise.
The evaluation is ddpo_group.evaluation's, the one the trainer logs as eval/reward_mean: image j
of prompt i starts from the same noise in every evaluation, so two models compare directly.
Prints a summary and writes JSON (evaluation.json beside a checkpoint).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_group.diffusion.policy import load_policy  # noqa: E402
from ddpo_group.evaluation import evaluate  # noqa: E402
from ddpo_group.prompts import load_prompts  # noqa: E402
from ddpo_group.rewards import build_reward_fn  # noqa: E402


def load_checkpoint_policy(checkpoint):
    """The run's model with the checkpoint's trained weights (full weights or LoRA), and the run's config."""
    run_dir = os.path.dirname(os.path.abspath(checkpoint))
    if os.path.basename(run_dir) == "checkpoints":
        run_dir = os.path.dirname(run_dir)
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    policy = load_policy(config["pretrained"]["model"])
    sample = config.get("sample", {})
    policy.configure(sde_type=sample.get("sde_type", ""), max_sequence_length=sample.get("max_sequence_length", 0),
                     resolution=sample.get("resolution", 0))
    if config["use_lora"]:
        policy.pipeline.load_lora_weights(os.path.join(checkpoint, "lora"))
    else:
        policy.load_trainable(policy.trainable_module, checkpoint, use_lora=False)
    return policy, config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-shapes", help="model to evaluate (ignored with --checkpoint)")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint_N directory of a run")
    parser.add_argument("--prompts", default=None, help="prompt set (default: the run's eval/training prompts, or shapes)")
    parser.add_argument("--reward", default=None, help="reward (default: the run's, or shapes_alignment)")
    parser.add_argument("--images-per-prompt", type=int, default=None, help="default: the run's, or 4")
    parser.add_argument("--num-steps", type=int, default=None, help="denoising steps (default: the run's, or 10)")
    parser.add_argument("--guidance-scale", type=float, default=None)
    parser.add_argument("--eta", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="noise seed (default: the run's eval_seed, or 1234)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output", default=None, help="JSON file to write (default: beside the checkpoint, or print only)")
    args = parser.parse_args(argv)

    run = {}
    if args.checkpoint:
        policy, run = load_checkpoint_policy(args.checkpoint)
    else:
        policy = load_policy(args.model)
    sample = run.get("sample", {})
    prompts = args.prompts or run.get("eval_prompt_fn") or run.get("prompt_fn", "shapes")
    reward = args.reward or run.get("reward_fn", "shapes_alignment")
    images_per_prompt = args.images_per_prompt or (run.get("eval_images_per_prompt") if run.get("eval_freq") else None) or 4
    num_steps = args.num_steps or sample.get("num_steps", 10)
    guidance = args.guidance_scale or sample.get("guidance_scale", 3.0)
    eta = args.eta if args.eta is not None else sample.get("eta", 1.0)
    seed = args.seed if args.seed is not None else run.get("eval_seed", 1234)
    records = load_prompts(prompts)
    reward_fn = build_reward_fn(reward)
    reward_fn.check_ready()
    start = time.perf_counter()
    result = evaluate(policy, None, records, reward_fn, images_per_prompt, num_steps, guidance, eta, seed=seed,
                      batch_size=args.batch_size)
    per_prompt = result["per_prompt"]
    summary = {
        "model": args.checkpoint or args.model,
        "prompts": prompts,
        "reward": reward,
        "num_prompts": len(records),
        "images_per_prompt": images_per_prompt,
        "num_steps": num_steps,
        "guidance_scale": guidance,
        "eta": eta,
        "seed": seed,
        "mean": result["reward_mean"],
        "std": result["reward_std"],
        "components": result["components"],
        "fraction_of_prompts_at_least_0.9": float((per_prompt >= 0.9).mean()),
        "per_prompt": {r.prompt: float(v) for r, v in zip(records, per_prompt)},
        "seconds": time.perf_counter() - start,
    }
    print(
        f"{summary['model']}: mean {reward} {summary['mean']:.4f} over {len(records)} prompts x "
        f"{images_per_prompt} images ({summary['fraction_of_prompts_at_least_0.9']:.0%} of prompts >= 0.9), "
        f"{summary['seconds']:.0f} s"
    )
    output = args.output or (os.path.join(args.checkpoint, "evaluation.json") if args.checkpoint else None)
    if output:
        with open(output, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {output}")
    return summary


if __name__ == "__main__":
    with torch.no_grad():
        main()
