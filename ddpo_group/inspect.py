"""Run inspection: one self-contained HTML report for a run directory (or two, side by side).

The report shows a summary that compares evaluations and 5-epoch windows (single epochs are
noise), the fixed-noise evaluation curve beside the smoothed training reward with the fixed
evaluation grids (first, middle, last) and scripts/evaluate.py's evaluation.json results, the
run's config, reward curves (reward_mean +- reward_std, each reward/<component> and
eval/<component>), kl / loss / clipfrac and the other scalar metrics that were logged,
the time per phase, the per-epoch sample grids, and for a few prompts the best and worst
samples of the last logged epoch with their rewards and advantages. Every image is embedded
as a base64 data URI, so the single .html file can be moved and opened anywhere.

A run directory is what the trainer writes (docs/CONTRACTS.md, "run directory"):

    run_dir/metrics.jsonl          one JSON object per epoch (required)
    run_dir/config.json            the run's config (optional)
    run_dir/samples/epoch_XXXX.png / .json / epoch_XXXX/NNN.png   (ddpo_group.grids, optional)

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
RUN_STYLES = ("-", "--")
_SAMPLE_JSON = re.compile(r"^epoch_(\d+)\.json$")
_SAMPLE_PNG = re.compile(r"^epoch_(\d+)\.png$")
_EVAL_PNG = re.compile(r"^eval_(\d+)\.png$")
SMOOTHING = 5  # epochs in the training reward's moving average and in the summary's windows


@dataclass
class RunData:
    """What the report reads from one run directory."""

    path: Path
    config: dict | None
    metrics: list[dict]
    grids: dict[int, Path] = field(default_factory=dict)  # epoch -> samples/epoch_XXXX.png
    sample_files: dict[int, Path] = field(default_factory=dict)  # epoch -> samples/epoch_XXXX.json
    eval_grids: dict[int, Path] = field(default_factory=dict)  # epoch -> samples/eval_XXXX.png
    evaluations: dict[str, dict] = field(default_factory=dict)  # checkpoint name -> its evaluation.json
    name: str = ""  # label in legends and headings; the folder name by default

    def __post_init__(self):
        self.name = self.name or self.path.name


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Parse metrics.jsonl: one JSON object per line (blank lines skipped)."""
    path = Path(path)
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
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


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Read metrics.jsonl, config.json (if present) and the list of sample epochs of a run."""
    path = Path(run_dir)
    if not path.exists():
        raise ValueError(f"run directory {path} does not exist; {RUN_DIR_HELP}")
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory; {RUN_DIR_HELP}")
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ValueError(f"{metrics_path} not found; {RUN_DIR_HELP}")
    metrics = read_metrics(metrics_path)
    config_path = path / "config.json"
    config = _read_json(config_path) if config_path.is_file() else None
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    run = RunData(path=path, config=config, metrics=metrics)
    samples_dir = path / "samples"
    if samples_dir.is_dir():
        for entry in sorted(samples_dir.iterdir()):
            if match := _SAMPLE_PNG.match(entry.name):
                run.grids[int(match.group(1))] = entry
            elif match := _SAMPLE_JSON.match(entry.name):
                run.sample_files[int(match.group(1))] = entry
            elif match := _EVAL_PNG.match(entry.name):
                run.eval_grids[int(match.group(1))] = entry
    for evaluation in sorted(path.glob("checkpoints/checkpoint_*/evaluation.json")):
        document = _read_json(evaluation)
        if isinstance(document, dict):
            run.evaluations[evaluation.parent.name] = document
    return run


def read_sample_records(run: RunData, epoch: int) -> list[dict]:
    """Records of samples/epoch_XXXX.json, each with `image_path` (absolute Path) added."""
    path = run.sample_files[epoch]
    document = _read_json(path)
    records = document.get("records") if isinstance(document, dict) else document
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a list of records or an object with a 'records' list")
    out = []
    for i, record in enumerate(records):
        if not isinstance(record, dict) or "prompt" not in record or "reward" not in record:
            raise ValueError(f"{path}: record {i} must be an object with at least 'prompt' and 'reward'")
        record = dict(record)
        image = record.get("image")
        record["image_path"] = None
        if image:
            image_path = (path.parent / str(image)).resolve()
            if not image_path.is_relative_to(run.path.resolve()):
                # a samples file names images of its run only: nothing outside the run directory is embedded
                record["outside"] = str(image)
            else:
                record["image_path"] = image_path
        out.append(record)
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


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


def _figure_png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def _new_axes(title: str):
    # Figure + Agg canvas directly: no pyplot, no global backend switch in the caller's process.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(4.6, 3.0), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("epoch", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return fig, ax


def plot_curves(runs: Sequence[RunData]) -> list[tuple[str, bytes]]:
    """One PNG per metric panel: reward_mean +- reward_std, then each other logged scalar (runs overlaid)."""
    panels = []
    colors = ("tab:blue", "tab:orange")
    if any(metric_series(run.metrics, "reward_mean")[0] for run in runs):
        fig, ax = _new_axes("reward_mean +- reward_std")
        for i, run in enumerate(runs):
            xs, means = metric_series(run.metrics, "reward_mean")
            if not xs:
                continue
            ax.plot(xs, means, RUN_STYLES[i], color=colors[i], label=run.name, marker="." if len(xs) < 30 else None)
            by_epoch = dict(zip(*metric_series(run.metrics, "reward_std")))
            band = [(x, m, by_epoch[x]) for x, m in zip(xs, means) if x in by_epoch]
            if band:
                bx, bm, bs = zip(*band)
                ax.fill_between(bx, [m - s for m, s in zip(bm, bs)], [m + s for m, s in zip(bm, bs)],
                                color=colors[i], alpha=0.2)
        ax.legend(fontsize=8)
        panels.append(("reward_mean +- reward_std", _figure_png(fig)))
    for key in _keys_in_order(runs):
        fig, ax = _new_axes(key)
        for i, run in enumerate(runs):
            xs, ys = metric_series(run.metrics, key)
            if xs:
                ax.plot(xs, ys, RUN_STYLES[i], color=colors[i], label=run.name, marker="." if len(xs) < 30 else None)
        ax.legend(fontsize=8)
        panels.append((key, _figure_png(fig)))
    return panels


def plot_times(runs: Sequence[RunData]) -> bytes | None:
    """Seconds per phase (time/sample, time/reward, time/train) per epoch; None when none was logged."""
    if not any(metric_series(run.metrics, key)[0] for run in runs for key in TIME_KEYS):
        return None
    fig, ax = _new_axes("time per phase (s)")
    fig.set_size_inches(6.0, 3.2)
    for i, run in enumerate(runs):
        for key, color in zip(TIME_KEYS, ("tab:green", "tab:purple", "tab:red")):
            xs, ys = metric_series(run.metrics, key)
            if xs:
                label = key if len(runs) == 1 else f"{run.name}: {key}"
                ax.plot(xs, ys, RUN_STYLES[i], color=color, label=label)
    ax.legend(fontsize=7)
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


def _steps_section(runs: Sequence[RunData]) -> str:
    png = plot_step_heatmaps(runs)
    header = "<h2>Per-step view</h2>"
    if png is None:
        return header + "<p>no per-step metrics (steps/*) in this run: it was written before they were logged</p>"
    return (
        header + "<p>Each panel is epoch (x) by denoising step (y, 0 = the noisiest, on top); grey cells had "
        "nothing to measure (no density, not trained, no critic). What each quantity means: docs/diagnostics.md "
        "in the ddpo-group repository.</p>" + _img(_png_data_uri(png), "per-step heat maps", "wide")
    )


def _mean_reward_by_prompt(records: Sequence[dict]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for record in records:
        reward = _number(record.get("reward"))
        if reward is not None:
            sums.setdefault(record["prompt"], []).append(reward)
    return {prompt: sum(v) / len(v) for prompt, v in sums.items()}


def choose_prompts(run: RunData, num_prompts: int = 3) -> list[str]:
    """The `num_prompts` prompts of the last sample epoch whose mean reward changed most.

    change(p) = |mean reward of p in the last sample epoch - mean reward of p in the first|;
    prompts absent from the first epoch (or a single sample epoch) rank after, by first appearance.
    """
    if not run.sample_files:
        return []
    epochs = sorted(run.sample_files)
    last = read_sample_records(run, epochs[-1])
    order = list(dict.fromkeys(record["prompt"] for record in last))
    last_means = _mean_reward_by_prompt(last)
    first_means = _mean_reward_by_prompt(read_sample_records(run, epochs[0])) if len(epochs) > 1 else {}

    def rank(item: tuple[int, str]):
        position, prompt = item
        if prompt in first_means and prompt in last_means:
            return (0, -abs(last_means[prompt] - first_means[prompt]), position)
        return (1, 0.0, position)

    return [prompt for _, prompt in sorted(enumerate(order), key=rank)[:num_prompts]]


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _img(data_uri: str, alt: str, css_class: str = "") -> str:
    cls = f' class="{css_class}"' if css_class else ""
    return f'<img{cls} src="{data_uri}" alt="{_e(alt)}">'


def _file_img(path: Path | None, alt: str, css_class: str = "") -> str:
    if path is None or not path.is_file():
        return f'<span class="missing">missing image: {_e(path)}</span>'
    return _img(_png_data_uri(path.read_bytes()), alt, css_class)


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
        cells.append(f'<div class="col"><details><summary>{_e(run.name)}: config.json</summary>{body}</details></div>')
    parts.append(f'<div class="cols">{"".join(cells)}</div>')
    return "\n".join(parts)


def smoothed(xs: Sequence[float], ys: Sequence[float], window: int = SMOOTHING) -> list[float]:
    """Trailing mean of ys over the last `window` points (fewer at the start)."""
    return [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]


def plot_evaluation(runs: Sequence[RunData]) -> bytes | None:
    """eval/reward_mean (fixed noise) per evaluation, beside the training reward_mean smoothed over SMOOTHING epochs."""
    if not any(metric_series(run.metrics, "eval/reward_mean")[0] for run in runs):
        return None
    colors = ("tab:blue", "tab:orange")
    fig, ax = _new_axes(f"evaluation (fixed noise) and training reward ({SMOOTHING}-epoch mean)")
    for i, run in enumerate(runs):
        xs, ys = metric_series(run.metrics, "eval/reward_mean")
        if xs:
            ax.plot(xs, ys, RUN_STYLES[i], color=colors[i], marker="o", label=f"{run.name} eval/reward_mean")
        xs, ys = metric_series(run.metrics, "reward_mean")
        if xs:
            ax.plot(xs, smoothed(xs, ys), ":", color=colors[i], label=f"{run.name} reward_mean, {SMOOTHING}-epoch mean")
    ax.set_xlabel("epoch (evaluations: weights after that many epochs)")
    ax.legend(fontsize=8)
    return _figure_png(fig)


def _window_mean(values: Sequence[float], first: bool) -> str:
    if not values:
        return ""
    part = values[:SMOOTHING] if first else values[-SMOOTHING:]
    return f"{sum(part) / len(part):.4f}"


def _evaluation_section(runs: Sequence[RunData]) -> str:
    parts = ["<h2>Evaluation</h2>"]
    figure = plot_evaluation(runs)
    if figure is None:
        parts.append("<p>no evaluation logged (set config.eval_freq, e.g. --config.eval_freq=10)</p>")
    else:
        parts.append(_img(_png_data_uri(figure), "evaluation curve", "plot"))
    for run in runs:
        epochs = sorted(run.eval_grids)
        if epochs:
            shown = sorted({epochs[0], epochs[len(epochs) // 2], epochs[-1]})
            cells = "".join(
                f'<div class="col"><h4>{_e(run.name)}: after {epoch} epochs</h4>'
                f'{_file_img(run.eval_grids[epoch], f"eval grid {epoch}", "grid")}</div>'
                for epoch in shown
            )
            parts.append(f"<h3>Fixed evaluation grids: the same prompts and noise, first / middle / last</h3>"
                         f'<div class="cols">{cells}</div>')
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


def _curves_section(runs: Sequence[RunData]) -> str:
    panels = plot_curves(runs)
    parts = ["<h2>Curves</h2>"]
    if not panels:
        parts.append("<p>no numeric metrics logged yet</p>")
    parts.append('<div class="panels">' + "".join(_img(_png_data_uri(png), key, "plot") for key, png in panels) + "</div>")
    times = plot_times(runs)
    if times is not None:
        parts.append("<h3>Time per phase</h3>" + _img(_png_data_uri(times), "time per phase", "plot"))
    return "\n".join(parts)


def _grids_section(runs: Sequence[RunData]) -> str:
    epochs = sorted(set().union(*(run.grids for run in runs)))
    parts = ["<h2>Sample grids</h2>"]
    if not epochs:
        return parts[0] + "<p>no sample grids (samples/epoch_XXXX.png) in this run</p>"
    for epoch in epochs:
        cells = []
        for run in runs:
            content = _file_img(run.grids[epoch], f"{run.name} epoch {epoch}", "grid") if epoch in run.grids else "<p>no grid</p>"
            label = f"<h4>{_e(run.name)}</h4>" if len(runs) > 1 else ""
            cells.append(f'<div class="col">{label}{content}</div>')
        parts.append(f'<h3>epoch {epoch}</h3><div class="cols">{"".join(cells)}</div>')
    return "\n".join(parts)


def _sample_cell(record: dict) -> str:
    advantage = _number(record.get("advantage"))
    caption = f"r={record['reward']:.3f} a={'n/a' if advantage is None else f'{advantage:+.2f}'}"
    if record.get("outside"):
        image = f'<span class="missing">not shown: {_e(record["outside"])} is outside the run directory</span>'
    else:
        image = _file_img(record.get("image_path"), f"sample {record.get('index', '')}", "sample")
    return f'<figure>{image}<figcaption>{_e(caption)}</figcaption></figure>'


def _prompts_section(runs: Sequence[RunData], prompts: Sequence[str], top_k: int) -> str:
    parts = [f"<h2>Best and worst samples (last sample epoch, top {top_k})</h2>"]
    if not prompts:
        return parts[0] + "<p>no sample records (samples/epoch_XXXX.json) to choose prompts from</p>"
    last_records = {}
    for run in runs:
        if run.sample_files:
            epoch = max(run.sample_files)
            last_records[run.name] = (epoch, read_sample_records(run, epoch))
    for prompt in prompts:
        parts.append(f"<h3>{_e(prompt)}</h3>")
        cells = []
        for run in runs:
            if run.name not in last_records:
                cells.append(f'<div class="col"><p>{_e(run.name)}: no sample records</p></div>')
                continue
            epoch, records = last_records[run.name]
            mine = [r for r in records if r["prompt"] == prompt and _number(r.get("reward")) is not None]
            header = f"<h4>{_e(run.name)}, epoch {epoch}</h4>" if len(runs) > 1 else f"<h4>epoch {epoch}</h4>"
            if not mine:
                cells.append(f'<div class="col">{header}<p>not sampled in this epoch</p></div>')
                continue
            ranked = sorted(mine, key=lambda r: r["reward"], reverse=True)
            shown = min(top_k, (len(ranked) + 1) // 2)  # best and worst never show the same image twice
            best = "".join(_sample_cell(r) for r in ranked[:shown])
            worst = "".join(_sample_cell(r) for r in ranked[shown:][::-1][:top_k])
            cells.append(
                f'<div class="col">{header}<p>best</p><div class="row">{best}</div>'
                f'<p>worst</p><div class="row">{worst}</div></div>'
            )
        parts.append(f'<div class="cols">{"".join(cells)}</div>')
    return "\n".join(parts)


CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1em; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; }
.cols { display: flex; gap: 1.5em; align-items: flex-start; }
.col { flex: 1; min-width: 0; }
.panels { display: flex; flex-wrap: wrap; gap: 0.5em; }
img.grid { max-width: 100%; image-rendering: pixelated; }
img.wide { max-width: 100%; }
img.sample { width: 96px; image-rendering: pixelated; }
.row { display: flex; flex-wrap: wrap; gap: 6px; }
figure { margin: 0; font-size: 0.8em; text-align: center; width: 100px; overflow-wrap: anywhere; }
pre { font-size: 0.8em; background: #f6f6f6; padding: 0.5em; overflow-x: auto; }
.missing { color: #a00; font-size: 0.8em; }
"""


