"""A vision-language model as the judge of an image, registered as ``vlm_judge``: over an OpenAI-compatible
chat-completions endpoint (what vLLM and SGLang serve), or in-process through transformers.

Each image is asked one question: the ``template`` with "{prompt}" replaced by the image's prompt (a plain
replacement, so other braces in a template are kept), the image sent before the text as a base64 PNG data URL
(endpoint) or through the model's processor (in-process). Two scorings:

- ``scoring="score"``: the judge writes an answer; the reward is x / ``score_scale`` with x the first match of
  ``score_pattern`` (group 1) in it. Default: UnifiedReward's "Final Score: x" with x in 1-5, r = x / 5 in
  [0.2, 1] (yifan123/flow_grpo ``flow_grpo/rewards.py``, unifiedreward_score_sglang: temperature 0, the first
  match of ``Final Score:\\s*([1-5](?:\\.\\d+)?)``).
- ``scoring="yes_no"``: one token is generated (``max_tokens=1, logprobs=True, top_logprobs=20``, temperature 0);
  with lp(Yes) and lp(No) the log-probabilities of the tokens ``yes_token`` and ``no_token`` (a listed token
  counts when it equals them once surrounding spaces are stripped; several such tokens are summed in
  probability),

      r = sigmoid(lp(Yes) - lp(No)) = P(Yes) / (P(Yes) + P(No))          in (0, 1)

  (X-GenGroup/Flow-Factory ``rewards/vllm_evaluate.py``). An endpoint lists only the top 20 tokens. When exactly
  one of Yes / No is missing from them, ``missing_token="bound"`` (default) gives it the smallest listed
  log-prob, which its own is below: r is then an upper bound (Yes missing) or a lower bound (No missing) of the
  true value, the closest one the answer supports; ``missing_token="zero"`` gives it probability 0 (r = 0 or 1,
  Flow-Factory's rule). When both are missing the reply is unparsed. The in-process judge has the whole
  distribution: nothing is ever missing there.

A reply that cannot be scored (no score match, a score outside [score_min, score_max], no Yes / No) is
**unparsed**: it is counted (info ``unparsed``, per image 0 / 1, logged as its mean: the batch's fraction) and
logged (a warning with the reply; info ``unparsed_reply``: the first one, a string, kept out of metrics.jsonl),
and its reward is ``unparsed_reward``: "mean" (default) gives it the mean reward of the batch's parsed replies,
so that a judge's failure neither rewards nor punishes the image much (Flow-GRPO gives 0, which punishes it); a
number gives that number. More than ``max_unparsed_fraction`` of a batch unparsed (default 0.25; a batch is one
call of the reward), or all of it with "mean", stops the run with a RewardError quoting a reply: the template or
the pattern is wrong, not the images.

The endpoint (``backend="endpoint"``, the ``openai`` package: ``pip install "ddpo-group[judge]"``): ``url`` is
the API base ("http://host:8000/v1"), ``model`` the served model name (None: the endpoint must serve exactly one,
which is used). ``check_ready`` (before the first epoch) lists the served models (GET /v1/models): an endpoint
that does not answer, or does not serve ``model``, is a RewardNotReadyError of one line. Requests run
``concurrency`` at a time in daemon threads (a process whose run gave up on the reward exits without them), each
attempt with ``timeout`` seconds in all (connecting, sending and the whole reply: the remote reward client's
``bounded_exchange`` does the openai client's I/O) and ``retries`` retries with exponential backoff (the openai
client's: connection errors, timeouts, 408 / 409 / 429 / 5xx); a reply over MAX_RESPONSE_MB (16) is refused
unread past that. A request that still fails is a RewardError naming the URL (the run stops: a dead judge is no
reward). Every keyword is checked when the reward is built (one line naming reward_kwargs.vlm_judge.FIELD).

In-process (``backend="transformers"``): ``model`` is a hub id or directory of an image-text-to-text model
(``AutoModelForImageTextToText`` + ``AutoProcessor``, its chat template), e.g. "CodeGoat24/UnifiedReward-qwen-7b"
or "Qwen/Qwen2.5-VL-7B-Instruct"; greedy decoding of at most ``max_tokens`` tokens (score) or the next-token
log-softmax in float32 (yes_no; ``yes_token`` and ``no_token`` must each be one token of its tokenizer).
"""

