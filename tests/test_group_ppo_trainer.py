"""Group-PPO in the trainer (docs/design.md §4): the training pass runs the UNet at the K shared
endpoints instead of the T steps, logs the grouping metrics, trains the critic and checkpoints
the adaptive threshold.

With T = 4 steps, max_group_size = 2 and a variance threshold far below any reachable
r_grpo / r_ppo ratio, Algorithm 2 closes segments by length only: [0, 1], [2, 3], so the
endpoints are steps 1 and 3 (K = 2) for every trajectory.
"""

import math
import os
import types

import pytest
import torch

from ddpo_group.training.trainer import Trainer
from helpers import cheap, make_config, read_json, read_metrics

pytestmark = pytest.mark.slow

T, K, MICRO_BATCHES = 4, 2, 2  # 4 trajectories / train.batch_size 2
THRESHOLD, MIN_THRESHOLD, THRESHOLD_LR, TARGET = 2e-9, 1e-9, 0.01, 0.75


def run_group_ppo(tmp_path, actor_tokens, accumulation=MICRO_BATCHES, **overrides):
    # accumulation = MICRO_BATCHES: one optimizer step per epoch, so pi_old needs no extra pass
    config = make_config(
        tmp_path,
        **cheap(
            **overrides,
            sample__num_steps=T,
            reward_fn="jpeg_compressibility",
            algorithm__adv_estimator="group_ppo",
            train__timestep_selection=actor_tokens,
            group_ppo__max_group_size=2,
            group_ppo__variance_threshold=THRESHOLD,
            group_ppo__min_threshold=MIN_THRESHOLD,
            group_ppo__threshold_lr=THRESHOLD_LR,
            group_ppo__target_compression=TARGET,
            train__gradient_accumulation_steps=accumulation,
        ),
    )
    trainer = Trainer(config)
    record = types.SimpleNamespace(in_train=False, grad_calls=[], samples=None, epoch=None,
                                   counted_epoch=config.num_epochs - 1, critic_masks=[])

    def count_calls(module, args, kwargs, output):
        if record.in_train and torch.is_grad_enabled() and record.epoch == record.counted_epoch:
            timesteps = args[1] if len(args) > 1 else kwargs["timestep"]
            record.grad_calls.append(sorted(set(torch.as_tensor(timesteps).flatten().tolist())))

    handle = trainer.trainable_module.register_forward_hook(count_calls, with_kwargs=True)
    train_epoch = trainer.train_epoch

    def recording_train_epoch(samples, epoch, metrics):
        record.samples = samples
        record.epoch = epoch
        record.in_train = True
        try:
            return train_epoch(samples, epoch, metrics)
        finally:
            record.in_train = False

    update_critic = trainer.update_critic

    def recording_update_critic(samples, epoch, metrics):
        record.critic_masks.append(samples.critic_mask.clone())
        return update_critic(samples, epoch, metrics)

    trainer.train_epoch = recording_train_epoch
    trainer.update_critic = recording_update_critic
    try:
        trainer.run()
    finally:
        handle.remove()
    record.run_dir = trainer.run_dir
    record.rows = read_metrics(trainer.run_dir)
    record.metrics = record.rows[0]
    return record


@pytest.fixture(scope="module")
def endpoints_run(tmp_path_factory):
    return run_group_ppo(tmp_path_factory.mktemp("endpoints"), "endpoints")


@pytest.fixture(scope="module")
def all_steps_run(tmp_path_factory):
    return run_group_ppo(tmp_path_factory.mktemp("all"), "all")


def test_endpoints_are_the_length_limited_segment_ends(endpoints_run):
    endpoint_mask = endpoints_run.samples.endpoint_mask
    expected = torch.zeros(4, T, dtype=torch.bool)
    expected[:, [1, 3]] = True
    assert torch.equal(endpoint_mask.bool().cpu(), expected)


def test_training_pass_runs_the_unet_at_the_endpoints_only(endpoints_run):
    samples = endpoints_run.samples
    columns = samples.endpoint_mask.any(dim=0).nonzero().flatten().tolist()
    assert len(columns) == K < T
    assert len(endpoints_run.grad_calls) == K * MICRO_BATCHES
    # each call is one endpoint step of the whole micro-batch (same scheduler timestep for every row)
    endpoint_timesteps = [[int(samples.timesteps[0, k])] for k in columns]
    assert endpoints_run.grad_calls == endpoint_timesteps * MICRO_BATCHES


def test_pi_old_is_recomputed_at_the_endpoints_only(tmp_path):
    # one optimizer step per micro-batch: the second micro-batch's pi_old is computed before the
    # first step, by one more UNet call per endpoint (and at no other step)
    run = run_group_ppo(tmp_path, "endpoints", accumulation=1)
    columns = run.samples.endpoint_mask.any(dim=0).nonzero().flatten().tolist()
    endpoint_timesteps = [[int(run.samples.timesteps[0, k])] for k in columns]
    assert run.grad_calls == endpoint_timesteps * (MICRO_BATCHES + 1)
    assert run.metrics["train/unet_calls"] == K * MICRO_BATCHES


def test_actor_tokens_all_trains_every_step(all_steps_run):
    samples = all_steps_run.samples
    assert len(all_steps_run.grad_calls) == T * MICRO_BATCHES
    assert all_steps_run.grad_calls == [[int(t)] for t in samples.timesteps[0]] * MICRO_BATCHES


def test_grouping_metrics_are_logged(endpoints_run):
    row = endpoints_run.metrics
    # N = 4 x 4 valid steps, 4 x 2 endpoints, 4 trajectories
    assert row["group/compression_ratio"] == pytest.approx(1 - 8 / 16)
    assert row["group/num_endpoints"] == pytest.approx(2.0)
    assert row["group/mean_segment_len"] == pytest.approx(2.0)
    assert row["group/efficiency_gain"] == pytest.approx(2.0)
    assert row["group/threshold"] == pytest.approx(THRESHOLD)  # the threshold this batch was grouped with


