"""The OCR reward and the VLM judge in training: two epochs of the tiny SD3 pipeline (sd35_ocr's family) with the
real reward code paths: GOT-OCR2 loaded with from_pretrained from a directory holding a tiny random model, and the
judge over a local chat-completions server (tests/test_judge_reward.py's ChatServer)."""

import math

import pytest
import torch

from ddpo_group.training.trainer import train
from helpers import cheap, make_config, read_metrics
from test_judge_reward import ChatServer


def save_tiny_got_ocr2(directory):
    """A random GOT-OCR2 shaped as the real one's input (256 image tokens: 256 px, 4-px patches, two stride-2
    convolutions) but 1 layer of width 8 / 16, and its processor, written with save_pretrained."""
    from transformers import GotOcr2Config, GotOcr2ForConditionalGeneration, GotOcr2Processor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from ddpo_group.diffusion.qwen_image import build_tiny_qwen_tokenizer

    tokenizer = build_tiny_qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<img>", "</img>",
                                                                "<imgpad>"]})
    processor = GotOcr2Processor(image_processor=GotOcr2ImageProcessorPil(size={"height": 256, "width": 256}),
                                 tokenizer=tokenizer)
    config = GotOcr2Config(
        vision_config=dict(hidden_size=8, output_channels=8, num_hidden_layers=1, num_attention_heads=1,
                           image_size=256, patch_size=4, window_size=8, mlp_dim=16, global_attn_indexes=[]),
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024),
        image_token_index=tokenizer.convert_tokens_to_ids("<imgpad>"), image_seq_length=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        GotOcr2ForConditionalGeneration(config).save_pretrained(directory)
    processor.save_pretrained(directory)


def test_two_epochs_with_the_ocr_reward_of_a_got_ocr2_loaded_from_a_directory(tmp_path):
    save_tiny_got_ocr2(tmp_path / "got")
    prompts = tmp_path / "ocr.txt"
    prompts.write_text('a red sign that says "cat"\na blue square with "dog" on it\n')
    config = make_config(tmp_path, variant="tiny_sd3", reward_fn="ocr", prompt_fn=str(prompts), **cheap(
        num_epochs=2, reward_kwargs={"ocr": {"model": str(tmp_path / "got"), "max_new_tokens": 2}}))
    rows = read_metrics(train(config))
    assert [row["epoch"] for row in rows] == [0, 1]
    for row in rows:
        assert 0.0 <= row["reward_mean"] <= 1.0
        assert 0.0 <= row["reward_info/ocr/exact"] <= 1.0


def test_two_epochs_with_the_vlm_judge_over_an_endpoint(tmp_path):
    server = ChatServer({}, default={"top_logprobs": {"Yes": math.log(0.3), "No": math.log(0.6)}})
    try:
        config = make_config(tmp_path, reward_fn="vlm_judge", **cheap(num_epochs=2, reward_kwargs={
            "vlm_judge": {"url": server.url, "scoring": "yes_no", "retries": 0}}))
        rows = read_metrics(train(config))
    finally:
        server.close()
    assert [row["epoch"] for row in rows] == [0, 1]
    for row in rows:
        assert row["reward_mean"] == pytest.approx(1 / 3)  # 0.3 / (0.3 + 0.6) for every image
        assert row["reward_info/vlm_judge/unparsed"] == 0.0
    assert len(server.requests) == 2 * config.sample.batch_size * config.sample.num_batches_per_epoch


# ---- the task presets (sd35_geneval, sd35_nft_geneval, sd35_ocr; sd35_pickscore's is in test_group_rewards.py): their
# task, reward and algorithm fields as they are, the model and sizes swapped for tiny-sd3, two epochs with the real
# reward code paths (the geneval reward behind the exact shapes detector, the ocr reward on a tiny random GOT-OCR2)


def on_tiny_sd3(config, tmp_path, prompt_file):
    config.pretrained.model, config.mixed_precision, config.use_lora = "tiny-sd3", "no", False
    config.logdir, config.run_name, config.num_epochs, config.save_freq, config.log_images_every = (
        str(tmp_path), "r", 2, 0, 0)
    config.prompt_fn, config.eval_freq = str(prompt_file), 0  # a shipped file by name, or a path
    config.prompt_fn_kwargs = {}
    for key, value in dict(batch_size=4, group_size=2, num_batches_per_epoch=1, num_steps=3, resolution=0,
                           max_sequence_length=16).items():
        config.sample[key] = value
    config.train.batch_size, config.train.gradient_accumulation_steps = 2, 1
    config.forward.num_timesteps = min(config.forward.num_timesteps, 2)  # DiffusionNFT's 9 of 10 on a grid of 3
    return read_metrics(train(config))


@pytest.mark.parametrize("preset", ["sd35_geneval", "sd35_nft_geneval"])
def test_the_geneval_presets_run_two_epochs_on_tiny_sd3(tmp_path, preset):
    from ddpo_group.config import grpo

    config = grpo.get_config(preset)
    assert config.reward_fn == "geneval" and config.reward_kwargs.geneval.detector == "mask2former"
    config.reward_kwargs.geneval.detector = "shapes"  # the exact detector: no weights to download
    rows = on_tiny_sd3(config, tmp_path, "geneval_shapes_squares.jsonl")  # a shipped prompt file
    assert [row["epoch"] for row in rows] == [0, 1]
    for row in rows:
        assert 0.0 <= row["reward_mean"] <= 1.0  # the partial score of one-object prompts lies in [0, 1]
        assert "reward_info/geneval/correct" in row


def test_the_ocr_preset_runs_two_epochs_on_tiny_sd3(tmp_path):
    from ddpo_group.config import grpo

    save_tiny_got_ocr2(tmp_path / "got")
    prompts = tmp_path / "ocr.txt"
    prompts.write_text('a red sign that says "cat"\na blue square with "dog" on it\n')
    config = grpo.get_config("sd35_ocr")
    assert config.reward_fn == "ocr" and config.reward_kwargs.ocr.engine == "paddleocr"
    config.reward_kwargs.ocr = {"engine": "got_ocr2", "model": str(tmp_path / "got"), "max_new_tokens": 2}
    config.eval_prompt_fn = ""
    rows = on_tiny_sd3(config, tmp_path, prompts)
    assert [row["epoch"] for row in rows] == [0, 1]
    assert all(0.0 <= row["reward_mean"] <= 1.0 for row in rows)
