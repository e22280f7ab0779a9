"""Pretrain the tiny Stable Diffusion pipeline on the shapes world, on a CPU, offline.

    ddpo-group pretrain                       # 12-25 min on a CPU -> a new folder runs/pretrain_shapes_TIME
    ddpo-group pretrain --quick               # seconds: smoke test -> a new folder runs/pretrain_shapes_quick_TIME
    ddpo-group pretrain --output-dir DIR      # -> DIR (never inside the package)
    ddpo-group pretrain --replace-shipped     # re-create the shipped ddpo_group/assets/tiny_shapes (asked for by name)
    python scripts/pretrain_tiny.py [the same flags]      # the same command from a checkout (it wraps this module)

Nothing writes into the package unless --replace-shipped says so: a smoke run or a try of other options must not
replace the shipped model that the main jobs fine-tune.

One room, past the ~600 lines a module gets before it is split: the shapes and scenes worlds' pretraining share their
steps (the VAE step, the learning-rate schedule, the EMA, the denoiser losses, the saved log) and one option parser
whose defaults depend on the world, and every function here is a stage of that one command; split, each part would
import the others' internals. Heavy modules (torch, diffusers, the rewards) are imported when a pretraining starts,
not for --help.

The architecture is ``ddpo_group.diffusion.tiny.build_tiny_pipeline`` (32x32 images,
VAE scale factor 4, 4x8x8 latents, ~0.8M-parameter UNet, tiny CLIP text encoder). Data
are (image, prompt) pairs rendered by ``ddpo_group.data.shapes.sample_dataset``.

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

The shipped ``ddpo_group/assets/tiny_shapes`` is this script with its defaults and --replace-shipped (seed 0, 1500
VAE steps, 3000 UNet steps, 1 thread): 456 s + 952 s on a shared 2-core machine, final
VAE mse 0.0065, UNet loss 0.108, mean ``shapes_alignment`` 0.56 (DDIM 50 steps, guidance 5,
eta 1), deliberately short of 1 so that RL fine-tuning has headroom.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import time

import numpy as np

from ddpo_group.cli.common import debug, inside_package, one_line

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT_DIR = os.path.dirname(PACKAGE_DIR)
ASSETS_DIR = os.path.join(PACKAGE_DIR, "assets")
DEFAULT_OUTPUT_DIR = os.path.join(ASSETS_DIR, "tiny_shapes")


def _import_torch() -> None:
    """torch, torch.nn.functional (F) and tqdm as this module's globals, imported when a pretraining (or a function
    of it) runs: `ddpo-group pretrain --help` imports none of them and answers in a fraction of a second."""
    global torch, F, tqdm
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm


def no_grad(fn):
    """torch.no_grad() as a decorator, torch imported when `fn` is called (not when this module is)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        _import_torch()
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run


class PretrainError(ValueError):
    """A bad input of this command (a state file, a path); the message names it and the fix."""


def number(kind, low=None, high=None, low_open=False, high_open=False):
    """An argparse type: a finite `kind` (int or float) in [low, high] (an end open when `*_open`): NaN, inf, a
    zero learning rate or a negative step count is refused when parsed, in argparse's one line naming the option."""
    bounds = ([f"{'>' if low_open else '>='} {low}"] if low is not None else []) + (
        [f"{'<' if high_open else '<='} {high}"] if high is not None else [])

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        above = low is None or (value > low if low_open else value >= low)
        below = high is None or (value < high if high_open else value <= high)
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(f"must be a finite number {' and '.join(bounds)}, got {text!r}")
        return value

    return parse


