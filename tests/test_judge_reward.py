"""The VLM judge (rewards/judge.py): its two scorings on replies and log-probs written here, the endpoint client
against a local server speaking the chat-completions format (a small ASGI app on uvicorn, loopback only), and the
in-process judge on a tiny random image-text-to-text model built from a config with its processor in memory."""

import asyncio
import base64
import io
import json
import math
import socket
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.rewards import CombinedReward, RewardError, RewardNotReadyError, get_reward
from ddpo_group.rewards.judge import image_data_url, parse_score, yes_no_reward

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("openai")


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# scorings ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reply, expected", [
    ("The caption matches well. Final Score: 4", 0.8),
    ("Final Score: 3.5\nFinal Score: 1", 0.7),  # the first match, as Flow-GRPO
    ("Final Score:5", 1.0),
    ("final score: 4", None),  # the pattern is case-sensitive, as UnifiedReward's
    ("Final Score: 7", None),  # not a 1-5 score
    ("I would give it a four.", None),
    ("", None),
    (None, None),
])
def test_unified_reward_score_is_x_over_5(reply, expected):
    value = parse_score(reply, low=1, high=5)
    assert value == (None if expected is None else pytest.approx(expected))


def test_a_custom_pattern_and_scale():
    assert parse_score("Rating: 7/10", pattern=r"Rating:\s*(\d+)/10", scale=10.0) == pytest.approx(0.7)
    assert parse_score("Rating: 7/10", pattern=r"Score=(\d+)", scale=10.0) is None


def test_yes_no_reward_is_the_sigmoid_of_the_log_prob_difference():
    top = {"Yes": math.log(0.6), "No": math.log(0.2), "Maybe": math.log(0.1)}
    assert yes_no_reward(top) == pytest.approx(0.75)  # 0.6 / (0.6 + 0.2)
    assert yes_no_reward({"Yes": -0.5, "No": -2.0}) == pytest.approx(sigmoid(1.5))


def test_yes_no_variants_with_spaces_are_summed_in_probability():
    top = {"Yes": math.log(0.3), " Yes": math.log(0.1), "No": math.log(0.4), "yes": math.log(0.05)}
    # "Yes" and " Yes" are Yes (case kept: "yes" is another token); P(Yes) = 0.4, P(No) = 0.4
    assert yes_no_reward(top) == pytest.approx(0.5)


def test_a_missing_yes_or_no_is_bounded_by_the_smallest_listed_log_prob():
    top = {"No": -0.1, "The": -1.0, "A": -4.0}
    assert yes_no_reward(top) == pytest.approx(sigmoid(-4.0 - -0.1))  # lp(Yes) <= -4: an upper bound
    assert yes_no_reward({"Yes": -0.2, "A": -3.0}) == pytest.approx(sigmoid(-0.2 - -3.0))  # a lower bound
    assert yes_no_reward(top, missing_token="zero") == 0.0  # Flow-Factory: P(Yes) = 0
    assert yes_no_reward({"Yes": -0.2, "A": -3.0}, missing_token="zero") == 1.0


def test_no_yes_and_no_no_is_unparsed():
    assert yes_no_reward({"The": -0.1, "A": -2.0}) is None
    assert yes_no_reward({}) is None
    assert yes_no_reward(None) is None


