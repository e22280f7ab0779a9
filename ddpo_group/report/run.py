"""Reading a run directory back: metrics.jsonl, config.json, the end markers and the sample / evaluation files.

A run directory is what the trainer writes (docs/CONTRACTS.md, "run directory"):

    run_dir/metrics.jsonl          one JSON object per epoch (required, unless the run failed or stopped before it)
    run_dir/config.json            the run's config (optional)
    run_dir/failed.json, stopped.json, resumes.jsonl    how the run ended, its resumes (optional)
    run_dir/samples/epoch_XXXX.png / .json / epoch_XXXX/NNN.png   (ddpo_group.runs.grids, optional)
    run_dir/samples/eval_XXXX.png / .json / eval_XXXX/NNN.png     (ddpo_group.evaluation.evaluator, optional)

`read_metrics` is metrics.jsonl's one reading rule (the resume in runs/run_dir.py and evaluation/evaluator.py use it too).
Nothing here draws or writes HTML; the report's other modules read runs through this one.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

RUN_DIR_HELP = (
    "expected a run directory written by the trainer (logdir/run_name) containing metrics.jsonl "
    "(one JSON object per epoch), and optionally config.json and samples/"
)
# The phases of an epoch that do not overlap (time/old_log_probs is part of time/train): their sum is the
# headline's wall time.
PHASE_KEYS = ("time/sample", "time/reward", "time/advantages", "time/train", "time/critic", "time/eval")
_SAMPLE_JSON = re.compile(r"^epoch_(\d+)\.json$")
_SAMPLE_PNG = re.compile(r"^epoch_(\d+)\.png$")
_EVAL_PNG = re.compile(r"^eval_(\d+)\.png$")
_EVAL_JSON = re.compile(r"^eval_(\d+)\.json$")
_CHECKPOINT = re.compile(r"^checkpoint_\d+$")
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
    eval_files: dict[int, Path] = field(default_factory=dict)  # epoch -> samples/eval_XXXX.json
    evaluations: dict[str, dict] = field(default_factory=dict)  # checkpoint name -> its evaluation.json
    failed: dict | None = None  # failed.json: the run stopped on an error
    stopped: dict | None = None  # stopped.json: a signal stopped the run before num_epochs
    resumes: list[dict] = field(default_factory=list)  # resumes.jsonl rows
    torn_metrics_line: int | None = None  # metrics.jsonl's last line, cut off mid-write and left out
    outside: list[str] = field(default_factory=list)  # run files (links) that lead outside the run directory: not read
    malformed: list[str] = field(default_factory=list)  # "path (why)" of optional files that cannot be shown: left out
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


def read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None


def _read_marker(path: Path | None) -> dict | None:
    """failed.json / stopped.json as a dict, None when absent; an unreadable one still says the run ended so."""
    if path is None or not path.is_file():
        return None
    try:
        document = read_json(path)
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
    root = path.resolve()
    outside = [name for name in ("metrics.jsonl", "config.json", "failed.json", "stopped.json", "resumes.jsonl")
               if os.path.lexists(path / name) and not _inside(path / name, root)]

    def own(name: str) -> Path | None:
        """The run's file `name`, None when it is a link out of the run directory (left out, and said)."""
        return None if name in outside else path / name

    metrics_path = path / "metrics.jsonl"
    failed, stopped = _read_marker(own("failed.json")), _read_marker(own("stopped.json"))
    torn = []
    if own("metrics.jsonl") is not None and metrics_path.is_file():
        metrics = read_metrics(metrics_path, torn=torn)
    elif failed is not None or stopped is not None or "metrics.jsonl" in outside:
        metrics = []
    else:
        raise ValueError(f"{metrics_path} not found; {RUN_DIR_HELP}")
    config_path = own("config.json")
    config = read_json(config_path) if config_path is not None and config_path.is_file() else None
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    resumes = own("resumes.jsonl")
    run = RunData(path=path, config=config, metrics=metrics, failed=failed, stopped=stopped,
                  resumes=_read_resumes(resumes) if resumes is not None else [],
                  torn_metrics_line=torn[0] if torn else None, outside=outside)
    samples_dir = path / "samples"
    if samples_dir.is_dir() and not _inside(samples_dir, root):
        run.outside.append("samples")
    elif samples_dir.is_dir():
        for entry in sorted(samples_dir.iterdir()):
            if not _inside(entry, root):
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
        if not _CHECKPOINT.match(evaluation.parent.name):
            continue
        if not _inside(evaluation, root):
            run.outside.append(str(evaluation.relative_to(path)))
            continue
        try:  # scripts/evaluate.py's result: one that cannot be read is left out, the report goes on
            document = read_json(evaluation)
        except (OSError, ValueError) as err:
            run.malformed.append(f"{evaluation.relative_to(path)} ({type(err).__name__})")
            continue
        if isinstance(document, dict):
            run.evaluations[evaluation.parent.name] = document
        else:
            run.malformed.append(f"{evaluation.relative_to(path)} (a JSON {type(document).__name__}, not an object)")
    return run


