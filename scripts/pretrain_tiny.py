"""Pretrain the tiny Stable Diffusion pipeline on the shapes world, on a CPU, offline.

    python scripts/pretrain_tiny.py                       # 12-25 min on a CPU -> ddpo_group/assets/tiny_shapes
    python scripts/pretrain_tiny.py --quick --output-dir /tmp/tiny   # seconds: smoke test

The architecture is ``ddpo_group.diffusion.tiny.build_tiny_pipeline`` (32x32 images,
VAE scale factor 4, 4x8x8 latents, ~0.8M-parameter UNet, tiny CLIP text encoder). Data
are (image, prompt) pairs rendered by ``ddpo_group.shapes.sample_dataset``.

Stage 1, the VAE as an autoencoder: x in [-1, 1], z ~ q(z | x) = N(mu, sigma^2),

    L_vae = mean (D(z) - x)^2 + kl_weight * KL(q(z | x) || N(0, I)) / dim(z)

then ``vae.config.scaling_factor = 1 / std(z)`` over the data set, so that scaled latents
have unit variance, as in Stable Diffusion.

Stage 2, UNet and text encoder with the standard epsilon-prediction loss (DDPM):
z0 = scaling_factor * z, t ~ U{0, ..., 999}, eps ~ N(0, I),
z_t = sqrt(abar_t) z0 + sqrt(1 - abar_t) eps,

    L_unet = mean (eps_theta(z_t, t, c) - eps)^2

with the prompt c replaced by "" with probability ``cond_dropout`` (10%) so that
classifier-free guidance works. AdamW, linear warmup then cosine decay, gradient clipping,
an exponential moving average (EMA) of the weights, which is what gets saved.

Finally the pipeline is sampled with DDIM (50 steps, guidance 5, eta 1) for the 108
prompts and scored with ``shapes_alignment``; the directory gets the diffusers files
(``save_pretrained``, safetensors) and ``pretrain_log.json`` (seconds per stage, final
losses, steps, seed, evaluation). Seeded: the same seed and thread count give the same model.

The shipped ``ddpo_group/assets/tiny_shapes`` is this script with its defaults (seed 0, 1500
VAE steps, 3000 UNet steps, 1 thread): 456 s + 952 s on a shared 2-core machine, final
VAE mse 0.0065, UNet loss 0.108, mean ``shapes_alignment`` 0.56 (DDIM 50 steps, guidance 5,
eta 1), deliberately short of 1 so that RL fine-tuning has headroom.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_group.diffusion.tiny import build_tiny_pipeline  # noqa: E402
from ddpo_group.rewards.shapes import shapes_alignment  # noqa: E402
from ddpo_group.shapes import sample_dataset, shapes_prompts  # noqa: E402

DEFAULT_OUTPUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ddpo_group", "assets", "tiny_shapes")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help="where the pipeline directory is written")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset-size", type=int, default=20000, help="rendered (image, prompt) pairs")
    parser.add_argument("--vae-steps", type=int, default=1500)
    parser.add_argument("--vae-batch-size", type=int, default=32)
    parser.add_argument("--vae-lr", type=float, default=2e-3)
    parser.add_argument("--kl-weight", type=float, default=1e-3, help="weight of the per-dimension KL term")
    parser.add_argument("--unet-steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64, help="UNet batch size")
    parser.add_argument("--unet-lr", type=float, default=1e-3)
    parser.add_argument("--cond-dropout", type=float, default=0.1, help="probability of the empty prompt")
    parser.add_argument("--ema-decay", type=float, default=0.999)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--eval-steps", type=int, default=50, help="DDIM steps of the final evaluation (0: skip it)")
    parser.add_argument("--eval-images-per-prompt", type=int, default=2)
    parser.add_argument("--guidance-scale", type=float, default=5.0)
    parser.add_argument("--eta", type=float, default=1.0)
    parser.add_argument("--samples-path", default=None, help="optional PNG grid of evaluation samples")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 (default) reproduces the shipped model and avoids oversubscription "
                             "on a shared CPU; 0 keeps torch's default")
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run (tiny step counts)")
    args = parser.parse_args(argv)
    if args.quick:
        args.dataset_size, args.vae_steps, args.unet_steps = 64, 3, 3
        args.vae_batch_size, args.batch_size, args.warmup_steps = 8, 8, 1
        args.eval_steps, args.eval_images_per_prompt = 2, 1
    for name in ("dataset_size", "vae_batch_size", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.cond_dropout < 1.0:
        raise ValueError(f"--cond-dropout must be in [0, 1), got {args.cond_dropout}")
    return args


def lr_lambda(warmup_steps: int, total_steps: int):
    """Learning-rate factor: linear warmup to 1, then cosine decay to 0.1."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


