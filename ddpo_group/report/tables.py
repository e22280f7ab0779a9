"""The report's tables: the headline (status, variant, algorithm, model, rewards, epochs, wall time, final and
best evaluation), the summary (first vs last evaluation, 5-epoch windows), the config, and the choice of the
prompts whose samples are shown.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any, Sequence

from ddpo_group.report.markup import LEFT_OUT, esc, fmt
from ddpo_group.report.run import (
    RunData,
    SMOOTHING,
    SampleSource,
    config_value,
    evaluation_rows,
    finite,
    mean_reward_by_prompt,
    metric_series,
    read_json,
    sample_source,
    trained_epochs,
    wall_time,
)

def rank_prompts(source: SampleSource, num_prompts: int) -> list[str]:
    order = list(dict.fromkeys(record["prompt"] for record in source.records))
    last_means = mean_reward_by_prompt(source.records)
    first_means = source.first_means

    def rank(item: tuple[int, str]):
        position, prompt = item
        if prompt in first_means and prompt in last_means:
            return (0, -abs(last_means[prompt] - first_means[prompt]), position)
        return (1, 0.0, position)

    return [prompt for _, prompt in sorted(enumerate(order), key=rank)[:num_prompts]]


def choose_prompts(run: RunData, num_prompts: int = 3) -> list[str]:
    """The `num_prompts` prompts of the run's best / worst samples (`sample_source`) whose mean reward changed most.

    change(p) = |mean reward of p there - mean reward of p at the start| (the first evaluation, or the first
    sample epoch); prompts absent from the start rank after, by first appearance.
    """
    source = sample_source(run)
    return [] if source is None else rank_prompts(source, num_prompts)


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(config, dict):
        return {prefix: config}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_section(runs: Sequence[RunData]) -> str:
    parts = ["<h2>Config</h2>"]
    if len(runs) == 2 and all(run.config is not None for run in runs):
        flat = [_flatten(run.config) for run in runs]
        keys = sorted(set(flat[0]) | set(flat[1]))
        differ = [k for k in keys if flat[0].get(k, "<absent>") != flat[1].get(k, "<absent>")]
        rows = "".join(
            f"<tr><td>{esc(k)}</td><td>{esc(flat[0].get(k, '<absent>'))}</td><td>{esc(flat[1].get(k, '<absent>'))}</td></tr>"
            for k in differ
        )
        parts.append(
            f"<h3>Differences ({len(differ)})</h3><table><tr><th>key</th><th>{esc(runs[0].name)}</th>"
            f"<th>{esc(runs[1].name)}</th></tr>{rows}</table>"
        )
    cells = []
    for run in runs:
        body = (
            f"<pre>{esc(json.dumps(run.config, indent=2, sort_keys=True, default=str))}</pre>"
            if run.config is not None
            else f"<p>no config.json in {esc(run.path)}</p>"
        )
        cells.append(f'<div class="half"><details><summary>{esc(run.name)}: config.json</summary>{body}</details></div>')
    parts.append(f'<div class="halves">{"".join(cells)}</div>')
    return "\n".join(parts)


def duration(seconds: float) -> str:
    """'42.5 s', '5 min 25 s', '2 h 03 min'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def run_status(run: RunData) -> tuple[str, str]:
    """(css class, sentence): failed (failed.json's reason), stopped (stopped.json), incomplete, or finished."""
    done, planned = trained_epochs(run), config_value(run.config, "num_epochs")
    if run.failed is not None:
        failed = run.failed
        where = f" at epoch {failed['epoch']}" if "epoch" in failed else ""
        when = f" ({failed['time']})" if failed.get("time") else ""
        return "failed", f"FAILED{where}: {failed.get('error', 'no reason recorded')}{when} (failed.json)"
    if run.stopped is not None:
        stopped = run.stopped
        resume = stopped.get("resume") or f"--config.resume_from={shlex.quote(str(run.path))}"
        return "stopped", (f"stopped by signal {stopped.get('signal')} after epoch {stopped.get('epoch')} "
                           f"(stopped.json); resume with {resume}")
    if isinstance(planned, int) and done < planned:
        return "incomplete", (f"incomplete: {done} of {planned} epochs logged and no failed.json or stopped.json "
                              "(still running, or killed before it could say so)")
    return "ok", f"finished: {done} of {planned} epochs" if isinstance(planned, int) else f"{done} epochs logged"


