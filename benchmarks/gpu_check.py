"""GPU check: the SD variants train in fp16 and bf16 with LoRA, exactly on-policy, at a known cost.

    python benchmarks/gpu_check.py                      # a CUDA machine: SD-1.5 architecture, random weights
    python benchmarks/gpu_check.py --dtypes bf16        # one dtype
    python benchmarks/gpu_check.py --device cpu --arch tiny --dtypes bf16 --steps 4   # the code path on a CPU

No hub: the pipeline is SD 1.5's architecture built from configs with random weights
(`load_pipeline("random-sd15")`, UNet 859.5M parameters, 512x512). Rewards on random weights mean
nothing, so only precision, speed and memory are checked. For each dtype:

    sampling      time of `sample_trajectories` vs the pipeline's own `pipeline(...)` call, same
                  dtype, batch `--sample-batch` (8), `--sample-steps` (50) steps, CFG 5, eta 1
    UNet fwd+bwd  the bare cost of one training forward + backward of the LoRA UNet on a micro-batch
                  of `--train-batch` (4) trajectories with CFG (8 rows), under autocast
    variants      one epoch of config/grpo.py:sd15, :ddpo, :group_ppo and :group_ppo_alg2 (LoRA, `--steps` denoising
                  steps, reward jpeg_compressibility, one optimizer step per epoch), read back from
                  metrics.jsonl: the on-policy max |log ratio| before the first optimizer step,
                  approx_kl and clipfrac (all three must be exactly 0), the layout noise that
                  recomputing pi_old removed, the training pass in seconds per trajectory-step,
                  peak GPU memory; and `nft` / `awm`, sd15 with the forward-process objective of
                  :tiny_nft / :tiny_awm (docs/forward.md), whose exactness check is the first window's
                  max |prediction - old model's prediction| (exactly 0: the sampling model is the policy)

It prints a table, writes benchmarks/results/gpu_check.json (or --output), and exits 1 if any
on-policy ratio is not exactly 1 or any optimizer step was skipped. Not part of CI (CI has no GPU).
"""

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "config"))

import grpo  # noqa: E402  config/grpo.py
import torch  # noqa: E402

