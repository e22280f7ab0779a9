"""The report page: its sections in order and the files it writes.

The report opens with a headline (status, and failed.json's reason when the run failed; variant, algorithm,
model, rewards, prompt set, epochs, wall time, seed, final and best evaluation) and the cost per epoch, then a summary that compares
evaluations and 5-epoch windows (single epochs are noise); the fixed-noise evaluation curve beside the
smoothed training reward with the fixed evaluation grids (first, middle, last; in compare mode a table whose
cell holds both runs' image of the same prompt and the same noise) and scripts/evaluate.py's evaluation.json
results; the per-prompt evaluation table (each prompt's first and last evaluation, the change, the reward's
components; the most regressed and most improved prompts as images; in compare mode both runs' means and
B - A); for a few prompts the best and worst samples of the final weights (the run's final evaluation,
samples/eval_XXXX.json marked "final"; runs without one: the last logged epoch's samples, and the report says
so); reward curves, kl / loss / clipfrac and the other scalar metrics (what kl is, from the config), the
reward's component curves, the time per phase, the per-step heat maps, the run's config, and the per-epoch
sample grids. Past the size cap (markup.MAX_REPORT_BYTES) the per-epoch sample grids are thinned evenly (the
first and the last kept) and what is left out is linked and counted at the top of the report.

Entry point: `ddpo-group-inspect` / scripts/inspect_run.py (ddpo_group.cli.inspect_main).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ddpo_group.data.edit_sources import edit_pairs_html
from ddpo_group.runs.grids import audio_samples_html, video_samples_html
from ddpo_group.evaluation.hacking import hacking_section
from ddpo_group.evaluation.protocol_report import protocol_tables_html, tag_evaluations_html
from ddpo_group.report.compare import paired_evaluation, prompt_means_table
from ddpo_group.report.figures import (
    STEP_LABELS,
    constant_notes,
    flat_over_steps,
    plot_components,
    plot_curves,
    plot_evaluation,
    plot_step_heatmaps,
    plot_phases,
    plot_times,
    step_keys,
)
from ddpo_group.report.markup import (
    CSS,
    Inline,
    LEFT_OUT,
    MAX_REPORT_BYTES,
    TEXT_RESERVE,
    data_uri_length,
    esc,
    fmt,
    img_tag,
    png_data_uri,
    sample_figure,
)
from ddpo_group.report.run import (
    RunData,
    SampleSource,
    config_value,
    finite,
    load_run,
    read_eval_records,
    read_json,
    sample_source,
)
from ddpo_group.report.tables import (
    PromptChange,
    config_section,
    headline_section,
    kl_note,
    prompt_changes,
    prompt_table,
    rank_prompts,
    summary_section,
)


def _steps_section(runs: Sequence[RunData], inline: Inline) -> str:
    png = plot_step_heatmaps(runs)
    header = "<h2>Per-step view</h2>"
    if png is None:
        return header + "<p>no per-step metrics (steps/*) in this run: it was written before they were logged</p>"
    flat = [STEP_LABELS[k] for k in step_keys(runs) if k != "steps/trained" and flat_over_steps(runs, k)]
    left = (f"<p class=\"small\">Not drawn: {esc(', '.join(flat))}: the same value at every step in every epoch, "
            "so a panel carries no information about the steps (the run's advantage estimator gives each trajectory "
            "one advantage, copied to every step; GRPO does). The per-epoch values are the curves above.</p>"
            if flat else "")
    return (
        header + "<p>Each panel is epoch (x) by denoising step (y, 0 = the noisiest, on top); grey cells had "
        "nothing to measure (no density, not trained, no critic); a column per run, one colour scale per row "
        "shared by the runs and stated above each panel. approx_kl is the k1 estimate of KL(pi_old || pi_theta) "
        "(how far an update moved the policy); KL to the reference is what the `kl` curve averages, split by step. "
        "What each quantity means: docs/diagnostics.md in the ddpo-group repository.</p>" + left
        + inline.plot(png, "per-step heat maps", "wide")
    )


def _three(epochs: Sequence[int]) -> list[int]:
    """First, middle and last of sorted epochs (fewer when there are fewer)."""
    return sorted({epochs[0], epochs[len(epochs) // 2], epochs[-1]}) if epochs else []


def _grid_share(run: RunData, epoch: int) -> str:
    """', the first 8 of 18 prompts' of an evaluation grid (its rows: the first config.eval_grid_prompts)."""
    if epoch not in run.eval_files:
        return ""
    document = read_json(run.eval_files[epoch])
    prompts = document.get("prompts") if isinstance(document, dict) else None
    rows = config_value(run.config, "eval_grid_prompts", 8)
    if not isinstance(prompts, list) or not isinstance(rows, int) or rows <= 0:
        return ""
    return f": the first {min(rows, len(prompts))} of {len(prompts)} prompts"


def _per_prompt_images(run: RunData, first: int, last: int, change: PromptChange, inline: Inline) -> str:
    """The prompt's images at the first and the last evaluation (the same noise), those kept in the files."""
    rows = []
    for epoch in dict.fromkeys((first, last)):
        _, records = read_eval_records(run, epoch)
        mine = sorted((r for r in records if r.get("prompt_index") == change.index), key=lambda r: r["image_index"])
        if mine:
            figures = "".join(sample_figure(r, f"r={r['reward']:.3f}", inline, "per-prompt images") for r in mine)
            rows.append(f'<div><p>after {epoch} epochs</p><div class="row">{figures}</div></div>')
    if not rows:
        return '<p class="small">no images of this prompt kept (the evaluation keeps those of its first prompts)</p>'
    return f'<div class="bw">{"".join(rows)}</div>'


