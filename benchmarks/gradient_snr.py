"""How much of a GRPO update is signal: the split-half agreement of the policy gradient, step by step.

For one training prompt of the scenes world (a ladder rung-b case) and a base, the script samples `--images`
trajectories with the variant's sampler, scores them with the variant's reward and gives them GRPO's advantages
(per prompt: (r - mean) / std over the images, clipped at train.adv_clip_max), then computes, for every denoising
step t, the policy gradient of the first update (ratio 1): g_t = sum_i A_i grad log pi(x_{t+1}^i | x_t^i, c), one
group of `--chunk` images at a time.

Two halves of n images each, drawn apart, give two independent estimates of the same mean gradient mu_t; the cosine
between them estimates ||mu_t||^2 / (||mu_t||^2 + tr(Sigma_t) / n). So the gradient of n images has a
signal-to-noise ratio s(n) = cos / (1 - cos), which grows as n, and n* = n / s(n) is the number of images at which
its signal and its noise weigh the same (n* = inf where the cosine is not above 0). The mean inner product of the
two halves estimates ||mu_t||^2 without bias, so each step's share of the signal (of sum_t ||mu_t||) stands beside
its share of the gradient's norm (of sum_t ||g_t||, as the trainer's steps/grad_share). The null control does the same with the advantages shuffled among the images: no
information, cosines about 0, so a row's distance from its null row is what the reward tells the update.

Gradients are kept as count sketches: each parameter's gradient entry is added, with a random sign, into one of
`--buckets` bins (fixed by `--seed`); inner products of sketches are unbiased estimates of the gradients' (the
bins' error in a cosine is about 1 / sqrt(buckets)). Random halves are drawn `--splits` times and averaged.

    python benchmarks/gradient_snr.py --case two_object --output benchmarks/results/gradient_snr/two_object.json
    python benchmarks/gradient_snr.py --model PIPELINE_DIR --variant tiny_scenes --case colors --images 256

Prints a table (a row per step and one for the whole trajectory, the real advantages and the null control) and
writes JSON (--output; a file that exists is refused). One thread; the UNet m at 256 images: about 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from scenes_ladder import FAMILIES, RUNG_B_PROMPTS  # noqa: E402  (the ladder's variants and one-prompt cases)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-scenes", help="the base (a shipped name or a pipeline directory)")
    parser.add_argument("--variant", default=FAMILIES["unet"],
                        help=f"the variant whose sampler, reward and advantage clip are used (default {FAMILIES['unet']})")
    parser.add_argument("--case", default="two_object", choices=sorted(RUNG_B_PROMPTS),
                        help="the ladder's rung-b case whose prompt is trained")
    parser.add_argument("--images", type=int, default=256, help="trajectories sampled (two halves of half as many)")
    parser.add_argument("--chunk", type=int, default=8, help="images a backward (a group); divides --images / 2")
    parser.add_argument("--splits", type=int, default=200, help="random halvings averaged")
    parser.add_argument("--buckets", type=int, default=2**16, help="count-sketch bins")
    parser.add_argument("--seed", type=int, default=0, help="the sampling noise's, the sketch's and the halvings'")
    parser.add_argument("--output", default="", help="JSON file to write (refused if it exists)")
    args = parser.parse_args(argv)
    if args.images < 4 * args.chunk or args.images % (2 * args.chunk):
        parser.error(f"argument --images: must be a multiple of 2 x --chunk ({2 * args.chunk}) and hold at least "
                     f"two chunks a half, got {args.images}")
    for name in ("chunk", "splits", "buckets"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name}: must be at least 1, got {getattr(args, name)}")
    if args.output and os.path.exists(args.output):
        parser.error(f"argument --output: {args.output} exists; a measurement is never written over")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        parser.error(f"argument --output: the folder of {args.output} does not exist")
    return args


class CountSketch:
    """Signed hashing of a module's trainable gradients into `buckets` bins (fixed by `seed`)."""

    def __init__(self, params, buckets, seed):
        import torch

        generator = torch.Generator().manual_seed(seed)
        self.params, self.buckets = list(params), buckets
        self.index = [torch.randint(buckets, (p.numel(),), generator=generator) for p in self.params]
        self.sign = [torch.randint(2, (p.numel(),), generator=generator).float() * 2 - 1 for p in self.params]

    def of_grads(self):
        """The sketch (buckets,) float64 of the parameters' current .grad (None counts as 0)."""
        import torch

        sketch = torch.zeros(self.buckets, dtype=torch.float64)
        for p, index, sign in zip(self.params, self.index, self.sign):
            if p.grad is not None:
                sketch.index_add_(0, index, (p.grad.detach().flatten().float().cpu() * sign).double())
        return sketch


