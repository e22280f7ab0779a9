"""Runs a study's training runs as subprocesses, `jobs` at once, each on one thread (OMP_NUM_THREADS=1), its output
in <run_dir>.log; shared by benchmarks/scenes_study.py and benchmarks/scenes_ladder.py."""

from __future__ import annotations

import json
import os
import subprocess
import time

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_pool(tasks, jobs, poll_seconds=5.0):
    """tasks: [(label, command (argv list), run_dir)]; runs them `jobs` at a time, printing a line as each starts
    and ends; a run's log is appended to (a run that goes on from a checkpoint keeps its earlier attempts' lines).
    Returns {label: exit code}."""
    pending, running, codes = list(tasks), [], {}
    env = dict(os.environ, **ONE_THREAD)
    while pending or running:
        while pending and len(running) < max(1, jobs):
            label, command, run_dir = pending.pop(0)
            os.makedirs(os.path.dirname(run_dir), exist_ok=True)
            log = open(run_dir + ".log", "a")
            log.write(f"=== {label}: started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            log.flush()
            print(f"start {label}", flush=True)
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((label, process, log, time.time()))
        time.sleep(poll_seconds if running else 0)
        for item in list(running):
            label, process, log, began = item
            if process.poll() is not None:
                log.close()
                running.remove(item)
                codes[label] = process.returncode
                print(f"done {label}: exit {process.returncode} after {time.time() - began:.0f} s", flush=True)
    return codes


def read_json(path):
    """The JSON at `path`, or None when it is missing or not JSON (a run's record that a stop cut short)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