def test_critic_value_loss_is_logged(endpoints_run, all_steps_run):
    for run in (endpoints_run, all_steps_run):
        assert math.isfinite(run.metrics["critic/value_loss"])
        assert run.metrics["critic/value_loss"] >= 0


def test_adaptive_threshold_state_is_checkpointed(endpoints_run):
    state = read_json(os.path.join(endpoints_run.run_dir, "checkpoints", "checkpoint_1", "trainer_state.json"))
    compression = 1 - 8 / 16
    expected = max(THRESHOLD * math.exp(THRESHOLD_LR * (compression - TARGET)), MIN_THRESHOLD)
    assert state["threshold"]["threshold"] == pytest.approx(expected, rel=1e-12)
    assert state["threshold"]["num_updates"] == 1


def test_segment_sample_trains_one_step_inside_each_segment(tmp_path):
    run = run_group_ppo(tmp_path, "segment_sample")
    timesteps = run.samples.timesteps[0].tolist()
    segments = [{timesteps[0], timesteps[1]}, {timesteps[2], timesteps[3]}]  # [0, 1], [2, 3] (length-limited)
    assert len(run.grad_calls) == K * MICRO_BATCHES
    for n, call in enumerate(run.grad_calls):
        assert call[0] in segments[n % K]


def test_early_selection_trains_the_first_steps_only(tmp_path):
    from helpers import cheap as cheap_overrides

    config = make_config(tmp_path, **cheap_overrides(sample__num_steps=4, train__timestep_selection="early",
                                                     train__early_steps=2, reward_fn="jpeg_compressibility"))
    trainer = Trainer(config)
    calls = []
    handle = trainer.trainable_module.register_forward_hook(
        lambda module, args, kwargs, output: calls.append(int(torch.as_tensor(args[1]).flatten()[0]))
        if torch.is_grad_enabled() else None,
        with_kwargs=True,
    )
    try:
        trainer.run()
    finally:
        handle.remove()
    first_two = trainer.policy.pipeline.scheduler.timesteps[:2].tolist()
    assert calls and set(calls) == set(first_two)


def test_segment_start_trains_the_first_step_of_each_segment(tmp_path):
    run = run_group_ppo(tmp_path, "segment_start")
    timesteps = run.samples.timesteps[0].tolist()
    # segments [0, 1], [2, 3] (length-limited): their first steps are 0 and 2
    assert run.grad_calls == [[timesteps[0]], [timesteps[2]]] * MICRO_BATCHES
    assert run.metrics["steps/trained"] == [1, 0, 1, 0]


def test_critic_trains_at_endpoints_or_at_every_valid_step(endpoints_run, tmp_path):
    assert endpoints_run.critic_masks[0].bool().cpu().equal(endpoints_run.samples.endpoint_mask.bool().cpu())
    run = run_group_ppo(tmp_path, "endpoints", critic__train_steps="all")
    assert run.critic_masks[0].cpu().equal(run.samples.mask.cpu())


def test_critic_warmup_epochs_train_the_critic_and_not_the_actor(tmp_path):
    run = run_group_ppo(tmp_path, "endpoints", num_epochs=2, critic__warmup_epochs=1)
    warmup, trained = run.rows[0], run.rows[1]
    assert "train/unet_calls" not in warmup and "steps/trained" not in warmup
    assert math.isfinite(warmup["critic/value_loss"]) and len(run.critic_masks) == 2
    assert trained["train/unet_calls"] == K * MICRO_BATCHES and run.grad_calls  # epoch 1 trains the actor


def test_the_default_design_samples_noise_and_trains_only_at_the_first_step(tmp_path):
    # tiny_group_ppo's fields (docs/group_ppo.md): a 1-step SDE window at step 0, segment_start, per-prompt norm
    from ddpo_group.config import grpo

    default = grpo.get_config("tiny_group_ppo")
    fields = {
        "sample__sde_window_size": default.sample.sde_window_size,
        "sample__sde_window_start": default.sample.sde_window_start,
        "group_ppo__advantage_norm": default.group_ppo.advantage_norm,
    }
    assert fields == {"sample__sde_window_size": 1, "sample__sde_window_start": 0, "group_ppo__advantage_norm": "group"}
    assert default.train.timestep_selection == "segment_start" and default.train.use_kl_loss
    run = run_group_ppo(tmp_path, default.train.timestep_selection, **fields)
    # only step 0 has a density (the others are eta-0 DDIM steps): it alone is trained, once per micro-batch
    assert run.samples.mask.cpu().tolist() == [[1, 0, 0, 0]] * 4
    assert run.grad_calls == [[run.samples.timesteps[0, 0].item()]] * MICRO_BATCHES
    assert run.metrics["steps/trained"] == [1, 0, 0, 0]
    # per-prompt normalised: each prompt group's advantages at step 0 have mean 0
    advantages = run.samples.advantages[:, 0].cpu()
    for prompt in run.samples.prompt_ids.unique():
        group = advantages[run.samples.prompt_ids.cpu() == prompt]
        assert abs(float(group.mean())) < 1e-5


def test_algorithm2_variant_is_algorithm2_as_written():
    from ddpo_group.config import grpo

    for name in ("tiny_group_ppo_alg2", "group_ppo_alg2"):
        config = grpo.get_config(name)
        assert config.algorithm.adv_estimator == "group_ppo" and config.train.timestep_selection == "endpoints"
        assert config.sample.sde_window_size == 0 and config.group_ppo.advantage_norm == "whiten"
        assert not config.train.use_kl_loss and not config.train.use_reference_model
