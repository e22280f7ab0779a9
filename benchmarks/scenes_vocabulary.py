"""Which held-out prompts of the scenes world ask for a word its models were never shown?

docs/scenes.md, "Rung d on the flow base, and the words no caption teaches":

    python benchmarks/scenes_vocabulary.py --output benchmarks/results/scenes_vocabulary/shipped.json

The scenes models learn their text encoders from the world's captions alone: pretraining captions are the
training records' prompts (``scenes.sample_dataset`` draws from ``scenes.training_records``), and RL trains on
training records too. GenEval's held-out prompts are new compositions of words a web-trained text encoder knows; a
held-out prompt here whose token appears in no training prompt asks for a word no model of the world was taught.

For each model (a shipped scenes model's name or a pipeline folder; default the three shipped ones) and each of its
tokenizer / text-encoder pairs: the tokens of the held-out prompts that no training prompt has (``unseen``), the
held-out records holding one, per tag, and the norm of each such token's input embedding beside the mean norm of
the tokens the training prompts have (``seen``) and of the vocabulary's tokens no prompt of the world has
(``never_used``): a token embedding no caption trained stays where its initialisation put it. ``ceiling``: GenEval's
overall (the unweighted mean of the six tags) if every held-out record with an unseen word is judged wrong and
every other right, the best a model can score without guessing the untaught words.

Writes OUTPUT (JSON) and prints a table. Deterministic, seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from bench_outputs import BenchmarkError, fail  # noqa: E402

DEFAULT_MODELS = ("tiny-scenes-flow", "tiny-scenes", "tiny-scenes-sd3")
ENCODER_PAIRS = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"), ("tokenizer_3", "text_encoder_3"))
EMBEDDING_KEYS = ("text_model.embeddings.token_embedding.weight", "embeddings.token_embedding.weight", "shared.weight",
                  "encoder.embed_tokens.weight")


def unseen_records(held_out: list[dict], training_prompts: list[str], tokenize) -> dict:
    """{"unseen": sorted tokens of held-out prompts that no training prompt has, "records": {tag: [prompts with one]},
    "per_tag": {tag: how many held-out records the tag has}, "seen": the training prompts' tokens} for
    `tokenize(prompt) -> list of tokens`."""
    seen = {token for prompt in training_prompts for token in tokenize(prompt)}
    unseen, records, per_tag = set(), {}, {}
    for record in held_out:
        per_tag[record["tag"]] = per_tag.get(record["tag"], 0) + 1
        missing = [token for token in tokenize(record["prompt"]) if token not in seen]
        if missing:
            unseen.update(missing)
            records.setdefault(record["tag"], []).append(record["prompt"])
    return {"unseen": sorted(unseen), "records": records, "per_tag": per_tag, "seen": seen}


def ceiling(records: dict, per_tag: dict) -> float:
    """GenEval's overall (the unweighted mean of the tags present) when every record in `records` is wrong and every
    other record of `per_tag` right."""
    shares = [1 - len(records.get(tag, [])) / n for tag, n in per_tag.items() if n]
    return sum(shares) / len(shares)


def _embedding(folder: str):
    """The input token embedding (a CPU float tensor) of a text-encoder folder, read from its safetensors."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(folder, "model.safetensors"))
    for key in EMBEDDING_KEYS:
        if key in weights:
            return weights[key].float()
    raise BenchmarkError(f"{folder}: no token embedding among {EMBEDDING_KEYS}")


def model_folder(model: str) -> str:
    """The pipeline folder of a shipped scenes model's name or of a folder; BenchmarkError naming --models if none."""
    from ddpo_group.diffusion.loading import SHIPPED_SCENES, shipped_dir

    if model in SHIPPED_SCENES:
        try:
            return str(shipped_dir(model))
        except ValueError as err:
            raise BenchmarkError(f"--models {model!r}: {err}") from None
    if not os.path.isfile(os.path.join(model, "model_index.json")):
        raise BenchmarkError(f"--models {model!r}: not a shipped scenes model ({', '.join(SHIPPED_SCENES)}) "
                             "nor a pipeline folder with model_index.json")
    return model


def measure(model: str, held_out: list[dict], training_prompts: list[str], world_prompts: list[str]) -> dict:
    """One model's encoders: the unseen tokens, their records, the embedding norms (module docstring)."""
    from transformers import AutoTokenizer

    folder = model_folder(model)
    encoders = {}
    for tokenizer_name, encoder_name in ENCODER_PAIRS:
        if not all(os.path.isdir(os.path.join(folder, name)) for name in (tokenizer_name, encoder_name)):
            continue
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, tokenizer_name))
        vocab = tokenizer.get_vocab()
        found = unseen_records(held_out, training_prompts, tokenizer.tokenize)
        world = {t for p in world_prompts for t in tokenizer.tokenize(p)} | found["seen"] | set(found["unseen"])
        missing = sorted(t for t in world if t not in vocab)
        if missing:  # tokenize() gives vocabulary tokens; a tokenizer that does not would be read wrong
            raise BenchmarkError(f"--models {model!r}: {tokenizer_name} tokenizes to {missing[:3]}, "
                                 "not in its vocabulary")
        norms = _embedding(os.path.join(folder, encoder_name)).norm(dim=1)
        used = {vocab[t] for t in world} | set(tokenizer.all_special_ids)
        never_used = [i for i in range(len(norms)) if i not in used]
        never = norms[never_used] if never_used else norms[:0]
        encoders[encoder_name] = {
            **{k: v for k, v in found.items() if k != "seen"},
            "ceiling": ceiling(found["records"], found["per_tag"]),
            "unseen_norms": {token: float(norms[vocab[token]]) for token in found["unseen"]},
            "seen_norm_mean": float(norms[sorted(vocab[t] for t in found["seen"])].mean()),
            "never_used_norm_mean": float(never.mean()) if len(never) else None,
            "never_used_norm_std": float(never.std()) if len(never) > 1 else None,
            "never_used_tokens": len(never_used),
        }
    if not encoders:
        raise BenchmarkError(f"--models {model!r}: {folder} has no tokenizer / text_encoder pair")
    return {"folder": os.path.relpath(folder, REPO_ROOT) if folder.startswith(REPO_ROOT) else folder,
            "encoders": encoders}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated shipped scenes model names or pipeline folders")
    parser.add_argument("--output", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    from ddpo_group.data.scenes import evaluation_prompts_path, training_records, world_records
    from ddpo_group.rewards.geneval.metadata import read_metadata
    from ddpo_group.runs.grids import save_json

    try:
        if not args.output.endswith(".json"):
            raise BenchmarkError(f"--output {args.output!r}: give a .json path")
        held_out = read_metadata(evaluation_prompts_path())
        training_prompts = [r["prompt"] for records in training_records(held_out).values() for r in records]
        world_prompts = [r["prompt"] for records in world_records().values() for r in records]
        models = {m: measure(m, held_out, training_prompts, world_prompts)
                  for m in (m.strip() for m in args.models.split(",")) if m}
    except BenchmarkError as err:
        fail(parser.prog, str(err))
    print(f"held-out records: {len(held_out)}; training prompts: {len(training_prompts)}")
    print(f"{'model / encoder':<34} {'unseen tokens (embedding norm)':<58} {'records, per tag':<24} "
          f"{'seen norm':>9} {'never-used norm (sd)':>20} {'ceiling':>8}")
    for model, result in models.items():
        for encoder, row in result["encoders"].items():
            tokens = ", ".join(f"{t} ({row['unseen_norms'][t]:.3f})" for t in row["unseen"]) or "-"
            per = ", ".join(f"{tag} {len(p)}/{row['per_tag'][tag]}" for tag, p in row["records"].items()) or "-"
            never = (f"{row['never_used_norm_mean']:.3f} (sd {row['never_used_norm_std']:.3f})"
                     if row["never_used_norm_std"] is not None else "-")
            print(f"{model + ' / ' + encoder:<34} {tokens:<58} {per:<24} {row['seen_norm_mean']:>9.3f} "
                  f"{never:>20} {row['ceiling']:>8.3f}")
    result = {"held_out": os.path.relpath(evaluation_prompts_path(), REPO_ROOT),
              "training_prompts": len(training_prompts), "models": models,
              "command": "python benchmarks/scenes_vocabulary.py " + shlex.join(sys.argv[1:] if argv is None else argv)}
    save_json(result, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