def parse_args(argv=None, prog=None):
    from ddpo_group.cli.common import OneLineArgumentParser

    parser = OneLineArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", choices=("shapes", "scenes"), default="shapes",
                        help="shapes: one shape per 32-px image (tiny-shapes); scenes: 1-4 shapes per 64-px image with "
                             "GenEval captions (tiny-scenes, tiny-scenes-sd3)")
    parser.add_argument("--arch", choices=("sd", "sd3", "sd-flow"), default="sd",
                        help="sd: UNet + DDIM (StableDiffusionPipeline); sd3: MMDiT flow matching (scenes world only); "
                             "sd-flow: the UNet trained by flow matching, a StableDiffusionPipeline with SD3's "
                             "flow scheduler (scenes world only; the sd_flow family)")
    parser.add_argument("--output-dir", default=None,
                        help="where the pipeline directory is written, never inside the package (default: a new "
                             "folder runs/pretrain_WORLD[_ARCH][_quick]_TIME under the current directory; the "
                             "shipped models are replaced only with --replace-shipped)")
    parser.add_argument("--replace-shipped", action="store_true",
                        help="write over the shipped model of the world and arch (ddpo_group/assets/tiny_shapes, "
                             "tiny_scenes or tiny_scenes_sd3) that the main jobs fine-tune: what re-creating it "
                             "takes; not with --quick or --output-dir")
    parser.add_argument("--state-dir", default=None,
                        help="scenes world: where the resumable state goes (default runs/pretrain_scenes_ARCH)")
    parser.add_argument("--max-minutes", type=number(float, 0), default=0.0,
                        help="scenes world: stop after this many minutes, the state saved; the same command goes on "
                             "(0: no limit)")
    parser.add_argument("--checkpoint-every", type=number(int, 1), default=250,
                        help="scenes world: steps between saved states")
    parser.add_argument("--stop-at-step", type=number(int, 0), default=0,
                        help="scenes world: stop when the denoiser stage reaches this step, the state saved (a schedule "
                             "run in parts gives the same weights as one run; 0: run to the end)")
    parser.add_argument("--vae-from", default=None,
                        help="scenes world: take the VAE of this pipeline directory instead of training one")
    parser.add_argument("--vae-crop", type=number(int, 4, 64), default=32,
                        help="scenes world: the VAE trains on crops of this size (a multiple of 4)")
    parser.add_argument("--size", choices=("s", "m", "l"), default="s",
                        help="scenes world: the denoiser's size (ddpo_group.diffusion.tiny.SCENES_SIZES; docs/scenes.md "
                             "has the scaling table)")
    parser.add_argument("--patch", type=int, choices=(1, 2), default=2,
                        help="scenes world, --arch sd3: the transformer's patch side in latent pixels; 2: 8x8 tokens "
                             "(the shipped tiny-scenes-sd3), 1: 16x16 tokens, about 4x the compute a step")
    parser.add_argument("--object-scale", choices=("fine", "coarse"), default="fine",
                        help="scenes world: the objects' areas, fine 80-160 px (issue 42's world) or coarse 150-260 px "
                             "(issue 53's: 1.4x as wide; ddpo_group.data.scenes.COARSE_AREA_RANGE, docs/scenes.md)")
    parser.add_argument("--flow-times", choices=("logit-normal", "uniform"), default="logit-normal",
                        help="scenes world, --arch sd3 or sd-flow: the noise levels the flow model trains at, SD3's "
                             "logit-normal(0, 1) or uniform in (0, 1) (seven times as many below 0.1)")
    parser.add_argument("--init", choices=("default", "adaln-zero"), default="default",
                        help="scenes world, --arch sd3: the transformer's initialisation, PyTorch's default (the "
                             "shipped tiny-scenes-sd3) or DiT's adaLN-Zero (every block's modulation and the output layer "
                             "at zero: ddpo_group.diffusion.tiny.adaln_zero_init)")
    parser.add_argument("--device", default="cpu",
                        help="scenes world: where the models train and sample (cpu, cuda, cuda:1...); the random "
                             "draws stay on the CPU's generator, so a device changes only the floating-point sums")
    parser.add_argument("--render-workers", type=number(int, 1), default=1,
                        help="scenes world: processes that render the data set (the same set for any number)")
    parser.add_argument("--denoiser-minutes", type=number(float, 0, low_open=True), default=None,
                        help="scenes world: instead of --unet-steps, train the denoiser for about this many minutes; "
                             "the step count is set from the speed of the first 50 steps (inside the warmup, whose "
                             "learning rates do not depend on it), recorded in the state and the log")
    parser.add_argument("--seed", type=number(int, 0), default=0)
    parser.add_argument("--dataset-size", type=number(int, 1), default=20000,
                        help="rendered (image, prompt) pairs")
    parser.add_argument("--vae-steps", type=number(int, 0), default=1500)
    parser.add_argument("--vae-batch-size", type=number(int, 1), default=32)
    parser.add_argument("--vae-lr", type=number(float, 0, low_open=True), default=2e-3)
    parser.add_argument("--kl-weight", type=number(float, 0), default=1e-3,
                        help="weight of the per-dimension KL term")
    parser.add_argument("--unet-steps", type=number(int, 1), default=3000)
    parser.add_argument("--batch-size", type=number(int, 1), default=64, help="UNet batch size")
    parser.add_argument("--unet-lr", type=number(float, 0, low_open=True), default=1e-3)
    parser.add_argument("--cond-dropout", type=number(float, 0, 1, high_open=True), default=0.1,
                        help="probability of the empty prompt")
    parser.add_argument("--ema-decay", type=number(float, 0, 1, high_open=True), default=0.999)
    parser.add_argument("--warmup-steps", type=number(int, 0), default=100)
    parser.add_argument("--eval-steps", type=number(int, 0), default=50,
                        help="DDIM steps of the final evaluation (0: skip it)")
    parser.add_argument("--eval-images-per-prompt", type=number(int, 1), default=2)
    parser.add_argument("--guidance-scale", type=number(float, 0), default=5.0)
    parser.add_argument("--eta", type=number(float, 0), default=1.0)
    parser.add_argument("--samples-path", default=None, help="optional PNG grid of evaluation samples")
    parser.add_argument("--threads", type=number(int, 0), default=1,
                        help="torch threads; 1 (default) reproduces the shipped model and avoids oversubscription "
                             "on a shared CPU; 0 keeps torch's default")
    parser.add_argument("--quick", action="store_true",
                        help="seconds-long smoke run (tiny step counts); written, without --output-dir, to a new "
                             "folder runs/pretrain_WORLD[_ARCH]_quick_TIME")
    args = parser.parse_args(argv)
    args.prog = parser.prog
    scenes = args.world == "scenes"
    # the options the command line gives, whatever their value: one given at its default is still given
    not_given = object()
    given = {name for name, value in vars(parser.parse_args(
        argv, namespace=argparse.Namespace(**{name: not_given for name in vars(args)}))).items()
        if value is not not_given}
    if not scenes:  # the scenes world's options on the shapes world: refused, never ignored
        for name in SCENES_ONLY:
            if name in given:
                parser.error(f"argument --{name.replace('_', '-')}: the scenes world's (--world scenes); the shapes "
                             "world's pretraining runs to its end in one go, with no state to stop or resume")
    if args.vae_crop % 4:
        parser.error(f"argument --vae-crop: must be a multiple of 4 (the VAE's scale factor), got {args.vae_crop}")
    for name in ("output_dir", "state_dir"):  # found out before the pretraining, not after it
        path = getattr(args, name)
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            parser.error(f"argument --{name.replace('_', '-')}: {path} is a file; give a directory")
    if args.replace_shipped and (args.quick or args.output_dir is not None):
        parser.error("argument --replace-shipped: not with " + ("--quick (a smoke run's weights would replace the "
                     "shipped model)" if args.quick else "--output-dir (it writes the shipped model's own folder)"))
    for name in ("output_dir", "state_dir", "samples_path"):  # the package's files are never written over
        path = getattr(args, name)
        problem = path is not None and inside_package(path, "--" + name.replace("_", "-"))
        if problem:
            parser.error("argument " + problem + (" (--replace-shipped re-creates the shipped model)"
                                                  if name == "output_dir" else ""))
    for name in ("output_dir", "state_dir"):  # a folder that can be made: found out before the pretraining
        path = getattr(args, name)
        existing = os.path.abspath(path) if path is not None else None
        while existing is not None and not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if existing is not None and (not os.path.isdir(existing) or not os.access(existing, os.W_OK)):
            parser.error(f"argument --{name.replace('_', '-')}: {path} cannot be made ({existing} is "
                         f"{'a file' if not os.path.isdir(existing) else 'not writable'}); give another folder")
    if args.samples_path is not None:  # found out before the pretraining, not after it
        folder = os.path.dirname(os.path.abspath(args.samples_path))
        if os.path.isdir(args.samples_path) or not os.path.isdir(folder):
            parser.error(f"argument --samples-path: {args.samples_path} "
                         + ("is a directory; give a PNG file path" if os.path.isdir(args.samples_path) else
                            f"is in a folder that does not exist ({folder}); create it or give another path"))
    if args.vae_from is not None and not os.path.isdir(os.path.join(args.vae_from, "vae")):
        parser.error(f"argument --vae-from: {args.vae_from} has no vae/ folder; give a pipeline directory this "
                     "script wrote (e.g. ddpo_group/assets/tiny_scenes_sd3)")
    if args.denoiser_minutes is not None and args.warmup_steps < AUTO_STEPS_PROBE:
        parser.error(f"argument --denoiser-minutes: needs --warmup-steps >= {AUTO_STEPS_PROBE} (the speed is measured "
                     f"inside the warmup), got {args.warmup_steps}")
    if args.arch != "sd" and not scenes:
        parser.error(f"--arch {args.arch} is for --world scenes (the shapes world's tiny-shapes is a DDIM UNet)")
    if args.flow_times != "logit-normal" and args.arch == "sd":
        parser.error("argument --flow-times: the flow models' (--arch sd3 or sd-flow); --arch sd trains at DDPM's "
                     "timesteps")
    if args.patch != 2 and args.arch != "sd3":
        parser.error(f"argument --patch: the transformer's (--arch sd3); --arch {args.arch} has no patches")
    if args.init != "default" and args.arch != "sd3":
        parser.error(f"argument --init: the transformer's (--arch sd3); --arch {args.arch} has no adaptive norms")
    if scenes:  # the scenes world's defaults where the shapes world's were not given
        for name, value in SCENES_DEFAULTS[args.arch].items():
            if name not in given:
                setattr(args, name, value)
    if args.replace_shipped:
        args.output_dir = os.path.join(ASSETS_DIR, SCENES_DEFAULT_OUTPUT[args.arch]) if scenes else DEFAULT_OUTPUT_DIR
    elif args.output_dir is None:
        args.output_dir = new_output_dir(args)
    if args.quick:  # tiny step counts, except where an option was given
        for name, value in QUICK.items():
            if name not in given:
                setattr(args, name, value)
    if args.samples_path is not None and args.eval_steps == 0:
        parser.error(f"argument --samples-path: the samples are the evaluation's, and --eval-steps 0 skips it; "
                     "give --eval-steps N or no --samples-path")
    return args


