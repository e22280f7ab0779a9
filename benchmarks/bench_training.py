"""Speed, memory and reward-per-second of the RL methods, trained one after another from one seed.

    python benchmarks/bench_training.py --quick                  # CPU, shapes world, under 10 minutes
    python benchmarks/bench_training.py --quick --threads 1      # the same on a CPU shared with other jobs
    python benchmarks/bench_training.py --output-dir benchmarks/results   # the full run quoted in benchmarks/README.md
    python benchmarks/bench_training.py --model tiny --quick     # random-weight tiny model (no shipped weights needed)
    python benchmarks/bench_training.py --model tiny-sd3 --quick # random-weight tiny SD3 (flow matching, SDE steps)
    python benchmarks/bench_training.py --profile group_ppo_endpoints   # where one epoch's time goes
    python benchmarks/bench_training.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 --device cuda

Every method is a named variant of config/grpo.py with its method fields changed; the sampling
work (model, prompts, reward, sample.*, train.batch_size, gradient accumulation, learning rate,
seed) is copied from one common variant, so every method samples the same trajectories at epoch 0
and differs only in how it trains. Each method runs in this process through
`ddpo_group.training.trainer.Trainer(config).run()` into results_dir/runs/<mode>/<method>/, and its
metrics.jsonl is read back to build the tables.

Definitions (also written into the JSON file):

    epoch seconds        wall clock from the start of an epoch's sampling to the end of its critic
                         update (sample + reward + advantages + train + critic; logging excluded)
    wall seconds         cumulative epoch seconds at the end of an epoch; total = at the last epoch
    initial reward       reward_mean of epoch 0 (sampled before any update; equal for all methods)
    final reward         mean of reward_mean over the last min(3, E) epochs
    reward per second    (final reward - initial reward) / total wall seconds
    smoothed reward      at epoch i, the mean of reward_mean over epochs max(0, i - 2) .. i
    time to reach R      wall seconds at the end of the first epoch whose smoothed reward >= R
                         (None: never); R = the ddpo run's final reward
    train speedup        ddpo's mean time/train divided by the method's mean time/train
    UNet calls           train/unet_calls: batched UNet forward+backward calls of the training pass
    UNet steps           train/unet_steps_per_sample x num_samples x num_inner_epochs: forward+backward
                         passes in trajectory-step units (one trajectory, one denoising step); the
                         reference model's extra no-grad forward (grpo_kl) is not counted
"""

import argparse
import ast
import concurrent.futures
import cProfile
import datetime
import gc
import gzip
import io
import json
import math
import os
import platform
import pstats
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "config"))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

import grpo  # noqa: E402  config/grpo.py
from bench_outputs import BenchmarkError, fail, own_folder, refuse_committed_default, require_finished  # noqa: E402
import torch  # noqa: E402

from ddpo_group.runs import metrics_log  # noqa: E402
from ddpo_group.training.trainer import Trainer  # noqa: E402

FINAL_WINDOW = 3
TRAIN_SPEEDUP_TARGET = 4.0
TIME_TO_REACH_TARGET = 0.4
QUICK_EPOCHS = 6
FULL_EPOCHS = 30
TINY_MODELS = ("tiny", "tiny-shapes", "tiny-sd3", "tiny-flux")