def _read_records(run: RunData, path: Path, evaluation: bool = False) -> tuple[dict, list[dict]]:
    """(document, records) of a samples JSON (epoch_XXXX.json or eval_XXXX.json); each record gets `image_path`
    (an absolute Path inside the run directory, or None) and, for evaluation files, prompt_index / image_index."""
    document = read_json(path)
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
            if not _inside(image_path, root):
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
            values = [v for v in (row if isinstance(row, list) else []) if finite(v) is not None]
            if values:
                means[str(prompt)] = sum(values) / len(values)
        return means
    return mean_reward_by_prompt(records)


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
    first_means = mean_reward_by_prompt(read_sample_records(run, epochs[0])) if len(epochs) > 1 else {}
    return SampleSource(
        records=last, final=False, short=f"training samples of epoch {epochs[-1]}, not the final weights",
        label=f"the training samples of epoch {epochs[-1]} (the last logged sample epoch: the weights after "
              f"{epochs[-1]} epochs, random noise), not the final weights: this run has no final-evaluation "
              "records (written before they were kept, eval_freq=0, or it ended before its final evaluation)",
        first_means=first_means,
    )


def finite(value: Any) -> float | None:
    """`value` as a float when it is a finite number (not a bool), else None; an int too large for a float
    (JSON allows any number of digits) is None too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def inside_run(path: str | os.PathLike, run_dir: str | os.PathLike) -> bool:
    """Whether `path` (links resolved) lies inside the run directory `run_dir`: the one rule of every reader of
    the report (a file a run names elsewhere, or a link out of it, is never read: a shared run would leak its
    reader's files)."""
    try:
        return _inside(Path(path), Path(run_dir).resolve())
    except (OSError, RuntimeError):
        return False


def _inside(path: Path, root: Path) -> bool:
    """Whether `path` resolves to a place inside `root` (a resolved path); a link loop or a link that cannot be
    resolved is not inside, nor is a FIFO, socket or device (reading one blocks or never ends: the report reads
    regular files and folders only)."""
    try:
        resolved = path.resolve()
        if resolved.exists() and not (resolved.is_file() or resolved.is_dir()):
            return False
        return resolved.is_relative_to(root)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13); OSError from 3.13 on
        return False


def metric_series(metrics: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    """(x, y) of a metric over the rows that logged a finite number for it; x = epoch (row index if absent)."""
    xs, ys = [], []
    for i, row in enumerate(metrics):
        y = finite(row.get(key))
        if y is None:
            continue
        x = finite(row.get("epoch"))
        xs.append(i if x is None else x)
        ys.append(y)
    return xs, ys


def step_matrix(metrics: Sequence[dict], key: str) -> tuple[list[float], list[list[float]]]:
    """(epochs, rows) of a per-step metric (docs/diagnostics.md): one row per epoch row that logged a list
    for `key`, one float per denoising step, NaN where the step had nothing to measure (null); rows padded
    with NaN to the longest. ([], []) when no row logged it (runs from before the per-step metrics)."""
    epochs, rows = [], []
    for i, row in enumerate(metrics):
        values = row.get(key)
        if not isinstance(values, list):
            continue
        x = finite(row.get("epoch"))
        epochs.append(i if x is None else x)
        rows.append([float("nan") if finite(v) is None else float(v) for v in values])
    width = max((len(r) for r in rows), default=0)
    return epochs, [r + [float("nan")] * (width - len(r)) for r in rows]


def mean_reward_by_prompt(records: Sequence[dict]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for record in records:
        reward = finite(record.get("reward"))
        if reward is not None:
            sums.setdefault(record["prompt"], []).append(reward)
    return {prompt: sum(v) / len(v) for prompt, v in sums.items()}


def config_value(config: dict | None, dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def trained_epochs(run: RunData) -> int:
    """Epochs trained: 1 + the last epoch of a training row (the final evaluation's eval_only row is not one)."""
    epochs = [finite(row.get("epoch")) for row in run.metrics if not row.get("eval_only")]
    epochs = [e for e in epochs if e is not None]
    return int(max(epochs)) + 1 if epochs else 0


def wall_time(run: RunData) -> float:
    """Seconds in the logged phases (PHASE_KEYS) over every row: sampling, rewards, advantages, training,
    critic, evaluation; model loading and checkpoint writing are not logged."""
    return sum(finite(row.get(key)) or 0.0 for row in run.metrics for key in PHASE_KEYS)


def evaluation_rows(run: RunData) -> list[tuple[float, float, bool]]:
    """(epoch, eval/reward_mean, is the final weights' row) of every evaluation row."""
    out = []
    for i, row in enumerate(run.metrics):
        value = finite(row.get("eval/reward_mean"))
        if value is not None:
            epoch = finite(row.get("epoch"))
            out.append((i if epoch is None else epoch, value, bool(row.get("eval_only"))))
    return out