AUTO_STEPS_PROBE = 50  # steps timed to set the denoiser's step count from --denoiser-minutes

# Options of the scenes world alone: on the shapes world they are refused.
SCENES_ONLY = ("state_dir", "max_minutes", "checkpoint_every", "stop_at_step", "vae_from", "vae_crop", "object_scale",
               "flow_times", "init")


def new_output_dir(args) -> str:
    """The default --output-dir: a folder that does not exist yet, runs/pretrain_WORLD[_ARCH][_quick]_TIME under the
    current directory (a second one in the same second gets _2, _3, ...)."""
    name = "_".join(["pretrain", args.world] + ([args.arch] if args.world == "scenes" else [])
                    + (["quick"] if args.quick else []) + [time.strftime("%Y%m%d-%H%M%S")])
    path, n = os.path.abspath(os.path.join("runs", name)), 1
    while os.path.exists(path):
        n += 1
        path = os.path.abspath(os.path.join("runs", f"{name}_{n}"))
    return path


# --quick: a seconds-long smoke run.
QUICK = {"dataset_size": 64, "vae_steps": 3, "unet_steps": 3, "vae_batch_size": 8, "batch_size": 8, "warmup_steps": 1,
         "eval_steps": 2, "eval_images_per_prompt": 1}

# The scenes world's defaults (see docs/scenes.md for the measured times on this machine).
SCENES_DEFAULTS = {
    "sd3": {"dataset_size": 20000, "vae_steps": 2000, "unet_steps": 10000, "batch_size": 32, "unet_lr": 1e-3,
            "eval_steps": 20, "eval_images_per_prompt": 4, "guidance_scale": 4.5},
    "sd": {"dataset_size": 20000, "vae_steps": 2000, "unet_steps": 8000, "batch_size": 32, "unet_lr": 1e-3,
           "eval_steps": 20, "eval_images_per_prompt": 4, "guidance_scale": 5.0},
    # the UNet's schedule, evaluated as the flow model is (the Euler ODE at CFG 4.5)
    "sd-flow": {"dataset_size": 20000, "vae_steps": 2000, "unet_steps": 8000, "batch_size": 32, "unet_lr": 1e-3,
                "eval_steps": 20, "eval_images_per_prompt": 4, "guidance_scale": 4.5},
}


def lr_lambda(warmup_steps: int, total_steps):
    """Learning-rate factor: linear warmup to 1, then cosine decay to 0.1. ``total_steps``: an int, or a one-item
    list read at each step (a count set after the warmup's first steps, --denoiser-minutes)."""

    def factor(step: int) -> float:
        total = total_steps[0] if isinstance(total_steps, list) else total_steps
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


@no_grad
def ema_update(ema_params, params, decay: float, step: int) -> None:
    """theta_ema <- d theta_ema + (1 - d) theta, with d = min(decay, (1 + step) / (10 + step))."""
    d = min(decay, (1 + step) / (10 + step))
    # one fused call over the lists (the same arithmetic as ema.mul_(d).add_(p, alpha=1 - d) per tensor): on a GPU a
    # loop of small kernels would cost more than the model's step
    torch._foreach_mul_(ema_params, d)
    torch._foreach_add_(ema_params, [p.detach() for p in params], alpha=1 - d)


def vae_step(vae, posterior, x, optimizer, scheduler, kl_weight, generator, smooth) -> None:
    """One step of stage 1 on the batch x and its posterior q(z | x) (module docstring's L_vae), gradients clipped
    to norm 1; `smooth` (a dict) gets the moving averages of "loss", "mse" and "kl"."""
    z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator).to(posterior.mean.device)
    reconstruction = vae.decode(z).sample
    mse = F.mse_loss(reconstruction, x)
    kl = posterior.kl().mean() / z[0].numel()
    loss = mse + kl_weight * kl
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    for key, value in (("loss", loss.item()), ("mse", mse.item()), ("kl", kl.item())):
        smooth[key] = value if key not in smooth else 0.98 * smooth[key] + 0.02 * value


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
        vae_step(vae, posterior, x, optimizer, scheduler, args.kl_weight, generator, smooth)
        progress.set_postfix(mse=f"{smooth['mse']:.4f}", kl=f"{smooth['kl']:.2f}", refresh=False)
    vae.eval()
    return {**smooth, "seconds": time.time() - start, "steps": args.vae_steps}


