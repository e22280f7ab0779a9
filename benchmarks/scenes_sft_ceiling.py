"""How far can the UNet base go on one rung-b prompt when it is shown the answer? (docs/scenes.md)

The learning ladder's rung b asks RL to take one training prompt to GenEval strict-correct >= 0.9 within 30 epochs.
This benchmark measures what the same model reaches with the strongest teacher there is: supervised fine-tuning on
rendered scenes of the prompt's record (the world's own renderer, at the model's object scale), the pretraining's
epsilon loss, the UNet alone trained (as RL trains it), AdamW at --lr after --warmup steps of linear warm-up,
batches of --batch scenes, 10 % empty captions as in the pretraining. After each of --steps (cumulative optimizer
steps) the UNet is saved into a copy of the pipeline and sampled as rung b trains and judges it: --images images of
the prompt at the variant's training sampler (DDIM 10 steps, eta 1, CFG 5) at eval seed 1234 through
scripts/evaluate.py, GenEval's strict verdict. Step 0 is the base. If a perfect teacher cannot lift the prompt to
0.9 in as many images as RL is given, the 0.9 is out of this base's reach in that budget, whatever the trainer; if it
can, RL's shortfall is the signal's.

    python benchmarks/scenes_sft_ceiling.py --case two_object --output benchmarks/results/scenes_sft_ceiling/two_object

prints a table (steps, scenes seen, training loss, strict-correct) and writes OUTPUT/ceiling.json (the rows, the
command, the record, the settings), OUTPUT/images_STEP/ (the sampled images and their verdicts) and
OUTPUT/samples.png (a row of 16 images per measurement, framed green where strictly correct; --figure-only draws it
again from the images).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def render_latents(pipeline, record, count, area_range, seed):
    """(posterior means, posterior stds) (count, 4, h, w) of `count` rendered scenes of `record`, unscaled (the
    pretraining's encoding, cli.pretrain.encode_scenes)."""
    import numpy as np

    from ddpo_group.cli.pretrain import encode_scenes
    from ddpo_group.data import scenes

    rng = np.random.default_rng(seed)
    images = np.stack([scenes.render_record(record, rng, area_range=area_range) for _ in range(count)])
    return encode_scenes(pipeline.vae, images)


def fine_tune(pipeline, latents, prompt_ids, steps, args, state):
    """`steps` more optimizer steps of the pretraining's loss on the UNet (cli.pretrain: scenes_batch draws the
    scenes and the 10 % empty captions, denoiser_loss the noise, the time and the epsilon loss); `prompt_ids` is
    (2, L): the record's prompt, then the empty one. state: optimizer, schedule, generator, losses."""
    import torch

    from ddpo_group.cli.pretrain import denoiser_loss, scenes_batch

    mean, std = latents
    rows = torch.zeros(mean.shape[0], dtype=torch.long)
    scaling = pipeline.vae.config.scaling_factor
    pipeline.unet.train()
    for _ in range(steps):
        z, batch_rows = scenes_batch(mean, std, rows, 1, args.batch, 0.1, state["generator"])
        loss = denoiser_loss(pipeline, "sd", z * scaling, prompt_ids[batch_rows], state["generator"])
        state["optimizer"].zero_grad(set_to_none=True)
        loss.backward()
        state["optimizer"].step()
        state["schedule"].step()
        state["losses"].append(float(loss.detach()))
    pipeline.unet.eval()


def samples_figure(output, count=16):
    """OUTPUT/samples.png: a row per measurement of OUTPUT/images_STEP (step order), its first `count` images, each
    framed green where GenEval's strict verdict is correct and red where not; the path, or None without images."""
    import numpy as np
    from PIL import Image

    from ddpo_group.runs.grids import save_png

    steps = sorted(int(name.split("_")[1]) for name in os.listdir(output)
                   if name.startswith("images_") and name.split("_")[1].isdigit())
    rows = []
    for step in steps:
        folder = os.path.join(output, f"images_{step}")
        verdicts = [json.loads(line)["strict_correct"] for line in open(os.path.join(folder, "verdicts.jsonl"))]
        tiles = []
        for i, right in enumerate(verdicts[:count]):
            tile = np.full((72, 72, 3), (40, 170, 40) if right else (200, 30, 30), dtype=np.uint8)
            image = Image.open(os.path.join(folder, "00000", "samples", f"{i:04d}.png")).convert("RGB")
            tile[4:68, 4:68] = np.asarray(image.resize((64, 64)))
            tiles.append(tile)
        tiles += [np.full((72, 72, 3), 255, dtype=np.uint8)] * (count - len(tiles))
        rows.append(np.concatenate(tiles, axis=1))
    if not rows:
        return None
    path = os.path.join(output, "samples.png")
    save_png(Image.fromarray(np.concatenate(rows, axis=0)), path)  # atomic: a stopped run leaves no half figure
    return path


def main(argv=None):
    from scenes_ladder import RUNG_B_PROMPTS, sample_prompt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="two_object", choices=sorted(RUNG_B_PROMPTS), help="rung b's case")
    parser.add_argument("--model", default="tiny-scenes", help="the UNet base: tiny-scenes or a pipeline folder")
    parser.add_argument("--scenes", type=int, default=512, help="rendered scenes of the record (default 512)")
    parser.add_argument("--steps", default="0,25,50,100,200", help="cumulative optimizer steps to measure at")
    parser.add_argument("--batch", type=int, default=32, help="scenes per optimizer step (default 32)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate (default 1e-4, the "
                        "pretraining's last)")
    parser.add_argument("--warmup", type=int, default=0, help="optimizer steps of linear learning-rate warm-up "
                        "(default 0: none)")
    parser.add_argument("--images", type=int, default=64, help="images sampled at each measurement (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="the scenes' and the training's seed")
    parser.add_argument("--output", required=True, help="folder for ceiling.json and the images")
    parser.add_argument("--figure-only", action="store_true", help="only draw OUTPUT/samples.png from its images")
    args = parser.parse_args(argv)
    if args.figure_only:
        if samples_figure(args.output) is None:
            parser.error(f"--output {args.output}: no images_STEP folders to draw; run the measurement first")
        return None
    try:
        steps = sorted({int(s) for s in args.steps.split(",") if s.strip()})
    except ValueError:
        parser.error(f"--steps {args.steps!r}: comma-separated whole numbers, e.g. 0,50,100")
    if not steps or steps[0] < 0:
        parser.error(f"--steps {args.steps!r}: whole numbers >= 0")
    for name in ("scenes", "batch", "images"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: a number >= 1")
    if args.warmup < 0 or not args.lr > 0:
        parser.error(f"--lr {args.lr} --warmup {args.warmup}: a learning rate > 0 and warm-up steps >= 0")
    if os.path.exists(os.path.join(args.output, "ceiling.json")):  # a measurement is never written over
        parser.error(f"--output {args.output}: holds a measurement (ceiling.json); choose a new folder")

    import torch

    from ddpo_group.data import scenes
    from ddpo_group.diffusion.loading import SHIPPED_SCENES, load_pipeline

    torch.manual_seed(args.seed)
    folder = str(SHIPPED_SCENES[args.model]) if args.model in SHIPPED_SCENES else args.model
    not_unet = f"--model {args.model}: not a UNet pipeline; this measures the UNet base (tiny-scenes)"
    if args.model == "tiny-scenes-sd3":
        parser.error(not_unet)
    try:
        pipeline = load_pipeline(args.model)
    except (ValueError, OSError) as err:
        parser.error(f"--model {args.model}: {str(err).splitlines()[0]}")
    if getattr(pipeline, "unet", None) is None:
        parser.error(not_unet)
    records = {r["prompt"]: r for tag_records in scenes.training_records().values() for r in tag_records}
    record = records[RUNG_B_PROMPTS[args.case]]
    area_range = scenes.area_range_of_pipeline(folder)
    latents = render_latents(pipeline, record, args.scenes, area_range, args.seed)
    tokenizer = pipeline.tokenizer

    def tokens(text):
        return tokenizer([text], padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids

    prompt_ids = torch.cat([tokens(record["prompt"]), tokens("")])
    for p in pipeline.text_encoder.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(pipeline.unet.parameters(), lr=args.lr, weight_decay=1e-2)
    warmup = max(1, args.warmup)
    state = {"optimizer": optimizer, "generator": torch.Generator().manual_seed(args.seed + 1), "losses": [],
             "schedule": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / warmup))}
    sampler = {"num_steps": 10, "guidance_scale": 5.0, "eta": 1.0}
    os.makedirs(args.output, exist_ok=True)
    rows, done, start = [], 0, time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        copy = os.path.join(work, "pipeline")
        shutil.copytree(folder, copy)
        for step in steps:
            fine_tune(pipeline, latents, prompt_ids, step - done, args, state)
            done = step
            pipeline.unet.save_pretrained(os.path.join(copy, "unet"))
            _, verdicts = sample_prompt(["--model", copy], record, args.images, sampler, work, f"step{step}")
            images_dir = os.path.join(args.output, f"images_{step}")
            shutil.rmtree(images_dir, ignore_errors=True)
            shutil.copytree(os.path.join(work, f"step{step}_images"), images_dir)
            shutil.copy(os.path.join(work, f"step{step}_images.jsonl"), os.path.join(images_dir, "verdicts.jsonl"))
            recent = state["losses"][-20:]
            rows.append({"step": step, "scenes_seen": step * args.batch,
                         "loss": sum(recent) / len(recent) if recent else None,
                         "strict_correct": sum(verdicts) / len(verdicts), "images": len(verdicts),
                         "seconds": round(time.perf_counter() - start, 1)})
            loss = f"{rows[-1]['loss']:.4f}" if recent else "-"
            print(f"step {step:5d}  scenes seen {step * args.batch:6d}  loss {loss}  "
                  f"strict-correct {rows[-1]['strict_correct']:.3f} ({sum(verdicts)}/{len(verdicts)})", flush=True)
    words = argv if argv is not None else sys.argv[1:]
    document = {"command": "python benchmarks/scenes_sft_ceiling.py " + " ".join(words),
                "case": args.case, "record": record, "model": args.model, "area_range": list(area_range),
                "settings": {k: getattr(args, k) for k in ("scenes", "batch", "lr", "warmup", "images", "seed")},
                "sampler": dict(sampler, seed=1234), "rows": rows}
    tmp = os.path.join(args.output, "ceiling.json.tmp")
    with open(tmp, "w") as handle:
        json.dump(document, handle, indent=1)
    os.replace(tmp, os.path.join(args.output, "ceiling.json"))
    samples_figure(args.output)
    return document


if __name__ == "__main__":
    main()
