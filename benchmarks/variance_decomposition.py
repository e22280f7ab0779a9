"""Where the reward's variance is, step by step, and how much of it a critic can see (issue 35, docs/critic.md).

No training. On a config variant's task (default `tiny`: the shipped shapes-world model, its 18 big-square
prompts, 10 DDIM steps, eta 1 at every step, CFG 3), B base trajectories (G per prompt) are sampled with their
noise drawn up front: the initial latent x_0 and z_0 .. z_{T-1}, x_{k+1} = mu_theta(x_k, t_k) + sigma_k z_k.

**Branching (item 1).** For a window W of steps (one step k, or 2 / 4 consecutive steps) and each base
trajectory i, M branches redraw z_W from its prefix x_{start(W)}, and keep the noise of every other step held
fixed at the base's values (common random numbers; `--others fixed`, the default), so a branch differs from the
base only by W's noise. The M + 1 rewards (base included) give s_i^2(W), the variance of the reward over W's
noise with everything else fixed; its mean over i is E[Var(r | z_not W)], W's total-effect (Sobol) variance.
Its share is that over the within-prompt variance Var_w(r) = mean over prompts of the variance of the base
rewards of that prompt (the per-prompt mean removed). "x_0" is the initial noise, redrawn with every z fixed.
Shares of one-step rows add to 1 when the steps act additively; more than 1 means interactions.
`--others deterministic` makes every step outside W a DDIM step with eta 0 (noise only in W: the
`sample.sde_window_size` designs); its variances are then those of that design, over the same Var_w(r).

Standard errors: bootstrap over the prompts (the base trajectories of a resampled prompt go together), 200
resamples, of the share (numerator and denominator resampled together).

**Critic (item 2, `--critic-epochs N > 0`).** A ValueNetwork (critic.py, the trainer's sizes) is trained alone on
N fresh batches of reference-policy rollouts, Monte-Carlo targets (every step's target is the trajectory's
reward: lambda 1), then evaluated on the base trajectories: explained variance of V(x_k) (the state before step
k) and V(x_{k+1}) (after it) against the reward, raw and within-prompt (V and r each minus their prompt's mean);
the same for the anchor V(x_k) = R(decode(x0_hat(x_k))) (critic_designs.py) and for the deterministic completion
V(x_k) = R(x_T of DDIM with eta 0 from x_k: T - k model calls, G2RPO's ODE completion); and the correlation over i of the
per-step advantages V(x_{k+1}) - V(x_k) (V(x_T) = r) with the branch-measured ones r_i - mean of its branches.

    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/variance_decomposition.py --output D.json --png D.png
    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/variance_decomposition.py --critic-epochs 30 --output ... --png ...

writes --output and --png; their defaults, benchmarks/results/variance_decomposition[_<others>].json and
docs/images/variance_decomposition[_<others>].png, hold the committed results and are written over only when named.
"""

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "config"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import grpo  # noqa: E402  config/grpo.py
from bench_outputs import BenchmarkError, refuse_committed_default  # noqa: E402

from ddpo_group.config.check import load_config_prompts  # noqa: E402
from ddpo_group.training.critic import ValueNetwork, compute_values  # noqa: E402
from ddpo_group.training.critic_designs import anchor_values, decode_latents  # noqa: E402
from ddpo_group.diffusion.policy import load_policy  # noqa: E402
from ddpo_group.diffusion.sd import step_log_prob  # noqa: E402
from ddpo_group.rewards import build_reward_fn  # noqa: E402


