"""The epoch loop (docs/design.md §7) end to end on the random-weight tiny pipeline.

Each module-scoped fixture is one real run, shared by the tests that read it:
a GRPO run with the debug dump, a LoRA + "ddpo" run that is resumed, and small runs for
NaN handling, SIGTERM and the gradient of per-step back-propagation.
"""

import copy
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import time
import types

import numpy as np
import pytest
import torch

from ddpo_group.algos.losses import agg_loss, gaussian_kl, get_policy_loss
from ddpo_group.diffusion.sd import step_log_prob
from ddpo_group.diffusion.tiny import build_tiny_pipeline
from ddpo_group.rewards.registry import RewardError
from ddpo_group.training.trainer import CheckpointError, Trainer, find_checkpoint, train
from helpers import (
    PYTHON,
    ROOT,
    cheap,
    grpo_advantages_numpy,
    make_config,
    read_dump,
    read_json,
    read_metrics,
    subprocess_env,
)

pytestmark = pytest.mark.slow

REQUIRED_METRICS = (
    "epoch", "num_processes", "num_samples", "reward_mean", "reward_std", "kl", "clipfrac", "approx_kl",
    "loss", "time/sample", "time/reward", "time/train", "peak_rss_mb",
)


# a GRPO run with the debug dump
@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """6 trajectories (2 prompts x group_size 3), 4 steps, reference + KL, 1 epoch, advantages clipped at 1."""
    tmp = tmp_path_factory.mktemp("grpo")
    config = make_config(
        tmp, num_epochs=1, debug_dump=True, reward_fn="jpeg_compressibility",
        sample__batch_size=6, sample__group_size=3, train__batch_size=3, train__adv_clip_max=1.0,
    )
    handler_before = signal.getsignal(signal.SIGINT)
    run_dir = train(config)
    return types.SimpleNamespace(
        run_dir=run_dir, config=config, handler_before=handler_before, handler_after=signal.getsignal(signal.SIGINT)
    )


def test_run_writes_the_run_directory(grpo_run):
    run_dir = grpo_run.run_dir
    assert run_dir == os.path.join(grpo_run.config.logdir, "r")
    for name in ("config.json", "metrics.jsonl", "samples/epoch_0000.png", "samples/epoch_0000.json",
                 "checkpoints/checkpoint_1/trainer_state.json", "debug/epoch_0000_rank0.json"):
        assert os.path.isfile(os.path.join(run_dir, name)), name
    assert not [n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.startswith(".tmp")]


def test_config_json_is_the_run_config(grpo_run):
    saved = read_json(os.path.join(grpo_run.run_dir, "config.json"))
    assert saved == json.loads(json.dumps(grpo_run.config.to_dict()))
    assert saved["sample"]["group_size"] == 3


def test_final_checkpoint_state(grpo_run):
    state = read_json(os.path.join(grpo_run.run_dir, "checkpoints", "checkpoint_1", "trainer_state.json"))
    assert state["epoch"] == 1
    assert state["global_step"] == 2  # 6 trajectories / train.batch_size 3, one optimizer step each
    assert state["skipped_steps"] == 0


def test_metrics_rows_have_the_required_keys(grpo_run):
    rows = read_metrics(grpo_run.run_dir)
    assert [row["epoch"] for row in rows] == [0]
    for key in REQUIRED_METRICS:
        assert key in rows[0], key
        assert math.isfinite(rows[0][key]), key
    assert rows[0]["num_processes"] == 1
    assert rows[0]["num_samples"] == 6


def test_reward_mean_and_std_match_the_dumped_rewards(grpo_run):
    row = read_metrics(grpo_run.run_dir)[0]
    rewards = read_dump(grpo_run.run_dir)["rewards"]
    assert len(rewards) == 6
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))  # population std
    assert row["reward_mean"] == pytest.approx(mean, rel=1e-6, abs=1e-9)
    assert row["reward_std"] == pytest.approx(std, rel=1e-5, abs=1e-9)
    assert row["reward/jpeg_compressibility"] == pytest.approx(mean, rel=1e-6, abs=1e-9)


def test_groups_hold_group_size_copies(grpo_run):
    prompt_ids = read_dump(grpo_run.run_dir)["prompt_ids"]
    counts = {pid: prompt_ids.count(pid) for pid in set(prompt_ids)}
    assert sum(counts.values()) == 6
    assert all(count % 3 == 0 for count in counts.values())


