"""Issue 42's study: the field's methods on the scenes world's shipped models, several seeds, GenEval's six tags
on the held-out set (docs/scenes.md).

    python benchmarks/scenes_study.py --methods flow_grpo --seeds 42,43,44 --results R   # one method, three seeds
    python benchmarks/scenes_study.py --jobs 2 --results R                              # every method, two at once
    python benchmarks/scenes_study.py --collect --results R                             # the table and JSON from what ran
    python benchmarks/scenes_study.py --eval-noise 1234,1,2,3,4,5,6,7 --results R       # the evaluation's own noise
    python benchmarks/scenes_study.py --reevaluate 1234,1,2,3 --jobs 2 --results R      # finals again: one sampler
    python benchmarks/scenes_study.py --flow-model tiny-scenes-flow --methods flow_grpo,nft_kl --results R

The committed study is R = benchmarks/results/scenes_study, the default folder: a command that writes there
must name it (--results benchmarks/results/scenes_study), since its committed runs are otherwise skipped as
"finished" and its table rewritten as if this command had made them.

Probes, each in a results directory of its own (docs/scenes.md says what they showed):

    python benchmarks/scenes_study.py --methods group_ppo --seeds 42 --epochs 200 --results benchmarks/results/scenes_study_long
    python benchmarks/scenes_study.py --methods flow_grpo --seeds 42 --epochs 80 --set train.learning_rate=1e-3 \
        --results benchmarks/results/scenes_study_lr1e-3
    python benchmarks/scenes_study.py --methods flow_grpo --seeds 42,43 --jobs 2 --set sample.num_batches_per_epoch=8 \
        --set sample.group_size=16 --set train.gradient_accumulation_steps=4 --results benchmarks/results/scenes_study_groups
    python benchmarks/scenes_study.py --reevaluate 1234,1,2,3 --results benchmarks/results/scenes_study_groups

Each run is a variant of config/grpo.py (tiny_scenes on the flow model tiny-scenes-sd3, or with --flow-model
tiny-scenes-flow tiny_scenes_flow on the flow-matching UNet; tiny_scenes_sd on the UNet tiny-scenes) with one
method's fields changed, trained in a process of its own on one thread (OMP_NUM_THREADS=1) into
RESULTS/runs/<method>/seed_<seed>/. A run whose directory holds finished.json is done and skipped, so the study
runs in stages (a session at a time) and resumes where it stopped; an unfinished run is started again from scratch
(its directory overwritten: only a run of this command's fields). A run directory there of other fields (another
seed, model, --epochs or --set value), finished or not, is refused before
anything runs: a probe goes into a --results of its own. A run that fails ends the study with exit status 1,
naming it and its log, without rewriting the table. Every method keeps its task's sampling work,
learning rate, KL and evaluation: only its method's fields change (METHODS).

From each run's metrics.jsonl:

    final            the last evaluation (the final weights, 2 fixed-noise images per held-out record):
                     eval/geneval/overall and eval/geneval/<tag>, GenEval's table (summary_scores.py's rules)
    train_seconds    the sum over training epochs of time/sample + time/reward + time/advantages + time/train
                     + time/critic (evaluation and checkpoints excluded), on one thread
    model_calls      denoiser evaluations in trajectory-step units (benchmarks/critic_compute.py: sampling,
                     training forward + backward, the reference's forwards, the recompute pass)
    to target        training seconds and model calls until the first evaluation whose overall reaches the
                     target (default: the best flow_grpo run's final overall); ratio: the method's median seconds
                     to it over the best flow_grpo run's seconds to it
    train reward     train_reward_start / _end: the mean training reward (64 samples an epoch) over the first
                     and the last 10 epochs, the trend on 640 samples each instead of one evaluation's 300 images
    reeval           (--reevaluate) the final weights again with one sampler for every method (eta 0: ODE /
                     DDIM) at several eval seeds: the mean overall and tags over 2 x seeds images per record;
                     --eval-noise measures how far one evaluation of the same weights moves with its seed

Writes RESULTS/summary.json (rows {"model", "method", "seed", "overall", six tags, "train_seconds",
"model_calls"}, one "method": "base" row with seed null per model: the epoch-0 evaluation, before any update),
RESULTS/study.json (the table, the targets' verdicts, the definitions) and RESULTS/metrics.json.gz (every run's
metrics rows).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))  # run_pool and bench_outputs, shared with the others

from bench_outputs import BenchmarkError, fail, refuse_committed_default  # noqa: E402
from run_pool import read_json as _read_json  # noqa: E402

DEFAULT_RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results", "scenes_study")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
TIME_KEYS = ("time/sample", "time/reward", "time/advantages", "time/train", "time/critic")
DEFAULT_FLOW_MODEL = "tiny-scenes-sd3"
# --flow-model: the flow methods' variant per flow base, the same recipe, task and evaluation (config/grpo.py);
# tiny-scenes-flow is the flow-matching UNet, the flow base that draws the world (docs/scenes.md)
FLOW_VARIANTS = {"tiny-scenes-sd3": "tiny_scenes", "tiny-scenes-flow": "tiny_scenes_flow"}


def models(flow_model=DEFAULT_FLOW_MODEL):
    """{variant: model} of the study's two bases: the flow methods' (--flow-model) and the UNet methods'."""
    return {FLOW_VARIANTS[flow_model]: flow_model, "tiny_scenes_sd": "tiny-scenes"}


