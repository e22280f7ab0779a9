"""The report's figures (matplotlib, Agg canvas, no pyplot): metric curves, time per phase, the fixed-noise
evaluation curve, and the per-step heat maps (epoch x denoising step). Each function returns PNG bytes.
"""

from __future__ import annotations

import io
import math
import textwrap
from typing import Sequence

from ddpo_group.report.run import RunData, SMOOTHING, finite, metric_series, step_matrix

# Panels after the reward panels, in this order, when the key was logged.
SCALAR_KEYS = ("kl", "approx_kl", "clipfrac", "loss")
SCALAR_PREFIXES = ("group/", "tracker/", "critic/")
TIME_KEYS = ("time/sample", "time/reward", "time/train")
RUN_STYLES = ("-", "--")
RUN_COLORS = ("tab:blue", "tab:orange")


def _keys_in_order(runs: Sequence[RunData]) -> list[str]:
    """Metric keys to plot after reward_mean, in report order, each logged by at least one run."""
    seen: list[str] = []
    for run in runs:
        for row in run.metrics:
            for key in row:
                if key not in seen and finite(row[key]) is not None:
                    seen.append(key)
    components = sorted(k for k in seen if k.startswith("reward/") or (
        k.startswith("eval/") and k != "eval/reward_mean" and not k.startswith("eval/reward_info/")))
    scalars = [k for k in SCALAR_KEYS if k in seen]
    prefixed = [k for prefix in SCALAR_PREFIXES for k in sorted(seen) if k.startswith(prefix)]
    rest = [k for k in ("peak_rss_mb",) if k in seen]
    return components + scalars + prefixed + rest


