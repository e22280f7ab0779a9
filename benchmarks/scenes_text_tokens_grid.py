"""A 64-image grid of a flow scenes pipeline on the held-out set's first 64 records (ODE, 20 steps, CFG 4.5, noise
seed 1234, one CPU thread), with a given number of zero T5 tokens: 16, what the scenes pretraining trains with, or
256, StableDiffusion3Pipeline's default (docs/scenes.md, "The flow base's text tokens").

    python benchmarks/scenes_text_tokens_grid.py PIPELINE_DIR 16 docs/images/scenes_base_sd3_m_text16.png
    python benchmarks/scenes_text_tokens_grid.py PIPELINE_DIR 256 docs/images/scenes_base_sd3_m_text256.png
"""

import argparse

import numpy as np
import torch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline", help="a scenes flow pipeline directory (ddpo-group pretrain --arch sd3)")
    parser.add_argument("zero_t5_tokens", type=int, help="the pipeline call's max_sequence_length")
    parser.add_argument("output", help="PNG file to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from diffusers import StableDiffusion3Pipeline

    from ddpo_group.cli.pretrain import _import_torch, save_grid
    from ddpo_group.data.scenes import evaluation_prompts_path
    from ddpo_group.rewards.geneval.metadata import read_metadata

    _import_torch()
    pipeline = StableDiffusion3Pipeline.from_pretrained(args.pipeline, text_encoder_3=None, tokenizer_3=None)
    pipeline.set_progress_bar_config(disable=True)
    prompts = [r["prompt"] for r in read_metadata(evaluation_prompts_path())][:64]
    with torch.no_grad():
        images = pipeline(prompts, num_inference_steps=20, guidance_scale=4.5,
                          generator=torch.Generator().manual_seed(1234), output_type="np",
                          max_sequence_length=args.zero_t5_tokens).images
    save_grid(torch.from_numpy(np.clip(images, 0, 1)).permute(0, 3, 1, 2).float(), args.output, columns=8)
    print("wrote", args.output)


if __name__ == "__main__":
    main()
