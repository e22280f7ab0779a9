"""The OCR (text-rendering) reward of Flow-GRPO, registered as ``ocr``: how much of the prompt's quoted text an
OCR engine reads back from the image.

For a prompt p and an image x, with t = target(p) and o = the recognised text of x, both lower-cased with every
space removed (norm(s) = s.replace(" ", "").lower()):

    d(t, o) = 0                               if norm(t) is a substring of norm(o)
            = min(Lev(norm(o), norm(t)), |norm(t)|)   otherwise
    r       = 1 - d / |norm(t)|               in [0, 1]

Lev is the Levenshtein edit distance (insertions, deletions, substitutions, each 1), computed by ``rapidfuzz``
(the C++ library that python-Levenshtein, Flow-GRPO's choice, is itself built on; the same numbers). The cap
makes an image full of unrelated text cost no more than an image with none (both r = 0).

target(p): the metadata field ``ocr_text`` when the prompt record has one (a .jsonl prompt file may give the text
apart from the prompt); else the first double-quoted span, p.split('"')[1] (so an unclosed quote runs to the end
of the prompt, as in Flow-GRPO); else the first single-quoted span, '...' opening and closing at a word boundary
(so the apostrophes of "don't" or "Joe's" open nothing); else, only with ``allow_unquoted=True``, the whole prompt.

Sources (read, not copied): yifan123/flow_grpo ``flow_grpo/ocr.py`` (OcrScorer: PaddleOCR 2.x, use_angle_cls=False,
lang "en"; ``prompt.split('"')[1]``, which raises on a prompt without quotes; the recognised lines of confidence > 0
joined without separator; an engine exception gives r = 0) and X-GenGroup/Flow-Factory ``rewards/ocr.py`` (the
same formula with PaddleOCR 3.x's ``predict`` and its ``rec_texts``; the whole prompt when it has no double
quote). The single-quote rule is this library's (issue 33). Differences, kept on purpose:
- A prompt set without quoted text is refused before any model loads (``check_prompts``: one line naming the
  prompt file and the first such prompt's line), unless ``allow_unquoted=True`` accepts the whole-prompt target:
  scoring "a poster of a cat" against the text on the poster rewards writing the prompt into the image, which is
  rarely the task the user meant. A quoted span that is empty after normalisation (``""``) is refused the same way
  (Flow-GRPO divides by zero there).
- An engine that raises is an error of the run (RewardError naming the prompt), not a silent r = 0: a broken OCR
  install would otherwise train towards nothing. An engine that reads nothing gives o = "" and r = 0.

Engines, behind one interface (``Recogniser``: ``load()``, ``read(images) -> list[str]``), chosen by ``engine``:
- ``"got_ocr2"`` (default): GOT-OCR 2.0 through transformers (``GotOcr2ForConditionalGeneration`` with its
  ``AutoProcessor``; ``model`` default "stepfun-ai/GOT-OCR-2.0-hf"), plain-text OCR, greedy decoding.
  Needs only the core dependencies (transformers) and the weights.
- ``"paddleocr"``: Flow-GRPO's engine (``pip install "ddpo-group[paddle]"``: paddleocr, plus a paddlepaddle build
  for the machine: https://www.paddlepaddle.org.cn/install). PaddleOCR 3.x's ``predict`` (``rec_texts``); with
  PaddleOCR 2.x, its ``ocr(image, cls=False)`` and Flow-GRPO's confidence > 0 filter.

The edit distance needs ``rapidfuzz`` (``pip install "ddpo-group[ocr]"``): an optional extra, since only this
reward uses it and a reward needs an OCR engine anyway; its absence is one line from ``check_ready``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import threading

import numpy as np
import torch

from ddpo_group.rewards.base import RewardError, RewardNotReadyError, register_reward, to_pil_images

OCR_INSTALL = 'pip install "ddpo-group[ocr]"  (or: pip install rapidfuzz)'
PADDLE_INSTALL = ('pip install "ddpo-group[paddle]"  (paddleocr; and a paddlepaddle build for this machine: '
                  'https://www.paddlepaddle.org.cn/install)')
GOT_OCR2_MODEL = "stepfun-ai/GOT-OCR-2.0-hf"
TARGET_FIELD = "ocr_text"  # a prompt record's metadata field that gives the target text apart from the prompt

# A single-quoted span: the quote opens where no word character precedes it and closes where none follows.
_SINGLE_QUOTED = re.compile(r"(?<!\w)'([^']*)'(?!\w)")


def normalise_text(text: str) -> str:
    """Flow-GRPO's comparison form: every space removed, lower case ("Hello World" -> "helloworld")."""
    return text.replace(" ", "").lower()


