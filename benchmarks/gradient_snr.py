"""How much of a GRPO update is signal: the split-half agreement of the policy gradient, step by step.

For one training prompt of the scenes world (a ladder rung-b case) and a base, the script samples `--images`
trajectories with the variant's sampler, scores them with the variant's reward, and keeps every image's score
gradient of every denoising step, grad log pi(x_{t+1}^i | x_t^i, c) (one model call an image and step). A batch of
n of those images is then an epoch of n images: its GRPO advantages A_i ((r - mean) / std over the n, clipped at
train.adv_clip_max; one prompt, so one group) and the policy gradient of its first update (ratio 1),
g_t = sum_i A_i grad log pi(x_{t+1}^i | x_t^i, c).

Two disjoint batches of n images, drawn at random from the sampled ones, give two independent estimates of the
same mean gradient mu_t; the cosine between them estimates ||mu_t||^2 / (||mu_t||^2 + tr(Sigma_t) / n). So the
gradient of n images has a signal-to-noise ratio s(n) = cos / (1 - cos), which grows as n, and n* = n / s(n) is the
number of images at which its signal and its noise weigh the same (n* = inf where the cosine is not above 0). The
mean inner product of the two batches estimates ||mu_t||^2 without bias, so each step's share of the signal (of
sum_t ||mu_t||) stands beside its share of the gradient's norm (of sum_t ||g_t||, all the images with their
advantages; the trainer's steps/grad_share). The null control does the same with each batch's rewards shuffled
among its images before its advantages are taken (a fresh shuffle every draw): no information, cosines about 0 on
average, and the spread of its single draws says how far chance alone moves one cosine.

The cosine weighs every parameter by its gradient's size; Adam does not: its first update of each parameter
entry is the sign of that entry's gradient, whatever its size. So the script also keeps the exact gradients of
`--entries` parameter entries chosen at random and reports the sign agreement of the two batches: the mean over
entries of sign(g1) sign(g2), 0 for independent batches, 1 when every entry would move the same way in both
(with its null, and its single draws' spread).

Several rewards can score the same trajectories (`--reward jpeg_incompressibility,partial,expected`: one
sampling, one set of gradients, each reward's advantages on the same pairs of batches). The JSON keeps each
under "rewards", and the first one's numbers at the top level as a result of one reward had them.

Gradients are kept as count sketches: each parameter's gradient entry is added, with a random sign, into one of
`--buckets` bins (fixed by `--seed`); inner products of sketches are unbiased estimates of the gradients' (the
bins' error in a cosine is about 1 / sqrt(buckets)). Pairs of batches are drawn `--splits` times and averaged.

    python benchmarks/gradient_snr.py --case two_object --output benchmarks/results/gradient_snr/two_object.json
    python benchmarks/gradient_snr.py --model PIPELINE_DIR --variant tiny_scenes --case colors --images 256
    python benchmarks/gradient_snr.py --case two_object --images 512 --reward jpeg_incompressibility,partial,expected

`jpeg_incompressibility` is the reward that rung a shows learning: the positive control, what a reward that
teaches looks like on this measurement.

Prints a table (a row per step and one for the whole trajectory, the real advantages and the null control) and
writes JSON (--output; a file that exists is refused). One thread; the UNet m at 512 images: about 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from scenes_ladder import FAMILIES, RUNG_B_PROMPTS  # noqa: E402  (the ladder's variants and one-prompt cases)


REWARDS = ("partial", "strict", "correct", "expected", "jpeg_incompressibility")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-scenes", help="the base (a shipped name or a pipeline directory)")
    parser.add_argument("--variant", default=FAMILIES["unet"], help="the variant whose sampler, reward and "
                        f"advantage clip are used (default {FAMILIES['unet']})")
    parser.add_argument("--case", default="two_object", choices=sorted(RUNG_B_PROMPTS),
                        help="the ladder's rung-b case whose prompt is trained")
    parser.add_argument("--reward", default="", help="comma-separated rewards scored on the same trajectories: "
                        f"{', '.join(REWARDS)} (GenEval's scores with the variant's detector; jpeg_incompressibility: "
                        "rung a's reward, which learns, the positive control); default: the variant's score")
    parser.add_argument("--entries", type=int, default=4096, help="parameter entries whose gradients are kept "
                        "exactly (chosen at random by --seed) for the sign agreement")
    parser.add_argument("--images", type=int, default=256, help="trajectories sampled (two halves of half as many)")
    parser.add_argument("--chunk", type=int, default=8, help="images sampled at a time; divides --images")
    parser.add_argument("--splits", type=int, default=100, help="pairs of disjoint batches drawn and averaged")
    parser.add_argument("--buckets", type=int, default=2**15, help="count-sketch bins")
    parser.add_argument("--seed", type=int, default=0, help="the sampling noise's, the sketch's and the halvings'")
    parser.add_argument("--output", default="", help="JSON file to write (refused if it exists)")
    args = parser.parse_args(argv)
    if args.images < 4 or args.images % 2 or args.images % max(args.chunk, 1):
        parser.error(f"argument --images: must be even, at least 4 and a multiple of --chunk ({args.chunk}), "
                     f"got {args.images}")
    rewards = [r.strip() for r in args.reward.split(",") if r.strip()]
    unknown = [r for r in rewards if r not in REWARDS]
    if unknown or len(set(rewards)) != len(rewards):
        parser.error(f"argument --reward: {args.reward!r}: give distinct names of {', '.join(REWARDS)}")
    args.rewards = rewards
    for name in ("chunk", "splits", "buckets", "entries"):
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


class Entries:
    """`count` parameter entries chosen at random (fixed by `seed`) among a module's trainable ones, their
    gradients kept exactly: Adam's first update of an entry is the sign of its gradient, whatever its scale."""

    def __init__(self, params, count, seed):
        import torch

        self.params = list(params)
        sizes = [p.numel() for p in self.params]
        total = sum(sizes)
        picks = torch.randperm(total, generator=torch.Generator().manual_seed(seed + 1))[:min(count, total)].sort()[0]
        starts = np.cumsum([0] + sizes)
        self.index = [picks[(picks >= starts[k]) & (picks < starts[k + 1])] - int(starts[k])
                      for k in range(len(self.params))]
        self.count = len(picks)

    def of_grads(self):
        """The chosen entries' gradients (count,) float64 (None counts as 0)."""
        import torch

        parts = [(p.grad.detach().flatten()[index].double().cpu() if p.grad is not None
                  else torch.zeros(len(index), dtype=torch.float64)) for p, index in zip(self.params, self.index)]
        return torch.cat(parts)