from ddpo_group.diffusion.loading import load_pipeline  # noqa: E402
from ddpo_group.diffusion.lora import add_lora  # noqa: E402
from ddpo_group.diffusion.sampling import sample_trajectories  # noqa: E402
from ddpo_group.trainer import train  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = ("sd15", "ddpo", "group_ppo", "group_ppo_alg2", "nft", "awm")
# forward-process objectives on the sd15 variant: the objective's fields come from these tiny variants
FORWARD_VARIANTS = {"nft": "tiny_nft", "awm": "tiny_awm"}
MODELS = {"sd15": "random-sd15", "tiny": "tiny"}
PROMPTS = ["a photo of a cat", "a photo of a dog", "a red circle", "a blue square"]


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats=1):
    """(result of the last call, mean seconds per call) after one untimed warm-up call."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    synchronize(device)
    return result, (time.perf_counter() - start) / repeats


def check_sampling(model, device, dtype, batch, steps):
    """Seconds of sample_trajectories and of pipeline(...) for the same batch, dtype and steps."""
    pipeline = load_pipeline(model, torch_dtype=dtype).to(device)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]

    def ours():
        return sample_trajectories(pipeline, prompts, steps, 5.0, 1.0, generator=torch.Generator().manual_seed(0))

    def theirs():
        return pipeline(prompts, num_inference_steps=steps, guidance_scale=5.0, eta=1.0, output_type="pt",
                        generator=torch.Generator().manual_seed(0)).images

    trajectories, ours_s = timed(ours, device)
    _, theirs_s = timed(theirs, device)
    return pipeline, {
        "sampling_s": ours_s,
        "pipeline_s": theirs_s,
        "sampling_vs_pipeline": ours_s / theirs_s,
        "sampling_mask_all_ones": bool((trajectories.mask == 1).all()),
        "log_probs_dtype": str(trajectories.log_probs.dtype),
    }


def check_unet_cost(pipeline, device, dtype, batch, repeats):
    """Mean seconds of one forward + backward of the LoRA UNet on `batch` trajectories with CFG."""
    unet = pipeline.unet
    add_lora(unet, 4)
    for param in unet.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    config = unet.config
    size = config.sample_size
    latents = torch.randn(2 * batch, config.in_channels, size, size, device=device)
    timesteps = torch.full((2 * batch,), 500, device=device)
    embeds = torch.randn(2 * batch, pipeline.tokenizer.model_max_length, config.cross_attention_dim, device=device)
    autocast = torch.autocast(device, dtype=dtype) if device == "cuda" or dtype == torch.bfloat16 else contextlib.nullcontext()

    def step():
        with autocast:
            out = unet(latents.to(dtype), timesteps, encoder_hidden_states=embeds.to(dtype), return_dict=False)[0]
        out.float().mean().backward()
        unet.zero_grad(set_to_none=True)

    _, seconds = timed(step, device, repeats)
    return {"unet_fwd_bwd_s": seconds, "unet_fwd_bwd_s_per_trajectory_step": seconds / batch}


def forward_variant(name, num_steps):
    """sd15 trained with the forward-process objective of FORWARD_VARIANTS[name] (at most num_steps timesteps)."""
    source = grpo.get_config(FORWARD_VARIANTS[name])
    config = grpo.get_config("sd15")
    config.train.objective = source.train.objective
    for field in ("use_reference_model", "use_kl_loss", "beta", "clip_range"):
        config.train[field] = source.train[field]
    config.forward = source.forward
    config.forward.num_timesteps = min(source.forward.num_timesteps or num_steps, num_steps)
    return config


def run_variant(variant, args, dtype_name, logdir):
    config = forward_variant(variant, args.steps) if variant in FORWARD_VARIANTS else grpo.get_config(variant)
    config.pretrained.model = MODELS[args.arch]
    config.mixed_precision = dtype_name
    config.use_lora = True
    config.reward_fn = "jpeg_compressibility"
    config.prompt_fn = "simple_animals"
    config.num_epochs = 1
    config.save_freq = 0
    config.log_images_every = 0
    config.logdir = logdir
    config.run_name = f"{variant}_{dtype_name}"
    config.sample.num_steps = args.steps
    config.sample.batch_size = args.sample_batch
    config.sample.num_batches_per_epoch = args.batches
    config.sample.group_size = min(config.sample.group_size, args.sample_batch) if variant != "ddpo" else 1
    config.train.batch_size = args.train_batch
    # one optimizer step per epoch: every micro-batch is trained before any update, so the ratio must be 1
    config.train.gradient_accumulation_steps = args.sample_batch * args.batches // args.train_batch
    run_dir = train(config)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        row = json.loads(f.readline())
    trained_steps = row["train/unet_steps_per_sample"] * row["num_samples"]
    # forward objectives: the first window's max |prediction - old prediction| stands for the log-ratio; NFT has
    # no ratio (approx_kl, clipfrac 0 by definition)
    on_policy = row.get("train/on_policy_max_abs_log_ratio", row.get("forward/first_window_max_abs_deviation"))
    return {
        "on_policy_max_abs_log_ratio": on_policy,
        "approx_kl": row.get("approx_kl", 0.0),
        "clipfrac": row.get("clipfrac", 0.0),
        "layout_noise_max_abs_log_ratio": row.get("train/layout_noise_max_abs_log_ratio"),
        "skipped_steps": row["train/skipped_steps"],
        "time_sample_s": row["time/sample"],
        "time_train_s": row["time/train"],
        "train_s_per_trajectory_step": row["time/train"] / trained_steps,
        "trained_trajectory_steps": trained_steps,
        "peak_gpu_mb": row.get("peak_gpu_mb"),
    }


def render(results):
    lines = [
        f"GPU check on {results['machine'].get('gpu', results['machine']['device'])}, architecture {results['arch']}",
        "",
        "| dtype | sampling s | pipeline(...) s | ratio | UNet fwd+bwd s / trajectory-step |",
        "|---|---:|---:|---:|---:|",
    ]
    for dtype, d in results["dtypes"].items():
        lines.append(
            f"| {dtype} | {d['sampling_s']:.3f} | {d['pipeline_s']:.3f} | {d['sampling_vs_pipeline']:.3f} | "
            f"{d['unet_fwd_bwd_s_per_trajectory_step']:.4f} |"
        )
    lines += [
        "",
        "| dtype | variant | on-policy max abs log ratio | approx_kl | clipfrac | layout noise removed | "
        "train s / trajectory-step | peak GPU MB | skipped |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, d in results["dtypes"].items():
        for variant, v in d["variants"].items():
            noise = v["layout_noise_max_abs_log_ratio"]
            peak = v["peak_gpu_mb"]
            lines.append(
                f"| {dtype} | {variant} | {v['on_policy_max_abs_log_ratio']:.3g} | {v['approx_kl']:.3g} | "
                f"{v['clipfrac']:.3g} | {'-' if noise is None else f'{noise:.3g}'} | "
                f"{v['train_s_per_trajectory_step']:.4f} | {'-' if peak is None else f'{peak:.0f}'} | {v['skipped_steps']} |"
            )
    lines += ["", f"result: {'PASS' if results['passed'] else 'FAIL'}: {results['verdict']}"]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--arch", choices=sorted(MODELS), default="sd15", help="sd15: SD 1.5's architecture; tiny: seconds")
    parser.add_argument("--dtypes", default="fp16,bf16", help="comma-separated: fp16 (GPU only), bf16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=20, help="denoising steps of the training epochs")
    parser.add_argument("--sample-steps", type=int, default=50, help="denoising steps of the sampling-time check")
    parser.add_argument("--sample-batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=2, help="sampling batches per epoch")
    parser.add_argument("--train-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed UNet forward+backward calls")
    parser.add_argument("--output", default=os.path.join(REPO_ROOT, "benchmarks", "results", "gpu_check.json"))
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device is visible to torch; on a CPU use --device cpu --arch tiny --dtypes bf16")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if "fp16" in args.dtypes:
            raise SystemExit("gpu_check: fp16 needs a GPU; on a CPU use --dtypes bf16")
    machine = {"platform": platform.platform(), "torch_version": torch.__version__, "device": args.device}
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(0)
    results = {"arch": args.arch, "machine": machine, "settings": vars(args), "dtypes": {}}
    logdir = tempfile.mkdtemp(prefix="gpu_check_")
    failures = []
    try:
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            pipeline, entry = check_sampling(MODELS[args.arch], args.device, dtype, args.sample_batch, args.sample_steps)
            entry.update(check_unet_cost(pipeline, args.device, dtype, args.train_batch, args.repeats))
            del pipeline
            if args.device == "cuda":
                torch.cuda.empty_cache()
            if not entry["sampling_mask_all_ones"]:
                failures.append(f"{dtype_name}: a sampled step lost its density (mask 0)")
            entry["variants"] = {}
            for variant in args.variants.split(","):
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                v = entry["variants"][variant] = run_variant(variant, args, dtype_name, logdir)
                print(f"{dtype_name} {variant}: {json.dumps(v)}", flush=True)
                exact = v["on_policy_max_abs_log_ratio"] == 0.0 and v["approx_kl"] == 0.0 and v["clipfrac"] == 0.0
                if not exact:
                    failures.append(f"{dtype_name} {variant}: on-policy ratio not exactly 1")
                if v["skipped_steps"]:
                    failures.append(f"{dtype_name} {variant}: {v['skipped_steps']} optimizer step(s) skipped")
            results["dtypes"][dtype_name] = entry
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    results["passed"] = not failures
    results["verdict"] = "; ".join(failures) or "every on-policy ratio exactly 1, no skipped step, no masked step"
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1, default=float)
    print(render(results))
    print(f"written: {args.output}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
