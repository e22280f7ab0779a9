"""The compare page's own parts (`ddpo-group-inspect RUN --compare RUN2`): the fixed evaluation images of both
runs side by side, a cell per (prompt, image) with the same prompt and the same noise in both runs.
"""

from __future__ import annotations

from typing import Sequence

from ddpo_group.report.markup import Inline, esc, sample_figure
from ddpo_group.report.run import RunData, config_value, finite, read_eval_records
from ddpo_group.report.tables import prompt_changes

COMPARE_PROMPTS = 8  # prompts in compare mode's paired evaluation table


def _paired_table(runs: Sequence[RunData], documents: Sequence[dict], records: Sequence[list[dict]],
                  inline: Inline) -> str:
    """Both runs' evaluation images, a cell per (prompt, image): run A's and run B's image of the same prompt and the
    same noise side by side (image j of prompt i starts from noise seeded by (seed, i, j) in both)."""
    seeds = [doc.get("seed", config_value(run.config, "eval_seed")) for run, doc in zip(runs, documents)]
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
            # a cell names its run by the label's letter ("A: tiny" -> "A") where there is one: captions stay short
            short = [run.name.split(":")[0] if ":" in run.name[:3] else run.name for run in runs]
            captions = [f"{name}: r={r['reward']:.3f}" if r is not None and finite(r.get("reward")) is not None
                        else f"{name}: none" for name, r in zip(short, (first, second))]
            cells.append(
                f'<td class="cell" data-cell="{i},{j}" data-same-noise="{str(same_noise).lower()}">'
                f'<div class="pair">{sample_figure(first, captions[0], inline, "evaluation images")}'
                f'{sample_figure(second, captions[1], inline, "evaluation images")}</div>{flag}</td>'
            )
        mean_a, mean_b = (_prompt_means(doc).get(prompt) for doc in documents)
        means = ""
        if mean_a is not None and mean_b is not None:
            means = (f'<br><span class="small">{esc(runs[0].name)}: {mean_a:.3f}<br>{esc(runs[1].name)}: {mean_b:.3f}'
                     f"<br>B - A: {mean_b - mean_a:+.3f}</span>")
        rows.append(f'<tr><th class="prompt">{esc(prompt)}{means}</th>{"".join(cells)}</tr>')
    if other_noise and same_seed:
        notes.append(f"{other_noise} cells pair a prompt that sits at another place in the second run's prompt list: "
                     "the same prompt, other noise")
    header = "".join(f"<th>image {j}</th>" for j in images)
    note = f'<p class="small">{esc("; ".join(notes))}</p>' if notes else ""
    return (f'{note}<div class="scroll"><table class="paired"><tr><th>prompt</th>{header}</tr>{"".join(rows)}'
            "</table></div>")


def paired_evaluation(runs: Sequence[RunData], inline: Inline) -> str:
    """Compare mode: at the first and middle common evaluation and at each run's last, a table whose cell holds
    both runs' image of one prompt and one noise."""
    epochs = [sorted(run.eval_files) for run in runs]
    common = sorted(set(epochs[0]) & set(epochs[1]))
    pairs = [(e, e) for e in sorted({common[0], common[len(common) // 2]})] if common else []
    pairs = list(dict.fromkeys(pairs + [(epochs[0][-1], epochs[1][-1])]))
    parts = ["<h3>Fixed evaluation images side by side: in each cell the same prompt and the same noise, "
             f"{esc(runs[0].name)} left, {esc(runs[1].name)} right</h3>"]
    for epoch_a, epoch_b in pairs:
        (doc_a, rec_a), (doc_b, rec_b) = read_eval_records(runs[0], epoch_a), read_eval_records(runs[1], epoch_b)
        if epoch_a == epoch_b:
            title = f"after {epoch_a} epochs"
        else:
            title = f"{runs[0].name} after {epoch_a} epochs, {runs[1].name} after {epoch_b} epochs"
        if doc_a.get("final") and doc_b.get("final"):
            title += " (the final weights)"
        parts.append(f"<h4>{esc(title)}</h4>" + _paired_table(runs, (doc_a, doc_b), (rec_a, rec_b), inline))
    return "\n".join(parts)


def _prompt_means(document: dict) -> dict[str, float]:
    """Mean reward per prompt (its text) from an evaluation document's "prompts" and (P, J) "rewards"."""
    rows = document.get("rewards") if isinstance(document.get("rewards"), list) else []
    prompts = document.get("prompts") if isinstance(document.get("prompts"), list) else []
    means = {}
    for prompt, row in zip(prompts, rows):
        values = [finite(v) for v in (row if isinstance(row, list) else [])]
        values = [v for v in values if v is not None]
        if values:
            means.setdefault(str(prompt), sum(values) / len(values))
    return means


def prompt_means_table(runs: Sequence[RunData]) -> str:
    """Compare mode: per evaluation prompt, each run's mean reward at its last evaluation (and its change since its
    first), and B - A; sorted by B - A. Prompts are matched by their text."""
    found = [prompt_changes(run) for run in runs]
    if any(f is None for f in found):
        return "<p>per-prompt rewards are missing from the evaluation files of a run (samples/eval_XXXX.json)</p>"
    by_prompt = [{c.prompt: c for c in f[2]} for f in found]
    common = [p for p in by_prompt[0] if p in by_prompt[1]]
    if not common:
        return "<p>the two runs evaluate no prompt in common</p>"
    rows = sorted(common, key=lambda p: by_prompt[1][p].end - by_prompt[0][p].end)
    a, b = runs[0].name, runs[1].name
    header = (f"<tr><th>prompt</th><th>{esc(a)} after {found[0][1]}</th><th>{esc(a)} change</th>"
              f"<th>{esc(b)} after {found[1][1]}</th><th>{esc(b)} change</th><th>B - A</th></tr>")
    body = []
    for p in rows:
        ca, cb = by_prompt[0][p], by_prompt[1][p]
        diff = cb.end - ca.end
        css = ' class="worse"' if diff < 0 else ' class="better"' if diff > 0 else ""
        cells = [esc(p), f"{ca.end:.3f}", "" if ca.change is None else f"{ca.change:+.3f}", f"{cb.end:.3f}",
                 "" if cb.change is None else f"{cb.change:+.3f}", f"{diff:+.3f}"]
        body.append(f"<tr{css}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    mean_diff = sum(by_prompt[1][p].end - by_prompt[0][p].end for p in common) / len(common)
    return (f"<p>Each run's mean reward per prompt at its last evaluation (change: since its first); B - A = "
            f"{esc(b)} minus {esc(a)}, mean over the {len(common)} common prompts {mean_diff:+.3f}; sorted by "
            f'B - A.</p><div class="scroll"><table class="prompts">{header}{"".join(body)}</table></div>')