@torch.no_grad()
def ema_update(ema_params, params, decay: float, step: int) -> None:
    """theta_ema <- d theta_ema + (1 - d) theta, with d = min(decay, (1 + step) / (10 + step))."""
    d = min(decay, (1 + step) / (10 + step))
    for ema, p in zip(ema_params, params):
        ema.mul_(d).add_(p.detach(), alpha=1 - d)


def train_vae(vae, images: torch.Tensor, args, generator: torch.Generator) -> dict:
    """Stage 1; images (N, 3, H, W) in [-1, 1]. Returns {"loss", "mse", "kl", "seconds", "steps"}."""
    vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, args.vae_steps))
    start = time.time()
    smooth = {}
    progress = tqdm(range(args.vae_steps), desc="vae", dynamic_ncols=True, mininterval=2.0)
    for step in progress:
        idx = torch.randint(0, images.shape[0], (args.vae_batch_size,), generator=generator)
        x = images[idx]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        reconstruction = vae.decode(z).sample
        mse = F.mse_loss(reconstruction, x)
        kl = posterior.kl().mean() / z[0].numel()
        loss = mse + args.kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        for key, value in (("loss", loss.item()), ("mse", mse.item()), ("kl", kl.item())):
            smooth[key] = value if key not in smooth else 0.98 * smooth[key] + 0.02 * value
        progress.set_postfix(mse=f"{smooth['mse']:.4f}", kl=f"{smooth['kl']:.2f}", refresh=False)
    vae.eval()
    return {**smooth, "seconds": time.time() - start, "steps": args.vae_steps}