def _per_prompt_section(runs: Sequence[RunData], inline: Inline, shown: int = 2) -> str:
    """Every evaluation prompt from the first to the last evaluation, sorted by change, the most regressed first;
    the `shown` most improved and most regressed prompts as images. Compare mode: compare.prompt_means_table."""
    parts = ["<h2>Per-prompt evaluation</h2>"]
    if len(runs) == 2:
        return "\n".join(parts + [prompt_means_table(runs)])
    run = runs[0]
    found = prompt_changes(run)
    if found is None:
        return parts[0] + "<p>no per-prompt rewards in the evaluation files (samples/eval_XXXX.json)</p>"
    first, last, changes = found
    moved = [c for c in changes if c.change is not None]
    worse = [c for c in moved if c.change < 0][:shown]
    better = [c for c in reversed(moved) if c.change > 0][:shown]
    parts.append(
        f'<p>Each prompt\'s mean reward over its {esc(config_value(run.config, "eval_images_per_prompt", ""))} '
        f"fixed-noise images after {first} and after {last} epochs, sorted by the change, the most regressed first "
        f"({sum(c.change < 0 for c in moved)} of {len(changes)} prompts got worse, "
        f"{sum(c.change > 0 for c in moved)} better). The component columns are the reward's own parts "
        "(reward_info), start &rarr; end.</p>")
    parts.append(prompt_table(first, last, changes))
    for title, chosen in (("Most regressed", worse), ("Most improved", better)):
        if not chosen:
            parts.append(f"<h3>{title}: none</h3>")
            continue
        for change in chosen:
            parts.append(f"<h3>{title}: {esc(change.prompt)}: {change.start:.3f} &rarr; {change.end:.3f} "
                         f"({change.change:+.3f})</h3>" + _per_prompt_images(run, first, last, change, inline))
    return "\n".join(parts)


def _evaluation_section(runs: Sequence[RunData], inline: Inline) -> str:
    parts = ["<h2>Evaluation</h2>"]
    figure = plot_evaluation(runs)
    if figure is None:
        parts.append("<p>no evaluation logged (set config.eval_freq, e.g. --config.eval_freq=10)</p>")
    else:
        parts.append(inline.plot(figure, "evaluation curve"))
    if len(runs) == 2 and all(run.eval_files for run in runs):
        parts.append(paired_evaluation(runs, inline))
    else:
        for run in runs:
            shown = _three(sorted(run.eval_grids))
            if not shown:
                continue
            cells = "".join(
                f'<div class="col"><h4>{esc(run.name)}: after {epoch} epochs{esc(_grid_share(run, epoch))}</h4>'
                f'{inline.file(run.eval_grids[epoch], f"eval grid {epoch}", "grid", "evaluation grids")}</div>'
                for epoch in shown
            )
            parts.append("<h3>Fixed evaluation grids: the same prompts and noise, first / middle / last (shown at "
                         f'their own size)</h3><div class="cols">{cells}</div>')
    for run in runs:
        if run.evaluations:
            rows = "".join(
                f"<tr><td>{esc(name)}</td><td>{esc(fmt(doc.get('mean')))}</td><td>{esc(doc.get('num_prompts', ''))} x "
                f"{esc(doc.get('images_per_prompt', ''))}</td><td>{esc(doc.get('prompts', ''))}</td></tr>"
                for name, doc in sorted(run.evaluations.items(), key=lambda item: int(item[0].split("_")[-1]))
            )
            parts.append(f"<h3>{esc(run.name)}: scripts/evaluate.py results (evaluation.json)</h3>"
                         f"<table><tr><th>checkpoint</th><th>mean</th><th>prompts x images</th><th>prompt set</th></tr>"
                         f"{rows}</table>")
    return "\n".join(parts)


