"""Issue 44: what each phase of an epoch spends beyond its model calls, and how close those calls come to the peak.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py --config tiny --epochs 2 \\
        --output benchmarks/results/overhead/tiny.json

Runs `--epochs` epochs of a variant of config/grpo.py (a throw-away run directory: a new --logdir/<variant>) with the per-phase
accounting of ddpo_group/training/perf.py recording one copy of each model call's inputs, then replays the same
calls bare, at the same shapes, with the run's final weights: for every (phase, model, input shapes) the run's
number of calls, one after another, nothing else around them (--replays times, the least time counted):

    sampling, evaluation      the denoiser's forwards without gradients (CFG's doubled batch as the run made it)
    decoding                  the VAE decoder's forwards
    old_log_probs             the denoiser's forwards under autograd, the graph dropped (as the run makes them)
    reference                 the reference's forwards (the same module, without gradients)
    training                  forward + backward of the same batch (the backward of the output's sum), zero_grad

Per phase: seconds (the run's, every epoch), bare_seconds (the replay), overhead = seconds / bare_seconds (1.0:
the loop adds nothing around its model calls; the phases that call no model have none), mfu = the phase's model
FLOPs / seconds / peak (perf.py's). Seconds on the CPU are the loop thread's CPU seconds (--clock cpu), which the
load of a shared machine does not stretch as it does the wall clock (run with OMP_NUM_THREADS=1: torch's work is
then on that thread; the reward's own thread is not counted). The first epoch (--warmup-epochs) is run and not counted: its first call of
each input shape runs under FlopCounterMode. Printed as a table and written as JSON
{"phases": {phase: {"seconds", "bare_seconds", "overhead", "mfu", "calls", "tflops"}}, "peak_tflops", ...}.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_outputs import BenchmarkError, fresh_run_dir, require_finished  # noqa: E402
from ddpo_group.training import perf  # noqa: E402

REPLAYED = ("sampling", "decoding", "old_log_probs", "reference", "training", "evaluation")


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    for item in output:
        found = _first_tensor(item) if isinstance(item, (torch.Tensor, tuple, list, dict)) else None
        if found is not None:
            return found
    return None


def replay(accounting, module_for, sync, clock=time.perf_counter):
    """{phase: bare seconds} of the run's recorded calls, made again one after another."""
    bare = {}
    for (phase, name, signature, grad), calls in sorted(accounting.run_calls.items(), key=lambda kv: kv[0][0]):
        module = module_for(name)
        args, kwargs = accounting.example_inputs[signature]
        train = phase == "training" and grad

        def call():
            with torch.enable_grad() if grad else torch.no_grad():
                output = module(*args, **kwargs)
                if train:
                    _first_tensor(output).float().sum().backward()
            return output

        call()  # warm-up: not timed
        if train:
            module.zero_grad(set_to_none=True)
        sync()
        start = clock()
        for _ in range(calls):
            call()
        if train:
            module.zero_grad(set_to_none=True)
        sync()
        bare[phase] = bare.get(phase, 0.0) + clock() - start
    return bare