def quoted_text(prompt: str) -> str | None:
    """The prompt's first double-quoted span (p.split('"')[1], Flow-GRPO's rule), else its first single-quoted
    span (opening and closing at word boundaries), else None. Not normalised."""
    if '"' in prompt:
        return prompt.split('"')[1]
    match = _SINGLE_QUOTED.search(prompt)
    return match.group(1) if match else None


def target_text(prompt: str, metadata: dict | None = None, allow_unquoted: bool = False) -> str | None:
    """The text the image should show (module docstring: metadata ``ocr_text``, quotes, whole prompt), not
    normalised; None when the prompt has none and allow_unquoted is False. ValueError naming the field when
    metadata gives ``ocr_text`` that is not a string (a JSON number would otherwise be ignored silently)."""
    if metadata and metadata.get(TARGET_FIELD) is not None:
        text = metadata[TARGET_FIELD]
        if not isinstance(text, str):
            raise ValueError(f"field '{TARGET_FIELD}' must be a string (the text to render), got {text!r}; quote it "
                             f"in the prompt file, e.g. \"{TARGET_FIELD}\": \"{text}\"")
        return text
    quoted = quoted_text(prompt)
    if quoted is None and allow_unquoted:
        return prompt
    return quoted


def _levenshtein():
    try:
        from rapidfuzz.distance import Levenshtein
    except ImportError as exc:
        raise RewardNotReadyError(f"reward 'ocr' needs the edit-distance package rapidfuzz ({exc}); install it: "
                                  f"{OCR_INSTALL}", reward="ocr") from exc
    return Levenshtein


def ocr_distance(target: str, recognised: str) -> int:
    """d = 0 if norm(target) is a substring of norm(recognised), else min(Lev(norm(recognised), norm(target)),
    |norm(target)|) (module docstring). ValueError when norm(target) is empty."""
    target, recognised = normalise_text(target), normalise_text(recognised)
    if not target:
        raise ValueError("the OCR target text is empty after removing spaces; nothing to read back")
    if target in recognised:
        return 0
    return min(int(_levenshtein().distance(recognised, target)), len(target))


def ocr_reward(target: str, recognised: str) -> float:
    """r = 1 - d(target, recognised) / |norm(target)|, in [0, 1] (module docstring)."""
    return 1.0 - ocr_distance(target, recognised) / len(normalise_text(target))


# the recognisers -------------------------------------------------------------------------------------------------
class Recogniser:
    """An OCR engine: ``load()`` imports and loads it (RewardNotReadyError saying what to install or set), then
    ``read(images)`` -> one recognised string per PIL image (lines joined without separator: spaces are dropped
    by the comparison anyway)."""

    name = "recogniser"

    def load(self) -> None:
        raise NotImplementedError

    def read(self, images) -> list[str]:
        raise NotImplementedError


def paddle_texts(result) -> str:
    """The recognised text of one image from PaddleOCR's answer, lines joined in reading order.

    PaddleOCR 3.x ``predict``: a list of result objects, each a mapping with ``rec_texts`` (list of str);
    PaddleOCR 2.x ``ocr``: [[box, (text, confidence)], ...] for the image (or None when nothing is found),
    of which Flow-GRPO keeps the lines of confidence > 0."""
    if result is None:
        return ""
    texts = []
    for item in result:
        if item is None:
            continue
        if hasattr(item, "get") and item.get("rec_texts") is not None:  # 3.x: OCRResult is a dict subclass
            texts.extend(str(text) for text in item["rec_texts"])
        elif isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], (list, tuple)):  # 2.x line
            text, confidence = item[1][0], float(item[1][1])
            if confidence > 0:
                texts.append(str(text))
        else:
            raise RewardError(f"reward 'ocr': PaddleOCR answered in a form this reward does not know: "
                              f"{str(item)[:200]}", reward="ocr")
    return "".join(texts)