def literal_text(fig) -> None:
    """Draw every text of the figure as written: run names, metric keys, reward names and prompts are the user's,
    and matplotlib reads text between two `$` as mathtext (a name such as "a$_$b" is no formula: the figure
    would fail to draw)."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        text.set_parse_math(False)


def _figure_png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    literal_text(fig)
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
        if key in CONSTANT_MEANINGS and constant_value(runs, key) is not None:
            continue  # a flat line that reads as the opposite of the truth: explained under the panels instead
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


# What a metric that stays constant over the run means, where its value alone reads as the opposite of the truth.
CONSTANT_MEANINGS = {
    "group/efficiency_gain": "N / K, the noisy steps per trained endpoint; with a one-step SDE window N = K = 1, so it "
                             "says 1.0 (no saving) although the window itself is the saving: compare the model calls "
                             "of training (train/unet_calls, the headline's cost row) with a run that trains every step",
    "group/compression_ratio": "1 - K / N; 0 with a one-step SDE window (N = K = 1), not a sign that nothing is "
                               "compressed: only one step is noisy, and that one is trained",
}


def constant_value(runs: Sequence[RunData], key: str) -> float | None:
    """The value of `key` when every run logged it at least twice and never anything else; else None."""
    values = [metric_series(run.metrics, key)[1] for run in runs]
    logged = [v for v in values if v]
    if not logged or any(len(v) < 2 for v in logged):
        return None
    first = logged[0][0]
    return first if all(x == first for v in logged for x in v) else None


def constant_notes(runs: Sequence[RunData]) -> list[str]:
    """One sentence per curve left out because it stayed constant and its value alone misleads (CONSTANT_MEANINGS):
    'group/efficiency_gain = 1 at every epoch: ...'."""
    notes = []
    for key in _keys_in_order(runs):
        value = constant_value(runs, key) if key in CONSTANT_MEANINGS else None
        if value is not None:
            notes.append(f"{key} = {value:.4g} at every epoch, not drawn: {CONSTANT_MEANINGS[key]}")
    return notes


def component_keys(runs: Sequence[RunData], prefix: str) -> dict[str, list[str]]:
    """{reward: [its info keys]} of the metrics `prefix`<reward>/<key> some run logged (prefix "reward_info/" for
    training, "eval/reward_info/" for the evaluation)."""
    found: dict[str, list[str]] = {}
    for run in runs:
        for row in run.metrics:
            for key, value in row.items():
                if key.startswith(prefix) and finite(value) is not None and "/" in key[len(prefix):]:
                    reward, _, part = key[len(prefix):].rpartition("/")
                    if part not in found.setdefault(reward, []):
                        found[reward].append(part)
    return found


def plot_components(runs: Sequence[RunData]) -> list[tuple[str, bytes]]:
    """One panel per reward and phase (training, evaluation): each logged info key of the reward over the epochs
    (reward_info/<reward>/<key>; evaluation: eval/reward_info/<reward>/<key>), a colour per key, a line style
    per run."""
    from matplotlib import colormaps

    panels = []
    for prefix, phase in (("reward_info/", "training"), ("eval/reward_info/", "evaluation")):
        for reward, parts in component_keys(runs, prefix).items():
            fig, ax = _new_axes(f"{reward}: its components, {phase} ({prefix}{reward}/<key>)", size=(5.2, 3.4))
            colors = colormaps["tab10"]
            for i, run in enumerate(runs):
                for c, part in enumerate(parts):
                    xs, ys = metric_series(run.metrics, f"{prefix}{reward}/{part}")
                    if xs:
                        label = part if len(runs) == 1 else f"{run.name}: {part}"
                        ax.plot(xs, ys, RUN_STYLES[i], color=colors(c % 10), label=label,
                                marker="o" if phase == "evaluation" or len(xs) < 30 else None, markersize=3)
            _legend_below(fig, ax, fontsize=7)
            panels.append((f"{prefix}{reward}", _figure_png(fig)))
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


PERF_PHASES = ("sampling", "decoding", "reward", "old_log_probs", "reference", "training", "critic", "evaluation",
               "checkpoint")  # ddpo_group/training/perf.py's phases, in the order an epoch makes them


def phase_costs(run: RunData) -> dict[str, tuple[float, float | None]]:
    """{phase: (mean seconds per epoch that had it, MFU or None)} from the run's perf/<phase>_seconds,
    perf/<phase>_tflops and perf/peak_tflops rows (MFU = TFLOPs / seconds / peak over those rows)."""
    costs = {}
    for phase in PERF_PHASES:
        rows = [r for r in run.metrics if finite(r.get(f"perf/{phase}_seconds")) is not None]
        if not rows:
            continue
        seconds = sum(r[f"perf/{phase}_seconds"] for r in rows)
        peaked = [r for r in rows if finite(r.get("perf/peak_tflops")) and finite(r.get(f"perf/{phase}_tflops"))]
        work = sum(r[f"perf/{phase}_tflops"] / r["perf/peak_tflops"] for r in peaked)
        busy = sum(r[f"perf/{phase}_seconds"] for r in peaked)
        costs[phase] = (seconds / len(rows), work / busy if work > 0 and busy > 0 else None)
    return costs


def plot_phases(runs: Sequence[RunData]) -> bytes | None:
    """One bar per phase: seconds per epoch and MFU (perf/* rows, ddpo_group/training/perf.py), a run's bars beside
    the other's on the compare page; None when no run logged them."""
    costs = [phase_costs(run) for run in runs]
    phases = [p for p in PERF_PHASES if any(p in c for c in costs)]
    if not phases:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.4))
    width = 0.8 / len(runs)
    for column, (title, index, scale) in enumerate((("seconds per epoch", 0, 1.0), ("MFU (%)", 1, 100.0))):
        ax = fig.add_subplot(1, 2, column + 1)
        ax.set_title(title, fontsize=9)
        for i, (run, cost) in enumerate(zip(runs, costs)):
            values = [(cost.get(p) or (0.0, None))[index] for p in phases]
            ax.bar([n + (i - (len(runs) - 1) / 2) * width for n in range(len(phases))],
                   [0.0 if v is None else v * scale for v in values], width, color=RUN_COLORS[i],
                   label=run.name if len(runs) > 1 else None)
        ax.set_xticks(range(len(phases)))
        ax.set_xticklabels(phases, rotation=35, ha="right", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    if len(runs) > 1:
        fig.axes[0].legend(fontsize=7)
    fig.tight_layout()
    return _figure_png(fig)


STEP_LABELS = {
    "steps/trained": "trained (1) or not (0)",
    "steps/adv_mean": "advantage mean",
    "steps/adv_std": "advantage std",
    "steps/grad_share": "share of the policy gradient",
    "steps/approx_kl": "approx_kl (k1)",
    "steps/kl": "KL to the reference",
    "steps/clipfrac": "clipfrac",
    "steps/ratio_std": "ratio std",
    "steps/log_ratio_mean": "log-ratio mean",
    "steps/log_ratio_std": "log-ratio std",
    "steps/norm_log_ratio_mean": "normalised log-ratio mean (GRPO-Guard)",
    "steps/norm_log_ratio_std": "normalised log-ratio std (GRPO-Guard)",
    "steps/kl_old": "exact KL to pi_old's step",
    "steps/value_error": "critic (V - R)^2",
    "steps/explained_variance": "critic explained variance",
    "steps/step_reward": "reward of the step's x0_hat",
    "steps/step_gain": "step reward gain",
}


def step_keys(runs: Sequence[RunData]) -> list[str]:
    """The per-step metrics some run logged with at least one number, in STEP_LABELS' order."""
    return [
        key for key in STEP_LABELS
        if any(any(math.isfinite(v) for r in step_matrix(run.metrics, key)[1] for v in r) for run in runs)
    ]


FIXED_RANGE_KEYS = ("steps/trained", "steps/grad_share", "steps/clipfrac")  # shares: always drawn on [0, 1]


def flat_over_steps(runs: Sequence[RunData], key: str) -> bool:
    """Whether every run's `key` holds, in every epoch, one value at all its measured steps (up to 1e-6 relative):
    a panel of it carries no information about the steps (GRPO's advantage: one per trajectory, copied to each
    step, so its per-step mean and std are the same at every step)."""
    import numpy as np

    seen = False
    for run in runs:
        for row in step_matrix(run.metrics, key)[1]:
            values = np.array([v for v in row if math.isfinite(v)])
            if len(values) > 1:
                seen = True
                if np.ptp(values) > 1e-6 * max(1.0, float(np.abs(values).max())):
                    return False
    return seen


def step_scale(runs: Sequence[RunData], key: str) -> tuple[float, float, str]:
    """(vmin, vmax, what the scale is) of `key`'s heat maps, one scale shared by every run's panel: [0, 1] for the
    shares, symmetric about 0 for the advantage mean, else the range of the values; when a few cells would
    saturate the colours (the largest value more than 3 inter-percentile ranges above the 98th percentile, e.g.
    approx_kl in the first epoch), the 2nd to 98th percentile, stated on the panel, brighter cells drawn at the
    top colour."""
    import numpy as np

    values = np.array([v for run in runs for row in step_matrix(run.metrics, key)[1] for v in row if math.isfinite(v)])
    if key in FIXED_RANGE_KEYS:
        return 0.0, 1.0, "scale 0 to 1"
    if not len(values):
        return 0.0, 1.0, ""
    low, high = float(values.min()), float(values.max())
    note = "scale: min to max" + (" of both runs" if len(runs) > 1 else "")
    if high - low <= 1e-4 * max(abs(low), abs(high), 1.0):
        # constant up to rounding (a group-normalised advantage's mean and std): no colour noise
        return low - 0.5 * max(abs(low), 1e-3), high + 0.5 * max(abs(high), 1e-3), "constant"
    if key == "steps/adv_mean":
        bound = max(abs(low), abs(high))
        return -bound, bound, "scale symmetric about 0"
    p2, p98 = (float(x) for x in np.percentile(values, [2, 98]))
    if p98 > p2 and high > p98 + 3 * (p98 - p2):
        return p2, p98, f"robust scale: 2nd-98th percentile (max {high:.3g} at the top colour)"
    return low, high, note


def plot_step_heatmaps(runs: Sequence[RunData], keys: Sequence[str] | None = None) -> bytes | None:
    """One PNG of epoch x step heat maps: a row per per-step metric, a column per run (step 0, the noisiest,
    on top; grey = nothing measured there), one colour scale per row shared by its runs (`step_scale`, stated
    on each panel). Without `keys`: every logged one but those flat over the steps (`flat_over_steps`).
    None when no run logged per-step metrics."""
    if keys is None:
        keys = [k for k in step_keys(runs) if k == "steps/trained" or not flat_over_steps(runs, k)]
    keys = [k for k in keys if k in STEP_LABELS]
    keys = [k for k in keys if any(step_matrix(run.metrics, k)[0] for run in runs)]
    if not keys:
        return None
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(3.6 * len(runs) + 0.6, 2.0 * len(keys) + 0.4), layout="constrained")
    axes = fig.subplots(len(keys), len(runs), squeeze=False)
    for row, key in enumerate(keys):
        low, high, scale = step_scale(runs, key)
        for col, run in enumerate(runs):
            ax = axes[row][col]
            epochs, matrix = step_matrix(run.metrics, key)
            ax.tick_params(labelsize=7)
            title = (run.name + "\n" if row == 0 else "") + textwrap.fill(scale, 48)
            ax.set_title(title, fontsize=7 if row else 8)
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
            x0, x1 = (epochs[0] - 0.5, epochs[-1] + 0.5) if len(epochs) > 1 else (epochs[0] - 0.5, epochs[0] + 0.5)
            image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, vmin=low, vmax=high,
                              extent=(x0, x1, data.shape[0] - 0.5, -0.5))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            bar = fig.colorbar(image, ax=ax, shrink=0.9, extend="max" if scale.startswith("robust") else "neither")
            bar.ax.tick_params(labelsize=7)
            bar.formatter.set_useOffset(False)
            bar.update_ticks()
    return _figure_png(fig)


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
