"""The scenes world: one to four shapes per image, captioned by GenEval's six prompt templates.

It grows the shapes world (``ddpo_group/data/shapes.py``) into GenEval's task in miniature, for the shipped models
``tiny-scenes-sd3`` (flow) and ``tiny-scenes`` (UNet + DDIM) and their held-out evaluation set.

Vocabulary. Classes: ``SCENE_SHAPES``, the shapes world's circle, square and triangle plus diamond, cross, ring,
star and semicircle (8). Colours: the shapes world's six (red, green, blue, yellow, magenta, cyan). Why eight
shapes: GenEval's counting tag has 3 prompts per class (two to four), its two_object tag one per pair of
classes; with three shapes there are 3 single-object, 3 two-object and 9 counting prompts, too few to hold any
out. With eight there are 8 / 28 / 24 / 48 / 112 / 840 distinct prompts for single_object / two_object /
counting / colors / position / color_attr ("A and B" is "B and A", "A left of B" is "B right of A",
``metadata.record_identity``), enough for a held-out set of 150 that leaves every tag but single_object with
prompts to train on. The colours stay six: GenEval's orange, purple, pink or brown would sit between two of
them, and a tiny model's colours are what the colour classifier must tell apart.

Images: ``SCENE_SIZE`` = 64 px. Four objects of 80-160 px area (about 10-20 px across) fit with room to move
at 64 px; at 32 px they would be 5-10 px across, where a star, a cross and a diamond differ by a few pixels.
The background is white, black or gray, drawn at random and never named (GenEval's prompts do not say it).
Issue 53's coarse scale (``COARSE_AREA_RANGE``, 150-260 px, ``pretrain --object-scale coarse``) draws the same
records with objects 1.4x as wide: the fine scale's smallest objects lose their counts through the models' VAE
(``benchmarks/scenes_vae_ceiling.py``). A scale changes the pretraining's scenes only; the prompts, the held-out set
and GenEval's rules are the same.

A scene for a record (``sample_scene``): exactly the objects its include clauses ask for (a counting record:
n objects of its class), each of its clause's colour or a random one, of a random area, placed uniformly at
random (objects one after another) so that every object's box keeps ``MARGIN`` px from the border and ``GAP`` px from every other box,
and a position clause's relation is the only one GenEval's rule (``protocol.relative_position``) finds
between the two boxes. Placement is rejection sampling, ``PLACE_TRIES`` positions per object and ``MAX_ATTEMPTS`` scenes at most; a record whose scene
cannot be placed raises ``SceneInfeasible``.

Prompts (``world_records``): every distinct record of the world, one phrasing each (drawn with a fixed seed
among "A and B" / "B and A", "A left of B" / "B right of A" ...). The held-out set (``evaluation_records``,
shipped as ``assets/prompts/geneval_scenes.jsonl``): per tag n = round(150 * GenEval's share of the tag)
records (GenEval's 553 prompts: 80 / 99 / 80 / 94 / 100 / 100), capped so that at least a third of a tag's
records stays for training (single_object: all eight go to evaluation), the shortfall given to the tags with
room, furthest below their share first; then n records drawn at random per tag (seed 0). Training (pretraining and
RL) uses only the other records (``training_records``).
"""

from __future__ import annotations

import itertools
import json
import math
import os

import numpy as np

from ddpo_group.rewards.geneval.metadata import (
    color_attr_record, colors_record, counting_record, position_record, record_identity, single_object_record,
    two_object_record,
)
from ddpo_group.rewards.geneval.protocol import Detection, relative_position
from ddpo_group.rewards.geneval.vocabulary import POSITIONS, TAGS, plural
from ddpo_group.data.shapes import ALL_SHAPES, BACKGROUNDS, COLORS, shape_coverage