# method -> (description, variant for the tiny models, variant for Stable Diffusion, method fields)
METHODS = {
    "ddpo": (
        "ddpo-pytorch: PPO on all timesteps, per-prompt stat tracking",
        "tiny_ddpo", "ddpo", {},
    ),
    "ddpo_fraction": (
        "ddpo with timestep_fraction 0.5 (a random half of the steps per trajectory)",
        "tiny_ddpo", "ddpo", {"train.timestep_selection": "fraction", "train.timestep_fraction": 0.5},
    ),
    "grpo_kl": (
        "GRPO advantages + reference KL (gaussian), all timesteps",
        "tiny", "sd15", {},
    ),
    "group_ppo": (
        "Group-PPO's default: noise only at the first step (a 1-step SDE window), trained there, "
        "GAE advantages normalised per prompt, reference KL",
        "tiny_group_ppo", "group_ppo", {"sample.sde_window_size": 1, "sample.sde_window_start": 0},
    ),
    "group_ppo_endpoints": (
        "Group-PPO as Algorithm 2 is written: noise everywhere, critic + GAE + grouping, trained on endpoints",
        "tiny_group_ppo_alg2", "group_ppo_alg2", {"train.timestep_selection": "endpoints"},
    ),
    "group_ppo_sampled": (
        "Algorithm 2's advantages, actor trained at one step drawn inside each segment (weighted by its length)",
        "tiny_group_ppo_alg2", "group_ppo_alg2", {"train.timestep_selection": "segment_sample"},
    ),
    "early_window": (
        "GRPO + KL trained only at the first (noisiest) 2 steps, Flow-GRPO-Fast / MixGRPO style",
        "tiny_early_window", "sd15", {"train.timestep_selection": "early", "train.early_steps": 2},
    ),
    "gae": (
        "PPO with a critic and GAE advantages over the denoising steps, all timesteps, reference KL",
        "tiny_gae", "sd15", {"algorithm.adv_estimator": "gae"},
    ),
    "group_ppo_all": (
        "Algorithm 2's advantages, actor trained on every valid step with the segment advantage",
        "tiny_group_ppo_alg2", "group_ppo_alg2", {"train.timestep_selection": "all"},
    ),
    "group_ppo_start": (
        "Algorithm 2's advantages, actor trained at the first (noisiest) step of each segment",
        "tiny_group_ppo_alg2", "group_ppo_alg2", {"train.timestep_selection": "segment_start"},
    ),
    "nft": (
        "DiffusionNFT: forward-process matching loss of implicit positive / negative policies weighted by the "
        "outcome's optimality r, no log-probs (docs/forward.md)",
        "tiny_nft", "sd15", {
            "train.objective": "nft", "train.use_reference_model": False, "train.use_kl_loss": False,
            "train.beta": 0.0, "forward.num_timesteps": 9, "forward.nft_beta": 1.0, "forward.weighting": "uniform",
        },
    ),
    "awm": (
        "Advantage-weighted matching: PPO's clipped ratio of forward-process matching losses with the outcome "
        "advantage, no log-probs (docs/forward.md)",
        "tiny_awm", "sd15", {
            "train.objective": "awm", "train.use_reference_model": False, "train.use_kl_loss": False,
            "train.beta": 0.0, "forward.num_timesteps": 4, "forward.weighting": "uniform",
        },
    ),
    "dgpo": (
        "DGPO: each group's preference of its positive over its negative samples on the matching loss against a "
        "frozen reference, no log-probs (docs/forward.md)",
        "tiny_dgpo", "sd15", {
            "train.objective": "dgpo", "train.use_reference_model": True, "train.use_kl_loss": False,
            "train.beta": 0.0, "forward.num_timesteps": 4, "forward.dgpo_beta": 100.0,
            "forward.old_decay_rate": 0.0, "forward.old_decay_max": 0.0,
        },
    ),
    "dpo": (
        "Diffusion-DPO with online pairs (each group's best and worst sample) against a frozen reference, no "
        "log-probs (docs/forward.md)",
        "tiny_dpo", "sd15", {
            "train.objective": "dpo", "train.use_reference_model": True, "train.use_kl_loss": False,
            "train.beta": 0.0, "forward.num_timesteps": 4, "forward.dpo_beta": 5000.0, "forward.dpo_pairs": "online",
            "forward.old_decay_rate": 0.0, "forward.old_decay_max": 0.0,
        },
    ),
    "sde_window2": (
        "GRPO + KL with noise only in the first 2 steps (an SDE window; ODE steps elsewhere), trained there",
        "tiny", "sd15", {"sample.sde_window_size": 2},
    ),
    # issue 35 (docs/critic.md, benchmarks/critic_study.sh): per-step critic advantages; critic.kind picks the design
    "critic_window": (
        "per-step critic advantages (Group-PPO with one-step segments, per-prompt baseline, KL) in a 4-step SDE "
        "window, every window step trained, the critic on every step",
        "tiny_group_ppo", "group_ppo", {
            "sample.sde_window_size": 4, "group_ppo.max_group_size": 1, "train.timestep_selection": "all",
            "critic.train_steps": "all",
        },
    ),
    "critic_everywhere": (
        "noise at every step (Algorithm 2's sampling) with per-step critic advantages (one-step segments, "
        "per-prompt baseline, KL), the first 4 of the 10 steps trained: the critic must take the later steps' "
        "noise out of their credit",
        "tiny_group_ppo", "group_ppo", {
            "sample.sde_window_size": 0, "group_ppo.max_group_size": 1, "train.timestep_selection": "early",
            "train.early_steps": 4, "critic.train_steps": "all",
        },
    ),
    "group_shared": (
        "Group-PPO's default with each prompt's group sharing its initial noise (TempFlow-GRPO's seed groups, "
        "sample.group_noise='shared'): the only spread inside a group is the trained step's noise",
        "tiny_group_ppo", "group_ppo", {
            "sample.sde_window_size": 1, "sample.sde_window_start": 0, "sample.group_noise": "shared",
        },
    ),
    "branch": (
        "TempFlow-style branching: a group shares its initial noise and the ODE steps up to a step drawn each epoch "
        "(a 1-step SDE window, sample.sde_window='random'), branches there and is trained there; GRPO + KL",
        "tiny", "sd15", {"sample.sde_window_size": 1, "sample.sde_window": "random", "sample.group_noise": "shared"},
    ),
}
# The variant whose sampling work every method copies.
COMMON_VARIANT = {"tiny": "tiny_all", "sd": "sd15", "tiny-sd3": "tiny_sd3", "tiny-flux": "tiny_flux"}
SHARED_FIELDS = (
    "seed", "eval_prompt_fn", "eval_images_per_prompt", "eval_batch_size", "eval_seed", "eval_grid_prompts",
    "pretrained.model", "pretrained.revision", "mixed_precision", "use_lora", "lora_rank", "lora_alpha",
    "prompt_fn", "prompt_fn_kwargs", "reward_fn", "reward_weights", "reward_aggregation", "reward_workers",
    "sample", "train.batch_size", "train.gradient_accumulation_steps", "train.learning_rate",
    "train.num_inner_epochs", "train.cfg", "train.clip_range",
)
DEFINITIONS = {
    "epoch_seconds": "wall clock from the start of an epoch's sampling to the end of its critic update "
    "(sample + reward + advantages + train + critic; logging and checkpoints excluded)",
    "wall_seconds": "cumulative epoch seconds at the end of an epoch; total_wall_seconds = at the last epoch",
    "initial_reward": "reward_mean of epoch 0 (sampled before any update)",
    "final_reward": f"mean of reward_mean over the last min({FINAL_WINDOW}, num_epochs) epochs",
    "reward_per_second": "(final_reward - initial_reward) / total_wall_seconds",
    "smoothed_reward": f"at epoch i, mean of reward_mean over epochs max(0, i - {FINAL_WINDOW - 1}) .. i",
    "time_to_reach_ddpo_final": "wall_seconds at the end of the first epoch whose smoothed_reward >= the ddpo "
    "run's final_reward (null: never reached)",
    "train_speedup_vs_ddpo": "ddpo's mean time/train / the method's mean time/train (equal sampling work)",
    "unet_calls": "train/unet_calls: batched UNet forward+backward calls of the training pass per epoch",
    "unet_steps": "train/unet_steps_per_sample x num_samples x num_inner_epochs: forward+backward passes per epoch "
    "in trajectory-step units; grpo_kl's extra no-grad reference forward per step is not counted",
    "peak_rss_mb": "peak resident set size of the process during the method's run (VmHWM, reset before each run)",
}


def _set(config, dotted, value):
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[leaf] = value


def _get(config, dotted):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def parse_method_spec(spec):
    """`[LABEL=]METHOD[:FIELD=VALUE]...` -> (label, method, {field: value}).

    A spec is a method of METHODS with config fields changed, e.g.
    `gp_w4=group_ppo_start:sample.sde_window_size=4:train.learning_rate=1e-4`; VALUE is read as a
    Python literal (numbers, True, strings in quotes) or else kept as a string. Without LABEL the
    whole spec is the label.
    """
    label, sep, rest = spec.partition("=")
    if not sep or ":" in label:
        label, rest = spec, spec
    method, *assignments = rest.split(":")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} in {spec!r}; choose from {list(METHODS)}")
    fields = {}
    for assignment in assignments:
        field, eq, text = assignment.partition("=")
        if not eq or not field:
            raise ValueError(f"method spec {spec!r}: {assignment!r} is not FIELD=VALUE")
        try:
            fields[field] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            fields[field] = text
    return label, method, fields


def model_family(model):
    return "tiny" if model in TINY_MODELS else "sd"


def build_method_config(method, model, num_epochs, run_dir, reward_fn=None, sample_overrides=None, common_variant=None,
                        seed=None, eval_freq=0):
    """The method's config: its variant, the common variant's sampling work, the method's fields.

    method: a name of METHODS or a spec (parse_method_spec) whose fields are applied last.

    sample_overrides: {"num_steps": int, "batch_size": int, "num_batches_per_epoch": int, ...} applied
    to every method alike (sample.*); train.batch_size shrinks to divide the epoch's trajectories.
    common_variant: the config/grpo.py variant the shared work comes from (default: tiny or sd15).
    """
    _, method, spec_fields = parse_method_spec(method)
    _, tiny_variant, sd_variant, fields = METHODS[method]
    fields = {**fields, **spec_fields}
    family = model_family(model)
    config = grpo.get_config(tiny_variant if family == "tiny" else sd_variant)
    common = grpo.get_config(common_variant or COMMON_VARIANT.get(model, COMMON_VARIANT[family]))
    common.pretrained.model = model
    if reward_fn:
        common.reward_fn = reward_fn
        common.reward_weights = {}
    for key, value in (sample_overrides or {}).items():
        if value is not None:
            common.sample[key] = value
    per_epoch = common.sample.batch_size * common.sample.num_batches_per_epoch
    if per_epoch % common.train.batch_size:
        common.train.batch_size = math.gcd(per_epoch, common.train.batch_size)
    if common.sample.batch_size % common.sample.group_size:
        common.sample.group_size = math.gcd(common.sample.batch_size, common.sample.group_size)
    for field in SHARED_FIELDS:
        value = _get(common, field)
        _set(config, field, value.to_dict() if hasattr(value, "to_dict") else value)
    for field, value in fields.items():
        _set(config, field, value)
    if seed is not None:
        config.seed = seed
    config.num_epochs = num_epochs
    config.logdir = os.path.dirname(run_dir)
    config.run_name = os.path.basename(run_dir)
    config.log_images_every = 0
    config.eval_freq = eval_freq
    config.save_freq = 0
    config.log_with = "none"
    config.resume_from = ""
    return config