def headline(run: RunData, source: SampleSource | None) -> list[tuple[str, str]]:
    """The headline's (field, value) pairs of one run, from its config.json, metrics.jsonl and end markers."""
    config = run.config
    if config is None:
        fields = ["variant", "algorithm", "model", "reward(s)", "prompt set", "seed"]
        values = dict.fromkeys(fields, "not recorded (no config.json)")
    else:
        variant = config.get("variant")
        values = {"variant": variant if variant else (
            "not recorded (config.json from before the variant was kept)" if variant is None
            else "none: a config file of the user's own")}
        estimator, objective = config_value(config, "algorithm.adv_estimator", "?"), config_value(config, "train.objective", "stepwise")
        algorithm = [f"{objective} (forward process), advantages {estimator}" if objective not in (None, "stepwise")
                     else f"{estimator}, policy loss {config_value(config, 'train.policy_loss', '?')}"]
        if config_value(config, "train.use_kl_loss"):
            algorithm.append(f"KL {config_value(config, 'train.kl_type', '')} beta {config_value(config, 'train.beta')}")
        values["algorithm"] = ", ".join(algorithm)
        model = str(config_value(config, "pretrained.model", "?"))
        if config_value(config, "pretrained.revision"):
            model += f" @ {config_value(config, 'pretrained.revision')}"
        model += f", LoRA r{config_value(config, 'lora_rank')}" if config_value(config, "use_lora") else ", full fine-tune"
        values["model"] = model
        rewards = str(config_value(config, "reward_fn", "?"))
        weights = config_value(config, "reward_weights") or {}
        if isinstance(weights, dict) and weights:
            rewards += " (" + ", ".join(f"{k} x {v}" for k, v in weights.items()) + f"; {config_value(config, 'reward_aggregation')})"
        values["reward(s)"] = rewards
        eval_prompts = config_value(config, "eval_prompt_fn") or "the training prompts"
        values["prompt set"] = f"{config_value(config, 'prompt_fn', '?')}; evaluation: {eval_prompts}"
        values["seed"] = f"{config_value(config, 'seed')} (evaluation noise {config_value(config, 'eval_seed')})"
    planned = config_value(config, "num_epochs")
    values["epochs"] = f"{trained_epochs(run)} of {planned}" if planned is not None else f"{trained_epochs(run)}"
    seconds = wall_time(run)
    values["wall time"] = f"{duration(seconds)} in the logged phases" if seconds else "not logged"
    evals = evaluation_rows(run)
    finals = [e for e in evals if e[2]]
    if finals:
        epoch, value, _ = finals[-1]
        start = f"; {evals[0][1]:.4f} after {evals[0][0]:g} epochs" if evals[0] is not finals[-1] else ""
        values["final eval"] = f"{value:.4f} (the final weights, after {epoch:g} epochs{start})"
    elif evals:
        epoch, value, _ = evals[-1]
        values["final eval"] = f"none (no evaluation of the final weights); the last: {value:.4f} after {epoch:g} epochs"
    else:
        values["final eval"] = "no evaluation logged (config.eval_freq=0)"
    if evals:
        epoch, value, _ = max(evals, key=lambda e: e[1])
        values["best eval"] = f"{value:.4f} (after {epoch:g} epochs)"
    else:
        values["best eval"] = ""
    values["samples shown"] = source.short if source is not None else "none (no sample records)"
    order = ["variant", "algorithm", "model", "reward(s)", "prompt set", "epochs", "wall time", "seed", "final eval",
             "best eval", "samples shown"]
    return [(key, values.get(key, "")) for key in order]


