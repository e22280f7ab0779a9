"""Does a scenes model's denoiser use the relation word? Its loss on position scenes, level by level, under the
right prompt and under prompts that say the wrong thing (docs/scenes.md, "Why position does not learn").

    python benchmarks/relation_loss.py --model tiny-scenes-flow --output R/relation_loss_base.json

N rendered scenes of the world's training position records (``scenes.training_records``; "A above B" drawn with A
above B), at the model's object scale (its pretrain_log.json), encoded by the model's VAE (the posterior's mean).
At each noise level, the same noise for every prompt, the denoiser's loss (``pretrain.denoiser_loss``: flow
matching for a flow model, epsilon prediction for the DDIM UNet) under:

    prompt            the scene's own caption, "a photo of A above B"
    relation_flipped  "a photo of A below B": the other relation word, the scene now says the opposite
    nouns_swapped     "a photo of B above A": the same words in the other order, also the opposite
    empty             "" (the unconditional branch classifier-free guidance uses)

`relation_share` = (relation_flipped - prompt) / (empty - prompt): of what the caption tells the denoiser at this
level, the share that the relation word tells it (given where the caption lowers the loss by at least 1 %; where
it tells the denoiser less, the ratio is one of noise and is left out). A denoiser that ignores the relation (draws
A and B anywhere) gives the flipped caption the caption's loss, 0; one that places A by it loses more with the
wrong word, above 0.
`relation_share_stderr`: its standard error over the scenes (the flipped caption's loss minus the caption's is
paired, one scene and one noise). Levels: the flow models' s (x = (1 - s) x0 + s noise; the sampler's ten steps at
shift 3 run s = 1.00, 0.96, 0.91, 0.86, 0.79, 0.71, 0.60, 0.46, 0.28, 0.01), the DDIM UNet's timestep
round(T s) - 1 of its T = 1000 (DDPM's noise there is not the flow's at the same s: s = 0.8 is about the flow's
0.84, 0.2 its 0.36).

Writes OUTPUT (JSON: the settings, the object areas the scenes were drawn at, and each level's four losses, share
and error) and prints the table. Deterministic: the same model and options give the same numbers. A folder written
by relation_finetune.py carries its base's object areas (its pretrain_log.json).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from bench_outputs import BenchmarkError, fail  # noqa: E402
from ddpo_group.runs.grids import save_json  # noqa: E402

LEVELS = (0.95, 0.9, 0.8, 0.7, 0.6, 0.4, 0.2)
TOLD = 0.01  # the share is given where the caption lowers the loss by at least this much of it (else a ratio of noise)
VARIANTS = ("prompt", "relation_flipped", "nouns_swapped", "empty")


def opposite_prompts(prompt: str) -> dict[str, str]:
    """The four captions of a position prompt (module docstring)."""
    from position_probe import parse_prompt, prompts_of

    a, relation, b = parse_prompt(prompt)
    records = dict(prompts_of(a, relation, b))
    return {"prompt": prompt, "relation_flipped": records["relation_flipped"]["prompt"],
            "nouns_swapped": records["nouns_swapped"]["prompt"], "empty": ""}


def position_scenes(n: int, seed: int, area_range):
    """(images uint8 (n, 64, 64, 3), prompts): n scenes of training position records drawn from `seed`."""
    import numpy as np

    from ddpo_group.data.scenes import render_record, training_records

    records = training_records()["position"]
    rng = np.random.default_rng([seed, 53])
    picked = [records[rng.integers(len(records))] for _ in range(n)]
    return np.stack([render_record(r, rng, area_range=area_range) for r in picked]), [r["prompt"] for r in picked]


def arch_of(pipeline) -> str:
    """pretrain.denoiser_loss's arch of a loaded scenes pipeline: sd3 (transformer), sd-flow (flow UNet) or sd."""
    from ddpo_group.diffusion.sd_flow import is_flow_unet

    if getattr(pipeline, "transformer", None) is not None:
        return "sd3"
    return "sd-flow" if is_flow_unet(pipeline) else "sd"


def load_scenes_model(model: str):
    """(pipeline, the object areas it was pretrained on) of a shipped scenes model's name or a pipeline folder, in
    float32; BenchmarkError naming --model when it does not load."""
    import torch

    from ddpo_group.data.scenes import area_range_of_pipeline
    from ddpo_group.diffusion.policy import load_policy

    try:
        pipeline = load_policy(model, torch_dtype=torch.float32).pipeline
    except (ValueError, OSError) as err:
        raise BenchmarkError(f"--model {model!r}: {str(err).splitlines()[0]}") from None
    return pipeline, area_range_of_pipeline(getattr(pipeline.config, "_name_or_path", None))


