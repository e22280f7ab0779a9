"""Fixed-noise evaluation: the mean reward of a policy over a prompt set, comparable across epochs.

Image j of prompt i starts from noise drawn with a generator seeded by (seed, i, j) and draws its
step noise from the same generator, so two evaluations differ only by the weights (and neither
depends on how the prompts are batched or split over processes). Used by the trainer
(`eval_freq`) and by `ddpo-group evaluate` (ddpo_group/cli/evaluate.py).

    result = evaluate(policy, model, records, reward_fn, images_per_prompt=2, num_steps=10,
                      guidance_scale=3.0, eta=1.0, seed=1234, batch_size=32, accelerator=acc)
    result["reward_mean"], result["components"], result["per_prompt"], result["images"]

With an accelerator every process evaluates its share of the (prompt, image) pairs and the
results are gathered (every process gets the whole result); grid images stay on the main process.

The trainer's evaluation phase is an `Evaluator`: it evaluates the current weights on the config's
evaluation prompts into the epoch's metrics (eval/*) and writes the fixed grid samples/eval_XXXX.png with
samples/eval_XXXX.json (ddpo_group.runs.grids: each image's prompt, reward, prompt_index and image_index, and the
document's seed, prompts and (P, J) rewards). The final evaluation (the trainer's eval_only row, the final
weights) keeps the images of more prompts than the grid's (FINAL_IMAGE_PROMPTS, all of a small prompt set) and
marks its JSON "final": the report's best and worst samples come from it.
With `config.eval_rewards` it also scores the same images with those evaluation-only ("gold") rewards
(eval/gold/<name>_mean, _std) and flags the proxy rising while a gold falls (ddpo_group/evaluation/hacking.py).
"""

import logging
import os
import time

import numpy as np
import torch

from ddpo_group.config.registry import ConfigError, check_positive, register_config_check
from ddpo_group.data.prompts import load_config_prompts
from ddpo_group.data.edit_sources import reward_metadata, source_images
from ddpo_group.runs.grids import save_epoch_samples
from ddpo_group.evaluation.hacking import PROXY_KEY, describe, gold_key, gold_names, gold_specs
from ddpo_group.report.run import read_metrics
from ddpo_group.rewards import AsyncRewardRunner, build_reward_fn
from ddpo_group.rewards.base import with_audio
from ddpo_group.rewards.checks import check_reward_modality
from ddpo_group.rewards.registry import resolve_reward
from ddpo_group.training.rollout import SamplesNotFiniteError
from ddpo_group.runs.run_dir import METRICS_FILE

logger = logging.getLogger("ddpo_group")
# The final evaluation keeps the images of the first max(eval_grid_prompts, this many) prompts for the report (held
# in memory until they are written: 32 prompts x 2 images at 512 px are 200 MB of float32).
FINAL_IMAGE_PROMPTS = 32


def not_finite_error(records, pairs, finite):
    """SamplesNotFiniteError naming the first of `pairs` [(prompt index, image index)] whose image is not finite
    (`finite`: one bool per pair), or None when all are: an evaluation of diverged weights has no honest number."""
    bad = [pair for pair, ok in zip(pairs, finite) if not ok]
    if not bad:
        return None
    i, j = bad[0]
    return SamplesNotFiniteError(
        f"evaluation: {len(bad)} of {len(pairs)} sampled images are not finite (NaN or inf), the first image {j} of "
        f"prompt {i} {records[i].prompt!r}: the weights diverged (or a sampling setting is not finite); evaluate an "
        "earlier checkpoint of the run, or one trained with a lower train.learning_rate"
    )


def sample_generator(seed, prompt_index, image_index):
    """The generator of image `image_index` of prompt `prompt_index`: initial and step noise."""
    return torch.Generator().manual_seed(int(np.random.default_rng([seed, prompt_index, image_index]).integers(2**62)))