SCENE_SHAPES: tuple[str, ...] = ALL_SHAPES
SCENE_COLORS: tuple[str, ...] = tuple(COLORS)
SCENE_SIZE = 64
AREA_RANGE = (80.0, 160.0)  # object area in pixels at 64 px, uniform: issue 42's world (the "fine" scale)
# issue 53's coarse scale: 1.4x as wide (a circle 14-18 px across); every record of the world is placed (0 failures in
# 5 draws of each of the 1,060 records; 160-300 px failed "four stars" once; 200-400 px cannot place two stars side
# by side). Through the shipped VAE its scenes keep 0.99 strict accuracy against the fine scale's 0.95 (docs/scenes.md).
COARSE_AREA_RANGE = (150.0, 260.0)
MARGIN = 3  # px between an object's box and the border
GAP = 2  # px between two objects' boxes
WINDOW = 14  # px: every shape of AREA_RANGE lies within this of its centre (a star's point: 10.5)
MAX_ATTEMPTS = 200  # scene draws
PLACE_TRIES = 20  # positions tried for one object before the scene is drawn again
MAX_COUNT = 4
EVALUATION_SIZE = 150
# GenEval's evaluation_metadata.jsonl: prompts per tag (553 in all)
GENEVAL_TAG_COUNTS = {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100,
                      "color_attr": 100}
TRAIN_RESERVE = 1 / 3  # share of a tag's records kept for training (single_object excepted)
EVALUATION_FILE = "geneval_scenes.jsonl"

# Whole-word tokens of the scenes models' tokenizer (ddpo_group.diffusion.tiny.build_tiny_tokenizer(words)).
SCENE_WORDS: tuple[str, ...] = tuple(dict.fromkeys(
    ("a", "an", "photo", "of", "and", "left", "right", "above", "below", "two", "three", "four")
    + SCENE_COLORS + SCENE_SHAPES + tuple(plural(s) for s in SCENE_SHAPES)
))


class SceneInfeasible(ValueError):
    """No placement of a record's objects was found within MAX_ATTEMPTS draws."""


def world_records(seed: int = 0) -> dict[str, list[dict]]:
    """Every distinct GenEval record of the world, per tag, one phrasing each, in a fixed order."""
    rng = np.random.default_rng(seed)
    pairs = list(itertools.combinations(SCENE_SHAPES, 2))
    by_tag: dict[str, list[dict]] = {
        "single_object": [single_object_record(s) for s in SCENE_SHAPES],
        "two_object": [two_object_record(*(pair if rng.random() < 0.5 else pair[::-1])) for pair in pairs],
        "counting": [counting_record(s, n) for s in SCENE_SHAPES for n in range(2, MAX_COUNT + 1)],
        "colors": [colors_record(s, c) for s in SCENE_SHAPES for c in SCENE_COLORS],
    }
    position = []
    for a, b in itertools.permutations(SCENE_SHAPES, 2):
        for relation in ("left of", "above"):
            if rng.random() < 0.5:  # "a left of b" or, the same record, "b right of a"
                position.append(position_record(a, relation, b))
            else:
                position.append(position_record(b, {"left of": "right of", "above": "below"}[relation], a))
    by_tag["position"] = position
    color_attr = []
    for a, b in pairs:
        for ca, cb in itertools.permutations(SCENE_COLORS, 2):
            color_attr.append(color_attr_record(a, ca, b, cb) if rng.random() < 0.5 else color_attr_record(b, cb, a, ca))
    by_tag["color_attr"] = color_attr
    for tag, records in by_tag.items():  # one phrasing per identity, by construction
        assert len({record_identity(r) for r in records}) == len(records), tag
    return by_tag


def evaluation_sizes(total: int = EVALUATION_SIZE, available: dict | None = None) -> dict[str, int]:
    """Records per tag in the held-out set (module docstring): GenEval's shares of `total`, capped so that at least
    TRAIN_RESERVE of each tag stays for training, the shortfall given to tags with room, furthest below its share
    first."""
    available = available or {tag: len(r) for tag, r in world_records().items()}
    caps = {tag: n if tag == "single_object" else n - math.ceil(TRAIN_RESERVE * n) for tag, n in available.items()}
    weight = {tag: GENEVAL_TAG_COUNTS[tag] / sum(GENEVAL_TAG_COUNTS.values()) for tag in TAGS}
    sizes = {tag: min(caps[tag], round(total * weight[tag])) for tag in TAGS}
    while sum(sizes.values()) < total:
        room = [tag for tag in TAGS if sizes[tag] < caps[tag]]
        if not room:
            raise ValueError(f"the scenes world has fewer than {total} records to hold out")
        # the tag with room that is furthest below its share of the total gets the next record
        tag = max(room, key=lambda t: (total * weight[t] - sizes[t], -TAGS.index(t)))
        sizes[tag] += 1
    return sizes