def test_advantages_are_clipped_grpo_of_the_dumped_rewards(grpo_run):
    dump = read_dump(grpo_run.run_dir)
    expected = grpo_advantages_numpy(dump["rewards"], dump["prompt_ids"], dump["mask"], clip=1.0)
    advantages = np.asarray(dump["advantages"])
    assert advantages.shape == (6, 4)
    # float32 in the trainer: (r - mean) / std of close rewards carries an error of order 1e-5
    np.testing.assert_allclose(advantages, expected, rtol=0, atol=2e-4)
    # three members per group: some z-scores reach the clip, some do not
    assert np.any(np.abs(advantages) == 1.0) and np.any((np.abs(advantages) < 0.999) & (advantages != 0))


def test_signal_handlers_are_restored_after_the_run(grpo_run):
    assert grpo_run.handler_after is grpo_run.handler_before


# resume (LoRA, ddpo tracker)
@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """2 epochs with a checkpoint after each, then a new Trainer resumes the run up to 3 epochs."""
    tmp = tmp_path_factory.mktemp("resume")
    overrides = cheap(
        num_epochs=2, save_freq=1, use_lora=True, train__learning_rate=1e-2,
        algorithm__adv_estimator="ddpo", reward_fn="jpeg_compressibility",
    )
    run_dir = train(make_config(tmp, **overrides))
    before = tmp / "before_resume"
    shutil.copytree(run_dir, before)
    saved_state = read_json(os.path.join(run_dir, "checkpoints", "checkpoint_2", "trainer_state.json"))

    overrides.update(num_epochs=3, resume_from=run_dir)
    trainer = Trainer(make_config(tmp, **overrides))
    at_start = dict(
        first_epoch=trainer.first_epoch,
        global_step=trainer.global_step,
        tracker=json.loads(json.dumps(trainer.trackers["reward"].state_dict(), default=float)),
        unet_out=_unet_out(trainer.trainable_module, _unet_inputs(trainer.trainable_module)),
    )
    trainer.run()
    return types.SimpleNamespace(
        run_dir=run_dir, before=str(before), saved_state=saved_state, at_start=at_start, trainer=trainer,
        overrides=overrides, tmp=tmp,
    )


def test_resume_starts_at_the_saved_epoch(resumed):
    assert resumed.saved_state["epoch"] == 2
    assert resumed.at_start["first_epoch"] == 2


def test_resume_writes_each_epoch_once(resumed):
    assert [row["epoch"] for row in read_metrics(resumed.run_dir)] == [0, 1, 2]


def test_resume_continues_the_global_step(resumed):
    # 4 trajectories, train.batch_size 2: two optimizer steps per epoch
    assert resumed.saved_state["global_step"] == 4
    assert resumed.at_start["global_step"] == 4
    assert [row["global_step"] for row in read_metrics(resumed.run_dir)] == [2, 4, 6]
    final = read_json(os.path.join(resumed.run_dir, "checkpoints", "checkpoint_3", "trainer_state.json"))
    assert (final["epoch"], final["global_step"]) == (3, 6)


def test_resume_restores_the_tracker(resumed):
    assert resumed.saved_state["trackers"]["reward"]
    assert resumed.at_start["tracker"] == resumed.saved_state["trackers"]["reward"]


def test_resume_from_a_checkpoint_directory(resumed, tmp_path):
    run_copy = tmp_path / "run"
    shutil.copytree(resumed.before, run_copy)
    overrides = dict(resumed.overrides, resume_from=str(run_copy / "checkpoints" / "checkpoint_1"))
    trainer = Trainer(make_config(tmp_path, **overrides))
    assert (trainer.first_epoch, trainer.global_step) == (1, 2)
    assert trainer.run_dir == str(run_copy)
    # the rows of the epochs the resumed run will redo are dropped
    assert [row["epoch"] for row in read_metrics(run_copy)] == [0]


@pytest.mark.parametrize("name", ["trainer_state.json", "optimizer.bin"])
def test_corrupt_checkpoint_names_the_file(resumed, tmp_path, name):
    run_copy = tmp_path / "run"
    shutil.copytree(resumed.before, run_copy)
    path = run_copy / "checkpoints" / "checkpoint_2" / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])  # truncated, as by a full disk or a killed copy
    overrides = dict(resumed.overrides, resume_from=str(run_copy))
    with pytest.raises(CheckpointError) as info:
        Trainer(make_config(tmp_path, **overrides))
    assert str(path) in str(info.value)