def test_image_is_a_png_data_url_of_the_same_pixels():
    image = Image.fromarray(np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3))
    url = image_data_url(image)
    assert url.startswith("data:image/png;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(image))


# the endpoint -----------------------------------------------------------------------------------------------------
class ChatServer:
    """An OpenAI-compatible chat-completions server on 127.0.0.1 (uvicorn): GET /v1/models lists `models`; POST
    /v1/chat/completions answers by the question's text: `answers[text]` (else `default`) is {"content": str} or
    {"top_logprobs": {token: lp}}, optionally with "fail": n (answer 503 n times first) and "delay": seconds."""

    def __init__(self, answers, models=("judge",), default=None):
        self.answers, self.models, self.default = answers, list(models), default
        self.requests, self.failed, self.in_flight, self.max_in_flight = [], {}, 0, 0
        self._lock = threading.Lock()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        config = uvicorn.Config(self.app, interface="asgi3", log_level="error", lifespan="off",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=5)

    async def app(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, answer, headers = 200, None, []
        if scope["method"] == "GET" and scope["path"] == "/v1/models":
            answer = {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "test"}
                                                 for m in self.models]}
        elif scope["method"] == "POST" and scope["path"] == "/v1/chat/completions":
            status, answer, headers = await self.complete(json.loads(body))
        else:
            status, answer = 404, {"error": {"message": "not found"}}
        data = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *headers]})
        await send({"type": "http.response.body", "body": data})

    async def complete(self, request):
        content = request["messages"][0]["content"]
        question = next(part["text"] for part in content if part["type"] == "text")
        spec = self.answers.get(question, self.default)
        with self._lock:
            self.requests.append(request)
            failed = self.failed.get(question, 0)
            if failed < spec.get("fail", 0):
                self.failed[question] = failed + 1
                return 503, {"error": {"message": "busy"}}, [(b"retry-after-ms", b"10")]
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(spec.get("delay", 0.0))
        finally:
            with self._lock:
                self.in_flight -= 1
        choice = {"index": 0, "finish_reason": "stop", "logprobs": None,
                  "message": {"role": "assistant", "content": spec.get("content")}}
        if "top_logprobs" in spec:
            top = [{"token": t, "logprob": lp, "bytes": None} for t, lp in spec["top_logprobs"].items()]
            choice["message"]["content"] = top[0]["token"] if top else ""
            choice["logprobs"] = {"content": [{"token": choice["message"]["content"], "logprob": top[0]["logprob"]
                                               if top else 0.0, "bytes": None, "top_logprobs": top}]}
        return 200, {"id": "c", "object": "chat.completion", "created": 0, "model": request["model"],
                     "choices": [choice]}, []


@pytest.fixture
def serve():
    servers = []

    def start(answers, models=("judge",)):
        servers.append(ChatServer(answers, models))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def images(n):
    return torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(n))


