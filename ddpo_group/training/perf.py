"""Per-phase accounting of a run: seconds, model FLOPs and MFU of each phase of an epoch (docs/performance.md).

One room: what an epoch spends, where, and how close its model calls come to the device's limit.

Phases: sampling, decoding, reward, old_log_probs, reference, training, critic, evaluation, checkpoint. The loop
enters each with ``phase(name)`` (a no-op when no accounting is active); phases nest, and a second counts for the
innermost phase only (the reference forward inside a training column is "reference", not "training"). The VAE
decoder's calls during sampling are the phase "decoding" by themselves.

Model FLOPs: forward hooks on the denoiser (the policy's trainable module: UNet / transformer) and the VAE decoder
count the calls made in each phase. Each (module, input shapes) signature is counted once with torch's
``FlopCounterMode`` (on the first call that has it), and multiplied by the calls made. A forward under autograd in the
"training" phase counts 3x its forward FLOPs: forward + backward (the backward ~2x the forward, the MFU convention
of PaLM / Megatron; activation recomputation is not counted). The old-log-prob pass runs its forwards under autograd
too (the training layout) but drops the graph: 1x.

Model seconds: the time inside the hooked forwards (CUDA: events, read once per epoch; CPU: the wall clock), plus
the backward calls the update wraps in ``model_time()``. perf/overhead = the epoch's seconds of the phases that
call a model over those phases' model seconds: 1.0 means the loop adds nothing around its model calls.

MFU = FLOPs / seconds / peak. The peak (``peak_tflops``): perf.peak_tflops when set; on a GPU the published dense
peak for its name and the run's dtype (PEAK_TFLOPS); on the CPU the measured float32 matmul throughput at the
run's thread count (``cpu_matmul_tflops``, measured once per process, never written outside the run).

perf.peak_tflops is checked by ``check_perf_config``, registered in the config walk's "run" section.
"""

import contextlib
import math
import platform
import threading
import time

import torch

from ddpo_group.config.registry import ConfigError, register_config_check

PHASES = ("sampling", "decoding", "reward", "old_log_probs", "reference", "training", "critic", "evaluation",
          "checkpoint")

# Published dense (no 2:4 sparsity) peak TFLOPS by GPU name and dtype. Sources: NVIDIA datasheets (H100 / H200 SXM:
# bf16/fp16 989.4, tf32 494.7, fp32 66.9; H100 PCIe: 756.5 / 378 / 51.2; A100: 312 / 156 / 19.5; L40S: 362.05 /
# 183 / 91.6; L4: 121 / 60 / 30.3; A10: 125 / 62.5 / 31.2; V100 SXM2: fp16 tensor 125, fp32 15.7; T4: fp16 65,
# fp32 8.1) and the Ada Lovelace architecture whitepaper (RTX 4090: fp16/bf16 with fp32 accumulation 165.2,
# tf32 82.6, fp32 82.6). Matched by substring of torch.cuda.get_device_name(), the longest name first.
PEAK_TFLOPS = {
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}

_CPU_PEAK = {}  # (cpu model, threads) -> TFLOPS measured by this process


@register_config_check("run")
def check_perf_config(config, machine=None):
    """ConfigError naming the field for a perf.peak_tflops that is not a finite number >= 0 (0: the device's)."""
    perf = config.get("perf") or {}
    peak = perf.get("peak_tflops", 0.0)
    try:
        ok = math.isfinite(float(peak)) and float(peak) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"config.perf.peak_tflops={peak!r} is not a finite number >= 0: set the device's peak "
                          "in TFLOPS, or 0 for the published GPU peak / the measured CPU matmul throughput")