def _vm_hwm_mb():
    """Peak RSS of this process in MiB (VmHWM, which `reset_peak_rss` resets); ru_maxrss elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _vm_rss_mb():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def reset_peak_memory():
    """Reset the process's peak RSS (Linux: write 5 to /proc/self/clear_refs) and CUDA's peak counter.

    Returns True when the RSS peak could be reset (otherwise later runs inherit earlier peaks).
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class TimedTrainer(Trainer):
    """Trainer that adds bench/epoch_seconds and bench/wall_seconds to each metrics row.

    profile_epoch: an epoch to run under `profiler` (an object with enable() / disable(), or None).
    """

    def __init__(self, config, profile_epoch=None, profiler=None):
        super().__init__(config)
        self.bench_wall = 0.0
        self.profile_epoch, self.profiler = profile_epoch, profiler

    def sample_epoch(self, epoch, metrics):
        if self.profiler is not None and epoch == self.profile_epoch:
            self.profiler.enable()
        self.bench_epoch_start = time.perf_counter()
        return super().sample_epoch(epoch, metrics)

    def log_epoch(self, epoch, samples, metrics):
        seconds = time.perf_counter() - self.bench_epoch_start
        if self.profiler is not None and epoch == self.profile_epoch:
            self.profiler.disable()
        self.bench_wall += seconds
        metrics["bench/epoch_seconds"] = seconds
        metrics["bench/wall_seconds"] = self.bench_wall
        super().log_epoch(epoch, samples, metrics)


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_method(config, profile_epoch=None, profiler=None):
    """Train one method from scratch into config.logdir/config.run_name (under the output's runs/, a folder this
    benchmark made: `own_folder`); returns (rows, rss_at_start_mb). An earlier run of this benchmark there is
    written over by the trainer's overwrite (which removes only a run's own files, and refuses a folder that is not
    a run); BenchmarkError when the run did not finish."""
    run_dir = os.path.join(config.logdir, config.run_name)
    config.overwrite = os.path.isdir(run_dir)  # metrics.jsonl appends: a stale run would mix into this one
    reset_peak_memory()
    rss_at_start = _vm_rss_mb()
    trainer = TimedTrainer(config, profile_epoch=profile_epoch, profiler=profiler)
    trainer.run()
    del trainer
    require_finished(run_dir)
    gc.collect()
    return read_metrics(run_dir), rss_at_start


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def epoch_seconds(row):
    """The row's bench/epoch_seconds, or the sum of its phase times for rows written without it."""
    if "bench/epoch_seconds" in row:
        return row["bench/epoch_seconds"]
    return sum(row.get(k, 0.0) for k in ("time/sample", "time/reward", "time/advantages", "time/train", "time/critic"))


def wall_seconds(rows):
    """Cumulative epoch seconds at the end of each epoch."""
    total, out = 0.0, []
    for row in rows:
        total += epoch_seconds(row)
        out.append(total)
    return out


def smoothed_rewards(rows, window=FINAL_WINDOW):
    """At epoch i, the mean reward_mean over epochs max(0, i - window + 1) .. i."""
    rewards = [row["reward_mean"] for row in rows]
    windows = [rewards[max(0, i - window + 1) : i + 1] for i in range(len(rewards))]
    return [sum(w) / len(w) for w in windows]


def final_reward(rows, window=FINAL_WINDOW):
    tail = [row["reward_mean"] for row in rows[-window:]]
    return sum(tail) / len(tail)


def time_to_reach(rows, target, window=FINAL_WINDOW):
    """Wall seconds at the end of the first epoch whose smoothed reward >= target; None if never."""
    for smoothed, wall in zip(smoothed_rewards(rows, window), wall_seconds(rows)):
        if smoothed >= target:
            return wall
    return None


def summarize(rows, config):
    """Per-method summary numbers (see DEFINITIONS) from its per-epoch metrics rows."""
    rows = [row for row in rows if "reward_mean" in row]  # not the final evaluation's own row
    if not rows:
        raise ValueError("a run with no metrics rows cannot be summarized; did the run stop before its first epoch?")
    rewards = [row["reward_mean"] for row in rows]
    walls = wall_seconds(rows)
    inner = config["train"]["num_inner_epochs"]
    total = walls[-1]
    initial, final = rewards[0], final_reward(rows)
    summary = {
        "num_epochs": len(rows),
        "num_samples_per_epoch": rows[0].get("num_samples"),
        "sample_seconds": _mean([row.get("time/sample") for row in rows]),
        "reward_seconds": _mean([row.get("time/reward") for row in rows]),
        "advantages_seconds": _mean([row.get("time/advantages") for row in rows]),
        "train_seconds": _mean([row.get("time/train") for row in rows]),
        "critic_seconds": _mean([row.get("time/critic", 0.0) for row in rows]),
        "epoch_seconds": _mean([epoch_seconds(row) for row in rows]),
        "total_wall_seconds": total,
        "unet_calls": _mean([row.get("train/unet_calls") for row in rows]),
        "unet_steps_per_sample": _mean([row.get("train/unet_steps_per_sample") for row in rows]),
        "unet_steps": _mean(
            [row["train/unet_steps_per_sample"] * row["num_samples"] * inner for row in rows if "train/unet_steps_per_sample" in row]
        ),
        "peak_rss_mb": max(row.get("peak_rss_mb", 0.0) for row in rows),
        "peak_gpu_mb": max((row["peak_gpu_mb"] for row in rows if "peak_gpu_mb" in row), default=None),
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_best": max(rewards),
        "initial_reward": initial,
        "final_reward": final,
        "reward_per_second": (final - initial) / total if total > 0 else None,
    }
    summary["other_seconds"] = summary["epoch_seconds"] - sum(
        summary[k] or 0.0 for k in ("sample_seconds", "reward_seconds", "train_seconds")
    )
    return summary


def add_comparisons(methods, baseline="ddpo"):
    """Adds train_speedup_vs_ddpo, time_to_reach_ddpo_final and its fraction of ddpo's wall to each summary."""
    if baseline not in methods:
        for entry in methods.values():
            entry["summary"].update(train_speedup_vs_ddpo=None, time_to_reach_ddpo_final=None, time_to_reach_fraction=None)
        return
    base = methods[baseline]["summary"]
    target = base["final_reward"]
    for entry in methods.values():
        s = entry["summary"]
        s["train_speedup_vs_ddpo"] = base["train_seconds"] / s["train_seconds"] if s["train_seconds"] else None
        reach = time_to_reach(entry["rows"], target)
        s["time_to_reach_ddpo_final"] = reach
        s["time_to_reach_fraction"] = reach / base["total_wall_seconds"] if reach is not None else None