def variant_of(method, flow_model=DEFAULT_FLOW_MODEL):
    """The variant a method's runs train: METHODS's, with the flow methods' ("tiny_scenes") on --flow-model's."""
    variant = METHODS[method][0]
    return FLOW_VARIANTS[flow_model] if variant == "tiny_scenes" else variant


def _window(size, mode):
    def apply(config):
        config.sample.sde_window_size = size
        config.sample.sde_window = mode
        return config
    return apply


def _fields(**fields):
    def apply(config):
        for dotted, value in fields.items():
            section, _, name = dotted.rpartition("__")
            target = config
            for part in section.split("__") if section else []:
                target = target[part]
            target[name] = value
        return config
    return apply


def _grpo_helpers():
    from ddpo_group.config import grpo

    return grpo


def _group_ppo(config):
    return _grpo_helpers()._learning_group_ppo(config)


def _algorithm2(config):
    config = _grpo_helpers()._algorithm2_group_ppo(config)
    config.group_ppo.max_group_size = 8
    return config


def _nft(config):
    config = _grpo_helpers()._diffusion_nft(config, weighting="uniform")
    config.train.skip_last_steps = 0  # a forward-process objective trains no trajectory step
    config.train.use_reference_model = config.train.use_kl_loss = False
    config.train.beta = 0.0
    return config


def _nft_kl(config):
    """The scenes ladder's DiffusionNFT + KL recipe (ddpo_group/config/variants/_methods.py)."""
    return _grpo_helpers()._diffusion_nft_kl(config)


def _awm(config):
    config.train.objective = "awm"
    config.train.skip_last_steps = 0  # a forward-process objective trains no trajectory step
    config.train.use_reference_model = config.train.use_kl_loss = False
    config.train.beta = 0.0
    config.forward.num_timesteps = 4
    config.forward.weighting = "uniform"
    return config


def _ddpo(config):
    config.algorithm.adv_estimator = "ddpo"
    config.train.clip_ratio_c = 1e4
    config.train.use_reference_model = config.train.use_kl_loss = False
    config.train.beta = 0.0
    return config


# method -> (base variant, what it changes, what it is); "tiny_scenes" is the flow methods' (variant_of)
METHODS = {
    "flow_grpo": ("tiny_scenes", lambda c: c, "Flow-GRPO: SDE at every step, every step but the last trained, KL"),
    "flow_grpo_fast": ("tiny_scenes", _window(2, "random"),
                       "Flow-GRPO-Fast: a 2-step SDE window at a random step each epoch, ODE elsewhere, the window trained"),
    "mixgrpo": ("tiny_scenes", _window(4, "sliding"), "MixGRPO: a 4-step SDE window sliding one step an epoch"),
    "cps": ("tiny_scenes", _fields(sample__sde_type="cps"), "Flow-CPS: coefficients-preserving SDE steps"),
    "dance": ("tiny_scenes", _fields(sample__sde_type="dance"), "DanceGRPO's SDE"),
    "nft": ("tiny_scenes", _nft, "DiffusionNFT: forward-process objective, no log-probs, no KL"),
    "nft_kl": ("tiny_scenes", _nft_kl, "DiffusionNFT + KL 0.1 to the reference, 4 passes an epoch (the ladder's)"),
    "awm": ("tiny_scenes", _awm, "AWM: advantage-weighted matching, 4 timesteps, no KL"),
    "group_ppo": ("tiny_scenes", _group_ppo, "Group-PPO's default (1-step SDE window, segment start, group norm)"),
    "gae": ("tiny_scenes", _fields(algorithm__adv_estimator="gae"), "GAE with the learned critic (ValueNetwork)"),
    "step_gain": ("tiny_scenes", _fields(algorithm__adv_estimator="step_gain"),
                  "per-step credit: the step reward gain (Stepwise-Flow-GRPO / DenseGRPO)"),
    "grpo_kl": ("tiny_scenes_sd", lambda c: c, "GRPO + KL on the UNet (DDIM, eta 1)"),
    "ddpo": ("tiny_scenes_sd", _ddpo, "DDPO: per-prompt stat tracking, PPO on all steps, no KL"),
    "group_ppo_sd": ("tiny_scenes_sd", _group_ppo, "Group-PPO's default on the UNet"),
    "alg2": ("tiny_scenes_sd", _algorithm2, "Group-PPO as Algorithm 2 is written"),
}