def grpo_advantages(rewards, clip):
    """GRPO's advantages of one prompt's images, as the trainer computes them (algos/advantages.py's
    compute_grpo_advantages: (r - mean) / (population std + 1e-6), 0 where the rewards are equal), clipped."""
    import torch

    from ddpo_group.algos.advantages import compute_grpo_advantages

    rewards = torch.as_tensor(np.asarray(rewards, dtype=np.float64))
    advantages, _ = compute_grpo_advantages(rewards, torch.zeros(len(rewards), dtype=torch.long),
                                            torch.ones(len(rewards), 1))
    return np.clip(advantages[:, 0].numpy(), -clip, clip)


def half_sizes(images):
    """The batch sizes n measured: powers of two from 8 (or 2) up to images / 2, and images / 2 itself."""
    half = images // 2
    sizes = [n for n in (2 ** k for k in range(1, 20)) if n <= half and (n >= 8 or half < 16)]
    return sizes + ([half] if half not in sizes else [])


def split_half_stats(scores, rewards, sizes, splits, rng, clip, shuffle=False):
    """scores (N images, T, B) sketches of each image's score gradient per step; rewards (N,). For each batch size n
    in `sizes` and step (T, plus the sum over steps as the last column): the mean cosine and the mean inner product
    of the policy gradients of two disjoint random batches of n images, each with its own GRPO advantages
    (shuffle: each batch's rewards permuted first, the null control), over `splits` draws; and the standard
    deviation of the single draws' cosines. Returns (cos, dot, cos_std), each (len(sizes), T + 1)."""
    n_images, steps, _ = scores.shape
    rewards = np.asarray(rewards, dtype=np.float64)
    cos = np.zeros((len(sizes), steps + 1))
    cos2 = np.zeros_like(cos)
    dot = np.zeros_like(cos)
    for _ in range(splits):
        order = rng.permutation(n_images)
        for k, n in enumerate(sizes):
            grads = []
            for batch in (order[:n], order[n_images // 2: n_images // 2 + n]):
                r = rng.permutation(rewards[batch]) if shuffle else rewards[batch]
                g = np.einsum("i,itb->tb", grpo_advantages(r, clip).astype(scores.dtype), scores[batch])
                grads.append(np.concatenate([g, g.sum(axis=0, keepdims=True)]).astype(np.float64))
            inner = np.einsum("tb,tb->t", *grads)
            norms = np.linalg.norm(grads[0], axis=-1) * np.linalg.norm(grads[1], axis=-1)
            c = np.divide(inner, norms, out=np.zeros_like(inner), where=norms > 0)
            cos[k] += c
            cos2[k] += c * c
            dot[k] += inner
    cos, cos2 = cos / splits, cos2 / splits
    return cos, dot / splits, np.sqrt(np.clip(cos2 - cos * cos, 0, None))


def sign_agreement(entries, rewards, sizes, splits, rng, clip, shuffle=False):
    """entries (N images, T, E) exact gradients of E parameter entries per step; as ``split_half_stats``, the
    agreement of two disjoint batches' policy gradients entry by entry as Adam's first update reads them (the
    sign): the mean over entries of sign(g1) sign(g2), 0 when the two are independent, 1 when every entry moves
    the same way. Returns (mean, its single draws' standard deviation), each (len(sizes), T + 1)."""
    n_images, steps, _ = entries.shape
    rewards = np.asarray(rewards, dtype=np.float64)
    agree = np.zeros((len(sizes), steps + 1))
    agree2 = np.zeros_like(agree)
    for _ in range(splits):
        order = rng.permutation(n_images)
        for k, n in enumerate(sizes):
            signs = []
            for batch in (order[:n], order[n_images // 2: n_images // 2 + n]):
                r = rng.permutation(rewards[batch]) if shuffle else rewards[batch]
                g = np.einsum("i,itb->tb", grpo_advantages(r, clip), entries[batch])
                signs.append(np.sign(np.concatenate([g, g.sum(axis=0, keepdims=True)])))
            a = (signs[0] * signs[1]).mean(axis=-1)
            agree[k] += a
            agree2[k] += a * a
    agree, agree2 = agree / splits, agree2 / splits
    return agree, np.sqrt(np.clip(agree2 - agree * agree, 0, None))


def images_for_even_odds(cos, n):
    """n* = n (1 - cos) / cos, the images at which the gradient's signal and noise weigh the same; inf if cos <= 0."""
    return float(n * (1 - cos) / cos) if cos > 0 else float("inf")


def measure(args) -> dict:
    import torch

    from ddpo_group.config import grpo
    from ddpo_group.data import scenes
    from ddpo_group.diffusion.base import configure_from_sample
    from ddpo_group.diffusion.policy import load_policy
    from ddpo_group.rewards.geneval.reward import INFO_KEYS, GenEvalReward

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
    exact = Entries(params, args.entries, args.seed)
    options = dict(config.reward_kwargs["geneval"])
    names = getattr(args, "rewards", None) or [options.get("score", "partial")]
    geneval = GenEvalReward(**{**options, "score": "expected" if "expected" in names else options.get("score",
                                                                                                      "partial")})
    jpeg = None
    if "jpeg_incompressibility" in names:
        from ddpo_group.rewards.registry import get_reward

        jpeg = get_reward("jpeg_incompressibility")
    meta = {k: v for k, v in record.items() if k != "prompt"}

    start = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed)
    scores = np.zeros((args.images, s.num_steps, args.buckets), dtype=np.float32)
    entries = np.zeros((args.images, s.num_steps, exact.count), dtype=np.float64)
    rewards = {name: [] for name in names}
    strict = []
    for c in range(args.images // args.chunk):
        with torch.no_grad():
            batch = policy.sample([prompt] * args.chunk, num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                                  eta=s.eta, generator=generator, keep_steps=True)
        images = batch.images.float()
        _, info = geneval(images, [prompt] * args.chunk, [meta] * args.chunk)
        strict.append(np.asarray(info["strict_correct"], dtype=np.float64))
        for name in names:
            values = (jpeg(images, [prompt] * args.chunk, [meta] * args.chunk)[0] if name == "jpeg_incompressibility"
                      else info[INFO_KEYS[name]])
            rewards[name].append(np.asarray(values, dtype=np.float64))
        for j in range(args.chunk):  # one image a call: its own score gradient at every step
            for t in range(s.num_steps):
                model.zero_grad(set_to_none=True)
                log_prob, _, _ = policy.step_log_prob(model, batch, torch.tensor([j]), torch.tensor([t]),
                                                      s.guidance_scale, s.eta)
                if not torch.isfinite(log_prob).all():  # a step without a density (a deterministic last step)
                    continue
                log_prob.float().sum().backward()
                scores[c * args.chunk + j, t] = sketch.of_grads().numpy()
                entries[c * args.chunk + j, t] = exact.of_grads().numpy()
    model.zero_grad(set_to_none=True)
    gradient_seconds = time.perf_counter() - start

    sizes = half_sizes(args.images)
    result = {"model": args.model, "variant": args.variant, "case": args.case, "prompt": prompt,
              "images": args.images, "splits": args.splits, "buckets": args.buckets, "entries": exact.count,
              "seed": args.seed, "num_steps": s.num_steps, "eta": s.eta, "guidance_scale": s.guidance_scale,
              "strict_correct": float(np.concatenate(strict).mean()), "half_sizes": sizes, "rewards": {}}
    for name in names:
        values = np.concatenate(rewards[name])
        rng = np.random.default_rng([args.seed, 2])  # every reward drawn on the same pairs of batches
        part = {"reward_mean": float(values.mean()), "reward_std": float(values.std()), "advantages": {}}
        for kind in ("real", "null"):
            cos, dot, cos_std = split_half_stats(scores, values, sizes, args.splits, rng, config.train.adv_clip_max,
                                                 shuffle=kind == "null")
            agree, agree_std = sign_agreement(entries, values, sizes, args.splits, rng, config.train.adv_clip_max,
                                              shuffle=kind == "null")
            signal = np.sqrt(np.clip(dot[-1, :-1], 0, None))  # ||mu_t||, up to one factor shared by the steps
            part["advantages"][kind] = {
                "cos": cos.tolist(), "cos_std": cos_std.tolist(), "dot": dot.tolist(),
                "sign_agreement": agree.tolist(), "sign_agreement_std": agree_std.tolist(),
                "steps": [{"step": t if t < s.num_steps else "all", "cos": float(cos[-1, t]),
                           "images_for_even_odds": images_for_even_odds(float(cos[-1, t]), sizes[-1])}
                          for t in range(s.num_steps + 1)],
                "signal_share": (signal / signal.sum()).tolist() if signal.sum() > 0 else None,
            }
        # each step's share of the gradient's norm: ||g_t|| of all the images with their advantages, over the sum
        weights = grpo_advantages(values, config.train.adv_clip_max)
        norms = np.linalg.norm(np.einsum("i,itb->tb", weights.astype(np.float32), scores), axis=-1)
        part["norm_share"] = (norms / norms.sum()).tolist() if norms.sum() > 0 else None
        result["rewards"][name] = part
    # the first reward's numbers at the top as well, where results of one reward always had them
    first = result["rewards"][names[0]]
    result.update({"reward": names[0], "reward_mean": first["reward_mean"], "reward_std": first["reward_std"],
                   "advantages": first["advantages"], "norm_share": first["norm_share"]})
    result["seconds"] = {"sampling_and_gradients": round(gradient_seconds, 1),
                         "total": round(time.perf_counter() - start, 1)}
    return result


def table(result) -> str:
    sizes = result["half_sizes"]
    lines = []
    for reward, part in result.get("rewards", {result.get("reward", "partial"): result}).items():
        lines += [f"split-half agreement of the first GRPO update's gradient: {result['model']} ({result['variant']}), "
                  f"\"{result['prompt']}\", {result['images']} images (reward {reward} {part['reward_mean']:.3f}, "
                  f"strict-correct {result['strict_correct']:.3f}), {result['splits']} pairs of batches a size",
                  "| advantages | step | " + " | ".join(f"cos, batches of {m}" for m in sizes)
                  + f" | one draw's spread at {sizes[-1]} | images for even odds | share of the gradient's norm "
                  f"| share of its signal | sign agreement at {sizes[0]} / {sizes[-1]} (spread) |",
                  "|---" * (7 + len(sizes)) + "|"]
        for name, rows in part["advantages"].items():
            cos, spread = np.asarray(rows["cos"]), np.asarray(rows["cos_std"])
            agree = np.asarray(rows.get("sign_agreement", np.full_like(cos, np.nan)))
            agree_std = np.asarray(rows.get("sign_agreement_std", np.full_like(cos, np.nan)))
            for t, step in enumerate(rows["steps"]):
                cells = [f"{cos[k, t]:.3f}" for k in range(len(sizes))]
                even = step["images_for_even_odds"]
                share = part["norm_share"]
                norm = f"{share[t]:.2f}" if share is not None and t < len(share) else ""
                signal = (f"{rows['signal_share'][t]:.2f}" if rows["signal_share"] is not None
                          and t < len(rows["signal_share"]) else "")
                lines.append(f"| {name} | {step['step']} | " + " | ".join(cells) + f" | {spread[-1, t]:.3f}"
                             + f" | {'inf' if even == float('inf') else f'{even:,.0f}'} | {norm} | {signal} "
                             f"| {agree[0, t]:.3f} / {agree[-1, t]:.3f} ({agree_std[-1, t]:.3f}) |")
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv=None):
    args = parse_args(argv)
    result = measure(args)
    result["command"] = "python benchmarks/gradient_snr.py " + shlex.join(sys.argv[1:] if argv is None else argv)
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