def evaluate_targets(methods):
    """The issue's two targets for group_ppo_endpoints against ddpo: measured value, bound, met."""
    have = "ddpo" in methods and "group_ppo_endpoints" in methods
    gp = methods["group_ppo_endpoints"]["summary"] if have else {}
    speedup = gp.get("train_speedup_vs_ddpo")
    fraction = gp.get("time_to_reach_fraction")
    reach_met = (fraction <= TIME_TO_REACH_TARGET) if (have and fraction is not None) else (False if have else None)
    reach_note = None
    if have and methods["ddpo"]["summary"]["final_reward"] <= methods["ddpo"]["summary"]["initial_reward"]:
        # ddpo's final is then at or below the shared epoch-0 reward: every method "reaches" it at once
        reach_met = None
        reach_note = "ddpo's final reward is not above the initial reward, so reaching it says nothing"
    return {
        "train_speedup": {
            "description": "group_ppo_endpoints' training pass at least 4x faster than ddpo's at equal sampling work",
            "bound": TRAIN_SPEEDUP_TARGET,
            "measured": speedup,
            "met": (speedup >= TRAIN_SPEEDUP_TARGET) if speedup is not None else None,
        },
        "time_to_ddpo_final": {
            "description": "group_ppo_endpoints reaches ddpo's final reward in at most 40% of ddpo's wall-clock time",
            "bound": TIME_TO_REACH_TARGET,
            "measured": fraction,
            "met": reach_met,
            "note": reach_note,
        },
    }


def machine_info(device):
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "device": device,
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_available"] = len(os.sched_getaffinity(0))
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = list(os.getloadavg())
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def build_results(mode, settings, machine, runs):
    """runs: {method: {"config": dict, "rows": [...], "rss_at_start_mb": float}} -> the JSON document."""
    methods = {}
    for name, run in runs.items():
        methods[name] = {
            "description": METHODS[name][0] if name in METHODS else "",
            "config": run["config"],
            "rss_at_start_mb": run.get("rss_at_start_mb"),
            "rows": run["rows"],
            "summary": summarize(run["rows"], run["config"]),
        }
    add_comparisons(methods)
    return {
        "mode": mode,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": settings.get("command"),
        "machine": machine,
        "settings": settings,
        "definitions": DEFINITIONS,
        "methods": methods,
        "targets": evaluate_targets(methods),
    }


