"""What a benchmark may write over or remove, and how it ends (issue 54); every script in benchmarks/ uses it.

- A benchmark trains into a folder of its own: a temporary one, a run directory that is missing (or empty) when
  it starts (`fresh_run_dir`), or a folder of runs it made itself and marked (`own_folder`: there it may train
  again, with the trainer's overwrite, which removes only a run's own files). It never removes a folder it did
  not make, nor sets config.overwrite on one.
- A default output that holds committed results (files git tracks there) is refused: the option that says where
  to write must be given (`refuse_committed_default`); a path given explicitly is the user's choice.
- A run the benchmark started that did not finish (no finished.json: it failed, was stopped or killed) ends the
  benchmark with a non-zero exit naming the run (`require_finished`), never with rc 0 and partial numbers.

Each refusal is one BenchmarkError line naming the option or path and the fix; a script's main turns it into
`SCRIPT: error: LINE` with exit status 2 (`fail`).
"""

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINISHED_FILE = "finished.json"  # ddpo_group/runs/run_dir.py: the last file a run that reached its end writes


class BenchmarkError(Exception):
    """A benchmark's refusal or failure: one line naming the option or path and the fix."""


def fail(prog, err, code=2):
    """Exit with `PROG: error: LINE` on stderr (argparse's form), status `code`."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    sys.exit(code)


def tracked(path):
    """The files git tracks at or under `path` (committed results); [] outside a git checkout of this repository."""
    path = os.path.abspath(path)
    if os.path.commonpath([path, REPO_ROOT]) != REPO_ROOT or not os.path.exists(path):
        return []
    try:
        result = subprocess.run(["git", "-C", REPO_ROOT, "ls-files", "--", os.path.relpath(path, REPO_ROOT)],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        result = None
    if result is None or result.returncode != 0:
        # no git (an unpacked archive): whatever lies under benchmarks/results is taken for committed results
        results = os.path.join(REPO_ROOT, "benchmarks", "results")
        if os.path.commonpath([path, results]) != results:
            return []
        if os.path.isfile(path):
            return [path]
        return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]
    return [line for line in result.stdout.splitlines() if line.strip()]


def refuse_committed_default(option, default, given, written=None):
    """`default` (a file or folder) is the default of `option`, which was not `given`; `written`: the paths this
    command writes there (default: `default` itself). Refused when one holds committed results, which a run of
    the benchmark would write over or report as its own."""
    if given:
        return
    for path in written or [default]:
        committed = tracked(path)
        if committed:
            shown = os.path.relpath(os.path.abspath(default), REPO_ROOT)
            raise BenchmarkError(
                f"{option} defaults to {shown}, which holds committed results ({len(committed)} file"
                f"{'s' if len(committed) > 1 else ''} this command would write over or report, e.g. {committed[0]}); give {option} to say "
                f"where this run writes (a new path, or {option} {shown} to replace them)")


MARK = ".made_by_benchmark"  # in a folder of run directories a benchmark made: the script's name


def own_folder(option, folder, prog):
    """`folder` (run directories a benchmark trains into and may train into again: their earlier runs are its own)
    is one `prog` made (its MARK), or is made now; an existing non-empty folder without the mark is someone else's
    and refused (a run there would write over it)."""
    mark = os.path.join(folder, MARK)
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise BenchmarkError(f"{option}: {folder} is a file, where this benchmark's runs go; give another {option}")
    if os.path.isdir(folder) and os.listdir(folder):
        try:
            with open(mark) as f:
                maker = f.read().strip()
        except OSError:
            maker = None
        if maker != prog:
            raise BenchmarkError(
                f"{option}: {folder} exists and was not made by {prog} (no {MARK} naming it), and its runs would be "
                f"written over; give another {option}, or move {folder} away")
        return
    os.makedirs(folder, exist_ok=True)
    with open(mark, "w") as f:
        f.write(prog + "\n")


def fresh_run_dir(option, run_dir):
    """A run directory the benchmark is about to create under the folder given by `option`: missing or empty,
    never one holding something (a finished run, the user's files) that a run would overwrite or mix with."""
    for path in (os.path.dirname(run_dir), run_dir):
        if os.path.lexists(path) and not os.path.isdir(path):
            raise BenchmarkError(f"{option}: {path} is a file, where this benchmark's run directory goes; "
                                 f"give another {option}")
    try:
        entries = sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []
    except OSError as err:
        raise BenchmarkError(f"{option}: cannot read {run_dir} ({err.strerror or err}); give another {option}") from None
    if entries:
        what = ("a run" if any(e in entries for e in ("config.json", "metrics.jsonl", "checkpoints"))
                else "files this benchmark did not make")
        raise BenchmarkError(
            f"{option}: {run_dir} already exists and holds {what} ({', '.join(entries[:3])}"
            f"{', ...' if len(entries) > 3 else ''}); a benchmark never writes over a folder it did not make: give "
            f"another {option} (or none, for a temporary one)")


def require_finished(run_dir, what="run"):
    """The run at `run_dir` reached its end (finished.json); else a BenchmarkError naming it and why."""
    if os.path.exists(os.path.join(run_dir, FINISHED_FILE)):
        return
    why = next((name for name in ("failed.json", "stopped.json") if os.path.exists(os.path.join(run_dir, name))), None)
    raise BenchmarkError(
        f"the {what} {run_dir} did not finish ({'see its ' + why if why else 'no finished.json'}); its numbers are not "
        "a measurement: fix the cause and run the benchmark again")