class Task:
    """The variant's model, prompts, reward and sampler settings, with the prompts encoded once."""

    def __init__(self, variant, chunk):
        config = grpo.get_config(variant)
        self.config, self.chunk = config, chunk
        self.policy = load_policy(config.pretrained.model)
        self.pipe = self.policy.pipeline
        self.policy.prepare("cpu", torch.float32, use_lora=False)
        self.unet = self.pipe.unet.eval()
        self.records = load_config_prompts(config, "prompt_fn")
        self.reward_fn = build_reward_fn(config.reward_fn, reward_workers=1)
        s = config.sample
        self.T, self.eta, self.gs = s.num_steps, float(s.eta), float(s.guidance_scale)
        self.pipe.scheduler.set_timesteps(self.T)
        self.timesteps = self.pipe.scheduler.timesteps.clone()
        prompts = [r.prompt for r in self.records]
        cond, uncond = self.pipe.encode_prompt(prompts, "cpu", 1, self.gs > 1, negative_prompt=[s.negative_prompt] * len(prompts))
        self.cond, self.uncond = cond, uncond
        size = self.pipe.unet.config.sample_size
        self.latent_shape = (self.pipe.unet.config.in_channels, size, size)

    def embeds(self, prompt_idx):
        return SimpleNamespace(prompt_embeds=self.cond[prompt_idx],
                               negative_prompt_embeds=None if self.uncond is None else self.uncond[prompt_idx])

    @torch.no_grad()
    def run(self, x, start, noise, prompt_idx, etas, keep=False):
        """From latents x (N, C, h, w) at step `start`, steps start .. T-1 with noise (N, T, C, h, w) (columns
        < start unused) and per-step eta `etas`; returns rewards (N,) float64 and, if keep, latents (N, T+1, ...)."""
        rewards, kept = [], []
        for a in range(0, len(x), self.chunk):
            rows = slice(a, a + self.chunk)
            xs, pid = x[rows], prompt_idx[rows]
            e = self.embeds(pid)
            traj = [xs]
            for k in range(start, self.T):
                t = self.timesteps[k].expand(len(xs))
                _, mean, std = step_log_prob(self.unet, self.pipe.scheduler, xs, xs, t, e.prompt_embeds,
                                             e.negative_prompt_embeds, self.gs, etas[k])
                xs = mean + std * noise[rows, k] if etas[k] > 0 else mean
                traj.append(xs)
            images = decode_latents(self.pipe, xs)
            total = self.reward_fn(images, [self.records[i].prompt for i in pid.tolist()],
                                   [self.records[i].metadata for i in pid.tolist()])[0]
            rewards.append(np.asarray(total, dtype=np.float64))
            if keep:
                kept.append(torch.stack(traj, 1))
        return np.concatenate(rewards), (torch.cat(kept) if keep else None)


def within_prompt_variance(rewards, prompt_idx, prompts=None):
    """mean over prompts of the (ddof 1) variance of that prompt's rewards."""
    prompts = np.unique(prompt_idx) if prompts is None else prompts
    return float(np.mean([np.var(rewards[prompt_idx == p], ddof=1) for p in prompts]))


def bootstrap_share(per_traj_var, rewards, prompt_idx, n_boot=200, seed=0):
    """(share, standard error): mean(per_traj_var) / Var_w(rewards), bootstrap over prompts."""
    share = float(np.mean(per_traj_var) / within_prompt_variance(rewards, prompt_idx))
    rng = np.random.default_rng(seed)
    prompts = np.unique(prompt_idx)
    boots = []
    for _ in range(n_boot):
        pick = rng.choice(prompts, len(prompts))
        num = np.mean(np.concatenate([per_traj_var[prompt_idx == p] for p in pick]))
        den = np.mean([np.var(rewards[prompt_idx == p], ddof=1) for p in pick])
        boots.append(num / den)
    return share, float(np.std(boots, ddof=1))


def windows(T):
    rows = [("x_0", None, 0)] + [(f"step {k}", k, 1) for k in range(T)]
    rows += [(f"steps {k}-{k + 1}", k, 2) for k in range(0, T - 1, 2)]
    rows += [(f"steps {k}-{k + 3}", k, 4) for k in range(0, T - 3, 2)]
    return rows