def _compile_totals():
    """torch.compile's cost in this process so far: {"seconds": dynamo's wall seconds compiling frames (tracing and
    the backend: inductor's code generation), "graphs": the graphs compiled}. Paid once per run, mostly in the warm-up
    epoch, which is not counted; a graph compiled in a counted epoch (a new input shape) is in its phase's seconds."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(sum(times) for name, times in compilation_time_metrics.items() if name.endswith("compile_inner"))
    return {"seconds": seconds, "graphs": int(counters["stats"].get("unique_graphs", 0))}


def build_config(variant, epochs, overrides, logdir):
    """The run's config: `variant` for `epochs` epochs into logdir/<variant>, per-phase accounting on, the
    --set overrides last. Never config.overwrite: the run directory is a new one (`check`)."""
    from ddpo_group.config.fields import set_field
    from ddpo_group.config.grpo import get_config

    config = get_config(variant)
    config.num_epochs = epochs
    config.logdir = logdir
    config.run_name = variant
    config.log_with = "none"
    config.perf.enabled = True
    for item in overrides:
        set_field(config, item)
    return config


def check(config):
    """Before anything runs: the run directory is new (missing or empty: nothing a run would write over), and the
    trainer's own checks (config/check.py's check_config, the run directory's) accept the config. Raises
    BenchmarkError or ConfigError, one line each."""
    from ddpo_group.config.check import check_config
    from ddpo_group.runs.run_dir import RunDir

    fresh_run_dir("--logdir", os.path.join(os.path.abspath(os.path.expanduser(config.logdir)), config.run_name))
    check_config(config, num_processes=int(os.environ.get("WORLD_SIZE", 1)), has_gpu=torch.cuda.is_available())
    RunDir.resolve(config)  # reads only


def run(variant, epochs, overrides=(), logdir=None, warmup=0, repeats=2, clock="cpu"):
    """Train `epochs` epochs of `variant` with recording accounting, then replay bare; returns the JSON dict.
    The first `warmup` epochs are run but not counted. BenchmarkError when the run did not finish."""
    from ddpo_group.training.trainer import Trainer

    config = build_config(variant, epochs, overrides, logdir or tempfile.mkdtemp(prefix="overhead_"))
    check(config)
    trainer = Trainer(config)
    accounting = trainer.perf
    accounting.record_inputs = True
    timer = time.thread_time if clock == "cpu" and trainer.accelerator.device.type == "cpu" else time.perf_counter
    accounting.clock = timer
    log_epoch = trainer.log_epoch

    epoch_ends = [timer()]  # the loop thread's clock at each epoch's end: epoch_seconds (the warm-up's holds compiling)

    def log_and_forget_warmup(epoch, samples, metrics):
        log_epoch(epoch, samples, metrics)
        epoch_ends.append(timer())
        if epoch < warmup:  # its first calls of each shape ran under FlopCounterMode, and warm caches up
            for totals in (accounting.run_seconds, accounting.run_model_seconds, accounting.run_calls):
                totals.clear()

    trainer.log_epoch = log_and_forget_warmup
    start = time.perf_counter()
    run_dir = trainer.run()
    wall = time.perf_counter() - start
    require_finished(run_dir)  # a stopped run's seconds are not the epochs' (its rc would be 0 otherwise)
    compiled = _compile_totals()  # before the replay: its warm-up calls reuse the run's graphs
    accounting.detach()
    accounting.model_seconds_by_phase()
    accounting.reset()  # the rows since the last epoch (the final evaluation, checkpoint) into the totals
    seconds, hooked = accounting.run_seconds, accounting.run_model_seconds
    flops = {}
    for (phase, name, signature, grad), calls in accounting.run_calls.items():
        factor = 3 if phase == "training" and grad else 1
        flops[phase] = flops.get(phase, 0) + factor * calls * accounting.signature_flops.get(signature, 0)
    device = trainer.accelerator.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    bare = {}
    for _ in range(repeats):  # the least of `repeats` replays: a shared machine's load only ever adds
        for phase, seconds_bare in replay(accounting, lambda name: accounting.modules[name], sync, timer).items():
            bare[phase] = min(bare.get(phase, float("inf")), seconds_bare)
    peak = accounting.peak_tflops()
    cache = trainer.policy.text_cache  # sample.text_embedding_cache: the sampling batches it served, those encoded
    phases = {}
    for phase in perf.PHASES:
        if phase not in seconds:
            continue
        row = {"seconds": seconds[phase], "bare_seconds": bare.get(phase), "overhead": None, "mfu": None,
               "hooked_seconds": hooked.get(phase), "tflops": flops.get(phase, 0) / 1e12,
               "calls": sum(n for (p, *_), n in accounting.run_calls.items() if p == phase)}
        if bare.get(phase):
            row["overhead"] = seconds[phase] / bare[phase]
        if flops.get(phase) and peak:
            row["mfu"] = flops[phase] / seconds[phase] / (peak * 1e12)
        phases[phase] = row
    return {
        "variant": variant, "epochs": epochs, "warmup_epochs": warmup, "replays": repeats,
        "clock": "thread CPU seconds" if timer is time.thread_time else "wall seconds", "overrides": list(overrides), "phases": phases,
        "text_cache": {"batches_served": cache.hits, "batches_encoded": cache.misses, "prompts": len(cache.rows)},
        "peak_tflops": peak, "wall_seconds": wall, "compile": {"enabled": bool(config.get("compile", False)), **compiled},
        "epoch_seconds": [b - a for a, b in zip(epoch_ends, epoch_ends[1:])], "threads": torch.get_num_threads(), "device": str(device),
        "cpu": perf._cpu_model(), "torch": torch.__version__, "python": platform.python_version(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def table(result):
    compiled = result.get("compile") or {}
    lines = [f"{result['variant']}: {result['epochs'] - result['warmup_epochs']} epochs counted, {result['clock']}, peak {result['peak_tflops']:.4g} TFLOPS, "
             f"{result['threads']} threads, load {result['load_average']}, text cache: "
             f"{result['text_cache']['batches_served']} batches served, {result['text_cache']['batches_encoded']} encoded"
             + (f", compile {compiled['seconds']:.1f} s wall ({compiled['graphs']} graphs)" if compiled.get("enabled") else ""),
             f"{'phase':<14}{'seconds':>10}{'bare s':>10}{'overhead':>10}{'MFU':>8}{'calls':>8}"]
    for phase, row in result["phases"].items():
        bare = "-" if row["bare_seconds"] is None else f"{row['bare_seconds']:.3f}"
        over = "-" if row["overhead"] is None else f"{row['overhead']:.2f}x"
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        lines.append(f"{phase:<14}{row['seconds']:>10.3f}{bare:>10}{over:>10}{mfu:>8}{row['calls']:>8}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny", help="a variant of config/grpo.py (tiny, tiny_sd3, tiny_scenes)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs to run before the bare replay")
    parser.add_argument("--output", default="", help="JSON file to write (atomically); empty: print only")
    parser.add_argument("--logdir", default="", help="where the run directory LOGDIR/<config> goes, which must not "
                        "exist yet (default: a temporary folder)")
    parser.add_argument("--warmup-epochs", type=int, default=-1,
                        help="epochs run first and not counted (default: 1 when --epochs > 1, else 0)")
    parser.add_argument("--replays", type=int, default=2, help="bare replays; the least time of each phase counts")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu (default on the CPU): the loop thread's CPU seconds, which other processes' load "
                             "does not stretch (exact with OMP_NUM_THREADS=1); wall: the wall clock (a GPU always)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field, e.g. --set sample.num_batches_per_epoch=1 or --set compile=true "
                             "(a JSON value; repeatable)")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs={args.epochs}: at least 1")
    warmup = args.warmup_epochs if args.warmup_epochs >= 0 else int(args.epochs > 1)
    if warmup >= args.epochs:
        parser.error(f"--warmup-epochs={warmup} leaves none of --epochs={args.epochs} to count")
    from ddpo_group.config.registry import ConfigError

    # Before anything runs: a misspelt field, a value the trainer refuses, a --logdir whose run directory exists
    # (a finished run there is never written over) are one line, not a traceback after the models loaded.
    logdir = args.logdir or tempfile.mkdtemp(prefix="overhead_")
    try:
        check(build_config(args.config, args.epochs, args.set, logdir))
    except (ConfigError, BenchmarkError) as err:
        if not args.logdir:
            os.rmdir(logdir)  # the empty temporary folder made just above
        parser.error(str(err))
    try:
        result = run(args.config, args.epochs, args.set, logdir, warmup, args.replays, args.clock)
    except BenchmarkError as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    print(table(result))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.output)), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.output)
    return result


if __name__ == "__main__":
    main()
