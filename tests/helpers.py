"""Shared fixtures of the trainer tests: configs of cheap runs, run-directory readers, and a
plain-numpy GRPO advantage written from docs/design.md §3 (independent of ddpo_group.algos)."""

import io
import json
import os
import socket
import sys

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable


def load_script(relative_path):
    """The module of a script of the repository (e.g. "benchmarks/gpu_check.py"), loaded from its file."""
    import importlib.util

    name = os.path.splitext(os.path.basename(relative_path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_config(tmp_path, variant="test", run_name="r", **overrides):
    """config/grpo.py:<variant> writing to tmp_path/run_name; overrides use dotted keys as
    keyword names with "__" for ".", e.g. sample__num_steps=2."""
    config_dir = os.path.join(ROOT, "config")
    if config_dir not in sys.path:
        sys.path.insert(0, config_dir)
    import grpo

    config = grpo.get_config(variant)
    config.logdir = str(tmp_path)
    config.run_name = run_name
    for dotted, value in overrides.items():
        *parents, field = dotted.split("__")
        node = config
        for part in parents:
            node = node[part]
        node[field] = value
    return config


def cheap(**overrides):
    """Overrides that make a run of the test variant cheap: two steps, no reference model, one epoch."""
    base = dict(
        num_epochs=1,
        sample__num_steps=2,
        train__use_reference_model=False,
        train__use_kl_loss=False,
        train__beta=0.0,
        log_images_every=0,
    )
    base.update(overrides)
    return base


def lora_round_trip(tmp_path, variant, build_pipeline, sample):
    """Train `variant` one epoch with LoRA rank 2 and a KL to the reference, then check what a family's LoRA export
    must give: the adapters of checkpoint_1 load into a fresh pipeline (diffusers' load_lora_weights) and through the
    family's own loader into a fresh LoRA module, and both sample what the trained policy samples (to 1e-5), which
    differs from the untrained model's. sample(policy) -> samples from fixed noise; build_pipeline(seed=0) -> the
    variant's tiny pipeline. Returns (config, trainer, run_dir, trained samples) for more checks."""
    import torch

    from ddpo_group.diffusion.policy import policy_for
    from ddpo_group.training.trainer import Trainer

    config = make_config(tmp_path, variant=variant, **cheap(
        train__learning_rate=3e-2, use_lora=True, lora_rank=2, train__use_reference_model=True,
        train__use_kl_loss=True, train__beta=0.01,
    ))
    trainer = Trainer(config)
    run_dir = trainer.run()
    assert read_metrics(run_dir)[0]["kl"] >= 0
    checkpoint = os.path.join(run_dir, "checkpoints", "checkpoint_1")
    fresh = build_pipeline(seed=0)
    fresh.load_lora_weights(os.path.join(checkpoint, "lora"))
    trained, loaded = sample(trainer.policy), sample(policy_for(fresh))
    base = sample(policy_for(build_pipeline(seed=0)))
    assert (trained - base).abs().max() > 1e-4  # training moved the adapters
    assert (loaded - trained).abs().max() < 1e-5
    again = policy_for(build_pipeline(seed=0))
    module = again.prepare("cpu", torch.float32, use_lora=True, lora_rank=2)
    again.load_trainable(module, checkpoint, use_lora=True)
    assert (sample(again) - trained).abs().max() < 1e-5
    return config, trainer, run_dir, trained


def tiny_clip_model(seed=0, **config):
    """A random tiny CLIPModel (eval mode) over the tiny tokenizer's vocabulary, 32 px images; `config`: more
    CLIPConfig fields (e.g. logit_scale_init_value)."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    from ddpo_group.diffusion.tiny import tiny_tokenizer_vocab

    torch.manual_seed(seed)
    return CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=len(tiny_tokenizer_vocab()[0]), hidden_size=32, intermediate_size=37,
                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=37,
                           num_hidden_layers=1, num_attention_heads=2),
        projection_dim=16, **config,
    )).eval()


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_dump(run_dir, epoch=0, rank=0):
    return read_json(os.path.join(run_dir, "debug", f"epoch_{epoch:04d}_rank{rank}.json"))


def grpo_advantages_numpy(rewards, prompt_ids, mask, clip, eps=1e-6):
    """A[i, t] = clip((R_i - mean_g) / (std_g + eps)) * mask[i, t] over groups g of equal prompt id,
    population std; a group of one uses mean 0 and std 1 (docs/design.md §3). Plain loops."""
    rewards = [float(r) for r in rewards]
    prompt_ids = [int(p) for p in prompt_ids]
    mask = np.asarray(mask, dtype=np.float64)
    out = np.zeros_like(mask)
    for i, (reward, pid) in enumerate(zip(rewards, prompt_ids)):
        group = [r for r, p in zip(rewards, prompt_ids) if p == pid]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = (sum((r - mean) ** 2 for r in group) / len(group)) ** 0.5
        value = (reward - mean) / (std + eps)
        value = min(max(value, -clip), clip)
        out[i] = value * mask[i]
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra):
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


def pil_jpeg_kb(pixels):
    """JPEG size at quality 95 in kB (bytes / 1000) of each (H, W, 3) uint8 image, computed with PIL."""
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=95)
        sizes.append(len(buffer.getvalue()) / 1000)
    return np.array(sizes)