def gpu_peak_tflops(name, dtype):
    """The published dense peak of a GPU named `name` ("NVIDIA H100 80GB HBM3") for dtype "bf16" / "fp16" /
    "tf32" / "fp32"; None for a GPU or dtype not in PEAK_TFLOPS."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            return PEAK_TFLOPS[key].get(dtype)
    return None


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_matmul_tflops(size=1024, seconds=0.5):
    """The CPU's float32 matmul throughput in TFLOPS at torch's current thread count: (size x size) @ (size x size)
    repeated for about `seconds` (2 size^3 FLOPs each), the best of five rounds. Measured once per process and
    thread count, kept in memory only: a run writes nothing outside its run directory. With one thread the clock
    is the thread's CPU time (a loaded machine does not lower it); with several, the wall clock (a shared, loaded machine measures less than its peak)."""
    key = f"{_cpu_model()}|threads={torch.get_num_threads()}"
    if key in _CPU_PEAK:
        return _CPU_PEAK[key]
    a, b = torch.randn(size, size, generator=torch.Generator().manual_seed(0)), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    # one thread: its CPU seconds, which other processes' load does not stretch; several: the wall clock
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    best = 0.0
    for _ in range(5):
        n, start = 0, clock()
        while clock() - start < seconds / 5:
            torch.mm(a, b)
            n += 1
        best = max(best, 2 * size**3 * n / (clock() - start) / 1e12)
    _CPU_PEAK[key] = best
    return best


def device_peak_tflops(config, device):
    """The peak MFU is measured against (TFLOPS): perf.peak_tflops when > 0, a GPU's published peak for the run's
    dtype, else the CPU's measured float32 matmul throughput (also for a GPU not in PEAK_TFLOPS: then None)."""
    override = float((config.get("perf") or {}).get("peak_tflops", 0.0) or 0.0)
    if override > 0:
        return override
    if torch.device(device).type == "cuda":
        dtype = {"fp16": "fp16", "bf16": "bf16"}.get(config.mixed_precision)
        if dtype is None:
            dtype = "tf32" if config.get("allow_tf32", True) else "fp32"
        return gpu_peak_tflops(torch.cuda.get_device_name(torch.device(device)), dtype)
    return cpu_matmul_tflops()


