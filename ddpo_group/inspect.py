"""Run inspection: one self-contained HTML report for a run directory (or two, side by side).

The report opens with a headline (status, and failed.json's reason when the run failed; variant, algorithm,
model, rewards, prompt set, epochs, wall time, seed, final and best evaluation), then a summary that compares
evaluations and 5-epoch windows (single epochs are noise); the fixed-noise evaluation curve beside the
smoothed training reward with the fixed evaluation grids (first, middle, last; in compare mode a table whose
cell holds both runs' image of the same prompt and the same noise) and scripts/evaluate.py's evaluation.json
results; for a few prompts the best and worst samples of the final weights (the run's final evaluation,
samples/eval_XXXX.json marked "final"; runs without one: the last logged epoch's samples, and the report says
so); reward curves, kl / loss / clipfrac and the other scalar metrics, the time per phase, the per-step heat
maps, the run's config, and the per-epoch sample grids.

Every image is embedded as a base64 data URI, so the single .html file can be moved and opened anywhere, up to
a size cap (`max_bytes`, MAX_REPORT_BYTES by default): past it the per-epoch sample grids are thinned evenly
(the first and the last kept) and what is left out is linked (paths relative to the report) and counted at
the top of the report. Images are shown at their own size or larger (never shrunk more than 2x).

A run directory is what the trainer writes (docs/CONTRACTS.md, "run directory"):

    run_dir/metrics.jsonl          one JSON object per epoch (required, unless the run failed or stopped before it)
    run_dir/config.json            the run's config (optional)
    run_dir/failed.json, stopped.json, resumes.jsonl    how the run ended, its resumes (optional)
    run_dir/samples/epoch_XXXX.png / .json / epoch_XXXX/NNN.png   (ddpo_group.grids, optional)
    run_dir/samples/eval_XXXX.png / .json / eval_XXXX/NNN.png     (ddpo_group.evaluation, optional)

Entry point: `ddpo-group-inspect` / scripts/inspect_run.py (ddpo_group.cli.inspect_main).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
import textwrap
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ddpo_group.hacking import hacking_section

RUN_DIR_HELP = (
    "expected a run directory written by the trainer (logdir/run_name) containing metrics.jsonl "
    "(one JSON object per epoch), and optionally config.json and samples/"
)
# Panels after the reward panels, in this order, when the key was logged.
SCALAR_KEYS = ("kl", "approx_kl", "clipfrac", "loss")
SCALAR_PREFIXES = ("group/", "tracker/", "critic/")
TIME_KEYS = ("time/sample", "time/reward", "time/train")
# The phases of an epoch that do not overlap (time/old_log_probs is part of time/train): their sum is the
# headline's wall time.
PHASE_KEYS = ("time/sample", "time/reward", "time/advantages", "time/train", "time/critic", "time/eval")
RUN_STYLES = ("-", "--")
RUN_COLORS = ("tab:blue", "tab:orange")
_SAMPLE_JSON = re.compile(r"^epoch_(\d+)\.json$")
_SAMPLE_PNG = re.compile(r"^epoch_(\d+)\.png$")
_EVAL_PNG = re.compile(r"^eval_(\d+)\.png$")
_EVAL_JSON = re.compile(r"^eval_(\d+)\.json$")
SMOOTHING = 5  # epochs in the training reward's moving average and in the summary's windows
# The report's size cap: 8 MB of HTML. A 5000-epoch run's grids would make it 150 MB or more; past the cap the
# sample grids are thinned evenly and the rest linked. Everything else (plots, evaluation, best and worst) comes first.
MAX_REPORT_BYTES = 8 * 2**20
TEXT_RESERVE = 256 * 2**10  # room kept for the report's text when the images of the early sections are embedded
COMPARE_PROMPTS = 8  # prompts in compare mode's paired evaluation table
MIN_SHOWN_WIDTH = 96  # a sample image narrower than this is enlarged (nearest neighbour) by an integer factor
MAX_SHOWN_WIDTH = 384  # a wider one is shown at max(this, half its width): never shrunk more than 2x


@dataclass
class RunData:
    """What the report reads from one run directory."""

    path: Path
    config: dict | None
    metrics: list[dict]
    grids: dict[int, Path] = field(default_factory=dict)  # epoch -> samples/epoch_XXXX.png
    sample_files: dict[int, Path] = field(default_factory=dict)  # epoch -> samples/epoch_XXXX.json
    eval_grids: dict[int, Path] = field(default_factory=dict)  # epoch -> samples/eval_XXXX.png
    eval_files: dict[int, Path] = field(default_factory=dict)  # epoch -> samples/eval_XXXX.json
    evaluations: dict[str, dict] = field(default_factory=dict)  # checkpoint name -> its evaluation.json
    failed: dict | None = None  # failed.json: the run stopped on an error
    stopped: dict | None = None  # stopped.json: a signal stopped the run before num_epochs
    resumes: list[dict] = field(default_factory=list)  # resumes.jsonl rows
    torn_metrics_line: int | None = None  # metrics.jsonl's last line, cut off mid-write and left out
    outside: list[str] = field(default_factory=list)  # run files (links) that lead outside the run directory: not read
    name: str = ""  # label in legends and headings; the folder name by default

    def __post_init__(self):
        self.name = self.name or self.path.name


def read_metrics(path: str | os.PathLike, torn: list | None = None) -> list[dict]:
    """Parse metrics.jsonl: one JSON object per line (blank lines skipped).

    torn: a list to which the number of a torn last line is appended, the line left out: the last line, cut off
    before its newline (the trainer writes each row with its newline in one write, so a run killed while
    writing leaves exactly that). None: such a line is an error like any other bad line."""
    path = Path(path)
    rows = []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if torn is not None and line_number == len(lines) and not line.endswith("\n"):
                torn.append(line_number)
                continue
            raise ValueError(
                f"{path} line {line_number}: not valid JSON ({err.msg}); "
                "metrics.jsonl must hold one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{path} line {line_number}: expected a JSON object like "
                f'{{"epoch": 0, "reward_mean": ...}}, got {type(row).__name__}'
            )
        rows.append(row)
    return rows


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None


def _read_marker(path: Path) -> dict | None:
    """failed.json / stopped.json as a dict, None when absent; an unreadable one still says the run ended so."""
    if not path.is_file():
        return None
    try:
        document = _read_json(path)
    except (OSError, ValueError) as err:
        return {"error": f"{path.name} is unreadable ({err})"}
    return document if isinstance(document, dict) else {"error": f"{path.name} holds {type(document).__name__}"}


def _read_resumes(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Read metrics.jsonl, config.json, the run's end markers and the list of sample and evaluation files.

    A run that failed (failed.json) or stopped (stopped.json) before its first metrics row is read with no
    rows: the report says why it ended."""
    path = Path(run_dir)
    if not path.exists():
        raise ValueError(f"run directory {path} does not exist; {RUN_DIR_HELP}")
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory; {RUN_DIR_HELP}")
    metrics_path = path / "metrics.jsonl"
    failed, stopped = _read_marker(path / "failed.json"), _read_marker(path / "stopped.json")
    torn = []
    if metrics_path.is_file():
        metrics = read_metrics(metrics_path, torn=torn)
    elif failed is not None or stopped is not None:
        metrics = []
    else:
        raise ValueError(f"{metrics_path} not found; {RUN_DIR_HELP}")
    config_path = path / "config.json"
    config = _read_json(config_path) if config_path.is_file() else None
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    run = RunData(path=path, config=config, metrics=metrics, failed=failed, stopped=stopped,
                  resumes=_read_resumes(path / "resumes.jsonl"), torn_metrics_line=torn[0] if torn else None)
    samples_dir = path / "samples"
    root = path.resolve()
    if samples_dir.is_dir():
        for entry in sorted(samples_dir.iterdir()):
            if not _resolves_inside(entry, root):
                # a link out of the run directory: the report reads the run's own files only
                run.outside.append(str(entry.relative_to(path)))
            elif match := _SAMPLE_PNG.match(entry.name):
                run.grids[int(match.group(1))] = entry
            elif match := _SAMPLE_JSON.match(entry.name):
                run.sample_files[int(match.group(1))] = entry
            elif match := _EVAL_PNG.match(entry.name):
                run.eval_grids[int(match.group(1))] = entry
            elif match := _EVAL_JSON.match(entry.name):
                run.eval_files[int(match.group(1))] = entry
    for evaluation in sorted(path.glob("checkpoints/checkpoint_*/evaluation.json")):
        if not _resolves_inside(evaluation, root):
            run.outside.append(str(evaluation.relative_to(path)))
            continue
        document = _read_json(evaluation)
        if isinstance(document, dict):
            run.evaluations[evaluation.parent.name] = document
    return run