def grpo_advantages(rewards, clip):
    """GRPO's advantages of one prompt's images: (r - mean) / std (population std; 0 where it is 0), clipped."""
    rewards = np.asarray(rewards, dtype=np.float64)
    std = rewards.std()
    advantages = (rewards - rewards.mean()) / std if std > 0 else np.zeros_like(rewards)
    return np.clip(advantages, -clip, clip)


def split_half_stats(sketches, splits, rng):
    """sketches (K chunks, T, B) float64 -> per half-size n (in chunks 1 .. K // 2) and step (T, plus the sum over
    steps as the last row): the mean cosine and the mean inner product of two disjoint halves over `splits` random
    halvings. Returns (cos (H, T + 1), dot (H, T + 1)) with H = K // 2 half sizes."""
    k, t, _ = sketches.shape
    full = np.concatenate([sketches, sketches.sum(axis=1, keepdims=True)], axis=1)  # (K, T + 1, B)
    half = k // 2
    cos = np.zeros((half, t + 1))
    dot = np.zeros((half, t + 1))
    for _ in range(splits):
        order = rng.permutation(k)
        first = np.cumsum(full[order[:half]], axis=0)  # (half, T + 1, B): the first m chunks of each half
        second = np.cumsum(full[order[half: 2 * half]], axis=0)
        inner = np.einsum("mtb,mtb->mt", first, second)
        norms = np.linalg.norm(first, axis=-1) * np.linalg.norm(second, axis=-1)
        cos += np.divide(inner, norms, out=np.zeros_like(inner), where=norms > 0)
        dot += inner
    return cos / splits, dot / splits


def images_for_even_odds(cos, n):
    """n* = n (1 - cos) / cos, the images at which the gradient's signal and noise weigh the same; inf if cos <= 0."""
    return float(n * (1 - cos) / cos) if cos > 0 else float("inf")


