"""The report's view of a run's evaluation protocols: an HTML fragment with each protocol's table.

``scripts/evaluate.py --protocol NAME --checkpoint RUN`` writes RUN/checkpoints/checkpoint_N/protocol_NAME.json
(ddpo_group/evaluation/protocols.py); ``protocol_tables_html(RUN)`` reads every such file and returns one table per
protocol, one row per evaluated checkpoint (oldest first): for GenEval the six tags, the overall score, % correct
images and % correct prompts; for GenEval 2 Soft-TIFA AM, GM and each skill's score; for a reward-mean protocol
the mean, its std and the number of images.
Reads JSON only: imports nothing of the package.
"""

from __future__ import annotations

import html
import json
import math
import os
import re

GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")
_PROTOCOL_RE = re.compile(r"^protocol_(\w+)\.json$")


def read_protocol_results(run_dir: str, left_out: list | None = None) -> dict[str, list[tuple[int, dict]]]:
    """{protocol: [(checkpoint step, its summary), ...] oldest first} of a run.

    A file that cannot be shown is skipped, and (path relative to the run, why) appended to `left_out`: one that
    is unreadable, not a summary (`malformed`), or outside the run directory (a link out of it: the report reads
    the run's own files only)."""
    left_out = [] if left_out is None else left_out
    root = os.path.join(run_dir, "checkpoints")
    real_run = os.path.realpath(run_dir)
    found: dict[str, list] = {}
    names = [n for n in os.listdir(root) if _CHECKPOINT_RE.match(n)] if os.path.isdir(root) else []
    for name in sorted(names, key=lambda n: int(_CHECKPOINT_RE.match(n)[1])):
        folder = os.path.join(root, name)
        for file in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            match = _PROTOCOL_RE.match(file)
            if not match:
                continue
            path = os.path.join(folder, file)
            relative = os.path.relpath(path, run_dir)
            if os.path.commonpath([real_run, os.path.realpath(path)]) != real_run:
                left_out.append((relative, "outside the run directory"))
                continue
            if not os.path.isfile(path):  # a FIFO or a device: reading it could block forever
                left_out.append((relative, "not a regular file"))
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    summary = json.load(f)
            except (OSError, ValueError) as err:
                left_out.append((relative, f"unreadable: {type(err).__name__}"))
                continue
            problem = malformed(match[1], summary)
            if problem:
                left_out.append((relative, problem))
                continue
            found.setdefault(match[1], []).append((int(_CHECKPOINT_RE.match(name)[1]), summary))
    return found


def malformed(protocol: str, summary) -> str | None:
    """Why `summary` is not a protocol summary the tables can show (None when it is one): an object whose shown
    fields, where present, are finite numbers (or null); for GenEval "tags" an object of {"score": ...} objects."""
    if not isinstance(summary, dict):
        return f"a JSON {type(summary).__name__}, not an object"
    fields = {key: summary.get(key) for key in ("overall", "correct_images", "correct_prompts", "mean", "std",
                                                 "soft_tifa_am", "soft_tifa_gm")}
    if protocol == "geneval2":
        skills = summary.get("skills", {})
        if not isinstance(skills, dict) or not all(isinstance(t, dict) for t in skills.values()):
            return '"skills" is not an object of {"score": ...} objects'
        fields.update({f"skills.{skill}.score": value.get("score") for skill, value in skills.items()})
    if protocol == "geneval":
        tags = summary.get("tags", {})
        if not isinstance(tags, dict) or not all(isinstance(t, dict) for t in tags.values()):
            return '"tags" is not an object of {"score": ...} objects'
        fields.update({f"tags.{tag}.score": value.get("score") for tag, value in tags.items()})
    for key, value in fields.items():
        if value is not None and _number(value) is None:
            return f"{key} is {str(value)[:40]}, not a finite number"
    return None


def _number(value) -> float | None:
    """`value` as a finite float (not a bool), else None: an integer too large for a float is None too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _cell(value, percent=False) -> str:
    value = _number(value)
    if value is None:
        return "<td>-</td>"
    return f"<td>{value:.1%}</td>" if percent else f"<td>{value:.3f}</td>"


def _geneval_table(rows) -> str:
    head = "".join(f"<th>{html.escape(tag)}</th>" for tag in GENEVAL_TAGS)
    lines = [f"<tr><th>checkpoint</th>{head}<th>overall</th><th>% correct images</th><th>% correct prompts</th></tr>"]
    for step, summary in rows:
        tags = summary.get("tags", {})
        cells = "".join(_cell(tags.get(tag, {}).get("score")) for tag in GENEVAL_TAGS)
        lines.append(f"<tr><td>{step}</td>{cells}{_cell(summary.get('overall'))}"
                     f"{_cell(summary.get('correct_images'), True)}{_cell(summary.get('correct_prompts'), True)}</tr>")
    return "\n".join(lines)


def _geneval2_table(rows) -> str:
    """GenEval 2: Soft-TIFA AM and GM, then each skill's atom-level score (the skills of any row, sorted)."""
    skills = sorted({skill for _, summary in rows for skill in summary.get("skills", {})})
    head = "".join(f"<th>{html.escape(skill)}</th>" for skill in skills)
    lines = [f"<tr><th>checkpoint</th><th>Soft-TIFA AM</th><th>Soft-TIFA GM</th>{head}</tr>"]
    for step, summary in rows:
        cells = "".join(_cell(summary.get("skills", {}).get(skill, {}).get("score")) for skill in skills)
        lines.append(f"<tr><td>{step}</td>{_cell(summary.get('soft_tifa_am'))}{_cell(summary.get('soft_tifa_gm'))}"
                     f"{cells}</tr>")
    return "\n".join(lines)