def method_config(method, seed, run_dir, epochs=None, overrides=(), flow_model=DEFAULT_FLOW_MODEL):
    """The config of one run: the method's base variant (variant_of), its fields, the seed and the run directory;
    overrides: "FIELD=VALUE" strings (a JSON value), applied after the method's fields (a probe's changes)."""
    from ddpo_group.config import grpo
    from ddpo_group.config.fields import set_field

    apply = METHODS[method][1]
    config = apply(grpo.get_config(variant_of(method, flow_model)))
    config.seed = seed
    if epochs:
        config.num_epochs = epochs
    for item in overrides:
        set_field(config, item)
    config.logdir, config.run_name = os.path.dirname(run_dir), os.path.basename(run_dir)
    config.save_freq = 0
    config.log_images_every = 0
    return config


def run_one(method, seed, run_dir, epochs, overrides=(), flow_model=DEFAULT_FLOW_MODEL):
    """Train one run in this process (called in a subprocess of its own by `main`)."""
    import torch

    torch.set_num_threads(1)
    from ddpo_group.training.trainer import Trainer

    config = method_config(method, seed, run_dir, epochs, overrides, flow_model)
    # an unfinished run of this study's own (main checked it: `check_run_dirs`) starts again from scratch; never
    # a folder it did not make, nor a finished run
    config.overwrite = os.path.isdir(run_dir) and not os.path.exists(os.path.join(run_dir, "finished.json"))
    Trainer(config).run()
    if not os.path.exists(os.path.join(run_dir, "finished.json")):
        sys.exit(f"{method} seed {seed}: the run stopped before its end ({run_dir})")


def _plain(value):
    """A config value as its config.json stores it (tuples as lists, ConfigDicts as dicts)."""
    value = value.to_dict() if hasattr(value, "to_dict") else value
    return json.loads(json.dumps(value))


def run_differences(run_dir, method, seed, epochs, overrides, flow_model=DEFAULT_FLOW_MODEL):
    """The fields this command sets (the seed, the epochs, the model, each --set FIELD) on which the run stored in
    `run_dir`/config.json differs from what the command would train: ["FIELD: stored X, this command Y"];
    None when run_dir holds no config.json."""
    stored = _read_json(os.path.join(run_dir, "config.json"))
    if not isinstance(stored, dict):
        return None
    wanted = method_config(method, seed, run_dir, epochs, overrides, flow_model)
    fields = ["seed", "num_epochs", "pretrained.model"] + [item.partition("=")[0] for item in overrides]
    differences = []
    for field in dict.fromkeys(fields):
        node_stored, node_wanted = stored, wanted
        for part in field.split("."):
            node_stored = node_stored.get(part) if isinstance(node_stored, dict) else None
            node_wanted = node_wanted[part]
        if node_stored != _plain(node_wanted):
            differences.append(f"{field}: stored {json.dumps(node_stored)}, this command {json.dumps(_plain(node_wanted))}")
    return differences


