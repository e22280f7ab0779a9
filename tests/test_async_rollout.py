"""train.async_rollout (ddpo_group/training/async_rollout.py): epoch k+1 sampled in a thread while epoch k trains.

Real runs of the random-weight tiny pipeline (the `test` variant: 4 trajectories of 4 steps an epoch). A run with the
optimizer's learning rate set to 0 after the Trainer is built keeps its weights, so its samples are the initial
weights' in every epoch: the reference against which the async run's samples and ratios are read.
"""

import os
import shutil
import signal
import threading

import pytest
import torch

from ddpo_group.config.check import check_config
from ddpo_group.config.registry import ConfigError
from ddpo_group.training import perf
from ddpo_group.training.async_rollout import sampler_view
from ddpo_group.training.trainer import Trainer
from helpers import make_config, read_metrics

pytestmark = pytest.mark.slow

RATIO = "train/on_policy_max_abs_log_ratio"
NUMBERS = ("reward_mean", "reward_std", "loss", "kl", "approx_kl", "clipfrac", RATIO, "eval/reward_mean")


def _run(tmp_path, name, frozen=False, variant="test", **overrides):
    """A 3-epoch run of `variant` (frozen: the learning rate set to 0 once built); its training rows."""
    settings = dict(num_epochs=3, save_freq=0, log_images_every=0, eval_freq=0)
    settings.update(overrides)
    trainer = Trainer(make_config(tmp_path, variant=variant, run_name=name, **settings))
    if frozen:
        for group in trainer.optimizer.param_groups:
            group["lr"] = 0.0
    run_dir = trainer.run()
    return [row for row in read_metrics(run_dir) if not row.get("eval_only")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    return {
        # evaluations every epoch: the loop evaluates while the next rollout samples
        "async": _run(tmp, "async", train__async_rollout=True, eval_freq=1,
                        eval_prompt_fn="shapes_one_hard.txt", eval_images_per_prompt=4, eval_grid_prompts=0),
        "async_again": _run(tmp, "async_again", train__async_rollout=True, eval_freq=1,
                        eval_prompt_fn="shapes_one_hard.txt", eval_images_per_prompt=4, eval_grid_prompts=0),
        # the rollout in a process of its own (rank 1 of a gloo group with the trainer)
        "async_process": _run(tmp, "async_process", train__async_rollout=True, train__async_rollout_processes=1,
                              eval_freq=1, eval_prompt_fn="shapes_one_hard.txt", eval_images_per_prompt=4,
                              eval_grid_prompts=0),
        "async_frozen": _run(tmp, "async_frozen", frozen=True, train__async_rollout=True),
        "sync_frozen": _run(tmp, "sync_frozen", frozen=True),
        "sync": _run(tmp, "sync"),
    }


def test_ratio_is_exact_at_equal_weights_and_lagged_otherwise(runs):
    rows = runs["async"]
    # epoch 0 samples with a snapshot of the weights it trains: the ratio against the snapshot is exactly 1
    assert rows[0][RATIO] == 0.0
    # later epochs were sampled one epoch earlier: the ratio differs from 1 by the lag
    assert all(row[RATIO] > 0 for row in rows[1:])
    assert [row["async/sampled_with_epoch"] for row in rows] == [0, 0, 1]
    # weights that never change: every epoch's ratio against its sampling snapshot is exactly 1
    assert all(row[RATIO] == 0.0 for row in runs["async_frozen"])


def test_samples_come_from_the_snapshot_of_the_previous_epoch(runs):
    frozen, sync, lagged = runs["sync_frozen"], runs["sync"], runs["async"]
    # frozen weights: async and sync draw the same samples every epoch
    assert [r["reward_mean"] for r in runs["async_frozen"]] == [r["reward_mean"] for r in frozen]
    # epoch 1 of the async run is drawn with the initial weights (the frozen run's), not the trained ones
    assert lagged[1]["reward_mean"] == frozen[1]["reward_mean"]
    assert lagged[0]["reward_mean"] == sync[0]["reward_mean"] and lagged[0]["loss"] == sync[0]["loss"]


def test_async_runs_are_reproducible(runs):
    for first, second in zip(runs["async"], runs["async_again"]):
        assert {k: first.get(k) for k in NUMBERS} == {k: second.get(k) for k in NUMBERS}


def test_a_rollout_process_draws_what_the_thread_draws(runs):
    # weights sent to the rollout process each epoch, samples sent back: the same numbers, bit for bit
    for thread, process in zip(runs["async"], runs["async_process"]):
        assert {k: thread.get(k) for k in NUMBERS} == {k: process.get(k) for k in NUMBERS}
    assert all(row["async/rollout_seconds"] > 0 for row in runs["async_process"][1:])


def test_rollout_processes_need_async_rollout_and_are_one_at_most(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.async_rollout_processes=1 .* train\.async_rollout=True"):
        check_config(make_config(tmp_path, train__async_rollout_processes=1))
    with pytest.raises(ConfigError, match=r"train\.async_rollout_processes=2: 0 .* or 1"):
        check_config(make_config(tmp_path, train__async_rollout=True, train__async_rollout_processes=2))


def test_evaluations_run_beside_the_rollout(runs):
    assert all("eval/reward_mean" in row for row in runs["async"])


def test_lora_copies_only_the_adapters(tmp_path):
    config = make_config(tmp_path, num_epochs=2, save_freq=0, log_images_every=0, eval_freq=0, use_lora=True,
                         lora_rank=2, train__async_rollout=True)
    trainer = Trainer(config)
    snapshot = trainer.async_rollout.copies[0]
    mine = dict(trainer.trainable_module.named_parameters())
    theirs = dict(snapshot.module.named_parameters())
    assert snapshot.names and all("lora" in name for name in snapshot.names)
    for name, param in theirs.items():
        assert (param is mine[name]) == (name not in snapshot.names), name
    threads = torch.get_num_threads()
    rows = read_metrics(trainer.run())
    assert rows[0][RATIO] == 0.0 and rows[1][RATIO] > 0
    assert torch.get_num_threads() == threads  # the split between the loop and the sampler ends with the run


def test_rows_keep_the_sampling_metrics(runs):
    for row in runs["async"]:
        assert row["time/sample"] > 0 and row["async/wait_seconds"] >= 0
        assert "perf/training_seconds" in row
    assert all(row["async/rollout_seconds"] > 0 for row in runs["async"][1:])


def test_resume_redraws_the_pending_rollout_exactly(tmp_path):
    settings = dict(num_epochs=4, save_freq=2, log_images_every=0, eval_freq=0, train__async_rollout=True)
    whole = Trainer(make_config(tmp_path, run_name="whole", **settings)).run()
    assert os.path.isfile(os.path.join(whole, "checkpoints", "checkpoint_2", "sampling_model.safetensors"))
    copy = tmp_path / "copy"
    shutil.copytree(whole, copy)
    shutil.rmtree(copy / "checkpoints" / "checkpoint_4")
    trainer = Trainer(make_config(tmp_path, run_name="whole", **settings,
                                  resume_from=str(copy / "checkpoints" / "checkpoint_2")))
    assert trainer.first_epoch == 2
    trainer.run()
    expected, resumed = read_metrics(whole), read_metrics(copy)
    assert [row["epoch"] for row in resumed] == [row["epoch"] for row in expected]
    for a, b in zip(expected, resumed):
        assert {k: a.get(k) for k in NUMBERS} == {k: b.get(k) for k in NUMBERS}, a["epoch"]

    # stopped by a signal right after epoch 2's samples were taken (epoch 3's rollout already started): the
    # checkpoint keeps the weights that drew epoch 2, and the resumed run redoes epoch 2 as the whole run did
    # (no periodic checkpoint: the stop writes checkpoint_2)
    settings["save_freq"] = 0
    stopped = Trainer(make_config(tmp_path, run_name="stopped", **settings))
    take = stopped.sample_epoch

    def sample_then_stop(epoch, metrics):
        samples = take(epoch, metrics)
        if epoch == 2:
            stopped.control.request_stop(signal.SIGTERM)
        return samples

    stopped.sample_epoch = sample_then_stop
    stopped_dir = stopped.run()
    assert [row["epoch"] for row in read_metrics(stopped_dir)] == [0, 1]
    Trainer(make_config(tmp_path, run_name="stopped", **settings, resume_from=stopped_dir)).run()
    for a, b in zip(expected, read_metrics(stopped_dir)):
        assert {k: a.get(k) for k in NUMBERS} == {k: b.get(k) for k in NUMBERS}, a["epoch"]


def test_a_flow_family_runs_async(tmp_path):
    rows = _run(tmp_path, "flow", variant="tiny_sd3", num_epochs=2, train__async_rollout=True, sample__batch_size=4,
                sample__num_batches_per_epoch=1, sample__group_size=2, train__batch_size=2)
    assert rows[0][RATIO] == 0.0 and rows[1][RATIO] > 0


@pytest.mark.parametrize("overrides, words", [
    (dict(train__objective="nft"), "train.objective='stepwise'"),
    (dict(algorithm__adv_estimator="gae"), "algorithm.adv_estimator='gae'"),
    (dict(train__sharding="fsdp2"), "train.sharding='none'"),
])
def test_combinations_that_cannot_run_are_refused(tmp_path, overrides, words):
    config = make_config(tmp_path, train__async_rollout=True, **overrides)
    with pytest.raises(ConfigError) as info:
        check_config(config)
    message = str(info.value)
    assert "train.async_rollout" in message and words in message and "\n" not in message


def test_several_processes_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.async_rollout=True .* launch one process"):
        check_config(make_config(tmp_path, train__async_rollout=True), num_processes=2)


def test_the_sampler_has_its_own_scheduler():
    from ddpo_group.diffusion.tiny import build_tiny_pipeline
    from ddpo_group.diffusion.sd import StableDiffusionPolicy

    policy = StableDiffusionPolicy(build_tiny_pipeline())
    view = sampler_view(policy)
    assert view.pipeline.scheduler is not policy.pipeline.scheduler
    assert view.pipeline.unet is policy.pipeline.unet and view.pipeline.vae is policy.pipeline.vae
    view.pipeline.scheduler.set_timesteps(3)
    policy.pipeline.scheduler.set_timesteps(5)
    assert len(view.pipeline.scheduler.timesteps) == 3


def test_another_threads_model_calls_are_not_accounted():
    module = torch.nn.Linear(4, 4)
    accounting = perf.PerfAccounting(peak_tflops=1.0)
    accounting.attach("denoiser", module)
    with perf.active(accounting), perf.phase("training"):
        module(torch.zeros(2, 4))
        worker = threading.Thread(target=lambda: [module(torch.zeros(2, 4)), perf.switch("reward")])
        worker.start()
        worker.join()
    assert accounting.calls == {("training", "denoiser"): 1}
    assert set(accounting.seconds) == {"training"}


def test_the_benchmark_reads_reward_over_time_from_hand_written_runs():
    from helpers import load_script

    bench = load_script("benchmarks/async_rollout.py")
    evals = [{"epoch": 0, "seconds": 0.0, "reward": 0.5}, {"epoch": 2, "seconds": 10.0, "reward": 0.7}]
    # 0.5 for 10 s, then 0.7 for 10 s, over a 20 s horizon
    assert bench.mean_reward_over(evals, 20.0) == pytest.approx(0.6)
    records = [
        {"seed": 0, "mode": "sync", "seconds": 20.0, "evals": evals[:1] + [dict(evals[1], seconds=20.0)]},
        {"seed": 0, "mode": "async", "seconds": 10.0, "evals": evals},
    ]
    summary = bench.summarise(records)
    assert summary["sync"]["mean_reward_over_time"][0] == pytest.approx(0.5)
    assert summary["async"]["mean_reward_over_time"][0] == pytest.approx(0.6)
    assert summary["async"]["gain_per_second"][0] == pytest.approx(0.02)
    assert "| async |" in bench.table(summary, [dict(r, load_before=(1, 1, 1), load_after=(2, 2, 2)) for r in records])


def test_a_compiled_run_samples_and_scores_with_the_snapshot(tmp_path, monkeypatch):
    """compile=True with train.async_rollout: the frozen copies are deep copies of a compiled denoiser and must run
    their own weights. They once ran the training weights (the compiled forward closed over the original module):
    the lagged epochs' ratio then read exactly 1, the rollout on-policy in name only."""
    import torch
    from torch._dynamo import lookup_backend

    from ddpo_group.training import speed

    monkeypatch.setattr(speed, "COMPILE_BACKEND", lookup_backend("aot_eager"))
    torch._dynamo.reset()
    try:
        rows = _run(tmp_path, "async_compiled", train__async_rollout=True, compile=True)
    finally:
        torch._dynamo.reset()
    assert rows[0][RATIO] == 0.0
    assert all(row[RATIO] > 0 for row in rows[1:])