def test_endpoint_score_judge_sends_image_and_question_and_scores_the_reply(serve):
    server = serve({"rate: a red fox": {"content": "Nice. Final Score: 4"},
                    "rate: two cats": {"content": "Final Score: 2.5"}})
    reward = get_reward("vlm_judge", url=server.url, template="rate: {prompt}", retries=0)
    CombinedReward({"vlm_judge": reward}).check_ready()
    batch = images(2)
    rewards, info = reward(batch, ["a red fox", "two cats"], [{}, {}])
    np.testing.assert_allclose(rewards, [0.8, 0.5])
    np.testing.assert_array_equal(info["unparsed"], [0.0, 0.0])
    request = server.requests[0]
    assert request["model"] == "judge" and request["temperature"] == 0
    sent = next(part for part in request["messages"][0]["content"] if part["type"] == "image_url")
    sent_image = Image.open(io.BytesIO(base64.b64decode(sent["image_url"]["url"].split(",", 1)[1])))
    index = 0 if "red fox" in request["messages"][0]["content"][1]["text"] else 1
    expected = (batch[index] * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(np.asarray(sent_image), expected)


def test_endpoint_yes_no_judge_asks_one_token_with_top_20_log_probs(serve):
    server = serve({"fox?": {"top_logprobs": {"Yes": math.log(0.9), "No": math.log(0.1)}},
                    "cat?": {"top_logprobs": {"No": -0.05, "Maybe": -3.0}}})
    reward = get_reward("vlm_judge", url=server.url, scoring="yes_no", template="{prompt}?", retries=0)
    rewards, _ = reward(images(2), ["fox", "cat"], [{}, {}])
    np.testing.assert_allclose(rewards, [0.9, sigmoid(-3.0 - -0.05)])
    request = server.requests[0]
    assert (request["max_tokens"], request["logprobs"], request["top_logprobs"]) == (1, True, 20)


def test_unparsed_replies_are_counted_logged_and_given_the_batch_mean(serve, caplog):
    answers = {f"q{i}": {"content": f"Final Score: {s}"} for i, s in enumerate([2, 3, 4, 5, 1, 5, 2])}
    answers["q7"] = {"content": "I cannot rate this."}
    server = serve(answers)
    reward = get_reward("vlm_judge", url=server.url, template="{prompt}", retries=0)
    with caplog.at_level("WARNING"):
        rewards, info = reward(images(8), [f"q{i}" for i in range(8)], [{}] * 8)
    mean = (2 + 3 + 4 + 5 + 1 + 5 + 2) / 7 / 5
    np.testing.assert_allclose(rewards, [0.4, 0.6, 0.8, 1.0, 0.2, 1.0, 0.4, mean])
    np.testing.assert_array_equal(info["unparsed"], [0] * 7 + [1])
    assert info["unparsed_reply"] == "I cannot rate this."
    assert "I cannot rate this." in caplog.text
    fixed = get_reward("vlm_judge", url=server.url, template="{prompt}", retries=0, unparsed_reward=0.0,
                       max_unparsed_fraction=0.5)
    assert fixed(images(2), ["q0", "q7"], [{}, {}])[0].tolist() == [0.4, 0.0]
    # with a fixed value, a batch of one unparsed image is no error when the fraction allows it
    lenient = get_reward("vlm_judge", url=server.url, template="{prompt}", retries=0, unparsed_reward=0.0,
                         max_unparsed_fraction=1.0)
    assert lenient(images(1), ["q7"], [{}])[0].tolist() == [0.0]


def test_too_many_unparsed_replies_stop_the_run_quoting_one(serve):
    server = serve({"a": {"content": "Final Score: 3"}, "b": {"content": "meh"}})
    reward = get_reward("vlm_judge", url=server.url, template="{prompt}", retries=0, max_unparsed_fraction=0.25)
    with pytest.raises(RewardError) as info:
        reward(images(2), ["a", "b"], [{}, {}])
    assert "1 of 2" in str(info.value) and "meh" in str(info.value) and info.value.prompt == "b"


def test_a_busy_server_is_retried_and_concurrency_is_bounded(serve):
    answers = {f"q{i}": {"content": "Final Score: 3", "delay": 0.05} for i in range(6)}
    answers["q0"]["fail"] = 2  # two 503 answers, then the score
    server = serve(answers)
    reward = get_reward("vlm_judge", url=server.url, template="{prompt}", retries=2, concurrency=2)
    rewards, _ = reward(images(6), [f"q{i}" for i in range(6)], [{}] * 6)
    np.testing.assert_allclose(rewards, [0.6] * 6)
    assert server.failed["q0"] == 2
    assert 1 <= server.max_in_flight <= 2


def test_a_request_that_keeps_failing_is_an_error_naming_the_url(serve):
    server = serve({"q": {"content": "Final Score: 3", "fail": 5}})
    reward = get_reward("vlm_judge", url=server.url, template="{prompt}", retries=1)
    with pytest.raises(RewardError, match=server.url.replace(".", r"\.")):
        reward(images(1), ["q"], [{}])


def test_a_dead_endpoint_is_refused_before_the_first_epoch_in_one_line():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    combined = CombinedReward({"vlm_judge": get_reward("vlm_judge", url=f"http://127.0.0.1:{port}/v1", retries=0,
                                                       timeout=2)})
    with pytest.raises(RewardNotReadyError) as info:
        combined.check_ready()
    assert "\n" not in str(info.value) and f"127.0.0.1:{port}" in str(info.value) and "vllm serve" in str(info.value)


def test_a_model_the_endpoint_does_not_serve_is_refused(serve):
    server = serve({}, models=("a", "b"))
    with pytest.raises(RewardNotReadyError, match="does not serve model='c'"):
        get_reward("vlm_judge", url=server.url, model="c", retries=0).check_ready()
    with pytest.raises(RewardNotReadyError, match="name one in reward_kwargs.vlm_judge.model"):
        get_reward("vlm_judge", url=server.url, retries=0).check_ready()


@pytest.mark.parametrize("kwargs, field", [({"scoring": "stars"}, "scoring"), ({"backend": "vllm"}, "backend"),
                                           ({"score_pattern": "Score: \\d"}, "score_pattern"),
                                           ({"unparsed_reward": "nan"}, "unparsed_reward")])
def test_bad_keywords_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"reward_kwargs.vlm_judge.{field}"):
        get_reward("vlm_judge", **kwargs)


