"""Prompt sources: built-in prompt sets, text / JSON / JSONL files, and plugins.

    load_prompts(source, **kwargs) -> list[PromptRecord(prompt, metadata)]

`source` is one of:

- a built-in set: "simple_animals" (ddpo-pytorch's 45 bare animal names, e.g. "cat"),
  "imagenet_animals" (the 398 ImageNet-1k animal classes), "imagenet_dogs" (its classes
  151-268), "shapes" (the tiny shapes world, `ddpo_group.data.shapes.shapes_prompts()`;
  metadata = the record's other fields + data_source "shapes");
- "from_file" with `path=` (ddpo-pytorch's prompt_fn name);
- a file path: *.txt (one prompt a line; blank lines and lines starting with # skipped),
  *.json (a list of records or {"prompts": [...]}) or *.jsonl (one record a line). A record
  is a string or an object {"prompt": ..., "data_source": ..., "ground_truth": ..., ...}
  whose fields other than "prompt" become the metadata the reward receives (an editing prompt's
  "source_image" is a path relative to the file, made absolute here: ddpo_group/data/edit_sources.py). A file name not
  found as given is looked up in ddpo_group/assets/prompts/;
- "package.module:function" or "path/to/file.py:function": a function called with
  `kwargs` that returns a list of strings, dicts or PromptRecords.

`low` / `high` (keyword arguments, as ddpo-pytorch's from_file) keep records[low:high].
Malformed files raise ValueError naming the file, the line (record for .json) and the
missing or bad field; a byte that is not UTF-8, the file, the line and the byte (``read_utf8``); a source
without any prompt is an error too.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import io
import json
import os
from typing import Any

from ddpo_group.config.registry import ConfigError
from ddpo_group.data.edit_sources import resolve_source_path

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "prompts")

# Line ranges of imagenet_animals.txt (class indices), as ddpo-pytorch's imagenet_* prompt_fns.
IMAGENET_DOGS = (151, 269)


@dataclasses.dataclass
class PromptRecord:
    """One prompt and the metadata its reward receives (data_source, ground_truth, ...)."""

    prompt: str
    metadata: dict = dataclasses.field(default_factory=dict)


# Invisible characters a prompt must not start or end with: zero-width space / joiners, word joiner, BOM.
_INVISIBLE = "\u200b\u200c\u200d\u2060\ufeff"


def clean_prompt(text: str) -> str:
    """The prompt without surrounding whitespace and invisible characters ("" when nothing else is left)."""
    previous = None
    while previous != text:
        previous, text = text, text.strip().strip(_INVISIBLE)
    return text


def _record(item: Any, where: str) -> PromptRecord:
    """PromptRecord from a string, a PromptRecord or a dict with a "prompt" field."""
    if isinstance(item, PromptRecord):
        prompt, metadata = item.prompt, dict(item.metadata)
    elif isinstance(item, str):
        prompt, metadata = item, {}
    elif isinstance(item, dict):
        if "prompt" not in item:
            raise ValueError(f"{where}: missing field 'prompt' (fields: {sorted(item)})")
        prompt = item["prompt"]
        metadata = {key: value for key, value in item.items() if key != "prompt"}
    else:
        raise ValueError(f"{where}: expected a string or an object with a 'prompt' field, got {type(item).__name__}")
    if not isinstance(prompt, str) or not clean_prompt(prompt):
        raise ValueError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r}")
    return PromptRecord(clean_prompt(prompt), metadata)


def _file_record(item: Any, where: str, path: str) -> PromptRecord:
    """A record of a prompt file: its source image path (an editing prompt's) made absolute, relative to the file."""
    record = _record(item, where)
    resolve_source_path(record.metadata, path, where)
    return record


def _resolve_path(path: str) -> str:
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        raise ValueError(f"prompt file {path!r} is a directory; give a .txt, .json or .jsonl file")
    asset = os.path.join(ASSETS_DIR, path)
    if os.path.isfile(asset):
        return asset
    raise ValueError(f"prompt file {path!r} does not exist" + ("" if os.path.isabs(path) else f" (nor {asset!r})"))


def read_utf8(path: str, error=ValueError) -> str:
    """The text of a UTF-8 file (a byte-order mark dropped). A byte that is not UTF-8 raises `error` in one line
    naming the file, the 1-based line, the byte and its offset in the file: "F, line 3: byte 0xe9 (offset 41) is
    not UTF-8 (invalid continuation byte); save the file as UTF-8"."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        body = exc.object  # the bytes after the BOM: exc.start counts from there
        line = body.count(b"\n", 0, exc.start) + 1
        offset = exc.start + (len(data) - len(body))
        raise error(f"{path}, line {line}: byte {body[exc.start]:#04x} (offset {offset}) is not UTF-8 ({exc.reason}); "
                    "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def load_text(path: str) -> list[PromptRecord]:
    """One prompt a line; blank lines (also of invisible characters only) and lines starting with # are skipped;
    metadata {}. A UTF-8 byte-order mark is dropped."""
    lines = [clean_prompt(line) for line in io.StringIO(read_utf8(path), newline=None)]
    return [PromptRecord(line, {}) for line in lines if line and not line.startswith("#")]


def jsonl_items(path: str, error=ValueError, hint: str = ""):
    """(item, where) of each line of a JSON-lines file (blank lines skipped, a UTF-8 BOM allowed); `where` is
    "PATH, line N" (1-based); a line that is not JSON, or not UTF-8 (`read_utf8`), raises `error` naming it, with
    `hint` appended to the first."""
    for lineno, line in enumerate(io.StringIO(read_utf8(path, error), newline=None), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: invalid JSON ({exc.msg}){hint}") from None
        yield item, where


def load_jsonl(path: str) -> list[PromptRecord]:
    """One JSON record a line (blank lines skipped); errors name the file and the 1-based line."""
    return [_file_record(item, where, path) for item, where in jsonl_items(path)]


def load_json(path: str) -> list[PromptRecord]:
    """A JSON list of records, or an object whose "prompts" field is that list."""
    try:
        data = json.loads(read_utf8(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}, line {exc.lineno}: invalid JSON ({exc.msg})") from exc
    if isinstance(data, dict):
        if "prompts" not in data:
            raise ValueError(f"{path}: a JSON object must have a 'prompts' field (a list of records)")
        data = data["prompts"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of records or {{'prompts': [...]}}, got {type(data).__name__}")
    return [_file_record(item, f"{path}, record {i}", path) for i, item in enumerate(data)]


def load_file(path: str) -> list[PromptRecord]:
    """Records of a .txt, .json or .jsonl prompt file (see the module docstring)."""
    path = _resolve_path(path)
    extension = os.path.splitext(path)[1].lower()
    loaders = {".txt": load_text, ".json": load_json, ".jsonl": load_jsonl}
    if extension not in loaders:
        raise ValueError(f"prompt file {path!r}: unknown extension {extension!r}; use .txt, .json or .jsonl")
    return loaders[extension](path)  # a byte that is not UTF-8: one line naming the file and the line (read_utf8)


def shapes_records(**kwargs) -> list[PromptRecord]:
    """The shapes world's prompts; metadata = the other fields + data_source "shapes"."""
    from ddpo_group.data.shapes import shapes_prompts

    records = []
    for i, item in enumerate(shapes_prompts(**kwargs)):
        record = _record(item, f"ddpo_group.data.shapes.shapes_prompts() item {i}")
        records.append(PromptRecord(record.prompt, {**record.metadata, "data_source": "shapes"}))
    return records


def _plugin(source: str, kwargs: dict) -> list[PromptRecord]:
    target, attr = source.rsplit(":", 1)
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ValueError(f"prompt source {source!r}: file {target!r} does not exist")
        module_spec = importlib.util.spec_from_file_location("ddpo_group_prompt_plugin", target)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise ValueError(f"prompt source {source!r}: cannot import {target!r} ({exc})") from exc
    if not hasattr(module, attr):
        raise ValueError(f"prompt source {source!r}: {target!r} defines no {attr!r}")
    items = getattr(module, attr)(**kwargs)
    return [_record(item, f"{source} item {i}") for i, item in enumerate(items)]


BUILTIN_PROMPT_SETS = {
    "simple_animals": lambda: load_text(os.path.join(ASSETS_DIR, "simple_animals.txt")),
    "imagenet_animals": lambda: load_text(os.path.join(ASSETS_DIR, "imagenet_animals.txt")),
    "imagenet_dogs": lambda: load_text(os.path.join(ASSETS_DIR, "imagenet_animals.txt"))[slice(*IMAGENET_DOGS)],
    "shapes": shapes_records,
}


def load_prompts(source, low: int | None = None, high: int | None = None, **kwargs) -> list[PromptRecord]:
    """Prompt records of `source` (module docstring), sliced to [low:high]; never empty.

    `kwargs` go to the "shapes" set's shapes_prompts(), to a plugin function, or (`path`)
    to "from_file". A list of strings / dicts / PromptRecords is also accepted as `source`.
    """
    if isinstance(source, (list, tuple)):
        records = [_record(item, f"prompts[{i}]") for i, item in enumerate(source)]
        name = "the given prompt list"
    elif not isinstance(source, str) or not source.strip():
        raise ValueError(f"prompt source must be a non-empty string or a list of prompts, got {source!r}")
    elif source in BUILTIN_PROMPT_SETS:
        records = BUILTIN_PROMPT_SETS[source](**kwargs)
        name = f"prompt set {source!r}"
    elif source == "from_file":
        if "path" not in kwargs:
            raise ValueError("prompt source 'from_file' needs path=... (config: prompt_fn_kwargs.path)")
        records = load_file(kwargs.pop("path"))
        name = "from_file"
    elif ":" in source and not os.path.isfile(source):
        records = _plugin(source, kwargs)
        name = f"prompt plugin {source!r}"
    elif source.lower().endswith((".txt", ".json", ".jsonl")) or os.path.isfile(source):
        records = load_file(source)
        name = f"prompt file {source!r}"
    else:
        raise ValueError(
            f"unknown prompt source {source!r}; use a built-in set ({', '.join(BUILTIN_PROMPT_SETS)}), "
            f"a .txt / .json / .jsonl file, or 'package.module:function'"
        )
    records = records[low:high]
    if not records:
        raise ValueError(f"{name} has no prompts" + (f" in [{low}:{high}]" if low is not None or high is not None else ""))
    return records


def load_config_prompts(config, field: str) -> list:
    """The prompt records of config.<field> ("prompt_fn" with prompt_fn_kwargs, or "eval_prompt_fn"); a file that
    is missing, empty or unreadable is a ConfigError naming the field."""
    kwargs = dict(config.prompt_fn_kwargs) if field == "prompt_fn" else {}
    try:
        records = load_prompts(config[field], **kwargs)
    except (ValueError, OSError) as err:
        raise ConfigError(f"config.{field}={config[field]!r}: {' '.join(str(err).split())}") from None
    _check_edit_prompts(config, field, records)
    return records


def _check_edit_prompts(config, field, records):
    """An editing model's prompts carry readable source images of the run's resolution; other models' carry none
    (ddpo_group/data/edit_sources.py); checked before any model loads (the family is known by the model's name)."""
    from ddpo_group.data.edit_sources import check_edit_prompts, record_sources
    from ddpo_group.diffusion.policy import family_for_model

    family = family_for_model(config.pretrained.model)
    editing = getattr(family, "conditions_on_images", False)
    if not editing and not any(record_sources(record.metadata) for record in records):
        return
    try:
        check_edit_prompts(records, editing, config.sample.resolution, field, config.pretrained.model,
                           getattr(family, "max_source_images", 1))
    except ValueError as err:
        raise ConfigError(str(err)) from None