@no_grad
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


@no_grad
def evaluate(pipeline, args) -> dict:
    """Mean shapes_alignment of DDIM samples (eval_steps, guidance_scale, eta) over the 108 prompts."""
    from ddpo_group.data.shapes import shapes_prompts
    from ddpo_group.rewards.registry import resolve_reward

    shapes_alignment = resolve_reward("shapes_alignment")
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
    array = (images.clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    for k in range(n):
        r, c = divmod(k, columns)
        grid[r * h : (r + 1) * h, c * w : (c + 1) * w] = array[k]
    Image.fromarray(grid).save(path)


def main(argv=None, prog=None) -> dict:
    """The command (module docstring); returns the log written. Every error is one line naming the command as it
    was called (DDPO_GROUP_DEBUG=1: the traceback)."""
    args = parse_args(argv, prog)
    print(f"{args.prog}: the pipeline goes to {args.output_dir}")
    _import_torch()
    previous_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _pretrain_scenes(args) if args.world == "scenes" else _pretrain(args)
    except KeyboardInterrupt:
        raise SystemExit(f"{args.prog}: interrupted (Ctrl-C)") from None
    except Exception as err:
        if debug():
            raise
        raise SystemExit(f"{args.prog}: error: {err if isinstance(err, PretrainError) else one_line(err)}") from None
    finally:
        torch.set_num_threads(previous_threads)


def write_log(output_dir: str, log: dict) -> None:
    """pretrain_log.json in `output_dir`, atomically (a temporary beside it, then renamed); the SD3 policy reads
    it back (its ``text_tokens``); the name is ``diffusion/tiny.PRETRAIN_LOG``, below the families."""
    from ddpo_group.diffusion.tiny import PRETRAIN_LOG

    path = os.path.join(output_dir, PRETRAIN_LOG)
    with open(path + ".tmp", "w") as f:
        json.dump(log, f, indent=2)
    os.replace(path + ".tmp", path)


def evaluate_into_log(output_dir: str, log: dict, run_evaluation) -> None:
    """log["evaluation"] = run_evaluation(), pretrain_log.json written before it (the training's numbers are kept
    when the evaluation fails: its error is logged, then raised) and after it."""
    log["evaluation"] = None
    write_log(output_dir, log)
    try:
        log["evaluation"] = run_evaluation()
    except BaseException as err:
        log["evaluation"] = {"error": one_line(err)}
        write_log(output_dir, log)
        raise
    write_log(output_dir, log)


def _pretrain(args) -> dict:
    from ddpo_group.data.shapes import sample_dataset, shapes_prompts
    from ddpo_group.diffusion.tiny import build_tiny_pipeline

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
    }
    evaluate_into_log(args.output_dir, log, lambda: evaluate(pipeline, args) if args.eval_steps > 0 else None)
    evaluation = log["evaluation"]
    summary = f"vae {vae_stats['seconds']:.0f}s mse {vae_stats['mse']:.4f} | unet {unet_stats['seconds']:.0f}s loss {unet_stats['loss']:.4f}"
    if evaluation is not None:
        summary += f" | shapes_alignment {evaluation['shapes_alignment_mean']:.3f}"
    print(summary)
    print(f"saved to {args.output_dir}")
    return log


# The scenes world (--world scenes): 64-px scenes of one to four shapes, GenEval captions, resumable.

SCENES_DEFAULT_OUTPUT = {"sd3": "tiny_scenes_sd3", "sd": "tiny_scenes", "sd-flow": "tiny_scenes_flow"}


def atomic_save(obj, path: str) -> None:
    """torch.save to a temporary beside `path`, then rename: a stop mid-write leaves the old file whole."""
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def flow_text_embeddings(pipeline, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SD3's conditioning as StableDiffusion3Pipeline.encode_prompt builds it without T5: each CLIP's
    penultimate hidden states side by side (B, L, 64), then L zero tokens for the absent T5; pooled: the two
    projections side by side (B, 64)."""
    first = pipeline.text_encoder(ids, output_hidden_states=True)
    second = pipeline.text_encoder_2(ids, output_hidden_states=True)
    hidden = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
    width = pipeline.transformer.config.joint_attention_dim
    hidden = F.pad(hidden, (0, width - hidden.shape[-1]))
    hidden = torch.cat([hidden, torch.zeros_like(hidden)], dim=1)
    return hidden, torch.cat([first[0], second[0]], dim=-1)


def denoiser_loss(pipeline, arch: str, z0: torch.Tensor, ids: torch.Tensor, generator,
                  flow_times: str = "logit-normal", levels=None, per_sample: bool = False) -> torch.Tensor:
    """One batch's loss on scaled latents z0 (module docstring): epsilon prediction (sd) or flow matching (sd3, and
    sd-flow: the same loss with the UNet and its one text encoder as the velocity predictor),
    its noise levels s logit-normal(0, 1) (SD3's) or uniform in (0, 1) (`flow_times`, ``--flow-times``). The draws
    come from `generator` (a CPU one) and move to z0's device, the noise first. `levels` (a CPU tensor, one per
    sample) fixes the noise levels instead of drawing them: sd's integer timesteps, the flow models' s in (0, 1)
    (benchmarks/relation_loss.py measures the loss level by level). `per_sample`: each sample's mean squared error
    (n,) instead of the batch's (their mean, the same draws)."""
    device = z0.device
    noise = torch.randn(z0.shape, generator=generator).to(device)
    n = z0.shape[0]
    ids = ids.to(device)
    if arch == "sd":
        timesteps = levels.long() if levels is not None else torch.randint(
            0, pipeline.scheduler.config.num_train_timesteps, (n,), generator=generator)
        abar = pipeline.scheduler.alphas_cumprod.to(torch.float32)[timesteps].view(-1, 1, 1, 1).to(device)
        timesteps = timesteps.to(device)
        noisy = abar.sqrt() * z0 + (1 - abar).sqrt() * noise
        prediction = pipeline.unet(noisy, timesteps, pipeline.text_encoder(ids)[0]).sample
        return _mse(prediction, noise, per_sample)
    if levels is not None:
        sigma = levels.float().view(-1, 1, 1, 1).to(device)
    elif flow_times == "uniform":
        sigma = torch.rand(n, generator=generator).view(-1, 1, 1, 1).to(device)
    else:
        sigma = torch.sigmoid(torch.randn(n, generator=generator)).view(-1, 1, 1, 1).to(device)  # logit-normal(0, 1)
    noisy = (1 - sigma) * z0 + sigma * noise
    if arch == "sd-flow":
        prediction = pipeline.unet(noisy, sigma.view(-1) * 1000, pipeline.text_encoder(ids)[0]).sample
        return _mse(prediction, noise - z0, per_sample)
    hidden, pooled = flow_text_embeddings(pipeline, ids)
    prediction = pipeline.transformer(noisy, encoder_hidden_states=hidden, pooled_projections=pooled,
                                      timestep=sigma.view(-1) * 1000).sample
    return _mse(prediction, noise - z0, per_sample)