# in-process -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_vlm():
    """A random LLaVA (CLIP vision tower on 28 px: 4 image tokens; 1-layer Qwen2 of width 32) with a processor built
    in memory (Qwen2 tokenizer with single-token Yes / No, a chat template): AutoModelForImageTextToText's path."""
    from transformers import AutoModelForImageTextToText, LlavaConfig, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from ddpo_group.diffusion.qwen_image import build_tiny_qwen_tokenizer

    tokenizer = build_tiny_qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
    tokenizer.add_tokens(["Yes", "No", "5"])
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
                "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tokenizer, chat_template=template, patch_size=14, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1,
    )
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=16),
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1, image_seq_length=4,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config)
    return model.eval(), processor


def test_in_process_yes_no_judge_is_the_sigmoid_of_the_two_logits(tiny_vlm):
    model, processor = tiny_vlm
    reward = get_reward("vlm_judge", backend="transformers", model="tiny", scoring="yes_no",
                        template="Is this {prompt}? Answer Yes or No.")
    reward.judge.set_model(model, processor)
    batch = images(2)
    rewards, info = reward(batch, ["a fox", "a cat"], [{}, {}])
    tokenizer = processor.tokenizer
    yes, no = tokenizer.convert_tokens_to_ids("Yes"), tokenizer.convert_tokens_to_ids("No")
    for i, prompt in enumerate(["a fox", "a cat"]):
        text = ("<|im_start|>user\n<image>Is this " + prompt + "? Answer Yes or No.<|im_end|>\n"
                "<|im_start|>assistant\n")
        image = Image.fromarray((batch[i] * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())
        with torch.no_grad():
            logits = model(**processor(text=[text], images=[image], return_tensors="pt")).logits[0, -1].double()
        # P(Yes) / (P(Yes) + P(No)) = sigmoid(logit_Yes - logit_No): the softmax's normaliser cancels
        assert rewards[i] == pytest.approx(torch.sigmoid(logits[yes] - logits[no]).item(), abs=1e-6)
    np.testing.assert_array_equal(info["unparsed"], [0.0, 0.0])


def test_in_process_score_judge_generates_and_parses(tiny_vlm):
    model, processor = tiny_vlm
    five = processor.tokenizer.convert_tokens_to_ids("5")
    model.generation_config.sequence_bias = {(five,): 100.0}  # the random model now answers "5 5 ..."
    try:
        reward = get_reward("vlm_judge", backend="transformers", model="tiny", score_pattern=r"(\d)", max_tokens=2)
        reward.judge.set_model(model, processor)
        rewards, info = reward(images(2), ["a fox", "a cat"], [{}, {}])
        np.testing.assert_allclose(rewards, [1.0, 1.0])  # 5 / 5
        strict = get_reward("vlm_judge", backend="transformers", model="tiny", max_tokens=2)
        strict.judge.set_model(model, processor)
        with pytest.raises(RewardError, match="could not be scored"):  # no "Final Score:" in "55"
            strict(images(2), ["a fox", "a cat"], [{}, {}])
    finally:
        model.generation_config.sequence_bias = None


def test_in_process_judge_needs_single_token_yes_and_no(tiny_vlm):
    reward = get_reward("vlm_judge", backend="transformers", model="tiny", scoring="yes_no", yes_token="Absolutely")
    with pytest.raises(RewardNotReadyError, match="yes_token"):
        reward.judge.set_model(*tiny_vlm)


def test_in_process_judge_without_a_model_says_which_keyword_to_set():
    with pytest.raises(RewardNotReadyError, match="reward_kwargs.vlm_judge.model"):
        get_reward("vlm_judge", backend="transformers").check_ready()