def _read_records(run: RunData, path: Path, evaluation: bool = False) -> tuple[dict, list[dict]]:
    """(document, records) of a samples JSON (epoch_XXXX.json or eval_XXXX.json); each record gets `image_path`
    (an absolute Path inside the run directory, or None) and, for evaluation files, prompt_index / image_index."""
    document = _read_json(path)
    records = document.get("records") if isinstance(document, dict) else document
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a list of records or an object with a 'records' list")
    document = document if isinstance(document, dict) else {}
    group = document.get("group_size") if isinstance(document.get("group_size"), int) else None
    out, root = [], run.path.resolve()
    for i, record in enumerate(records):
        if not isinstance(record, dict) or "prompt" not in record or "reward" not in record:
            raise ValueError(f"{path}: record {i} must be an object with at least 'prompt' and 'reward'")
        record = dict(record)
        if evaluation and group and "prompt_index" not in record and isinstance(record.get("index"), int):
            # evaluation files from before the indices were stored: image j of prompt i is record i * J + j
            record["prompt_index"], record["image_index"] = divmod(record["index"], group)
        image = record.get("image")
        record["image_path"] = None
        if image:
            image_path = path.parent / str(image)
            if not _resolves_inside(image_path, root):
                # a samples file names images of its run only: nothing outside the run directory is embedded
                record["outside"] = str(image)
            else:
                record["image_path"] = image_path.resolve()
        out.append(record)
    return document, out


def read_sample_records(run: RunData, epoch: int) -> list[dict]:
    """Records of samples/epoch_XXXX.json, each with `image_path` (absolute Path) added."""
    return _read_records(run, run.sample_files[epoch])[1]


def read_eval_records(run: RunData, epoch: int) -> tuple[dict, list[dict]]:
    """(document, records) of samples/eval_XXXX.json: the evaluation's seed, prompts, (P, J) rewards and "final"
    flag (runs from before these were stored have none), and a record per kept image."""
    return _read_records(run, run.eval_files[epoch], evaluation=True)


@dataclass
class SampleSource:
    """Where a run's best and worst samples come from: the final evaluation, else the last logged epoch."""

    records: list[dict]
    label: str  # a sentence for the report: which weights, which epoch
    short: str  # a few words for the headline and headings
    first_means: dict[str, float]  # mean reward per prompt at the start (first evaluation / first sample epoch)
    final: bool  # from the final weights


def _means_of_document(document: dict, records: Sequence[dict]) -> dict[str, float]:
    """Mean reward per prompt: from the evaluation's (P, J) rewards of every prompt when stored, else the records."""
    prompts, rewards = document.get("prompts"), document.get("rewards")
    if isinstance(prompts, list) and isinstance(rewards, list) and len(prompts) == len(rewards):
        means = {}
        for prompt, row in zip(prompts, rewards):
            values = [v for v in (row if isinstance(row, list) else []) if _number(v) is not None]
            if values:
                means[str(prompt)] = sum(values) / len(values)
        return means
    return _mean_reward_by_prompt(records)


def sample_source(run: RunData) -> SampleSource | None:
    """The final evaluation's records (samples/eval_XXXX.json with "final": true, the latest), else the last
    sample epoch's (runs from before the final evaluation kept its images, eval_freq=0, or stopped early)."""
    final = None
    if run.eval_files:  # the final evaluation is the run's last (epoch num_epochs)
        epoch = max(run.eval_files)
        document, records = read_eval_records(run, epoch)
        final = (epoch, document, records) if document.get("final") else None
    if final is not None:
        epoch, document, records = final
        first = min(run.eval_files)
        first_document, first_records = read_eval_records(run, first) if first != epoch else ({}, [])
        seed = f", noise seed {document['seed']}" if "seed" in document else ""
        return SampleSource(
            records=records, final=True, short=f"final weights (after {epoch} epochs)",
            label=f"the final evaluation: the final weights, after {epoch} epochs (fixed noise{seed}, "
                  f"samples/eval_{epoch:04d}.json); ranked by the change since the evaluation after {first} epochs",
            first_means=_means_of_document(first_document, first_records),
        )
    if not run.sample_files:
        return None
    epochs = sorted(run.sample_files)
    last = read_sample_records(run, epochs[-1])
    first_means = _mean_reward_by_prompt(read_sample_records(run, epochs[0])) if len(epochs) > 1 else {}
    return SampleSource(
        records=last, final=False, short=f"training samples of epoch {epochs[-1]}, not the final weights",
        label=f"the training samples of epoch {epochs[-1]} (the last logged sample epoch: the weights after "
              f"{epochs[-1]} epochs, random noise), not the final weights: this run has no final-evaluation "
              "records (written before they were kept, eval_freq=0, or it ended before its final evaluation)",
        first_means=first_means,
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value) if math.isfinite(value) else None
    except OverflowError:  # an integer beyond float's range (a 400-digit number in metrics.jsonl): not drawn
        return None


def _resolves_inside(entry: Path, root: Path) -> bool:
    """Whether `entry` resolves to a path under `root`; a symlink loop (or an unreadable link) does not."""
    try:
        return entry.resolve().is_relative_to(root)
    except (OSError, RuntimeError):  # RuntimeError: Python < 3.13's "Symlink loop from ..."
        return False


