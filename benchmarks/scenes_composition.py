"""Which shapes a model draws together for a two-object prompt, and whether it draws its two objects' classes as if
each had its own coin (docs/scenes.md, "two_object's plateau is one coin per object").

Reads the image folders that `scripts/evaluate.py --save-images DIR` writes (GenEval's layout:
DIR/NNNNN/metadata.jsonl, DIR/NNNNN/samples/NNNN.png), segments every image with the shapes detector and names each
object by its best template overlap (`ShapesDetector.objects`, every object of at least the detector's minimum
area, whatever its score). For every record of tag two_object (classes A and B), over its images:

- the composition: the share of images drawn as "A + B", "A + A", "B + B", and anything else (one object, three,
  another class);
- p, the share of A among the objects of the images drawn as two objects from {A, B};
- what one coin per object would give those images: A + B 2p(1 - p), A + A p^2, B + B (1 - p)^2 of them (given,
  like every share here, as a share of all the record's images);
- the ceiling of such a draw: its best strict share, 0.5 (at p = 1/2) times the share of images drawn as two
  objects from {A, B}. A policy whose strict-correct sits at that ceiling has learned the classes, not their pairing.

    python scripts/evaluate.py --checkpoint CKPT --prompts ONE_RECORD.jsonl --protocol geneval \\
        --protocol-option detector=shapes --images-per-prompt 64 --num-steps 10 --guidance-scale 5 --eta 1 \\
        --seed 1234 --save-images DIR
    python benchmarks/scenes_composition.py --images "final weights=DIR" [--images LABEL=DIR ...] --output OUT.json

Prints a table (one row per folder and record) and writes it as JSON (--output; a file that exists is refused).
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from bench_outputs import BenchmarkError, fail  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", action="append", default=[], metavar="LABEL=DIR", required=True,
                        help="a folder of scripts/evaluate.py --save-images, with its label (repeatable)")
    parser.add_argument("--output", default="", help="JSON of the table (refused if it exists)")
    args = parser.parse_args(argv)
    if args.output and os.path.exists(args.output):
        parser.error(f"--output {args.output} exists; give a new file (a measurement is never written over)")
    for item in args.images:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            parser.error(f"--images {item!r}: give LABEL=DIR")
    return args


def object_classes(image, detector) -> tuple[str, ...]:
    """The classes of one image's objects (each its best template overlap), sorted."""
    return tuple(sorted(max(obj["overlaps"], key=obj["overlaps"].get) for obj in detector.objects(image)))


def composition(drawn: list[tuple[str, ...]], first: str, second: str) -> dict:
    """The composition of a two-object record's images (`drawn`: each image's object classes) against one coin per
    object; the module docstring defines every field."""
    n = len(drawn)
    pair, first_twice, second_twice = tuple(sorted((first, second))), (first, first), (second, second)
    counts = collections.Counter(
        "A + B" if classes == pair else "A + A" if classes == first_twice else "B + B" if classes == second_twice
        else "other" for classes in drawn)
    two = counts["A + B"] + counts["A + A"] + counts["B + B"]
    p = (counts["A + B"] + 2 * counts["A + A"]) / (2 * two) if two else float("nan")
    return {
        "images": n, "classes": [first, second],
        "shares": {key: counts[key] / n for key in ("A + B", "A + A", "B + B", "other")},
        "p": p,
        "one_coin_per_object": ({"A + B": 2 * p * (1 - p) * two / n, "A + A": p * p * two / n,
                                 "B + B": (1 - p) ** 2 * two / n} if two else None),
        "ceiling": 0.5 * two / n,
    }


def measure(folder: str, detector) -> list[dict]:
    """Every two_object record of one --save-images folder (read by the GenEval protocol's own reader)."""
    from ddpo_group.evaluation.protocols import ProtocolError, read_geneval_folder
    from ddpo_group.rewards.geneval.metadata import GenEvalFormatError

    try:
        records, images = read_geneval_folder(folder)
    except (ProtocolError, GenEvalFormatError) as err:
        raise BenchmarkError(f"{err} (scripts/evaluate.py --save-images writes one)") from None
    rows = []
    for record, record_images in zip(records, images):
        if record.metadata.get("tag") != "two_object":
            continue
        first, second = (clause["class"] for clause in record.metadata["include"])
        drawn = [object_classes(image, detector) for image in record_images]
        rows.append({"prompt": record.prompt, **composition(drawn, first, second)})
    if not rows:
        raise BenchmarkError(f"--images {folder}: no record of tag two_object; this measures two-object prompts")
    return rows


def table(results: dict) -> str:
    lines = ["| images | prompt (A and B) | n | A + B | A + A | B + B | other | p (share of A) | A + B, one coin per "
             "object | ceiling of one coin per object |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, rows in results.items():
        for row in rows:
            shares, coin = row["shares"], row["one_coin_per_object"]
            lines.append(f"| {label} | {row['prompt']} | {row['images']} | {shares['A + B']:.3f} "
                         f"| {shares['A + A']:.3f} | {shares['B + B']:.3f} | {shares['other']:.3f} | {row['p']:.3f} | "
                         f"{coin['A + B'] if coin else float('nan'):.3f} | {row['ceiling']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    from ddpo_group.rewards.geneval.shapes_scenes import ShapesDetector

    detector = ShapesDetector()
    try:
        results = {label: measure(folder, detector)
                   for label, _, folder in (item.partition("=") for item in args.images)}
    except BenchmarkError as err:
        fail("scenes_composition.py", err)
    print(table(results))
    if args.output:
        from ddpo_group.runs.grids import save_json

        command = ["python", "benchmarks/scenes_composition.py"]
        for item in args.images:
            command += ["--images", item]
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        save_json({"command": shlex.join(command + ["--output", args.output]), "results": results}, args.output)
        print(f"wrote {args.output}")
    return results


if __name__ == "__main__":
    main()