def headline_section(runs: Sequence[RunData], sources: Sequence[SampleSource | None]) -> str:
    statuses = [run_status(run) for run in runs]
    banners = "".join(
        f'<p class="status {cls}">{esc(run.name + ": " if len(runs) > 1 else "")}{esc(text)}</p>'
        for run, (cls, text) in zip(runs, statuses)
    )
    for run in runs:
        for resume in run.resumes:
            failure = resume.get("previous_failure")
            if isinstance(failure, dict):
                banners += (f'<p class="status earlier">{esc(run.name)}: resumed at epoch {esc(resume.get("epoch"))} '
                            f'after a failure at epoch {esc(failure.get("epoch"))}: {esc(failure.get("error"))}</p>')
        if run.torn_metrics_line:
            banners += (f'<p class="status earlier">{esc(run.name)}: metrics.jsonl line {run.torn_metrics_line}, its last, '
                        "was cut off mid-write (the run was killed while writing it) and is left out</p>")
        if run.outside:
            banners += (f'<p class="status earlier">{esc(run.name)}: left out, links to files outside the run directory '
                        f'(the report reads the run\'s own files only): {esc(", ".join(run.outside))}</p>')
        for item in run.malformed:
            banners += f'<p class="status earlier">{esc(run.name)}: left out: {esc(item)}</p>'
    fields = [headline(run, source) for run, source in zip(runs, sources)]
    header = f'<tr><th></th>{"".join(f"<th>{esc(run.name)}</th>" for run in runs)}</tr>' if len(runs) > 1 else ""
    rows = "".join(
        f"<tr><th>{esc(key)}</th>" + "".join(f"<td>{esc(f[row][1])}</td>" for f in fields) + "</tr>"
        for row, (key, _) in enumerate(fields[0])
    )
    # the cost, right under the headline: what an epoch costs, and (compare mode) the time to a common target
    cost = [("cost per epoch", [cost_text(run) for run in runs])]
    target = target_row(runs) if len(runs) == 2 else None
    cost += [target] if target is not None else []
    cost_rows = "".join(f"<tr><th>{esc(key)}</th>" + "".join(f"<td>{esc(cell)}</td>" for cell in cells) + "</tr>"
                        for key, cells in cost)
    note = ("<p class=\"small\">wall time: the sum of the logged phases (time/sample, time/reward, time/advantages, "
            "time/train, time/critic, time/eval) over every epoch, resumes included; model loading and checkpoints "
            "are not in it.</p>")
    return (f'{banners}<table class="headline">{header}{rows}</table><table class="headline cost">{header}{cost_rows}'
            f"</table>{note}{LEFT_OUT}")


def _window_mean(values: Sequence[float], first: bool) -> str:
    if not values:
        return ""
    part = values[:SMOOTHING] if first else values[-SMOOTHING:]
    return f"{sum(part) / len(part):.4f}"


def summary_section(runs: Sequence[RunData]) -> str:
    """First vs last evaluation and first vs last SMOOTHING-epoch windows: single epochs are noise."""
    header = "".join(f"<th>{esc(run.name)} first</th><th>{esc(run.name)} last</th>" for run in runs)
    rows = []
    for key, label in (("eval/reward_mean", "eval/reward_mean (first vs last evaluation)"),):
        values = []
        for run in runs:
            logged = metric_series(run.metrics, key)[1]
            values += [fmt(logged[0]) if logged else "", fmt(logged[-1]) if logged else ""]
        if any(values):
            rows.append(f"<tr><td>{esc(label)}</td>" + "".join(f"<td>{esc(v)}</td>" for v in values) + "</tr>")
    for key in ("reward_mean", "kl", "loss"):
        values = []
        for run in runs:
            logged = metric_series(run.metrics, key)[1]
            values += [_window_mean(logged, True), _window_mean(logged, False)]
        if any(values):
            label = f"{key} (mean of the first / last {SMOOTHING} epochs)"
            rows.append(f"<tr><td>{esc(label)}</td>" + "".join(f"<td>{esc(v)}</td>" for v in values) + "</tr>")
    counts = ", ".join(f"{esc(run.name)}: {len(run.metrics)} rows" for run in runs)
    table = f"<table><tr><th>metric</th>{header}</tr>{''.join(rows)}</table>"
    return f"<h2>Summary</h2><p>metrics.jsonl: {counts}</p>{table}" + _legacy_summary(runs)


def _legacy_summary(runs: Sequence[RunData]) -> str:
    keys = ["epoch", "global_step", "num_processes", "num_samples", "reward_mean", "reward_std", "kl", "loss"]
    header = "".join(f"<th>{esc(run.name)} first</th><th>{esc(run.name)} last</th>" for run in runs)
    rows = []
    for key in keys:
        values = []
        for run in runs:
            logged = [row[key] for row in run.metrics if key in row]
            values += [fmt(logged[0]) if logged else "", fmt(logged[-1]) if logged else ""]
        if any(values):
            rows.append(f"<tr><td>{esc(key)}</td>" + "".join(f"<td>{esc(v)}</td>" for v in values) + "</tr>")
    return f"<details><summary>first and last single rows</summary><table><tr><th>metric</th>{header}</tr>{''.join(rows)}</table></details>"


