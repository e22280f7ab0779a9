"""The reward-hacking monitor: the training (proxy) reward against evaluation-only "gold" rewards.

With `config.eval_rewards` set, every fixed-noise evaluation scores its images with the training
reward (eval/reward_mean, eval/reward_std) and with each gold reward (eval/gold/<name>_mean,
eval/gold/<name>_std). This module decides when the two tell different stories and draws them.

The divergence rule. Over the evaluations so far, e_0 (the first) .. e_n (the latest), with p the proxy
mean, g a gold mean, and s_p, s_g their standard deviations over the images of e_0 (the spread of one
image's reward, so the rule is the same for rewards of any scale):

    proxy rise  = p_n - p_0                       (the proxy above its start)
    gold fall   = max(g_0 .. g_n) - g_n           (the gold below its best so far: its start, or a later peak)
    diverged at e_n  <=>  n >= 1, proxy rise >= MARGIN * s_p and gold fall >= MARGIN * s_g

MARGIN = 0.25: a quarter of the per-image spread (with 144 images the standard error of a mean is a
twelfth of it, so the flag is no accident of the evaluation's noise). A zero spread counts as a tiny one.
The rule reads means only, so it holds for a run resumed from its metrics.jsonl exactly as for one
that never stopped. Flat, falling or jointly moving curves never flag; a gold that rises, peaks and
falls back by the margin while the proxy keeps its gain does (over-optimisation).

    divergence(proxy, gold, proxy_std0, gold_std0) -> index of the first evaluation that diverged, or None
    diverged_at(...)                                -> the rule at every evaluation (list of bools)
    gold_names(metrics rows)                        -> the gold rewards a run logged
    plot_proxy_vs_gold(runs), hacking_section(runs) -> the report's figure and HTML (ddpo_group/report/)

`runs` are objects with `.name` and `.metrics` (the rows of metrics.jsonl): report.run.RunData.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Sequence

MARGIN = 0.25
GOLD_PREFIX = "eval/gold/"
PROXY_KEY, PROXY_STD_KEY = "eval/reward_mean", "eval/reward_std"
_TINY = 1e-12


def gold_specs(eval_rewards) -> list[str]:
    """The reward specs of config.eval_rewards (comma-separated; blanks ignored)."""
    return [spec.strip() for spec in str(eval_rewards or "").split(",") if spec.strip()]


def gold_key(name: str, stat: str = "mean") -> str:
    """The metric of gold reward `name`: eval/gold/<name>_mean, _std or _diverged."""
    return f"{GOLD_PREFIX}{name}_{stat}"


def diverged_at(proxy: Sequence[float], gold: Sequence[float], proxy_std0: float, gold_std0: float,
                margin: float = MARGIN) -> list[bool]:
    """The divergence rule (module docstring) at each evaluation of the two series of equal length."""
    if len(proxy) != len(gold):
        raise ValueError(f"proxy and gold series differ in length ({len(proxy)} vs {len(gold)})")
    flags = []
    best = -math.inf
    for n, (p, g) in enumerate(zip(proxy, gold)):
        best = max(best, g)
        rise, fall = p - proxy[0], best - g
        flags.append(n >= 1 and rise >= margin * max(proxy_std0, _TINY) and fall >= margin * max(gold_std0, _TINY))
    return flags


def divergence(proxy: Sequence[float], gold: Sequence[float], proxy_std0: float, gold_std0: float,
               margin: float = MARGIN) -> int | None:
    """Index of the first evaluation at which the proxy rose and the gold fell by the margin, or None."""
    flags = diverged_at(proxy, gold, proxy_std0, gold_std0, margin)
    return flags.index(True) if True in flags else None


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def gold_names(metrics: Sequence[dict]) -> list[str]:
    """The gold rewards logged in metrics rows (keys eval/gold/<name>_mean), in first-seen order."""
    names: list[str] = []
    for row in metrics:
        for key in row:
            if key.startswith(GOLD_PREFIX) and key.endswith("_mean"):
                name = key[len(GOLD_PREFIX) : -len("_mean")]
                if name not in names:
                    names.append(name)
    return names


def evaluation_series(metrics: Sequence[dict], name: str):
    """(epochs, proxy means, gold means, proxy std at the first, gold std at the first) over the rows that
    logged both the proxy and gold reward `name`."""
    epochs, proxy, gold, stds = [], [], [], None
    for i, row in enumerate(metrics):
        p, g = _number(row.get(PROXY_KEY)), _number(row.get(gold_key(name)))
        if p is None or g is None:
            continue
        epoch = _number(row.get("epoch"))
        epochs.append(i if epoch is None else epoch)
        proxy.append(p)
        gold.append(g)
        if stds is None:
            stds = (_number(row.get(PROXY_STD_KEY)) or 0.0, _number(row.get(gold_key(name, "std"))) or 0.0)
    return epochs, proxy, gold, *(stds or (0.0, 0.0))


def describe(metrics: Sequence[dict], name: str) -> dict:
    """The rule applied to a run's rows for gold reward `name`: {"epochs", "proxy", "gold", "flags", "first"
    (epoch of the first divergence or None), "rise", "fall", "peak_epoch"} at that first divergence (else at
    the last evaluation)."""
    epochs, proxy, gold, proxy_std0, gold_std0 = evaluation_series(metrics, name)
    flags = diverged_at(proxy, gold, proxy_std0, gold_std0)
    at = flags.index(True) if True in flags else len(epochs) - 1
    out = {"epochs": epochs, "proxy": proxy, "gold": gold, "flags": flags, "first": None, "rise": None,
           "fall": None, "peak_epoch": None}
    if at >= 0:
        peak = max(range(at + 1), key=lambda i: gold[i])
        out.update(rise=proxy[at] - proxy[0], fall=gold[peak] - gold[at], peak_epoch=epochs[peak])
        out["first"] = epochs[at] if flags[at] else None
    return out


def plot_proxy_vs_gold(runs, name: str, title: str | None = None) -> bytes:
    """PNG of the proxy (eval/reward_mean, left axis, solid) and gold reward `name` (right axis, dashed) over the
    evaluations of each run, the first divergence of each run marked by a vertical line and shading after it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(5.2, 3.2 + 0.15 * len(runs)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    gold_ax = ax.twinx()
    shades = ("tab:blue", "tab:cyan", "tab:purple", "tab:olive")
    golds = ("tab:red", "tab:orange", "tab:brown", "tab:pink")
    flagged = []
    for i, run in enumerate(runs):
        d = describe(run.metrics, name)
        if not d["epochs"]:
            continue
        label = f" {run.name}" if len(runs) > 1 else ""
        ax.plot(d["epochs"], d["proxy"], "-o", color=shades[i % 4], markersize=3, label=f"proxy{label}")
        gold_ax.plot(d["epochs"], d["gold"], "--s", color=golds[i % 4], markersize=3, label=f"gold {name}{label}")
        if d["first"] is not None:
            flagged.append(d["first"])
            ax.axvline(d["first"], color=golds[i % 4], linewidth=1, alpha=0.8)
            ax.axvspan(d["first"], d["epochs"][-1], color=golds[i % 4], alpha=0.07)
    proxy_name = next((_proxy_name(run) for run in runs if _proxy_name(run)), "training reward")
    ax.set_ylabel(f"proxy: {proxy_name} (eval mean)", fontsize=8)
    gold_ax.set_ylabel(f"gold: {name} (eval mean)", fontsize=8)
    ax.set_xlabel("epoch (evaluations: weights after that many epochs)", fontsize=8)
    ax.tick_params(labelsize=7)
    gold_ax.tick_params(labelsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if not flagged:
        verdict = "no divergence"
    elif len(runs) == 1:
        verdict = f"diverged at epoch {flagged[0]:g}"
    else:
        verdict = f"{len(flagged)} of {len(runs)} runs diverged (lines)"
    ax.set_title(title or f"proxy vs gold {name}: {verdict}", fontsize=9)
    lines = ax.get_legend_handles_labels()
    gold_lines = gold_ax.get_legend_handles_labels()
    fig.legend(lines[0] + gold_lines[0], lines[1] + gold_lines[1], fontsize=6, loc="outside lower center",
               ncol=2, frameon=False)
    from matplotlib.text import Text

    for text in fig.findobj(Text):  # reward and run names drawn as written, never as mathtext ("a$_$b" is none)
        text.set_parse_math(False)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def _proxy_name(run) -> str:
    config = getattr(run, "config", None) or {}
    weights = config.get("reward_weights") or {}
    return " + ".join(f"{w:g} {k}" for k, w in weights.items()) if weights else str(config.get("reward_fn") or "")


def hacking_section(runs) -> str:
    """The report's "proxy vs gold" section: per gold reward the figure and, per run, the verdict of the rule."""
    e = html.escape
    parts = ["<h2>Reward hacking: proxy vs gold</h2>"]
    names = []
    for run in runs:
        names += [n for n in gold_names(run.metrics) if n not in names]
    if not names:
        parts.append("<p>no gold rewards logged (set config.eval_rewards, e.g. --config.eval_rewards=shapes_alignment, "
                     "with config.eval_freq: each evaluation then scores its images with those rewards too)</p>")
        return "\n".join(parts)
    parts.append(f"<p>Divergence: the proxy (training reward, eval/reward_mean) at least {MARGIN:g} of its first "
                 f"evaluation's per-image std above its first evaluation while a gold reward is at least {MARGIN:g} "
                 "of its own first std below its best evaluation so far (ddpo_group/evaluation/hacking.py).</p>")
    for name in names:
        uri = "data:image/png;base64," + base64.b64encode(plot_proxy_vs_gold(runs, name)).decode("ascii")
        parts.append(f'<img class="plot" src="{uri}" alt="proxy vs gold {e(name)}">')
        items = []
        for run in runs:
            d = describe(run.metrics, name)
            if not d["epochs"]:
                continue
            if d["first"] is not None:
                items.append(
                    f'<li class="hacking-flag"><b>{e(run.name)}: DIVERGED at epoch {d["first"]:g}</b>: the proxy rose '
                    f'{d["rise"]:+.4f} since epoch {d["epochs"][0]:g} while gold {e(name)} fell {d["fall"]:.4f} below '
                    f'its best (epoch {d["peak_epoch"]:g})</li>')
            else:
                rise = "" if d["rise"] is None else f' (proxy {d["rise"]:+.4f}, gold {-d["fall"]:+.4f} from its best)'
                items.append(f"<li>{e(run.name)}: no divergence over {len(d['epochs'])} evaluations{rise}</li>")
        parts.append("<ul>" + "".join(items) + "</ul>")
    return "\n".join(parts)