def _fmt(value, spec=".2f"):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def render_markdown(results):
    """Markdown: a header, the time/compute table, the reward table, the targets, where the time goes."""
    machine, settings, methods = results["machine"], results["settings"], results["methods"]
    gpu = any(m["summary"]["peak_gpu_mb"] is not None for m in methods.values())
    lines = [
        f"# Training benchmark ({results['mode']})",
        "",
        f"Model `{settings['model']}` on {machine['device']}"
        + (f" ({machine['gpu']})" if machine.get("gpu") else "")
        + f"; {machine['cpu_count']} CPUs, torch {machine['torch_version']} ({machine['torch_num_threads']} threads); "
        f"{settings['num_epochs']} epochs per method, seed {settings['seed']}, {settings['samples_per_epoch']} "
        f"trajectories x {settings['num_steps']} steps per epoch (group size {settings['group_size']}), "
        f"created {results['created']}.",
        "",
        f"Command: `{results['command']}`",
        "",
        "## Time and compute per epoch (means over epochs)",
        "",
        "| method | sample s | reward s | train s | other s | epoch s | train speedup vs ddpo "
        "| UNet fwd+bwd calls | UNet fwd+bwd trajectory-steps | peak RSS MB |" + (" peak GPU MB |" if gpu else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if gpu else ""),
    ]
    for name, m in methods.items():
        s = m["summary"]
        row = (
            f"| {name} | {_fmt(s['sample_seconds'])} | {_fmt(s['reward_seconds'])} | {_fmt(s['train_seconds'])} "
            f"| {_fmt(s['other_seconds'])} | {_fmt(s['epoch_seconds'])} | {_fmt(s['train_speedup_vs_ddpo'])}x "
            f"| {_fmt(s['unet_calls'], '.0f')} | {_fmt(s['unet_steps'], '.0f')} | {_fmt(s['peak_rss_mb'], '.0f')} |"
        )
        if gpu:
            row += f" {_fmt(s['peak_gpu_mb'], '.0f')} |"
        lines.append(row)
    lines += [
        "",
        "`other` = advantages + critic update + gathers. UNet fwd+bwd calls are batched calls (one micro-batch at "
        "one step); trajectory-steps count one trajectory at one denoising step.",
        "",
        "## Reward",
        "",
        f"Final = mean of the last {FINAL_WINDOW} epochs; reward/s = (final - initial) / total wall seconds; "
        f"time to reach = wall seconds until the {FINAL_WINDOW}-epoch trailing mean first reaches ddpo's final reward.",
        "",
        "| method | first | last | best | final | total wall s | reward gained / s | time to ddpo's final s "
        "| fraction of ddpo's wall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in methods.items():
        s = m["summary"]
        lines.append(
            f"| {name} | {_fmt(s['reward_first'], '.4f')} | {_fmt(s['reward_last'], '.4f')} "
            f"| {_fmt(s['reward_best'], '.4f')} | {_fmt(s['final_reward'], '.4f')} | {_fmt(s['total_wall_seconds'], '.1f')} "
            f"| {_fmt(s['reward_per_second'], '.3e')} | {_fmt(s['time_to_reach_ddpo_final'], '.1f')} "
            f"| {_fmt(s['time_to_reach_fraction'], '.2f')} |"
        )
    lines += ["", "## Targets", ""]
    for target in results["targets"].values():
        unknown = "not meaningful" if target.get("note") else "not measured"
        met = {True: "met", False: "not met", None: unknown}[target["met"]]
        note = f" ({target['note']})" if target.get("note") else ""
        lines.append(
            f"- {target['description']}: measured {_fmt(target['measured'])} (bound {target['bound']}): **{met}**{note}"
        )
    lines += [
        "", "## Where the time goes (share of epoch seconds)", "",
        "| method | sample | reward | advantages | train | critic | rest |", "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in methods.items():
        s = m["summary"]
        parts = [s["sample_seconds"], s["reward_seconds"], s["advantages_seconds"], s["train_seconds"], s["critic_seconds"]]
        parts = [p or 0.0 for p in parts]
        shares = [p / s["epoch_seconds"] for p in parts] + [1.0 - sum(parts) / s["epoch_seconds"]]
        lines.append(f"| {name} | " + " | ".join(f"{100 * x:.0f}%" for x in shares) + " |")
    return "\n".join(lines) + "\n"


def write_results(results, output_dir):
    os.makedirs(output_dir, exist_ok=True)
    stem = os.path.join(output_dir, f"bench_{results['mode']}")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1, default=float)
    markdown = render_markdown(results)
    with open(stem + ".md", "w") as f:
        f.write(markdown)
    return stem + ".json", stem + ".md", markdown


class TorchProfiler:
    """torch.profiler behind the enable() / disable() interface of cProfile.Profile."""

    def __init__(self):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(activities=activities, record_shapes=False)

    def enable(self):
        self.profile.__enter__()

    def disable(self):
        self.profile.__exit__(None, None, None)

    def report(self, top):
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        return self.profile.key_averages().table(sort_by=sort, row_limit=top)


def profile_method(method, args, output_dir):
    """Run 2 epochs of `method`, profile the second (warm) one; print the phase split and the top functions."""
    run_dir = os.path.join(output_dir, "runs", "profile", method)
    config = build_method_config(method, args.model, 2, run_dir, args.reward, _sample_overrides(args), args.common_variant)
    profiler = TorchProfiler() if args.profiler == "torch" else cProfile.Profile()
    rows, _ = run_method(config, profile_epoch=1, profiler=profiler)
    row = rows[1]
    total = epoch_seconds(row)
    lines = [f"profile of {method}, epoch 1 ({args.profiler}): {total:.2f} s", "", "phase       seconds  share"]
    for phase in ("sample", "reward", "advantages", "train", "critic"):
        value = row.get(f"time/{phase}", 0.0)
        lines.append(f"{phase:<11} {value:7.3f}  {100 * value / total:4.0f}%")
    rest = total - sum(row.get(f"time/{p}", 0.0) for p in ("sample", "reward", "advantages", "train", "critic"))
    lines.append(f"{'rest':<11} {rest:7.3f}  {100 * rest / total:4.0f}%")
    lines += ["", f"UNet calls in training: {row.get('train/unet_calls')}, steps per sample: "
              f"{row.get('train/unet_steps_per_sample')}", ""]
    if args.profiler == "torch":
        lines.append(profiler.report(args.top))
    else:
        for sort in ("tottime", "cumulative"):
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats(sort).print_stats(args.top)
            text = stream.getvalue()
            lines += [f"top {args.top} functions by {sort}:", text[text.find("   ncalls"):]]
    report = "\n".join(lines)
    path = os.path.join(output_dir, f"profile_{method}.txt")
    with open(path, "w") as f:
        f.write(report + "\n")
    print(report)
    print(f"written: {path}")
    return report


def _sample_overrides(args):
    return {"num_steps": args.num_steps, "batch_size": args.sample_batch_size, "num_batches_per_epoch": args.num_batches}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train every RL method from one seed with equal sampling work; write a markdown table and JSON."
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_EPOCHS} epochs per method (CI-style check)")
    parser.add_argument("--epochs", type=int, default=None, help=f"epochs per method (default {FULL_EPOCHS}, "
                        f"--quick {QUICK_EPOCHS})")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--model", default="tiny-shapes", help="'tiny-shapes' (shipped shapes-world model), 'tiny' "
                        "(random weights), a local diffusers directory or a hub id (Stable Diffusion configs)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--common-variant", default=None, help="config/grpo.py variant whose sampling work, prompts, "
                        "reward, learning rate and clip range every method shares (default: tiny, or sd15 for SD); "
                        "e.g. tiny_one_prompt")
    parser.add_argument("--reward", default=None, help="reward_fn for every method (default: the common variant's)")
    parser.add_argument("--num-steps", type=int, default=None, help="sample.num_steps for every method")
    parser.add_argument("--sample-batch-size", type=int, default=None, help="sample.batch_size for every method")
    parser.add_argument("--num-batches", type=int, default=None, help="sample.num_batches_per_epoch for every method")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own "
                        "choice); on a CPU shared with other jobs, 1 avoids OpenMP oversubscription")
    parser.add_argument("--no-warmup", action="store_true", help="skip the short untimed warm-up run")
    parser.add_argument("--output-dir", default=None,
                        help="where bench_<quick|full>.json/.md and runs/ go (default benchmarks/results; its "
                             "committed results, e.g. bench_full.json, are replaced only when --output-dir names it)")
    parser.add_argument("--from-json", metavar="PATH", default=None, help="rebuild the summaries, targets and "
                        "markdown of a bench_<mode>.json from its per-epoch rows, without training")
    parser.add_argument("--seeds", type=int, default=0, help="train every method with N seeds (seed, seed+1, ...) and "
                        "summarize the fixed-noise evaluation reward over seeds (bench_seeds.json)")
    parser.add_argument("--seed-start", type=int, default=None, help="first seed of --seeds (default: the config's)")
    parser.add_argument("--eval-freq", type=int, default=None, help="evaluate every N epochs (default: 0, or 4 "
                        "with --seeds)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None, help="merge bench_seeds JSON files "
                        "(runs of other seeds) into one summary, without training")
    parser.add_argument("--jobs", type=int, default=1, help="with --seeds: run N (method, seed) trainings at once, each "
                        "a process of its own with one CPU thread and no GPU (OMP_NUM_THREADS=1, CUDA_VISIBLE_DEVICES=), "
                        "then merge their JSON; on a 16-core machine --jobs 16")
    parser.add_argument("--run-timeout", type=float, default=0, help="with --jobs: seconds one training may take "
                        "before it is stopped and reported as failed (0: no limit)")
    parser.add_argument("--target", type=float, default=0.75, help="with --seeds: the evaluation reward whose first "
                        "reaching is reported in epochs and seconds (default 0.75)")
    parser.add_argument("--reference", default=None, help="with --seeds: the method (label) whose seconds to --target "
                        "the others are divided by (e.g. grpo_kl)")
    parser.add_argument("--calibrate", action="store_true", help="measure each method's cost alone: --epochs epochs, "
                        "no evaluation, one after another in this process; writes calibration.json")
    parser.add_argument("--calibration", metavar="JSON", default=None, help="with --seeds / --merge: a calibration.json "
                        "whose per-method costs give the training seconds (instead of the times measured in runs that "
                        "shared the CPU)")
    parser.add_argument("--profile", metavar="METHOD", default=None, help="profile one epoch of METHOD instead")
    parser.add_argument("--profiler", default="cprofile", choices=("cprofile", "torch"))
    parser.add_argument("--top", type=int, default=25, help="profile entries to print")
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for spec in args.methods + ([args.profile] if args.profile else []):
        try:
            parse_method_spec(spec)
        except ValueError as err:
            parser.error(str(err))
    labels = [parse_method_spec(spec)[0] for spec in args.methods]
    if len(set(labels)) != len(labels):
        parser.error(f"two methods share a label in {labels}; give each spec its own LABEL=")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if args.quick else FULL_EPOCHS
    if args.eval_freq is None:
        args.eval_freq = 4 if args.seeds else 0
    if args.epochs < 1:
        parser.error("--epochs must be >= 1")
    given, args.output_dir = args.output_dir is not None, args.output_dir or DEFAULT_OUTPUT_DIR
    try:
        refuse_committed_default("--output-dir", args.output_dir, given,
                                 [os.path.join(args.output_dir, name) for name in _written(args)])
    except BenchmarkError as err:
        parser.error(str(err))
    return args


DEFAULT_OUTPUT_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")


def _written(args):
    """The files of the output folder this command writes (runs/ aside: `own_folder`)."""
    if args.from_json:
        try:
            with open(args.from_json) as f:
                mode = json.load(f).get("mode", "full")
        except (OSError, ValueError, AttributeError):
            mode = "full"  # rebuild's own error names the file
        stems = [f"bench_{mode}"]
    elif args.merge or args.seeds:
        stems = ["bench_seeds"]
    elif args.calibrate:
        return ["calibration.json"]
    elif args.profile:
        return [f"profile_{args.profile}.txt"]
    else:
        stems = ["bench_quick" if args.quick else "bench_full"]
    return [stem + ext for stem in stems for ext in (".json", ".md")]


def _select_device(device):
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read when CUDA first initialises; the trainer then picks the CPU
        return "cpu"
    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    return "cuda" if available else "cpu"


def _check_model(model):
    if model == "tiny-shapes":
        from ddpo_group.diffusion.loading import TINY_SHAPES_DIR

        if not (TINY_SHAPES_DIR / "model_index.json").is_file():
            raise SystemExit(
                f"--model tiny-shapes: the shipped model is missing from {TINY_SHAPES_DIR}; create it with "
                "`python scripts/pretrain_tiny.py --replace-shipped` or benchmark the random-weight model with "
                "--model tiny"
            )


