"""Issue 53's learning ladder on the scenes world: can the trainer teach the shipped models anything, from the
easiest lesson up? A rung that fails stops the climb until its cause is found (docs/scenes.md).

    python benchmarks/scenes_ladder.py --rungs a,b --families flow,unet --jobs 14   # rungs a and b, 3 seeds each
    python benchmarks/scenes_ladder.py --rungs a --families flow --seeds 42 --epochs 3   # one short check
    python benchmarks/scenes_ladder.py --rungs b --cases two_object --families unet      # one case of a rung
    python benchmarks/scenes_ladder.py --rungs b --draw 1 --results benchmarks/results/scenes_ladder_draw1  # other prompts
    python benchmarks/scenes_ladder.py --collect                                    # the tables, JSON and figures
    python benchmarks/scenes_ladder.py --rungs b --model-flow runs/pretrain/flow --results benchmarks/results/scenes_ladder_newbase

Rungs (every one on both families: "flow" is Flow-GRPO on the flow model, variant tiny_scenes on tiny-scenes-sd3;
"unet" is GRPO + KL on the UNet, variant tiny_scenes_sd on tiny-scenes; --model-flow / --model-unet train
another base; a flow base may be an SD3 pipeline or a flow-matching UNet, the sd_flow family's, e.g. tiny-scenes-flow):

    a  DDPO's sanity check: reward_fn jpeg_incompressibility on one prompt (RUNG_A_PROMPT); passes when the
       training reward rises: the mean of the last WINDOW epochs exceeds the first WINDOW's by more than 2
       standard errors (each epoch's reward_std / sqrt(its num_samples)). Default 15 epochs (the issue's probe
       rose 2.16 -> 3.08 in 14).
    b  one training prompt of each tag that has training records (RUNG_B_PROMPTS: one drawn at random per tag,
       seed 0, nobody's pick), the task's reward (Flow-GRPO's partial score); passes when the training
       strict-correct (reward_info/geneval/strict_correct, GenEval's strict verdict, the mean over an epoch's
       images) averaged over WINDOW consecutive epochs reaches TARGET = 0.9 within the rung's 30 epochs (a run
       given more with --epochs is judged on its first 30; its epochs_to_strict_0.9 still says when it got there).
       single_object has no training prompt (all eight are held out), so five runs per seed. --draw K draws
       another prompt per tag the same way with seed K (rung_b_prompts; 0 is RUNG_B_PROMPTS): the issue's "a
       one-prompt run on a training prompt nobody tuned for learns the same way", for recipes chosen on draw 0.
    c  one tag's training prompts (--tag, default colors; its training records in the GenEval mix); passes when
       the held-out set's number for that tag (eval/geneval/<tag>, 2 fixed-noise images per record) after the
       last epoch is above the base's (the same evaluation at epoch 0) by more than 2 standard errors of the
       difference (each score a share of the tag's images: p (1 - p) / images, the images being the tag's
       held-out records x eval_images_per_prompt), as rung a asks of its rise. Default 30 epochs.
    d  the full task (the variant as it is: every tag in GenEval's proportions); passes when the held-out overall
       after the last epoch is above the base's by more than 2 standard errors (the overall is the mean of the six
       tags' shares, its variance the sum of theirs over 36). Default 40 epochs (the variant's).

A case (rung, family, prompt or tag) passes when a majority of its seeds pass; a rung passes for a family when
every case of the rung ran on at least SEEDS = 3 seeds and passed. A folder that holds only some of them (one
probe, one case, one seed) reads INCOMPLETE, never PASS, unless a case in it has already failed on two seeds of
three (FAIL).

Cost. Every run keeps its variant's sampler, learning rate and KL; an epoch is 8 groups of 8 images (64, the
variants' own; --images changes the count, in whole sampling batches). Flow-GRPO's GenEval recipe samples 48
groups of 24 (1,152 images an epoch, yifan123/flow_grpo config/grpo.py geneval_sd3). Scaled down: a group of 8
keeps GRPO's per-group standard deviation usable (a group of 2-4 is often all-equal on a 0/1-ish reward) and 8
groups keep 4 optimizer steps an epoch. Measured (flow, rung a, 3 epochs, one thread on a 2-core machine shared
with about ten other processes): 163 s of wall time an epoch, of which the run's own CPU time was about 27 s (the
command's 102 s of CPU less 14 s of start-up and the collection); on a free core an epoch is about 30 s, so rungs a
and b (2 families x 6 cases x 3 seeds = 36 runs, 15 or 30 epochs, ~990 run-epochs) take about 35-40 minutes with
--jobs 14 on a 16-core machine (about 0.7 GB of memory a run). An epoch's strict-correct over 64 images has a
standard error near 0.04 at 0.9; WINDOW = 3 epochs (192 images) takes it to 0.02, so a run does not pass on one
lucky epoch.

Each run trains in a process of its own on one thread into RESULTS/runs/<rung>/<family>/<case>/seed_<s>/ (config
written there as ladder_config.json when it finishes). A run whose directory holds finished.json is done and
skipped when its ladder_config.json is the config this command would train (the same rung, model, epochs, images,
--set, code defaults); otherwise the command refuses the results folder (a finished run is never overwritten and
never reported as another config's: give a new --results). A run saves a checkpoint every --save-every epochs
(default SAVE_EVERY = 5; also when a signal stops it): an unfinished run goes on from its latest checkpoint, bit for
bit what one uninterrupted run trains (a run started with another config, as its ladder_started.json says, is refused),
and one with no checkpoint starts again from scratch; its log is appended to. A run keeps its last two checkpoints.
A run that ends without finished.json (a signal stopped it) counts as failed. The command exits non-zero when any
run failed.

Writes RESULTS/summary.json ({"runs": one row per finished run (a row with a strict-correct series, as rung b's,
also carries best_window, the best WINDOW-epoch mean of strict-correct within the rung's epochs with its first
and last epoch counted from 0, and strict_by_ten, the means of epochs 0-9, 10-19, ...), "rungs": the verdicts,
"definitions", "command"}),
RESULTS/metrics.json.gz (every run's metrics rows) and RESULTS/ladder_<rung>.png (training reward and strict-correct
per epoch, a panel per family, a colour per case, a line per seed). With --samples N, also RESULTS/ladder_b_samples.png:
for every rung-b run whose final checkpoint is still there (checkpoints are not committed), N images of its prompt
from the base and N from the final weights (`scripts/evaluate.py --protocol geneval`, the run's sampler, eval seed
1234: the same noise for both), the strict verdict under each; its numbers in RESULTS/samples.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import statistics
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from run_pool import read_json as _read_json, run_pool  # noqa: E402
from scenes_study import TAGS, TIME_KEYS, read_rows, write_json  # noqa: E402

DEFAULT_RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results", "scenes_ladder")
FAMILIES = {"flow": "tiny_scenes", "unet": "tiny_scenes_sd"}
RUNGS = ("a", "b", "c", "d")
DEFAULT_EPOCHS = {"a": 15, "b": 30, "c": 30, "d": 40}
RUNG_A_PROMPT = "a photo of three circles"  # the probe: jpeg_incompressibility 2.16 -> 3.08 in 14 epochs
# one training prompt per tag, drawn at random (numpy default_rng(0)) from scenes.training_records()[tag]
RUNG_B_PROMPTS = {
    "two_object": "a photo of a star and a triangle",
    "counting": "a photo of three semicircles",
    "colors": "a photo of a magenta star",
    "position": "a photo of a star above a cross",
    "color_attr": "a photo of a magenta cross and a yellow star",
}
TARGET = 0.9
WINDOW = 3
SAVE_EVERY = 5  # epochs between a run's checkpoints (--save-every): a stopped ladder resumes from the last one
SEEDS = 3  # a rung's verdict needs every case on at least this many seeds
STRICT = "reward_info/geneval/strict_correct"
CONFIG_FILE = "ladder_config.json"
FINISHED = "finished.json"  # the trainer's mark of a run that reached its end (ddpo_group.runs.run_dir.FINISHED_FILE)


def strict_key(rows):
    """The key of GenEval's strict verdict in a run's metrics rows: STRICT, or, for a reward that scores with GenEval
    under its own name (the null control, benchmarks/null_reward.py, logs the images' true verdicts as
    reward_info/ShuffledGenEval/strict_correct), the one reward_info/<name>/strict_correct key there; None if none."""
    keys = {k for r in rows for k in r if k.startswith("reward_info/") and k.endswith("/strict_correct")}
    if not keys or STRICT in keys:
        return STRICT if keys else None
    if len(keys) > 1:
        raise ValueError(f"metrics rows with several strict verdicts and none of them {STRICT}: {sorted(keys)}")
    return keys.pop()


def rung_b_prompts(draw=0):
    """{tag: prompt} of rung b: per tag with training records, the record at numpy default_rng(draw).integers(n)
    of scenes.training_records()[tag] (n records). draw 0 is RUNG_B_PROMPTS, the prompts every earlier run used."""
    import numpy as np

    from ddpo_group.data import scenes

    records = scenes.training_records()
    return {tag: records[tag][int(np.random.default_rng(draw).integers(len(records[tag])))]["prompt"]
            for tag in RUNG_B_PROMPTS}


def cases(rung, tag="colors", draw=0):
    """[(case name, prompt or None)] of a rung (rung b's prompts from rung_b_prompts(draw))."""
    if rung == "a":
        return [("jpeg", RUNG_A_PROMPT)]
    if rung == "b":
        return list((RUNG_B_PROMPTS if draw == 0 else rung_b_prompts(draw)).items())
    if rung == "c":
        return [(tag, None)]
    return [("full", None)]


def ladder_config(rung, family, case, prompt, seed, run_dir, epochs=0, images=0, model="", overrides=(),
                  save_every=SAVE_EVERY):
    """The config of one run: the family's variant with the rung's prompts / reward / evaluation, then the
    --set overrides, then the images per epoch (whole sampling batches); a checkpoint every `save_every` epochs."""
    from ddpo_group.config import grpo
    from ddpo_group.config.fields import set_field
    from ddpo_group.config.registry import ConfigError

    config = grpo.get_config(FAMILIES[family])
    config.seed = seed
    config.num_epochs = epochs or DEFAULT_EPOCHS[rung]
    if model:
        config.pretrained.model = model
        from ddpo_group.diffusion.policy import family_for_model

        if family_for_model(model).family == "sd_flow":  # a flow UNet's CLIP: no zero T5 tokens to count
            config.sample.max_sequence_length = 0
    if rung == "a":
        config.reward_fn = "jpeg_incompressibility"
        config.reward_kwargs = {}
    if prompt:
        config.prompt_fn_kwargs = {"prompt": prompt}
    elif rung == "c":
        config.prompt_fn_kwargs = {**config.prompt_fn_kwargs, "tags": case}
    # one-prompt rungs read the training numbers; c and d the held-out set before and after
    config.eval_freq = 0 if rung in ("a", "b") else config.num_epochs
    for item in overrides:
        set_field(config, item)
    if images:
        if images % config.sample.batch_size or images % config.sample.group_size:
            raise ConfigError(f"--images {images}: must be a multiple of sample.batch_size "
                              f"({config.sample.batch_size}) and sample.group_size ({config.sample.group_size})")
        config.sample.num_batches_per_epoch = images // config.sample.batch_size
    config.logdir, config.run_name = os.path.dirname(run_dir), os.path.basename(run_dir)
    config.overwrite = True
    config.save_freq = save_every
    config.num_checkpoint_limit = 2  # the final checkpoint and the one before it: a ladder has dozens of runs
    config.log_images_every = 0
    return config


# fields that say where a run is written and how often it saves, not what it trains: left out of the config a
# finished run is compared by (a resumed folder may have moved; a run resumed from a checkpoint trains bit for bit
# what one uninterrupted run trains)
NOT_THE_EXPERIMENT = ("logdir", "run_name", "overwrite", "save_freq", "num_checkpoint_limit", "resume_from")
STARTED_FILE = "ladder_started.json"  # the config a run was started with: a resume under another is refused


def config_document(config):
    """The run's config as JSON data, without the fields of NOT_THE_EXPERIMENT."""
    document = json.loads(json.dumps(config.to_dict(), default=str, sort_keys=True))
    for key in NOT_THE_EXPERIMENT:
        document.pop(key, None)
    return document


def has_checkpoint(run_dir):
    """Whether an unfinished run's directory holds a checkpoint_N to go on from (a half-written one is named
    .tmp_checkpoint_N and does not count)."""
    from ddpo_group.runs.run_dir import CHECKPOINT_RE

    root = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(root) and any(CHECKPOINT_RE.match(name) for name in os.listdir(root))


@functools.lru_cache(maxsize=1)
def _base_defaults():
    """The base config as JSON data (read once: same_config runs for every finished run of a folder)."""
    from ddpo_group.config.fields import load_base_config

    return json.loads(json.dumps(load_base_config().to_dict(), default=str, sort_keys=True))


def same_config(done, now):
    """Whether a finished run's config document `done` is the config document `now`: equal, once the fields the
    code added since the run (absent from `done`) are dropped from `now` where they hold the base config's default
    (a field added at its default, e.g. train.lr_warmup_steps = 0, is the config the run had)."""
    defaults = _base_defaults()
    done = {key: value for key, value in done.items() if key not in NOT_THE_EXPERIMENT} if done else done

    def trim(old, new, default):
        if not (isinstance(old, dict) and isinstance(new, dict)):
            return new
        default = default if isinstance(default, dict) else {}
        return {key: trim(old.get(key), value, default.get(key)) for key, value in new.items()
                if key in old or key not in default or value != default[key]}

    return done is not None and done == trim(done, now, defaults)


def run_dir_of(results, rung, family, case, seed):
    return os.path.join(results, "runs", rung, family, case, f"seed_{seed}")


def run_one(spec, overrides=()):
    """Train one run in this process (a subprocess of its own, started by `main`); its config beside it at the end.
    A run directory with a checkpoint (a run stopped or killed before its end) goes on from its latest checkpoint,
    refused in one line when the run was started with another config (STARTED_FILE); a run that ends without
    finished.json exits non-zero and writes no ladder_config.json."""
    import torch

    torch.set_num_threads(1)
    from ddpo_group.training.trainer import Trainer

    config = ladder_config(**spec, overrides=overrides)
    document = config_document(config)  # as built, before the trainer reads (or fills in) anything
    record = {"spec": spec, "set": list(overrides), "config": document}
    started = os.path.join(spec["run_dir"], STARTED_FILE)
    resume = has_checkpoint(spec["run_dir"])
    if resume:
        before = _read_json(started)
        if before is not None and not same_config(before.get("config"), document):
            sys.exit(f"{spec['run_dir']}: this unfinished run was started with another config (its {STARTED_FILE}); "
                     "run its own command to finish it, or give a new --results")
        config.overwrite, config.resume_from = False, spec["run_dir"]
        print(f"resuming {spec['run_dir']} from its latest checkpoint", flush=True)
    trainer = Trainer(config)
    if not resume:
        write_json(started, record)  # after the trainer took the directory (an overwrite empties it first)
    trainer.run()
    if not os.path.exists(os.path.join(spec["run_dir"], FINISHED)):  # stopped by a signal, or nothing to do
        sys.exit(f"{spec['run_dir']}: the run did not finish (no finished.json); run the same command to go on")
    write_json(os.path.join(spec["run_dir"], CONFIG_FILE), record)


def rising(rows):
    """(rise, its standard error, pass) of the training reward: the mean of the last WINDOW epochs minus the first
    WINDOW's (fewer when the run has under 2 x WINDOW epochs), the error from each epoch's reward_std / sqrt(n)."""
    training = [r for r in rows if "reward_mean" in r]
    w = max(1, min(WINDOW, len(training) // 2))
    if len(training) < 2:
        return None, None, False
    first, last = training[:w], training[-w:]

    def variance(part):  # of the mean over the part's epochs
        return sum(r.get("reward_std", 0.0) ** 2 / max(1, r.get("num_samples", 1)) for r in part) / len(part) ** 2

    rise = statistics.fmean(r["reward_mean"] for r in last) - statistics.fmean(r["reward_mean"] for r in first)
    error = math.sqrt(variance(first) + variance(last))
    return rise, error, rise > 2 * error


def epochs_to_target(strict, target=TARGET, window=WINDOW):
    """Epochs sampled until the mean strict-correct of `window` consecutive epochs first reaches `target` (the
    window's last epoch, counted from 1), or None."""
    for end in range(window, len(strict) + 1):
        if statistics.fmean(strict[end - window:end]) >= target - 1e-12:
            return end
    return None


def best_window(strict, window=WINDOW, limit=None):
    """[mean, first epoch, last epoch] of the `window` consecutive epochs with the highest mean strict-correct among
    the first `limit` epochs (all when None); epochs counted from 0 as in metrics.jsonl; the earliest of tied
    windows; None when the run has fewer epochs than the window."""
    values = strict[:limit] if limit else strict
    best = None
    for start in range(len(values) - window + 1):
        mean = statistics.fmean(values[start:start + window])
        if best is None or mean > best[0] + 1e-12:
            best = [mean, start, start + window - 1]
    return best


def means_by_ten(values):
    """The mean of epochs 0-9, 10-19, ... ([first, last, mean] each; the last block may be shorter)."""
    return [[start, min(start + 10, len(values)) - 1, statistics.fmean(values[start:start + 10])]
            for start in range(0, len(values), 10)]


def run_row(rung, family, case, seed, rows, document):
    """One summary row of a finished run (module docstring's verdicts)."""
    training = sorted((r for r in rows if "reward_mean" in r), key=lambda r: r["epoch"])
    rewards = [r["reward_mean"] for r in training]
    key = strict_key(training)
    strict = [r[key] for r in training if key in r] if key else []
    spec = (document or {}).get("spec", {})
    config = (document or {}).get("config", {})
    row = {"rung": rung, "family": family, "case": case, "seed": seed,
           "model": (config.get("pretrained") or {}).get("model"), "prompt": spec.get("prompt"),
           "reward_fn": config.get("reward_fn"), "epochs": len(training),
           "images_per_epoch": training[0].get("num_samples") if training else None,
           "first_reward": rewards[0] if rewards else None, "last_reward": rewards[-1] if rewards else None,
           "reward": [round(v, 4) for v in rewards], "strict_correct": [round(v, 4) for v in strict],
           "epochs_to_strict_0.9": epochs_to_target(strict) if strict else None,
           "best_window": best_window(strict, limit=DEFAULT_EPOCHS[rung]) if strict else None,
           "strict_by_ten": means_by_ten(strict) if strict else [],
           "seconds_per_epoch": (statistics.fmean(sum(r.get(k, 0.0) for k in TIME_KEYS) for r in training)
                                 if training else None)}
    evals = sorted((r for r in rows if "eval/geneval/overall" in r), key=lambda r: r["epoch"])
    if evals:
        row["base"] = {key: evals[0].get(f"eval/geneval/{key}") for key in ("overall",) + TAGS}
        row["final"] = {key: evals[-1].get(f"eval/geneval/{key}") for key in ("overall",) + TAGS}
        row["final_epoch"] = evals[-1]["epoch"]
    if rung == "a":
        rise, error, ok = rising(training)
        row.update(rise=rise, rise_error=error, passed=ok)
    elif rung == "b":
        reached = row["epochs_to_strict_0.9"]  # the rung's budget, whatever --epochs the run was given
        row["passed"] = reached is not None and reached <= DEFAULT_EPOCHS["b"]
    else:
        key = case if rung == "c" else "overall"
        done = evals and evals[-1]["epoch"] > evals[0]["epoch"] and evals[0].get(f"eval/geneval/{key}") is not None
        row["lift"] = (evals[-1][f"eval/geneval/{key}"] - evals[0][f"eval/geneval/{key}"]) if done else None
        row["lift_error"] = (math.hypot(held_out_error(row["base"], key, config),
                                        held_out_error(row["final"], key, config)) if done else None)
        row["passed"] = bool(done and row["lift"] > 2 * row["lift_error"])
    return row


@functools.lru_cache(maxsize=8)
def held_out_images(prompts, images_per_prompt):
    """{tag: images} behind a held-out evaluation's tag scores: the tag's records in `prompts` (a file in
    ddpo_group/assets/prompts or a path) times the images per record."""
    from ddpo_group.rewards.geneval.metadata import read_metadata

    path = prompts if os.path.exists(prompts) else os.path.join(REPO_ROOT, "ddpo_group", "assets", "prompts", prompts)
    counts = {}
    for record in read_metadata(path):
        counts[record["tag"]] = counts.get(record["tag"], 0) + images_per_prompt
    return counts


def held_out_error(scores, key, config):
    """The standard error of one held-out evaluation's `key` (a tag, or "overall", the unweighted mean of the tags
    present), each tag's score a share of its images (held_out_images; the run's eval prompts and images per
    record, the variants' geneval_scenes.jsonl and 2 when its config is not known)."""
    counts = held_out_images(config.get("eval_prompt_fn") or "geneval_scenes.jsonl",
                             int(config.get("eval_images_per_prompt") or 2))
    tags = [key] if key != "overall" else [t for t in TAGS if scores.get(t) is not None and counts.get(t)]
    variance = sum(scores[t] * (1 - scores[t]) / counts[t] for t in tags) / len(tags) ** 2
    return math.sqrt(variance)


def finished_runs(results):
    """[(run directory, its ladder_config.json or None)] of the finished runs under results/runs."""
    found = []
    for rung in RUNGS:
        for family in FAMILIES:
            base = os.path.join(results, "runs", rung, family)
            for case in sorted(os.listdir(base)) if os.path.isdir(base) else []:
                for name in sorted(os.listdir(os.path.join(base, case))):
                    run_dir = os.path.join(base, case, name)
                    if (name.startswith("seed_") and os.path.isdir(run_dir)
                            and os.path.exists(os.path.join(run_dir, FINISHED))):
                        found.append((run_dir, _read_json(os.path.join(run_dir, CONFIG_FILE))))
    return found


def collect(results):
    """(summary rows, verdicts {rung: {family: {"passed", "cases": {case: {"passed", "seeds_passed", "seeds"}}}}},
    metrics {run: rows}) of the finished runs under results/runs."""
    rows_out, metrics = [], {}
    for run_dir, document in finished_runs(results):
        rung, family, case, name = os.path.relpath(run_dir, os.path.join(results, "runs")).split(os.sep)
        seed = int(name.split("_")[1])
        rows = read_rows(run_dir)
        metrics[f"{rung}/{family}/{case}/{seed}"] = rows
        rows_out.append(run_row(rung, family, case, seed, rows, document))
    verdicts = {}
    for row in rows_out:
        case = verdicts.setdefault(row["rung"], {}).setdefault(row["family"], {"cases": {}})["cases"].setdefault(
            row["case"], {"seeds": [], "seeds_passed": 0})
        case["seeds"].append(row["seed"])
        case["seeds_passed"] += bool(row["passed"])
    for rung, families in verdicts.items():
        for family in families.values():
            for case in family["cases"].values():
                case["passed"] = case["seeds_passed"] * 2 > len(case["seeds"])
            # a folder of some of a rung's cases, or of fewer than its 3 seeds, does not pass the rung: it once
            # read "PASS" for a folder that held rung b's two_object alone
            family.update(rung_verdict(rung, family["cases"]))
    return rows_out, verdicts, metrics


def rung_verdict(rung, case_verdicts):
    """{"passed", "complete", "missing_cases", "short_of_seeds"} of one family on a rung: it passes when every
    case of the rung ran on at least SEEDS seeds and each passed on a majority of its seeds."""
    expected = [c for c, _ in cases(rung)] if rung in ("a", "b", "d") else list(case_verdicts)  # c: its --tag
    missing = [c for c in expected if c not in case_verdicts]
    short = sorted(c for c, v in case_verdicts.items() if len(v["seeds"]) < SEEDS)
    complete = not missing and not short and bool(case_verdicts)
    return {"passed": complete and all(v["passed"] for v in case_verdicts.values()), "complete": complete,
            "missing_cases": missing, "short_of_seeds": short}


def verdict_word(verdict):
    """PASS; FAIL when a case has failed on enough seeds that no more seeds can give it a majority of SEEDS (or of
    the seeds it ran, when more); else INCOMPLETE (cases or seeds not run yet)."""
    if verdict["passed"]:
        return "PASS"
    for case in verdict["cases"].values():
        failures = len(case["seeds"]) - case["seeds_passed"]
        if failures * 2 >= max(len(case["seeds"]), SEEDS):
            return "FAIL"
    return "INCOMPLETE"


def _cell(value, digits=3):
    return "-" if value is None else f"{value:.{digits}f}"


def render(rows, verdicts):
    """A markdown table per rung: one line per run."""
    lines = []
    for rung in RUNGS:
        mine = [r for r in rows if r["rung"] == rung]
        if not mine:
            continue
        verdict = ", ".join(f"{f} {verdict_word(v)}" + (f": not run: {', '.join(v['missing_cases'])}" if
                                                         v["missing_cases"] else "")
                            + (f"; under {SEEDS} seeds: {', '.join(v['short_of_seeds'])}" if v["short_of_seeds"] else "")
                            for f, v in verdicts[rung].items())
        lines += ["", f"## rung {rung} ({verdict})", "",
                  "| family | case | seed | epochs | reward first -> last | strict-correct first -> last "
                  f"| best {WINDOW}-epoch mean (its epochs) | epochs to 0.9 | held-out base -> final "
                  "| s/epoch | pass |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            strict = (f"{r['strict_correct'][0]:.3f} -> {r['strict_correct'][-1]:.3f}" if r["strict_correct"] else "-")
            held = "-"
            if "base" in r:
                key = r["case"] if rung == "c" else "overall"
                held = f"{_cell(r['base'][key])} -> {_cell(r['final'][key])} ({key})"
                if r.get("lift_error") is not None:
                    held += f", lift {r['lift']:+.3f} +- {r['lift_error']:.3f}"
            best = r.get("best_window")
            best = f"{best[0]:.3f} ({best[1]}-{best[2]})" if best else "-"
            extra = f" (rise {r['rise']:.3f} +- {r['rise_error']:.3f})" if rung == "a" and r.get("rise") is not None else ""
            lines.append(f"| {r['family']} | {r['case']} | {r['seed']} | {r['epochs']} | {_cell(r['first_reward'])} -> "
                         f"{_cell(r['last_reward'])}{extra} | {strict} | {best} | "
                         f"{r['epochs_to_strict_0.9'] or '-'} | {held} | "
                         f"{_cell(r['seconds_per_epoch'], 1)} | {'yes' if r['passed'] else 'no'} |")
    return "\n".join(lines)


def figures(rows, verdicts, results):
    """RESULTS/ladder_<rung>.png per rung that ran: training reward (top) and strict-correct (bottom, when logged)
    per epoch, a column per family, a colour per case, a line per seed. Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for rung in RUNGS:
        mine = [r for r in rows if r["rung"] == rung]
        if not mine:
            continue
        families = [f for f in FAMILIES if any(r["family"] == f for r in mine)]
        with_strict = any(r["strict_correct"] for r in mine)
        n_rows = 2 if with_strict else 1
        fig, axes = plt.subplots(n_rows, len(families), figsize=(5 * len(families), 3.2 * n_rows), squeeze=False)
        case_names = sorted({r["case"] for r in mine})
        colors = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(case_names)}
        for j, family in enumerate(families):
            for r in (r for r in mine if r["family"] == family):
                label = r["case"] if r["seed"] == min(x["seed"] for x in mine if x["case"] == r["case"]) else None
                axes[0][j].plot(range(len(r["reward"])), r["reward"], color=colors[r["case"]], alpha=0.8, label=label)
                if with_strict and r["strict_correct"]:
                    axes[1][j].plot(range(len(r["strict_correct"])), r["strict_correct"], color=colors[r["case"]],
                                    alpha=0.8)
            axes[0][j].set_title(f"rung {rung}, {family} ({verdict_word(verdicts[rung][family])})")
            axes[0][j].set_ylabel("training reward" if rung != "a" else "jpeg_incompressibility (kB)")
            axes[0][j].legend(fontsize=7)
            if with_strict:
                axes[1][j].axhline(TARGET, color="gray", linestyle=":")
                axes[1][j].set_ylim(-0.02, 1.02)
                axes[1][j].set_ylabel("strict-correct (training)")
            axes[-1][j].set_xlabel("epoch")
        fig.tight_layout()
        path = os.path.join(results, f"ladder_{rung}.png")
        tmp = path + ".tmp.png"
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        os.replace(tmp, path)
        paths.append(path)
    return paths


def final_checkpoint(run_dir):
    """The checkpoint finished.json names when it is still there, else the run's last checkpoint_N directory, or
    None."""
    from ddpo_group.runs.run_dir import CHECKPOINT_RE

    named = (_read_json(os.path.join(run_dir, FINISHED)) or {}).get("checkpoint")
    if isinstance(named, str) and os.path.isdir(named):
        return named
    base = os.path.join(run_dir, "checkpoints")
    names = [n for n in os.listdir(base) if CHECKPOINT_RE.match(n)] if os.path.isdir(base) else []
    return os.path.join(base, max(names, key=lambda n: int(n.split("_")[1]))) if names else None


def sample_record(model_args, record, count, sampler, workdir, label, seed=1234):
    """(images uint8 (count, H, W, 3), scripts/evaluate.py's rows) of one GenEval record: `count` images by
    scripts/evaluate.py (the shapes detector, `sampler`'s num_steps / guidance_scale / eta, eval seed `seed`), on
    one thread, its files in `workdir` under `label`. RuntimeError with evaluate.py's last line if it fails."""
    import subprocess

    import numpy as np
    from PIL import Image

    prompts = os.path.join(workdir, f"{label}.jsonl")
    with open(prompts, "w") as handle:
        handle.write(json.dumps(record) + "\n")
    folder, output = os.path.join(workdir, f"{label}_images"), os.path.join(workdir, f"{label}.json")
    command = [sys.executable, os.path.join(REPO_ROOT, "scripts", "evaluate.py"), *model_args, "--prompts", prompts,
               "--protocol", "geneval", "--protocol-option", "detector=shapes", "--images-per-prompt", str(count),
               "--num-steps", str(sampler["num_steps"]), "--guidance-scale", str(sampler["guidance_scale"]),
               "--eta", str(sampler["eta"]), "--seed", str(seed), "--output", output, "--save-images", folder]
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"scripts/evaluate.py failed on {record['prompt']!r} (exit {result.returncode}): {last}")
    rows = [json.loads(line) for line in open(output[:-len(".json")] + "_images.jsonl")]
    images = np.stack([np.asarray(Image.open(os.path.join(folder, "00000", "samples", f"{i:04d}.png")).convert("RGB"))
                       for i in range(count)])
    return images, rows


def sample_prompt(model_args, record, count, sampler, workdir, label):
    """(images uint8 (count, H, W, 3), strict verdicts) of one GenEval record at eval seed 1234 (sample_record)."""
    images, rows = sample_record(model_args, record, count, sampler, workdir, label)
    return images, [bool(r["strict_correct"]) for r in rows]


def sample_figure(rows, results, count):
    """RESULTS/ladder_b_samples.png and samples.json (module docstring, --samples); None when no rung-b run of the
    folder still has its final checkpoint."""
    import tempfile

    import numpy as np
    from PIL import Image, ImageDraw

    from ddpo_group.data import scenes

    records = {r["prompt"]: r for tag_records in scenes.training_records().values() for r in tag_records}
    panels, numbers = [], []
    for row in sorted((r for r in rows if r["rung"] == "b"), key=lambda r: (r["family"], r["case"], r["seed"])):
        run_dir = run_dir_of(results, "b", row["family"], row["case"], row["seed"])
        checkpoint = final_checkpoint(run_dir)
        document = _read_json(os.path.join(run_dir, CONFIG_FILE)) or {}
        config = document.get("config") or {}
        if checkpoint is None or row["prompt"] not in records:
            continue
        sampler = {key: (config.get("sample") or {}).get(key) for key in ("num_steps", "guidance_scale", "eta")}
        record = records[row["prompt"]]
        with tempfile.TemporaryDirectory() as work:
            base = sample_prompt(["--model", row["model"]], record, count, sampler, work, "base")
            final = sample_prompt(["--checkpoint", checkpoint], record, count, sampler, work, "final")
        panels.append((row, base, final))
        numbers.append({"family": row["family"], "case": row["case"], "seed": row["seed"], "prompt": row["prompt"],
                        "checkpoint": os.path.relpath(checkpoint, results), "images": count, "eval_seed": 1234,
                        **{f"{k}_strict": float(np.mean(v[1])) for k, v in (("base", base), ("final", final))}})
    if not panels:
        return None
    size = 2 * panels[0][1][0].shape[1]
    cell, label_h, title_h = size + 6, 14, 18
    width, height = 2 * count * cell + 30, len(panels) * (cell + label_h + title_h)
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    for k, (row, base, final) in enumerate(panels):
        top = k * (cell + label_h + title_h)
        draw.text((4, top + 3), f"{row['family']} / {row['case']} / seed {row['seed']}: \"{row['prompt']}\"   base "
                  f"{sum(base[1])}/{count} strict-correct (left), after {row['epochs']} epochs {sum(final[1])}/{count} "
                  "(right)", fill="black")
        for part, (images, verdicts) in enumerate((base, final)):
            for i in range(count):
                x = part * (count * cell + 30) + i * cell
                canvas.paste(Image.fromarray(images[i]).resize((size, size), Image.NEAREST), (x, top + title_h))
                draw.text((x + 2, top + title_h + size + 1), "correct" if verdicts[i] else "-", fill="black")
    path = os.path.join(results, "ladder_b_samples.png")
    tmp = path + ".tmp.png"
    canvas.save(tmp, optimize=True)
    os.replace(tmp, path)
    write_json(os.path.join(results, "samples.json"), {"runs": numbers, "command": "python benchmarks/scenes_ladder.py "
                                                                                  f"--collect --samples {count}"})
    return path


def write_outputs(results, argv, samples=0):
    rows, verdicts, metrics = collect(results)
    os.makedirs(results, exist_ok=True)
    command = "python benchmarks/scenes_ladder.py " + shlex.join(argv)
    # every command that wrote this folder, in order: a later --collect (or one more seed) keeps the commands
    # that trained its runs instead of replacing them
    before = _read_json(os.path.join(results, "summary.json")) or {}
    commands = list(before.get("commands") or ([before["command"]] if before.get("command") else []))
    if not commands or commands[-1] != command:
        commands.append(command)
    write_json(os.path.join(results, "summary.json"), {
        "runs": rows, "rungs": verdicts,
        "definitions": __doc__.split("Rungs (")[1].split("Cost.")[0].strip(),
        "command": command, "commands": commands,
    })
    write_json(os.path.join(results, "metrics.json.gz"), metrics, compress=True)
    figures(rows, verdicts, results)
    if samples:
        sample_figure(rows, results, samples)
    print(render(rows, verdicts))
    return rows, verdicts


def _list(text, allowed, what, parser):
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in allowed]
    if unknown or not items:
        parser.error(f"--{what} {text!r}: choose from {', '.join(allowed)}")
    return items


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rungs", default="a,b", help="comma-separated, of a, b, c, d (default a,b)")
    parser.add_argument("--families", default="flow,unet", help="flow (Flow-GRPO, tiny-scenes-sd3), unet "
                                                                "(GRPO + KL, tiny-scenes)")
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--epochs", type=int, default=0, help="training epochs of every run (0: the rung's: "
                        + ", ".join(f"{k} {v}" for k, v in DEFAULT_EPOCHS.items()) + ")")
    parser.add_argument("--images", type=int, default=0, help="images per epoch (0: the variants' 64; a multiple "
                                                              "of sample.batch_size)")
    parser.add_argument("--tag", default="colors", help="rung c's tag (default colors)")
    parser.add_argument("--draw", type=int, default=0, metavar="K",
                        help="rung b's prompts drawn with seed K, one per tag (default 0: RUNG_B_PROMPTS)")
    parser.add_argument("--cases", default="", help="only these cases of the rungs, comma-separated (rung b's: "
                        "its tags, e.g. two_object); default every case")
    parser.add_argument("--model-flow", default="", help="the flow base to train (default tiny-scenes-sd3)")
    parser.add_argument("--model-unet", default="", help="the UNet base to train (default tiny-scenes)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each)")
    parser.add_argument("--save-every", type=int, default=SAVE_EVERY, metavar="N",
                        help=f"a checkpoint every N epochs (default {SAVE_EVERY}; 0: at a run's end and when it is "
                             "stopped): an unfinished run goes on from its latest checkpoint")
    parser.add_argument("--results", default=DEFAULT_RESULTS)
    parser.add_argument("--collect", action="store_true", help="only build the tables, JSON and figures")
    parser.add_argument("--samples", type=int, default=0, metavar="N",
                        help="also sample N images of each rung-b prompt, base and final weights (ladder_b_samples.png)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field of every run (a JSON value; repeatable)")
    parser.add_argument("--run-one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        return run_one(json.loads(args.run_one), args.set)
    results = os.path.abspath(args.results)
    if args.samples < 0:
        parser.error(f"--samples {args.samples}: a number of images, 0 (none) or more")
    if args.draw < 0:
        parser.error(f"--draw {args.draw}: a seed, 0 (the ladder's own prompts) or more")
    if args.save_every < 0:
        parser.error(f"--save-every {args.save_every}: a number of epochs, 0 (at a run's end only) or more")
    if any(item.split("=")[0].strip() in ("save_freq", "num_checkpoint_limit") for item in args.set):
        parser.error("--set save_freq / num_checkpoint_limit: the ladder sets them; use --save-every")
    if not args.collect:
        from ddpo_group.config.registry import ConfigError
        from ddpo_group.data.prompts import load_config_prompts

        rungs = _list(args.rungs, RUNGS, "rungs", parser)
        families = _list(args.families, FAMILIES, "families", parser)
        if args.tag not in TAGS[1:]:
            parser.error(f"--tag {args.tag!r}: choose a tag with training prompts: {', '.join(TAGS[1:])}")
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            parser.error(f"--seeds {args.seeds!r}: comma-separated whole numbers, e.g. 42,43,44")
        known = {case for rung in rungs for case, _ in cases(rung, args.tag, args.draw)}
        only = set(_list(args.cases, sorted(known), "cases", parser)) if args.cases else known
        models = {"flow": args.model_flow, "unet": args.model_unet}
        for family, model in models.items():
            if model and (os.sep in model or model.startswith(".")) and not os.path.isdir(model):
                parser.error(f"--model-{family} {model!r}: no such directory (a model directory written by "
                             "`ddpo-group pretrain`, or a shipped model's name)")
        tasks, refused = [], []
        for rung in rungs:
            for family in families:
                for case, prompt in cases(rung, args.tag, args.draw):
                    if case not in only:
                        continue
                    for seed in seeds:
                        run_dir = run_dir_of(results, rung, family, case, seed)
                        spec = {"rung": rung, "family": family, "case": case, "prompt": prompt, "seed": seed,
                                "run_dir": run_dir, "epochs": args.epochs, "images": args.images,
                                "model": models[family], "save_every": args.save_every}
                        try:  # a misspelt field or a bad prompt is one line here, not a traceback in a run's log
                            config = ladder_config(**spec, overrides=args.set)
                            if not tasks:
                                load_config_prompts(config, "prompt_fn")
                        except ConfigError as err:
                            parser.error(str(err))
                        if os.path.exists(os.path.join(run_dir, FINISHED)):
                            done = _read_json(os.path.join(run_dir, CONFIG_FILE)) or {}
                            if not same_config(done.get("config"), config_document(config)):
                                refused.append(os.path.relpath(run_dir, results))
                            continue
                        tasks.append((f"{rung}/{family}/{case}/seed_{seed}",
                                      [sys.executable, os.path.abspath(__file__), "--run-one", json.dumps(spec)]
                                      + [f"--set={item}" for item in args.set], run_dir))
        # every other finished run of the folder too: the folder holds one ladder config (its epochs, images,
        # models and --set), so that --collect never reports runs of two configs as one ladder
        planned = {task[2] for task in tasks}
        for run_dir, done in finished_runs(results):
            if run_dir in planned or os.path.relpath(run_dir, results) in refused:
                continue
            spec = dict((done or {}).get("spec") or {}, run_dir=run_dir, epochs=args.epochs, images=args.images)
            try:
                same = done is not None and same_config(done.get("config"), config_document(
                    ladder_config(**dict(spec, model=models.get(spec.get("family"), "")), overrides=args.set)))
            except (ConfigError, TypeError, KeyError):
                same = False
            if not same:
                refused.append(os.path.relpath(run_dir, results))
        if refused:
            sys.exit(f"--results {args.results}: {len(refused)} finished run(s) there were trained with another "
                     f"config (first: {refused[0]}); give a new --results folder (finished runs are never overwritten)")
        codes = run_pool(tasks, args.jobs)
        failed = sorted(label for label, code in codes.items() if code)
    else:
        failed = []
    rows, verdicts = write_outputs(results, argv, args.samples)
    if failed:
        sys.exit(f"{len(failed)} run(s) failed (logs: {results}/runs/<rung>/<family>/<case>/seed_<s>.log): "
                 + ", ".join(failed))
    return rows, verdicts


if __name__ == "__main__":
    main()
