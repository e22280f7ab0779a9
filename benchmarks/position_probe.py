"""Does a scenes model draw what a position prompt says? (docs/scenes.md, "Why position does not learn")

    python benchmarks/position_probe.py --model tiny-scenes-flow --output R/base.json
    python benchmarks/position_probe.py --checkpoint RUN/checkpoints/checkpoint_30 --output R/final.json

For a position prompt "a photo of A above B" (default: rung b's "a star above a cross"), N images (scripts/evaluate.py
--protocol geneval, the shapes detector, the ladder's flow sampler: 10 steps, guidance 4.5, eta 0.7, eval seed 1234)
of it and of its two opposites, each with the same noise: "B above A" (the words in the other order) and "A below
B" (the other relation word). Each image falls in one of:

    correct          GenEval's strict verdict
    one of each      exactly one A and one B (the detector's calls), whatever their relation
    wrong objects    any other set (two A, two B, a third shape, none)

and among the images with A and B drawn ("placed": correct or one of each; an image's most confident A and B), the
share where A's box centre is on the side the prompt names (higher, for "above"; `first_on_the_side`): a model that
follows the prompt puts A higher under "A above B" and lower under both opposites; one that ignores the relation
gives each prompt the same share (the chance it draws A higher). `pixel_change`: the mean absolute difference
(0-255) between an opposite's images and the prompt's, the same noise: how much the prompt's words move the image.

Writes OUTPUT (JSON: the settings, each prompt's counts and shares, each image's detections) and OUTPUT's .png
(the first FIGURE_IMAGES images of the prompt, of "B above A" and of "A below B", a row each, each image's verdict
below it: correct, 1+1 (one of each) or x (wrong objects)).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from bench_outputs import BenchmarkError, fail  # noqa: E402
from ddpo_group.runs.grids import save_json  # noqa: E402

SAMPLER = {"num_steps": 10, "guidance_scale": 4.5, "eta": 0.7}  # tiny_scenes_flow's training sampler
FIGURE_IMAGES = 16
RELATIONS = {"above": "below", "below": "above", "left of": "right of", "right of": "left of"}


def parse_prompt(prompt):
    """(a, relation, b) of "a photo of a/an A RELATION a/an B"; BenchmarkError otherwise."""
    for relation in RELATIONS:
        parts = prompt.strip().split(f" {relation} ")
        if len(parts) == 2 and parts[0].startswith("a photo of "):
            a, b = parts[0][len("a photo of "):].split(), parts[1].split()
            if len(a) == 2 and len(b) == 2 and a[0] in ("a", "an") and b[0] in ("a", "an"):
                return a[1], relation, b[1]
    raise BenchmarkError(f"--prompt: {prompt.strip()!r} is not 'a photo of a A RELATION a B' with a relation of "
                         f"{list(RELATIONS)}")


def prompts_of(a, relation, b):
    """[(label, record)]: the prompt, the words in the other order, the other relation word."""
    from ddpo_group.rewards.geneval.metadata import position_record

    return [("prompt", position_record(a, relation, b)), ("nouns_swapped", position_record(b, relation, a)),
            ("relation_flipped", position_record(a, RELATIONS[relation], b))]


def first_higher(a_box, b_box, relation):
    """Whether A sits on the side `relation` names of B (box centres): higher for above, left for left of."""
    axis = 1 if relation in ("above", "below") else 0
    a_centre, b_centre = (a_box[axis] + a_box[axis + 2]) / 2, (b_box[axis] + b_box[axis + 2]) / 2
    return a_centre < b_centre if relation in ("above", "left of") else a_centre > b_centre


def classify(row, a, b):
    """'correct', 'one of each' or 'wrong objects' of one image's evaluation row (a and b in either order)."""
    if row["strict_correct"]:
        return "correct"
    detections = row["detections"]
    counts = {name: len(boxes) for name, boxes in detections.items()}
    if counts.get(a) == 1 and counts.get(b) == 1 and sum(counts.values()) == 2:
        return "one of each"
    return "wrong objects"


def sample(model_args, record, images, seed, workdir, label):
    """(images uint8 (N, H, W, 3), evaluation rows) of one record, by scripts/evaluate.py (the ladder's
    sample_record, SAMPLER)."""
    from scenes_ladder import sample_record

    try:
        return sample_record(model_args, record, images, SAMPLER, workdir, label, seed)
    except RuntimeError as err:
        raise BenchmarkError(str(err)) from None