def decompose(task, args):
    T, G, M = task.T, args.per_prompt, args.branches
    P = len(task.records)
    gen = torch.Generator().manual_seed(args.seed)
    prompt_idx = torch.arange(P).repeat_interleave(G)
    N = len(prompt_idx)
    x0 = torch.randn(N, *task.latent_shape, generator=gen)
    Z = torch.randn(N, T, *task.latent_shape, generator=gen)
    full = [task.eta] * T
    base_etas = full if args.others == "fixed" else [0.0] * T
    # the within-prompt variance of the sampler as configured (noise everywhere), the denominator of every share
    r_full, lat_full = task.run(x0, 0, Z, prompt_idx, full, keep=True)
    r_base, lat_base = (r_full, lat_full) if args.others == "fixed" else task.run(x0, 0, Z, prompt_idx, base_etas, keep=True)
    pid = prompt_idx.numpy()
    total = within_prompt_variance(r_full, pid)
    results, branch_adv = [], {}
    for name, k, w in windows(T):
        t0 = time.perf_counter()
        start = 0 if k is None else k
        etas = list(base_etas)
        if k is not None:
            etas[k : k + w] = [task.eta] * w
        rewards = [r_base]
        for _ in range(M):
            if k is None:
                x_start, noise = torch.randn(N, *task.latent_shape, generator=gen), Z
            else:
                x_start, noise = lat_base[:, k], Z.clone()
                noise[:, k : k + w] = torch.randn(N, w, *task.latent_shape, generator=gen)
            rewards.append(task.run(x_start, start, noise, prompt_idx, etas)[0])
        rewards = np.stack(rewards, 1)  # (N, M + 1)
        per_traj = rewards.var(axis=1, ddof=1)
        share, se = bootstrap_share(per_traj, r_full, pid, seed=args.seed)
        if w == 1:
            branch_adv[k] = (rewards[:, 0] - rewards.mean(axis=1)).tolist()
        results.append({"window": name, "start": k, "size": w, "variance": float(per_traj.mean()), "share": share,
                        "share_se": se, "seconds": time.perf_counter() - t0})
        print(f"{name:>10}: variance {per_traj.mean():.5f}  share {share:.3f} +- {se:.3f}  "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return {"within_prompt_variance": total, "reward_mean": float(r_full.mean()), "num_trajectories": N,
            "rows": results}, (r_base, lat_base, prompt_idx, branch_adv)


def explained_variance(values, rewards, pid, within):
    """1 - Var(r - V) / Var(r); within: r and V each minus their prompt's mean first."""
    v, r = np.asarray(values, np.float64).copy(), np.asarray(rewards, np.float64).copy()
    if within:
        for p in np.unique(pid):
            r[pid == p] -= r[pid == p].mean()
            v[pid == p] -= v[pid == p].mean()
    return float(1 - np.var(r - v) / np.var(r))


def within_corr2(before, after, rewards, pid):
    """(squared correlation with r of V(x_k), of V(x_{k+1})), each minus its prompt's mean: the variance an affine
    recalibration of V would explain (an uncalibrated anchor can have a negative EV and a high correlation)."""
    out = []
    for v in (before, after):
        v, r = np.asarray(v, np.float64).copy(), np.asarray(rewards, np.float64).copy()
        for p in np.unique(pid):
            r[pid == p] -= r[pid == p].mean()
            v[pid == p] -= v[pid == p].mean()
        out.append(float(np.corrcoef(v, r)[0, 1] ** 2) if np.std(v) > 0 else 0.0)
    return out


def train_critic(task, args):
    """A ValueNetwork trained alone on args.critic_epochs fresh batches of 64 reference rollouts, MC targets."""
    T, P = task.T, len(task.records)
    gen = torch.Generator().manual_seed(args.seed + 1)
    torch.manual_seed(args.seed)
    critic = ValueNetwork(latent_channels=task.latent_shape[0], prompt_dim=task.cond.shape[-1],
                          hidden=task.config.critic.hidden)
    opt = torch.optim.AdamW(critic.parameters(), lr=task.config.critic.learning_rate)
    full = [task.eta] * T
    t_all = task.timesteps.long().expand(1, T)
    t0 = time.perf_counter()
    for epoch in range(args.critic_epochs):  # one epoch = one fresh batch of 64 rollouts, 4 passes over its steps
        pid = torch.randint(P, (64,), generator=gen)
        x0 = torch.randn(64, *task.latent_shape, generator=gen)
        Z = torch.randn(64, T, *task.latent_shape, generator=gen)
        r, lat = task.run(x0, 0, Z, pid, full, keep=True)
        r = torch.as_tensor(r, dtype=torch.float32)
        for _ in range(4):
            perm = torch.randperm(64, generator=gen)
            for a in range(0, 64, 16):
                rows = perm[a : a + 16]
                lx = lat[rows, :T].flatten(0, 1)
                tt = t_all.expand(len(rows), T).flatten()
                pe = task.cond[pid[rows]].mean(1).repeat_interleave(T, 0)
                loss = ((critic(lx, tt, pe) - r[rows].repeat_interleave(T)) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    return critic


def critic_study(task, args, base):
    """Item 2: train a ValueNetwork on reference rollouts (MC returns), measure it, the anchor and the deterministic
    completion on the base set (args.critics)."""
    r_base, lat_base, prompt_idx, branch_adv = base
    critics = args.critics.split(",")
    T = task.T
    t_all = task.timesteps.long().expand(1, T)
    t0 = time.perf_counter()
    if "network" in critics:
        critic = train_critic(task, args)
    seconds = time.perf_counter() - t0
    N = len(r_base)
    measured = []
    if "network" in critics:
        with torch.no_grad():
            measured.append(("network", compute_values(critic, lat_base, t_all.expand(N, T), task.cond[prompt_idx]).numpy()))
    if "anchor" in critics:
        batch = SimpleNamespace(latents=lat_base, timesteps=t_all.expand(N, T), prompt_embeds=task.cond[prompt_idx],
                                negative_prompt_embeds=None if task.uncond is None else task.uncond[prompt_idx])
        measured.append(("anchor", anchor_values(
            task.policy, task.unet, batch, task.reward_fn, [task.records[i].prompt for i in prompt_idx],
            [task.records[i].metadata for i in prompt_idx], task.gs, micro_batch_size=task.chunk).numpy()))
    if "completion" in critics:  # G2RPO-style: the reward of the deterministic (eta 0) completion of x_k, T - k calls
        measured.append(("completion", np.stack(
            [task.run(lat_base[:, k], k, None, prompt_idx, [0.0] * T)[0] for k in range(T)], 1)))
    pid = prompt_idx.numpy()
    rows = []
    for name, values in measured:
        after = np.concatenate([values[:, 1:], r_base[:, None]], 1)  # V(x_{k+1}); V(x_T) = r
        for k in range(T):
            adv = after[:, k] - values[:, k]
            branch = np.asarray(branch_adv.get(k, [np.nan] * N))
            corr = float(np.corrcoef(adv, branch)[0, 1]) if np.std(adv) > 0 else float("nan")
            rows.append({"critic": name, "step": k,
                         "ev_before": explained_variance(values[:, k], r_base, pid, False),
                         "ev_after": explained_variance(after[:, k], r_base, pid, False),
                         "ev_before_within": explained_variance(values[:, k], r_base, pid, True),
                         "ev_after_within": explained_variance(after[:, k], r_base, pid, True),
                         "corr2_within": within_corr2(values[:, k], after[:, k], r_base, pid),
                         "corr_with_branch_advantage": corr})
            x = rows[-1]
            print(f"{name:>8} step {k}: EV before {x['ev_before']:+.3f} ({x['ev_before_within']:+.3f} within)  "
                  f"after {x['ev_after']:+.3f} ({x['ev_after_within']:+.3f})  corr2 within {x['corr2_within'][0]:.3f} "
                  f"{x['corr2_within'][1]:.3f}  corr(A, A_branch) {corr:+.3f}", flush=True)
    return {"critic_epochs": args.critic_epochs, "critic_train_seconds": seconds, "rows": rows}


def markdown(result):
    """The tables of docs/critic.md from a result."""
    d = result["decomposition"]
    lines = [f"| window | variance | share of Var_w(r) = {d['within_prompt_variance']:.4f} |", "|---|---|---|"]
    lines += [f"| {r['window']} | {r['variance']:.4f} | {r['share']:.3f} +- {r['share_se']:.3f} |" for r in d["rows"]]
    if "critic" in result:
        lines += ["", "| critic | step k | EV of V(x_k), within | EV of V(x_k+1), within | corr^2 V(x_k), V(x_k+1) | "
                  "corr(A_k, branch A_k) |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['critic']} | {r['step']} | {r['ev_before_within']:+.2f} | {r['ev_after_within']:+.2f} | "
                  f"{r['corr2_within'][0]:.2f}, {r['corr2_within'][1]:.2f} | {r['corr_with_branch_advantage']:+.2f} |"
                  for r in result["critic"]["rows"]]
    return "\n".join(lines)


def draw(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["decomposition"]["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(9, 2.6), gridspec_kw={"width_ratios": [11, 5, 4]})
    for ax, size, title in zip(axes, (1, 2, 4), ("one step (x_0: initial noise)", "2-step windows", "4-step windows")):
        sel = [r for r in rows if r["size"] == size or (size == 1 and r["start"] is None)]
        labels = [r["window"].replace("steps ", "").replace("step ", "") for r in sel]
        ax.bar(range(len(sel)), [r["share"] for r in sel], yerr=[r["share_se"] for r in sel], color="tab:blue", capsize=2)
        ax.set_xticks(range(len(sel)), labels, fontsize=7)
        ax.set_title(title, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    axes[0].set_ylabel("share of Var_within(reward)", fontsize=8)
    fig.suptitle(f"{result['variant']}: variance of the reward from each step's noise "
                 f"(others {result['others']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--per-prompt", type=int, default=4, help="base trajectories per prompt (G)")
    parser.add_argument("--branches", type=int, default=4, help="branches M per base trajectory and window")
    parser.add_argument("--others", choices=("fixed", "deterministic"), default="fixed",
                        help="the steps outside the window: their noise held at the base's (fixed) or eta 0")
    parser.add_argument("--critic-epochs", type=int, default=0, help="item 2: critic training batches (0: skip)")
    parser.add_argument("--critics", default=None,
                        help="comma-separated of network (needs --critic-epochs), anchor, completion; default: all "
                        "three with --critic-epochs > 0, none without")
    parser.add_argument("--chunk", type=int, default=96, help="trajectories per model call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="")
    parser.add_argument("--png", default="")
    parser.add_argument("--markdown", default="", help="only print the tables of this result JSON")
    args = parser.parse_args(argv)
    suffix = "" if args.others == "fixed" else "_deterministic"
    default_out = os.path.join(ROOT, "benchmarks", "results", f"variance_decomposition{suffix}.json")
    default_png = os.path.join(ROOT, "docs", "images", f"variance_decomposition{suffix}.png")
    try:  # before the minutes of sampling: the committed result and the docs' figure only when named
        if not args.markdown:
            refuse_committed_default("--output", default_out, bool(args.output))
            refuse_committed_default("--png", default_png, bool(args.png))
    except BenchmarkError as err:
        parser.error(str(err))
    if args.critics is None:
        args.critics = "network,anchor,completion" if args.critic_epochs else ""
    if "network" in args.critics and not args.critic_epochs:
        parser.error("--critics network needs --critic-epochs > 0")
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return
    start = time.perf_counter()
    task = Task(args.variant, args.chunk)
    decomposition, base = decompose(task, args)
    result = {"variant": args.variant, "others": args.others, "per_prompt": args.per_prompt, "branches": args.branches,
              "seed": args.seed, "num_steps": task.T, "eta": task.eta, "guidance_scale": task.gs,
              "decomposition": decomposition}
    if args.critics:
        result["critic"] = critic_study(task, args, base)
    result["seconds"] = time.perf_counter() - start
    out = args.output or default_out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(out + ".tmp", out)
    png = args.png or default_png
    os.makedirs(os.path.dirname(png), exist_ok=True)
    draw(result, png)
    print(markdown(result))
    print(f"total within-prompt variance {decomposition['within_prompt_variance']:.5f} "
          f"(reward mean {decomposition['reward_mean']:.3f}); {result['seconds']:.0f} s; wrote {out}, {png}")


if __name__ == "__main__":
    main()