def measure(args) -> dict:
    import torch

    from ddpo_group.config import grpo
    from ddpo_group.data import scenes
    from ddpo_group.diffusion.base import configure_from_sample
    from ddpo_group.diffusion.policy import load_policy
    from ddpo_group.rewards.geneval.reward import GenEvalReward

    torch.set_num_threads(1)
    config = grpo.get_config(args.variant)
    if config.reward_fn != "geneval":
        raise SystemExit(f"gradient_snr.py: error: --variant {args.variant}: its reward is {config.reward_fn!r}; "
                         "give a scenes variant (reward_fn geneval)")
    prompt = RUNG_B_PROMPTS[args.case]
    record = next(r for tag in scenes.training_records().values() for r in tag if r["prompt"] == prompt)
    s = config.sample
    policy = load_policy(args.model, torch_dtype=torch.float32)
    configure_from_sample(policy, s)
    model = policy.prepare(torch.device("cpu"), torch.float32, False)
    model.eval()  # the trainer's: no dropout in these models
    params = [p for p in model.parameters() if p.requires_grad]
    sketch = CountSketch(params, args.buckets, args.seed)
    reward = GenEvalReward(**dict(config.reward_kwargs["geneval"]))
    meta = {k: v for k, v in record.items() if k != "prompt"}

    start = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed)
    chunks, rewards, strict = [], [], []
    for _ in range(args.images // args.chunk):
        with torch.no_grad():
            batch = policy.sample([prompt] * args.chunk, num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                                  eta=s.eta, generator=generator, keep_steps=True)
        chunks.append(batch)
        scores, info = reward(batch.images.float(), [prompt] * args.chunk, [meta] * args.chunk)
        rewards.append(np.asarray(scores, dtype=np.float64))
        strict.append(np.asarray(info["strict_correct"], dtype=np.float64))
    rewards = np.concatenate(rewards)
    sample_seconds = time.perf_counter() - start
    advantages = grpo_advantages(rewards, config.train.adv_clip_max)
    shuffled = np.random.default_rng([args.seed, 1]).permutation(advantages)

    sketches = {"real": np.zeros((len(chunks), s.num_steps, args.buckets)),
                "null": np.zeros((len(chunks), s.num_steps, args.buckets))}
    rows = torch.arange(args.chunk)
    for c, batch in enumerate(chunks):
        weights = {name: torch.as_tensor(adv[c * args.chunk: (c + 1) * args.chunk], dtype=torch.float32)
                   for name, adv in (("real", advantages), ("null", shuffled))}
        for t in range(s.num_steps):
            step = torch.full((args.chunk,), t, dtype=torch.long)
            log_prob, _, _ = policy.step_log_prob(model, batch, rows, step, s.guidance_scale, s.eta)
            if not torch.isfinite(log_prob).all():  # a step without a density (a deterministic last step)
                continue
            for k, name in enumerate(("real", "null")):
                model.zero_grad(set_to_none=True)
                (weights[name] * log_prob.float()).sum().backward(retain_graph=k == 0)
                sketches[name][c, t] = sketch.of_grads().numpy()
    model.zero_grad(set_to_none=True)

    rng = np.random.default_rng([args.seed, 2])
    result = {"model": args.model, "variant": args.variant, "case": args.case, "prompt": prompt,
              "images": args.images, "chunk": args.chunk, "splits": args.splits, "buckets": args.buckets,
              "seed": args.seed, "num_steps": s.num_steps, "eta": s.eta, "guidance_scale": s.guidance_scale,
              "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
              "strict_correct": float(np.concatenate(strict).mean()),
              "half_sizes": [args.chunk * (m + 1) for m in range(len(chunks) // 2)], "advantages": {}}
    for name, stack in sketches.items():
        cos, dot = split_half_stats(stack, args.splits, rng)
        n = args.chunk * (len(chunks) // 2)
        signal = np.sqrt(np.clip(dot[-1, :-1], 0, None))  # ||mu_t||, up to one factor shared by the steps
        norm = np.linalg.norm(stack, axis=-1).mean(axis=0)  # (T,) a chunk's gradient's mean norm
        result["advantages"][name] = {
            "cos": cos.tolist(), "dot": dot.tolist(),
            "steps": [{"step": t if t < s.num_steps else "all", "cos": float(cos[-1, t]),
                       "images_for_even_odds": images_for_even_odds(float(cos[-1, t]), n)}
                      for t in range(s.num_steps + 1)],
            "signal_share": (signal / signal.sum()).tolist() if signal.sum() > 0 else None,
            "norm_share": (norm / norm.sum()).tolist() if norm.sum() > 0 else None,
        }
    result["seconds"] = {"sampling": round(sample_seconds, 1), "total": round(time.perf_counter() - start, 1)}
    result["command"] = "python benchmarks/gradient_snr.py " + " ".join(sys.argv[1:])
    return result


def table(result) -> str:
    n = result["half_sizes"][-1]
    sizes = [m for m in result["half_sizes"] if m in (8, 16, 32, 64, 128) or m == n]
    lines = [f"split-half agreement of the first GRPO update's gradient: {result['model']} ({result['variant']}), "
             f"\"{result['prompt']}\", {result['images']} images (reward {result['reward_mean']:.3f}, "
             f"strict-correct {result['strict_correct']:.3f}), {result['splits']} halvings",
             "| advantages | step | " + " | ".join(f"cos at {m} a half" for m in sizes)
             + " | images for even odds | share of the gradient's norm | share of its signal |",
             "|---" * (5 + len(sizes)) + "|"]
    for name, rows in result["advantages"].items():
        cos = np.asarray(rows["cos"])
        for t, step in enumerate(rows["steps"]):
            cells = [f"{cos[result['half_sizes'].index(m), t]:.3f}" for m in sizes]
            even = step["images_for_even_odds"]
            norm = (f"{rows['norm_share'][t]:.2f}" if rows["norm_share"] is not None
                    and t < len(rows["norm_share"]) else "")
            signal = (f"{rows['signal_share'][t]:.2f}" if rows["signal_share"] is not None
                      and t < len(rows["signal_share"]) else "")
            lines.append(f"| {name} | {step['step']} | " + " | ".join(cells)
                         + f" | {'inf' if even == float('inf') else f'{even:,.0f}'} | {norm} | {signal} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    result = measure(args)
    print(table(result))
    if args.output:
        tmp = args.output + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.output)
        print("wrote", args.output)
    return result


if __name__ == "__main__":
    main()