def evaluation_records(seed: int = 0) -> list[dict]:
    """The held-out set: evaluation_sizes() records per tag drawn at random (seed), the tags taken in turn
    (one record of each tag, then the next of each, ...), so that the first prompts of the set, which an
    evaluation grid shows, cover every tag."""
    rng = np.random.default_rng(seed)
    by_tag = world_records()
    sizes = evaluation_sizes(available={tag: len(r) for tag, r in by_tag.items()})
    chosen = {}
    for tag in TAGS:
        picks = sorted(rng.choice(len(by_tag[tag]), size=sizes[tag], replace=False))
        chosen[tag] = [by_tag[tag][i] for i in picks]
    return [records[k] for k in range(max(sizes.values())) for records in chosen.values() if k < len(records)]


def evaluation_prompts_path() -> str:
    """The shipped held-out set (ddpo_group/assets/prompts/geneval_scenes.jsonl)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "prompts", EVALUATION_FILE)


def training_records(held_out=None) -> dict[str, list[dict]]:
    """The world's records per tag minus the held-out ones (`held_out`: records; default the shipped set)."""
    if held_out is None:
        from ddpo_group.rewards.geneval.metadata import read_metadata

        held_out = read_metadata(evaluation_prompts_path())
    excluded = {record_identity(r) for r in held_out}
    return {tag: [r for r in records if record_identity(r) not in excluded] for tag, records in world_records().items()}


def scene_training_prompts(n_per_tag: int = 100, seed: int = 0, tags: str | list = "", mix: str = "records",
                           prompt: str = "") -> list[dict]:
    """A prompt source for RL on the scenes world (config prompt_fn = "ddpo_group.data.scenes:scene_training_prompts"):
    records generated by GenEval's rules over the world's classes and colours and deduplicated against the
    shipped held-out set, as Flow-GRPO generates its GenEval training prompts (up to `n_per_tag` distinct
    records per tag; a tag whose prompts run out gets fewer: single_object has none left, all eight are held out).

    mix: how the list weighs the tags (the trainer draws uniformly from the list, so a tag's share of the list is
    its share of the training groups):
        "records"  every distinct record once: a tag weighs by how many records it has (the world's records
                   give 48 % color_attr, 36 % position, 4 % counting);
        "geneval"  GenEval's proportions (``GENEVAL_TAG_COUNTS``): tag t fills exactly GENEVAL_TAG_COUNTS[t] places
                   of the list, its distinct records cycled in a seeded order (each k or k + 1 times). Of the
                   chosen tags only those with training records count: single_object has none, so its share goes
                   to the others in proportion to theirs (99 / 80 / 94 / 100 / 100 of 473).
    prompt: one training prompt alone (the learning ladder's one-prompt runs, benchmarks/scenes_ladder.py): its
        record, phrased as the world phrases it (``world_records``); a prompt of the held-out set or one the
        world does not have is a one-line ValueError naming prompt_fn_kwargs.prompt."""
    from ddpo_group.rewards.geneval.metadata import generate_training_records, read_metadata

    held_out = read_metadata(evaluation_prompts_path())
    if prompt:
        return [_one_training_record(prompt, held_out)]
    if mix not in ("records", "geneval"):
        raise ValueError(f"scene_training_prompts: mix={mix!r} is not 'records' or 'geneval' "
                         "(config: prompt_fn_kwargs.mix)")
    chosen = [t.strip() for t in tags.split(",") if t.strip()] if isinstance(tags, str) else list(tags)
    records = generate_training_records(n_per_tag, seed, tuple(chosen) or TAGS, held_out,
                                        classes=SCENE_SHAPES, colors=SCENE_COLORS, max_count=MAX_COUNT)
    if mix == "records":
        return records
    rng = np.random.default_rng([seed, 1])  # the cycling order, apart from the generator's stream
    mixed = []
    for tag in tuple(chosen) or TAGS:
        own = [r for r in records if r["tag"] == tag]
        if own:  # each record k or k + 1 times: the first (count mod len) of a seeded order once more
            order = rng.permutation(len(own))
            mixed += [own[order[i % len(own)]] for i in range(GENEVAL_TAG_COUNTS[tag])]
    return mixed