def _curves_section(runs: Sequence[RunData], inline: Inline) -> str:
    panels = plot_curves(runs)
    parts = ["<h2>Curves</h2>"]
    if not panels:
        parts.append("<p>no numeric metrics logged yet</p>")
    parts.append('<div class="panels">' + "".join(inline.plot(png, key) for key, png in panels) + "</div>")
    notes = constant_notes(runs) + [kl_note(runs)]
    parts.append("".join(f'<p class="small">{esc(note)}.</p>' for note in notes if note))
    components = plot_components(runs)
    if components:
        parts.append("<h3>Reward components</h3><p class=\"small\">The reward's own parts as it logs them "
                     "(reward_info/&lt;reward&gt;/&lt;key&gt;: the mean over the epoch's samples; evaluation: over the "
                     "fixed-noise images); the per-prompt table above has them per prompt.</p>"
                     + '<div class="panels">' + "".join(inline.plot(png, key) for key, png in components) + "</div>")
    times = plot_times(runs)
    if times is not None:
        parts.append("<h3>Time per phase</h3>" + inline.plot(times, "time per phase"))
    phases = plot_phases(runs)
    if phases is not None:
        parts.append("<h3>Cost per phase</h3><p class=\"small\">Seconds per epoch and MFU (model FLOPs over seconds "
                     "over the device's peak, perf/peak_tflops) of each phase, from the perf/* metrics "
                     "(docs/performance.md).</p>" + inline.plot(phases, "cost per phase"))
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
    costs = [sum(data_uri_length(run.grids[e].stat().st_size) for run in runs if e in run.grids) + 400 for e in epochs]

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
        parts.append(f"<p class=\"small\">{esc(note)}.</p>")
    for i in chosen:
        epoch = epochs[i]
        cells = []
        for run in runs:
            if epoch in run.grids:
                uri = png_data_uri(run.grids[epoch].read_bytes())
                inline.used += len(uri)
                content = img_tag(uri, f"{run.name} epoch {epoch}", "grid")
            else:
                content = "<p>no grid</p>"
            label = f"<h4>{esc(run.name)}</h4>" if len(runs) > 1 else ""
            cells.append(f'<div class="col">{label}{content}</div>')
        parts.append(f'<h3>epoch {epoch}</h3><div class="pair">{"".join(cells)}</div>')
    parts.append(link_html)
    return "\n".join(parts), note


def _sample_cell(record: dict, inline: Inline) -> str:
    """A best / worst sample captioned with its reward (and a training sample's advantage)."""
    caption = f"r={record['reward']:.3f}"
    if "prompt_index" not in record:  # a training sample: it has an advantage (an evaluation image has none)
        advantage = finite(record.get("advantage"))
        caption += f" a={'n/a' if advantage is None else f'{advantage:+.2f}'}"
    return sample_figure(record, caption, inline, "best and worst samples", alt=f"sample {record.get('index', '')}")


def _prompts_section(runs: Sequence[RunData], sources: Sequence[SampleSource | None], prompts: Sequence[str],
                     top_k: int, inline: Inline) -> str:
    parts = [f"<h2>Best and worst samples (top {top_k} per prompt)</h2>"]
    for run, source in zip(runs, sources):
        who = f"{run.name}: " if len(runs) > 1 else ""
        parts.append(f"<p>{esc(who)}from {esc(source.label) if source else 'no sample records'}.</p>")
    if not prompts:
        return "\n".join(parts) + "<p>no sample records (samples/eval_XXXX.json or epoch_XXXX.json) to choose prompts from</p>"
    for prompt in prompts:
        parts.append(f"<h3>{esc(prompt)}</h3>")
        cells = []
        for run, source in zip(runs, sources):
            if source is None:
                cells.append(f'<div class="col"><p>{esc(run.name)}: no sample records</p></div>')
                continue
            mine = [r for r in source.records if r["prompt"] == prompt and finite(r.get("reward")) is not None]
            header = f"<h4>{esc(run.name)}, {esc(source.short)}</h4>" if len(runs) > 1 else ""
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


def run_labels(runs: Sequence[RunData]) -> list[str]:
    """Compare mode's default labels: a letter and the run's variant, 'A: tiny', 'B: tiny_group_ppo' (the folder
    name for a run without a recorded variant)."""
    labels = []
    for letter, run in zip("ABCDEFGH", runs):
        variant = config_value(run.config, "variant")
        labels.append(f"{letter}: {variant if isinstance(variant, str) and variant else run.path.name}")
    return labels


