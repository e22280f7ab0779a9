"""GenEval 2 (Kamath et al., arXiv 2512.16853; facebookresearch/GenEval2) scored with Soft-TIFA, as the protocol
``geneval2`` of ``scripts/evaluate.py --protocol geneval2 --prompts geneval2_data.jsonl``.

Records: the user's copy of GenEval 2's ``geneval2_data.jsonl`` (nothing is fetched), one JSON object a line:

    {"prompt": "four white bicycles in front of three plastic cows", "atom_count": 7,
     "vqa_list": [["How many bicycles are in the image?", "four"], ["Are the bicycles white?", "Yes"], ...],
     "skills": ["count", "attribute", ...]}

``vqa_list``: one [question, answer] pair per atom (non-empty strings); ``skills``: the category of each pair (same
length; GenEval 2's are object, attribute, count, position, verb); ``atom_count``: the prompt's atomicity, a whole
number >= 1 (GenEval 2 asks about "a" too, so the list can be one longer than the count). Blank lines are skipped;
anything else wrong stops with one line naming the file and line.

Soft-TIFA, per image x of a prompt with atoms (q_k, a_k), k = 1..K:

    s_k = P_VQA(a_k | x, q_k + " Answer in one word.")          the soft score of atom k, in [0, 1]
    AM(x) = (1/K) sum_k s_k                                     Soft-TIFA AM: atom-level
    GM(x) = (prod_k s_k)^(1/K)    (0 when any s_k is 0)         Soft-TIFA GM: prompt-level

P_VQA(a | x, q) is the probability the VQA model gives to the correct answer as its first generated token (one
token, temperature 0): the sum of exp(log-prob) over the distinct listed tokens t whose stripped text is a form of a:
a itself, lower-case, capitalised, and for a number its other spelling ("four" <-> "4", zero to ten), so " Yes",
"yes" and "Yes" all count for "Yes". An endpoint lists its top ``top_logprobs`` (20) tokens: a correct answer not
among them has probability below the smallest listed and counts 0. The in-process judge adds the exact log-prob of
every form that is one token of its tokenizer. The sum is clipped to 1.

The table (every number a fraction in [0, 1]; the paper prints them x 100):

- ``soft_tifa_am``, ``soft_tifa_gm``: the mean of AM(x) and of GM(x) over all images (every prompt has the same
  number of images, so this is also the mean over prompts of their images' mean);
- ``skills``: per category, the mean s_k over every atom of that category in every image (the paper's per-skill
  analysis, atom level, Soft-TIFA AM), with its atom count;
- ``atomicity``: per ``atom_count``, the mean GM(x) over the images of prompts of that atomicity (the paper's
  per-atomicity analysis, prompt level, Soft-TIFA GM), with its image count.

Each image's row (the per-image JSONL) carries its ``atom_scores``, ``soft_tifa_am``, ``soft_tifa_gm``.

Judge options (``--protocol-option KEY=VALUE``) are the ``vlm_judge`` reward's transport options (rewards/judge.py):
backend (endpoint | transformers), url, model, api_key, timeout, retries, concurrency, top_logprobs, image_size,
dtype; plus ``question_template`` (default "{question} Answer in one word.").
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from ddpo_group.data.prompts import PromptRecord, jsonl_items
from ddpo_group.rewards.base import RewardError, RewardNotReadyError, to_pil_images

QUESTION_TEMPLATE = "{question} Answer in one word."
JUDGE_OPTIONS = ("backend", "url", "model", "api_key", "timeout", "retries", "concurrency", "top_logprobs",
                 "image_size", "dtype")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
RECORD_FORMAT = ('one JSON object a line: {"prompt": str, "atom_count": int >= 1, "vqa_list": [[question, answer], '
                 '...], "skills": [str per pair]} (GenEval 2\'s geneval2_data.jsonl)')


class GenEval2Error(ValueError):
    """A GenEval 2 evaluation that cannot run as asked: a bad option, or a records file that cannot be read (the
    message names the file and line). protocols.py registers this protocol (this module imports nothing of it)."""


def answer_forms(answer: str) -> set[str]:
    """The texts a first token may have (once stripped) to be the answer `answer` (module docstring)."""
    answer = answer.strip()
    spellings = {answer}
    lower = answer.lower()
    if lower in NUMBER_WORDS:
        spellings.add(str(NUMBER_WORDS.index(lower)))
    elif answer.isdigit() and int(answer) < len(NUMBER_WORDS):
        spellings.add(NUMBER_WORDS[int(answer)])
    return {form for s in spellings for form in (s, s.lower(), s.capitalize())}


def answer_probability(top_logprobs: dict[str, float] | None, answer: str) -> float | None:
    """P(answer): the sum of exp(lp) over the distinct listed tokens whose stripped text is a form of the answer,
    clipped to 1; 0 when none is listed; None when nothing is listed at all (no log-probs: unscorable)."""
    if not top_logprobs:
        return None
    forms = answer_forms(answer)
    total = sum(math.exp(lp) for token, lp in top_logprobs.items()
                if lp is not None and lp > -math.inf and token.strip() in forms)
    return min(total, 1.0)


def geometric_mean(scores) -> float:
    """(prod s_k)^(1/K), 0 when any s_k is 0."""
    scores = np.asarray(scores, dtype=np.float64)
    if (scores <= 0).any():
        return 0.0
    return float(np.exp(np.log(scores).mean()))


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_record(record, where: str) -> dict:
    """`record` if it is a GenEval 2 record, else a one-line GenEval2Error naming `where` and the field."""
    def bad(what):
        return GenEval2Error(f"{where}: {what}; {RECORD_FORMAT}")

    if not isinstance(record, dict):
        raise bad(f"a JSON {type(record).__name__}, not an object")
    prompt, pairs, skills, count = (record.get(k) for k in ("prompt", "vqa_list", "skills", "atom_count"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad('"prompt" is missing or not a non-empty string')
    if not isinstance(pairs, list) or not pairs:
        raise bad('"vqa_list" is missing or not a non-empty list of [question, answer] pairs')
    for n, pair in enumerate(pairs):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) and p.strip() for p in pair)):
            raise bad(f'"vqa_list"[{n}] is {json.dumps(pair)[:80]}, not a [question, answer] pair of non-empty strings')
    if not (isinstance(skills, list) and len(skills) == len(pairs)
            and all(isinstance(s, str) and s.strip() for s in skills)):
        raise bad(f'"skills" is not a list of {len(pairs)} non-empty strings (one per "vqa_list" pair)')
    if not (_whole(count) and count >= 1):
        raise bad(f'"atom_count" is {json.dumps(count)[:40]}, not a whole number >= 1')
    return record


def read_records(path: str) -> list[PromptRecord]:
    """The checked records of a GenEval 2 .jsonl file, as PromptRecords (metadata: atom_count, vqa_list, skills)."""
    if not os.path.isfile(path):
        raise GenEval2Error(f"--prompts {path}: no such file; give your copy of GenEval 2's "
                                  "geneval2_data.jsonl (facebookresearch/GenEval2)")
    records = []
    for record, where in jsonl_items(path, GenEval2Error, f"; {RECORD_FORMAT}"):
        record = check_record(record, where)
        records.append(PromptRecord(record["prompt"], {"atom_count": record["atom_count"],
                                                        "vqa_list": record["vqa_list"], "skills": record["skills"]}))
    if not records:
        raise GenEval2Error(f"{path}: no records; {RECORD_FORMAT}")
    return records


class GenEval2Protocol:
    """GenEval 2 with Soft-TIFA (module docstring) through the VLM-judge transport."""

    name = "geneval2"
    images_per_prompt = 1  # GenEval 2 scores one image per prompt

    def __init__(self, device=None, question_template: str = QUESTION_TEMPLATE, **options):
        from ddpo_group.rewards.registry import get_reward  # the judge's module is imported by the registry alone

        unknown = sorted(set(options) - set(JUDGE_OPTIONS))
        if unknown:
            raise GenEval2Error(f"protocol 'geneval2': unknown option {unknown[0]!r}; options: "
                                f"{', '.join(JUDGE_OPTIONS + ('question_template',))}")
        if not (isinstance(question_template, str) and "{question}" in question_template):
            raise GenEval2Error(f"protocol 'geneval2': question_template={question_template!r} has no {{question}}; "
                                "e.g. question_template='{question} Answer in one word.'")
        self.question_template = question_template
        try:  # the judge's own checks of each option, one line naming it, before anything loads
            self.judge_reward = get_reward("vlm_judge", scoring="yes_no", device=device, **options)
        except ValueError as err:
            raise GenEval2Error(_as_option(err)) from None
        self.judge = self.judge_reward.judge
        self.where = self.judge_reward.where

    def load_records(self, source, prompt_kwargs=None) -> list[PromptRecord]:
        if not isinstance(source, str) or not source.endswith(".jsonl"):
            raise GenEval2Error(f"--prompts {source}: protocol 'geneval2' reads GenEval 2's records from a .jsonl "
                                "file (your copy of geneval2_data.jsonl)")
        return read_records(source)

    def check_ready(self) -> None:
        try:
            self.judge_reward.check_ready()
        except RewardNotReadyError as err:
            raise GenEval2Error(_as_option(err)) from None

    def question(self, question: str) -> str:
        return self.question_template.replace("{question}", question)

    def _atom_score(self, image, question: str, answer: str) -> float:
        text = self.question(question)
        if self.judge_reward.backend == "transformers":  # in-process: the exact log-prob of every one-token form too
            top = self.judge.next_token_logprobs(image, text, words=sorted(f for form in answer_forms(answer) for f in (form, " " + form)))
        else:
            top = self.judge.next_token_logprobs(image, text)
        value = answer_probability(top, answer)
        if value is None:
            raise RewardError(f"protocol 'geneval2' ({self.where}): the judge gave no log-probs of its first token "
                              f"for {text!r}; Soft-TIFA needs them (serve a model whose endpoint returns logprobs)",
                              reward="geneval2")
        return value

    def score(self, images, records) -> list[dict]:
        self.check_ready()  # once: the endpoint's models listed, or the model loaded
        pil = to_pil_images(images)
        if self.judge_reward.image_size:
            side = int(self.judge_reward.image_size)
            pil = [image.resize((side, side)) for image in pil]
        items = [(n, q, a) for n, record in enumerate(records) for q, a in record.metadata["vqa_list"]]
        scores = self.judge.map(lambda n, q, a: self._atom_score(pil[n], q, a), items)
        rows, start = [], 0
        for record in records:
            count = len(record.metadata["vqa_list"])
            atoms = [float(s) for s in scores[start : start + count]]
            start += count
            rows.append({"prompt": record.prompt, "atom_count": record.metadata["atom_count"],
                         "skills": list(record.metadata["skills"]), "atom_scores": atoms,
                         "soft_tifa_am": float(np.mean(atoms)), "soft_tifa_gm": geometric_mean(atoms)})
        return rows

    def summarize(self, results) -> dict:
        skills, atomicity = {}, {}
        for row in results:
            for skill, score in zip(row["skills"], row["atom_scores"]):
                skills.setdefault(skill, []).append(score)
            atomicity.setdefault(int(row["atom_count"]), []).append(row["soft_tifa_gm"])
        return {
            "soft_tifa_am": float(np.mean([r["soft_tifa_am"] for r in results])),
            "soft_tifa_gm": float(np.mean([r["soft_tifa_gm"] for r in results])),
            "skills": {s: {"score": float(np.mean(v)), "atoms": len(v)} for s, v in sorted(skills.items())},
            "atomicity": {str(k): {"score": float(np.mean(v)), "images": len(v)} for k, v in sorted(atomicity.items())},
            "num_images": len(results),
            "num_prompts": len({r.get("prompt_index", r["prompt"]) for r in results}),
        }

    def format(self, summary) -> str:
        lines = [f"GenEval 2 (Soft-TIFA), {summary['num_images']} images of {summary['num_prompts']} prompts",
                 f"Soft-TIFA AM (atom level)   {summary['soft_tifa_am']:.4f}",
                 f"Soft-TIFA GM (prompt level) {summary['soft_tifa_gm']:.4f}",
                 "", "| skill | Soft-TIFA AM | atoms |", "|---|---|---|"]
        lines += [f"| {s} | {v['score']:.4f} | {v['atoms']} |" for s, v in summary["skills"].items()]
        lines += ["", "| atomicity | Soft-TIFA GM | images |", "|---|---|---|"]
        lines += [f"| {k} | {v['score']:.4f} | {v['images']} |" for k, v in summary["atomicity"].items()]
        return "\n".join(lines)


def _as_option(err) -> str:
    """A judge error's words for this command: its config field is a --protocol-option here."""
    text = " ".join(str(err).split()).replace("config: reward_kwargs.vlm_judge.", "--protocol-option ")
    return f"protocol 'geneval2' judge: {text.replace('reward_kwargs.vlm_judge.', '--protocol-option ')}"