def relation_losses(pipeline, images, prompts, levels=LEVELS, batch: int = 128, seed: int = 0) -> list[dict]:
    """Each level's mean loss under the four captions (module docstring) and the relation share; the same noise for
    every caption at a level (the generator seeded by (seed, level) each time)."""
    import torch

    import ddpo_group.cli.pretrain as pretrain

    pretrain._import_torch()
    arch = arch_of(pipeline)
    latent_mean, _ = pretrain.encode_scenes(pipeline.vae, images)
    z0 = (latent_mean - (pipeline.vae.config.shift_factor or 0.0)) * pipeline.vae.config.scaling_factor
    captions = [opposite_prompts(p) for p in prompts]
    tokenize = lambda texts: pipeline.tokenizer(texts, padding="max_length",  # noqa: E731
                                                max_length=pipeline.tokenizer.model_max_length, truncation=True,
                                                return_tensors="pt").input_ids
    ids = {variant: tokenize([c[variant] for c in captions]) for variant in VARIANTS}
    timesteps = pipeline.scheduler.config.num_train_timesteps if arch == "sd" else None
    rows = []
    with torch.no_grad():
        for level in levels:
            value = max(0, round(timesteps * level) - 1) if arch == "sd" else level
            per_scene = {}
            for variant in VARIANTS:
                generator = torch.Generator().manual_seed(seed * 1000 + round(1000 * level))
                parts = []
                for i in range(0, len(z0), batch):
                    chunk = z0[i : i + batch]
                    levels_t = torch.full((len(chunk),), value, dtype=torch.float64)
                    parts.append(pretrain.denoiser_loss(pipeline, arch, chunk, ids[variant][i : i + batch], generator,
                                                        levels=levels_t, per_sample=True).double())
                per_scene[variant] = torch.cat(parts)
            losses = {variant: float(values.mean()) for variant, values in per_scene.items()}
            told = losses["empty"] - losses["prompt"]
            flipped = per_scene["relation_flipped"] - per_scene["prompt"]  # paired: the same scene and noise
            error = float(flipped.std() / len(flipped) ** 0.5) if len(flipped) > 1 else None
            given = told >= TOLD * losses["prompt"]
            rows.append({"level": level, **losses, "relation_share": float(flipped.mean()) / told if given else None,
                         "flipped_minus_prompt_stderr": error,
                         "relation_share_stderr": error / told if given and error is not None else None})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-scenes-flow",
                        help="a shipped scenes model's name or a pipeline folder")
    parser.add_argument("--scenes", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="the scenes' and the noise's seed")
    parser.add_argument("--output", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    try:
        if not args.output.endswith(".json"):
            raise BenchmarkError(f"--output {args.output!r}: give a .json path")
        if args.scenes < 1:
            raise BenchmarkError(f"--scenes {args.scenes}: give at least 1")
        if args.seed < 0:
            raise BenchmarkError(f"--seed {args.seed}: give a seed >= 0")
        pipeline, area_range = load_scenes_model(args.model)
        images, prompts = position_scenes(args.scenes, args.seed, area_range)
        rows = relation_losses(pipeline, images, prompts, seed=args.seed)
    except BenchmarkError as err:
        fail(parser.prog, str(err))
    print(f"{args.model}: {args.scenes} position scenes; the denoiser's loss under each caption")
    print(f"{'level':>6} " + " ".join(f"{v:>16}" for v in VARIANTS) + f" {'relation share':>16}")
    for row in rows:
        share = "-" if row["relation_share"] is None else (f"{row['relation_share']:.3f} +- "
                                                             f"{row['relation_share_stderr']:.3f}")
        print(f"{row['level']:>6.2f} " + " ".join(f"{row[v]:>16.5f}" for v in VARIANTS) + f" {share:>16}")
    result = {"model": args.model, "scenes": args.scenes, "seed": args.seed, "arch": arch_of(pipeline),
              "object_area": list(area_range),
              "levels": rows,
              "command": "python benchmarks/relation_loss.py " + shlex.join(sys.argv[1:] if argv is None else argv)}
    save_json(result, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
