"""The report's view of a run's evaluation protocols: an HTML fragment with each protocol's table.

``scripts/evaluate.py --protocol NAME --checkpoint RUN`` writes RUN/checkpoints/checkpoint_N/protocol_NAME.json
(ddpo_group/protocols.py); ``protocol_tables_html(RUN)`` reads every such file and returns one table per
protocol, one row per evaluated checkpoint (oldest first): for GenEval the six tags, the overall score, % correct
images and % correct prompts; for a reward-mean protocol the mean, its std and the number of images.
Reads JSON only: imports nothing of the package.
"""

from __future__ import annotations

import html
import json
import os
import re

GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")
_PROTOCOL_RE = re.compile(r"^protocol_(\w+)\.json$")


def read_protocol_results(run_dir: str) -> dict[str, list[tuple[int, dict]]]:
    """{protocol: [(checkpoint step, its summary), ...] oldest first} of a run; unreadable files are skipped."""
    root = os.path.join(run_dir, "checkpoints")
    found: dict[str, list] = {}
    names = [n for n in os.listdir(root) if _CHECKPOINT_RE.match(n)] if os.path.isdir(root) else []
    for name in sorted(names, key=lambda n: int(_CHECKPOINT_RE.match(n)[1])):
        folder = os.path.join(root, name)
        for file in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            match = _PROTOCOL_RE.match(file)
            if not match:
                continue
            try:
                with open(os.path.join(folder, file)) as f:
                    summary = json.load(f)
            except (OSError, ValueError):
                continue
            found.setdefault(match[1], []).append((int(_CHECKPOINT_RE.match(name)[1]), summary))
    return found


def _cell(value, percent=False) -> str:
    if not isinstance(value, (int, float)):
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


def _mean_table(rows) -> str:
    lines = ["<tr><th>checkpoint</th><th>mean</th><th>std</th><th>images</th></tr>"]
    for step, summary in rows:
        lines.append(f"<tr><td>{step}</td>{_cell(summary.get('mean'))}{_cell(summary.get('std'))}"
                     f"<td>{html.escape(str(summary.get('num_images', '-')))}</td></tr>")
    return "\n".join(lines)


def protocol_tables_html(run_dir: str) -> str:
    """One <h2> and <table> per protocol evaluated on the run's checkpoints; "" when there is none."""
    parts = []
    for protocol, rows in sorted(read_protocol_results(run_dir).items()):
        table = _geneval_table(rows) if protocol == "geneval" else _mean_table(rows)
        parts.append(f'<h2>Protocol {html.escape(protocol)}</h2>\n<table class="protocol">\n{table}\n</table>')
    return "\n".join(parts)
