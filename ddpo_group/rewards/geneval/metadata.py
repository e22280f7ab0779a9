"""GenEval's prompt records: reading ``evaluation_metadata.jsonl``, checking a record, and generating training
prompts by GenEval's prompt rules, deduplicated against an evaluation set.

A record (one JSON object a line, djghosh13/geneval ``prompts/evaluation_metadata.jsonl``):

    {"tag": "position", "prompt": "a photo of a dog right of a teddy bear",
     "include": [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}]}

    tag       str, one of GenEval's six (``vocabulary.TAGS``): another tag is refused (GenEval's overall score is the
              mean over exactly these six, so a seventh would change it)
    prompt    non-empty str
    include   list of clauses {"class": str, "count": int >= 1, "color"?: str, "position"?: [relation, j]},
              j the index of an EARLIER include clause, relation one of "left of", "right of", "above", "below"
    exclude   optional list of {"class": str, "count": int >= 1}

A clause has only these keys (an unknown one, "colour", is refused with the closest name: ignored, it would make
every image pass that clause). Each tag asks for the clauses GenEval's ``prompts/create_prompts.py`` writes for it
(``TAG_CLAUSES``), since GenEval's verdict reads the clauses, never the tag or the prompt: a "position" record
without a position clause would be scored as a two_object one.

    single_object  one include clause, no colour, no position
    two_object     two include clauses, no colour, no position
    counting       one include clause (N), no colour, no position, and the exclude clause {class, N + 1}
                   (without it "two dogs" passes with five)
    colors         one include clause with a colour, no position
    position       two include clauses, the second at a position of the first (j = 0), no colour
    color_attr     two include clauses, each with a colour, no position

And the clauses must be satisfiable by some image, by GenEval's rule (evaluate_images.py: an include clause of a
class takes the `count` most confident detections of it, an exclude clause asks for fewer than `count`): an exclude
clause whose count is at most an include clause's count of its class, two include clauses of one class with other
colours (they judge the same detections), a position relating a class to itself (an object is never left of
itself) are refused.

Other fields are kept, except one whose name is close to a field of the format ("includes", "exlude"): it would be
taken for metadata and its clauses dropped. Loaded as prompts (``ddpo_group.data.prompts.load_prompts`` on the .jsonl file, or the
generator below as a ``module:function`` prompt source), the record's fields other than "prompt" are the
metadata the ``geneval`` reward reads.

The generator (``generate_training_records``) follows ``prompts/create_prompts.py``: single_object "a photo of
a {class}"; two_object "a photo of a {A} and a {B}" (A != B); counting "a photo of {two..four} {plural}" with
include N and exclude N+1; colors "a photo of a {color} {class}" (never "person"); position "a photo of a {A}
{relation} a {B}" (clauses [B, A at relation of clause 0]); color_attr "a photo of a {c1} {A} and a {c2} {B}"
(A != B, c1 != c2, never "person"). A generated record is dropped when it equals one of the evaluation set or
one generated before it, where "A and B" equals "B and A" (clause order does not matter) and "A left of B"
equals "B right of A" ("above" / "below" likewise) (``record_identity``).
"""

from __future__ import annotations

import difflib
import os

import numpy as np

from ddpo_group.rewards.geneval.vocabulary import COCO_CLASSES, COLORS, NUMBER_WORDS, POSITIONS, TAGS, plural, with_article


class GenEvalFormatError(ValueError):
    """A GenEval metadata record or file that does not follow the format; the message names the file and line."""


RECORD_FIELDS = ("tag", "prompt", "include", "exclude")
CLAUSE_KEYS = {"include": ("class", "count", "color", "position"), "exclude": ("class", "count")}
# tag: (include clauses, colour on which clauses, position on which clauses, an exact-count exclude clause)
TAG_CLAUSES = {
    "single_object": (1, (), (), False),
    "two_object": (2, (), (), False),
    "counting": (1, (), (), True),
    "colors": (1, (0,), (), False),
    "position": (2, (), (1,), False),
    "color_attr": (2, (0, 1), (), False),
}


def _closest(name, known):
    match = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _check_keys(clause, part, at):
    """An unknown key of a clause, refused with the closest known name."""
    unknown = [key for key in clause if key not in CLAUSE_KEYS[part]]
    if unknown:
        key = unknown[0]
        raise GenEvalFormatError(f"{at}: unknown key {key!r}{_closest(key, CLAUSE_KEYS[part])}; an {part} clause has "
                                 f"only {', '.join(CLAUSE_KEYS[part])}")


