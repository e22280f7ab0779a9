"""The expected strict verdict: Flow-GRPO's ``strict_correct`` averaged over what the detector is unsure of.

GenEval's rules threshold the detector's scores (> 0.3, > 0.9 for counting): a blob that is 0.55 star and 0.45
triangle is a star, and a noise that moves it to 0.45 / 0.55 flips the reward. ``expected_strict`` reads the
scores as probabilities instead, so that the reward moves as much as the detector's belief does (measured as a
training reward on the ladder: docs/scenes.md, "The expected strict verdict as the reward"):

- an object is one detected thing: the detections that share one mask array (the shapes-world detector reports
  one object under every class it scores >= 0.05 for, with the same mask), or one detection alone (Mask2Former's
  queries, each its own mask);
- object k is of class c with probability p_k(c), its score for c, and of none of the record's classes with
  the rest, 1 - sum_c p_k(c) (scores summing above 1 are scaled to sum to 1); objects are independent;
- the value is sum over the assignments a of prod_k p_k(a_k) * strict(a), strict being ``flow_grpo_score``'s
  verdict on the objects a gives each class (colours and positions as the colour classifier and the boxes say).

Only the record's include classes matter to the strict verdict (it ignores exclude clauses), so each object has
at most (include classes + 1) outcomes; objects whose outcome is certain (p >= 1 - 1e-9) are fixed and objects
with no include class do not enter. Above ``MAX_ASSIGNMENTS`` assignments, the most certain objects are fixed to
their likeliest outcome one by one until the rest fit (an approximation; ``expected_strict`` returns how many). On a
rendered scene every object's true class scores > 0.98, so the value is within a few hundredths of the verdict;
on an unsure blob it moves smoothly with the scores instead of jumping at a threshold.

No threshold acts: counting's 0.9 does not apply (a 0.5-sure semicircle counts half). GenEval's own verdict and
the evaluation are unchanged; this is a training reward (``reward_kwargs.geneval.score = "expected"``).
"""

from __future__ import annotations

import itertools
import math

from ddpo_group.rewards.geneval.protocol import POSITION_MARGIN, flow_grpo_score

MAX_ASSIGNMENTS = 4096
CERTAIN = 1 - 1e-9
OTHER = None  # the outcome "none of the record's include classes"


def objects_of(detections: dict) -> list[dict]:
    """{class: [Detection]} (all of them, before any threshold) -> [{class: Detection}], one dict per object:
    detections sharing one mask array are one object; a detection without a mask is an object of its own."""
    objects: dict[int, dict] = {}
    for name, found in detections.items():
        for detection in found:
            key = id(detection.mask) if detection.mask is not None else id(detection)
            objects.setdefault(key, {})[name] = detection
    return list(objects.values())


def outcomes(obj: dict, classes) -> list[tuple]:
    """[(class or OTHER, probability)] of one object over the record's include classes, probabilities > 0."""
    probs = {name: max(0.0, float(obj[name].score)) for name in classes if name in obj}
    total = sum(max(0.0, float(d.score)) for d in obj.values())
    scale = 1.0 / total if total > 1 else 1.0
    pairs = [(name, p * scale) for name, p in probs.items() if p > 0]
    rest = 1.0 - sum(p for _, p in pairs)
    if rest > 1e-12:
        pairs.append((OTHER, rest))
    return pairs


def expected_strict(detections: dict, record: dict, classify, margin: float = POSITION_MARGIN) -> tuple[float, int]:
    """(the expected strict verdict in [0, 1], the objects fixed to their likeliest outcome to stay within
    MAX_ASSIGNMENTS) of one image: `detections` {class: [Detection]} as the detector gave them (no threshold),
    `record` its GenEval record, `classify` the protocol's colour classifier for this image."""
    classes = list(dict.fromkeys(clause["class"] for clause in record.get("include", [])))
    fixed: list[tuple] = []  # (object, class) with a certain or forced outcome
    unsure: list[tuple] = []  # (object, [(class, p)])
    for obj in objects_of(detections):
        pairs = outcomes(obj, classes)
        if not any(name is not OTHER for name, _ in pairs):
            continue
        best = max(pairs, key=lambda pair: pair[1])
        if best[1] >= CERTAIN:
            fixed.append((obj, best[0]))
        else:
            unsure.append((obj, pairs))
    forced = 0
    while unsure and math.prod(len(pairs) for _, pairs in unsure) > MAX_ASSIGNMENTS:
        k = max(range(len(unsure)), key=lambda i: max(p for _, p in unsure[i][1]))
        obj, pairs = unsure.pop(k)
        fixed.append((obj, max(pairs, key=lambda pair: pair[1])[0]))  # as if certain
        forced += 1
    value = 0.0
    for choice in itertools.product(*(pairs for _, pairs in unsure)):
        p = math.prod(q for _, q in choice)
        if p <= 0:
            continue
        found: dict[str, list] = {}
        for obj, name in fixed + [(obj, name) for (obj, _), (name, _) in zip(unsure, choice)]:
            if name is not OTHER:
                found.setdefault(name, []).append(obj[name])
        for name in found:  # most confident first, as the protocol keeps them
            found[name].sort(key=lambda d: -float(d.score))
        strict, _, _ = flow_grpo_score(found, record, classify, margin)
        value += p * float(strict)
    return min(1.0, max(0.0, value)), forced