def metric_series(metrics: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    """(x, y) of a metric over the rows that logged a finite number for it; x = epoch (row index if absent)."""
    xs, ys = [], []
    for i, row in enumerate(metrics):
        y = _number(row.get(key))
        if y is None:
            continue
        x = _number(row.get("epoch"))
        xs.append(i if x is None else x)
        ys.append(y)
    return xs, ys


def _keys_in_order(runs: Sequence[RunData]) -> list[str]:
    """Metric keys to plot after reward_mean, in report order, each logged by at least one run."""
    seen: list[str] = []
    for run in runs:
        for row in run.metrics:
            for key in row:
                if key not in seen and _number(row[key]) is not None:
                    seen.append(key)
    components = sorted(k for k in seen if k.startswith("reward/") or (k.startswith("eval/") and k != "eval/reward_mean"))
    scalars = [k for k in SCALAR_KEYS if k in seen]
    prefixed = [k for prefix in SCALAR_PREFIXES for k in sorted(seen) if k.startswith(prefix)]
    rest = [k for k in ("peak_rss_mb",) if k in seen]
    return components + scalars + prefixed + rest


def _png_data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _data_uri_length(num_bytes: int) -> int:
    """Characters of the data URI of a PNG of `num_bytes` bytes (base64: 4 per 3, padded)."""
    return len("data:image/png;base64,") + 4 * math.ceil(num_bytes / 3)


def _figure_png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def _new_axes(title: str, size: tuple[float, float] = (4.6, 3.0)):
    # Figure + Agg canvas directly: no pyplot, no global backend switch in the caller's process.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=size, layout="constrained")
    ax = fig.add_subplot()
    # wrapped to the figure's width (about 0.6 em per character): a title is never clipped at the sides
    ax.set_title(textwrap.fill(title, max(20, int(size[0] * 72 / (10 * 0.6)))), fontsize=10)
    ax.set_xlabel("epoch", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return fig, ax


def _legend_below(fig, ax, fontsize: int = 8) -> None:
    """The legend under the axes, outside them (constrained layout makes room): it never covers a curve."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(2, len(handles)), fontsize=fontsize,
                   frameon=False)


def plot_curves(runs: Sequence[RunData]) -> list[tuple[str, bytes]]:
    """One PNG per metric panel: reward_mean +- reward_std, then each other logged scalar (runs overlaid; with
    two runs a legend under the panel, one run needs none: the panel's title names the metric)."""
    panels = []
    if any(metric_series(run.metrics, "reward_mean")[0] for run in runs):
        fig, ax = _new_axes("reward_mean +- reward_std")
        for i, run in enumerate(runs):
            xs, means = metric_series(run.metrics, "reward_mean")
            if not xs:
                continue
            ax.plot(xs, means, RUN_STYLES[i], color=RUN_COLORS[i], label=run.name, marker="." if len(xs) < 30 else None)
            by_epoch = dict(zip(*metric_series(run.metrics, "reward_std")))
            band = [(x, m, by_epoch[x]) for x, m in zip(xs, means) if x in by_epoch]
            if band:
                bx, bm, bs = zip(*band)
                ax.fill_between(bx, [m - s for m, s in zip(bm, bs)], [m + s for m, s in zip(bm, bs)],
                                color=RUN_COLORS[i], alpha=0.2)
        if len(runs) > 1:
            _legend_below(fig, ax)
        panels.append(("reward_mean +- reward_std", _figure_png(fig)))
    for key in _keys_in_order(runs):
        fig, ax = _new_axes(key)
        for i, run in enumerate(runs):
            xs, ys = metric_series(run.metrics, key)
            if xs:
                ax.plot(xs, ys, RUN_STYLES[i], color=RUN_COLORS[i], label=run.name,
                        marker="." if len(xs) < 30 else None)
        if len(runs) > 1:
            _legend_below(fig, ax)
        panels.append((key, _figure_png(fig)))
    return panels


def plot_times(runs: Sequence[RunData]) -> bytes | None:
    """Seconds per phase (time/sample, time/reward, time/train) per epoch; None when none was logged."""
    if not any(metric_series(run.metrics, key)[0] for run in runs for key in TIME_KEYS):
        return None
    fig, ax = _new_axes("time per phase (s)", size=(6.0, 3.4))
    for i, run in enumerate(runs):
        for key, color in zip(TIME_KEYS, ("tab:green", "tab:purple", "tab:red")):
            xs, ys = metric_series(run.metrics, key)
            if xs:
                label = key if len(runs) == 1 else f"{run.name}: {key}"
                ax.plot(xs, ys, RUN_STYLES[i], color=color, label=label)
    _legend_below(fig, ax, fontsize=7)
    return _figure_png(fig)


STEP_LABELS = {
    "steps/trained": "trained (1) or not (0)",
    "steps/adv_mean": "advantage mean",
    "steps/adv_std": "advantage std",
    "steps/grad_share": "share of the policy gradient",
    "steps/approx_kl": "approx_kl (k1)",
    "steps/clipfrac": "clipfrac",
    "steps/ratio_std": "ratio std",
    "steps/value_error": "critic (V - R)^2",
    "steps/explained_variance": "critic explained variance",
}


def step_matrix(metrics: Sequence[dict], key: str) -> tuple[list[float], list[list[float]]]:
    """(epochs, rows) of a per-step metric (docs/diagnostics.md): one row per epoch row that logged a list
    for `key`, one float per denoising step, NaN where the step had nothing to measure (null); rows padded
    with NaN to the longest. ([], []) when no row logged it (runs from before the per-step metrics)."""
    epochs, rows = [], []
    for i, row in enumerate(metrics):
        values = row.get(key)
        if not isinstance(values, list):
            continue
        x = _number(row.get("epoch"))
        epochs.append(i if x is None else x)
        rows.append([float("nan") if _number(v) is None else float(v) for v in values])
    width = max((len(r) for r in rows), default=0)
    return epochs, [r + [float("nan")] * (width - len(r)) for r in rows]


def step_keys(runs: Sequence[RunData]) -> list[str]:
    """The per-step metrics some run logged with at least one number, in STEP_LABELS' order."""
    return [
        key for key in STEP_LABELS
        if any(any(math.isfinite(v) for r in step_matrix(run.metrics, key)[1] for v in r) for run in runs)
    ]


def plot_step_heatmaps(runs: Sequence[RunData], keys: Sequence[str] | None = None) -> bytes | None:
    """One PNG of epoch x step heat maps: a row per per-step metric, a column per run (step 0, the noisiest,
    on top; grey = nothing measured there). None when no run logged per-step metrics."""
    keys = [k for k in (keys if keys is not None else step_keys(runs)) if k in STEP_LABELS]
    keys = [k for k in keys if any(step_matrix(run.metrics, k)[0] for run in runs)]
    if not keys:
        return None
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.6 * len(runs) + 0.6, 1.9 * len(keys) + 0.4), layout="constrained")
    axes = fig.subplots(len(keys), len(runs), squeeze=False)
    for row, key in enumerate(keys):
        for col, run in enumerate(runs):
            ax = axes[row][col]
            epochs, matrix = step_matrix(run.metrics, key)
            ax.tick_params(labelsize=7)
            if row == 0:
                ax.set_title(run.name, fontsize=9)
            if col == 0:
                ax.set_ylabel(f"{STEP_LABELS[key]}\nstep", fontsize=8)
            if row == len(keys) - 1:
                ax.set_xlabel("epoch", fontsize=8)
            if not epochs:
                ax.text(0.5, 0.5, "not logged", ha="center", va="center", fontsize=8, transform=ax.transAxes)
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            data = np.ma.masked_invalid(np.array(matrix, dtype=float).T)  # steps x epochs
            cmap = colormaps["RdBu_r" if key == "steps/adv_mean" else "viridis"].with_extremes(bad="0.85")
            kwargs = {}
            if key in ("steps/trained", "steps/grad_share", "steps/clipfrac"):
                kwargs = {"vmin": 0.0, "vmax": 1.0}
            elif data.count():
                low, high = float(data.min()), float(data.max())
                if high - low <= 1e-4 * max(abs(low), abs(high), 1.0):
                    # constant up to rounding (a group-normalised advantage's mean and std): no colour noise
                    low, high = low - 0.5 * max(abs(low), 1e-3), high + 0.5 * max(abs(high), 1e-3)
                if key == "steps/adv_mean":
                    bound = max(abs(low), abs(high))
                    low, high = -bound, bound
                kwargs = {"vmin": low, "vmax": high}
            x0, x1 = (epochs[0] - 0.5, epochs[-1] + 0.5) if len(epochs) > 1 else (epochs[0] - 0.5, epochs[0] + 0.5)
            image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap,
                              extent=(x0, x1, data.shape[0] - 0.5, -0.5), **kwargs)
            bar = fig.colorbar(image, ax=ax, shrink=0.9)
            bar.ax.tick_params(labelsize=7)
            bar.formatter.set_useOffset(False)
            bar.update_ticks()
    return _figure_png(fig)