@dataclass
class PromptChange:
    """One evaluation prompt from the run's first to its last evaluation (the same noise in both)."""

    index: int  # the prompt's place in the evaluation's prompt list
    prompt: str
    start: float | None  # mean reward over the prompt's images at the first evaluation
    end: float  # ... at the last
    components: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # info key -> (start, end)

    @property
    def change(self) -> float | None:
        return None if self.start is None else self.end - self.start


def _row_means(rows: Any) -> list[float | None]:
    """Mean of each row of a (P, J) list of lists over its finite numbers (None for a row without one)."""
    means = []
    for row in rows if isinstance(rows, list) else []:
        values = [finite(v) for v in (row if isinstance(row, list) else [])]
        values = [v for v in values if v is not None]
        means.append(sum(values) / len(values) if values else None)
    return means


def prompt_changes(run: RunData) -> tuple[int, int, list[PromptChange]] | None:
    """(first epoch, last epoch, one PromptChange per prompt) from samples/eval_XXXX.json's (P, J) "rewards" (and
    "reward_info" when stored) of the first and the last evaluation, sorted by change, the most regressed first
    (prompts without a start last). change = mean_j r[p, j] at the last - mean_j r[p, j] at the first.
    None when the run has no evaluation file with per-prompt rewards."""
    if not run.eval_files:
        return None
    first, last = min(run.eval_files), max(run.eval_files)
    end_doc = read_json(run.eval_files[last])
    start_doc = read_json(run.eval_files[first]) if first != last else {}
    end_doc, start_doc = (d if isinstance(d, dict) else {} for d in (end_doc, start_doc))
    prompts = end_doc.get("prompts")
    end_means = _row_means(end_doc.get("rewards"))
    if not isinstance(prompts, list) or len(prompts) != len(end_means):
        return None
    same_list = start_doc.get("prompts") == prompts
    start_means = _row_means(start_doc.get("rewards")) if same_list else [None] * len(prompts)
    info_end = end_doc.get("reward_info") if isinstance(end_doc.get("reward_info"), dict) else {}
    info_start = start_doc.get("reward_info") if same_list and isinstance(start_doc.get("reward_info"), dict) else {}
    components = {key: (_row_means(info_start.get(key)), _row_means(values)) for key, values in info_end.items()}
    changes = []
    for i, (prompt, end) in enumerate(zip(prompts, end_means)):
        if end is None:
            continue
        parts = {key: (s[i] if i < len(s) else None, e[i] if i < len(e) else None) for key, (s, e) in components.items()}
        changes.append(PromptChange(i, str(prompt), start_means[i] if i < len(start_means) else None, end, parts))
    changes.sort(key=lambda c: (c.change is None, c.change if c.change is not None else 0.0, c.index))
    return first, last, changes


def _signed(value: float | None) -> str:
    return "" if value is None else f"{value:+.3f}"


