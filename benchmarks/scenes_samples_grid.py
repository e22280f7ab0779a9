"""A grid of a scenes model's images of the held-out set's first records (one image a record, 8 a row), sampled by
the trainer's own policy (any family: a shipped name such as tiny-scenes, or a pipeline directory), one CPU thread:
what a base draws, for docs/scenes.md.

    python benchmarks/scenes_samples_grid.py tiny-scenes docs/images/scenes_base_unet_m_coarse.png
    python benchmarks/scenes_samples_grid.py tiny-scenes-sd3 out.png --guidance-scale 4.5 --eta 0

Defaults: 64 records, 20 steps, CFG 5, eta 1 (the UNet's evaluation in docs/scenes.md), noise seed 1234.
"""

import argparse
import os


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a shipped model's name (tiny-scenes, tiny-scenes-sd3) or a pipeline directory")
    parser.add_argument("output", help="PNG file to write")
    parser.add_argument("--records", type=int, default=64, help="the held-out set's first N records (at most 150)")
    parser.add_argument("--num-steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=5.0)
    parser.add_argument("--eta", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.records < 1:
        parser.error(f"argument --records: must be at least 1, got {args.records}")
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        parser.error(f"argument output: {args.output} is in a folder that does not exist ({folder})")
    import torch

    from ddpo_group.cli.pretrain import _import_torch, save_grid
    from ddpo_group.data.scenes import evaluation_prompts_path
    from ddpo_group.diffusion.policy import load_policy
    from ddpo_group.rewards.geneval.metadata import read_metadata

    _import_torch()
    torch.set_num_threads(1)
    prompts = [r["prompt"] for r in read_metadata(evaluation_prompts_path())][: args.records]
    policy = load_policy(args.model)
    with torch.no_grad():
        images = policy.sample(prompts, num_steps=args.num_steps, guidance_scale=args.guidance_scale, eta=args.eta,
                               generator=torch.Generator().manual_seed(args.seed), keep_steps=False).images
    save_grid(images.float().cpu(), args.output, columns=8)
    print("wrote", args.output)


if __name__ == "__main__":
    main()