class PaddleOCRRecogniser(Recogniser):
    """PaddleOCR (Flow-GRPO's engine), English, no orientation / unwarping models (Flow-GRPO: use_angle_cls=False;
    Flow-Factory: the three use_* switches off). ``device``: "cpu", "gpu" or "gpu:N" (PaddleOCR's own names)."""

    name = "paddleocr"

    def __init__(self, device: str | None = None, lang: str = "en"):
        self.device, self.lang, self.ocr = device, lang, None

    def load(self) -> None:
        if self.ocr is not None:
            return
        try:
            paddleocr = importlib.import_module("paddleocr")
        except ImportError as exc:
            raise RewardNotReadyError(f"reward 'ocr' with engine='paddleocr' needs the paddleocr package ({exc}); "
                                      f"install it: {PADDLE_INSTALL}", reward="ocr") from exc
        try:  # 2.x (Flow-GRPO pins 2.9.1) and 3.x take different switches
            version = int(importlib.metadata.version("paddleocr").split(".")[0])
        except (importlib.metadata.PackageNotFoundError, ValueError):
            version = 3
        try:
            if version >= 3:
                kwargs = dict(use_doc_orientation_classify=False, use_doc_unwarping=False,
                              use_textline_orientation=False, lang=self.lang)
                if self.device:
                    kwargs["device"] = self.device
                self.ocr = paddleocr.PaddleOCR(**kwargs)
            else:
                self.ocr = paddleocr.PaddleOCR(use_angle_cls=False, lang=self.lang, show_log=False,
                                               use_gpu=bool(self.device and self.device.startswith("gpu")))
        except Exception as exc:
            raise RewardNotReadyError(
                f"reward 'ocr': PaddleOCR could not load its models ({type(exc).__name__}: {exc}); run it once "
                "online to download them, or use engine='got_ocr2'", reward="ocr") from exc

    def read(self, images) -> list[str]:
        out = []
        for image in images:
            array = np.asarray(image.convert("RGB"))
            if hasattr(self.ocr, "predict"):
                out.append(paddle_texts(self.ocr.predict(array)))
            else:
                result = self.ocr.ocr(array, cls=False)
                out.append(paddle_texts(result[0] if result else None))
        return out


class GotOcr2Recogniser(Recogniser):
    """GOT-OCR 2.0 through transformers: plain-text OCR of each image, greedy, at most ``max_new_tokens`` tokens.

    ``model``: a hub id or local directory of the -hf checkpoint (processor and weights); ``dtype`` of the weights
    (bfloat16 on a GPU is GOT's own setting; float32 on a CPU)."""

    name = "got_ocr2"

    def __init__(self, model: str = GOT_OCR2_MODEL, device=None, dtype: str | torch.dtype = "auto",
                 max_new_tokens: int = 512, batch_size: int = 8):
        self.model_spec, self.max_new_tokens, self.batch_size = model, int(max_new_tokens), int(batch_size)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if dtype == "auto":
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = self.processor = None

    def load(self) -> None:
        if self.model is not None:  # loaded, or given with set_model
            return
        from transformers import AutoProcessor, GotOcr2ForConditionalGeneration

        from ddpo_group.rewards.clip_models import check_reward_hub

        check_reward_hub(self.model_spec, "ocr", "model")
        try:
            processor = AutoProcessor.from_pretrained(self.model_spec)
            model = GotOcr2ForConditionalGeneration.from_pretrained(self.model_spec, dtype=self.dtype)
        except (OSError, ValueError) as exc:  # not found / no processor files in the directory
            raise RewardNotReadyError(
                f"reward 'ocr': cannot load GOT-OCR 2.0 from {self.model_spec!r} ({' '.join(str(exc).split())[:300]}); "
                "run once online to download it, or set the reward's keyword argument model=/path/to/GOT-OCR-2.0-hf "
                "(config: reward_kwargs.ocr.model)", reward="ocr") from exc
        self.set_model(model, processor)

    def set_model(self, model, processor) -> None:
        """Use an already built GOT-OCR2 model and its processor (what ``load`` does after from_pretrained)."""
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.processor = processor

    @torch.no_grad()
    def read(self, images) -> list[str]:
        texts = []
        tokenizer = self.processor.tokenizer
        for start in range(0, len(images), self.batch_size):
            chunk = images[start : start + self.batch_size]
            inputs = self.processor(chunk, return_tensors="pt").to(self.device)
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
            generated = self.model.generate(
                **inputs, do_sample=False, max_new_tokens=self.max_new_tokens,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
            )
            new_tokens = generated[:, inputs["input_ids"].shape[1]:].cpu()
            texts.extend(self.processor.batch_decode(new_tokens, skip_special_tokens=True))
        return texts


ENGINES = {"got_ocr2": GotOcr2Recogniser, "paddleocr": PaddleOCRRecogniser}