def _check_tag_clauses(record, where: str) -> None:
    """The clauses the record's tag asks for (TAG_CLAUSES, module docstring)."""
    tag, include = record["tag"], record["include"]
    n, colored, positioned, exact_count = TAG_CLAUSES[tag]
    if len(include) != n:
        raise GenEvalFormatError(f"{where}: a {tag!r} record has {n} include clause{'s' if n > 1 else ''}, got "
                                 f"{len(include)}; fix the clauses or the tag")
    for i, clause in enumerate(include):
        for key, wanted in (("color", i in colored), ("position", i in positioned)):
            if (key in clause) != wanted:
                asked = "needs" if wanted else "has no"
                raise GenEvalFormatError(f"{where}: include[{i}]: a {tag!r} record's clause {i} {asked} {key!r}"
                                         f"{' (the first clause is its target)' if key == 'position' else ''}; "
                                         "fix the clause or the tag")
    if positioned and include[positioned[0]]["position"][1] != 0:
        raise GenEvalFormatError(f"{where}: include[1]: a 'position' record places clause 1 relative to clause 0, got "
                                 f"{include[1]['position']!r}")
    if exact_count:
        wanted = {"class": include[0]["class"], "count": include[0]["count"] + 1}
        if record.get("exclude") != [wanted]:
            raise GenEvalFormatError(f"{where}: a 'counting' record needs the exclude clause {wanted} (exactly "
                                     f"{include[0]['count']}: fewer than {wanted['count']}), got "
                                     f"{record.get('exclude', [])!r}")


def _check_satisfiable(record, where: str) -> None:
    """Clauses no image can meet by GenEval's rule (module docstring)."""
    include = record["include"]
    for i, clause in enumerate(include):
        for j, other in enumerate(include[:i]):
            if other["class"] == clause["class"] and "color" in clause and "color" in other \
                    and clause["color"] != other["color"]:
                raise GenEvalFormatError(
                    f"{where}: include[{j}] and include[{i}] ask for a {other['color']} and a {clause['color']} "
                    f"{clause['class']!r}, which GenEval judges on the same detections: no image passes both")
        if "position" in clause and include[clause["position"][1]]["class"] == clause["class"]:
            raise GenEvalFormatError(
                f"{where}: include[{i}] places a {clause['class']!r} {clause['position'][0]} a {clause['class']!r}: "
                "GenEval compares the same detections, and no object is " + clause["position"][0] + " itself")
    for k, clause in enumerate(record.get("exclude", [])):
        for i, wanted in enumerate(include):
            if wanted["class"] == clause["class"] and wanted["count"] >= clause["count"]:
                raise GenEvalFormatError(
                    f"{where}: exclude[{k}] asks for fewer than {clause['count']} {clause['class']!r} and include[{i}] "
                    f"for at least {wanted['count']}: no image passes both")


def check_record(record, where: str) -> dict:
    """The record if it follows the format (module docstring: known keys, its tag's clauses, satisfiable), with
    each position as a [relation, j] list; GenEvalFormatError naming `where` (e.g. "FILE, line 3") and the field
    otherwise."""
    if not isinstance(record, dict):
        raise GenEvalFormatError(f"{where}: expected a JSON object (a GenEval metadata record), got {type(record).__name__}")
    for field in ("tag", "prompt"):
        if not isinstance(record.get(field), str) or not record[field].strip():
            raise GenEvalFormatError(f"{where}: field {field!r} must be a non-empty string, got {record.get(field)!r}")
    if record["tag"] not in TAGS:
        raise GenEvalFormatError(f"{where}: tag {record['tag']!r} is not one of GenEval's six tags ({', '.join(TAGS)})")
    for field in record:
        near = difflib.get_close_matches(str(field), RECORD_FIELDS, n=1, cutoff=0.8)
        if field not in RECORD_FIELDS and near and near[0] not in record:
            raise GenEvalFormatError(f"{where}: unknown field {field!r} (did you mean {near[0]!r}?); a GenEval record "
                                     f"has {', '.join(RECORD_FIELDS)}")
    if "include" not in record:
        raise GenEvalFormatError(f"{where}: missing field 'include' (a list of {{'class', 'count'}} clauses)")
    record = dict(record)
    for part in ("include", "exclude"):
        clauses = record.get(part, [])
        if not isinstance(clauses, list):
            raise GenEvalFormatError(f"{where}: field {part!r} must be a list of clauses, got {type(clauses).__name__}")
        checked = []
        for i, clause in enumerate(clauses):
            at = f"{where}: {part}[{i}]"
            if not isinstance(clause, dict):
                raise GenEvalFormatError(f"{at} must be an object {{'class', 'count', ...}}, got {clause!r}")
            _check_keys(clause, part, at)
            if not isinstance(clause.get("class"), str) or not clause["class"].strip():
                raise GenEvalFormatError(f"{at}: 'class' must be a non-empty string, got {clause.get('class')!r}")
            count = clause.get("count")
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise GenEvalFormatError(f"{at}: 'count' must be a whole number >= 1, got {count!r}")
            if "color" in clause and (not isinstance(clause["color"], str) or not clause["color"]):
                raise GenEvalFormatError(f"{at}: 'color' must be a colour name, got {clause['color']!r}")
            clause = dict(clause)
            if "position" in clause:
                position = clause["position"]
                if (not isinstance(position, (list, tuple)) or len(position) != 2 or position[0] not in POSITIONS
                        or isinstance(position[1], bool) or not isinstance(position[1], int)
                        or not 0 <= position[1] < i):
                    raise GenEvalFormatError(
                        f"{at}: 'position' must be [relation, j] with relation one of {list(POSITIONS)} and j the "
                        f"index of an earlier include clause (0..{i - 1}), got {position!r}")
                clause["position"] = [position[0], position[1]]
            checked.append(clause)
        record[part] = checked
    if not record["include"]:
        raise GenEvalFormatError(f"{where}: 'include' is empty; a record asks for at least one object")
    _check_tag_clauses(record, where)
    _check_satisfiable(record, where)
    return record