@torch.no_grad()
def evaluate(policy, model, records, reward_fn, images_per_prompt, num_steps, guidance_scale, eta, seed=1234,
             batch_size=32, accelerator=None, grid_prompts=0, should_stop=None, gold_fn=None, reward_timeout=None):
    """Rewards of `images_per_prompt` fixed-noise images of every prompt record.

    Args:
        policy: a DiffusionPolicy; model: the module to sample with (None: the policy's).
        records: PromptRecords; reward_fn: a CombinedReward (``build_reward_fn``).
        grid_prompts: keep the images of the first this many prompts (for a grid), on the main process.
        should_stop: a callable asked before each batch of a one-process evaluation, and while it waits for a
            batch's rewards; when it says True the evaluation ends there and returns None (a stop signal need
            not wait for the whole evaluation, nor for a reward that never returns).
        gold_fn: a CombinedReward of evaluation-only rewards (``gold_reward_fn``) that scores the same images;
            each of its components is one gold reward.
        reward_timeout: seconds a batch's reward (and gold reward) may take, else RewardError naming it and
            config.reward_timeout (None or 0: no limit); the rewards run in a daemon worker thread.

    Sampled images that are not finite (NaN or inf: diverged weights) stop the evaluation with a
    SamplesNotFiniteError naming the first (on every process, after the gather, when there are several).

    Returns: {"reward_mean", "reward_std", "components": {name: mean}, "per_prompt": (P,) means,
    "rewards": (P, J) array, "images": (k*J, 3, H, W) CPU tensor or None, "grid_prompts": their prompts,
    "gold": {name: (P, J) array} (empty without gold_fn), "info": {"<reward>/<key>": (P, J) array} of the
    rewards' per-image info numbers (the shapes world's colour, area, background, shape; scalars left out)}.
    """
    pairs = [(i, j) for i in range(len(records)) for j in range(images_per_prompt)]
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    scorers = [fn for fn in (reward_fn, gold_fn) if fn is not None]
    group_wise = any(getattr(fn, "group_wise_names", None) for fn in scorers)
    # a group-wise reward sees a prompt's images_per_prompt images in one call: all of a prompt's images are
    # sampled on one process then (the same images: their noise depends on (seed, i, j) only)
    if group_wise:
        mine = [pair for pair in pairs if pair[0] % world == rank]
        longest = images_per_prompt * -(-len(records) // world)
    else:
        mine = pairs[rank::world]
        longest = -(-len(pairs) // world)
    only = {"only": "per_image"} if group_wise else {}
    # Every process makes the same number of model calls of the same size (a sharded model all-gathers its
    # weights in each call): a shorter slice is padded with its last pair again, whose result is dropped.
    padded = mine + [mine[-1] if mine else pairs[0]] * (longest - len(mine))
    results, waiting = [], {}  # waiting: prompt index -> [(result row, image)] of a group not yet complete
    stop = should_stop if world == 1 else None  # several processes must all reach the gather

    def collect(start, chunk, images, finite, futures):
        """Wait for one batch's rewards (and gold rewards) and add its result rows; None when told to stop."""
        scored = _wait(runners[0], futures[0], reward_timeout, stop)
        gold = _wait(runners[1], futures[1], reward_timeout, stop) if futures[1] is not None else ({}, {})
        if scored is None or gold is None:
            return None
        total, components, info = scored
        gold = gold[1]
        per_image = {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in (info or {}).items()
                     if np.ndim(v) == 1 and len(v) == len(chunk) and np.issubdtype(np.asarray(v).dtype, np.number)}
        for n, (i, j) in enumerate(chunk):
            if start + n >= len(mine):
                break  # padding
            keep = images[n].clone() if i < grid_prompts else None  # a view would carry the whole batch in a gather
            row = [i, j, float(total[n]), {k: float(v[n]) for k, v in components.items()}, keep,
                   {k: float(v[n]) for k, v in gold.items()}, {k: float(v[n]) for k, v in per_image.items()},
                   finite[n]]
            results.append(row)
            if group_wise:
                waiting.setdefault(i, []).append((row, images[n]))
        for i in [i for i, members in waiting.items() if len(members) == images_per_prompt]:
            _score_group(records[i], waiting.pop(i), reward_fn, gold_fn)
        return True

    # The rewards of a batch run in a worker thread while the next batch samples (as in training's rollout); the
    # batches' rows are still added in order, so the result is the one-batch-at-a-time evaluation's.
    runners = [AsyncRewardRunner(fn, 1) if fn is not None else None for fn in (reward_fn, gold_fn)]
    pending = None  # the batch whose rewards are running: collect's arguments
    try:
        for start in range(0, len(padded), batch_size):
            if should_stop is not None and world == 1 and start > 0 and should_stop():
                return None  # several processes finish the evaluation: each must reach the gather below
            chunk = padded[start : start + batch_size]
            prompts = [records[i].prompt for i, _ in chunk]
            generators = [sample_generator(seed, i, j) for i, j in chunk]
            context = accelerator.autocast() if accelerator is not None else torch.autocast("cpu", enabled=False)
            sources = source_images([records[i] for i, _ in chunk], getattr(policy, "resolution", 0) or 0)
            extra = {"source_images": sources} if getattr(policy, "conditions_on_images", False) else {}
            with context:
                batch = policy.sample(prompts, num_steps, guidance_scale, eta, generator=generators, model=model, **extra)
            images = batch.images.float().cpu()
            finite = torch.isfinite(images.flatten(1)).all(dim=1).tolist()
            if world == 1 and not all(finite):  # before the rewards: a reward may fail on NaN or score it as black
                raise not_finite_error(records, chunk, finite)
            metadata = with_audio(reward_metadata([records[i].metadata for i, _ in chunk], sources), batch.audio,
                                  getattr(policy, "audio_sample_rate", None))
            # the previous batch's rewards ran while this one sampled: collected before this one is scored, so a stop
            # signal that came meanwhile ends the evaluation with no reward called on a batch after it
            if pending is not None and (collect(*pending) is None or (stop is not None and stop())):
                return None
            futures = [None if runner is None else runner.submit(images, prompts, metadata, **only) for runner in runners]
            pending = (start, chunk, images, finite, futures)
        if pending is not None and collect(*pending) is None:
            return None
    finally:
        for runner in runners:
            if runner is not None:
                runner.shutdown(wait=False)  # a reward that never returns is left in its daemon thread
    if accelerator is not None and world > 1:
        from accelerate.utils import gather_object

        results = gather_object(results)
    error = not_finite_error(records, [(row[0], row[1]) for row in results], [row[7] for row in results])
    if error is not None:  # every process holds every row now: all stop together
        raise error
    rewards = np.full((len(records), images_per_prompt), np.nan)
    component_sums = {}
    grid = {}
    gold, info = {}, {}
    for i, j, value, parts, image, gold_parts, info_parts, _ in results:
        rewards[i, j] = value
        for name, part in parts.items():
            component_sums.setdefault(name, []).append(part)
        for name, part in gold_parts.items():
            gold.setdefault(name, np.full((len(records), images_per_prompt), np.nan))[i, j] = part
        for name, part in info_parts.items():
            info.setdefault(name, np.full((len(records), images_per_prompt), np.nan))[i, j] = part
        if image is not None:
            grid[(i, j)] = image
    images = None
    if grid and (accelerator is None or accelerator.is_main_process):
        images = torch.stack([grid[key] for key in sorted(grid)])
    return {
        "reward_mean": float(np.mean(rewards)),
        "reward_std": float(np.std(rewards)),
        "components": {name: float(np.mean(values)) for name, values in component_sums.items()},
        "per_prompt": rewards.mean(axis=1),
        "rewards": rewards,
        "images": images,
        "grid_prompts": [records[i].prompt for i in range(min(grid_prompts, len(records)))],
        "gold": gold,
        "info": info,
    }


def _score_group(record, members, reward_fn, gold_fn):
    """Add the group-wise components of `reward_fn` and `gold_fn` to the result rows `members` [(row, image)] of
    one prompt's images: row[2] += w_k * r_k, row[3][k] = r_k (row[5][k] for gold)."""
    rows, images = zip(*members)
    images = torch.stack(images)
    prompts, metadata = [record.prompt] * len(rows), [record.metadata] * len(rows)
    for fn, slot in ((reward_fn, 3), (gold_fn, 5)):
        if fn is None or not getattr(fn, "group_wise_names", None):
            continue
        _, components, _ = fn(images, prompts, metadata, only="group_wise")
        for name, values in components.items():
            for row, value in zip(rows, values):
                row[slot][name] = float(value)
                if slot == 3:
                    row[2] += fn.weights[name] * float(value)


def _wait(runner, future, timeout, should_stop):
    """A submitted batch's reward, waited for at most `timeout` s (RewardError past it; None or 0: no limit) and
    until `should_stop()` says True (then None)."""
    if should_stop is None:
        return runner.result(future, timeout)
    return runner.result_or_stop(future, timeout, should_stop)


def _tag_of(record) -> dict:
    """{"tag": the record's tag} for a prompt record whose metadata has one (GenEval's), else {}."""
    tag = record.metadata.get("tag")
    return {"tag": tag} if isinstance(tag, str) else {}


def tag_table(records, info) -> dict:
    """A protocol's table by tag from an evaluation's per-image verdicts: for every reward info key
    "<reward>/correct" (the geneval reward's GenEval verdicts) and records whose metadata have a "tag",
    {"eval/<reward>/<tag>": fraction of the tag's images correct, "eval/<reward>/overall": the unweighted mean
    over the tags}, GenEval's table (summary_scores.py); {} when the records carry no tags."""
    tags = [record.metadata.get("tag") for record in records]
    if not any(isinstance(tag, str) for tag in tags):
        return {}
    table = {}
    for key, values in info.items():
        reward, _, field = key.rpartition("/")
        if field != "correct":
            continue
        scores = {}
        for tag in dict.fromkeys(t for t in tags if isinstance(t, str)):
            rows = [i for i, t in enumerate(tags) if t == tag]
            scores[tag] = float(np.mean(np.asarray(values)[rows]))
            table[f"eval/{reward}/{tag}"] = scores[tag]
        table[f"eval/{reward}/overall"] = float(np.mean(list(scores.values())))
    return table


def gold_reward_fn(eval_rewards, device=None, reward_frames=4):
    """The CombinedReward of the evaluation-only rewards of config.eval_rewards (None when it names none): one
    component per spec, named as training reward components are (the short name, the spec when two collide);
    on videos an image reward scores `reward_frames` frames per video (config.reward_frames)."""
    specs = gold_specs(eval_rewards)
    return build_reward_fn(None, {spec: 1.0 for spec in specs}, device=device, reward_frames=reward_frames) if specs else None


class Evaluator:
    """The trainer's fixed-noise evaluation (config.eval_*), the same prompts and noise at every epoch."""

    def __init__(self, config, accelerator, run_dir, prompts, reward_fn):
        """prompts: the training prompts, evaluated when config.eval_prompt_fn is empty."""
        self.config = config
        self.accelerator = accelerator
        self.run_dir = run_dir
        self.reward_fn = reward_fn
        # read now: a missing or empty file stops the run before it starts, naming the field
        self.prompts = load_config_prompts(config, "eval_prompt_fn") if config.eval_prompt_fn else prompts
        self.first = None  # (epoch, reward mean) of this process's first evaluation: the console's "since"
        # evaluation-only ("gold") rewards: built and loaded now, so a missing model fails before the first epoch
        self.gold_fn = gold_reward_fn(config.eval_rewards, device=accelerator.device, reward_frames=config.reward_frames)
        if self.gold_fn is not None:
            self.gold_fn.check_ready()
        self.history = None  # metrics of the run's evaluations so far (the divergence rule reads them)

    def __call__(self, epoch, metrics, policy, model, should_stop=None):
        """Evaluate `model` (the weights after `epoch` epochs) into `metrics`: eval/reward_mean, eval/reward_std,
        eval/<component>, eval/reward_info/<reward>/<key> (the mean of the rewards' per-image info numbers),
        eval/<reward>/<tag> and eval/<reward>/overall (GenEval's table of tagged prompts, ``tag_table``),
        eval/grid, time/eval, and per gold reward of config.eval_rewards eval/gold/<name>_mean,
        _std and _diverged; nothing when `should_stop` interrupted it (a stop signal)."""
        config, acc = self.config, self.accelerator
        start = time.perf_counter()
        final = bool(metrics.get("eval_only"))  # the final weights: every image kept for the report's best / worst
        result = evaluate(
            policy, model, self.prompts, self.reward_fn, config.eval_images_per_prompt, config.sample.num_steps,
            config.sample.guidance_scale, config.sample.eta, seed=config.eval_seed,
            batch_size=config.eval_batch_size or config.sample.batch_size, accelerator=acc,
            grid_prompts=max(config.eval_grid_prompts, FINAL_IMAGE_PROMPTS) if final else config.eval_grid_prompts,
            should_stop=should_stop, gold_fn=self.gold_fn, reward_timeout=config.reward_timeout,
        )
        if result is None:  # stopped by a signal between evaluation batches: no partial numbers are logged
            logger.warning("evaluation of epoch %d interrupted by a stop signal", epoch)
            return
        metrics["eval/reward_mean"] = result["reward_mean"]
        metrics["eval/reward_std"] = result["reward_std"]
        for name, value in result["components"].items():
            metrics[f"eval/{name}"] = value
        for name, values in result["info"].items():
            metrics[f"eval/reward_info/{name}"] = float(np.nanmean(values))
        metrics.update(tag_table(self.prompts, result["info"]))
        for name, values in result["gold"].items():
            metrics[gold_key(name)] = float(np.mean(values))
            metrics[gold_key(name, "std")] = float(np.std(values))
        announce = self._divergence(epoch, metrics) if result["gold"] else []
        if acc.is_main_process and result["images"] is not None:
            per_image, kept = config.eval_images_per_prompt, len(result["grid_prompts"])
            grid = save_epoch_samples(
                self.run_dir.path, epoch, result["images"], [p for p in result["grid_prompts"] for _ in range(per_image)],
                result["rewards"][:kept].reshape(-1), None, per_image, max_rows=min(kept, config.eval_grid_prompts),
                prefix="eval", record_fields=[{"prompt_index": i, "image_index": j, **_tag_of(self.prompts[i])}
                                             for i in range(kept) for j in range(per_image)],
                extra={"final": final, "seed": config.eval_seed, "prompts": [r.prompt for r in self.prompts],
                       "rewards": result["rewards"].tolist(),
                       # per prompt and image, the rewards' info numbers: the report's per-prompt components
                       "reward_info": {name: [[v if np.isfinite(v) else None for v in row] for row in values.tolist()]
                                       for name, values in result["info"].items()}},
                sources=source_images([r for r in self.prompts[:kept] for _ in range(per_image)]),  # editing: source -> edited
            )
            if grid is not None:
                metrics["eval/grid"] = os.path.relpath(grid, self.run_dir.path)
        metrics["time/eval"] = time.perf_counter() - start
        self.first = self.first or (epoch, result["reward_mean"])
        if acc.is_main_process:
            components = result["components"] if len(result["components"]) > 1 else {}  # one is the reward itself
            logger.info(
                "eval epoch %d: reward %.4f ± %.4f (%+.4f since epoch %d)%s%s", epoch, result["reward_mean"],
                result["reward_std"], result["reward_mean"] - self.first[1], self.first[0],
                "".join(f", {name} {value:.4f}" for name, value in components.items()),
                "".join(f", gold {name} {metrics[gold_key(name)]:.4f} ({self._gold_change(name, metrics):+.4f})"
                        for name in result["gold"]),
            )
            for line in announce:
                logger.warning(line)

    def _earlier_evaluations(self, epoch):
        """The evaluation rows of this run before `epoch` (a resumed run's are in its metrics.jsonl)."""
        path = self.run_dir.file(METRICS_FILE)
        if not os.path.exists(path):
            return []
        # a torn last line of an interrupted run is left out (the resume has checked the other lines)
        return [row for row in read_metrics(path, torn=[]) if PROXY_KEY in row and row.get("epoch", epoch) < epoch]

    def _gold_change(self, name, metrics):
        gold = describe(self.history, name)["gold"]  # the history holds this evaluation already (_divergence)
        return gold[-1] - gold[0]

    def _divergence(self, epoch, metrics):
        """Apply the divergence rule (ddpo_group/evaluation/hacking.py) to the evaluations so far and this one: writes
        eval/gold/<name>_diverged (1.0 / 0.0) into `metrics`; returns the console lines of first divergences (the
        rule reads means only, so an earlier divergence, a resumed run's too, shows in the earlier flags)."""
        if self.history is None:
            self.history = self._earlier_evaluations(epoch)
        rows, lines = self.history + [metrics], []
        for name in gold_names([metrics]):
            d = describe(rows, name)
            metrics[gold_key(name, "diverged")] = float(d["flags"][-1])
            if d["flags"][-1] and not any(d["flags"][:-1]):
                lines.append(
                    f"reward hacking? at epoch {epoch} the training reward rose {d['rise']:+.4f} since "
                    f"epoch {d['epochs'][0]:g} while gold {name} fell {d['fall']:.4f} below its best "
                    f"(epoch {d['peak_epoch']:g}); {gold_key(name, 'diverged')}=1; ddpo-group-inspect draws both"
                )
        self.history.append({k: v for k, v in metrics.items() if k.startswith("eval/") or k == "epoch"})
        return lines


# The fixed evaluation draws this many images per prompt at most, at every evaluation.
MAX_EVAL_IMAGES_PER_PROMPT = 1024


@register_config_check("evaluation")
def check_evaluation(config, machine):
    """The fixed-noise evaluation's fields: how often, how many images, the grid, the batch."""
    check_positive(config.eval_freq, "eval_freq", allow_zero=True)
    check_positive(config.eval_images_per_prompt, "eval_images_per_prompt")
    if config.eval_images_per_prompt > MAX_EVAL_IMAGES_PER_PROMPT:
        raise ConfigError(
            f"config.eval_images_per_prompt={config.eval_images_per_prompt}: every evaluation would draw that many "
            f"images for each prompt; use at most {MAX_EVAL_IMAGES_PER_PROMPT} (the standard error of a mean over "
            "1024 rewards in [0, 1] is below 0.016), or score a checkpoint once with "
            "ddpo-group evaluate --checkpoint RUN_DIR"
        )
    check_positive(config.eval_grid_prompts, "eval_grid_prompts", allow_zero=True)
    check_positive(config.eval_batch_size, "eval_batch_size", allow_zero=True)


@register_config_check("evaluation")
def check_eval_rewards(config, machine):
    """config.eval_rewards: comma-separated reward specs that resolve, scored at evaluations (eval_freq > 0)."""
    specs = gold_specs(config.eval_rewards)
    if specs and not config.eval_freq:
        raise ConfigError(
            f"config.eval_rewards={config.eval_rewards!r} is scored at the fixed-noise evaluations, and "
            "config.eval_freq=0 runs none: set config.eval_freq (e.g. 10), or config.eval_rewards=''"
        )
    for spec in specs:
        try:
            resolve_reward(spec)
        except Exception as err:  # an unknown name, a missing file or module, an error importing it
            raise ConfigError(f"config.eval_rewards: {err}") from err
    check_reward_modality(config, specs, "eval_rewards")