from __future__ import annotations

import base64
import http.client
import importlib
import io
import logging
import math
import re
import threading
import urllib.parse

import numpy as np
import torch

from ddpo_group.rewards.base import RewardError, RewardNotReadyError, register_reward, to_pil_images
from ddpo_group.rewards.remote import MAX_RESPONSE_MB, AnswerTooLarge, bounded_exchange

logger = logging.getLogger(__name__)

JUDGE_INSTALL = 'pip install "ddpo-group[judge]"  (or: pip install openai)'
SCORINGS = ("score", "yes_no")
BACKENDS = ("endpoint", "transformers")
UNIFIED_REWARD_PATTERN = r"Final Score:\s*([1-5](?:\.\d+)?)"
# The default questions. To reproduce Flow-GRPO's UnifiedReward numbers, set `template` to the question of
# yifan123/flow_grpo flow_grpo/rewards.py (unifiedreward_score_sglang), with {prompt} where it puts the caption.
SCORE_TEMPLATE = (
    "Rate how well this generated image matches its caption and how good it looks (clarity, detail, colour, "
    "composition), on a scale from 1 (poor) to 5 (excellent). End your answer with 'Final Score: x', x in 1-5.\n"
    "Caption: {prompt}"
)
YES_NO_TEMPLATE = 'Does this image show "{prompt}", clearly and without visible defects? Answer Yes or No.'


def _real(value) -> bool:
    """A finite number (a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value) -> bool:
    """A whole number (an int, or a float without a fraction; a bool is not one)."""
    return _real(value) and float(value).is_integer()


# scoring: pure functions of a reply -------------------------------------------------------------------------------
def parse_score(reply: str | None, pattern: str = UNIFIED_REWARD_PATTERN, scale: float = 5.0,
                low: float = -math.inf, high: float = math.inf) -> float | None:
    """x / scale for x the first match (group 1) of `pattern` in `reply`; None when there is none, it is not a
    number, or x lies outside [low, high]."""
    if not reply:
        return None
    match = re.search(pattern, reply)
    if match is None:
        return None
    try:
        value = float(match.group(1))
    except (IndexError, ValueError):
        return None
    if not (math.isfinite(value) and low <= value <= high):
        return None
    return value / scale


def _token_logprob(top_logprobs: dict[str, float], token: str) -> float | None:
    """log sum exp of the log-probs of the listed tokens equal to `token` once stripped; None if none is."""
    values = [lp for t, lp in top_logprobs.items() if t.strip() == token and lp is not None and lp > -math.inf]
    if not values:
        return None
    peak = max(values)
    return peak + math.log(sum(math.exp(v - peak) for v in values))


def yes_no_reward(top_logprobs: dict[str, float] | None, yes_token: str = "Yes", no_token: str = "No",
                  missing_token: str = "bound") -> float | None:
    """sigmoid(lp(Yes) - lp(No)) from the first generated token's top log-probs {token: log-prob} (module
    docstring: one missing token bounded by the smallest listed log-prob, or given probability 0); None when
    both are missing or nothing is listed."""
    if not top_logprobs:
        return None
    yes, no = _token_logprob(top_logprobs, yes_token), _token_logprob(top_logprobs, no_token)
    if yes is None and no is None:
        return None
    if yes is None or no is None:
        if missing_token == "zero":
            return 0.0 if yes is None else 1.0
        floor = min(lp for lp in top_logprobs.values() if lp is not None and lp > -math.inf)
        yes, no = (floor if yes is None else yes), (floor if no is None else no)
    difference = yes - no
    if difference >= 0:  # the two forms of the sigmoid that never overflow
        return 1.0 / (1.0 + math.exp(-difference))
    return math.exp(difference) / (1.0 + math.exp(difference))


def image_data_url(image) -> str:
    """A PIL image as "data:image/png;base64,..." (lossless: the judge sees the 8-bit image the reward got)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