def prompt_table(first: int, last: int, changes: Sequence[PromptChange]) -> str:
    """The per-prompt evaluation table: prompt, start, end, change, and each reward component start -> end."""
    keys = sorted({key for change in changes for key in change.components})
    header = ("<tr><th>#</th><th>prompt</th><th>after " + esc(first) + "</th><th>after " + esc(last)
              + "</th><th>change</th>" + "".join(f"<th>{esc(key)}</th>" for key in keys) + "</tr>")
    rows = []
    for change in changes:
        delta = change.change
        css = "" if delta is None else (' class="worse"' if delta < 0 else ' class="better"' if delta > 0 else "")
        cells = [esc(change.index), esc(change.prompt), fmt(change.start), fmt(change.end), _signed(delta)]
        for key in keys:
            start, end = change.components.get(key, (None, None))
            cells.append("" if end is None else (f"{start:.2f} &rarr; {end:.2f}" if start is not None else f"{end:.2f}"))
        rows.append(f"<tr{css}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f'<div class="scroll"><table class="prompts">{header}{"".join(rows)}</table></div>'


TRAINING_PHASES = ("time/sample", "time/reward", "time/advantages", "time/train", "time/critic")


def training_seconds(row: dict) -> float:
    """Seconds of one epoch's training phases (sampling, rewards, advantages, training, critic; not evaluation)."""
    return sum(finite(row.get(key)) or 0.0 for key in TRAINING_PHASES)


def cost_text(run: RunData) -> str:
    """'6.1 s of training, 96 model calls (train/unet_calls)': means over the training rows that logged them."""
    rows = [row for row in run.metrics if not row.get("eval_only")]
    seconds = [training_seconds(row) for row in rows if any(key in row for key in TRAINING_PHASES)]
    calls = [finite(row.get("train/unet_calls")) for row in rows]
    calls = [c for c in calls if c is not None]
    parts = []
    if seconds:
        parts.append(f"{sum(seconds) / len(seconds):.1f} s of training (sample, reward, advantages, train, critic)")
    if calls:
        parts.append(f"{sum(calls) / len(calls):.0f} training calls of the denoising model (train/unet_calls)")
    return "; ".join(parts) if parts else "not logged"


def seconds_to(run: RunData, target: float) -> tuple[float, float] | None:
    """(seconds, epoch) at the first evaluation with eval/reward_mean >= target: the logged training and evaluation
    seconds of the rows up to and including it; None when no evaluation reaches it."""
    total = 0.0
    for i, row in enumerate(run.metrics):
        total += training_seconds(row) + (finite(row.get("time/eval")) or 0.0)
        value = finite(row.get("eval/reward_mean"))
        if value is not None and value >= target:
            epoch = finite(row.get("epoch"))
            return total, (i if epoch is None else epoch)
    return None


def target_row(runs: Sequence[RunData]) -> tuple[str, list[str]] | None:
    """Compare mode's headline row: seconds to the target evaluation, the lower of the two runs' best
    eval/reward_mean after their first evaluation (so that both reach it), when that is above both first
    evaluations; a row saying why there is none otherwise; None without evaluations in both runs."""
    rows = [evaluation_rows(run) for run in runs]
    if any(not r for r in rows):
        return None
    later = [max((v for _, v, _ in r[1:]), default=None) for r in rows]
    starts = [r[0][1] for r in rows]
    risen = [b is not None and b > s for b, s in zip(later, starts)]
    if not all(risen):
        return "seconds to a common target", [
            "rose above its first evaluation" if up else "never rose above its first evaluation: no common target"
            for up in risen]
    target = min(later)
    cells = []
    for run in runs:
        reached = seconds_to(run, target)
        cells.append("not reached" if reached is None else f"{reached[0]:.0f} s (evaluation after {reached[1]:g} epochs)")
    return f"seconds to eval >= {target:.4f} (the lower best)", cells


def kl_note(runs: Sequence[RunData]) -> str:
    """What the `kl` curve is, from each run's config; in compare mode whether the two are like with like."""
    described = []
    for run in runs:
        if not config_value(run.config, "train.use_reference_model") or not any("kl" in row for row in run.metrics):
            continue
        mode = config_value(run.config, "train.loss_agg_mode", "token-mean")
        kind = config_value(run.config, "train.kl_type", "?")
        what = {"token-mean": "the mean over the trained (trajectory, step) pairs",
                "seq-mean-token-sum": "the sum over each trajectory's trained steps, averaged over trajectories",
                "seq-mean-token-mean": "the mean over each trajectory's trained steps, averaged over trajectories",
                "seq-mean-token-sum-norm": "the sum over (trajectory, step) pairs divided by the number of steps",
                }.get(mode, f"aggregated by {mode}")
        kinds = {"gaussian": "the exact KL of the two Gaussian steps, (mu_theta - mu_ref)^2 / (2 sigma_t^2) averaged "
                             "over pixels"}
        described.append((run.name, mode, f"{what} of {kinds.get(kind, f'the {kind} estimate')} to the reference model"))
    if not described:
        return ""
    prefix = lambda name: f"{name}: " if len(runs) > 1 else ""  # noqa: E731
    text = "kl: " + "; ".join(f"{prefix(name)}{what}" for name, _, what in described)
    text += " (steps/kl in the per-step view splits it by step)"
    if len(runs) == 2:
        if len(described) == 2 and described[0][1] == described[1][1] == "token-mean":
            text += "; both are per trained step, so the two kl curves compare like with like"
        elif len(described) == 2:
            text += "; the runs aggregate it differently, so their kl curves are not comparable: compare steps/kl"
        else:
            text += "; only one run has a reference model"
    return text