def _mse(prediction, target, per_sample: bool):
    """F.mse_loss of the batch, or each sample's (denoiser_loss's `per_sample`)."""
    if per_sample:
        return ((prediction - target) ** 2).flatten(1).mean(dim=1)
    return F.mse_loss(prediction, target)


def scenes_batch(latent_mean, latent_std, rows, empty_row: int, batch_size: int, cond_dropout: float, generator):
    """A denoiser batch: `batch_size` scenes drawn with replacement, each latent drawn from its posterior (mean + std
    * N(0, 1), unscaled, on latent_mean's device), and their prompts' `rows` (a CPU tensor), each replaced by
    `empty_row` with probability `cond_dropout` (classifier-free guidance). The draws come from `generator` (a CPU
    one) in that order. Returns (latents, rows)."""
    device = latent_mean.device
    idx = torch.randint(0, latent_mean.shape[0], (batch_size,), generator=generator)
    z = latent_mean[idx.to(device)] + latent_std[idx.to(device)] * torch.randn(
        (batch_size,) + tuple(latent_mean.shape[1:]), generator=generator).to(device)
    batch_rows = rows[idx].clone()
    batch_rows[torch.rand(batch_size, generator=generator) < cond_dropout] = empty_row
    return z, batch_rows


class Stopped(Exception):
    """The time budget ran out; the state is saved and the same command resumes."""


def _scenes_paths(args):
    output = args.output_dir or os.path.join(ASSETS_DIR, SCENES_DEFAULT_OUTPUT[args.arch])
    state = args.state_dir or os.path.join(ROOT_DIR, "runs", f"pretrain_scenes_{args.arch}")
    return output, state


# What a scenes state is made with: a resume with another value would silently train another schedule (or load
# weights of another shape), so it is refused. The session's own options (--max-minutes, --stop-at-step,
# --checkpoint-every, --threads, --output-dir, the evaluation's) may change between parts.
RECORDED_OPTIONS = ("world", "arch", "size", "patch", "object_scale", "flow_times", "init", "quick", "seed",
                    "dataset_size", "vae_from", "vae_crop", "vae_steps", "vae_batch_size", "vae_lr", "kl_weight",
                    "unet_steps", "denoiser_minutes", "batch_size", "unet_lr", "cond_dropout", "ema_decay", "warmup_steps")
OPTIONS_FILE = "options.json"
DEFAULTS_OF_LATER_OPTIONS = {"size": "s", "patch": 2, "denoiser_minutes": None, "object_scale": "fine",
                             "flow_times": "logit-normal", "init": "default"}


def recorded_options(args) -> dict:
    """The options of RECORDED_OPTIONS as the state directory's options.json holds them (--vae-from absolute)."""
    options = {name: getattr(args, name) for name in RECORDED_OPTIONS}
    if options["vae_from"] is not None:
        options["vae_from"] = os.path.abspath(options["vae_from"])
    return options


def check_recorded_options(args, state_dir: str) -> None:
    """A new state directory records the options it is made with (options.json); a resume with another value of
    any of them stops in one line naming the option, the recorded value and the fix. A state directory from
    before the options were recorded gets them now (what it was made with cannot be known: its weights' shapes
    are checked when loaded)."""
    path = os.path.join(state_dir, OPTIONS_FILE)
    options = recorded_options(args)
    if not os.path.exists(path):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(options, f, indent=2)
        os.replace(tmp, path)
        return
    try:
        with open(path) as f:
            recorded = json.load(f)
        if not isinstance(recorded, dict):
            raise ValueError(f"a JSON {type(recorded).__name__}, not an object")
    except (OSError, ValueError) as err:
        raise SystemExit(f"{args.prog}: error: --state-dir {state_dir}: its {OPTIONS_FILE} cannot be read "
                         f"({err}); give another --state-dir to start afresh") from None
    for name in RECORDED_OPTIONS:
        if name not in recorded:  # an option added after the state was made: the state was made at its default
            if name not in DEFAULTS_OF_LATER_OPTIONS:
                continue
            recorded[name] = DEFAULTS_OF_LATER_OPTIONS[name]
        if recorded[name] == options[name]:
            continue
        option = "--" + name.replace("_", "-")
        if name == "quick":  # a flag: with it or without it
            made = ("with " if recorded[name] else "without ") + option
            given = ("not with " if options[name] else "not without ") + option
        else:
            made, given = f"with {option} {recorded[name]}", f"not {options[name]}"
        raise SystemExit(f"{args.prog}: error: {option}: the state in --state-dir {state_dir} was made {made}, "
                         f"{given}; resume {made}, or give another --state-dir to start afresh (the state's options: "
                         f"{path})")


def area_range_of(args) -> tuple[float, float]:
    """The objects' areas in px of --object-scale (ddpo_group.data.scenes)."""
    from ddpo_group.data import scenes

    return scenes.COARSE_AREA_RANGE if args.object_scale == "coarse" else scenes.AREA_RANGE


