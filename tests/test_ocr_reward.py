"""The OCR reward (rewards/ocr.py): the target-text rules, Flow-GRPO's formula on cases computed by hand, the prompt
set check before any model loads, and the recognisers' code paths (GOT-OCR2 on a tiny random model built from a
config with its processor built in memory; PaddleOCR's answer forms and its missing package)."""

import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.rewards import CombinedReward, RewardError, RewardNotReadyError, get_reward
from ddpo_group.rewards.ocr import (
    OcrReward,
    ocr_distance,
    ocr_reward,
    paddle_texts,
    quoted_text,
    target_text,
)
from helpers import make_config


def levenshtein(a: str, b: str) -> int:
    """Plain dynamic-programming edit distance (the test's own, independent of rapidfuzz)."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        previous, row[0] = row[0], i
        for j, cb in enumerate(b, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ca != cb))
    return row[-1]


# target text ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, expected", [
    ('a neon sign that says "Open Late" on a wall', "Open Late"),
    ('a "red" poster reading "stop"', "red"),  # the first double-quoted span
    ('a banner with "Happy Birthday', "Happy Birthday"),  # unclosed: to the end (Flow-GRPO's split('"')[1])
    ("a door marked 'EXIT' in green", "EXIT"),  # single quotes when there is no double quote
    ("'left' and \"right\"", "right"),  # a double quote wins over an earlier single-quoted span
    ("don't 'stop' me now", "stop"),  # the apostrophe of don't opens nothing
    ("Joe's cafe at night", None),  # an apostrophe is no quote
    ("a cat on a mat", None),
])
def test_target_text_is_the_first_quoted_span(prompt, expected):
    assert quoted_text(prompt) == expected


def test_whole_prompt_only_when_allowed_and_metadata_wins():
    assert target_text("a cat on a mat") is None
    assert target_text("a cat on a mat", allow_unquoted=True) == "a cat on a mat"
    assert target_text('a sign "open"', {"ocr_text": "closed"}) == "closed"


# the formula ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target, recognised, distance, reward", [
    ("Hello World", "HELLO WORLD!! 2024", 0, 1.0),  # substring after lower-casing and removing spaces
    ("Hello World", "helo world", 1, 0.9),  # one insertion makes "heloworld" "helloworld": 1 - 1/10
    ("cat", "cot", 1, 2 / 3),
    ("cat", "x" * 25, 3, 0.0),  # Lev = 25 capped at |target| = 3
    ("cat", "", 3, 0.0),  # nothing read: Lev = |target|
    ("open now", "OPENNOW", 0, 1.0),
    ("abcd", "abxy", 2, 0.5),
])
def test_reward_is_one_minus_the_capped_distance_over_the_length(target, recognised, distance, reward):
    assert ocr_distance(target, recognised) == distance
    assert ocr_reward(target, recognised) == pytest.approx(reward)


def test_distance_is_the_levenshtein_distance_below_the_cap():
    for target, recognised in [("kitten", "sitting"), ("flowgrpo", "flowgpro"), ("abcdefgh", "bcdefghi")]:
        assert ocr_distance(target, recognised) == min(levenshtein(recognised, target), len(target))


def test_an_empty_target_is_refused():
    with pytest.raises(ValueError, match="empty"):
        ocr_distance("  ", "anything")


# the prompt set check ---------------------------------------------------------------------------------------------
def test_prompt_set_without_quotes_is_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "ocr.txt"
    path.write_text('# OCR prompts\na sign that says "open"\n\na cat on a mat\na "b"\n')
    with pytest.raises(ValueError) as info:
        OcrReward.check_prompts(["a sign that says \"open\"", "a cat on a mat"], source=str(path))
    message = str(info.value)
    assert str(path) in message and "line 4" in message and "allow_unquoted" in message
    OcrReward.check_prompts(["a cat on a mat"], source=str(path), allow_unquoted=True)


def test_a_jsonl_prompt_file_may_give_the_text_apart_from_the_prompt(tmp_path):
    path = tmp_path / "ocr.jsonl"
    path.write_text('{"prompt": "a bakery sign", "ocr_text": "Fresh Bread"}\n{"prompt": "a plain wall"}\n')
    config = make_config(tmp_path, reward_fn="ocr", prompt_fn=str(path))
    with pytest.raises(ConfigError, match="'a plain wall'"):
        check_config(config)
    path.write_text('{"prompt": "a bakery sign", "ocr_text": "Fresh Bread"}\n')
    check_config(config)


def test_empty_quotes_are_refused():
    with pytest.raises(ValueError, match="empty"):
        OcrReward.check_prompts(['a sign with "" on it'], source="")


def test_config_check_refuses_an_unquoted_ocr_prompt_file_before_any_model_loads(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text('a sign that says "open"\na cat on a mat\n')
    config = make_config(tmp_path, reward_fn="ocr", prompt_fn=str(path))
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert "config.prompt_fn" in str(info.value) and "line 2" in str(info.value)
    config.reward_kwargs = {"ocr": {"allow_unquoted": True}}
    check_config(config)


def test_an_ocr_gold_reward_checks_the_prompts_too(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a cat on a mat\n")
    config = make_config(tmp_path, reward_fn="jpeg_compressibility", prompt_fn=str(path), eval_rewards="ocr",
                         eval_freq=1)
    with pytest.raises(ConfigError, match="line 1"):
        check_config(config)


def test_a_prompt_without_quotes_at_call_time_names_the_prompt():
    reward = OcrReward()
    with pytest.raises(RewardError) as info:
        reward(torch.zeros(1, 3, 8, 8), ["a cat"], [{}])
    assert info.value.prompt == "a cat"


# recognisers ------------------------------------------------------------------------------------------------------
def test_paddle_answers_of_both_versions_are_read():
    # PaddleOCR 3.x predict(): result objects with rec_texts; 2.x ocr(): [box, (text, confidence)] lines, of which
    # Flow-GRPO keeps the lines of confidence > 0
    assert paddle_texts([{"rec_texts": ["Hello", "World"], "rec_scores": [0.9, 0.8]}]) == "HelloWorld"
    box = [[0, 0], [1, 0], [1, 1], [0, 1]]
    assert paddle_texts([[box, ("Hello", 0.93)], [box, ("noise", 0.0)], [box, ("World", 0.5)]]) == "HelloWorld"
    assert paddle_texts(None) == ""
    with pytest.raises(RewardError, match="PaddleOCR"):
        paddle_texts([42])


@pytest.mark.skipif(importlib.util.find_spec("paddleocr") is not None, reason="paddleocr is installed here")
def test_missing_paddleocr_is_one_line_saying_what_to_install():
    combined = CombinedReward({"ocr": get_reward("ocr", engine="paddleocr")})
    with pytest.raises(RewardNotReadyError) as info:
        combined.check_ready()
    assert "\n" not in str(info.value) and 'pip install "ddpo-group[paddle]"' in str(info.value)


def test_got_ocr2_weights_not_found_say_which_keyword_to_set(tmp_path):
    with pytest.raises(RewardNotReadyError) as info:
        OcrReward(model=str(tmp_path)).check_ready()
    assert "reward_kwargs.ocr.model" in str(info.value)


def test_unknown_engine_names_the_keyword():
    with pytest.raises(ValueError, match="reward_kwargs.ocr.engine"):
        get_reward("ocr", engine="tesseract")


def tiny_got_ocr2(forced_word: str):
    """A random GOT-OCR2 (1-layer SAM-style encoder on 64 px, 1 image token, 1-layer Qwen2 of width 16) with its
    processor built in memory; generation biased to repeat `forced_word`, so the text it reads is known."""
    from transformers import GotOcr2Config, GotOcr2ForConditionalGeneration, GotOcr2Processor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from ddpo_group.diffusion.qwen_image import build_tiny_qwen_tokenizer

    tokenizer = build_tiny_qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<img>", "</img>",
                                                                "<imgpad>"]})
    processor = GotOcr2Processor(image_processor=GotOcr2ImageProcessorPil(size={"height": 64, "width": 64}),
                                 tokenizer=tokenizer)
    processor.num_image_tokens = 1  # 64 px / 16 = 4x4 patches, two stride-2 convolutions: one token
    config = GotOcr2Config(
        vision_config=dict(hidden_size=16, output_channels=8, num_hidden_layers=1, num_attention_heads=2,
                           image_size=64, patch_size=16, window_size=2, mlp_dim=32, global_attn_indexes=[0]),
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512),
        image_token_index=tokenizer.convert_tokens_to_ids("<imgpad>"), image_seq_length=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GotOcr2ForConditionalGeneration(config)
    word_ids = tokenizer.encode(" " + forced_word, add_special_tokens=False)
    assert len(word_ids) == 1
    model.generation_config.sequence_bias = {tuple(word_ids): 100.0}
    return model, processor


@pytest.fixture(scope="module")
def got_reward():
    reward = get_reward("ocr", engine="got_ocr2", max_new_tokens=1)
    reward.recogniser.set_model(*tiny_got_ocr2("cat"))
    return reward


def test_got_ocr2_reads_the_image_and_the_reward_follows(got_reward):
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert got_reward.recogniser.read([Image.new("RGB", (32, 32))]) == [" cat"]
    prompts = ['a sign that says "cat"', 'a mug printed with "cart"', "a door marked 'dog'"]
    CombinedReward({"ocr": got_reward}).check_ready()  # the model is there: nothing to load
    rewards, info = got_reward(images, prompts, [{}, {}, {}])
    # read "cat": "cat" is in it (1); "cart" is one insertion away (1 - 1/4); "dog" three substitutions (0)
    np.testing.assert_allclose(rewards, [1.0, 0.75, 0.0])
    np.testing.assert_array_equal(info["exact"], [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(info["recognised_chars"], [3.0, 3.0, 3.0])


def test_got_ocr2_batches_of_the_recogniser_keep_the_order(got_reward):
    got_reward.recogniser.batch_size = 2
    try:
        texts = got_reward.recogniser.read([Image.new("RGB", (32, 32), (i * 40, 0, 0)) for i in range(5)])
    finally:
        got_reward.recogniser.batch_size = 8
    assert texts == [" cat"] * 5


# the preset -------------------------------------------------------------------------------------------------------
def test_sd35_ocr_preset_names_the_missing_prompt_file_and_passes_with_quoted_prompts(tmp_path):
    with pytest.raises(ConfigError, match="dataset/ocr/train.txt"):
        check_config(make_config(tmp_path, "sd35_ocr"))
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text('a neon sign that says "open"\na chalkboard reading "Menu"\n')
    test.write_text('a cake with "Happy Birthday" written in icing\n')
    config = make_config(tmp_path, "sd35_ocr", prompt_fn=str(train), eval_prompt_fn=str(test))
    check_config(config)
    test.write_text("a cake\n")
    with pytest.raises(ConfigError, match="config.eval_prompt_fn"):
        check_config(config)