def rebuild(path, output_dir):
    """Re-derive a results file from its stored per-epoch rows (after a change of definitions)."""
    with open(path) as f:
        old = json.load(f)
    runs = {name: {"config": m["config"], "rows": m["rows"], "rss_at_start_mb": m.get("rss_at_start_mb")}
            for name, m in old["methods"].items()}
    results = build_results(old["mode"], old["settings"], old["machine"], runs)
    results["created"] = old["created"]
    json_path, md_path, markdown = write_results(results, output_dir)
    print(markdown)
    print(f"[bench] written: {json_path}, {md_path}")
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        return rebuild(args.from_json, os.path.abspath(args.output_dir))
    if args.merge:
        return merge_seed_results(args.merge, os.path.abspath(args.output_dir), args)
    device = _select_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    _check_model(args.model)
    output_dir = os.path.abspath(args.output_dir)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    original_peak_rss = metrics_log.peak_rss_mb
    metrics_log.peak_rss_mb = _vm_hwm_mb  # peak since reset_peak_memory(), not since the process started
    try:
        if not (args.seeds and args.jobs > 1):  # the runs go into runs/ here (with --jobs: into each part's own)
            own_folder("--output-dir", os.path.join(output_dir, "runs"), "bench_training.py")
        if args.profile:
            return profile_method(args.profile, args, output_dir)
        if args.calibrate:
            return run_calibration(args, argv, device, output_dir)
        if args.seeds:
            return run_seeds(args, argv, device, output_dir)
        return run_benchmark(args, argv, device, output_dir)
    except BenchmarkError as err:
        fail("bench_training.py", err, code=1)
    finally:
        metrics_log.peak_rss_mb = original_peak_rss


def run_benchmark(args, argv, device, output_dir):
    """Train every method of args.methods, write bench_<mode>.json / .md, print the markdown."""
    mode = "quick" if args.quick else "full"
    runs_root = os.path.join(output_dir, "runs", mode)
    machine = machine_info(device)
    configs = {
        m: build_method_config(
            m, args.model, args.epochs, os.path.join(runs_root, m), args.reward, _sample_overrides(args), args.common_variant
        )
        for m in args.methods
    }
    first = configs[args.methods[0]]
    settings = {
        "command": "python benchmarks/bench_training.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "num_epochs": args.epochs,
        "methods": args.methods,
        "seed": first.seed,
        "num_steps": first.sample.num_steps,
        "samples_per_epoch": first.sample.batch_size * first.sample.num_batches_per_epoch,
        "group_size": first.sample.group_size,
        "train_batch_size": first.train.batch_size,
        "final_window": FINAL_WINDOW,
        "warmup": not args.no_warmup,
        "common_variant": args.common_variant,
        "prompt_fn": first.prompt_fn,
    }
    if not args.no_warmup:
        # First calls pay for lazy imports, thread pools and kernel selection: an untimed 1-epoch, 2-step run.
        warm = build_method_config(args.methods[0], args.model, 1, os.path.join(runs_root, "_warmup"), args.reward,
                                   {**_sample_overrides(args), "num_steps": 2, "num_batches_per_epoch": 1},
                                   args.common_variant)
        print(f"[bench] warm-up: {args.methods[0]}, 1 epoch of 2 steps", flush=True)
        run_method(warm)
    runs = {}
    for i, method in enumerate(args.methods):
        print(f"[bench] {i + 1}/{len(args.methods)} {method}: {METHODS[parse_method_spec(method)[1]][0]}; "
              f"{args.epochs} epochs", flush=True)
        start = time.perf_counter()
        rows, rss_at_start = run_method(configs[method])
        runs[method] = {"config": configs[method].to_dict(), "rows": rows, "rss_at_start_mb": rss_at_start}
        print(f"[bench] {method} done in {time.perf_counter() - start:.1f} s, reward {rows[0]['reward_mean']:.4f} -> "
              f"{rows[-1]['reward_mean']:.4f}", flush=True)
    results = build_results(mode, settings, machine, runs)
    json_path, md_path, markdown = write_results(results, output_dir)
    print(markdown)
    print(f"[bench] written: {json_path}, {md_path}")
    return results


SEED_STATS = ("initial_reward", "final_reward", "best_reward", "time_to_reach_fraction", "reward_at_equal_wall",
              "epochs_to_target", "seconds_to_target", "fraction_of_reference", "train_seconds_per_epoch",
              "epoch_seconds")
SEED_DEFINITIONS = {
    "initial_reward": "eval/reward_mean before any update (epoch 0)",
    "final_reward": "eval/reward_mean of the final weights (the evaluation row of epoch num_epochs)",
    "best_reward": "the highest eval/reward_mean of the run",
    "time_to_reach_fraction": "wall seconds (training epochs only, evaluation excluded) until the first evaluation "
    "at or above ddpo's final_reward of the same seed, divided by ddpo's total wall seconds (runs that never reach "
    "it are left out of the statistics; 'reached' counts them)",
    "reward_at_equal_wall": "eval/reward_mean of the last evaluation whose weights took at most W wall seconds, W = the "
    "smallest total wall time of all methods for that seed",
    "epochs_to_target": "training epochs before the first evaluation at or above --target (never: left out, see "
    "'reached')",
    "seconds_to_target": "training seconds (evaluation excluded) of those epochs: measured, or from --calibration",
    "fraction_of_reference": "seconds_to_target / the --reference method's seconds_to_target of the same seed",
    "train_seconds_per_epoch": "mean time/train", "epoch_seconds": "mean training seconds per epoch",
}


def epoch_cost(row, calibration=None):
    """Training seconds of one epoch's row: measured (bench/epoch_seconds), or from a calibration entry.

    A calibration entry {"fixed_seconds": s, "seconds_per_unet_call": c} (run_calibration) prices an epoch as
    s + c x train/unet_calls of that epoch: sampling, rewards, advantages and the critic cost what they cost alone,
    and the training pass what its batched model calls cost alone (Group-PPO's K may change between epochs).
    """
    if calibration is None:
        return epoch_seconds(row)
    return calibration["fixed_seconds"] + calibration["seconds_per_unet_call"] * row.get("train/unet_calls", 0)


def seed_run_numbers(rows, calibration=None):
    """(evaluations [(epoch, reward, training seconds after that many epochs)], total seconds, train s/epoch, epoch s)."""
    train_rows = [row for row in rows if "reward_mean" in row]
    walls, total = [0.0], 0.0
    for row in train_rows:
        total += epoch_cost(row, calibration)
        walls.append(total)
    evaluations = [(row["epoch"], row["eval/reward_mean"], walls[min(row["epoch"], len(walls) - 1)])
                   for row in rows if "eval/reward_mean" in row]
    return evaluations, walls[-1], _mean([row.get("time/train") for row in train_rows]), (
        walls[-1] / len(train_rows) if train_rows else None)


