"""The files a run trains on, and the content hash of each (docs/reliability.md): recorded in the run directory
when the run starts, checked when it resumes.

    RUN_DIR/inputs.json   {"files": {absolute path: sha256 hex digest of its bytes}}

The files (``input_files``): the prompt files of prompt_fn and eval_prompt_fn (a path, a shipped prompt file named
by its name, or "from_file" with prompt_fn_kwargs.path); the .py file of each "file.py:function" spec (prompt_fn,
eval_prompt_fn, reward_fn, eval_rewards, the keys of reward_weights and reward_kwargs) and of config.plugins; every
file named by a string of prompt_fn_kwargs or reward_kwargs (a reference file, GenEval's metadata to exclude); the
source images of editing prompts (``edit_sources.record_sources``). Not the built-in prompt sets, registered rewards
or installed modules (they change with the package's version), nor the pretrained model.

A resume re-reads every recorded file (``check_inputs``, before any model loads): one that changed or is gone
since the run started is refused in one line naming it and the fix, since training on other prompts or another
reward silently mixes two experiments in one run; with config.resume_allow_input_changes the run goes on, and
resumes.jsonl records {"inputs_changed": {path: [recorded sha256, now (None: gone)]}}. A run from before this
file was written has none, and is not checked.
"""

from __future__ import annotations

import hashlib
import json
import os

from ddpo_group.config.registry import ConfigError

INPUTS_FILE = "inputs.json"


def _existing_file(value) -> str | None:
    """The absolute path of `value` when it is a string naming an existing file (not a directory)."""
    if not isinstance(value, str) or not value or "\0" in value:
        return None
    path = os.path.expanduser(value)
    return os.path.abspath(path) if os.path.isfile(path) else None


def _spec_file(spec) -> str | None:
    """The file of a "path/to/file.py:function" spec; None for a registered name, a module or a URL."""
    if not isinstance(spec, str) or ":" not in spec or spec.startswith(("http://", "https://")):
        return None
    target = spec.rsplit(":", 1)[0]
    return _existing_file(target) if target.endswith(".py") else None


def _strings(value):
    """Every string inside a config value (nested dicts and lists)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict) or hasattr(value, "to_dict"):
        for item in (value.to_dict() if hasattr(value, "to_dict") else value).values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def input_files(config, records=()) -> list[str]:
    """The sorted absolute paths of the files the run trains on (module docstring); `records`: its PromptRecords
    (training and evaluation), whose editing sources count."""
    from ddpo_group.data.edit_sources import record_sources
    from ddpo_group.data.prompts import ASSETS_DIR, BUILTIN_PROMPT_SETS
    from ddpo_group.evaluation.hacking import gold_specs

    found = []
    for field in ("prompt_fn", "eval_prompt_fn"):
        value = config.get(field)
        if not isinstance(value, str) or not value or value in BUILTIN_PROMPT_SETS or value == "from_file":
            continue
        found.append(_existing_file(value) or _spec_file(value) or _existing_file(os.path.join(ASSETS_DIR, value)))
    found += [_existing_file(value) for value in _strings(config.get("prompt_fn_kwargs", {}))]
    specs = [config.get("reward_fn")] + gold_specs(config.get("eval_rewards", ""))
    for field in ("reward_weights", "reward_kwargs"):
        specs += list(config[field].to_dict()) if field in config else []
    found += [_spec_file(spec) for spec in specs]
    found += [_existing_file(value) for value in _strings(config.get("reward_kwargs", {}))]
    found += [_existing_file(entry.strip()) for entry in str(config.get("plugins", "")).split(",")
              if entry.strip().endswith(".py")]
    for record in records:
        found += [_existing_file(path) for path in record_sources(getattr(record, "metadata", {}) or {}) or []]
    return sorted({path for path in found if path})


def file_sha256(path: str) -> str | None:
    """The sha256 hex digest of the file's bytes; None when it cannot be read (gone)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def input_hashes(config, records=()) -> dict:
    """{path: sha256} of ``input_files``: what RUN_DIR/inputs.json holds."""
    return {path: file_sha256(path) for path in input_files(config, records)}


def recorded_inputs(run_dir: str) -> dict:
    """{path: sha256} recorded in run_dir/inputs.json ({} for a run from before it was written); a damaged file is
    a ConfigError naming it."""
    path = os.path.join(run_dir, INPUTS_FILE)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"cannot resume {run_dir}: {path} (the hashes of the files the run trained on) is "
                          f"unreadable ({err}); restore it, or delete it to resume without checking them") from None
    return files


def check_inputs(run_dir: str, config) -> dict:
    """The recorded inputs of `run_dir` that changed: {path: [recorded sha256, now (None: gone)]}. ConfigError in
    one line naming the first (and how many more) unless config.resume_allow_input_changes."""
    changed = {}
    for path, recorded in sorted(recorded_inputs(run_dir).items()):
        now = file_sha256(path)
        if now != recorded:
            changed[path] = [recorded, now]
    if changed and not config.get("resume_allow_input_changes", False):
        path, (recorded, now) = next(iter(changed.items()))
        what = "is gone" if now is None else f"changed (sha256 {str(recorded)[:12]}... -> {now[:12]}...)"
        more = f" (and {len(changed) - 1} more file{'s' if len(changed) > 2 else ''})" if len(changed) > 1 else ""
        raise ConfigError(
            f"config.resume_from={config.resume_from!r}: {path}, which the run {run_dir} trained on, {what} since the "
            f"run started{more}; restore it, start a new run for the new file, or pass "
            "--config.resume_allow_input_changes=True to continue this run with it (recorded in resumes.jsonl)"
        )
    return changed