# the two judges: (image, question) -> a reply (text) or the first token's log-probs --------------------------------
def bounded_http_client(httpx, timeout: float, max_bytes: int):
    """An httpx client (of `httpx`, the module the openai client is built on: httpx, or httpx2) whose every request
    takes at most `timeout` s in all and whose answer is at most `max_bytes` bytes: remote.bounded_exchange, the
    remote reward client's attempt, does the I/O. httpx's own timeout bounds each read, so an endpoint that
    trickles its answer would hold a request for ever. Past the deadline: httpx's ReadTimeout (the openai client
    retries it); an answer over the limit: AnswerTooLarge (not an httpx error: raised through, or retried and
    wrapped by older openai clients)."""

    class BoundedTransport(httpx.BaseTransport):
        def handle_request(self, request):
            url = request.url
            connection = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
            headers = {key: value for key, value in request.headers.multi_items()
                       if key.lower() not in ("accept-encoding", "connection")}
            headers["Accept-Encoding"] = "identity"  # the byte limit is on what is kept, not on a compressed form
            conn = connection(url.host, url.port, timeout=timeout)
            try:
                response, data = bounded_exchange(conn, request.method, url.raw_path.decode("ascii"),
                                                  request.read() or None, headers, timeout, max_bytes)
            except TimeoutError as exc:
                raise httpx.ReadTimeout(f"no whole answer within {timeout:g} s", request=request) from exc
            except (OSError, http.client.HTTPException) as exc:
                raise httpx.ConnectError(f"{type(exc).__name__}: {exc}", request=request) from exc
            # http.client has undone the chunking; a content-encoding the server used anyway is left undecoded
            kept = [(key, value) for key, value in response.getheaders()
                    if key.lower() not in ("transfer-encoding", "content-encoding")]
            return httpx.Response(response.status, headers=kept, content=data, request=request)

    return httpx.Client(transport=BoundedTransport())