def read_metadata(path: str) -> list[dict]:
    """The checked records of a GenEval ``evaluation_metadata.jsonl`` (one JSON object a line, blank lines
    skipped); GenEvalFormatError naming the file and the 1-based line of the first bad record."""
    if not os.path.isfile(path):
        raise GenEvalFormatError(f"GenEval metadata file {path!r} does not exist; give GenEval's "
                                 "prompts/evaluation_metadata.jsonl or a file in its format")
    from ddpo_group.data.prompts import jsonl_items

    records = [check_record(item, where) for item, where in
               jsonl_items(path, GenEvalFormatError, "; one GenEval record a line")]
    if not records:
        raise GenEvalFormatError(f"GenEval metadata file {path!r} has no records")
    return records


def check_vocabulary(records, classes, colors, where: str) -> None:
    """GenEvalFormatError when a record names a class the detector cannot find or a colour its classifier cannot
    name (None: any); `where` names the source of the records."""
    for i, record in enumerate(records):
        for clause in record.get("include", []) + record.get("exclude", []):
            if classes is not None and clause["class"] not in classes:
                raise GenEvalFormatError(f"{where}, record {i} ({record['prompt']!r}): class {clause['class']!r} is "
                                         f"not one the detector finds ({', '.join(sorted(classes)[:12])}, ...)")
            if colors is not None and "color" in clause and clause["color"] not in colors:
                raise GenEvalFormatError(f"{where}, record {i} ({record['prompt']!r}): colour {clause['color']!r} is "
                                         f"not one the colour classifier names ({', '.join(colors)})")


_OPPOSITE = {"right of": "left of", "below": "above"}


def record_identity(record: dict) -> tuple:
    """What makes two records the same prompt: the tag, the include clauses as a set, the exclude clauses as a
    set; a position clause "A right of B" is written as "B left of A" ("below" as "above")."""
    include = record.get("include", [])
    clauses, relations = [], []
    for clause in include:
        if "position" in clause:
            relation, j = clause["position"]
            subject, target = clause["class"], include[j]["class"]
            if relation in _OPPOSITE:
                relation, subject, target = _OPPOSITE[relation], target, subject
            relations.append((subject, relation, target))
        clauses.append((clause["class"], clause["count"], clause.get("color")))
    exclude = sorted((c["class"], c["count"]) for c in record.get("exclude", []))
    return record["tag"], tuple(sorted(clauses, key=repr)), tuple(sorted(relations)), tuple(exclude)


def single_object_record(name: str) -> dict:
    return {"tag": "single_object", "include": [{"class": name, "count": 1}], "prompt": f"a photo of {with_article(name)}"}


def two_object_record(a: str, b: str) -> dict:
    return {"tag": "two_object", "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
            "prompt": f"a photo of {with_article(a)} and {with_article(b)}"}


def counting_record(name: str, n: int) -> dict:
    return {"tag": "counting", "include": [{"class": name, "count": n}], "exclude": [{"class": name, "count": n + 1}],
            "prompt": f"a photo of {NUMBER_WORDS[n]} {plural(name)}"}