def _one_training_record(prompt: str, held_out) -> dict:
    """The world's record whose prompt is `prompt`, refused (one line) when held out or not in the world."""
    import difflib

    records = [r for by_tag in world_records().values() for r in by_tag]
    found = [r for r in records if r["prompt"] == prompt.strip()]
    if not found:
        near = difflib.get_close_matches(prompt, [r["prompt"] for r in records], n=1)
        raise ValueError(f"prompt_fn_kwargs.prompt={prompt!r} is not a prompt of the scenes world"
                         + (f"; did you mean {near[0]!r}?" if near else " (ddpo_group.data.scenes.world_records)"))
    if record_identity(found[0]) in {record_identity(r) for r in held_out}:
        raise ValueError(f"prompt_fn_kwargs.prompt={prompt!r} is in the held-out set ({EVALUATION_FILE}); "
                         "choose a training prompt (ddpo_group.data.scenes.training_records)")
    return found[0]


def _objects_of(record: dict, rng: np.random.Generator) -> list[tuple[str, str]]:
    """(shape, colour) of each object a record asks for, include clauses in order."""
    objects = []
    for clause in record["include"]:
        for _ in range(clause["count"]):
            color = clause.get("color") or SCENE_COLORS[rng.integers(len(SCENE_COLORS))]
            objects.append((clause["class"], color))
    return objects


def _box(coverage: np.ndarray) -> tuple[float, float, float, float] | None:
    ys, xs = np.nonzero(coverage > 0)
    if not len(xs):
        return None
    return float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)


def window_of(area_range) -> int:
    """px around a centre that holds every shape of `area_range` (WINDOW at AREA_RANGE, grown with the side)."""
    return max(WINDOW, math.ceil(WINDOW * math.sqrt(float(area_range[1]) / AREA_RANGE[1])))


def check_area_range(area_range) -> tuple[float, float]:
    """(low, high) object areas in px, or ValueError naming what is wrong with them."""
    try:
        low, high = (float(a) for a in area_range)
    except (TypeError, ValueError):
        raise ValueError(f"object areas {area_range!r}: two numbers, the smallest and largest area in px") from None
    if not (0 < low <= high < math.inf):
        raise ValueError(f"object areas {area_range!r}: need 0 < low <= high, finite (px; the default {AREA_RANGE}, "
                         f"the coarse scale {COARSE_AREA_RANGE})")
    return low, high


def area_range_of_pipeline(folder) -> tuple[float, float]:
    """The object areas a scenes model was pretrained on: its pretrain_log.json's ``object_area`` (written by
    ``ddpo-group pretrain --world scenes``), AREA_RANGE for a log from before the option or any other folder."""
    path = os.path.join(folder, "pretrain_log.json") if isinstance(folder, str) and folder else None
    try:
        with open(path) as f:
            areas = json.load(f).get("object_area")
        return check_area_range(areas)
    except (TypeError, OSError, ValueError, AttributeError):
        return AREA_RANGE