# the reward ------------------------------------------------------------------------------------------------------
@register_reward("ocr")
class OcrReward:
    """r = 1 - d(target, OCR(image)) / |target| (module docstring), one value in [0, 1] per image.

    engine: "got_ocr2" (default) or "paddleocr"; model: GOT-OCR2 checkpoint (got_ocr2 only); allow_unquoted:
    score a prompt without quotes against the whole prompt instead of refusing the prompt set;
    max_new_tokens: GOT-OCR2's generation length. info: ``exact`` (share of images with d = 0) and
    ``recognised_chars`` (mean length of the normalised recognised text).
    """

    def __init__(self, engine: str = "got_ocr2", model: str = GOT_OCR2_MODEL, allow_unquoted: bool = False,
                 max_new_tokens: int = 512, device=None, dtype: str = "auto"):
        if engine not in ENGINES:
            raise ValueError(f"reward 'ocr': engine={engine!r} is not one of {sorted(ENGINES)} "
                             "(config: reward_kwargs.ocr.engine)")
        self.engine, self.allow_unquoted = engine, bool(allow_unquoted)
        if engine == "got_ocr2":
            self.recogniser = GotOcr2Recogniser(model, device=device, dtype=dtype, max_new_tokens=max_new_tokens)
        else:
            index = getattr(torch.device(device), "index", None) if device is not None else None
            paddle_device = None if device is None else ("cpu" if torch.device(device).type == "cpu"
                                                         else f"gpu:{index or 0}")
            self.recogniser = PaddleOCRRecogniser(device=paddle_device)
        self._ready = False
        self._lock = threading.Lock()

    @classmethod
    def check_prompts(cls, prompts, source: str = "", allow_unquoted: bool = False, **_) -> None:
        """ValueError naming `source` (the prompt file) and the first prompt with no target text (no quotes and
        not allow_unquoted) or an empty one. `prompts`: PromptRecords or strings."""
        for number, record in enumerate(prompts, start=1):
            prompt = getattr(record, "prompt", record)
            metadata = getattr(record, "metadata", None)
            try:
                target = target_text(prompt, metadata, allow_unquoted)
            except ValueError as err:
                raise ValueError(f"reward 'ocr': {_where(source, prompt, number)}: {err}") from None
            if target is not None and normalise_text(target):
                continue
            where = _where(source, prompt, number)
            if target is None:
                raise ValueError(
                    f"reward 'ocr': {where} has no quoted text to render ({prompt!r}); an OCR prompt names its text "
                    "in double (or single) quotes, e.g. 'a sign that says \"open\"'. Fix the prompt file, or set "
                    "reward_kwargs.ocr.allow_unquoted=True to score the whole prompt as the text")
            raise ValueError(f"reward 'ocr': {where}'s quoted text is empty ({prompt!r}); quote the text to render")

    def check_ready(self) -> None:
        with self._lock:
            if self._ready:
                return
            _levenshtein()
            self.recogniser.load()
            self._ready = True

    def targets(self, prompts, metadata) -> list[str]:
        out = []
        for i, prompt in enumerate(prompts):
            try:
                target = target_text(prompt, metadata[i] if metadata else None, self.allow_unquoted)
            except ValueError as err:
                raise RewardError(f"reward 'ocr': prompt {prompt!r}: {err}", reward="ocr", index=i,
                                  prompt=prompt) from None
            if target is None or not normalise_text(target):
                raise RewardError(
                    f"reward 'ocr': prompt {prompt!r} has no quoted text to render (reward_kwargs.ocr.allow_unquoted"
                    "=True scores the whole prompt)", reward="ocr", index=i, prompt=prompt)
            out.append(target)
        return out

    def __call__(self, images, prompts, metadata):
        targets = self.targets(prompts, metadata)  # before the engine runs: a bad prompt costs no OCR
        self.check_ready()
        recognised = self.recogniser.read(to_pil_images(images))
        distances = np.array([ocr_distance(t, o) for t, o in zip(targets, recognised)], dtype=np.float64)
        lengths = np.array([len(normalise_text(t)) for t in targets], dtype=np.float64)
        info = {"exact": (distances == 0).astype(np.float64),
                "recognised_chars": np.array([len(normalise_text(o)) for o in recognised], dtype=np.float64)}
        return 1.0 - distances / lengths, info


def _where(source: str, prompt: str, number: int) -> str:
    """'prompt file F, line N' when `source` is a text file with the prompt as a line of its own, else 'prompt N
    of F' (N counts the prompts, not the lines: a .json / .jsonl record, or a prompt set that is no file)."""
    if source and os.path.isfile(source):
        try:
            with open(source, encoding="utf-8-sig") as f:
                for lineno, line in enumerate(f, start=1):
                    if line.strip() == prompt:
                        return f"prompt file {source!r}, line {lineno}"
        except (OSError, UnicodeDecodeError):
            pass
    return f"prompt {number} of {source!r}" if source else f"prompt {number}"