def colors_record(name: str, color: str) -> dict:
    return {"tag": "colors", "include": [{"class": name, "count": 1, "color": color}],
            "prompt": f"a photo of {with_article(color)} {name}"}


def position_record(a: str, relation: str, b: str) -> dict:
    """"a photo of a {a} {relation} a {b}": clauses [b, a at `relation` of clause 0]."""
    return {"tag": "position",
            "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}],
            "prompt": f"a photo of {with_article(a)} {relation} {with_article(b)}"}


def color_attr_record(a: str, color_a: str, b: str, color_b: str) -> dict:
    return {"tag": "color_attr",
            "include": [{"class": a, "count": 1, "color": color_a}, {"class": b, "count": 1, "color": color_b}],
            "prompt": f"a photo of {with_article(color_a)} {a} and {with_article(color_b)} {b}"}


def _single_object(rng, classes, colors, max_count):
    return single_object_record(classes[rng.integers(len(classes))])


def _two_object(rng, classes, colors, max_count):
    a, b = (classes[i] for i in rng.choice(len(classes), size=2, replace=False))
    return two_object_record(a, b)


def _counting(rng, classes, colors, max_count):
    name = classes[rng.integers(len(classes))]
    return counting_record(name, int(rng.integers(2, max_count, endpoint=True)))


def _colorable(classes):
    return [name for name in classes if name != "person"]  # GenEval writes no "[colour] person" prompt


def _colors(rng, classes, colors, max_count):
    names = _colorable(classes)
    name, color = names[rng.integers(len(names))], colors[rng.integers(len(colors))]
    return colors_record(name, color)


def _position(rng, classes, colors, max_count):
    a, b = (classes[i] for i in rng.choice(len(classes), size=2, replace=False))
    return position_record(a, POSITIONS[rng.integers(len(POSITIONS))], b)


def _color_attr(rng, classes, colors, max_count):
    names = _colorable(classes)
    a, b = (names[i] for i in rng.choice(len(names), size=2, replace=False))
    ca, cb = (colors[i] for i in rng.choice(len(colors), size=2, replace=False))
    return color_attr_record(a, ca, b, cb)


GENERATORS = {"single_object": _single_object, "two_object": _two_object, "counting": _counting,
              "colors": _colors, "position": _position, "color_attr": _color_attr}


def generate_training_records(n_per_tag: int = 100, seed: int = 0, tags=TAGS, exclude_records=(),
                              classes=COCO_CLASSES, colors=COLORS, max_count: int = 4,
                              attempts_per_record: int = 50) -> list[dict]:
    """Up to `n_per_tag` new records per tag (module docstring), none equal to a record of `exclude_records`
    (the evaluation set) or to an earlier one. A tag whose prompts run out (single_object has only
    len(classes) prompts, all in GenEval's evaluation set) gets fewer: at most n_per_tag * attempts_per_record
    draws are made for it. The same arguments give the same records."""
    unknown = [tag for tag in tags if tag not in GENERATORS]
    if unknown:
        raise ValueError(f"GenEval prompt generator: unknown tags {unknown}; choose from {list(TAGS)}")
    if not 2 <= max_count < len(NUMBER_WORDS) - 1:
        raise ValueError(f"GenEval prompt generator: max_count={max_count} must be in 2..{len(NUMBER_WORDS) - 2}")
    rng = np.random.default_rng(seed)
    seen = {record_identity(record) for record in exclude_records}
    records = []
    for tag in tags:
        made = 0
        for _ in range(n_per_tag * attempts_per_record):
            if made == n_per_tag:
                break
            record = GENERATORS[tag](rng, list(classes), list(colors), max_count)
            identity = record_identity(record)
            if identity not in seen:
                seen.add(identity)
                records.append(record)
                made += 1
    return records


def training_prompts(n_per_tag: int = 100, seed: int = 0, exclude: str = "", tags: str | list = "",
                     max_count: int = 4) -> list[dict]:
    """A prompt source (config: prompt_fn = "ddpo_group.rewards.geneval.metadata:training_prompts", its
    arguments in prompt_fn_kwargs): generated GenEval records, deduplicated against the evaluation metadata file
    `exclude` (GenEval's prompts/evaluation_metadata.jsonl; "" for none). `tags`: comma-separated, "" for all six."""
    chosen = [t.strip() for t in tags.split(",") if t.strip()] if isinstance(tags, str) else list(tags)
    evaluation = read_metadata(exclude) if exclude else []
    return generate_training_records(n_per_tag, seed, tuple(chosen) or TAGS, evaluation, max_count=max_count)