@torch.no_grad()
def encode_dataset(vae, images: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of every image: (N, 4, h, w) each."""
    means, stds = [], []
    for i in range(0, images.shape[0], chunk):
        posterior = vae.encode(images[i : i + chunk]).latent_dist
        means.append(posterior.mean)
        stds.append(posterior.std)
    return torch.cat(means), torch.cat(stds)


def train_unet(pipeline, latent_mean, latent_std, prompt_index, prompt_ids, args, generator) -> dict:
    """Stage 2: epsilon-prediction loss on (latents, prompt) pairs, UNet + text encoder trained.

    latent_mean / latent_std (N, 4, h, w) unscaled; prompt_index (N,) rows of prompt_ids
    (P+1, L) whose last row is the empty prompt. The EMA weights are copied into the models
    at the end. Returns {"loss", "seconds", "steps"}.
    """
    unet, text_encoder, noise_scheduler = pipeline.unet, pipeline.text_encoder, pipeline.scheduler
    scaling_factor = pipeline.vae.config.scaling_factor
    params = list(unet.parameters()) + list(text_encoder.parameters())
    ema_params = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=args.unet_lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, args.unet_steps))
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(torch.float32)
    num_train_timesteps = noise_scheduler.config.num_train_timesteps
    empty_row = prompt_ids.shape[0] - 1
    unet.train()
    text_encoder.train()
    start = time.time()
    smooth = None
    progress = tqdm(range(args.unet_steps), desc="unet", dynamic_ncols=True, mininterval=2.0)
    for step in progress:
        idx = torch.randint(0, latent_mean.shape[0], (args.batch_size,), generator=generator)
        z0 = latent_mean[idx] + latent_std[idx] * torch.randn(latent_mean[idx].shape, generator=generator)
        z0 = z0 * scaling_factor
        noise = torch.randn(z0.shape, generator=generator)
        timesteps = torch.randint(0, num_train_timesteps, (args.batch_size,), generator=generator)
        abar = alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        noisy = abar.sqrt() * z0 + (1 - abar).sqrt() * noise
        rows = prompt_index[idx].clone()
        rows[torch.rand(args.batch_size, generator=generator) < args.cond_dropout] = empty_row
        prompt_embeds = text_encoder(prompt_ids[rows])[0]
        prediction = unet(noisy, timesteps, prompt_embeds).sample
        loss = F.mse_loss(prediction, noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        ema_update(ema_params, params, args.ema_decay, step)
        smooth = loss.item() if smooth is None else 0.99 * smooth + 0.01 * loss.item()
        progress.set_postfix(loss=f"{smooth:.4f}", refresh=False)
    with torch.no_grad():
        for ema, p in zip(ema_params, params):
            p.copy_(ema)
    unet.eval()
    text_encoder.eval()
    return {"loss": smooth, "seconds": time.time() - start, "steps": args.unet_steps}


@torch.no_grad()
def evaluate(pipeline, args) -> dict:
    """Mean shapes_alignment of DDIM samples (eval_steps, guidance_scale, eta) over the 108 prompts."""
    records = shapes_prompts()
    prompts = [r["prompt"] for r in records for _ in range(args.eval_images_per_prompt)]
    generator = torch.Generator().manual_seed(args.seed + 1)
    start = time.time()
    images = []
    for i in tqdm(range(0, len(prompts), 108), desc="eval", dynamic_ncols=True):
        output = pipeline(
            prompts[i : i + 108],
            num_inference_steps=args.eval_steps,
            guidance_scale=args.guidance_scale,
            eta=args.eta,
            generator=generator,
            output_type="pt",
        )
        images.append(output.images.float().cpu())
    images = torch.cat(images)
    rewards, components = shapes_alignment(images, prompts, [{} for _ in prompts])
    per_prompt = rewards.reshape(len(records), args.eval_images_per_prompt).mean(axis=1)
    result = {
        "num_inference_steps": args.eval_steps,
        "guidance_scale": args.guidance_scale,
        "eta": args.eta,
        "images_per_prompt": args.eval_images_per_prompt,
        "seconds": time.time() - start,
        "shapes_alignment_mean": float(rewards.mean()),
        "shapes_alignment_std": float(rewards.std()),
        "per_prompt_std": float(per_prompt.std()),
        "per_prompt_min": float(per_prompt.min()),
        "per_prompt_max": float(per_prompt.max()),
        "components_mean": {name: float(value.mean()) for name, value in components.items()},
        "by_attribute": {},
        "per_prompt": {r["prompt"]: round(float(v), 4) for r, v in zip(records, per_prompt)},
    }
    for field in ("size", "color", "shape", "background"):
        values = sorted({r[field] for r in records})
        result["by_attribute"][field] = {
            v: float(np.mean([s for r, s in zip(records, per_prompt) if r[field] == v])) for v in values
        }
    if args.samples_path:
        save_grid(images, args.samples_path, columns=18)
    return result


def save_grid(images: torch.Tensor, path: str, columns: int) -> None:
    """Write (N, 3, H, W) [0, 1] images as one PNG, ``columns`` per row."""
    from PIL import Image

    n, _, h, w = images.shape
    rows = math.ceil(n / columns)
    grid = np.zeros((rows * h, columns * w, 3), dtype=np.uint8)
    array = (images.clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    for k in range(n):
        r, c = divmod(k, columns)
        grid[r * h : (r + 1) * h, c * w : (c + 1) * w] = array[k]
    Image.fromarray(grid).save(path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    previous_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _pretrain(args)
    finally:
        torch.set_num_threads(previous_threads)


def _pretrain(args) -> dict:
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    pipeline = build_tiny_pipeline(seed=args.seed)

    start = time.time()
    images_uint8, prompts = sample_dataset(args.dataset_size, seed=args.seed)
    images = torch.from_numpy(images_uint8).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    unique_prompts = [r["prompt"] for r in shapes_prompts()]
    row_of = {p: i for i, p in enumerate(unique_prompts)}
    prompt_index = torch.tensor([row_of[p] for p in prompts])
    prompt_ids = pipeline.tokenizer(
        unique_prompts + [""], padding="max_length", max_length=pipeline.tokenizer.model_max_length,
        truncation=True, return_tensors="pt",
    ).input_ids
    data_seconds = time.time() - start

    vae_stats = train_vae(pipeline.vae, images, args, generator)
    latent_mean, latent_std = encode_dataset(pipeline.vae, images)
    latents = latent_mean + latent_std * torch.randn(latent_mean.shape, generator=generator)
    scaling_factor = float(1.0 / latents.std())
    pipeline.vae.register_to_config(scaling_factor=scaling_factor)
    del images

    unet_stats = train_unet(pipeline, latent_mean, latent_std, prompt_index, prompt_ids, args, generator)

    os.makedirs(args.output_dir, exist_ok=True)
    pipeline.save_pretrained(args.output_dir, safe_serialization=True)
    evaluation = evaluate(pipeline, args) if args.eval_steps > 0 else None
    log = {
        "seed": args.seed,
        "quick": args.quick,
        "torch_threads": torch.get_num_threads(),
        "dataset_size": args.dataset_size,
        "data_seconds": data_seconds,
        "vae": {**vae_stats, "batch_size": args.vae_batch_size, "lr": args.vae_lr, "kl_weight": args.kl_weight},
        "scaling_factor": scaling_factor,
        "unet": {**unet_stats, "batch_size": args.batch_size, "lr": args.unet_lr, "cond_dropout": args.cond_dropout,
                 "ema_decay": args.ema_decay},
        "evaluation": evaluation,
    }
    with open(os.path.join(args.output_dir, "pretrain_log.json"), "w") as f:
        json.dump(log, f, indent=2)
    summary = f"vae {vae_stats['seconds']:.0f}s mse {vae_stats['mse']:.4f} | unet {unet_stats['seconds']:.0f}s loss {unet_stats['loss']:.4f}"
    if evaluation is not None:
        summary += f" | shapes_alignment {evaluation['shapes_alignment_mean']:.3f}"
    print(summary)
    print(f"saved to {args.output_dir}")
    return log


if __name__ == "__main__":
    main()
