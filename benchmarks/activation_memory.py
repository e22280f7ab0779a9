"""Activation memory of one training forward, measured exactly on any device (a CPU too), with and without
`train.gradient_checkpointing`.

    python benchmarks/activation_memory.py                                   # tiny, tiny-sd3: seconds
    python benchmarks/activation_memory.py --arch sd15 --batch 1 --resolution 512 --dtype bf16   # SD-1.5 size

What it counts: the bytes of the tensors autograd saves for the backward (`SavedActivations`), from the
forward until the backward releases them, for one training forward of the LoRA model (`policy.step_log_prob`,
classifier-free guidance as in training, under autocast in `--dtype`) on `--batch` sampled states. Parameters
are left out (they are held anyway) and a storage saved twice is counted once. This is the part of the peak
GPU memory that gradient checkpointing and the micro-batch size control; the weights, the optimizer state and
the allocator's own caching come on top (peak GPU memory is measured by benchmarks/gpu_check.py on a GPU).
The architectures are gpu_check's (random weights built from the published configs, no hub).

Prints a table and writes benchmarks/results/activation_memory.json (or --output).
"""

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import weakref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_check  # noqa: E402  benchmarks/gpu_check.py: the architectures and their sampling settings
import torch  # noqa: E402

from ddpo_group.run_dir import write_json_atomic  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _Saved:
    """A saved tensor's holder: autograd keeps it exactly as long as it keeps the tensor."""

    def __init__(self, tensor):
        self.tensor = tensor


class SavedActivations:
    """Counts the bytes autograd holds for the backward: `live` now and `peak` since creation.

    Use ``with meter.counting():`` around the forward (and backward). Tensors sharing a storage with one of
    `module`'s parameters are not counted; a storage saved several times is counted once."""

    def __init__(self, module):
        self.parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.holders = {}  # storage pointer -> number of live saved tensors on it
        self.sizes = {}
        self.live = self.peak = 0

    def _release(self, key):
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.live -= self.sizes.pop(key)

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.parameters or storage.nbytes() == 0:
            return tensor
        if key not in self.holders:
            self.holders[key], self.sizes[key] = 0, storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.holders[key] += 1
        # detached: a holder that kept the tensor's grad_fn would close a cycle through the graph, never freed
        holder = _Saved(tensor.detach())
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    @contextlib.contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


def measure(arch, dtype_name, batch, resolution, lora_rank):
    """The activation bytes of one training forward of `arch` without and with gradient checkpointing."""
    spec = dict(gpu_check.ARCHS[arch])
    if resolution:
        spec["resolution"] = resolution
    dtype = DTYPES[dtype_name]
    policy = gpu_check.load_configured_policy(spec, "cpu", dtype)
    if resolution and not spec["flow"]:
        policy.configure(resolution=resolution)
    guidance = gpu_check.flow_sample_settings(spec)["guidance_scale"] if spec["flow"] else 5.0
    prompts = [gpu_check.PROMPTS[i % len(gpu_check.PROMPTS)] for i in range(batch)]
    start = time.perf_counter()
    samples = policy.sample(prompts, 2, guidance, 1.0 if not spec["flow"] else 0.7,
                            generator=torch.Generator().manual_seed(0))
    module = policy.prepare("cpu", dtype, use_lora=True, lora_rank=lora_rank)
    rows, steps = torch.arange(batch), torch.zeros(batch, dtype=torch.int64)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    entry = {"arch": arch, "model": spec["model"], "dtype": dtype_name, "batch": batch,
             "resolution": int(samples.images.shape[-1]), "cfg": guidance > 1.0, "lora_rank": lora_rank}
    for checkpointing in (False, True):
        if checkpointing:
            module.enable_gradient_checkpointing()
        else:
            module.disable_gradient_checkpointing()
        meter = SavedActivations(module)
        with meter.counting():
            with autocast:
                log_prob = policy.step_log_prob(module, samples, rows, steps, guidance, 1.0)[0]
            held = meter.live
            log_prob.float().mean().backward()
        module.zero_grad(set_to_none=True)
        released = meter.live == 0
        del log_prob
        key = "checkpointing" if checkpointing else "plain"
        entry[f"{key}_mb"] = held / 2**20
        entry[f"{key}_released_by_backward"] = released
    entry["ratio"] = entry["checkpointing_mb"] / entry["plain_mb"]
    entry["seconds"] = time.perf_counter() - start
    return entry


def render(entries):
    lines = ["| arch | dtype | batch (x2 with CFG) | px | activations MB | with checkpointing MB | ratio |",
             "|---|---|---|---|---|---|---|"]
    for e in entries:
        lines.append(f"| {e['arch']} ({e['model']}) | {e['dtype']} | {e['batch']}{' x2' if e['cfg'] else ''} | "
                     f"{e['resolution']} | {e['plain_mb']:.1f} | {e['checkpointing_mb']:.1f} | {e['ratio']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="tiny,tiny-sd3", help=f"comma-separated, of {list(gpu_check.ARCHS)}")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="autocast dtype of the forward")
    parser.add_argument("--batch", type=int, default=4, help="trajectories in the training micro-batch")
    parser.add_argument("--resolution", type=int, default=0, help="image side in pixels (0: the arch's own)")
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--output", default=os.path.join(gpu_check.REPO_ROOT, "benchmarks", "results",
                                                         "activation_memory.json"))
    args = parser.parse_args(argv)
    for arch in args.arch.split(","):
        if arch not in gpu_check.ARCHS:
            parser.error(f"--arch {arch!r} is not one of {list(gpu_check.ARCHS)}")
    entries = []
    for arch in args.arch.split(","):
        entries.append(measure(arch, args.dtype, args.batch, args.resolution, args.lora_rank))
        print(json.dumps(entries[-1]), flush=True)
    results = {"machine": {"platform": platform.platform(), "torch_version": torch.__version__},
               "settings": vars(args), "entries": entries}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    write_json_atomic(args.output, results)
    print(render(entries))
    print(f"written: {args.output}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))))
    sys.exit(main())