def _mean_table(rows) -> str:
    lines = ["<tr><th>checkpoint</th><th>mean</th><th>std</th><th>images</th></tr>"]
    for step, summary in rows:
        lines.append(f"<tr><td>{step}</td>{_cell(summary.get('mean'))}{_cell(summary.get('std'))}"
                     f"<td>{html.escape(str(summary.get('num_images', '-')))}</td></tr>")
    return "\n".join(lines)


def protocol_tables_html(run_dir: str) -> str:
    """One <h2> and <table> per protocol evaluated on the run's checkpoints, and a note naming each protocol file
    left out (`read_protocol_results`); "" when there is none."""
    parts, left_out = [], []
    for protocol, rows in sorted(read_protocol_results(run_dir, left_out).items()):
        table = {"geneval": _geneval_table, "geneval2": _geneval2_table}.get(protocol, _mean_table)(rows)
        parts.append(f'<h2>Protocol {html.escape(protocol)}</h2>\n<table class="protocol">\n{table}\n</table>')
    parts += [f'<p class="leftout">Protocol results left out: {html.escape(path)} ({html.escape(why)})</p>'
              for path, why in left_out]
    return "\n".join(parts)


def tag_evaluations_html(run_dir: str, per_tag: int = 4) -> str:
    """The report's fragment of a run evaluated on tagged prompts (GenEval records, e.g. the scenes world's
    held-out set): the table of eval/<reward>/<tag> over the run's evaluations (metrics.jsonl), and the first and
    the last evaluation's images of `per_tag` prompts of each tag side by side (samples/eval_XXXX.json records
    with a "tag"), each marked by its verdict where the evaluation logged one (reward_info "<reward>/correct").
    "" for a run without tagged evaluations. Files outside the run directory are never read."""
    import base64
    import glob

    from ddpo_group.report.run import inside_run

    rows = []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and inside_run(metrics, run_dir):
        with open(metrics, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and any(k.startswith("eval/") and k.endswith("/overall") for k in row):
                    rows.append(row)
    if not rows:
        return ""
    reward = next(k for k in rows[-1] if k.startswith("eval/") and k.endswith("/overall"))[len("eval/"):-len("/overall")]
    tags = [t for t in GENEVAL_TAGS if f"eval/{reward}/{t}" in rows[-1]]
    header = "".join(f"<th>epoch {html.escape(str(row.get('epoch')))}</th>" for row in rows)
    body = "".join(
        f"<tr><td>{html.escape(name)}</td>" + "".join(f"<td>{_score_text(row.get(f'eval/{reward}/{name}'))}</td>" for row in rows)
        + "</tr>" for name in tags + ["overall"])
    parts = [f"<section><h2>Held-out evaluation by tag ({html.escape(reward)})</h2>",
             f"<table><tr><th>tag</th>{header}</tr>{body}</table>"]
    samples = os.path.join(run_dir, "samples")
    documents = [d for d in sorted(glob.glob(os.path.join(samples, "eval_[0-9][0-9][0-9][0-9].json")))
                 if inside_run(d, run_dir)]
    loaded = []
    for path in (documents[:1] + documents[-1:]) if len(documents) > 1 else []:
        try:
            with open(path, encoding="utf-8") as f:
                loaded.append(json.load(f))
        except (OSError, ValueError):
            return "\n".join(parts) + "</section>"

    def image(record):
        rel = str(record.get("image", ""))
        path = os.path.join(samples, rel)
        if not rel or not inside_run(path, run_dir) or not os.path.isfile(path):
            return '<span class="missing">not shown</span>'
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
        return f'<img src="data:image/png;base64,{data}" style="width:96px;image-rendering:pixelated">'

    def verdict(document, record):
        values = (document.get("reward_info") or {}).get(f"{reward}/correct")
        try:
            value = values[record["prompt_index"]][record["image_index"]]
        except (TypeError, KeyError, IndexError):
            return ""
        return " &#10003;" if value == 1 else " &#10007;" if value == 0 else ""

    if len(loaded) == 2:
        first, last = loaded
        by_key = {(r.get("prompt_index"), r.get("image_index")): r for r in first.get("records", [])}
        cells = []
        for name in tags:
            chosen = [r for r in last.get("records", []) if r.get("tag") == name and r.get("image_index") == 0]
            for record in chosen[:per_tag]:
                before = by_key.get((record.get("prompt_index"), 0))
                if before is None:
                    continue
                cells.append(f"<tr><td>{html.escape(name)}</td><td>{html.escape(str(record.get('prompt', '')))}</td>"
                             f"<td>{image(before)}{verdict(first, before)}</td>"
                             f"<td>{image(record)}{verdict(last, record)}</td></tr>")
        if cells:
            parts.append(f"<h3>The same prompts and noise: epoch {html.escape(str(first.get('epoch')))} and epoch "
                         f"{html.escape(str(last.get('epoch')))} (&#10003; correct by GenEval's rules)</h3>"
                         f"<table><tr><th>tag</th><th>prompt</th><th>first</th><th>last</th></tr>{''.join(cells)}</table>")
    return "\n".join(parts) + "</section>"


def _score_text(value) -> str:
    """A table cell's score: three decimals, "-" for anything that is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    try:
        return f"{float(value):.3f}" if math.isfinite(float(value)) else "-"
    except OverflowError:
        return "-"
