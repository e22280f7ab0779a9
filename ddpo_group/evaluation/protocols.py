"""Evaluation protocols: a benchmark's own way to score a model on its prompt set and write its table.

    protocol = get_protocol("geneval", detector="shapes")      # options: the reward's keyword arguments
    records = protocol.load_records("evaluation_metadata.jsonl")
    results = score_policy(protocol, policy, records, images_per_prompt=4, num_steps=40, ...)   # or score_folder
    summary = protocol.summarize(results); print(protocol.format(summary))
    write_protocol_results(path, summary, results)

A protocol scores images with a registered reward, resolved through the reward registry when the protocol is
built (so a reward added by another module is found by name):

- ``geneval``: the ``geneval`` reward's per-image verdicts (djghosh13/geneval's rules, docs/geneval.md) and
  GenEval's table: the score per tag, the overall score (unweighted mean of the tags), % correct images,
  % correct prompts. Its prompts are GenEval metadata records; 4 images per prompt by default, as GenEval.
- ``geneval2``: GenEval 2's Soft-TIFA through the VLM-judge transport (ddpo_group/evaluation/geneval2.py: its
  records, rules and table).
- ``ocr``: the mean of the ``ocr`` reward with per-image values (a ``RewardMeanProtocol``; any reward can be
  measured the same way by registering a ``RewardMeanProtocol`` under another name).

A new protocol: a class with ``load_records``, ``check_ready``, ``score(images, records) -> [dict]``,
``summarize(results) -> dict``, ``format(summary) -> str``, registered with ``register_protocol(name, factory)``.

Images are sampled with the fixed noise of ``ddpo_group.evaluation.evaluator`` (image j of prompt i from the generator
seeded by (seed, i, j)), so a protocol's "before" and "after" of a run differ only by the weights; or read from
a folder in GenEval's layout (``score_folder``), the layout ``save_geneval_folder`` writes for GenEval's own
scripts (the official numbers, docs/geneval.md).
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import numpy as np
import torch

from ddpo_group.evaluation.evaluator import not_finite_error, sample_generator
from ddpo_group.evaluation.geneval2 import GenEval2Protocol
from ddpo_group.data.prompts import PromptRecord, load_prompts, read_utf8
from ddpo_group.rewards.geneval.metadata import GenEvalFormatError, check_record, check_vocabulary, read_metadata
from ddpo_group.rewards.geneval.protocol import format_table, summarize
from ddpo_group.rewards.registry import get_reward, list_rewards, resolve_reward
from ddpo_group.runs.run_dir import write_json_atomic

PROTOCOLS: dict[str, Callable] = {}


class ProtocolError(ValueError):
    """A protocol that cannot run as asked (an unknown name, a reward that is not registered, bad records)."""


def register_protocol(name: str, factory: Callable) -> None:
    """Make `factory(**options)` the protocol called `name`."""
    PROTOCOLS[name] = factory


def get_protocol(name: str, device=None, **options):
    """The protocol `name` built with `options` (its reward's keyword arguments); one-line ProtocolError if unknown."""
    if name not in PROTOCOLS:
        raise ProtocolError(f"unknown protocol {name!r}; protocols: {', '.join(sorted(PROTOCOLS))}")
    return PROTOCOLS[name](device=device, **options)


def _registered_reward(protocol: str, reward: str, device, options: dict):
    try:
        resolve_reward(reward)
    except ValueError:
        raise ProtocolError(f"protocol {protocol!r} scores images with the reward {reward!r}, which is not registered "
                            f"(registered: {', '.join(list_rewards())}); install or import the module that "
                            "registers it") from None
    try:
        return get_reward(reward, device=device, **options)
    except (TypeError, ValueError) as err:
        raise ProtocolError(f"protocol {protocol!r}: {' '.join(str(err).split())} (--protocol-option KEY=VALUE)") from None


class GenEvalProtocol:
    """GenEval (module docstring); options are the ``geneval`` reward's keyword arguments (``score`` is ignored:
    the table counts GenEval's own verdict)."""

    name = "geneval"
    images_per_prompt = 4

    def __init__(self, device=None, **options):
        options.pop("score", None)
        # the reward class's own option check, found through the registry (this module imports no reward module)
        check_options = getattr(resolve_reward("geneval"), "check_options", None)
        try:
            if check_options is not None:
                check_options(options, protocol=True)  # named as the option it came from, before any model loads
        except ValueError as err:
            raise ProtocolError(f"protocol 'geneval': {err}") from None
        self.reward = _registered_reward(self.name, "geneval", device, options)

    def load_records(self, source, prompt_kwargs=None) -> list[PromptRecord]:
        """The checked GenEval records of `source`: a metadata .jsonl file (errors name its line), or any prompt
        source whose records carry GenEval metadata. Checked against the detector's vocabulary too, before any
        model loads."""
        if isinstance(source, str) and source.endswith(".jsonl") and os.path.isfile(source):
            records = read_metadata(source)
        else:
            loaded = load_prompts(source, **(prompt_kwargs or {}))
            records = [check_record({**r.metadata, "prompt": r.prompt}, f"{source}, record {i}")
                       for i, r in enumerate(loaded)]
        scorer = self.reward.scorer
        check_vocabulary(records, scorer.detector.classes, scorer.color_classifier.colors, str(source))
        return [PromptRecord(r["prompt"], {k: v for k, v in r.items() if k != "prompt"}) for r in records]

    def check_ready(self) -> None:
        self.reward.check_ready()

    def score(self, images, records) -> list[dict]:
        return self.reward.results(images, [r.prompt for r in records], [r.metadata for r in records])

    def summarize(self, results) -> dict:
        """GenEval's table (protocol.summarize) plus Flow-GRPO's measures of the same images: the mean partial
        score and the fraction strictly correct."""
        summary = summarize(results)
        summary["flow_grpo"] = {"partial_score": float(np.mean([r["partial_score"] for r in results])),
                                "strict_accuracy": float(np.mean([r["strict_correct"] for r in results]))}
        return summary

    def format(self, summary) -> str:
        text = format_table(summary)
        if "flow_grpo" in summary:
            text += (f"\nFlow-GRPO's partial score {summary['flow_grpo']['partial_score']:.4f}, strict accuracy "
                     f"{summary['flow_grpo']['strict_accuracy']:.4f}")
        return text


class RewardMeanProtocol:
    """The mean of one registered reward over the images, with each image's value (and its info numbers)."""

    images_per_prompt = 4

    def __init__(self, reward: str, device=None, **options):
        self.name = reward
        self.options = options
        self.reward = _registered_reward(reward, reward, device, options)

    def load_records(self, source, prompt_kwargs=None) -> list[PromptRecord]:
        """The prompt records of `source`, checked by the reward's own prompt check (``check_prompts``, as the
        config check runs it in training: the ocr reward's quoted text) before any model loads."""
        records = load_prompts(source, **(prompt_kwargs or {}))
        check = getattr(self.reward, "check_prompts", None)
        if check is not None:
            try:
                check(records, source=str(source), **self.options)
            except ValueError as err:
                raise ProtocolError(" ".join(str(err).split())) from None
        return records

    def check_ready(self) -> None:
        if hasattr(self.reward, "check_ready"):
            self.reward.check_ready()

    def score(self, images, records) -> list[dict]:
        rewards, info = self.reward(images, [r.prompt for r in records], [r.metadata for r in records])
        rewards = np.asarray(torch.as_tensor(rewards, dtype=torch.float64).cpu())
        results = []
        for n, record in enumerate(records):
            row = {"prompt": record.prompt, "reward": float(rewards[n])}
            for key, value in (info or {}).items():
                value = np.asarray(value)
                if value.ndim == 1 and len(value) == len(records) and np.issubdtype(value.dtype, np.number):
                    row[key] = float(value[n])
            results.append(row)
        return results

    def summarize(self, results) -> dict:
        values = np.array([r["reward"] for r in results])
        prompts = {}
        for r in results:
            prompts.setdefault(r["prompt"], []).append(r["reward"])
        return {"reward": self.name, "mean": float(values.mean()), "std": float(values.std()),
                "num_images": len(results), "num_prompts": len(prompts)}

    def format(self, summary) -> str:
        return (f"mean {summary['reward']} {summary['mean']:.4f} (std {summary['std']:.4f}) over "
                f"{summary['num_images']} images of {summary['num_prompts']} prompts")


register_protocol("geneval", GenEvalProtocol)
register_protocol("geneval2", GenEval2Protocol)
register_protocol("ocr", lambda device=None, **options: RewardMeanProtocol("ocr", device=device, **options))


@torch.no_grad()
def score_policy(protocol, policy, records, images_per_prompt, num_steps, guidance_scale, eta, seed=1234,
                 batch_size=32, keep_images=False):
    """Per-image results of `images_per_prompt` fixed-noise images of every record (ddpo_group.evaluation.evaluator's
    noise), each with "prompt_index" and "image_index"; with keep_images, also the images (P, J, H, W, 3) uint8.
    Images that are not finite stop it (SamplesNotFiniteError naming the first), as they stop training."""
    pairs = [(i, j) for i in range(len(records)) for j in range(images_per_prompt)]
    results, kept = [], {}
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        generators = [sample_generator(seed, i, j) for i, j in chunk]
        batch = policy.sample([records[i].prompt for i, _ in chunk], num_steps, guidance_scale, eta, generator=generators)
        images = batch.images.float().cpu()
        error = not_finite_error(records, chunk, torch.isfinite(images.flatten(1)).all(dim=1).tolist())
        if error is not None:
            raise error
        for (i, j), row in zip(chunk, protocol.score(images, [records[i] for i, _ in chunk])):
            results.append({"prompt_index": i, "image_index": j, **row})
        if keep_images:
            pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
            kept.update({pair: pixels[n] for n, pair in enumerate(chunk)})
    if not keep_images:
        return results, None
    return results, np.stack([np.stack([kept[(i, j)] for j in range(images_per_prompt)]) for i in range(len(records))])


_FOLDER_RE, _SAMPLE_RE = re.compile(r"^\d+$"), re.compile(r"^\d+\.png$")


def read_geneval_folder(path: str):
    """(records, images) of a folder in GenEval's layout: PATH/<NNNNN>/metadata.jsonl (the prompt's record) and
    PATH/<NNNNN>/samples/<NNNN>.png; images: a list (one per record) of lists of uint8 (H, W, 3), any sizes.
    Every numbered entry must be a prompt folder with its metadata.jsonl (GenEval's evaluate_images.py fails on
    one without), every NNNN.png a regular file PIL reads: one-line errors naming the folder or file."""
    if not os.path.isdir(path):
        raise ProtocolError(f"--images {path}: no such directory; give a folder in GenEval's layout "
                            "(NNNNN/metadata.jsonl, NNNNN/samples/NNNN.png)")
    records, images = [], []
    for name in sorted((n for n in os.listdir(path) if _FOLDER_RE.match(n)), key=int):
        folder = os.path.join(path, name)
        metadata = os.path.join(folder, "metadata.jsonl")
        if not os.path.isdir(folder):
            raise ProtocolError(f"--images {path}: {folder} is not a folder; in GenEval's layout every numbered entry "
                                "is a prompt's folder (NNNNN/metadata.jsonl, NNNNN/samples/NNNN.png): move it away")
        if not os.path.isfile(metadata):  # a regular file only: a FIFO would block the read
            raise ProtocolError(f"--images {path}: the prompt folder {folder} has no metadata.jsonl (its GenEval "
                                "record); write it, or move the folder away")
        text = read_utf8(metadata, GenEvalFormatError).strip()  # not UTF-8: the file, the line and the byte
        try:
            record = check_record(json.loads(text), metadata)
        except json.JSONDecodeError as exc:
            raise GenEvalFormatError(f"{metadata}: invalid JSON ({exc.msg}); one GenEval record") from None
        samples = os.path.join(folder, "samples")
        files = sorted(n for n in os.listdir(samples) if _SAMPLE_RE.match(n)) if os.path.isdir(samples) else []
        if not files:
            raise ProtocolError(f"{samples}: no NNNN.png images for the prompt {record['prompt']!r}")
        records.append(PromptRecord(record["prompt"], {k: v for k, v in record.items() if k != "prompt"}))
        images.append([_read_image(os.path.join(samples, n)) for n in files])
    if not records:
        raise ProtocolError(f"--images {path}: no NNNNN/metadata.jsonl folders in it (GenEval's layout)")
    return records, images


def _read_image(path: str) -> np.ndarray:
    """uint8 (H, W, 3) of an image file; ProtocolError naming it when it is no regular file or PIL refuses it (a
    decompression bomb: PIL's pixel limit)."""
    from PIL import Image

    if not os.path.isfile(path):
        raise ProtocolError(f"{path}: not a regular file; GenEval's samples are NNNN.png image files")
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ProtocolError(f"{path}: cannot be read as an image ({type(err).__name__}: "
                            f"{' '.join(str(err).split())[:200]})") from None


def score_folder(protocol, records, images, batch_size=32) -> list[dict]:
    """Per-image results of the images of each record (uint8 (H, W, 3) each, a sequence per record). Images of
    different sizes go to the protocol in separate batches (GenEval scores each image on its own)."""
    pairs = [(i, j) for i, stack in enumerate(images) for j in range(len(stack))]
    results, start = [], 0
    while start < len(pairs):
        shape = images[pairs[start][0]][pairs[start][1]].shape
        chunk = [pairs[start]]
        for i, j in pairs[start + 1 : start + batch_size]:
            if images[i][j].shape != shape:
                break
            chunk.append((i, j))
        start += len(chunk)
        pixels = torch.from_numpy(np.stack([images[i][j] for i, j in chunk])).permute(0, 3, 1, 2).float() / 255
        for (i, j), row in zip(chunk, protocol.score(pixels, [records[i] for i, _ in chunk])):
            results.append({"prompt_index": i, "image_index": j, **row})
    return results


def save_geneval_folder(path: str, records, images) -> None:
    """Write images (P, J, H, W, 3) uint8 in GenEval's layout for its own evaluate_images.py; `path` must not
    exist or be empty."""
    from PIL import Image

    check_new_folder(path)
    for i, (record, stack) in enumerate(zip(records, images)):
        samples = os.path.join(path, f"{i:05d}", "samples")
        os.makedirs(samples, exist_ok=True)
        with open(os.path.join(path, f"{i:05d}", "metadata.jsonl"), "w", encoding="utf-8") as f:
            f.write(json.dumps({**record.metadata, "prompt": record.prompt}) + "\n")
        for j, image in enumerate(stack):
            Image.fromarray(image).save(os.path.join(samples, f"{j:04d}.png"))


def check_new_folder(path: str) -> None:
    """ProtocolError unless `path` is new or an empty directory (images are never written over others)."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ProtocolError(f"--save-images {path}: exists and is not an empty directory; give a new directory")


def results_path(summary_path: str) -> str:
    """The per-image results file beside a summary JSON: NAME.json -> NAME_images.jsonl."""
    return os.path.splitext(summary_path)[0] + "_images.jsonl"


def write_protocol_results(path: str, summary: dict, results: list[dict]) -> str:
    """The summary as JSON at `path` and the per-image results as JSON lines beside it (atomically, each);
    returns the results path."""
    lines = results_path(path)
    tmp = lines + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in results:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, lines)
    write_json_atomic(path, summary)
    return lines


def parse_options(pairs) -> dict:
    """--protocol-option KEY=VALUE pairs -> {KEY: VALUE}, VALUE read as JSON when it parses (numbers, true),
    else as a string."""
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ProtocolError(f"--protocol-option {pair!r}: expected KEY=VALUE, e.g. detector=shapes")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options