def _steps_section(runs: Sequence[RunData], inline: Inline) -> str:
    png = plot_step_heatmaps(runs)
    header = "<h2>Per-step view</h2>"
    if png is None:
        return header + "<p>no per-step metrics (steps/*) in this run: it was written before they were logged</p>"
    return (
        header + "<p>Each panel is epoch (x) by denoising step (y, 0 = the noisiest, on top); grey cells had "
        "nothing to measure (no density, not trained, no critic); a column per run. What each quantity means: "
        "docs/diagnostics.md in the ddpo-group repository.</p>" + inline.plot(png, "per-step heat maps", "wide")
    )


def _mean_reward_by_prompt(records: Sequence[dict]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for record in records:
        reward = _number(record.get("reward"))
        if reward is not None:
            sums.setdefault(record["prompt"], []).append(reward)
    return {prompt: sum(v) / len(v) for prompt, v in sums.items()}


def _rank_prompts(source: SampleSource, num_prompts: int) -> list[str]:
    order = list(dict.fromkeys(record["prompt"] for record in source.records))
    last_means = _mean_reward_by_prompt(source.records)
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
    return [] if source is None else _rank_prompts(source, num_prompts)


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def shown_width(width: int) -> int:
    """The width an image of `width` pixels is shown at: small ones enlarged by an integer factor to at least
    MIN_SHOWN_WIDTH (32 -> 96), wide ones at max(MAX_SHOWN_WIDTH, width / 2), never narrower than half their width."""
    if width < MIN_SHOWN_WIDTH:
        return width * math.ceil(MIN_SHOWN_WIDTH / width)
    return min(width, max(MAX_SHOWN_WIDTH, math.ceil(width / 2)))


def _img(data_uri: str, alt: str, css_class: str = "", size: tuple[int, int] | None = None) -> str:
    cls = f' class="{css_class}"' if css_class else ""
    dims = f' width="{size[0]}" height="{size[1]}"' if size else ""
    return f'<img{cls}{dims} src="{data_uri}" alt="{_e(alt)}">'


class Inline:
    """The report's images within its size cap: embedded while they fit in `limit` characters, else linked
    (a path relative to the report's folder) and counted in the report's "left out" note."""

    def __init__(self, limit: int, link_base: Path):
        self.limit, self.used, self.link_base = limit, 0, link_base
        self.left_out: list[tuple[str, Path]] = []  # (section, file)

    def plot(self, png: bytes, alt: str, css_class: str = "plot") -> str:
        """A plot is always embedded (tens of KB); it counts against the cap."""
        uri = _png_data_uri(png)
        self.used += len(uri)
        return _img(uri, alt, css_class)

    def link(self, path: Path, text: str) -> str:
        href = urllib.parse.quote(Path(os.path.relpath(path, self.link_base)).as_posix())
        return f'<a class="linked" href="{_e(href)}">{_e(text)}</a>'

    def file(self, path: Path | None, alt: str, css_class: str, section: str) -> str:
        """An image file of the run: a sample at `shown_width`, a grid at its own size; a link past the cap."""
        if path is None or not path.is_file():
            return f'<span class="missing">missing image: {_e(path)}</span>'
        cost = _data_uri_length(path.stat().st_size)
        if self.used + cost > self.limit:
            self.left_out.append((section, path))
            return self.link(path, f"{alt} (linked: over the report's size cap)")
        self.used += cost
        size = None
        if css_class == "sample":
            from PIL import Image

            with Image.open(path) as image:
                width, height = image.size
            shown = shown_width(width)
            size = (shown, max(1, round(height * shown / width)))
        return _img(_png_data_uri(path.read_bytes()), alt, css_class, size)


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(config, dict):
        return {prefix: config}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _fmt(value: Any) -> str:
    number = _number(value)
    if number is None:
        return "" if value is None else str(value)
    return f"{number:.4g}"


def _config_section(runs: Sequence[RunData]) -> str:
    parts = ["<h2>Config</h2>"]
    if len(runs) == 2 and all(run.config is not None for run in runs):
        flat = [_flatten(run.config) for run in runs]
        keys = sorted(set(flat[0]) | set(flat[1]))
        differ = [k for k in keys if flat[0].get(k, "<absent>") != flat[1].get(k, "<absent>")]
        rows = "".join(
            f"<tr><td>{_e(k)}</td><td>{_e(flat[0].get(k, '<absent>'))}</td><td>{_e(flat[1].get(k, '<absent>'))}</td></tr>"
            for k in differ
        )
        parts.append(
            f"<h3>Differences ({len(differ)})</h3><table><tr><th>key</th><th>{_e(runs[0].name)}</th>"
            f"<th>{_e(runs[1].name)}</th></tr>{rows}</table>"
        )
    cells = []
    for run in runs:
        body = (
            f"<pre>{_e(json.dumps(run.config, indent=2, sort_keys=True, default=str))}</pre>"
            if run.config is not None
            else f"<p>no config.json in {_e(run.path)}</p>"
        )
        cells.append(f'<div class="half"><details><summary>{_e(run.name)}: config.json</summary>{body}</details></div>')
    parts.append(f'<div class="halves">{"".join(cells)}</div>')
    return "\n".join(parts)


def _cfg(config: dict | None, dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def duration(seconds: float) -> str:
    """'42.5 s', '5 min 25 s', '2 h 03 min'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def trained_epochs(run: RunData) -> int:
    """Epochs trained: 1 + the last epoch of a training row (the final evaluation's eval_only row is not one)."""
    epochs = [_number(row.get("epoch")) for row in run.metrics if not row.get("eval_only")]
    epochs = [e for e in epochs if e is not None]
    return int(max(epochs)) + 1 if epochs else 0


def wall_time(run: RunData) -> float:
    """Seconds in the logged phases (PHASE_KEYS) over every row: sampling, rewards, advantages, training,
    critic, evaluation; model loading and checkpoint writing are not logged."""
    return sum(_number(row.get(key)) or 0.0 for row in run.metrics for key in PHASE_KEYS)


def run_status(run: RunData) -> tuple[str, str]:
    """(css class, sentence): failed (failed.json's reason), stopped (stopped.json), incomplete, or finished."""
    done, planned = trained_epochs(run), _cfg(run.config, "num_epochs")
    if run.failed is not None:
        failed = run.failed
        where = f" at epoch {failed['epoch']}" if "epoch" in failed else ""
        when = f" ({failed['time']})" if failed.get("time") else ""
        return "failed", f"FAILED{where}: {failed.get('error', 'no reason recorded')}{when} (failed.json)"
    if run.stopped is not None:
        stopped = run.stopped
        resume = stopped.get("resume") or f"--config.resume_from={run.path}"
        return "stopped", (f"stopped by signal {stopped.get('signal')} after epoch {stopped.get('epoch')} "
                           f"(stopped.json); resume with {resume}")
    if isinstance(planned, int) and done < planned:
        return "incomplete", (f"incomplete: {done} of {planned} epochs logged and no failed.json or stopped.json "
                              "(still running, or killed before it could say so)")
    return "ok", f"finished: {done} of {planned} epochs" if isinstance(planned, int) else f"{done} epochs logged"


def _evaluations(run: RunData) -> list[tuple[float, float, bool]]:
    """(epoch, eval/reward_mean, is the final weights' row) of every evaluation row."""
    out = []
    for i, row in enumerate(run.metrics):
        value = _number(row.get("eval/reward_mean"))
        if value is not None:
            epoch = _number(row.get("epoch"))
            out.append((i if epoch is None else epoch, value, bool(row.get("eval_only"))))
    return out


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
        estimator, objective = _cfg(config, "algorithm.adv_estimator", "?"), _cfg(config, "train.objective", "stepwise")
        algorithm = [f"{objective} (forward process), advantages {estimator}" if objective not in (None, "stepwise")
                     else f"{estimator}, policy loss {_cfg(config, 'train.policy_loss', '?')}"]
        if _cfg(config, "train.use_kl_loss"):
            algorithm.append(f"KL {_cfg(config, 'train.kl_type', '')} beta {_cfg(config, 'train.beta')}")
        values["algorithm"] = ", ".join(algorithm)
        model = str(_cfg(config, "pretrained.model", "?"))
        if _cfg(config, "pretrained.revision"):
            model += f" @ {_cfg(config, 'pretrained.revision')}"
        model += f", LoRA r{_cfg(config, 'lora_rank')}" if _cfg(config, "use_lora") else ", full fine-tune"
        values["model"] = model
        rewards = str(_cfg(config, "reward_fn", "?"))
        weights = _cfg(config, "reward_weights") or {}
        if isinstance(weights, dict) and weights:
            rewards += " (" + ", ".join(f"{k} x {v}" for k, v in weights.items()) + f"; {_cfg(config, 'reward_aggregation')})"
        values["reward(s)"] = rewards
        eval_prompts = _cfg(config, "eval_prompt_fn") or "the training prompts"
        values["prompt set"] = f"{_cfg(config, 'prompt_fn', '?')}; evaluation: {eval_prompts}"
        values["seed"] = f"{_cfg(config, 'seed')} (evaluation noise {_cfg(config, 'eval_seed')})"
    planned = _cfg(config, "num_epochs")
    values["epochs"] = f"{trained_epochs(run)} of {planned}" if planned is not None else f"{trained_epochs(run)}"
    seconds = wall_time(run)
    values["wall time"] = f"{duration(seconds)} in the logged phases" if seconds else "not logged"
    evals = _evaluations(run)
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


LEFT_OUT = "<!-- left out -->"


def _headline_section(runs: Sequence[RunData], sources: Sequence[SampleSource | None]) -> str:
    statuses = [run_status(run) for run in runs]
    banners = "".join(
        f'<p class="status {cls}">{_e(run.name + ": " if len(runs) > 1 else "")}{_e(text)}</p>'
        for run, (cls, text) in zip(runs, statuses)
    )
    for run in runs:
        for resume in run.resumes:
            failure = resume.get("previous_failure")
            if isinstance(failure, dict):
                banners += (f'<p class="status earlier">{_e(run.name)}: resumed at epoch {_e(resume.get("epoch"))} '
                            f'after a failure at epoch {_e(failure.get("epoch"))}: {_e(failure.get("error"))}</p>')
        if run.torn_metrics_line:
            banners += (f'<p class="status earlier">{_e(run.name)}: metrics.jsonl line {run.torn_metrics_line}, its last, '
                        "was cut off mid-write (the run was killed while writing it) and is left out</p>")
        if run.outside:
            banners += (f'<p class="status earlier">{_e(run.name)}: left out, links to files outside the run directory '
                        f'(the report reads the run\'s own files only): {_e(", ".join(run.outside))}</p>')
    fields = [headline(run, source) for run, source in zip(runs, sources)]
    header = f'<tr><th></th>{"".join(f"<th>{_e(run.name)}</th>" for run in runs)}</tr>' if len(runs) > 1 else ""
    rows = "".join(
        f"<tr><th>{_e(key)}</th>" + "".join(f"<td>{_e(f[row][1])}</td>" for f in fields) + "</tr>"
        for row, (key, _) in enumerate(fields[0])
    )
    note = ("<p class=\"small\">wall time: the sum of the logged phases (time/sample, time/reward, time/advantages, "
            "time/train, time/critic, time/eval) over every epoch, resumes included; model loading and checkpoints "
            "are not in it.</p>")
    return f'{banners}<table class="headline">{header}{rows}</table>{note}{LEFT_OUT}'


def smoothed(xs: Sequence[float], ys: Sequence[float], window: int = SMOOTHING) -> list[float]:
    """Trailing mean of ys over the last `window` points (fewer at the start)."""
    return [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]


def evaluation_figure(runs: Sequence[RunData]):
    """The matplotlib Figure of `plot_evaluation` (None when no run logged an evaluation): a title that fits,
    the legend under the axes."""
    if not any(metric_series(run.metrics, "eval/reward_mean")[0] for run in runs):
        return None
    fig, ax = _new_axes(f"Fixed-noise evaluation and training reward ({SMOOTHING}-epoch mean)", size=(7.2, 3.8))
    for i, run in enumerate(runs):
        prefix = f"{run.name}: " if len(runs) > 1 else ""
        xs, ys = metric_series(run.metrics, "eval/reward_mean")
        if xs:
            ax.plot(xs, ys, RUN_STYLES[i], color=RUN_COLORS[i], marker="o", label=f"{prefix}eval/reward_mean")
        xs, ys = metric_series(run.metrics, "reward_mean")
        if xs:
            ax.plot(xs, smoothed(xs, ys), ":", color=RUN_COLORS[i], label=f"{prefix}reward_mean, {SMOOTHING}-epoch mean")
    ax.set_xlabel("epoch (evaluations: the weights after that many epochs)", fontsize=9)
    _legend_below(fig, ax)
    return fig


def plot_evaluation(runs: Sequence[RunData]) -> bytes | None:
    """eval/reward_mean (fixed noise) per evaluation, beside the training reward_mean smoothed over SMOOTHING epochs."""
    fig = evaluation_figure(runs)
    return None if fig is None else _figure_png(fig)


def _window_mean(values: Sequence[float], first: bool) -> str:
    if not values:
        return ""
    part = values[:SMOOTHING] if first else values[-SMOOTHING:]
    return f"{sum(part) / len(part):.4f}"


def _three(epochs: Sequence[int]) -> list[int]:
    """First, middle and last of sorted epochs (fewer when there are fewer)."""
    return sorted({epochs[0], epochs[len(epochs) // 2], epochs[-1]}) if epochs else []


def _sample_figure(record: dict | None, caption: str, inline: Inline, section: str, alt: str | None = None) -> str:
    if record is None:
        return f'<figure><span class="missing">none</span><figcaption>{_e(caption)}</figcaption></figure>'
    if record.get("outside"):
        image = f'<span class="missing">not shown: {_e(record["outside"])} is outside the run directory</span>'
    else:
        alt = alt or f"{caption} {record.get('prompt', '')}"
        image = inline.file(record.get("image_path"), alt, "sample", section)
    return f"<figure>{image}<figcaption>{_e(caption)}</figcaption></figure>"


def _paired_table(runs: Sequence[RunData], documents: Sequence[dict], records: Sequence[list[dict]],
                  inline: Inline) -> str:
    """Both runs' evaluation images, a cell per (prompt, image): run A's and run B's image of the same prompt and the
    same noise side by side (image j of prompt i starts from noise seeded by (seed, i, j) in both)."""
    seeds = [doc.get("seed", _cfg(run.config, "eval_seed")) for run, doc in zip(runs, documents)]
    by_index = [{(r["prompt_index"], r["image_index"]): r for r in recs if "prompt_index" in r} for recs in records]
    by_prompt = {(r["prompt"], r["image_index"]): r for r in records[1] if "image_index" in r}
    if not by_index[0]:
        return "<p>no per-image records in the evaluation files (samples/eval_XXXX.json)</p>"
    prompt_indices = sorted({i for i, _ in by_index[0]})
    images = sorted({j for _, j in by_index[0]})
    notes = []
    same_seed = seeds[0] is not None and seeds[0] == seeds[1]
    if not same_seed:
        notes.append(f"the runs' evaluation seeds differ ({seeds[0]} vs {seeds[1]}): a cell holds the same prompt, "
                     "not the same noise")
    if len(prompt_indices) > COMPARE_PROMPTS:
        notes.append(f"the first {COMPARE_PROMPTS} of {len(prompt_indices)} evaluation prompts")
    rows = []
    other_noise = 0
    for i in prompt_indices[:COMPARE_PROMPTS]:
        prompt = next(r["prompt"] for (pi, _), r in by_index[0].items() if pi == i)
        cells = []
        for j in images:
            first = by_index[0].get((i, j))
            second = by_index[1].get((i, j))
            same_noise = same_seed
            if second is None or second["prompt"] != prompt:
                second = by_prompt.get((prompt, j))  # the prompt sits elsewhere in run B's list: other noise
                same_noise = False
            other_noise += 0 if same_noise else 1
            flag = "" if same_noise else '<span class="missing">not the same noise</span>'
            captions = [f"{run.name}: r={r['reward']:.3f}" if r is not None and _number(r.get("reward")) is not None
                        else f"{run.name}: none" for run, r in zip(runs, (first, second))]
            cells.append(
                f'<td class="cell" data-cell="{i},{j}" data-same-noise="{str(same_noise).lower()}">'
                f'<div class="pair">{_sample_figure(first, captions[0], inline, "evaluation images")}'
                f'{_sample_figure(second, captions[1], inline, "evaluation images")}</div>{flag}</td>'
            )
        rows.append(f'<tr><th class="prompt">{_e(prompt)}</th>{"".join(cells)}</tr>')
    if other_noise and same_seed:
        notes.append(f"{other_noise} cells pair a prompt that sits at another place in the second run's prompt list: "
                     "the same prompt, other noise")
    header = "".join(f"<th>image {j}</th>" for j in images)
    note = f'<p class="small">{_e("; ".join(notes))}</p>' if notes else ""
    return (f'{note}<div class="scroll"><table class="paired"><tr><th>prompt</th>{header}</tr>{"".join(rows)}'
            "</table></div>")


def _paired_evaluation(runs: Sequence[RunData], inline: Inline) -> str:
    """Compare mode: at the first and middle common evaluation and at each run's last, a table whose cell holds
    both runs' image of one prompt and one noise."""
    epochs = [sorted(run.eval_files) for run in runs]
    common = sorted(set(epochs[0]) & set(epochs[1]))
    pairs = [(e, e) for e in sorted({common[0], common[len(common) // 2]})] if common else []
    pairs = list(dict.fromkeys(pairs + [(epochs[0][-1], epochs[1][-1])]))
    parts = ["<h3>Fixed evaluation images side by side: in each cell the same prompt and the same noise, "
             f"{_e(runs[0].name)} left, {_e(runs[1].name)} right</h3>"]
    for epoch_a, epoch_b in pairs:
        (doc_a, rec_a), (doc_b, rec_b) = read_eval_records(runs[0], epoch_a), read_eval_records(runs[1], epoch_b)
        if epoch_a == epoch_b:
            title = f"after {epoch_a} epochs"
        else:
            title = f"{runs[0].name} after {epoch_a} epochs, {runs[1].name} after {epoch_b} epochs"
        if doc_a.get("final") and doc_b.get("final"):
            title += " (the final weights)"
        parts.append(f"<h4>{_e(title)}</h4>" + _paired_table(runs, (doc_a, doc_b), (rec_a, rec_b), inline))
    return "\n".join(parts)


def _evaluation_section(runs: Sequence[RunData], inline: Inline) -> str:
    parts = ["<h2>Evaluation</h2>"]
    figure = plot_evaluation(runs)
    if figure is None:
        parts.append("<p>no evaluation logged (set config.eval_freq, e.g. --config.eval_freq=10)</p>")
    else:
        parts.append(inline.plot(figure, "evaluation curve"))
    if len(runs) == 2 and all(run.eval_files for run in runs):
        parts.append(_paired_evaluation(runs, inline))
    else:
        for run in runs:
            shown = _three(sorted(run.eval_grids))
            if not shown:
                continue
            cells = "".join(
                f'<div class="col"><h4>{_e(run.name)}: after {epoch} epochs</h4>'
                f'{inline.file(run.eval_grids[epoch], f"eval grid {epoch}", "grid", "evaluation grids")}</div>'
                for epoch in shown
            )
            parts.append("<h3>Fixed evaluation grids: the same prompts and noise, first / middle / last (shown at "
                         f'their own size)</h3><div class="cols">{cells}</div>')
    for run in runs:
        if run.evaluations:
            rows = "".join(
                f"<tr><td>{_e(name)}</td><td>{_e(_fmt(doc.get('mean')))}</td><td>{_e(doc.get('num_prompts', ''))} x "
                f"{_e(doc.get('images_per_prompt', ''))}</td><td>{_e(doc.get('prompts', ''))}</td></tr>"
                for name, doc in sorted(run.evaluations.items(), key=lambda item: int(item[0].split("_")[-1]))
            )
            parts.append(f"<h3>{_e(run.name)}: scripts/evaluate.py results (evaluation.json)</h3>"
                         f"<table><tr><th>checkpoint</th><th>mean</th><th>prompts x images</th><th>prompt set</th></tr>"
                         f"{rows}</table>")
    return "\n".join(parts)


def _summary_section(runs: Sequence[RunData]) -> str:
    """First vs last evaluation and first vs last SMOOTHING-epoch windows: single epochs are noise."""
    header = "".join(f"<th>{_e(run.name)} first</th><th>{_e(run.name)} last</th>" for run in runs)
    rows = []
    for key, label in (("eval/reward_mean", "eval/reward_mean (first vs last evaluation)"),):
        values = []
        for run in runs:
            logged = metric_series(run.metrics, key)[1]
            values += [_fmt(logged[0]) if logged else "", _fmt(logged[-1]) if logged else ""]
        if any(values):
            rows.append(f"<tr><td>{_e(label)}</td>" + "".join(f"<td>{_e(v)}</td>" for v in values) + "</tr>")
    for key in ("reward_mean", "kl", "loss"):
        values = []
        for run in runs:
            logged = metric_series(run.metrics, key)[1]
            values += [_window_mean(logged, True), _window_mean(logged, False)]
        if any(values):
            label = f"{key} (mean of the first / last {SMOOTHING} epochs)"
            rows.append(f"<tr><td>{_e(label)}</td>" + "".join(f"<td>{_e(v)}</td>" for v in values) + "</tr>")
    counts = ", ".join(f"{_e(run.name)}: {len(run.metrics)} rows" for run in runs)
    table = f"<table><tr><th>metric</th>{header}</tr>{''.join(rows)}</table>"
    return f"<h2>Summary</h2><p>metrics.jsonl: {counts}</p>{table}" + _legacy_summary(runs)


def _legacy_summary(runs: Sequence[RunData]) -> str:
    keys = ["epoch", "global_step", "num_processes", "num_samples", "reward_mean", "reward_std", "kl", "loss"]
    header = "".join(f"<th>{_e(run.name)} first</th><th>{_e(run.name)} last</th>" for run in runs)
    rows = []
    for key in keys:
        values = []
        for run in runs:
            logged = [row[key] for row in run.metrics if key in row]
            values += [_fmt(logged[0]) if logged else "", _fmt(logged[-1]) if logged else ""]
        if any(values):
            rows.append(f"<tr><td>{_e(key)}</td>" + "".join(f"<td>{_e(v)}</td>" for v in values) + "</tr>")
    return f"<details><summary>first and last single rows</summary><table><tr><th>metric</th>{header}</tr>{''.join(rows)}</table></details>"


def _curves_section(runs: Sequence[RunData], inline: Inline) -> str:
    panels = plot_curves(runs)
    parts = ["<h2>Curves</h2>"]
    if not panels:
        parts.append("<p>no numeric metrics logged yet</p>")
    parts.append('<div class="panels">' + "".join(inline.plot(png, key) for key, png in panels) + "</div>")
    times = plot_times(runs)
    if times is not None:
        parts.append("<h3>Time per phase</h3>" + inline.plot(times, "time per phase"))
    return "\n".join(parts)


def thin_evenly(count: int, keep: int) -> list[int]:
    """`keep` of the indices 0 .. count-1, evenly spaced, the first and the last among them (keep >= 2)."""
    if keep >= count:
        return list(range(count))
    if keep <= 0:
        return []
    if keep == 1:
        return [count - 1]
    return sorted({round(i * (count - 1) / (keep - 1)) for i in range(keep)})


def _grids_section(runs: Sequence[RunData], inline: Inline, available: int) -> tuple[str, str]:
    """(html, what was left out) of the per-epoch sample grids within `available` characters: every epoch when
    they fit, else evenly thinned (first and last kept) and the others linked."""
    epochs = sorted(set().union(*(run.grids for run in runs)))
    heading = "<h2>Sample grids</h2>"
    if not epochs:
        return heading + "<p>no sample grids (samples/epoch_XXXX.png) in this run</p>", ""
    costs = [sum(_data_uri_length(run.grids[e].stat().st_size) for run in runs if e in run.grids) + 400 for e in epochs]

    def links(left: Sequence[int]) -> str:
        if not left:
            return ""
        items = " ".join(
            inline.link(run.grids[e], f"{run.name + ' ' if len(runs) > 1 else ''}{e}") for e in left for run in runs
            if e in run.grids
        )
        return (f"<details><summary>{len(left)} more sample grids, linked (files beside the report; the size cap "
                f"left them out)</summary><p>{items}</p></details>")

    keep = len(epochs)
    while True:
        chosen = thin_evenly(len(epochs), keep)
        kept = set(chosen)
        left = [e for i, e in enumerate(epochs) if i not in kept]
        link_html = links(left)
        total = sum(costs[i] for i in chosen) + len(link_html)
        if total <= available or keep == 0:
            break
        keep = min(keep - 1, max(0, int(keep * available / total)))
    parts = [heading]
    note = ""
    if left:
        note = (f"{len(left)} of {len(epochs)} per-epoch sample grids ({len(chosen)} shown, evenly spaced, the first and "
                "the last kept; the others are linked under Sample grids)")
        parts.append(f"<p class=\"small\">{_e(note)}.</p>")
    for i in chosen:
        epoch = epochs[i]
        cells = []
        for run in runs:
            if epoch in run.grids:
                uri = _png_data_uri(run.grids[epoch].read_bytes())
                inline.used += len(uri)
                content = _img(uri, f"{run.name} epoch {epoch}", "grid")
            else:
                content = "<p>no grid</p>"
            label = f"<h4>{_e(run.name)}</h4>" if len(runs) > 1 else ""
            cells.append(f'<div class="col">{label}{content}</div>')
        parts.append(f'<h3>epoch {epoch}</h3><div class="pair">{"".join(cells)}</div>')
    parts.append(link_html)
    return "\n".join(parts), note


def _sample_cell(record: dict, inline: Inline) -> str:
    """A best / worst sample captioned with its reward (and a training sample's advantage)."""
    caption = f"r={record['reward']:.3f}"
    if "prompt_index" not in record:  # a training sample: it has an advantage (an evaluation image has none)
        advantage = _number(record.get("advantage"))
        caption += f" a={'n/a' if advantage is None else f'{advantage:+.2f}'}"
    return _sample_figure(record, caption, inline, "best and worst samples", alt=f"sample {record.get('index', '')}")


def _prompts_section(runs: Sequence[RunData], sources: Sequence[SampleSource | None], prompts: Sequence[str],
                     top_k: int, inline: Inline) -> str:
    parts = [f"<h2>Best and worst samples (top {top_k} per prompt)</h2>"]
    for run, source in zip(runs, sources):
        who = f"{run.name}: " if len(runs) > 1 else ""
        parts.append(f"<p>{_e(who)}from {_e(source.label) if source else 'no sample records'}.</p>")
    if not prompts:
        return "\n".join(parts) + "<p>no sample records (samples/eval_XXXX.json or epoch_XXXX.json) to choose prompts from</p>"
    for prompt in prompts:
        parts.append(f"<h3>{_e(prompt)}</h3>")
        cells = []
        for run, source in zip(runs, sources):
            if source is None:
                cells.append(f'<div class="col"><p>{_e(run.name)}: no sample records</p></div>')
                continue
            mine = [r for r in source.records if r["prompt"] == prompt and _number(r.get("reward")) is not None]
            header = f"<h4>{_e(run.name)}, {_e(source.short)}</h4>" if len(runs) > 1 else ""
            if not mine:
                cells.append(f'<div class="col">{header}<p>not among these samples</p></div>')
                continue
            ranked = sorted(mine, key=lambda r: r["reward"], reverse=True)
            shown = min(top_k, (len(ranked) + 1) // 2)  # best and worst never show the same image twice
            best = "".join(_sample_cell(r, inline) for r in ranked[:shown])
            worst = "".join(_sample_cell(r, inline) for r in ranked[shown:][::-1][:top_k])
            cells.append(
                f'<div class="col">{header}<div class="bw"><div><p>best</p><div class="row">{best}</div></div>'
                f'<div><p>worst</p><div class="row">{worst}</div></div></div></div>'
            )
        parts.append(f'<div class="cols">{"".join(cells)}</div>')
    return "\n".join(parts)


CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1em; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
table.headline th { background: #f3f3f3; }
.status { padding: 0.4em 0.8em; font-weight: bold; margin: 0.3em 0; }
.status.ok { background: #e6f4e6; }
.status.failed { background: #fbe3e3; color: #900; }
.status.stopped, .status.incomplete, .status.earlier { background: #fff4d6; }
.leftout { background: #fff4d6; padding: 0.4em 0.8em; }
.small { font-size: 0.85em; color: #555; }
.cols { display: flex; flex-wrap: wrap; gap: 1.5em; align-items: flex-start; }
.col { flex: 0 0 auto; max-width: 100%; overflow-x: auto; }
.pair { display: flex; gap: 1em; align-items: flex-start; overflow-x: auto; }
.pair > .col { flex: 0 0 auto; max-width: none; }
.halves { display: flex; gap: 1.5em; align-items: flex-start; }
.half { flex: 1; min-width: 0; }
.scroll { overflow-x: auto; max-width: 100%; }
.panels { display: flex; flex-wrap: wrap; gap: 0.5em; }
img.grid { image-rendering: pixelated; }
img.wide { max-width: 100%; }
img.sample { image-rendering: pixelated; }
table.paired td.cell .pair { gap: 4px; }
th.prompt { max-width: 12em; font-weight: normal; }
.row { display: flex; flex-wrap: wrap; gap: 6px; }
.bw { display: flex; gap: 2em; align-items: flex-start; }
.bw p { margin: 0.2em 0; }
figure { margin: 0; font-size: 0.8em; text-align: center; width: min-content; overflow-wrap: anywhere; }
figcaption { min-width: 6em; }
pre { font-size: 0.8em; background: #f6f6f6; padding: 0.5em; overflow-x: auto; }
.missing { color: #a00; font-size: 0.8em; }
"""


def build_report(
    run_dir: str | os.PathLike,
    compare: str | os.PathLike | None = None,
    prompts: Sequence[str] | None = None,
    top_k: int = 4,
    num_prompts: int = 3,
    max_bytes: int = MAX_REPORT_BYTES,
    link_base: str | os.PathLike | None = None,
) -> str:
    """The HTML text of the report for `run_dir` (and `compare` side by side, if given).

    prompts: prompts to show best/worst samples for; None = `choose_prompts(run, num_prompts)`
    of the first run (of the second when the first has no sample records).
    max_bytes: the report's size cap (UTF-8 bytes); images past it are linked, the per-epoch sample grids thinned
    evenly, and the report says what it left out. link_base: the folder the report will be written to (links to
    what is left out are relative to it); default run_dir.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    runs = [load_run(run_dir)] + ([load_run(compare)] if compare is not None else [])
    if len(runs) == 2 and runs[0].name == runs[1].name:
        # Same folder name under two logdirs: tell them apart in legends and headings.
        for run in runs:
            resolved = run.path.resolve()
            run.name = f"{resolved.parent.name}/{resolved.name}"
    sources = [sample_source(run) for run in runs]
    if prompts is None:
        chosen: list[str] = []
        for source in sources:
            chosen = chosen or ([] if source is None else _rank_prompts(source, num_prompts))
    else:
        chosen = list(prompts)
        known = set()
        for source in sources:
            if source is not None:
                known |= {r["prompt"] for r in source.records}
        unknown = [p for p in chosen if p not in known]
        if unknown:
            examples = ", ".join(repr(p) for p in sorted(known)[:5]) or "none (no samples/eval_XXXX.json or epoch_XXXX.json)"
            where = " or ".join(f"{run.path} ({source.short if source else 'no samples'})" for run, source in zip(runs, sources))
            raise ValueError(f"prompts: {unknown!r} not sampled in the samples the report shows of {where}; "
                             f"prompts there include: {examples}")
    inline = Inline(max_bytes - TEXT_RESERVE, Path(link_base) if link_base is not None else runs[0].path)
    title = " vs ".join(run.name for run in runs)
    grids = "<!-- sample grids -->"
    body = [
        f"<h1>ddpo-group run report: {_e(title)}</h1>",
        "<p>" + "<br>".join(_e(run.path) for run in runs) + "</p>",
        _headline_section(runs, sources),
        _summary_section(runs),
        _evaluation_section(runs, inline),
        hacking_section(runs),
        _prompts_section(runs, sources, chosen, top_k, inline),
        _curves_section(runs, inline),
        _steps_section(runs, inline),
        _config_section(runs),
        grids,  # last: the per-epoch sample grids get the room the rest leaves under the size cap
    ]
    head = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{_e(title)}</title><style>{CSS}</style></head>\n<body>\n")
    tail = "\n</body></html>\n"
    note_room = 4096  # the "left out" note written into the headline below
    used = len(head.encode()) + len(tail) + sum(len(part.encode()) + 1 for part in body) + note_room
    grids_html, grids_left = _grids_section(runs, inline, max(0, max_bytes - used))
    body[body.index(grids)] = grids_html
    left = [grids_left] if grids_left else []
    by_section: dict[str, int] = {}
    for section, _ in inline.left_out:
        by_section[section] = by_section.get(section, 0) + 1
    left += [f"{count} {section} (linked where they would be)" for section, count in by_section.items()]
    note = ""
    if left:
        note = (f'<p class="leftout">Left out of this report to keep it under {max_bytes / 2**20:.1f} MB: '
                + "; ".join(_e(item) for item in left) + ". The files are in the run directory.</p>")
    body = [part.replace(LEFT_OUT, note, 1) if LEFT_OUT in part else part for part in body]
    return head + "\n".join(body) + tail


def write_step_heatmaps(run_dirs: Sequence[str | os.PathLike], output: str | os.PathLike,
                        keys: Sequence[str] | None = None, names: Sequence[str] | None = None) -> Path:
    """Write the per-step heat maps of one or more runs (a column each) as one PNG, atomically.

    keys: "steps/..." metrics to draw (default: every one some run logged); names: column titles."""
    from ddpo_group.grids import atomic_write

    runs = [load_run(path) for path in run_dirs]
    for run, name in zip(runs, names or []):
        run.name = name
    unknown = [k for k in keys or [] if k not in STEP_LABELS]
    if unknown:
        raise ValueError(f"steps keys {unknown!r} unknown; choose from {list(STEP_LABELS)}")
    png = plot_step_heatmaps(runs, keys)
    if png is None:
        raise ValueError(
            f"no per-step metrics (steps/*) in {', '.join(str(r.path) for r in runs)}: "
            "runs written before they were logged have none; train again with this version"
        )
    output = Path(output)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(png)

    atomic_write(output, write)
    return output


def write_report(
    run_dir: str | os.PathLike,
    output: str | os.PathLike | None = None,
    compare: str | os.PathLike | None = None,
    prompts: Sequence[str] | None = None,
    top_k: int = 4,
    max_bytes: int = MAX_REPORT_BYTES,
) -> Path:
    """Build the report and write it (atomically) to `output`; default run_dir/report.html,
    or run_dir/report_vs_<compare name>.html with `compare`. Returns the path written."""
    from ddpo_group.grids import atomic_write

    if output is None:
        name = "report.html" if compare is None else f"report_vs_{Path(compare).resolve().name}.html"
        output = Path(run_dir) / name
    output = Path(output)
    text = build_report(run_dir, compare=compare, prompts=prompts, top_k=top_k, max_bytes=max_bytes,
                        link_base=output.resolve().parent)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(output, write)
    return output
