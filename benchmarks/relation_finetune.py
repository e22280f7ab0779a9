"""Does more pretraining on position scenes teach a scenes model the relation word? (docs/scenes.md, "Why position
does not learn")

    python benchmarks/relation_finetune.py --model tiny-scenes-flow --share position=1.0 --steps 3000 \
        --output-dir R/relation_finetune_position
    python benchmarks/relation_loss.py --model R/relation_finetune_position/step_750 --output R/step_750.json

The model's denoiser and text encoder go on training from its shipped weights with its own pretraining loss
(``pretrain.denoiser_loss``: flow matching for a flow model, epsilon prediction for the DDIM UNet) on its own
pretraining data (``scenes.sample_dataset`` at its --dataset-size and --seed, its object scale), with one tag's
share of the batches raised (--share TAG=FRACTION: the scenes of TAG drawn with that probability, the rest in
proportion): AdamW at --lr after 100 warm-up steps, batch 32, 10 % empty captions, gradients clipped at 1, an EMA
of 0.999 that starts at the shipped weights. Every --save-every steps the EMA weights are saved as a pipeline
folder (OUTPUT_DIR/step_N, with the base's pretrain_log.json and this fine-tuning in it: relation_loss.py reads
its object areas), which relation_loss.py and position_probe.py --model read; log.json has the smoothed loss and
seconds at each. The EMA starts at the base: at step N the saved weights still hold 0.999^N of it (22 % at 1,500,
5 % at 3,000). OUTPUT_DIR must be new or empty (the benchmark writes nothing else).

An experiment, not a shipped model: nothing here replaces a model in ddpo_group/assets.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from bench_outputs import BenchmarkError, fail, fresh_run_dir  # noqa: E402
from ddpo_group.runs.grids import save_json  # noqa: E402

WARMUP_STEPS, BATCH, COND_DROPOUT, EMA_DECAY = 100, 32, 0.1, 0.999


def parse_share(text: str) -> tuple[str, float]:
    """('position', 1.0) of "position=1.0"; BenchmarkError naming --share otherwise."""
    from ddpo_group.data.scenes import TAGS

    tag, _, value = text.partition("=")
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if tag not in TAGS or not 0.0 < fraction <= 1.0:
        raise BenchmarkError(f"--share {text!r}: give TAG=FRACTION with a tag of {list(TAGS)} and 0 < FRACTION <= 1, "
                             "e.g. position=0.5")
    return tag, fraction


def scene_weights(prompts, tag: str, fraction: float):
    """Each scene's probability of being drawn: `fraction` spread evenly over the scenes of `tag`, the rest over the
    others (every scene alike when the data has nothing else); BenchmarkError when it has no scene of `tag`."""
    import torch

    from ddpo_group.data.scenes import world_records

    tag_of = {r["prompt"]: t for t, records in world_records().items() for r in records}
    chosen = torch.tensor([tag_of[p] == tag for p in prompts])
    n_chosen, n_other = int(chosen.sum()), int((~chosen).sum())
    if n_chosen == 0:
        raise BenchmarkError(f"--share {tag}=...: the data has no scene of {tag} (its records are all held out, or "
                             "none was drawn); choose another tag")
    if n_other == 0:
        return torch.full((len(prompts),), 1.0 / len(prompts))
    return torch.where(chosen, fraction / n_chosen, (1.0 - fraction) / n_other)


def base_log(pipeline) -> dict:
    """The loaded pipeline's own pretrain_log.json ({} without one)."""
    import json

    path = os.path.join(getattr(pipeline.config, "_name_or_path", "") or "", "pretrain_log.json")
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def finetune(pipeline, images, prompts, tag, fraction, steps, lr, save_every, output_dir, seed=0, log=print,
             pretrain_log=None):
    """The fine-tuning (module docstring); returns log.json's rows. Each step folder gets `pretrain_log` (the base's
    pretrain_log.json, whose object areas relation_loss.py and position_probe.py read) with this fine-tuning added
    under "relation_finetune"."""
    import torch

    import ddpo_group.cli.pretrain as pretrain
    from relation_loss import arch_of

    pretrain._import_torch()
    arch = arch_of(pipeline)
    unique = sorted(set(prompts))
    row_of = {p: i for i, p in enumerate(unique)}
    rows = torch.tensor([row_of[p] for p in prompts])
    ids = pipeline.tokenizer(unique + [""], padding="max_length", max_length=pipeline.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
    weights = scene_weights([unique[int(r)] for r in rows], tag, fraction)
    latent_mean, latent_std = pretrain.encode_scenes(pipeline.vae, images)
    scaling, shift = pipeline.vae.config.scaling_factor, pipeline.vae.config.shift_factor or 0.0
    denoiser = pipeline.transformer if arch == "sd3" else pipeline.unet
    modules = [denoiser, pipeline.text_encoder] + ([pipeline.text_encoder_2] if arch == "sd3" else [])
    params = [p for m in modules for p in m.parameters()]
    ema = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    generator = torch.Generator().manual_seed(seed + 7)  # the draws' stream, apart from the data's
    for module in modules:
        module.train()
    smooth, began, written = None, time.time(), []
    for step in range(1, steps + 1):
        idx = torch.multinomial(weights, BATCH, replacement=True, generator=generator)
        z = latent_mean[idx] + latent_std[idx] * torch.randn((BATCH,) + tuple(latent_mean.shape[1:]),
                                                             generator=generator)
        batch_rows = rows[idx].clone()
        batch_rows[torch.rand(BATCH, generator=generator) < COND_DROPOUT] = len(unique)
        loss = pretrain.denoiser_loss(pipeline, arch, (z - shift) * scaling, ids[batch_rows], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():  # no warm-up of the decay: the average starts at the shipped weights
            for average, p in zip(ema, params):
                average.mul_(EMA_DECAY).add_(p.detach(), alpha=1 - EMA_DECAY)
        smooth = loss.item() if smooth is None else 0.99 * smooth + 0.01 * loss.item()
        if step % 100 == 0:
            log(f"step {step} loss {smooth:.4f} {time.time() - began:.0f}s")
        if step % save_every == 0 or step == steps:
            trained = [p.detach().clone() for p in params]
            with torch.no_grad():
                for average, p in zip(ema, params):
                    p.copy_(average)
            folder = os.path.join(output_dir, f"step_{step}")
            pipeline.save_pretrained(folder, safe_serialization=True)
            if pretrain_log is not None:
                save_json({**pretrain_log, "relation_finetune": {
                    "share": {tag: fraction}, "step": step, "lr": lr, "data_seed": seed, "scenes": len(prompts)}},
                    os.path.join(folder, "pretrain_log.json"))
            with torch.no_grad():
                for kept, p in zip(trained, params):
                    p.copy_(kept)
            written.append({"step": step, "loss": smooth, "seconds": time.time() - began})
            save_json(written, os.path.join(output_dir, "log.json"))
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + " " + __doc__.splitlines()[1].strip())
    parser.add_argument("--model", default="tiny-scenes-flow",
                        help="a shipped scenes model's name or a pipeline folder")
    parser.add_argument("--share", default="position=1.0", help="TAG=FRACTION: the tag's share of the batches")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--save-every", type=int, default=750)
    parser.add_argument("--dataset-size", type=int, default=20000,
                        help="the pretraining's scenes (tiny-scenes-flow's: 20000)")
    parser.add_argument("--seed", type=int, default=0, help="the data's seed (the pretraining's: 0)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-dir", required=True, help="a new or empty folder for the step_N pipelines")
    args = parser.parse_args(argv)
    try:
        tag, fraction = parse_share(args.share)
        for name in ("steps", "save_every", "dataset_size", "threads"):
            if getattr(args, name) < 1:
                raise BenchmarkError(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive number")
        if not args.lr > 0:
            raise BenchmarkError(f"--lr {args.lr}: give a positive learning rate")
        fresh_run_dir("--output-dir", args.output_dir)
        import torch

        from ddpo_group.data.scenes import sample_dataset
        from relation_loss import load_scenes_model

        torch.set_num_threads(args.threads)
        pipeline, area_range = load_scenes_model(args.model)
        images, prompts = sample_dataset(args.dataset_size, seed=args.seed, area_range=area_range)
        scene_weights(prompts, tag, fraction)  # a tag without scenes is refused before the folder is made
        os.makedirs(args.output_dir, exist_ok=True)
        finetune(pipeline, images, prompts, tag, fraction, args.steps, args.lr, args.save_every, args.output_dir,
                 seed=args.seed, pretrain_log={**base_log(pipeline), "object_area": list(area_range)})
    except BenchmarkError as err:
        fail(parser.prog, str(err))
    print(f"wrote {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