def _cause(exc: BaseException, kind):
    """The first exception of type `kind` in exc's chain of causes and contexts, or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class EndpointJudge:
    """An OpenAI-compatible chat-completions endpoint (vLLM, SGLang, ...), through the openai client."""

    def __init__(self, url: str, model: str | None, api_key: str, timeout: float, retries: int,
                 concurrency: int, max_tokens: int, top_logprobs: int):
        self.url, self.model, self.api_key = url.rstrip("/"), model, api_key
        self.timeout, self.retries, self.concurrency = float(timeout), int(retries), int(concurrency)
        self.max_tokens, self.top_logprobs = int(max_tokens), int(top_logprobs)
        self.client = None

    def load(self) -> None:
        try:
            openai = importlib.import_module("openai")
        except ImportError as exc:
            raise RewardNotReadyError(f"reward 'vlm_judge' with an endpoint needs the openai package ({exc}); "
                                      f"install it: {JUDGE_INSTALL}", reward="vlm_judge") from exc
        base_client = importlib.import_module("openai._base_client")
        httpx = getattr(base_client, "httpx2", None) or base_client.httpx  # the one this openai client is built on
        client = openai.OpenAI(base_url=self.url, api_key=self.api_key, timeout=self.timeout,
                               max_retries=self.retries, http_client=bounded_http_client(
                                   httpx, self.timeout, int(MAX_RESPONSE_MB * 2**20)))
        self.timeout_errors = (openai.APITimeoutError, TimeoutError)
        try:
            served = [m.id for m in client.models.list()]
        except openai.OpenAIError as exc:
            raise RewardNotReadyError(
                f"reward 'vlm_judge': the judge endpoint {self.url} does not answer GET {self.url}/models "
                f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); start the server "
                "(docs/tasks_ocr_judge.md: vllm serve MODEL --port PORT) or fix reward_kwargs.vlm_judge.url",
                reward="vlm_judge") from exc
        if self.model is None:
            if len(served) != 1:
                raise RewardNotReadyError(
                    f"reward 'vlm_judge': the endpoint {self.url} serves {served or 'no model'}; name one in "
                    "reward_kwargs.vlm_judge.model", reward="vlm_judge")
            self.model = served[0]
        elif self.model not in served:
            raise RewardNotReadyError(
                f"reward 'vlm_judge': the endpoint {self.url} does not serve model={self.model!r} (it serves "
                f"{served}); fix reward_kwargs.vlm_judge.model", reward="vlm_judge")
        self.client = client

    def _create(self, image, question: str, **kwargs):
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_data_url(image)}},
            {"type": "text", "text": question},
        ]}]
        try:
            return self.client.chat.completions.create(model=self.model, messages=messages, temperature=0.0,
                                                       **kwargs)
        except Exception as exc:  # the openai client has retried what can be retried
            too_large = _cause(exc, AnswerTooLarge)
            if too_large is not None:
                raise RewardError(
                    f"reward 'vlm_judge': the judge endpoint {self.url} answered with {too_large.size}, over the "
                    f"limit of {MAX_RESPONSE_MB:g} MB for a reply (a judge's is a few KB); is "
                    "reward_kwargs.vlm_judge.url a chat-completions endpoint?", reward="vlm_judge") from exc
            if _cause(exc, self.timeout_errors) is not None:
                attempts = self.retries + 1
                raise RewardError(
                    f"reward 'vlm_judge': the judge endpoint {self.url} did not answer within timeout="
                    f"{self.timeout:g} s ({attempts} attempt{'s' * (attempts != 1)}, each limited as a whole: "
                    "connecting, sending and the whole reply); start or fix the server, or raise "
                    "reward_kwargs.vlm_judge.timeout", reward="vlm_judge") from exc
            raise RewardError(
                f"reward 'vlm_judge': the judge endpoint {self.url} failed after {self.retries} retries "
                f"(timeout {self.timeout:g} s each): {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                reward="vlm_judge") from exc

    def reply(self, image, question: str) -> str | None:
        completion = self._create(image, question, max_tokens=self.max_tokens)
        return completion.choices[0].message.content if completion.choices else None

    def next_token_logprobs(self, image, question: str) -> dict[str, float] | None:
        completion = self._create(image, question, max_tokens=1, logprobs=True, top_logprobs=self.top_logprobs)
        if not completion.choices or completion.choices[0].logprobs is None:
            return None
        content = completion.choices[0].logprobs.content or []
        if not content:
            return None
        return {entry.token: float(entry.logprob) for entry in content[0].top_logprobs or []}

    def map(self, fn, items) -> list:
        """fn over `items`, `concurrency` at a time, results in order; the first error is raised (no item is
        started after it). The workers are daemon threads: requests still running when the run gives up on this
        reward (reward_timeout, an error) do not keep the process from exiting, as a ThreadPoolExecutor's
        workers would (they are joined at interpreter exit)."""
        results, errors, pending, lock = [None] * len(items), [], iter(range(len(items))), threading.Lock()

        def work():
            while True:
                with lock:
                    index = None if errors else next(pending, None)
                if index is None:
                    return
                try:
                    results[index] = fn(*items[index])
                except BaseException as exc:  # raised in the caller's thread below
                    with lock:
                        errors.append(exc)

        workers = [threading.Thread(target=work, name=f"vlm_judge_{i}", daemon=True)
                   for i in range(max(1, min(self.concurrency, len(items))))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if errors:
            raise errors[0]
        return results


class TransformersJudge:
    """An image-text-to-text model in this process (``AutoModelForImageTextToText`` and its ``AutoProcessor``)."""

    def __init__(self, model: str | None, device=None, dtype="auto", max_tokens: int = 512,
                 top_logprobs: int = 20, yes_token: str = "Yes", no_token: str = "No"):
        self.model_spec, self.max_tokens, self.top_logprobs = model, int(max_tokens), int(top_logprobs)
        self.yes_token, self.no_token = yes_token, no_token
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if dtype == "auto":
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = self.processor = None
        self._lock = threading.Lock()  # one forward at a time on the one model

    def load(self) -> None:
        if self.model is not None:  # loaded, or given with set_model
            return
        if not self.model_spec:
            raise RewardNotReadyError("reward 'vlm_judge' with backend='transformers' needs a model: set "
                                      "reward_kwargs.vlm_judge.model (hub id or directory)", reward="vlm_judge")
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from ddpo_group.rewards.clip_models import check_reward_hub

        check_reward_hub(self.model_spec, "vlm_judge", "model")
        try:
            processor = AutoProcessor.from_pretrained(self.model_spec)
            model = AutoModelForImageTextToText.from_pretrained(self.model_spec, dtype=self.dtype)
        except (OSError, ValueError) as exc:
            raise RewardNotReadyError(
                f"reward 'vlm_judge': cannot load {self.model_spec!r} ({' '.join(str(exc).split())[:300]}); run once "
                "online to download it, or set reward_kwargs.vlm_judge.model=/path/to/model", reward="vlm_judge",
            ) from exc
        self.set_model(model, processor)

    def set_model(self, model, processor) -> None:
        """Use an already built model and processor (what ``load`` does after from_pretrained); RewardNotReadyError
        when yes_token / no_token are not single tokens of its tokenizer."""
        tokenizer = processor.tokenizer
        self.token_ids = {}
        for token in (self.yes_token, self.no_token):
            ids = tokenizer.encode(token, add_special_tokens=False)
            if len(ids) != 1:
                raise RewardNotReadyError(
                    f"reward 'vlm_judge': {token!r} is {len(ids)} tokens for this model's tokenizer, not one; set "
                    "reward_kwargs.vlm_judge.yes_token / no_token to single-token words", reward="vlm_judge")
            self.token_ids[token] = ids[0]
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.processor = processor

    def _inputs(self, image, question: str):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[text], images=[image], return_tensors="pt").to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        return inputs

    @torch.no_grad()
    def reply(self, image, question: str) -> str:
        with self._lock:
            inputs = self._inputs(image, question)
            tokenizer = self.processor.tokenizer
            generated = self.model.generate(**inputs, do_sample=False, max_new_tokens=self.max_tokens,
                                            pad_token_id=tokenizer.pad_token_id)
        return self.processor.batch_decode(generated[:, inputs["input_ids"].shape[1]:].cpu(),
                                           skip_special_tokens=True)[0]

    @torch.no_grad()
    def next_token_logprobs(self, image, question: str, words=()) -> dict[str, float]:
        """The top `top_logprobs` tokens of log_softmax(next-token logits) in float32, decoded, plus Yes and No
        (always present: their exact log-probs), plus each of `words` that is one token of the tokenizer (its exact
        log-prob: GenEval 2's Soft-TIFA asks for an answer's probability, evaluation/geneval2.py)."""
        with self._lock:
            logits = self.model(**self._inputs(image, question)).logits[0, -1]
        log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
        top = torch.topk(log_probs, min(self.top_logprobs, log_probs.numel()))
        tokenizer = self.processor.tokenizer
        listed = {tokenizer.decode([int(i)]): float(lp) for lp, i in zip(top.values, top.indices)}
        exact = {index: token for token, index in self.token_ids.items()}
        for word in words:  # one entry per token id: two spellings of one token are not counted twice
            ids = tokenizer.encode(word, add_special_tokens=False)
            if len(ids) == 1:
                exact.setdefault(ids[0], word)
        for token in exact.values():
            for text in [t for t in listed if t.strip() == token.strip()]:  # exact values below, not a doubled count
                del listed[text]
        for index, token in exact.items():
            listed[token] = float(log_probs[index])
        return listed

    def map(self, fn, items) -> list:
        return [fn(*item) for item in items]


# the reward ------------------------------------------------------------------------------------------------------
@register_reward("vlm_judge")
class VlmJudgeReward:
    """A VLM judge's reward per image (module docstring), one value per image; info: ``unparsed`` (0 / 1 per image),
    ``unparsed_reply`` (the first unparsed reply, a string; absent when none).

    backend "endpoint" | "transformers"; url (endpoint API base); model (served name / hub id or directory);
    scoring "score" | "yes_no"; template (str with {prompt}; default by scoring); score_pattern, score_scale,
    score_min, score_max (score); yes_token, no_token, top_logprobs, missing_token "bound" | "zero" (yes_no);
    unparsed_reward "mean" | number; max_unparsed_fraction; image_size (resize to a square of this side first,
    None: as sampled; Flow-GRPO's UnifiedReward: 512); concurrency, timeout, retries, api_key (endpoint);
    max_tokens (the reply's length, score).
    """

    def __init__(self, backend: str = "endpoint", url: str = "http://127.0.0.1:8000/v1", model: str | None = None,
                 scoring: str = "score", template: str | None = None,
                 score_pattern: str = UNIFIED_REWARD_PATTERN, score_scale: float = 5.0, score_min: float = 1.0,
                 score_max: float = 5.0, yes_token: str = "Yes", no_token: str = "No", top_logprobs: int = 20,
                 missing_token: str = "bound", unparsed_reward="mean", max_unparsed_fraction: float = 0.25,
                 image_size: int | None = None, concurrency: int = 16, timeout: float = 120.0, retries: int = 3,
                 api_key: str = "EMPTY", max_tokens: int = 512, device=None, dtype: str = "auto"):
        def bad(field, value, what):
            return ValueError(f"reward 'vlm_judge': {field}={value!r} {what} (config: reward_kwargs.vlm_judge.{field})")

        if backend not in BACKENDS:
            raise bad("backend", backend, f"is not one of {BACKENDS}")
        if scoring not in SCORINGS:
            raise bad("scoring", scoring, f"is not one of {SCORINGS}")
        if missing_token not in ("bound", "zero"):
            raise bad("missing_token", missing_token, "is not one of ('bound', 'zero')")
        if not (unparsed_reward == "mean" or _real(unparsed_reward)):
            raise bad("unparsed_reward", unparsed_reward, "is neither 'mean' nor a number")
        if not (_real(max_unparsed_fraction) and 0.0 <= max_unparsed_fraction <= 1.0):
            raise bad("max_unparsed_fraction", max_unparsed_fraction, "is not a number in [0, 1]")
        if not isinstance(score_pattern, str):
            raise bad("score_pattern", score_pattern, "is not a string")
        try:
            if re.compile(score_pattern).groups < 1:
                raise bad("score_pattern", score_pattern, "has no group: put the number in (...)")
        except re.error as exc:
            raise bad("score_pattern", score_pattern, f"is not a regular expression ({exc})") from None
        # each option on its own, so that a bad one is named before anything is loaded or asked
        if backend == "endpoint":
            parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise bad("url", url, "is not an http(s) URL: give the API base, http://HOST:PORT/v1")
        if not (model is None or (isinstance(model, str) and model.strip())):
            raise bad("model", model, "is neither a name nor None")
        for field, value in (("template", template), ("api_key", api_key)):
            if not (isinstance(value, str) or (value is None and field == "template")):
                raise bad(field, value, "is not a string")
        for field, value in (("yes_token", yes_token), ("no_token", no_token)):
            if not (isinstance(value, str) and value.strip()):
                raise bad(field, value, "is not a word (a non-empty string)")
        for field, value in (("score_scale", score_scale), ("timeout", timeout)):
            if not (_real(value) and value > 0):
                raise bad(field, value, "is not a number > 0")
        for field, value in (("score_min", score_min), ("score_max", score_max)):
            if not _real(value):
                raise bad(field, value, "is not a number")
        if score_min > score_max:
            raise bad("score_min", score_min, f"is above score_max={score_max!r}")
        whole = {"top_logprobs": (top_logprobs, 1, "1..20 (the OpenAI API's limit)"),
                 "concurrency": (concurrency, 1, ">= 1"), "retries": (retries, 0, ">= 0"),
                 "max_tokens": (max_tokens, 1, ">= 1"), "image_size": (image_size, 1, ">= 1 (or None: as sampled)")}
        for field, (value, low, what) in whole.items():
            if field == "image_size" and value is None:
                continue
            if not (_whole(value) and value >= low and (field != "top_logprobs" or value <= 20)):
                raise bad(field, value, f"is not a whole number {what}")
        self.scoring, self.backend = scoring, backend
        self.template = template if template is not None else (SCORE_TEMPLATE if scoring == "score"
                                                               else YES_NO_TEMPLATE)
        self.score_pattern, self.score_scale = score_pattern, float(score_scale)
        self.score_min, self.score_max = float(score_min), float(score_max)
        self.yes_token, self.no_token, self.missing_token = yes_token, no_token, missing_token
        self.unparsed_reward, self.max_unparsed_fraction = unparsed_reward, float(max_unparsed_fraction)
        self.image_size = None if image_size is None else int(image_size)
        if backend == "endpoint":
            self.judge = EndpointJudge(url, model, api_key, timeout, retries, concurrency, max_tokens, top_logprobs)
        else:
            self.judge = TransformersJudge(model, device, dtype, max_tokens, top_logprobs, yes_token, no_token)
        self.where = url if backend == "endpoint" else f"model {model!r}"
        self._ready = False
        self._lock = threading.Lock()

    def check_ready(self) -> None:
        with self._lock:
            if not self._ready:
                self.judge.load()
                self._ready = True

    def question(self, prompt: str) -> str:
        return self.template.replace("{prompt}", prompt)

    def _score_one(self, image, prompt) -> tuple[float | None, str]:
        """(reward or None when unparsed, the reply as text for the log)."""
        question = self.question(prompt)
        if self.scoring == "score":
            reply = self.judge.reply(image, question)
            return parse_score(reply, self.score_pattern, self.score_scale, self.score_min, self.score_max), \
                str(reply)
        top = self.judge.next_token_logprobs(image, question)
        return yes_no_reward(top, self.yes_token, self.no_token, self.missing_token), f"top log-probs {top}"

    def __call__(self, images, prompts, metadata):
        self.check_ready()
        pil = to_pil_images(images)
        if self.image_size:
            pil = [image.resize((int(self.image_size), int(self.image_size))) for image in pil]
        results = self.judge.map(self._score_one, list(zip(pil, prompts)))
        values = [value for value, _ in results]
        unparsed = np.array([value is None for value in values], dtype=np.float64)
        info = {"unparsed": unparsed}
        if unparsed.any():
            first = int(np.flatnonzero(unparsed)[0])
            reply = " ".join(results[first][1].split())[:300]
            info["unparsed_reply"] = reply
            logger.warning("vlm_judge (%s): %d of %d replies unparsed; the first, for %r: %r", self.where,
                           int(unparsed.sum()), len(values), prompts[first], reply)
            no_mean = unparsed.all() and self.unparsed_reward == "mean"  # nothing parsed to take the mean of
            if no_mean or unparsed.mean() > self.max_unparsed_fraction:
                raise RewardError(
                    f"reward 'vlm_judge' ({self.where}): {int(unparsed.sum())} of {len(values)} replies could not "
                    f"be scored (max_unparsed_fraction={self.max_unparsed_fraction:g}); the first, for prompt "
                    f"{prompts[first]!r}: {reply!r}. Fix the template or score_pattern (reward_kwargs.vlm_judge)",
                    reward="vlm_judge", index=first, prompt=prompts[first])
        parsed = [value for value in values if value is not None]
        fill = float(np.mean(parsed)) if self.unparsed_reward == "mean" else float(self.unparsed_reward)
        return np.array([fill if value is None else value for value in values], dtype=np.float64), info
