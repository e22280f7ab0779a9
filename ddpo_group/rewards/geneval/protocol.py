"""GenEval's rules on detections: which detections count, whether an image is correct, the score table; and
Flow-GRPO's partial score (the training reward). No model here: detections come from any detector
(``detectors.py``, ``shapes_scenes.py``), colours from any colour classifier.

Detections kept (djghosh13/geneval ``evaluation/evaluate_images.py``): per class, sorted by confidence
(highest first), those with score > 0.3 (> 0.9 when the record's tag is ``counting``), at most 16 per class.
GenEval's optional non-maximum suppression is off by default (max_overlap 1.0) and is not offered. Two details
follow GenEval's code exactly (``keep_confident``): the scores are float32 (mmdetection's) and compared with the
threshold in float32, and equal scores are ordered as numpy 1.23's argsort, reversed, orders them.

An image is correct (``geneval_correct``) when every ``include`` clause holds (AND) and no ``exclude`` clause
does (OR of the failures):

- include {class, count}: at least ``count`` detections of the class; only the ``count`` most confident ones
  are checked further;
- with ``color``: the colour classifier names the clause's colour for all ``count`` of them;
- with ``position`` [relation, j]: clause j held (else "no target"), and the relation holds between every
  checked object and every object of clause j (``relative_position``);
- exclude {class, count}: fails when there are ``count`` or more detections of the class (all kept ones).

A counting prompt ("exactly N") is include N + exclude N+1.

relative_position(A, B): with box centres c, box sizes d = (w, h) and offset o = c_A - c_B,
o' = sign(o) max(|o| - 0.1 (d_A + d_B), 0) per axis; no relation when |o'| < 1e-3 on both axes; else with
(dx, dy) = o' / |o|: "left of" dx < -0.5, "right of" dx > 0.5, "above" dy < -0.5, "below" dy > 0.5 (image y
grows downwards).

The table (``summarize``, as ``summary_scores.py``): per tag the fraction of its images that are correct; the
overall score is the unweighted mean over the tags present (the six of GenEval: single_object, two_object,
counting, colors, position, color_attr); % correct images over all images; % correct prompts: a prompt (one
metadata record) is correct when ANY of its images is.

Flow-GRPO's partial score (``flow_grpo_score``; yifan123/reward-server ``reward_server/gen_eval.py``,
``evaluate_reward``, used by yifan123/flow_grpo ``flow_grpo/rewards.py: geneval_score``) is a mean of terms,
one list for the whole record, 0 when there is none. Per include clause with n = number of ALL kept
detections of the class (not only the first ``count``):

    count term      1 - |count - n| / count                      (negative once n > 2 count)
    n != count:     one extra 0 if the clause has a colour or a position (one 0 even if it has both)
    n == count, colour:   1 - |count - k| / count, k = objects the classifier gives the clause's colour
    n == count, position, the colour matched: target clause failed -> 0; else, if some pair fails the
                    relation, a 0, and then ALWAYS a 1 (a failed relation adds 0 and 1, a held one adds 1)

Its ``strict_correct`` needs exactly ``count`` detections (not "at least"), all colours right and the relations
held, and ignores ``exclude`` clauses: a two-object image with two dogs is wrong for it and right for GenEval.
These are Flow-GRPO's quirks, kept so that its rewards are reproduced (docs/geneval.md).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Sequence

import numpy as np

from ddpo_group.rewards.geneval.vocabulary import TAGS

THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
POSITION_MARGIN = 0.1


@dataclasses.dataclass
class Detection:
    """One detected object: box (x1, y1, x2, y2) in pixels, confidence in [0, 1], mask bool (H, W) or None."""

    box: tuple[float, float, float, float]
    score: float
    mask: np.ndarray | None = None


# A colour classifier for one image: (detections of one class, the class name) -> one colour name per detection.
ClassifyColors = Callable[[list, str], list]


def keep_confident(detections: dict, tag: str, threshold: float = THRESHOLD,
                   counting_threshold: float = COUNTING_THRESHOLD, max_objects: int = MAX_OBJECTS) -> dict:
    """{class: [Detection]} -> the kept ones per class, most confident first (score > threshold, or >
    counting_threshold for the tag "counting"; at most max_objects); classes left empty are dropped.

    As GenEval's evaluate_images.py, whose scores are mmdetection's float32 array:

    - The comparison is in float32. numpy compares a float32 array with a Python float in float32 (numpy 1.x's
      value-based casting and numpy 2's weak Python scalars agree), so the threshold 0.3 becomes float32(0.3) =
      0.300000011920928955078125 and a score of exactly float32(0.3) is not > it: dropped. (In float64 it would
      pass: 0.300000011920928955078125 > 0.299999999999999988897769753748.) A float64 score rounds to float32
      first: 0.3000000001 is float32(0.3), dropped too.
    - The order is np.argsort(scores)[::-1] over ALL the class's detections (before the threshold and the limit)
      with numpy 1.23.1, GenEval's pinned version (environment.yml), whose default argsort is an introsort
      (``numpy_argsort``). It is not stable: for at most 16 detections it is an insertion sort, stable, so after
      the reversal equal scores come in REVERSE detector order (shapes of equal fit score equally in the shapes-world
      detector, whose unit confidence scored every object 1.0: its last objects are the ones checked); above 16, quicksort partitions move equal scores about (18 equal
      scores sort as 0, 15, 14, ..., 1, 16, 17). Newer numpy on AVX2 / AVX-512 CPUs dispatches argsort to
      x86-simd-sort, whose order of ties differs again (numpy 2.4 with AVX2 sorts (1, 1, 0, 0) as 3, 2, 1, 0), so
      the pinned version's order is the one reproduced.
    """
    limit = np.float32(counting_threshold if tag == "counting" else threshold)
    kept = {}
    for name, found in detections.items():
        scores = np.array([float(d.score) for d in found], dtype=np.float32)
        order = numpy_argsort(scores.tolist())[::-1]
        ordered = [found[k] for k in order if scores[k] > limit][:max_objects]
        if ordered:
            kept[name] = ordered
    return kept


# numpy 1.23's introsort (npysort/quicksort.cpp, aquicksort_): partitions above this size, insertion sort below
_SMALL_QUICKSORT = 15


def _less(a: float, b: float) -> bool:
    """numpy's order of floats: NaN after every number."""
    return a < b or (b != b and a == a)


def numpy_argsort(values: Sequence[float]) -> list[int]:
    """The indices that sort `values` ascending exactly as numpy 1.23's default ``np.argsort`` (kind "quicksort")
    orders them, ties included: an introsort that partitions a range of more than 16 around the median of its
    first, middle and last entries, insertion-sorts ranges of at most 16, and heap-sorts a range once its depth
    budget (2 floor(log2 n)) is spent. Re-implemented from the algorithm, so that GenEval's order of equal scores
    does not depend on the numpy or the CPU here (keep_confident)."""
    v = list(values)
    n = len(v)
    order = list(range(n))
    if n < 2:
        return order
    stack = []  # (low, high, depth) of the ranges still to sort
    low, high, depth = 0, n - 1, 2 * (n.bit_length() - 1)
    while True:
        if depth < 0:
            _heapsort(v, order, low, high)
        else:
            while high - low > _SMALL_QUICKSORT:
                mid = low + ((high - low) >> 1)
                if _less(v[order[mid]], v[order[low]]):
                    order[mid], order[low] = order[low], order[mid]
                if _less(v[order[high]], v[order[mid]]):
                    order[high], order[mid] = order[mid], order[high]
                if _less(v[order[mid]], v[order[low]]):
                    order[mid], order[low] = order[low], order[mid]
                pivot = v[order[mid]]
                i, j = low, high - 1
                order[mid], order[j] = order[j], order[mid]
                while True:
                    i += 1
                    while _less(v[order[i]], pivot):
                        i += 1
                    j -= 1
                    while _less(pivot, v[order[j]]):
                        j -= 1
                    if i >= j:
                        break
                    order[i], order[j] = order[j], order[i]
                order[i], order[high - 1] = order[high - 1], order[i]
                depth -= 1
                if i - low < high - i:  # the larger side waits on the stack
                    stack.append((i + 1, high, depth))
                    high = i - 1
                else:
                    stack.append((low, i - 1, depth))
                    low = i + 1
            for i in range(low + 1, high + 1):
                item, j = order[i], i
                while j > low and _less(v[item], v[order[j - 1]]):
                    order[j] = order[j - 1]
                    j -= 1
                order[j] = item
        if not stack:
            return order
        low, high, depth = stack.pop()


def _heapsort(v, order, low, high) -> None:
    """numpy's aheapsort_ on order[low..high] (1-based heap over that range), in place."""
    n = high - low + 1
    a = [None] + order[low:high + 1]

    def sift(i, size, item):
        j = 2 * i
        while j <= size:
            if j < size and _less(v[a[j]], v[a[j + 1]]):
                j += 1
            if not _less(v[item], v[a[j]]):
                break
            a[i] = a[j]
            i, j = j, 2 * j
        a[i] = item

    for start in range(n >> 1, 0, -1):
        sift(start, n, a[start])
    while n > 1:
        item = a[n]
        a[n] = a[1]
        n -= 1
        sift(1, n, item)
    order[low:high + 1] = a[1:]


def relative_position(a: Detection, b: Detection, margin: float = POSITION_MARGIN) -> set[str]:
    """The relations of A to B (module docstring): a subset of {"left of", "right of", "above", "below"}."""
    box_a, box_b = np.asarray(a.box[:4], dtype=np.float64), np.asarray(b.box[:4], dtype=np.float64)
    center_a, center_b = (box_a[:2] + box_a[2:]) / 2, (box_b[:2] + box_b[2:]) / 2
    size_a, size_b = np.abs(box_a[2:] - box_a[:2]), np.abs(box_b[2:] - box_b[:2])
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - margin * (size_a + size_b), 0.0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def geneval_correct(objects: dict, record: dict, classify: ClassifyColors,
                    margin: float = POSITION_MARGIN) -> tuple[bool, str]:
    """GenEval's verdict on one image (module docstring): (correct, the reasons it is not, one a line)."""
    correct, reasons, groups = True, [], []
    for clause in record.get("include", []):
        name, count = clause["class"], clause["count"]
        found = objects.get(name, [])[:count]
        held = len(found) >= count
        if not held:
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in clause:
                colors = classify(found, name)
                if colors.count(clause["color"]) < count:
                    held = False
                    reasons.append(f"expected {clause['color']} {name}>={count}, found {_color_counts(colors)}")
            if "position" in clause and held:
                relation, target = clause["position"]
                if groups[target] is None:
                    held = False
                    reasons.append(f"no target for {name} to be {relation}")
                else:
                    held, reason = _relation_holds(found, groups[target], relation, name, margin)
                    if not held:
                        reasons.append(reason)
        correct = correct and held
        groups.append(found if held else None)
    for clause in record.get("exclude", []):
        name = clause["class"]
        if len(objects.get(name, [])) >= clause["count"]:
            correct = False
            reasons.append(f"expected {name}<{clause['count']}, found {len(objects[name])}")
    return correct, "\n".join(reasons)


def flow_grpo_score(objects: dict, record: dict, classify: ClassifyColors,
                    margin: float = POSITION_MARGIN) -> tuple[bool, float, str]:
    """Flow-GRPO's (strict_correct, partial score, reasons) of one image, its quirks kept (module docstring)."""
    strict, terms, reasons, groups = True, [], [], []
    for clause in record.get("include", []):
        name, count = clause["class"], clause["count"]
        found = objects.get(name, [])
        held = True
        terms.append(1 - abs(count - len(found)) / count)
        if len(found) != count:
            held = False
            reasons.append(f"expected {name}=={count}, found {len(found)}")
            if "color" in clause or "position" in clause:
                terms.append(0.0)
        else:
            if "color" in clause:
                colors = classify(found, name)
                right = colors.count(clause["color"])
                terms.append(1 - abs(count - right) / count)
                if right != count:
                    held = False
                    reasons.append(f"expected {clause['color']} {name}=={count}, found {_color_counts(colors)}")
            if "position" in clause and held:
                relation, target = clause["position"]
                if groups[target] is None:
                    held = False
                    reasons.append(f"no target for {name} to be {relation}")
                    terms.append(0.0)
                else:
                    held, reason = _relation_holds(found, groups[target], relation, name, margin)
                    if not held:
                        reasons.append(reason)
                        terms.append(0.0)
                    terms.append(1.0)  # the reference appends it after its loop, whether or not a pair failed
        strict = strict and held
        groups.append(found if held else None)
    return strict, (sum(terms) / len(terms) if terms else 0.0), "\n".join(reasons)


def _relation_holds(found, targets, relation, name, margin) -> tuple[bool, str]:
    for obj in found:
        for target in targets:
            relations = relative_position(obj, target, margin)
            if relation not in relations:
                return False, f"expected {name} {relation} target, found {' and '.join(sorted(relations)) or 'no relation'}"
    return True, ""


def _color_counts(colors: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for color in colors:
        counts[color] = counts.get(color, 0) + 1
    return ", ".join(f"{n} {color}" for color, n in counts.items())


def record_key(record: dict) -> str:
    """The identity of a prompt in the table: its metadata record as canonical JSON (GenEval groups by it)."""
    return json.dumps(record, sort_keys=True)


class GenEvalScorer:
    """Detector + colour classifier + the rules above: one result dict per image.

    detector.detect(images uint8 (B, H, W, 3)) -> B dicts {class name: [Detection]};
    color_classifier.classify(image uint8 (H, W, 3), detections, class name) -> [colour name].
    """

    def __init__(self, detector, color_classifier, threshold: float = THRESHOLD,
                 counting_threshold: float = COUNTING_THRESHOLD, max_objects: int = MAX_OBJECTS,
                 position_margin: float = POSITION_MARGIN, expected: Callable | None = None):
        self.detector = detector
        # expected(raw detections, record, classify, margin) -> (value, _): expected.py's expected_strict, passed in
        # by the reward that trains on it (this module stays below expected.py, which uses its rules)
        self.expected = expected
        self.color_classifier = color_classifier
        self.threshold = threshold
        self.counting_threshold = counting_threshold
        self.max_objects = max_objects
        self.position_margin = position_margin

    def score(self, images: np.ndarray, records: Sequence[dict]) -> list[dict]:
        """images uint8 (B, H, W, 3), records: B GenEval metadata records -> B dicts with "tag", "prompt",
        "correct" (GenEval's), "strict_correct" and "partial_score" (Flow-GRPO's), "reason", "detections"
        ({class: [[x1, y1, x2, y2, score], ...]} of the kept detections), "metadata" (record_key); with
        `expected` given, "expected_strict" too (expected.py: Flow-GRPO's verdict averaged over the detector's
        scores, all of them before the threshold)."""
        images = np.asarray(images)
        if len(images) != len(records):
            raise ValueError(f"GenEval: got {len(images)} images but {len(records)} metadata records")
        results = []
        for image, raw, record in zip(images, self.detector.detect(images), records):
            objects = keep_confident(raw, record["tag"], self.threshold, self.counting_threshold, self.max_objects)
            cache: dict = {}

            def classify(found, name, image=image, cache=cache):
                key = (name, tuple(id(d) for d in found))  # both rules ask about the same objects: ask once
                if key not in cache:
                    cache[key] = list(self.color_classifier.classify(image, found, name))
                return cache[key]

            correct, reason = geneval_correct(objects, record, classify, self.position_margin)
            strict, partial, strict_reason = flow_grpo_score(objects, record, classify, self.position_margin)
            results.append({
                "tag": record["tag"], "prompt": record["prompt"], "correct": bool(correct),
                "strict_correct": bool(strict), "partial_score": float(partial), "reason": reason,
                "strict_reason": strict_reason,
                "detections": {name: [[*map(float, d.box[:4]), float(d.score)] for d in found]
                               for name, found in objects.items()},
                "metadata": record_key(record),
            })
            if self.expected is not None:
                results[-1]["expected_strict"] = self.expected(raw, record, classify, self.position_margin)[0]
        return results


def summarize(results: Sequence[dict]) -> dict:
    """GenEval's table from per-image results (each with "tag", "correct", "metadata"):
    {"tags": {tag: {"score", "correct", "images"}} (GenEval's six first, in order, then any other),
    "overall": mean of the tag scores, "correct_images", "correct_prompts", "num_images", "num_prompts"}."""
    if not results:
        raise ValueError("GenEval: no image results to summarize")
    by_tag: dict[str, list[bool]] = {}
    by_prompt: dict[str, bool] = {}
    for result in results:
        by_tag.setdefault(result["tag"], []).append(bool(result["correct"]))
        by_prompt[result["metadata"]] = by_prompt.get(result["metadata"], False) or bool(result["correct"])
    order = [tag for tag in TAGS if tag in by_tag] + [tag for tag in by_tag if tag not in TAGS]
    tags = {tag: {"score": float(np.mean(by_tag[tag])), "correct": int(sum(by_tag[tag])), "images": len(by_tag[tag])}
            for tag in order}
    return {
        "tags": tags,
        "overall": float(np.mean([row["score"] for row in tags.values()])),
        "correct_images": float(np.mean([bool(r["correct"]) for r in results])),
        "correct_prompts": float(np.mean(list(by_prompt.values()))),
        "num_images": len(results),
        "num_prompts": len(by_prompt),
    }


def format_table(summary: dict) -> str:
    """The table as text: every one of GenEval's six tags (a tag without images shows "-"), overall, % correct."""
    lines = [f"{'tag':<16} {'score':>7}  correct / images"]
    for tag in list(TAGS) + [t for t in summary["tags"] if t not in TAGS]:
        row = summary["tags"].get(tag)
        lines.append(f"{tag:<16} {row['score']:>7.4f}  {row['correct']} / {row['images']}" if row
                     else f"{tag:<16} {'-':>7}  0 / 0")
    lines.append(f"{'overall':<16} {summary['overall']:>7.4f}  (unweighted mean of the {len(summary['tags'])} tags present)")
    lines.append(f"% correct images  {summary['correct_images']:.2%} of {summary['num_images']}")
    lines.append(f"% correct prompts {summary['correct_prompts']:.2%} of {summary['num_prompts']}")
    return "\n".join(lines)