def measure(model_args, prompt, images, seed):
    """The probe's JSON document (module docstring) and the images per prompt label."""
    import numpy as np

    a, relation, b = parse_prompt(prompt)
    document = {"model": model_args[-1], "prompt": prompt, "images": images, "eval_seed": seed, "sampler": SAMPLER,
                "prompts": {}}
    pictures = {}
    with tempfile.TemporaryDirectory(prefix="position_probe_") as work:
        for label, record in prompts_of(a, relation, b):
            pictures[label], rows = sample(model_args, record, images, seed, work, label)
            verdicts = [classify(row, a, b) for row in rows]  # the same two shapes in each of the three prompts
            higher = [first_higher(row["detections"][a][0], row["detections"][b][0], relation)
                      for row, verdict in zip(rows, verdicts) if verdict != "wrong objects"]
            document["prompts"][label] = {
                "prompt": record["prompt"],
                "correct": verdicts.count("correct"), "one_of_each": verdicts.count("one of each"),
                "wrong_objects": verdicts.count("wrong objects"),
                "placed": len(higher), "first_on_the_side": sum(higher),
                "share_first_on_the_side": (sum(higher) / len(higher)) if higher else None,
                "pixel_change": float(np.abs(pictures[label].astype(np.float64)
                                             - pictures["prompt"].astype(np.float64)).mean()),
                "rows": [{"verdict": v, "detections": row["detections"]} for v, row in zip(verdicts, rows)],
            }
    document["side"] = f"{a} {relation} {b} (box centres)"
    return document, pictures


def figure(document, pictures, path):
    """The three prompts' first FIGURE_IMAGES images, a row each, each image's verdict below it."""
    from PIL import Image, ImageDraw

    labels = list(document["prompts"])
    count = min(FIGURE_IMAGES, len(pictures[labels[0]]))
    size = 2 * pictures[labels[0]].shape[1]
    cell, title_h, label_h = size + 4, 16, 12
    canvas = Image.new("RGB", (count * cell, len(labels) * (cell + title_h + label_h)), "white")
    draw = ImageDraw.Draw(canvas)
    for k, label in enumerate(labels):
        entry, top = document["prompts"][label], k * (cell + title_h + label_h)
        share = entry["share_first_on_the_side"]
        draw.text((2, top + 2), f"\"{entry['prompt']}\": {entry['correct']}/{document['images']} correct, "
                  f"{entry['placed']} placed, {document['side']}: "
                  f"{'-' if share is None else f'{share:.2f}'} of those (the first {count} images)", fill="black")
        for i in range(count):
            canvas.paste(Image.fromarray(pictures[label][i]).resize((size, size), Image.NEAREST),
                         (i * cell, top + title_h))
            verdict = entry["rows"][i]["verdict"]
            draw.text((i * cell + 2, top + title_h + size), {"one of each": "1+1", "wrong objects": "x"}.get(
                verdict, verdict), fill="black")
    tmp = path + ".tmp.png"
    canvas.save(tmp)
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default="tiny-scenes-flow", help="a shipped model's name or a pipeline folder")
    which.add_argument("--checkpoint", default=None, help="a run's checkpoint_N folder (its final weights)")
    parser.add_argument("--prompt", default="a photo of a star above a cross")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234, help="the evaluation seed (the same noise for each prompt)")
    parser.add_argument("--output", required=True, help="the JSON file to write (its figure: the same name, .png)")
    args = parser.parse_args(argv)
    try:
        if not args.output.endswith(".json"):
            raise BenchmarkError(f"--output: {args.output} is not a .json file; give e.g. /tmp/position_probe/base.json")
        if args.images < 1:
            raise BenchmarkError(f"--images: {args.images}; give a positive number of images per prompt")
        parse_prompt(args.prompt)
        model_args = ["--checkpoint", args.checkpoint] if args.checkpoint else ["--model", args.model]
        document, pictures = measure(model_args, args.prompt, args.images, args.seed)
    except BenchmarkError as err:
        fail(parser.prog, str(err))
    document["command"] = "python benchmarks/position_probe.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    save_json(document, args.output)
    figure(document, pictures, os.path.splitext(args.output)[0] + ".png")
    print(f"{'prompt':<40} {'correct':>7} {'placed':>6} {'wrong':>5} {document['side'] + ' of placed':>36} "
          f"{'pixel change':>12}")
    for entry in document["prompts"].values():
        share = entry["share_first_on_the_side"]
        print(f"{entry['prompt']:<40} {entry['correct']:>7} {entry['placed']:>6} {entry['wrong_objects']:>5} "
              f"{'-' if share is None else f'{share:.2f}':>36} {entry['pixel_change']:>12.1f}")
    print(f"wrote {args.output} and its .png")
    return document


if __name__ == "__main__":
    main()