def _shapes(value, depth=0):
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype))
    if depth < 2 and isinstance(value, (list, tuple)):
        return tuple(_shapes(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return tuple((k, _shapes(v, depth + 1)) for k, v in sorted(value.items()))
    return None


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


class PerfAccounting:
    """Seconds, model calls, FLOPs and model seconds of each phase since the last ``epoch_metrics`` (module
    docstring). ``attach(name, module)`` hooks a model; ``phase(name)`` / ``model_time()`` are entered by the loop
    (through this module's functions of the same names while the accounting is ``active``)."""

    def __init__(self, peak_tflops=None, device="cpu", clock=time.perf_counter):
        self.peak = peak_tflops  # TFLOPS, or a callable giving it (measured on first use), or None
        # the seconds' clock: the wall (a run's default) or time.thread_time, the loop thread's CPU seconds, which a
        # shared machine's load does not stretch (benchmarks/overhead.py, with one torch thread)
        self.clock = clock
        self.cuda = torch.device(device).type == "cuda"
        self.stack = []  # [phase, start] innermost last
        self.signature_flops = {}  # (module name, input signature) -> forward FLOPs
        self.handles, self.calls_in_flight = [], []
        self._counting = None
        self.modules = {}  # name -> module attached
        # the loop's thread (set by ``active``): calls made by another thread (train.async_rollout's sampler) are
        # not accounted, since the phases are the loop's; None: every thread's
        self.thread = None
        # record_inputs (benchmarks/overhead.py): one detached copy of each signature's inputs and the run's calls
        # per (phase, module name, signature, grad enabled), to replay them bare
        self.record_inputs, self.example_inputs, self.run_calls = False, {}, {}
        self.run_seconds, self.run_model_seconds = {}, {}  # the epochs' totals, rows already written
        self.reset()

    def reset(self):
        for phase, seconds in getattr(self, "seconds", {}).items():
            self.run_seconds[phase] = self.run_seconds.get(phase, 0.0) + seconds
        for phase, seconds in getattr(self, "model_seconds", {}).items():
            self.run_model_seconds[phase] = self.run_model_seconds.get(phase, 0.0) + seconds
        self.seconds = {}  # phase -> wall seconds (innermost)
        self.flops = {}  # phase -> model FLOPs
        self.calls = {}  # (phase, module name) -> calls
        self.model_seconds = {}  # phase -> seconds inside the model calls (CPU)
        self.events = []  # (phase, start event, end event) on CUDA, read at epoch_metrics

    # ---- phases ----
    def _now(self):
        return self.clock()

    def _enter(self, name):
        now = self._now()
        if self.stack:
            outer = self.stack[-1]
            self.seconds[outer[0]] = self.seconds.get(outer[0], 0.0) + now - outer[1]
        self.stack.append([name, now])

    def _exit(self):
        now = self._now()
        name, start = self.stack.pop()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - start
        if self.stack:
            self.stack[-1][1] = now

    @contextlib.contextmanager
    def phase(self, name):
        self._enter(name)
        try:
            yield
        finally:
            self._exit()

    def switch(self, name):
        """The innermost phase ends here and `name` takes its place (closed with it)."""
        if self.stack:
            now = self._now()
            old, start = self.stack[-1]
            self.seconds[old] = self.seconds.get(old, 0.0) + now - start
            self.stack[-1] = [name, now]

    @property
    def current(self):
        return self.stack[-1][0] if self.stack else None

    @contextlib.contextmanager
    def model_time(self):
        """Seconds spent in a model call that no forward hook sees (the update's backward)."""
        token = self._start_call()
        try:
            yield
        finally:
            self._end_call(token, self.current)

    def _start_call(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.clock()

    def _end_call(self, token, phase):
        if phase is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((phase, token, end))
        else:
            self.model_seconds[phase] = self.model_seconds.get(phase, 0.0) + self.clock() - token

    # ---- hooks ----
    def attach(self, name, module, phase=None):
        """Count and time the forward calls of `module` under `name`; `phase`: the phase its calls are (decoding)
        when made during sampling, else the current phase's."""

        def before(mod, args, kwargs):
            if not self.owns_thread():
                return
            own = phase if phase is not None and self.current == "sampling" else None
            if own is not None:
                self._enter(own)
            signature = (name, _shapes(args), _shapes(kwargs))
            counter = None
            if self._counting is None and signature not in self.signature_flops:
                from torch.utils.flop_counter import FlopCounterMode

                counter = FlopCounterMode(display=False)
                counter.__enter__()
                self._counting = counter
            self.calls_in_flight.append((signature, own, counter, self._start_call()))

        def after(mod, args, kwargs, output):
            if not self.owns_thread():
                return
            signature, own, counter, token = self.calls_in_flight.pop()
            current = self.current
            self._end_call(token, current)
            if counter is not None:
                counter.__exit__(None, None, None)
                self._counting = None
                self.signature_flops[signature] = counter.get_total_flops()
            if current is not None:
                flops = self.signature_flops.get(signature, 0)
                if current == "training" and torch.is_grad_enabled():
                    flops *= 3  # forward + backward
                self.flops[current] = self.flops.get(current, 0) + flops
                self.calls[current, name] = self.calls.get((current, name), 0) + 1
                if self.record_inputs:
                    key = (current, name, signature, torch.is_grad_enabled())
                    self.run_calls[key] = self.run_calls.get(key, 0) + 1
                    if signature not in self.example_inputs:
                        self.example_inputs[signature] = _detached((args, kwargs))
            if own is not None:
                self._exit()

        self.modules[name] = module
        self.handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        # always_call: a forward that raises still closes its FlopCounterMode and its decoding phase
        self.handles.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))

    def owns_thread(self):
        return self.thread is None or self.thread == threading.get_ident()

    def detach(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # ---- the epoch's row ----
    def peak_tflops(self):
        if callable(self.peak):
            self.peak = self.peak()
        return self.peak

    def model_seconds_by_phase(self):
        if self.cuda and self.events:
            torch.cuda.synchronize()
            for phase, start, end in self.events:
                self.model_seconds[phase] = self.model_seconds.get(phase, 0.0) + start.elapsed_time(end) / 1e3
            self.events = []
        return dict(self.model_seconds)

    def epoch_metrics(self):
        """perf/<phase>_seconds and perf/<phase>_tflops of the phases that happened since the last call,
        perf/sampling_mfu, perf/train_mfu, perf/overhead and perf/peak_tflops (the report's per-phase MFU is
        tflops / seconds / peak); then starts counting afresh."""
        model_seconds = self.model_seconds_by_phase()
        metrics = {}
        for phase in PHASES:
            if phase in self.seconds:
                metrics[f"perf/{phase}_seconds"] = self.seconds[phase]
                metrics[f"perf/{phase}_tflops"] = self.flops.get(phase, 0) / 1e12
        peak = self.peak_tflops()
        if peak:
            metrics["perf/peak_tflops"] = peak
        for phase, key in (("sampling", "perf/sampling_mfu"), ("training", "perf/train_mfu")):
            if self.seconds.get(phase) and self.flops.get(phase) and peak:
                metrics[key] = self.flops[phase] / self.seconds[phase] / (peak * 1e12)
        busy = [phase for phase in self.seconds if model_seconds.get(phase)]
        if busy:
            metrics["perf/overhead"] = sum(self.seconds[p] for p in busy) / sum(model_seconds[p] for p in busy)
        self.reset()
        return metrics


_ACTIVE = []  # the accounting of the run in progress (one at a time per process)


@contextlib.contextmanager
def active(accounting):
    """Make `accounting` the one that ``phase`` / ``switch`` / ``model_time`` of this module report to (None:
    nothing is accounted)."""
    if accounting is None:
        yield None
        return
    _ACTIVE.append(accounting)
    accounting.thread = threading.get_ident()
    try:
        yield accounting
    finally:
        _ACTIVE.remove(accounting)
        accounting.thread = None


def _mine():
    """The active accounting when the calling thread is its loop's, else None."""
    return _ACTIVE[-1] if _ACTIVE and _ACTIVE[-1].owns_thread() else None


def phase(name):
    """Context manager: the code inside is phase `name` of the active accounting (nothing without one)."""
    accounting = _mine()
    return accounting.phase(name) if accounting is not None else contextlib.nullcontext()


def switch(name):
    """The active accounting's innermost phase ends here; `name` continues in its place (nothing without one)."""
    accounting = _mine()
    if accounting is not None:
        accounting.switch(name)


def model_time():
    """Context manager: a model call no hook sees (a backward), timed as the current phase's model seconds."""
    accounting = _mine()
    return accounting.model_time() if accounting is not None else contextlib.nullcontext()


def for_run(config, device, policy, copies=()):
    """The run's PerfAccounting with the denoiser (and `copies`, its FSDP2-sharded frozen copies: the reference, the
    old model) and the VAE decoder attached, or None with perf.enabled=False. An unsharded reference or old model
    runs through the denoiser itself (functional_call): its hooks see those calls."""
    perf = config.get("perf") or {}
    if not perf.get("enabled", True):
        return None
    accounting = PerfAccounting(lambda: device_peak_tflops(config, device), device)
    accounting.attach("denoiser", policy.trainable_module)
    for n, module in enumerate(copies):
        accounting.attach(f"denoiser_copy{n}", module)
    vae = getattr(getattr(policy, "pipeline", None), "vae", None)
    decoder = getattr(vae, "decoder", None)
    if isinstance(decoder, torch.nn.Module):
        accounting.attach("decoder", decoder, phase="decoding")
    return accounting