def _task_sections(runs) -> str:
    """What the task and modality modules render from a run directory, each "" when it does not apply: the
    evaluation protocols' tables (GenEval, OCR: evaluation/protocol_report.py), the animated grids of a video run
    (grids.video_samples_html), the sample soundtracks of a run with sound (grids.audio_samples_html) and the
    source -> edited pairs of an editing run (edit_sources.edit_pairs_html)."""
    parts = []
    for run in runs:
        fragments = [protocol_tables_html(str(run.path)), tag_evaluations_html(str(run.path)), video_samples_html(run.path),
                     video_samples_html(run.path, prefix="eval"), audio_samples_html(run.path),
                     edit_pairs_html(str(run.path))]
        fragments = [fragment for fragment in fragments if fragment]
        if fragments and len(runs) > 1:
            fragments.insert(0, f"<h2>{esc(run.name)}</h2>")
        parts += fragments
    return "\n".join(parts)


def build_report(
    run_dir: str | os.PathLike,
    compare: str | os.PathLike | None = None,
    prompts: Sequence[str] | None = None,
    top_k: int = 4,
    num_prompts: int = 3,
    max_bytes: int = MAX_REPORT_BYTES,
    link_base: str | os.PathLike | None = None,
    names: Sequence[str] | None = None,
) -> str:
    """The HTML text of the report for `run_dir` (and `compare` side by side, if given).

    prompts: prompts to show best/worst samples for; None = `choose_prompts(run, num_prompts)`
    of the first run (of the second when the first has no sample records).
    max_bytes: the report's size cap (UTF-8 bytes); images past it are linked, the per-epoch sample grids thinned
    evenly, and the report says what it left out. link_base: the folder the report will be written to (links to
    what is left out are relative to it); default run_dir. names: the two runs' labels in compare mode (every
    legend, header and caption); default `run_labels`.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    runs = [load_run(run_dir)] + ([load_run(compare)] if compare is not None else [])
    if names is not None and len(names) != len(runs):
        raise ValueError(f"names: expected {len(runs)} labels (one per run, e.g. --names A,B), got {len(names)}")
    if len(runs) == 2:
        for run, label in zip(runs, names or run_labels(runs)):
            run.name = label
    sources = [sample_source(run) for run in runs]
    if prompts is None:
        chosen: list[str] = []
        for source in sources:
            chosen = chosen or ([] if source is None else rank_prompts(source, num_prompts))
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
        f"<h1>ddpo-group run report: {esc(title)}</h1>",
        "<p>" + "<br>".join(esc(run.path) for run in runs) + "</p>",
        headline_section(runs, sources),
        summary_section(runs),
        _evaluation_section(runs, inline),
        _task_sections(runs),
        _per_prompt_section(runs, inline),
        hacking_section(runs),
        _prompts_section(runs, sources, chosen, top_k, inline),
        _curves_section(runs, inline),
        _steps_section(runs, inline),
        config_section(runs),
        grids,  # last: the per-epoch sample grids get the room the rest leaves under the size cap
    ]
    head = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body>\n")
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
                + "; ".join(esc(item) for item in left) + ". The files are in the run directory.</p>")
    body = [part.replace(LEFT_OUT, note, 1) if LEFT_OUT in part else part for part in body]
    return head + "\n".join(body) + tail


def write_step_heatmaps(run_dirs: Sequence[str | os.PathLike], output: str | os.PathLike,
                        keys: Sequence[str] | None = None, names: Sequence[str] | None = None) -> Path:
    """Write the per-step heat maps of one or more runs (a column each) as one PNG, atomically.

    keys: "steps/..." metrics to draw (default: every one some run logged); names: column titles."""
    from ddpo_group.runs.grids import atomic_write

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
    names: Sequence[str] | None = None,
) -> Path:
    """Build the report and write it (atomically) to `output`; default run_dir/report.html,
    or run_dir/report_vs_<compare name>.html with `compare`. Returns the path written."""
    from ddpo_group.runs.grids import atomic_write

    if output is None:
        name = "report.html" if compare is None else f"report_vs_{Path(compare).resolve().name}.html"
        output = Path(run_dir) / name
    output = Path(output)
    if output.is_dir():  # checked before the report is built: the rename onto a directory would fail at the end
        raise ValueError(f"cannot write the report to {output}: it is a directory; remove it, or pass --output "
                         "with the path of an .html file")
    text = build_report(run_dir, compare=compare, prompts=prompts, top_k=top_k, max_bytes=max_bytes,
                        link_base=output.resolve().parent, names=names)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    try:
        atomic_write(output, write)
    except OSError as err:  # a directory made meanwhile, no permission, a full disk: one line naming the file
        raise ValueError(f"cannot write the report to {output}: {err.strerror or err}; free or fix that path, or "
                         "pass --output with another .html file") from err
    return output