def test_leftover_tmp_checkpoint_is_never_picked(resumed, tmp_path):
    run_copy = tmp_path / "run"
    shutil.copytree(resumed.before, run_copy)
    leftover = run_copy / "checkpoints" / ".tmp_checkpoint_5"
    shutil.copytree(run_copy / "checkpoints" / "checkpoint_2", leftover)
    (leftover / "trainer_state.json").write_text(json.dumps({"epoch": 5, "global_step": 10}))
    checkpoint, state, _ = find_checkpoint(str(run_copy))
    assert checkpoint == str(run_copy / "checkpoints" / "checkpoint_2")
    assert state["epoch"] == 2


def _unet_inputs(unet, seed=0):
    generator = torch.Generator().manual_seed(seed)
    c = unet.config
    sample = torch.randn(2, c.in_channels, c.sample_size, c.sample_size, generator=generator)
    hidden = torch.randn(2, 7, c.cross_attention_dim, generator=generator)
    return sample, torch.tensor([801, 301]), hidden


def _unet_out(unet, inputs):
    sample, timesteps, hidden = inputs
    with torch.no_grad():
        return unet(sample, timesteps, encoder_hidden_states=hidden, return_dict=False)[0]


def test_resume_restores_the_lora_weights(resumed):
    pipe = build_tiny_pipeline()
    pipe.load_lora_weights(os.path.join(resumed.before, "checkpoints", "checkpoint_2", "lora"))
    inputs = _unet_inputs(pipe.unet)
    torch.testing.assert_close(resumed.at_start["unet_out"], _unet_out(pipe.unet, inputs), rtol=1e-5, atol=1e-6)


def test_lora_checkpoint_loads_into_a_fresh_pipeline(resumed):
    lora_dir = os.path.join(resumed.run_dir, "checkpoints", "checkpoint_3", "lora")
    assert os.path.isdir(lora_dir)
    trained = resumed.trainer.trainable_module.eval()
    inputs = _unet_inputs(trained)
    pipe = build_tiny_pipeline()
    base_out = _unet_out(pipe.unet, inputs)
    pipe.load_lora_weights(lora_dir)
    loaded_out = _unet_out(pipe.unet, inputs)
    trained_out = _unet_out(trained, inputs)
    assert not torch.allclose(trained_out, base_out, atol=1e-5), "training did not move the LoRA weights"
    torch.testing.assert_close(loaded_out, trained_out, rtol=1e-5, atol=1e-6)


# NaN safety
def test_nan_reward_stops_the_run_naming_reward_and_prompt(tmp_path):
    marker = tmp_path / "nan_from_now_on"
    plugin = tmp_path / "nan_plugin.py"
    plugin.write_text(
        "import os\n"
        "import numpy as np\n\n\n"
        "def nan_after_first_epoch(images, prompts, metadata):\n"
        "    rewards = images.float().mean(dim=(1, 2, 3)).numpy().astype(np.float64)\n"
        f"    if os.path.exists({str(marker)!r}):\n"
        "        rewards[1] = float('nan')\n"
        "    return rewards, {}\n"
    )
    config = make_config(tmp_path, **cheap(num_epochs=2, reward_fn=f"{plugin}:nan_after_first_epoch"))
    trainer = Trainer(config)
    log_epoch = trainer.log_epoch

    def log_then_break_the_reward(epoch, samples, metrics):
        log_epoch(epoch, samples, metrics)
        marker.touch()

    trainer.log_epoch = log_then_break_the_reward
    with pytest.raises(RewardError) as info:
        trainer.run()
    err = info.value
    assert "nan_after_first_epoch" in str(err)
    assert err.index == 1
    assert err.prompt in {record.prompt for record in trainer.prompts}
    assert repr(err.prompt) in str(err)
    assert [row["epoch"] for row in read_metrics(trainer.run_dir)] == [0]