def _scenes_data(args, state_dir, pipeline):
    """(images uint8 (N, 64, 64, 3), prompt rows (N,), unique prompts): rendered once, cached in the state dir."""
    from ddpo_group.data.scenes import sample_dataset

    path = os.path.join(state_dir, "data.npz")
    if os.path.exists(path):
        try:
            with np.load(path, allow_pickle=False) as data:
                images, rows, prompts = data["images"], data["rows"], [str(p) for p in data["prompts"]]
            if images.ndim != 4 or len(images) != len(rows):
                raise ValueError(f"images {images.shape} for {len(rows)} prompt rows")
        except Exception as err:
            raise damaged_state(path, err, "remove it (it is rendered again, the same from the same --seed)") from None
        return images, torch.from_numpy(rows), prompts
    images, prompts = sample_dataset(args.dataset_size, seed=args.seed, workers=args.render_workers,
                                     area_range=area_range_of(args))
    unique = sorted(set(prompts))
    row_of = {p: i for i, p in enumerate(unique)}
    rows = np.asarray([row_of[p] for p in prompts], dtype=np.int64)
    tmp = path + ".tmp.npz"
    np.savez(tmp, images=images, rows=rows, prompts=np.asarray(unique))
    os.replace(tmp, path)
    return images, torch.from_numpy(rows), unique


def damaged_state(path: str, err: BaseException, fix: str) -> PretrainError:
    """The one-line error for a state file that is cut or damaged (a stop mid-copy, a full disk, another file)."""
    return PretrainError(f"the state file {path} is cut or damaged ({one_line(err)}); {fix}, or give another "
                         "--state-dir to start afresh")


def _load_state(state_dir):
    path = os.path.join(state_dir, "state.pt")
    if not os.path.exists(path):
        return None
    try:
        state = torch.load(path, weights_only=True)
        if not isinstance(state, dict) or state.get("stage") not in ("vae", "denoiser"):
            raise ValueError(f"a {type(state).__name__} without the stage 'vae' or 'denoiser'")
    except Exception as err:
        raise damaged_state(path, err, "remove it to start the training over (the rendered data.npz is kept)") from None
    return state


def _train_scenes_vae(pipeline, images, args, state_dir, deadline) -> dict:
    """Stage 1 on random 32x32 crops of the 64-px scenes (the VAE is convolutional; a crop costs a quarter)."""
    vae = pipeline.vae
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, args.vae_steps))
    generator = torch.Generator().manual_seed(args.seed)
    start_step, smooth, seconds = 0, {}, 0.0
    state = _load_state(state_dir)
    if state is not None and state["stage"] == "vae":
        vae.load_state_dict(state["vae"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        generator.set_state(state["generator"])
        start_step, smooth, seconds = state["step"], state["smooth"], state["seconds"]
    crop = args.vae_crop
    size = images.shape[1]
    vae.train()
    began = time.time()
    progress = tqdm(range(start_step, args.vae_steps), desc="vae", dynamic_ncols=True, mininterval=2.0,
                    initial=start_step, total=args.vae_steps)

    def save(step):
        atomic_save({"stage": "vae", "step": step, "vae": vae.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "generator": generator.get_state(), "smooth": smooth,
                     "seconds": seconds + time.time() - began}, os.path.join(state_dir, "state.pt"))

    for step in progress:
        if time.time() > deadline:
            save(step)
            raise Stopped(f"vae step {step}")
        idx = torch.randint(0, images.shape[0], (args.vae_batch_size,), generator=generator)
        top, left = (int(v) for v in torch.randint(0, size - crop + 1, (2,), generator=generator))
        x = torch.from_numpy(images[idx.cpu().numpy()][:, top : top + crop, left : left + crop]).permute(0, 3, 1, 2)
        x = (x.float() / 127.5 - 1.0).to(args.device)
        vae_step(vae, vae.encode(x).latent_dist, x, optimizer, scheduler, args.kl_weight, generator, smooth)
        progress.set_postfix(mse=f"{smooth['mse']:.4f}", refresh=False)
        if (step + 1) % args.checkpoint_every == 0:
            save(step + 1)
    vae.eval()
    return {**smooth, "seconds": seconds + time.time() - began, "steps": args.vae_steps, "crop": crop}


@no_grad
def encode_scenes(vae, images, chunk=64):
    """Posterior mean and std (N, 4, h, w) of every image, on the CPU (encoded on the VAE's device)."""
    device = vae.device
    chunk = chunk if device.type == "cpu" else 1024
    means, stds = [], []
    for i in tqdm(range(0, len(images), chunk), desc="encode", dynamic_ncols=True, mininterval=2.0):
        x = (torch.from_numpy(images[i : i + chunk]).permute(0, 3, 1, 2).float() / 127.5 - 1.0).to(device)
        posterior = vae.encode(x).latent_dist
        means.append(posterior.mean.cpu())
        stds.append(posterior.std.cpu())
    return torch.cat(means), torch.cat(stds)


def _train_scenes_denoiser(pipeline, args, latents, rows, prompt_ids, state_dir, deadline, previous, vae_stats) -> dict:
    """Stage 2 (module docstring), resumable; the EMA weights are copied into the models at the end."""
    denoiser = pipeline.transformer if args.arch == "sd3" else pipeline.unet
    encoders = [pipeline.text_encoder] + ([pipeline.text_encoder_2] if args.arch == "sd3" else [])
    modules = [denoiser] + encoders
    params = [p for m in modules for p in m.parameters()]
    ema_params = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=args.unet_lr, weight_decay=1e-2)
    total_steps = [args.unet_steps]  # set from the first steps' speed under --denoiser-minutes
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, total_steps))
    generator = torch.Generator().manual_seed(args.seed + 1)
    device = torch.device(args.device)
    latent_mean, latent_std = (t.to(device) for t in latents)
    start_step, smooth, seconds = 0, None, 0.0
    if previous is not None and previous["stage"] == "denoiser":
        try:
            if len(previous["modules"]) != len(modules):
                raise RuntimeError(f"{len(previous['modules'])} models saved, {len(modules)} expected")
            for module, weights in zip(modules, previous["modules"]):
                module.load_state_dict(weights)
        except RuntimeError as err:  # another --arch (a state from before options.json recorded it)
            raise SystemExit(f"{args.prog}: error: --arch {args.arch}: the state in --state-dir {state_dir} "
                             f"does not fit it ({str(err).splitlines()[0]}); resume with the --arch it was made "
                             "with, or give another --state-dir to start afresh") from None
        for ema, saved in zip(ema_params, previous["ema"]):
            ema.copy_(saved)
        optimizer.load_state_dict(previous["optimizer"])
        scheduler.load_state_dict(previous["scheduler"])
        generator.set_state(previous["generator"])
        start_step, smooth, seconds = previous["step"], previous["smooth"], previous["seconds"]
        total_steps[0] = previous.get("total_steps", args.unet_steps)
    auto_steps = args.denoiser_minutes is not None and start_step < AUTO_STEPS_PROBE
    scaling = pipeline.vae.config.scaling_factor
    shift = pipeline.vae.config.shift_factor or 0.0
    empty_row = prompt_ids.shape[0] - 1
    for module in modules:
        module.train()
    began = time.time()

    def save(step):
        atomic_save({"stage": "denoiser", "step": step, "vae": pipeline.vae.state_dict(),
                     "vae_config": dict(pipeline.vae.config), "modules": [m.state_dict() for m in modules],
                     "ema": ema_params, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                     "generator": generator.get_state(), "smooth": smooth, "seconds": seconds + time.time() - began,
                     "vae_stats": vae_stats, "total_steps": total_steps[0]},
                    os.path.join(state_dir, "state.pt"))

    progress = tqdm(initial=start_step, total=total_steps[0], desc=args.arch, dynamic_ncols=True, mininterval=2.0)
    step = start_step
    probe_began = None
    while step < total_steps[0]:
        if time.time() > deadline or (args.stop_at_step and step == args.stop_at_step):
            save(step)
            raise Stopped(f"{args.arch} step {step}")
        if auto_steps and step == 5:  # the first steps (allocation, warm caches) are not timed
            probe_began = time.time()
        if auto_steps and step == AUTO_STEPS_PROBE:
            per_step = (time.time() - probe_began) / (AUTO_STEPS_PROBE - 5)
            total_steps[0] = max(AUTO_STEPS_PROBE + 1, int(args.denoiser_minutes * 60 / per_step))
            progress.total = total_steps[0]
            print(f"--denoiser-minutes {args.denoiser_minutes}: {per_step * 1000:.1f} ms a step -> "
                  f"{total_steps[0]} steps")
        z, batch_rows = scenes_batch(latent_mean, latent_std, rows, empty_row, args.batch_size, args.cond_dropout,
                                     generator)
        z0 = (z - shift) * scaling
        loss = denoiser_loss(pipeline, args.arch, z0, prompt_ids[batch_rows], generator, args.flow_times)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        ema_update(ema_params, params, args.ema_decay, step)
        smooth = loss.item() if smooth is None else 0.99 * smooth + 0.01 * loss.item()
        progress.set_postfix(loss=f"{smooth:.4f}", refresh=False)
        progress.update()
        step += 1
        if step % args.checkpoint_every == 0:
            save(step)
    progress.close()
    save(total_steps[0])
    with torch.no_grad():
        for ema, p in zip(ema_params, params):
            p.copy_(ema)
    for module in modules:
        module.eval()
    return {"loss": smooth, "seconds": seconds + time.time() - began, "steps": total_steps[0]}