def _stats(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return {"median": median, "min": values[0], "max": values[-1], "n": len(values)}


def summarize_seeds(runs, target=0.75, reference=None, calibration=None):
    """runs: {method: {seed: rows}} -> ({method: {stat: {median, min, max, n}}}, per-seed numbers) (SEED_DEFINITIONS).

    calibration: {method: calibration entry} (epoch_cost); methods without an entry use their measured times.
    """
    per_seed = {}
    calibration = calibration or {}
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    for seed in seeds:
        numbers = {m: seed_run_numbers(by_seed[seed], calibration.get(m)) for m, by_seed in runs.items() if seed in by_seed}
        equal_wall = min(total for _, total, _, _ in numbers.values())
        ddpo = numbers.get("ddpo")
        for method, (evaluations, total, train_s, epoch_s) in numbers.items():
            row = per_seed.setdefault(method, {}).setdefault(seed, {})
            row["initial_reward"] = evaluations[0][1]
            row["final_reward"] = evaluations[-1][1]
            row["best_reward"] = max(e[1] for e in evaluations)
            row["train_seconds_per_epoch"], row["epoch_seconds"] = train_s, epoch_s
            row["reward_at_equal_wall"] = max((e for e in evaluations if e[2] <= equal_wall + 1e-9), key=lambda e: e[0])[1]
            row["time_to_reach_fraction"] = None
            if ddpo is not None:
                ddpo_target, ddpo_total = ddpo[0][-1][1], ddpo[1]
                reached = next((wall for _, reward, wall in evaluations if reward >= ddpo_target), None)
                row["time_to_reach_fraction"] = None if reached is None else reached / ddpo_total
            hit = next(((epoch, wall) for epoch, reward, wall in evaluations if reward >= target), None)
            row["epochs_to_target"], row["seconds_to_target"] = hit if hit else (None, None)
            row["evaluations"] = [list(e) for e in evaluations]
        if reference in numbers:
            ref_seconds = per_seed[reference][seed]["seconds_to_target"]
            for method in numbers:
                seconds = per_seed[method][seed]["seconds_to_target"]
                per_seed[method][seed]["fraction_of_reference"] = (
                    seconds / ref_seconds if seconds is not None and ref_seconds else None)
    summary = {}
    for method, by_seed in per_seed.items():
        summary[method] = {stat: _stats([by_seed[s].get(stat) for s in by_seed]) for stat in SEED_STATS}
        summary[method]["time_to_reach_fraction"]["reached"] = sum(
            by_seed[s]["time_to_reach_fraction"] is not None for s in by_seed)
        summary[method]["epochs_to_target"]["reached"] = sum(by_seed[s]["epochs_to_target"] is not None for s in by_seed)
    return summary, per_seed


def eval_at_budget(evaluations, seconds):
    """eval/reward_mean of the last evaluation whose weights took at most `seconds` of training (None: none did)."""
    done = [reward for _, reward, wall in evaluations if wall <= seconds + 1e-9]
    return done[-1] if done else None


def render_seeds_markdown(results):
    def cell(stat, spec=".3f"):
        if stat["median"] is None:
            return "-"
        return f"{stat['median']:{spec}} [{stat['min']:{spec}}, {stat['max']:{spec}}]"

    seeds = results["seeds"]
    settings = results["settings"]
    target = settings.get("target", 0.75)
    lines = [
        f"# Methods over seeds {seeds} (median [min, max]), {settings['num_epochs']} epochs, "
        f"task {settings['common_variant']}",
        "",
        f"Training seconds: {settings.get('seconds', 'measured in each run')}.",
        "",
        f"| method | eval initial | eval final | eval best | epochs to {target} (reached) | seconds to {target} "
        f"| / {settings.get('reference') or 'reference'} | eval at equal wall clock | seconds / epoch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, stats in results["summary"].items():
        reach = stats["epochs_to_target"]
        lines.append(
            f"| {method} | {cell(stats['initial_reward'])} | {cell(stats['final_reward'])} | "
            f"{cell(stats['best_reward'])} | {cell(reach, '.0f')} ({reach['reached']}/{len(results['per_seed'][method])}) | "
            f"{cell(stats['seconds_to_target'], '.1f')} | {cell(stats['fraction_of_reference'], '.2f')} | "
            f"{cell(stats['reward_at_equal_wall'])} | {cell(stats['epoch_seconds'], '.2f')} |"
        )
    budgets = results.get("budgets") or []
    if budgets:
        lines += ["", "Evaluation reward at a training-time budget (median over seeds of the last evaluation within it):",
                  "", "| method | " + " | ".join(f"{b:g} s" for b in budgets) + " |",
                  "|---|" + "---|" * len(budgets)]
        for method, by_seed in results["per_seed"].items():
            cells = []
            for budget in budgets:
                stat = _stats([eval_at_budget(row["evaluations"], budget) for row in by_seed.values()])
                cells.append(cell(stat))
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "Definitions:"] + [f"- {k}: {v}" for k, v in SEED_DEFINITIONS.items()]
    for line in results.get("targets", []):
        lines.append(f"- target: {line}")
    return "\n".join(lines) + "\n"


def seed_targets(summary):
    """The issue's target: Group-PPO (either variant) reaches ddpo's final evaluation reward in at most 25% of ddpo's
    wall clock, median over seeds."""
    lines = []
    for method in ("group_ppo_endpoints", "group_ppo_sampled"):
        if method in summary:
            stat = summary[method]["time_to_reach_fraction"]
            median = stat["median"]
            verdict = "not met (never reached)" if median is None else ("met" if median <= 0.25 else "not met")
            lines.append(f"{method} reaches ddpo's final eval reward at {median if median is None else round(median, 3)} "
                         f"of ddpo's wall clock (median; reached in {stat['reached']} seeds), bound 0.25: {verdict}")
    return lines


def write_seed_results(results, output_dir):
    os.makedirs(output_dir, exist_ok=True)
    stem = os.path.join(output_dir, "bench_seeds")
    _write_atomic(stem + ".json", json.dumps(results, indent=1, default=float))
    markdown = render_seeds_markdown(results)
    _write_atomic(stem + ".md", markdown)
    return stem + ".json", stem + ".md", markdown


def _write_atomic(path, text):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _budgets(runs_summary_per_seed):
    """Four training-time budgets spread over the cheapest method's median total time."""
    totals = [row["evaluations"][-1][2] for by_seed in runs_summary_per_seed.values() for row in by_seed.values()
              if row["evaluations"]]
    if not totals:
        return []
    top = min(totals)
    return [round(top * f) for f in (0.25, 0.5, 0.75, 1.0)]


def _seed_results(runs, settings, machine, calibration=None):
    summary, per_seed = summarize_seeds(runs, settings.get("target", 0.75), settings.get("reference"), calibration)
    return {
        "seeds": sorted({seed for by_seed in runs.values() for seed in by_seed}),
        "summary": summary,
        "per_seed": per_seed,
        "budgets": _budgets(per_seed),
        "targets": seed_targets(summary),
        "definitions": SEED_DEFINITIONS,
        "settings": settings,
        "machine": machine,
        "calibration": calibration,
        "runs": runs,
    }


def _load_calibration(path):
    if not path:
        return None
    with open(path) as f:
        return json.load(f)["methods"]


def _seed_settings(args, argv, seeds):
    return {
        "command": "python benchmarks/bench_training.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "num_epochs": args.epochs, "methods": args.methods, "seeds": seeds,
        "eval_freq": args.eval_freq, "common_variant": args.common_variant, "target": args.target,
        "reference": args.reference, "jobs": args.jobs,
        "seconds": f"priced by {args.calibration}" if args.calibration else "measured in each run",
    }


def run_seeds(args, argv, device, output_dir):
    """Every method x every seed (here, or --jobs processes at once); bench_seeds.json / .md over seeds."""
    first_seed = args.seed_start if args.seed_start is not None else grpo.get_config(
        args.common_variant or COMMON_VARIANT.get(args.model, COMMON_VARIANT[model_family(args.model)])).seed
    seeds = list(range(first_seed, first_seed + args.seeds))
    settings = _seed_settings(args, argv, seeds)
    if args.jobs > 1:
        runs = _run_seeds_in_processes(args, seeds, output_dir)
    else:
        runs_root = os.path.join(output_dir, "runs", "seeds")
        runs = {parse_method_spec(spec)[0]: {} for spec in args.methods}
        for seed in seeds:
            for spec in args.methods:
                label = parse_method_spec(spec)[0]
                config = build_method_config(spec, args.model, args.epochs, os.path.join(runs_root, f"{label}_{seed}"),
                                             args.reward, _sample_overrides(args), args.common_variant, seed=seed,
                                             eval_freq=args.eval_freq)
                start = time.perf_counter()
                rows, _ = run_method(config)
                runs[label][seed] = rows
                evaluations = [round(row["eval/reward_mean"], 3) for row in rows if "eval/reward_mean" in row]
                print(f"[bench] seed {seed} {label}: {time.perf_counter() - start:.0f} s, eval {evaluations}", flush=True)
    results = _seed_results(runs, settings, machine_info(device), _load_calibration(args.calibration))
    json_path, md_path, markdown = write_seed_results(results, output_dir)
    print(markdown)
    print(f"[bench] written: {json_path}, {md_path}")
    return results


def _child_command(args, spec, seed, part_dir):
    """The bench_training.py command that trains one (method spec, seed) and writes part_dir/bench_seeds.json."""
    command = [sys.executable, os.path.abspath(__file__), "--seeds", "1", "--seed-start", str(seed), "--methods", spec,
               "--epochs", str(args.epochs), "--eval-freq", str(args.eval_freq), "--model", args.model,
               "--device", "cpu", "--threads", "1", "--target", str(args.target), "--output-dir", part_dir]
    for flag, value in (("--common-variant", args.common_variant), ("--reward", args.reward),
                        ("--num-steps", args.num_steps), ("--sample-batch-size", args.sample_batch_size),
                        ("--num-batches", args.num_batches)):
        if value is not None:
            command += [flag, str(value)]
    return command


def _run_seeds_in_processes(args, seeds, output_dir):
    """Each (method, seed) in a process of its own, args.jobs at once, one CPU thread each and no GPU; their
    bench_seeds.json files are merged. A training that fails (or passes --run-timeout) ends the benchmark with exit
    status 1, naming it and its log (BenchmarkError), the finished parts kept."""
    parts_root = os.path.join(output_dir, "parts")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    tasks = [(spec, seed) for seed in seeds for spec in args.methods]

    def run_one(task):
        spec, seed = task
        label = parse_method_spec(spec)[0]
        part_dir = os.path.join(parts_root, f"{label}_{seed}")
        os.makedirs(part_dir, exist_ok=True)
        start = time.perf_counter()
        with open(os.path.join(part_dir, "log.txt"), "w") as log:
            try:
                code = subprocess.run(_child_command(args, spec, seed, part_dir), env=env, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=args.run_timeout or None).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        return label, seed, part_dir, code, time.perf_counter() - start

    runs = {parse_method_spec(spec)[0]: {} for spec in args.methods}
    failed = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for label, seed, part_dir, code, seconds in pool.map(run_one, tasks):
            path = os.path.join(part_dir, "bench_seeds.json")
            if code != 0 or not os.path.exists(path):
                failed.append(f"{label} seed {seed} (exit {code}; log {os.path.join(part_dir, 'log.txt')})")
                print(f"[bench] FAILED {failed[-1]}", flush=True)
                continue
            with open(path) as f:
                rows = json.load(f)["runs"][label][str(seed)]
            runs[label][seed] = rows
            evaluations = [round(row["eval/reward_mean"], 3) for row in rows if "eval/reward_mean" in row]
            print(f"[bench] seed {seed} {label}: {seconds:.0f} s, eval {evaluations}", flush=True)
    if failed:  # no summary of the rest as if it were the study's: the parts that finished stay for --merge
        raise BenchmarkError(
            f"{len(failed)} of {len(tasks)} trainings failed: {', '.join(failed)}; bench_seeds.json is not written "
            f"(the parts that finished are in {parts_root}: --merge their bench_seeds.json to summarize them)")
    return runs


def merge_seed_results(paths, output_dir, args=None):
    """One bench_seeds.json from several (e.g. one process per seed, or studies run at different times); a path
    ending in .gz is read gzip-compressed (how large committed studies are kept)."""
    runs, settings, machine = {}, None, None
    for path in paths:
        with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
            part = json.load(f)
        settings, machine = settings or part["settings"], machine or part["machine"]
        for method, by_seed in part["runs"].items():
            runs.setdefault(method, {}).update({int(seed): rows for seed, rows in by_seed.items()})
    settings = dict(settings, seeds=sorted({s for by_seed in runs.values() for s in by_seed}), merged_from=list(paths),
                    methods=list(runs))
    calibration = None
    if args is not None:
        settings["target"] = args.target
        settings["reference"] = args.reference or settings.get("reference")
        if args.calibration:
            settings["seconds"] = f"priced by {args.calibration}"
        calibration = _load_calibration(args.calibration)
    results = _seed_results(runs, settings, machine, calibration)
    json_path, md_path, markdown = write_seed_results(results, output_dir)
    print(markdown)
    print(f"[bench] written: {json_path}, {md_path}")
    return results


def run_calibration(args, argv, device, output_dir):
    """Each method alone, --epochs epochs without evaluation, one after another: what an epoch costs on this machine.

    For each method: fixed_seconds = mean over epochs 1.. of (epoch seconds - time/train) (sampling, rewards,
    advantages, critic) and seconds_per_unet_call = mean over those epochs of time/train / train/unet_calls; epoch 0
    (first calls) is left out when there are more epochs. Writes calibration.json (read by --calibration).
    """
    runs_root = os.path.join(output_dir, "runs", "calibration")
    methods = {}
    for spec in args.methods:
        label = parse_method_spec(spec)[0]
        config = build_method_config(spec, args.model, args.epochs, os.path.join(runs_root, label), args.reward,
                                     _sample_overrides(args), args.common_variant)
        rows, _ = run_method(config)
        rows = [row for row in rows if "reward_mean" in row]
        timed = rows[1:] if len(rows) > 1 else rows
        calls = [row.get("train/unet_calls", 0) for row in timed]
        train = [row.get("time/train", 0.0) for row in timed]
        methods[label] = {
            "fixed_seconds": _mean([epoch_seconds(row) - row.get("time/train", 0.0) for row in timed]),
            "seconds_per_unet_call": sum(train) / sum(calls) if sum(calls) else 0.0,
            "epoch_seconds": _mean([epoch_seconds(row) for row in timed]),
            "unet_calls": _mean(calls),
            "epochs_timed": len(timed),
        }
        print(f"[bench] calibration {label}: {methods[label]}", flush=True)
    document = {
        "command": "python benchmarks/bench_training.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "definitions": run_calibration.__doc__,
        "methods": methods,
    }
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "calibration.json")
    _write_atomic(path, json.dumps(document, indent=1))
    print(f"[bench] written: {path}")
    return document


if __name__ == "__main__":
    main()