def test_nan_loss_skips_the_optimizer_step(tmp_path):
    # 4 trajectories, train.batch_size 2: two micro-batches, two optimizer steps; the first one's loss is NaN
    # jpeg sizes differ between any two images, so every advantage, and the taken step, is non-zero
    trainer = Trainer(make_config(tmp_path, **cheap(reward_fn="jpeg_compressibility")))
    snapshots = []
    policy_loss = trainer.policy_loss

    @functools.wraps(policy_loss)  # the registered loss's properties (reads_drift, couples_steps) come along
    def nan_in_first_micro_batch(*args, **kwargs):
        loss, metrics = policy_loss(*args, **kwargs)
        return (loss * float("nan") if not snapshots else loss), metrics

    optimizer_step = trainer._optimizer_step

    def recording_optimizer_step(bad):
        before = [p.detach().clone() for p in trainer.trainable_params]
        result = optimizer_step(bad)
        snapshots.append((before, [p.detach().clone() for p in trainer.trainable_params]))
        return result

    trainer.policy_loss = nan_in_first_micro_batch
    trainer._optimizer_step = recording_optimizer_step
    trainer.run()

    assert len(snapshots) == 2
    skipped_before, skipped_after = snapshots[0]
    assert all(torch.equal(a, b) for a, b in zip(skipped_before, skipped_after))
    taken_before, taken_after = snapshots[1]
    assert any(not torch.equal(a, b) for a, b in zip(taken_before, taken_after))
    assert all(torch.isfinite(p).all() for p in taken_after)
    row = read_metrics(trainer.run_dir)[0]
    assert row["train/skipped_steps"] == 1
    assert row["global_step"] == 1


