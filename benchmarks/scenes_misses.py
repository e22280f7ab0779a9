"""The images a GenEval evaluation judged wrong, side by side, each with what the detector found: the figure to read a
plateau by eye (docs/scenes.md, "What the misses are").

    python scripts/evaluate.py --checkpoint RUN/checkpoints/checkpoint_30 --prompts RECORD.jsonl --protocol geneval \
        --protocol-option detector=shapes --images-per-prompt 128 ... --output OUT.json --save-images DIR
    python benchmarks/scenes_misses.py --rows OUT_images.jsonl --images DIR --output misses.png

Reads the per-image rows scripts/evaluate.py writes beside its output (OUT_images.jsonl: "prompt_index",
"image_index", "strict_correct", "detections") and the images it saved (DIR/<prompt_index:05d>/samples/<i:04d>.png);
draws every image whose strict verdict is wrong (Flow-GRPO's, the rung's number), `--columns` a row, under each its
index and the classes found with their counts (cut to the image's width). Writes the PNG atomically; refuses an
existing output.
"""

from __future__ import annotations

import argparse
import json
import os

CELL = 128  # px an image is drawn at (nearest-neighbour: the pixels as the detector saw them)
LABEL = 16  # px of text under an image


def misses(rows):
    """The rows judged wrong by the strict verdict, in the file's order."""
    return [row for row in rows if not row["strict_correct"]]


def found_text(detections):
    """'cross x2, star x1' of a row's detections ({class: [box, ...]}), 'nothing' when empty."""
    return ", ".join(f"{name} x{len(boxes)}" for name, boxes in sorted(detections.items())) or "nothing"


def draw(rows, images, columns=8):
    """A PIL image of the missed images (`rows`, as `misses` gives them), `columns` a row."""
    from PIL import Image, ImageDraw

    count = max(1, len(rows))
    width, height = columns * (CELL + 8), ((count + columns - 1) // columns) * (CELL + LABEL + 8)
    canvas = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(canvas)
    for k, row in enumerate(rows):
        path = os.path.join(images, f"{row['prompt_index']:05d}", "samples", f"{row['image_index']:04d}.png")
        tile = Image.open(path).convert("RGB").resize((CELL, CELL), Image.NEAREST)
        x, y = (k % columns) * (CELL + 8) + 4, (k // columns) * (CELL + LABEL + 8) + 4
        canvas.paste(tile, (x, y))
        pen.text((x, y + CELL + 2), f"#{row['image_index']}: {found_text(row['detections'])}"[:26], fill="black")
    return canvas


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", required=True, help="scripts/evaluate.py's OUT_images.jsonl")
    parser.add_argument("--images", required=True, help="its --save-images folder")
    parser.add_argument("--output", required=True, help="the PNG to write (refused if it exists)")
    parser.add_argument("--columns", type=int, default=8)
    args = parser.parse_args(argv)
    if os.path.exists(args.output):
        parser.error(f"--output {args.output}: exists; give a new path (nothing is overwritten)")
    if args.columns < 1:
        parser.error(f"--columns {args.columns}: at least 1")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        parser.error(f"--output {args.output}: its folder does not exist")
    for name, path, check in (("rows", args.rows, os.path.isfile), ("images", args.images, os.path.isdir)):
        if not check(path):
            parser.error(f"--{name} {path}: not found (scripts/evaluate.py's --output gives OUT_images.jsonl, "
                         "its --save-images the folder)")
    with open(args.rows) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    wrong = misses(rows)
    tmp = args.output + ".tmp.png"
    draw(wrong, args.images, args.columns).save(tmp, optimize=True)
    os.replace(tmp, args.output)
    print(f"{len(wrong)} of {len(rows)} images judged wrong: {args.output}")
    return wrong


if __name__ == "__main__":
    main()