FRESH_SCENES = 1024  # scenes of the held-out loss (held_out_loss)


@no_grad
def held_out_loss(pipeline, args, images=None, prompts=None) -> float:
    """The denoiser's loss (denoiser_loss, the EMA weights) on FRESH_SCENES scenes, the same draws of noise and
    time for any model: `images` (uint8 (N, 64, 64, 3), e.g. the first training scenes) and their `prompts`, or,
    when None, fresh scenes
    rendered from a seed no pretraining uses (10**6 + seed). Equal on both: the model is not data-bound."""
    from ddpo_group.data.scenes import sample_dataset

    if images is None:
        images, prompts = sample_dataset(FRESH_SCENES, seed=10**6 + args.seed, workers=args.render_workers,
                                         area_range=area_range_of(args))
    latent_mean, latent_std = encode_scenes(pipeline.vae, images)
    scaling = pipeline.vae.config.scaling_factor
    shift = pipeline.vae.config.shift_factor or 0.0
    generator = torch.Generator().manual_seed(12345)
    ids = pipeline.tokenizer(prompts, padding="max_length", max_length=pipeline.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
    device = torch.device(args.device)
    total, count = 0.0, 0
    for i in range(0, len(images), 256):
        z = latent_mean[i : i + 256] + latent_std[i : i + 256] * torch.randn(latent_mean[i : i + 256].shape, generator=generator)
        z0 = ((z - shift) * scaling).to(device)
        loss = denoiser_loss(pipeline, args.arch, z0, ids[i : i + 256], generator, args.flow_times)
        total += float(loss) * len(z0)
        count += len(z0)
    return total / count


@no_grad
def evaluate_scenes(pipeline, args) -> dict:
    """GenEval's six-tag table of the pipeline on the held-out set (assets/prompts/geneval_scenes.jsonl),
    ``eval_images_per_prompt`` images per record, the exact shapes-world detector."""
    from ddpo_group.rewards.geneval.metadata import read_metadata
    from ddpo_group.rewards.geneval.protocol import GenEvalScorer, format_table, summarize
    from ddpo_group.rewards.geneval.shapes_scenes import ShapesColorClassifier, ShapesDetector
    from ddpo_group.data.scenes import evaluation_prompts_path

    records = [r for r in read_metadata(evaluation_prompts_path()) for _ in range(args.eval_images_per_prompt)]
    generator = torch.Generator().manual_seed(args.seed + 2)
    start = time.time()
    # sd3: as many zero T5 tokens as the training fed (flow_text_embeddings), not the pipeline's 256
    kwargs = {"max_sequence_length": pipeline.tokenizer.model_max_length} if args.arch == "sd3" else {"eta": args.eta}
    images = []
    for i in tqdm(range(0, len(records), 50), desc="eval", dynamic_ncols=True):
        batch = [r["prompt"] for r in records[i : i + 50]]
        if args.arch == "sd-flow":  # StableDiffusionPipeline() has no flow sampler: the family's, its Euler ODE
            from ddpo_group.diffusion.policy import policy_for

            output = policy_for(pipeline).sample(batch, args.eval_steps, args.guidance_scale, 0.0,
                                                 generator=generator, keep_steps=False).images
            images.append((output.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8))
            continue
        output = pipeline(batch, num_inference_steps=args.eval_steps, guidance_scale=args.guidance_scale,
                          generator=generator, output_type="np", **kwargs)
        images.append((np.clip(output.images, 0, 1) * 255).round().astype(np.uint8))
    images = np.concatenate(images)
    results = GenEvalScorer(ShapesDetector(), ShapesColorClassifier()).score(images, records)
    summary = summarize(results)
    print(format_table(summary))
    if args.samples_path:
        save_grid(torch.from_numpy(images[:: args.eval_images_per_prompt][:64]).permute(0, 3, 1, 2).float() / 255,
                  args.samples_path, columns=8)
    return {"num_inference_steps": args.eval_steps, "guidance_scale": args.guidance_scale,
            "eta": args.eta if args.arch == "sd" else None, "images_per_prompt": args.eval_images_per_prompt,
            "seconds": time.time() - start, "overall": summary["overall"],
            "tags": {tag: row["score"] for tag, row in summary["tags"].items()}, "summary": summary}


def _pretrain_scenes(args) -> dict:
    from ddpo_group.diffusion.tiny import build_tiny_scenes_pipeline
    from ddpo_group.data.scenes import SCENE_WORDS

    output_dir, state_dir = _scenes_paths(args)
    os.makedirs(state_dir, exist_ok=True)
    check_recorded_options(args, state_dir)
    deadline = time.time() + args.max_minutes * 60 if args.max_minutes else math.inf
    torch.manual_seed(args.seed)
    pipeline = build_tiny_scenes_pipeline(SCENE_WORDS, args.arch, seed=args.seed, size=args.size,
                                          patch=args.patch, init=args.init)
    start = time.time()
    images, rows, unique_prompts = _scenes_data(args, state_dir, pipeline)  # rendered before the device is touched
    pipeline.to(args.device)
    prompt_ids = pipeline.tokenizer(unique_prompts + [""], padding="max_length",
                                    max_length=pipeline.tokenizer.model_max_length, truncation=True,
                                    return_tensors="pt").input_ids
    data_seconds = time.time() - start
    state = _load_state(state_dir)
    try:
        if state is not None and state["stage"] == "denoiser":
            pipeline.vae.load_state_dict(state["vae"])
            pipeline.vae.register_to_config(scaling_factor=state["vae_config"]["scaling_factor"],
                                            shift_factor=state["vae_config"]["shift_factor"])
            vae_stats = state["vae_stats"]
        elif args.vae_from:
            from diffusers import AutoencoderKL

            trained = AutoencoderKL.from_pretrained(os.path.join(args.vae_from, "vae"), local_files_only=True)
            pipeline.vae.load_state_dict(trained.state_dict())
            pipeline.vae.to(args.device)
            vae_stats = {"from": os.path.relpath(os.path.abspath(args.vae_from), ROOT_DIR)}
        else:
            vae_stats = _train_scenes_vae(pipeline, images, args, state_dir, deadline)
        latents_path = os.path.join(state_dir, "latents.pt")
        if os.path.exists(latents_path) and state is not None and state["stage"] == "denoiser":
            try:
                latent_mean, latent_std = torch.load(latents_path, weights_only=True)
                if latent_mean.shape != latent_std.shape or len(latent_mean) != len(images):
                    raise ValueError(f"latents {tuple(latent_mean.shape)} and {tuple(latent_std.shape)} for "
                                     f"{len(images)} images")
            except Exception as err:
                raise damaged_state(latents_path, err, "remove it (the images are encoded again with the state's "
                                    "VAE, and the denoiser starts over from its step 0)") from None
        else:
            latent_mean, latent_std = encode_scenes(pipeline.vae, images)
            atomic_save((latent_mean, latent_std), latents_path)
            sample = latent_mean + latent_std * torch.randn(latent_mean.shape, generator=torch.Generator().manual_seed(args.seed))
            # SD3 / FLUX convention (the flow models): latents = (z - shift) * scaling with unit variance; SD: no shift
            shift = float(sample.mean()) if args.arch != "sd" else None
            scaling = float(1.0 / (sample - (shift or 0.0)).std())
            pipeline.vae.register_to_config(scaling_factor=scaling, shift_factor=shift)
            state = {"stage": "denoiser", "step": 0, "vae_stats": vae_stats, "fresh": True}
        train_images = images[:FRESH_SCENES]
        del images
        unet_stats = _train_scenes_denoiser(pipeline, args, (latent_mean, latent_std), rows, prompt_ids, state_dir,
                                            deadline, None if state.get("fresh") else state, vae_stats)
    except Stopped as stop:
        print(f"stopped at {stop}; the state is in {state_dir}: run the same command (without --stop-at-step) "
              "again to go on")
        return {"stopped": str(stop)}
    os.makedirs(output_dir, exist_ok=True)
    pipeline.to("cpu").save_pretrained(output_dir, safe_serialization=True)
    pipeline.to(args.device)
    losses = {"train_scenes": held_out_loss(pipeline, args, train_images,
                                            [unique_prompts[int(r)] for r in rows[:FRESH_SCENES]]),
              "fresh_scenes": held_out_loss(pipeline, args, None)} if args.eval_steps > 0 else None
    log = {
        "world": "scenes", "arch": args.arch, "size": args.size, "patch": args.patch, "seed": args.seed,
        "quick": args.quick, "object_scale": args.object_scale, "object_area": list(area_range_of(args)),
        **({"flow_times": args.flow_times} if args.arch != "sd" else {}),
        **({"init": args.init} if args.arch == "sd3" else {}),
        # the zero T5 tokens the flow model was trained and is sampled with (diffusion/sd3.trained_text_length)
        **({"text_tokens": pipeline.tokenizer.model_max_length} if args.arch == "sd3" else {}),
        "device": str(args.device), "render_workers": args.render_workers,
        "denoiser_parameters": sum(p.numel() for p in (pipeline.transformer if args.arch == "sd3" else pipeline.unet).parameters()),
        "denoiser_loss": losses,
        "torch_threads": torch.get_num_threads(), "dataset_size": args.dataset_size, "data_seconds": data_seconds,
        "machine": platform.processor() or platform.machine(),
        "vae": {**(vae_stats or {}), "batch_size": args.vae_batch_size, "lr": args.vae_lr, "kl_weight": args.kl_weight},
        "scaling_factor": pipeline.vae.config.scaling_factor, "shift_factor": pipeline.vae.config.shift_factor,
        "denoiser": {**unet_stats, "batch_size": args.batch_size, "lr": args.unet_lr, "cond_dropout": args.cond_dropout,
                     "ema_decay": args.ema_decay},
    }
    evaluate_into_log(output_dir, log, lambda: evaluate_scenes(pipeline, args) if args.eval_steps > 0 else None)
    print(f"saved to {output_dir}")
    return log

