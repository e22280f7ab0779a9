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
from bench_outputs import BenchmarkError, refuse_committed_default  # noqa: E402
import torch  # noqa: E402

from ddpo_group.runs.run_dir import write_json_atomic  # noqa: E402

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


def measure(arch, dtype_name, batch, resolution, lora_rank, device="cpu"):
    """The activation bytes of one training forward of `arch` without and with gradient checkpointing, the
    largest checkpointed block's, and on CUDA the peak GPU memory the forward + backward adds."""
    spec = dict(gpu_check.ARCHS[arch])
    if resolution:
        spec["resolution"] = resolution
    dtype = DTYPES[dtype_name]
    policy = gpu_check.load_configured_policy(spec, device, dtype)
    if resolution and not spec["flow"]:
        policy.configure(resolution=resolution)
    guidance = gpu_check.flow_sample_settings(spec)["guidance_scale"] if spec["flow"] else 5.0
    prompts = [gpu_check.PROMPTS[i % len(gpu_check.PROMPTS)] for i in range(batch)]
    start = time.perf_counter()
    samples = policy.sample(prompts, 2, guidance, 1.0 if not spec["flow"] else 0.7,
                            generator=torch.Generator().manual_seed(0))
    module = policy.prepare(device, dtype, use_lora=True, lora_rank=lora_rank)
    rows = torch.arange(batch, device=samples.latents.device)
    steps = torch.zeros(batch, dtype=torch.int64, device=samples.latents.device)
    autocast = torch.autocast(device, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    def forward():
        with autocast:
            return policy.step_log_prob(module, samples, rows, steps, guidance, 1.0)[0]

    blocks = []  # the blocks diffusers' checkpointing wraps (each recomputed whole in the backward)

    def recording_checkpoint(block, *args):  # diffusers' own checkpoint call, noting which block it wraps
        if not any(block is seen for seen in blocks):
            blocks.append(block)
        return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)

    entry = {"arch": arch, "model": spec["model"], "dtype": dtype_name, "device": device, "batch": batch,
             "resolution": int(samples.images.shape[-1]), "cfg": guidance > 1.0, "lora_rank": lora_rank}
    for checkpointing in (True, False):  # checkpointing first: its forward finds the blocks measured without it
        if checkpointing:
            module.enable_gradient_checkpointing(gradient_checkpointing_func=recording_checkpoint)
        else:
            module.disable_gradient_checkpointing()
        meter = SavedActivations(module)
        block_bytes, starts, hooks = [0], {}, []
        if not checkpointing:  # what each checkpointed block saves when it is not checkpointed
            def before(block, args):
                starts[id(block)] = meter.live

            def after(block, args, output):
                block_bytes.append(meter.live - starts.pop(id(block)))

            hooks = [h for b in blocks for h in (b.register_forward_pre_hook(before), b.register_forward_hook(after))]
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            allocated = torch.cuda.memory_allocated()
        with meter.counting():
            log_prob = forward()
            held = meter.live
            log_prob.float().mean().backward()
        for hook in hooks:
            hook.remove()
        key = "checkpointing" if checkpointing else "plain"
        if device == "cuda":
            torch.cuda.synchronize()
            entry[f"{key}_gpu_peak_added_mb"] = (torch.cuda.max_memory_allocated() - allocated) / 2**20
        module.zero_grad(set_to_none=True)
        entry[f"{key}_released_by_backward"] = meter.live == 0
        del log_prob
        entry[f"{key}_mb"] = held / 2**20
        if not checkpointing:
            entry["largest_block_mb"] = max(block_bytes) / 2**20
    entry["checkpointed_blocks"] = len(blocks)
    # in the backward with checkpointing, one block at a time is recomputed and holds its activations again
    entry["checkpointing_bound_mb"] = entry["checkpointing_mb"] + entry["largest_block_mb"]
    entry["ratio"] = entry["checkpointing_mb"] / entry["plain_mb"]
    entry["bound_ratio"] = entry["checkpointing_bound_mb"] / entry["plain_mb"]
    entry["seconds"] = time.perf_counter() - start
    return entry


def render(entries):
    lines = ["| arch | dtype | batch (x2 with CFG) | px | activations MB | checkpointing: held MB | + largest block MB "
             "| bound / plain |", "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        lines.append(f"| {e['arch']} ({e['model']}) | {e['dtype']} | {e['batch']}{' x2' if e['cfg'] else ''} | "
                     f"{e['resolution']} | {e['plain_mb']:.1f} | {e['checkpointing_mb']:.1f} | "
                     f"{e['largest_block_mb']:.1f} | {e['bound_ratio']:.3f} |")
    if any("plain_gpu_peak_added_mb" in e for e in entries):
        lines += ["", "| arch | GPU peak added, plain MB | with checkpointing MB |", "|---|---|---|"]
        lines += [f"| {e['arch']} | {e['plain_gpu_peak_added_mb']:.0f} | {e['checkpointing_gpu_peak_added_mb']:.0f} |"
                  for e in entries if "plain_gpu_peak_added_mb" in e]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="tiny,tiny-sd3", help=f"comma-separated, of {list(gpu_check.ARCHS)}")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the model runs (cuda: also the peak GPU memory the forward + backward adds)")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="autocast dtype of the forward")
    parser.add_argument("--batch", type=int, default=4, help="trajectories in the training micro-batch")
    parser.add_argument("--resolution", type=int, default=0, help="image side in pixels (0: the arch's own)")
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--output", default=None, help="the JSON (default benchmarks/results/activation_memory.json; "
                        "a committed file there is replaced only when --output names it)")
    args = parser.parse_args(argv)
    given = args.output is not None
    args.output = args.output or os.path.join(gpu_check.REPO_ROOT, "benchmarks", "results", "activation_memory.json")
    try:
        refuse_committed_default("--output", args.output, given)
    except BenchmarkError as err:
        parser.error(str(err))
    for arch in args.arch.split(","):
        if arch not in gpu_check.ARCHS:
            parser.error(f"--arch {arch!r} is not one of {list(gpu_check.ARCHS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    entries = []
    for arch in args.arch.split(","):
        entries.append(measure(arch, args.dtype, args.batch, args.resolution, args.lora_rank, args.device))
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