def check_run_dirs(results, methods, seeds, epochs, overrides, flow_model=DEFAULT_FLOW_MODEL):
    """Before any run starts: every run directory the command would skip (finished) or start again (unfinished)
    holds a run of this command's fields; a finished run of other fields would be reported as this command's
    result (a probe's --set that ran nothing), an unfinished one or a folder the study did not make would be
    written over. BenchmarkError naming the first such directory and the fix."""
    for method in methods:
        for seed in seeds:
            run_dir = os.path.join(results, "runs", method, f"seed_{seed}")
            if not os.path.isdir(run_dir) or not os.listdir(run_dir):
                continue
            differences = run_differences(run_dir, method, seed, epochs, overrides, flow_model)
            finished = os.path.exists(os.path.join(run_dir, "finished.json"))
            if differences is None:
                raise BenchmarkError(
                    f"{run_dir} holds no run of this study (no config.json) and would be written over; give another "
                    "--results, or move it away")
            if differences:
                raise BenchmarkError(
                    f"{run_dir} holds a {'finished' if finished else 'unfinished'} run of other fields "
                    f"({'; '.join(differences)}): its results are not this command's; give --results a new folder "
                    "for this probe")


def read_rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rows.append(json.loads(line))
    return rows


def _critic_compute():
    import importlib.util

    spec = importlib.util.spec_from_file_location("critic_compute", os.path.join(REPO_ROOT, "benchmarks", "critic_compute.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_curve(rows):
    """[(epoch k, overall, tags dict, model calls, training seconds)] of a run's evaluations, the calls and
    seconds of the training epochs before each."""
    calls = _critic_compute().training_calls(rows)
    training = [r for r in rows if "reward_mean" in r]
    curve = []
    for row in rows:
        if "eval/geneval/overall" not in row:
            continue
        k = row["epoch"]
        seconds = sum(sum(r.get(key, 0.0) for key in TIME_KEYS) for r in training if r["epoch"] < k)
        model = sum(c[0] for epoch, c in calls if epoch < k)
        tags = {tag: row.get(f"eval/geneval/{tag}") for tag in TAGS}
        curve.append((k, row["eval/geneval/overall"], tags, model, seconds))
    return curve


def collect(results, target=None, flow_model=DEFAULT_FLOW_MODEL):
    """summary rows, the table and the verdicts from the finished runs under results/runs; each row's model is the
    one its run trained (its config.json), the bases' re-evaluations those of --flow-model's variants."""
    runs_root = os.path.join(results, "runs")
    summary, curves, metrics = [], {}, {}
    bases = {}
    for method in METHODS:
        for name in sorted(os.listdir(os.path.join(runs_root, method))) if os.path.isdir(os.path.join(runs_root, method)) else []:
            run_dir = os.path.join(runs_root, method, name)
            if not os.path.exists(os.path.join(run_dir, "finished.json")):
                continue
            seed = int(name.split("_")[1])
            rows = read_rows(run_dir)
            curve = run_curve(rows)
            if not curve:
                continue
            stored = (_read_json(os.path.join(run_dir, "config.json")) or {}).get("pretrained") or {}
            model = stored.get("model") or models(flow_model)[variant_of(method, flow_model)]
            metrics[f"{method}/{seed}"] = rows
            curves[(method, seed)] = curve
            k, overall, tags, calls, seconds = curve[-1]
            summary.append({"model": model, "method": method, "seed": seed, "overall": overall, **tags,
                            "train_seconds": round(seconds, 1), "model_calls": calls})
            rewards = [r["reward_mean"] for r in sorted(rows, key=lambda r: r["epoch"]) if "reward_mean" in r]
            if len(rewards) >= 2 * TREND_EPOCHS:  # the training reward's trend, a less noisy view than one eval
                summary[-1]["train_reward_start"] = statistics.fmean(rewards[:TREND_EPOCHS])
                summary[-1]["train_reward_end"] = statistics.fmean(rewards[-TREND_EPOCHS:])
            again = _read_json(os.path.join(run_dir, REEVAL))
            if again:
                summary[-1]["reeval"] = {**_mean_row(again["rows"]), **again["settings"]}
            if curve[0][0] == 0:
                # the base as the study's runs evaluate it: a run's epoch 0, one whose sampler is the variant's own
                # first (cps and dance runs evaluate with their own SDE, so their epoch 0 differs)
                own = method not in OWN_SAMPLER_METHODS
                if model not in bases or (own and not bases[model][1]):
                    bases[model] = ({"model": model, "method": "base", "seed": None, "overall": curve[0][1],
                                     **curve[0][2], "train_seconds": 0.0, "model_calls": 0}, own)
    bases = {model: row for model, (row, _) in bases.items()}
    for variant, model in models(flow_model).items():
        again = _read_json(os.path.join(results, f"reeval_base_{variant}.json"))
        if again and model in bases:
            bases[model]["reeval"] = {**_mean_row(again["rows"]), **again["settings"]}
    summary = list(bases.values()) + summary
    flow = [r for r in summary if r["method"] == "flow_grpo"]
    if target is None and flow:
        target = max(r["overall"] for r in flow)
    best_flow = max(flow, key=lambda r: r["overall"]) if flow else None
    reference_seconds = None
    if best_flow is not None:
        reached = [s for _, o, _, _, s in curves[("flow_grpo", best_flow["seed"])] if o >= target - 1e-12]
        reference_seconds = reached[0] if reached else None
    table = []
    for method in METHODS:
        rows = [r for r in summary if r["method"] == method]
        if not rows:
            continue
        # the target is the flow model's (the best flow_grpo run): a run of the UNet model, whose base scores
        # differently, is not measured against it
        comparable = best_flow is not None and rows[0]["model"] == best_flow["model"]
        to_target = []
        for r in rows:
            hit = next(((c, s) for _, o, _, c, s in curves[(method, r["seed"])] if o >= target - 1e-12),
                       None) if comparable else None
            to_target.append(hit)
        hits = [h for h in to_target if h is not None]
        seconds = statistics.median(h[1] for h in hits) if len(hits) * 2 > len(rows) else None
        table.append({
            "method": method, "model": rows[0]["model"], "what": METHODS[method][2], "seeds": [r["seed"] for r in rows],
            "overall": _spread([r["overall"] for r in rows]),
            # the final weights again with one deterministic sampler and 4x the images (reevaluate); None until run
            "reeval_overall": (_spread([r["reeval"]["overall"] for r in rows]) if all("reeval" in r for r in rows)
                               else None),
            "reeval_tags": ({tag: _spread([r["reeval"][tag] for r in rows]) for tag in TAGS}
                            if all("reeval" in r for r in rows) else None),
            "tags": {tag: _spread([r[tag] for r in rows]) for tag in TAGS},
            "train_reward_start": _spread([r.get("train_reward_start") for r in rows]),
            "train_reward_end": _spread([r.get("train_reward_end") for r in rows]),
            "train_seconds": statistics.median(r["train_seconds"] for r in rows),
            "model_calls": statistics.median(r["model_calls"] for r in rows),
            "reached_target": f"{len(hits)}/{len(rows)}" if comparable else "n/a (another model)",
            "seconds_to_target": seconds,
            "calls_to_target": statistics.median(h[0] for h in hits) if seconds is not None else None,
            "ratio_to_flow_grpo": seconds / reference_seconds if seconds is not None and reference_seconds else None,
        })
    return summary, table, target, metrics


def _spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def render(table, target, summary):
    def cell(spread):
        return "-" if spread is None else f"{spread['median']:.3f} [{spread['min']:.3f}, {spread['max']:.3f}]"

    lines = [f"target: overall >= {target:.3f} (the best flow_grpo run's final overall)" if target is not None else "",
             "re-eval: the final weights with one deterministic sampler for all and 4x the images (--reevaluate)",
             "| model | method | overall | re-eval | train reward | " + " | ".join(TAGS)
             + " | train s | model calls | reached | s to target | / flow_grpo |",
             "|" + "---|" * (10 + len(TAGS))]
    for base in (r for r in summary if r["method"] == "base"):
        again = f"{base['reeval']['overall']:.3f}" if "reeval" in base else "-"
        lines.append(f"| {base['model']} | base | {base['overall']:.3f} | {again} | | "
                     + " | ".join(f"{base[t]:.3f}" for t in TAGS) + " | 0 | 0 | | | |")
    for row in table:
        ratio = "-" if row["ratio_to_flow_grpo"] is None else f"{row['ratio_to_flow_grpo']:.2f}"
        seconds = "-" if row["seconds_to_target"] is None else f"{row['seconds_to_target']:.0f}"
        trend = ("-" if row["train_reward_start"] is None else
                 f"{row['train_reward_start']['median']:.3f} -> {row['train_reward_end']['median']:.3f}")
        lines.append(f"| {row['model']} | {row['method']} | {cell(row['overall'])} | {cell(row['reeval_overall'])} | "
                     f"{trend} | "
                     + " | ".join(cell(row["tags"][t]) for t in TAGS)
                     + f" | {row['train_seconds']:.0f} | {row['model_calls']:.0f} | {row['reached_target']} | {seconds} | {ratio} |")
    return "\n".join(lines)


def _base_evaluator(variant, workdir, eta=None, flow_model=DEFAULT_FLOW_MODEL):
    """A Trainer of `variant` on its base weights (one thread, in `workdir`), whose evaluator the modes below call
    with other eval seeds; eta: the evaluation's sampler noise (None: the variant's own, as its runs evaluate)."""
    import torch

    torch.set_num_threads(1)
    from ddpo_group.training.trainer import Trainer

    method = next(m for m in METHODS if variant_of(m, flow_model) == variant)
    config = method_config(method, 0, os.path.join(workdir, "runs", method, "seed_0"), epochs=1, flow_model=flow_model)
    config.log_with = "none"
    trainer = Trainer(config)
    if eta is not None:  # after the trainer's checks, which refuse a deterministic sampler for training
        trainer.evaluator.config.sample.eta = eta
    return trainer


def _evaluate_seeds(trainer, eval_seeds, label):
    """[{"eval_seed", "overall", six tags}] of the trainer's current weights at each eval seed."""
    rows = []
    for eval_seed in eval_seeds:
        trainer.config.eval_seed = eval_seed
        metrics = {"epoch": 0}
        trainer.evaluate(0, metrics)
        rows.append({"eval_seed": eval_seed, "overall": metrics["eval/geneval/overall"],
                     **{tag: metrics[f"eval/geneval/{tag}"] for tag in TAGS}})
        print(f"{label} eval_seed {eval_seed}: overall {rows[-1]['overall']:.3f}", flush=True)
    return rows


def eval_noise(eval_seeds, results, flow_model=DEFAULT_FLOW_MODEL):
    """The evaluation's own noise: each model's base (the shipped weights, before any update) evaluated as a run
    evaluates it (its variant's prompts, steps, guidance, eta, 2 images a record) with each of `eval_seeds` as
    config.eval_seed. A difference between two runs' finals smaller than this spread is not a difference the
    held-out set can see. Returns the JSON document ({"rows": [...], "spread": {model: {...}}})."""
    import tempfile

    rows, spread = [], {}
    for variant, model in models(flow_model).items():
        with tempfile.TemporaryDirectory(prefix="eval_noise_") as tmp:
            evaluator = _base_evaluator(variant, tmp, flow_model=flow_model)
            rows += [{"model": model, **row} for row in _evaluate_seeds(evaluator, eval_seeds, model)]
        values = [r["overall"] for r in rows if r["model"] == model]
        spread[model] = {**_spread(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                         "n": len(values)}
    document = {"what": "each model's base evaluated with several eval seeds (benchmarks/scenes_study.py "
                        "--eval-noise): the held-out overall's spread from the evaluation noise alone",
                "eval_seeds": list(eval_seeds), "rows": rows, "spread": spread}
    os.makedirs(results, exist_ok=True)
    write_json(os.path.join(results, "eval_noise.json"), document)
    for model, s in spread.items():
        print(f"{model}: base overall over {s['n']} eval seeds: median {s['median']:.3f} [{s['min']:.3f}, "
              f"{s['max']:.3f}], std {s['std']:.3f}")
    return document


REEVAL = "reeval.json"
TREND_EPOCHS = 10  # the training reward's start and end: the mean over the first and the last 10 epochs
# methods whose runs sample, and so evaluate, with another SDE than their variant's
OWN_SAMPLER_METHODS = ("cps", "dance")


def reevaluate(eval_seeds, results, eta=0.0, methods=None, base=True, flow_model=DEFAULT_FLOW_MODEL):
    """Every finished run's final weights (RESULTS/runs/<method>/seed_<s>/checkpoints/checkpoint_<last>) and each
    model's base evaluated again with one sampler for all (eta: 0, the deterministic ODE / DDIM sampler, as
    Flow-GRPO evaluates; the runs evaluated with their own training sampler, so cps and dance's numbers were on
    other samplers) at each of `eval_seeds` (2 images a record each): 2 x len(eval_seeds) images per held-out
    record instead of 2. Each run's numbers go into its directory (reeval.json; a run whose file holds these
    seeds and eta is skipped, so it resumes), the base's into RESULTS/reeval_base.json; `collect` reads them."""
    import tempfile

    settings = {"eval_seeds": list(eval_seeds), "eta": eta, "images_per_record": 2 * len(eval_seeds)}
    methods = list(methods or METHODS)
    for variant, model in models(flow_model).items():
        if not any(variant_of(m, flow_model) == variant for m in methods):
            continue
        todo = []
        for method in methods:
            if variant_of(method, flow_model) != variant or not os.path.isdir(os.path.join(results, "runs", method)):
                continue
            for name in sorted(os.listdir(os.path.join(results, "runs", method))):
                run_dir = os.path.join(results, "runs", method, name)
                if not os.path.exists(os.path.join(run_dir, "finished.json")):
                    continue
                done = _read_json(os.path.join(run_dir, REEVAL))
                if done and done.get("settings") == settings:
                    continue
                checkpoints = os.path.join(run_dir, "checkpoints")
                last = sorted(os.listdir(checkpoints), key=lambda n: int(n.split("_")[-1]))[-1:] \
                    if os.path.isdir(checkpoints) else []
                epochs = (_read_json(os.path.join(run_dir, "config.json")) or {}).get("num_epochs")
                if not last or int(last[0].split("_")[-1]) != epochs:
                    print(f"{method}/{name}: no final checkpoint (checkpoints/checkpoint_{epochs or 'N'} with its "
                          "config.json); not re-evaluated", flush=True)
                    continue
                todo.append((method, name, run_dir, os.path.join(checkpoints, last[0])))
        base_path = os.path.join(results, f"reeval_base_{variant}.json")
        base_done = not base or (_read_json(base_path) or {}).get("settings") == settings
        if not todo and base_done:
            continue
        with tempfile.TemporaryDirectory(prefix="reeval_") as tmp:
            trainer = _base_evaluator(variant, tmp, eta, flow_model)
            module = trainer.trainable_module
            if not base_done:  # before any run's weights are loaded
                write_json(base_path, {"model": model, "settings": settings,
                                       "rows": _evaluate_seeds(trainer, eval_seeds, f"{model} base")})
            for method, name, run_dir, checkpoint in todo:
                trainer.policy.load_trainable(module, checkpoint, use_lora=False)  # every weight: a strict load
                rows = _evaluate_seeds(trainer, eval_seeds, f"{method}/{name}")
                write_json(os.path.join(run_dir, REEVAL), {"checkpoint": os.path.relpath(checkpoint, run_dir),
                                                           "settings": settings, "rows": rows})


def _mean_row(rows):
    """The mean over eval seeds of the overall and each tag (tags a seed's table lacks are left out)."""
    keys = ("overall",) + TAGS
    return {key: statistics.fmean(r[key] for r in rows if r.get(key) is not None) for key in keys}


def write_json(path, document, compress=False):
    tmp = path + ".tmp"
    with (gzip.open(tmp, "wt") if compress else open(tmp, "w")) as f:
        json.dump(document, f, indent=None if compress else 1)
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="", help=f"comma-separated, of {', '.join(METHODS)} (default: all)")
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--epochs", type=int, default=0, help="training epochs (0: the variant's, 40)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each)")
    parser.add_argument("--results", default=None,
                        help="the study's folder (default benchmarks/results/scenes_study, whose committed results "
                             "are refused unless --results names it)")
    parser.add_argument("--collect", action="store_true", help="only build the table and JSON from finished runs")
    parser.add_argument("--target", type=float, default=None, help="overall target (default: best flow_grpo final)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field of every run (a JSON value; repeatable), for a probe in its own "
                             "--results, e.g. --set train.learning_rate=1e-3")
    parser.add_argument("--eval-noise", default="", metavar="SEEDS",
                        help="only measure the evaluation's noise: each base model evaluated with these eval seeds "
                             "(comma-separated), into RESULTS/eval_noise.json")
    parser.add_argument("--reevaluate", default="", metavar="SEEDS",
                        help="only evaluate every finished run's final weights and the bases again with these eval "
                             "seeds and one sampler (--eval-eta), into each run's reeval.json (resumes)")
    parser.add_argument("--eval-eta", type=float, default=0.0,
                        help="--reevaluate's sampler noise (0: the deterministic ODE / DDIM sampler)")
    parser.add_argument("--flow-model", default=DEFAULT_FLOW_MODEL, choices=list(FLOW_VARIANTS),
                        help="the flow methods' base (default tiny-scenes-sd3; tiny-scenes-flow: the flow-matching "
                             "UNet, variant tiny_scenes_flow); the UNet methods train tiny-scenes either way")
    parser.add_argument("--no-base", action="store_true", help=argparse.SUPPRESS)  # a --reevaluate job's
    parser.add_argument("--run-one", nargs=4, metavar=("METHOD", "SEED", "RUN_DIR", "EPOCHS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        method, seed, run_dir, epochs = args.run_one
        return run_one(method, int(seed), run_dir, int(epochs), args.set, args.flow_model)
    given, args.results = args.results is not None, args.results or DEFAULT_RESULTS
    try:  # every mode writes into the results folder: the committed study only when --results names it
        refuse_committed_default("--results", args.results, given)
    except BenchmarkError as err:
        parser.error(str(err))
    if args.eval_noise:
        return eval_noise([int(s) for s in args.eval_noise.split(",") if s.strip()], args.results, args.flow_model)
    if args.reevaluate:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()] or list(METHODS)
        seeds = [int(s) for s in args.reevaluate.split(",") if s.strip()]
        if args.jobs <= 1:
            return reevaluate(seeds, args.results, args.eval_eta, methods, base=not args.no_base,
                              flow_model=args.flow_model)
        shares = [methods[i::args.jobs] for i in range(args.jobs)]  # the bases go with the first job's
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        processes = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--reevaluate", args.reevaluate,
                                       "--eval-eta", str(args.eval_eta), "--results", args.results,
                                       "--methods", ",".join(share), "--flow-model", args.flow_model]
                                      + (["--no-base"] if i else []), env=env)
                     for i, share in enumerate(shares) if share]
        codes = [p.wait() for p in processes]
        if any(codes):
            sys.exit(f"--reevaluate: a job failed (exit codes {codes})")
        return None
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] or list(METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if (args.set or args.epochs) and not args.collect:
        # a misspelt field, or a value the trainer's own check refuses for any method (--set sample.num_steps=3
        # against mixgrpo's 4-step window), is one line here, not a traceback in every run's log
        from ddpo_group.config.check import check_config
        from ddpo_group.config.registry import ConfigError

        method = methods[0]
        try:
            for method in methods:
                check_config(method_config(method, seeds[0] if seeds else 0, os.path.join(args.results, "check"),
                                           args.epochs, args.set, args.flow_model), num_processes=1)
        except ConfigError as err:
            parser.error(f"{err} (method {method})")
    failures = []
    if not args.collect:
        from run_pool import run_pool

        try:
            check_run_dirs(args.results, methods, seeds, args.epochs, args.set, args.flow_model)
        except BenchmarkError as err:
            parser.error(str(err))
        pending = [(m, s) for m in methods for s in seeds
                   if not os.path.exists(os.path.join(args.results, "runs", m, f"seed_{s}", "finished.json"))]
        tasks = []
        for method, seed in pending:
            run_dir = os.path.join(args.results, "runs", method, f"seed_{seed}")
            tasks.append((f"{method} seed {seed}", [sys.executable, os.path.abspath(__file__), "--run-one", method,
                                                    str(seed), run_dir, str(args.epochs), "--flow-model", args.flow_model]
                          + [f"--set={item}" for item in args.set], run_dir))
        codes = run_pool(tasks, args.jobs)
        for (label, _, run_dir) in tasks:
            if codes.get(label) or not os.path.exists(os.path.join(run_dir, "finished.json")):
                failures.append(f"{label} (exit {codes.get(label)}, log {run_dir}.log)")
    if failures:  # the table would mix the finished runs with a failed study: --collect builds it when wanted
        fail(parser.prog, f"{len(failures)} run{'s' if len(failures) > 1 else ''} failed: {', '.join(failures)}; "
                          "the finished runs are kept (--collect builds the table from them); the study's summary "
                          "and table are not rewritten", code=1)
    summary, table, target, metrics = collect(args.results, args.target, args.flow_model)
    os.makedirs(args.results, exist_ok=True)
    write_json(os.path.join(args.results, "summary.json"), summary)
    write_json(os.path.join(args.results, "study.json"), {
        "target": target, "table": table, "definitions": __doc__.split("From each run's metrics.jsonl:")[1].strip(),
        "command": "python benchmarks/scenes_study.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    })
    write_json(os.path.join(args.results, "metrics.json.gz"), metrics, compress=True)
    print(render(table, target, summary))
    return summary


if __name__ == "__main__":
    main()
