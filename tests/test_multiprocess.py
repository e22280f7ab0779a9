"""Two CPU processes (gloo), launched the ways docs/design.md §7 says work on a CPU machine.

The required check of the issue: the advantages each rank trains on are the GRPO advantages of
the gathered batch (rank 0's trajectories, then rank 1's), not of its local slice, and the
group_size copies of a prompt may sit on different ranks.
"""

import os
import subprocess

import numpy as np
import pytest

from helpers import PYTHON, ROOT, free_port, grpo_advantages_numpy, read_dump, read_metrics, subprocess_env

pytestmark = pytest.mark.slow

BIN = os.path.dirname(PYTHON)
TRAIN_ARGS = [
    "scripts/train.py", "--config", "config/grpo.py:test", "--config.num_epochs=1", "--config.debug_dump=True",
    "--config.reward_fn=jpeg_compressibility", "--config.train.use_reference_model=False",
    "--config.train.use_kl_loss=False", "--config.log_images_every=0", "--config.run_name=r",
]
LOCAL_BATCH, GROUP_SIZE, CLIP = 4, 2, 5.0  # config/grpo.py:test


def accelerate_command(port):
    return [os.path.join(BIN, "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
            "--main_process_port", str(port)]


def torchrun_command(port):
    return [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(port)]


LAUNCHERS = {
    # ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 scripts/train.py ...
    "accelerate": (accelerate_command, {"ACCELERATE_USE_CPU": "true"}),
    # torchrun --nproc_per_node 2 scripts/train.py ...
    "torchrun": (torchrun_command, {}),
}


@pytest.fixture(scope="module", params=sorted(LAUNCHERS))
def two_process_run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    make_command, extra_env = LAUNCHERS[request.param]
    command = make_command(free_port()) + TRAIN_ARGS + [f"--config.logdir={tmp}"]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(**extra_env), capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return str(tmp / "r")


def test_two_processes_run(two_process_run):
    row = read_metrics(two_process_run)[0]
    assert row["num_processes"] == 2
    assert row["num_samples"] == 2 * LOCAL_BATCH


def test_each_rank_trains_on_the_advantages_of_the_gathered_batch(two_process_run):
    dumps = [read_dump(two_process_run, rank=rank) for rank in (0, 1)]
    assert [d["rank"] for d in dumps] == [0, 1]
    rewards = dumps[0]["rewards"] + dumps[1]["rewards"]
    prompt_ids = dumps[0]["prompt_ids"] + dumps[1]["prompt_ids"]
    mask = dumps[0]["mask"] + dumps[1]["mask"]
    expected = grpo_advantages_numpy(rewards, prompt_ids, mask, clip=CLIP)
    for rank, dump in enumerate(dumps):
        local = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        # the trainer computes in float32: rewards of about 20 that differ by about 1e-3 within a group
        # leave (r - mean) / std with an error of order 1e-5
        np.testing.assert_allclose(np.asarray(dump["advantages"]), expected[local], rtol=0, atol=2e-4)


def test_a_prompt_group_spans_both_ranks(two_process_run):
    dumps = [read_dump(two_process_run, rank=rank) for rank in (0, 1)]
    gathered = dumps[0]["prompt_ids"] + dumps[1]["prompt_ids"]
    assert all(gathered.count(pid) % GROUP_SIZE == 0 for pid in gathered)
    assert set(dumps[0]["prompt_ids"]) & set(dumps[1]["prompt_ids"])
    # a group split over ranks is normalised with its members from both ranks: not a local GRPO
    for dump in dumps:
        local = grpo_advantages_numpy(dump["rewards"], dump["prompt_ids"], dump["mask"], clip=CLIP)
        assert not np.allclose(np.asarray(dump["advantages"]), local, atol=1e-4)


def test_reward_statistics_cover_both_ranks(two_process_run):
    row = read_metrics(two_process_run)[0]
    rewards = read_dump(two_process_run, rank=0)["rewards"] + read_dump(two_process_run, rank=1)["rewards"]
    assert row["reward_mean"] == pytest.approx(np.mean(rewards), rel=1e-6)
    assert row["reward_std"] == pytest.approx(np.std(rewards), rel=1e-5)


def test_checkpoint_holds_the_state_of_both_ranks(two_process_run):
    root = os.path.join(two_process_run, "checkpoints")
    assert os.listdir(root) == ["checkpoint_1"]
    files = os.listdir(os.path.join(root, "checkpoint_1"))
    assert {"random_states_0.pkl", "random_states_1.pkl", "trainer_state.json"} <= set(files)


SLOW_RANK_HOOK = '''
import os
import time

if os.environ.get("RANK") == "1":
    import accelerate.accelerator

    _save_accelerator_state = accelerate.accelerator.save_accelerator_state

    def _late_save_accelerator_state(*args, **kwargs):
        time.sleep(3)  # rank 1 writes its part of the checkpoint 3 s after rank 0
        return _save_accelerator_state(*args, **kwargs)

    accelerate.accelerator.save_accelerator_state = _late_save_accelerator_state
'''


def test_checkpoint_waits_for_a_slow_rank(tmp_path):
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(SLOW_RANK_HOOK)
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir), env["PYTHONPATH"]])
    command = torchrun_command(free_port()) + TRAIN_ARGS + [f"--config.logdir={tmp_path}", "--config.debug_dump=False"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    files = os.listdir(tmp_path / "r" / "checkpoints" / "checkpoint_1")
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(files)