def build_report(
    run_dir: str | os.PathLike,
    compare: str | os.PathLike | None = None,
    prompts: Sequence[str] | None = None,
    top_k: int = 4,
    num_prompts: int = 3,
) -> str:
    """The HTML text of the report for `run_dir` (and `compare` side by side, if given).

    prompts: prompts to show best/worst samples for; None = `choose_prompts(run, num_prompts)`
    of the first run (of the second when the first has no sample records).
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    runs = [load_run(run_dir)] + ([load_run(compare)] if compare is not None else [])
    if len(runs) == 2 and runs[0].name == runs[1].name:
        # Same folder name under two logdirs: tell them apart in legends and headings.
        for run in runs:
            resolved = run.path.resolve()
            run.name = f"{resolved.parent.name}/{resolved.name}"
    if prompts is None:
        chosen: list[str] = []
        for run in runs:
            chosen = chosen or choose_prompts(run, num_prompts)
    else:
        chosen = list(prompts)
        known = set()
        for run in runs:
            if run.sample_files:
                known |= {r["prompt"] for r in read_sample_records(run, max(run.sample_files))}
        unknown = [p for p in chosen if p not in known]
        if unknown:
            examples = ", ".join(repr(p) for p in sorted(known)[:5]) or "none (no samples/epoch_XXXX.json)"
            raise ValueError(
                f"prompts: {unknown!r} not sampled in the last sample epoch of "
                f"{' or '.join(str(run.path) for run in runs)}; prompts there include: {examples}"
            )
    title = " vs ".join(run.name for run in runs)
    body = [
        f"<h1>ddpo-group run report: {_e(title)}</h1>",
        "<p>" + "<br>".join(_e(run.path) for run in runs) + "</p>",
        _summary_section(runs),
        _evaluation_section(runs),
        hacking_section(runs),
        _config_section(runs),
        _curves_section(runs),
        _steps_section(runs),
        _grids_section(runs),
        _prompts_section(runs, chosen, top_k),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


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
) -> Path:
    """Build the report and write it (atomically) to `output`; default run_dir/report.html,
    or run_dir/report_vs_<compare name>.html with `compare`. Returns the path written."""
    from ddpo_group.grids import atomic_write

    text = build_report(run_dir, compare=compare, prompts=prompts, top_k=top_k)
    if output is None:
        name = "report.html" if compare is None else f"report_vs_{Path(compare).resolve().name}.html"
        output = Path(run_dir) / name
    output = Path(output)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(output, write)
    return output