def sample_scene(record: dict, rng: np.random.Generator, size: int = SCENE_SIZE, area_range=AREA_RANGE):
    """(objects [(shape, colour, coverage (size, size))], background name) of a random scene for `record`
    (module docstring), its objects' areas uniform in `area_range` (px); SceneInfeasible when MAX_ATTEMPTS draws
    place none."""
    area_range = check_area_range(area_range)
    window = window_of(area_range)
    wanted = _objects_of(record, rng)
    relation = None
    for clause in record["include"]:
        if "position" in clause:
            relation = clause["position"][0]
    background = list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
    for _ in range(MAX_ATTEMPTS):
        placed, boxes = [], []
        for shape, color in wanted:
            for _ in range(PLACE_TRIES):
                area = rng.uniform(*area_range)
                # the box's offsets from the centre, from the shape drawn at the canvas centre
                x1, y1, x2, y2 = _box(shape_coverage(shape, area, (size / 2, size / 2), size, window=window))
                low_x, high_x = MARGIN + 1 + size / 2 - x1, size - MARGIN - 1 - (x2 - size / 2)
                low_y, high_y = MARGIN + 1 + size / 2 - y1, size - MARGIN - 1 - (y2 - size / 2)
                if low_x > high_x or low_y > high_y:  # it cannot fit on this canvas at this area
                    continue
                center = (rng.uniform(low_x, high_x), rng.uniform(low_y, high_y))
                coverage = shape_coverage(shape, area, center, size, window=window)
                box = _box(coverage)
                inside = min(box[0], box[1]) >= MARGIN and max(box[2], box[3]) <= size - MARGIN
                if inside and not any(box[0] < b[2] + GAP and b[0] < box[2] + GAP and box[1] < b[3] + GAP
                                      and b[1] < box[3] + GAP for b in boxes):
                    placed.append((shape, color, coverage))
                    boxes.append(box)
                    break
            else:
                break
        else:
            # include clause 1 (the subject) against clause 0 (the target): exactly the asked relation
            if relation is None or relative_position(Detection(boxes[1], 1.0), Detection(boxes[0], 1.0)) == {relation}:
                return placed, background
    raise SceneInfeasible(f"no scene for {record['prompt']!r} placed in {MAX_ATTEMPTS} draws")


def render_objects(objects, background: str, size: int = SCENE_SIZE) -> np.ndarray:
    """uint8 (size, size, 3): image = coverage * colour + (1 - coverage) * image, object by object."""
    image = np.broadcast_to(np.asarray(BACKGROUNDS[background], dtype=np.float64), (size, size, 3)).copy()
    for _, color, coverage in objects:
        image = coverage[..., None] * np.asarray(COLORS[color], dtype=np.float64) + (1.0 - coverage[..., None]) * image
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def render_record(record: dict, rng: np.random.Generator, size: int = SCENE_SIZE,
                  area_range=AREA_RANGE) -> np.ndarray:
    """A random scene for `record` as uint8 (size, size, 3)."""
    objects, background = sample_scene(record, rng, size, area_range)
    return render_objects(objects, background, size)


DATASET_CHUNK = 500  # scenes per independently seeded chunk of a pretraining data set


def _render_chunk(job) -> tuple[np.ndarray, list[str]]:
    """Chunk `index` of a data set (``sample_dataset``): `n` scenes from the generator seeded by (seed, index)."""
    n, seed, index, size, pool, area_range = job
    rng = np.random.default_rng([seed, index])
    tags = list(pool)
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    prompts = []
    for i in range(n):
        records = pool[tags[rng.integers(len(tags))]]
        record = records[rng.integers(len(records))]
        images[i] = render_record(record, rng, size, area_range)
        prompts.append(record["prompt"])
    return images, prompts


def sample_dataset(n: int, seed: int, size: int = SCENE_SIZE, held_out=None, workers: int = 1,
                   area_range=AREA_RANGE) -> tuple[np.ndarray, list[str]]:
    """`n` (image, prompt) pairs for pretraining, reproducible from `seed`: a tag uniformly among those with
    training records, a record uniformly among the tag's training records, a random scene for it (objects of
    `area_range` px). The set is made
    in chunks of DATASET_CHUNK scenes, chunk k from the generator seeded by (seed, k), so that `workers` processes
    render the same set as one. Returns (images uint8 (n, size, size, 3), prompts)."""
    pool = {tag: records for tag, records in training_records(held_out).items() if records}
    area_range = check_area_range(area_range)
    jobs = [(min(DATASET_CHUNK, n - start), seed, k, size, pool, area_range)
            for k, start in enumerate(range(0, n, DATASET_CHUNK))]
    if workers > 1 and len(jobs) > 1:
        import multiprocessing

        # spawn: the parent may hold torch's threads (or a CUDA context), which a forked child must not inherit
        with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as processes:
            chunks = processes.map(_render_chunk, jobs)
    else:
        chunks = [_render_chunk(job) for job in jobs]
    if not chunks:
        return np.empty((0, size, size, 3), dtype=np.uint8), []
    return np.concatenate([c[0] for c in chunks]), [p for c in chunks for p in c[1]]