# SIGTERM
def test_sigterm_writes_a_final_checkpoint_and_exits(tmp_path):
    run_dir = tmp_path / "r"
    command = [
        PYTHON, os.path.join(ROOT, "scripts", "train.py"), "--config", "config/grpo.py:test",
        "--config.num_epochs=50", f"--config.logdir={tmp_path}", "--config.run_name=r", "--config.save_freq=0",
        "--config.sample.num_steps=2", "--config.train.use_reference_model=False",
        "--config.train.use_kl_loss=False", "--config.log_images_every=0",
    ]
    with open(tmp_path / "log.txt", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            metrics = run_dir / "metrics.jsonl"
            while not (metrics.exists() and metrics.read_text().strip()):
                assert process.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
                assert time.monotonic() < deadline, "no epoch finished in time"
                time.sleep(0.5)
            process.send_signal(signal.SIGTERM)
            returncode = process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    # not a finished run: exit 128 + SIGTERM as the shell reports it, stopped.json marks the run, one line says how to go on
    log_text = (tmp_path / "log.txt").read_text()
    assert returncode == 128 + signal.SIGTERM, log_text[-3000:]
    epochs_done = len(read_metrics(run_dir))
    assert 1 <= epochs_done < 50
    checkpoints = os.listdir(run_dir / "checkpoints")
    assert checkpoints == [f"checkpoint_{epochs_done}"]  # no .tmp_ directory left
    state = read_json(run_dir / "checkpoints" / f"checkpoint_{epochs_done}" / "trainer_state.json")
    assert state["epoch"] == epochs_done
    assert state["global_step"] == 2 * epochs_done
    stopped = read_json(run_dir / "stopped.json")
    assert stopped["signal"] == signal.SIGTERM and stopped["epoch"] == epochs_done
    assert f"resume with --config.resume_from={run_dir}" in log_text
    # a resume that finishes clears the mark
    train(make_config(tmp_path, num_epochs=epochs_done + 1, save_freq=0, sample__num_steps=2, log_images_every=0,
                      train__use_reference_model=False, train__use_kl_loss=False, resume_from=str(run_dir)))
    assert not (run_dir / "stopped.json").exists()


# per-step backward = whole-loss gradient
def _perturb(params, seed, scale):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in params:
            param.add_(scale * torch.randn(param.shape, generator=generator).to(param.device))


@pytest.mark.parametrize("old_log_probs", ["sampled", "recompute"])
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_per_step_backward_equals_the_whole_loss_gradient(tmp_path, monkeypatch, policy_loss, old_log_probs):
    beta, clip = 0.5, 0.5
    config = make_config(
        tmp_path, num_epochs=1, reward_fn="jpeg_compressibility", sample__num_steps=3,
        sample__batch_size=2, sample__group_size=2, train__batch_size=2,  # one micro-batch
        train__policy_loss=policy_loss, train__use_reference_model=True, train__use_kl_loss=True,
        train__beta=beta, train__kl_type="gaussian", train__loss_agg_mode="token-mean",
        train__clip_range=clip, train__max_grad_norm=1e12, train__old_log_probs=old_log_probs,
    )
    trainer = Trainer(config)
    metrics = {}
    samples = trainer.sample_epoch(0, metrics)
    trainer.compute_advantages(samples, metrics)
    unet = trainer.trainable_module
    reference_unet = copy.deepcopy(unet).requires_grad_(False)  # the initial policy = pi_ref = pi_old
    _perturb(trainer.trainable_params, seed=1, scale=5e-4)  # pi_theta differs from pi_old and pi_ref

    captured = {}

    def capture_gradient(*args, **kwargs):
        captured.update({name: p.grad.detach().clone() for name, p in unet.named_parameters() if p.requires_grad})

    monkeypatch.setattr(trainer.optimizer, "step", capture_gradient)
    trainer.train_epoch(samples, 0, metrics)
    assert captured and metrics["kl"] > 0

    # the same loss as one autograd graph over the whole (b, T) matrix
    unet.zero_grad(set_to_none=True)
    scheduler = trainer.policy.pipeline.scheduler
    gs, eta = config.sample.guidance_scale, config.sample.eta
    T = samples.log_probs.shape[1]
    log_probs, kls = [], []
    for k in range(T):
        args = (samples.latents[:, k], samples.latents[:, k + 1], samples.timesteps[:, k],
                samples.prompt_embeds, samples.negative_prompt_embeds, gs, eta)
        log_prob, mean, std = step_log_prob(unet, scheduler, *args)
        with torch.no_grad():
            _, ref_mean, _ = step_log_prob(reference_unet, scheduler, *args)
        log_probs.append(log_prob)
        kls.append(gaussian_kl(mean, ref_mean, std))
    log_probs, kls = torch.stack(log_probs, 1), torch.stack(kls, 1)
    mask = samples.mask.float()
    assert torch.equal(mask, torch.ones_like(mask))
    assert (log_probs - samples.log_probs).abs().max() < 0.4  # unclipped ratios: the policy term has a gradient
    loss_config = types.SimpleNamespace(
        clip_ratio=clip, clip_ratio_low=clip, clip_ratio_high=clip, clip_ratio_c=3.0, loss_agg_mode="token-mean"
    )
    # pi_old: the stored log-probs, or (recompute, one micro-batch before any optimizer step) the
    # current weights' own log-probs, i.e. an on-policy ratio of 1
    old = samples.log_probs.float() if old_log_probs == "sampled" else log_probs.detach()
    loss, _ = get_policy_loss(policy_loss)(old, log_probs, samples.advantages, mask, loss_config)
    loss = loss + beta * agg_loss(kls * mask, mask, "token-mean")
    loss.backward()

    expected = torch.cat([p.grad.flatten() for name, p in unet.named_parameters() if p.requires_grad])
    got = torch.cat([captured[name].flatten() for name, p in unet.named_parameters() if p.requires_grad])
    assert expected.norm() > 0
    assert (got - expected).norm() / expected.norm() < 1e-4


# several rewards, each normalised in its group before the weighted sum (MixGRPO)
def test_normalize_then_sum_adds_per_reward_group_advantages(tmp_path):
    weights = {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5}
    config = make_config(
        tmp_path, **cheap(
            debug_dump=True, sample__batch_size=6, sample__group_size=3, train__batch_size=3,
            train__adv_clip_max=100.0, reward_aggregation="normalize_then_sum",
        )
    )
    config.reward_weights = weights
    run_dir = train(config)
    dump = read_dump(run_dir)
    mask = np.asarray(dump["mask"])
    expected = sum(
        weight * grpo_advantages_numpy(dump["components"][name], dump["prompt_ids"], mask, clip=1e9)
        for name, weight in weights.items()
    )
    np.testing.assert_allclose(np.asarray(dump["advantages"]), expected, atol=2e-4)
    # the weighted sum of rewards (logged as reward_mean) is not what was normalised
    row = read_metrics(run_dir)[0]
    total = [c + 0.5 * i for c, i in zip(dump["components"]["jpeg_compressibility"], dump["components"]["jpeg_incompressibility"])]
    assert row["reward_mean"] == pytest.approx(sum(total) / len(total), rel=1e-5)
