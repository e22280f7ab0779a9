"""FSDP2 sharding (train.sharding="fsdp2", ddpo_group/training/sharding.py) with two CPU processes on gloo.

tests/fsdp2_worker.py trains the tiny SD, SD3 and FLUX models sharded over two processes and, on rank 0, an
unsharded copy on the same global batch; the trainer runs end to end under torchrun, resumes, and loads its
checkpoint with another number of processes.
"""

import json
import os
import shutil
import subprocess

import pytest
from helpers import PYTHON, ROOT, free_port, make_config, read_metrics, subprocess_env

from ddpo_group.training import sharding
from ddpo_group.config.check import ConfigError

pytestmark = pytest.mark.slow

TORCHRUN = os.path.join(os.path.dirname(PYTHON), "torchrun")
MODELS = ("tiny", "tiny-sd3", "tiny-flux", "tiny-sd3:lora")  # the last: LoRA adapters on a sharded base


def torchrun(nproc, *args):
    command = [TORCHRUN, "--nproc_per_node", str(nproc), "--master_port", str(free_port()), *args]
    return launch(command, {})


def launch(command, extra_env, timeout=300):
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(**extra_env), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


# ---- config checks (no process group) --------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, field", [
    ({"train__sharding": "zero3"}, "train.sharding='zero3'"),
    ({"train__sharding": "none", "train__sharding_cpu_offload": True}, "train.sharding_cpu_offload"),
    ({"train__sharding": "fsdp2", "mixed_precision": "fp16"}, "mixed_precision='fp16'"),
    ({"train__sharding": "fsdp2", "train__use_8bit_adam": True}, "train.use_8bit_adam"),
])
def test_a_setting_sharding_cannot_honour_is_one_line_naming_the_field(tmp_path, overrides, field):
    config = make_config(tmp_path, **overrides)
    with pytest.raises(ConfigError) as err:
        sharding.check_sharding_config(config, ("down_blocks",))
    assert field in str(err.value) and "\n" not in str(err.value)


def test_a_model_without_known_blocks_is_refused(tmp_path):
    config = make_config(tmp_path, train__sharding="fsdp2")
    with pytest.raises(ConfigError, match=r"config.train.sharding='fsdp2'.*no block structure"):
        sharding.check_sharding_config(config, ())
    sharding.check_sharding_config(config, ("down_blocks",))  # accepted


def test_a_checkpoint_of_the_other_sharding_is_refused_in_one_line(tmp_path):
    from ddpo_group.runs.run_dir import CheckpointError, check_sharded_checkpoint

    (tmp_path / "sharding.json").write_text(json.dumps({"num_processes": 2, "copies": []}))
    with pytest.raises(CheckpointError, match=r"written with train.sharding='fsdp2'; resume it with"):
        check_sharded_checkpoint(str(tmp_path), None)
    check_sharded_checkpoint(str(tmp_path), sharded=object())  # accepted
    os.remove(tmp_path / "sharding.json")
    with pytest.raises(CheckpointError, match=r"written with train.sharding='none'"):
        check_sharded_checkpoint(str(tmp_path), sharded=object())
    check_sharded_checkpoint(str(tmp_path), None)


# ---- the two-process worker: equality with one process, bytes per process, the sharded reference -----------------


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("worker") / "result"
    torchrun(2, "tests/fsdp2_worker.py", str(out), *MODELS)
    return [json.loads(open(f"{out}.{rank}.json").read()) for rank in (0, 1)]


@pytest.mark.parametrize("index", range(len(MODELS)))
def test_sharded_weights_equal_one_process_with_the_same_global_batch(worker, index):
    result = worker[0][index]
    assert (result["model"], result["lora"]) == (MODELS[index].split(":")[0], MODELS[index].endswith(":lora"))
    # two AdamW steps at lr 1e-3 move the weights by about 2e-3; the two layouts differ by float32 rounding
    # (reduction order of the gradient mean and norm, the convolutions' kernels at another batch size), which
    # Adam's m / sqrt(v) turns into up to 2 lr on a coordinate whose gradient is within the rounding of 0: the
    # largest difference of one coordinate depends on the CPU (tiny SD: 3.6e-6 on one machine, 2.5e-4 on an
    # AVX-512 one, where the step-0 gradients differ by 4e-5 relative, 0.03 % of the coordinates by more than
    # 2e-5, the updates by 7e-4 relative). So the bounds are on every coordinate at once: a gradient taken on
    # one process's rows only, or a shard left out of the reduction, is another gradient, not a rounding of it.
    assert result["max_abs_weight_change"] > 1e-3
    assert result["weight_diff_share"] <= 1e-3
    assert result["relative_update_diff"] <= 5e-3
    # tiny SD3, tiny FLUX and LoRA on the sharded SD3 base keep far inside one coordinate's 2e-5 (2.1e-6 at most)
    if index > 0:
        assert result["max_abs_weight_diff"] <= 2e-5
    # the global gradient norm over both processes' shards is the one-process norm (before clipping)
    for sharded_norm, full_norm in zip(result["norms"], result["full_norms"]):
        assert sharded_norm == pytest.approx(full_norm, rel=1e-5)
    assert worker[1][index]["norms"] == result["norms"]


@pytest.mark.parametrize("index", range(len(MODELS)))
def test_each_process_holds_half_the_parameter_gradient_and_optimizer_bytes(worker, index):
    full = worker[0][index]["full_bytes"]
    for kind in ("params", "grads", "optimizer"):
        per_rank = [worker[rank][index]["bytes"][kind] for rank in (0, 1)]
        assert sum(per_rank) == full[kind]  # the shards partition the model: nothing held twice
        assert max(per_rank) <= 0.55 * full[kind]  # dim-0 shards of ceil(rows / 2): about half each
    # AdamW holds exp_avg and exp_avg_sq of each trained parameter: twice its gradient bytes, sharded the same way
    # (a full fine-tune: every parameter; LoRA: the adapters, while the frozen base is sharded too)
    held = worker[0][index]["bytes"]
    assert held["optimizer"] == 2 * held["grads"]
    assert (held["grads"] == held["params"]) == (not worker[0][index]["lora"])


@pytest.mark.parametrize("index", range(len(MODELS)))
def test_the_export_of_the_gathered_weights_loads_back_exactly(worker, index):
    # full weights: <ModelClass>.from_pretrained(unet/ or transformer/); LoRA: the family's load_trainable(lora/)
    assert worker[0][index]["export_max_abs_diff"] == 0.0


@pytest.mark.parametrize("index", range(len(MODELS)))
def test_the_sharded_reference_mixes_up_shard_by_shard(worker, index):
    # theta_ref <- 0.3 theta + 0.7 theta_0, compared with the formula on the gathered weights it mixed (against the
    # one-process run's weights it would carry their rounding difference, the test above's)
    assert worker[0][index]["max_abs_reference_diff"] <= 1e-6


# ---- the trainer end to end: on-policy ratio, evaluation padding, checkpoints, export, resume -----------------------


def train_args(logdir, prompts_file):
    return [
        "scripts/train.py", "--config", "config/grpo.py:test", "--config.train.sharding=fsdp2",
        "--config.num_epochs=2", "--config.save_freq=1", "--config.sample.num_steps=2",
        "--config.train.gradient_accumulation_steps=2",  # one optimizer step per epoch: all of it on-policy
        "--config.reward_fn=jpeg_compressibility", "--config.log_images_every=0", "--config.run_name=r",
        "--config.eval_freq=1", f"--config.eval_prompt_fn={prompts_file}", "--config.eval_images_per_prompt=1",
        f"--config.logdir={logdir}",
    ]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2_run")
    prompts = tmp / "eval_prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\n")  # 3 prompts on 2 processes: padded
    # the documented launch: accelerate launch --config_file config/accelerate_fsdp2.yaml --num_processes 2
    command = [os.path.join(os.path.dirname(PYTHON), "accelerate"), "launch", "--config_file",
               "config/accelerate_fsdp2.yaml", "--num_processes", "2", "--main_process_port", str(free_port())]
    launch(command + train_args(tmp, prompts), {"ACCELERATE_USE_CPU": "true"})
    return tmp / "r"


def test_the_first_on_policy_step_has_ratio_exactly_one(sharded_run):
    row = read_metrics(str(sharded_run))[0]
    assert row["num_processes"] == 2 and row["train/global_step"] == 1
    assert row["approx_kl"] == 0.0 and row["clipfrac"] == 0.0
    assert row["train/on_policy_max_abs_log_ratio"] == 0.0


def test_an_uneven_evaluation_is_padded_and_covers_every_prompt(sharded_run):
    rows = [row for row in read_metrics(str(sharded_run)) if "eval/reward_mean" in row]
    assert [row["epoch"] for row in rows] == [0, 1, 2]
    assert all(row["eval/reward_std"] >= 0 for row in rows)


def test_the_checkpoint_is_sharded_with_dcp_and_the_final_one_exports_full_weights(sharded_run):
    from diffusers import UNet2DConditionModel

    for epoch in (1, 2):
        checkpoint = sharded_run / "checkpoints" / f"checkpoint_{epoch}"
        files = os.listdir(checkpoint / "sharded")
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files)
        assert json.loads((checkpoint / "sharding.json").read_text())["copies"] == ["reference"]
        assert not (checkpoint / "reference.safetensors").exists()  # the sharded reference is in sharded/
    assert not (sharded_run / "checkpoints" / "checkpoint_1" / "unet").exists()
    unet = UNet2DConditionModel.from_pretrained(sharded_run / "checkpoints" / "checkpoint_2" / "unet")
    assert sum(p.numel() for p in unet.parameters()) > 0


def test_resume_with_the_same_processes_is_bit_identical(sharded_run, tmp_path):
    copy = tmp_path / "r"
    shutil.copytree(sharded_run, copy)
    shutil.rmtree(copy / "checkpoints" / "checkpoint_2")
    torchrun(2, "scripts/train.py", f"--config.resume_from={copy / 'checkpoints' / 'checkpoint_1'}")
    name = os.path.join("checkpoints", "checkpoint_2", "unet", "diffusion_pytorch_model.safetensors")
    assert (copy / name).read_bytes() == (sharded_run / name).read_bytes()


def test_resume_with_another_number_of_processes_loads_resharded(sharded_run, tmp_path):
    copy = tmp_path / "r"
    shutil.copytree(sharded_run, copy)
    # num_epochs=1: the run loads its checkpoint of epoch 1 (DCP re-shards the two processes' shards onto one)
    # and has nothing left to do
    result = torchrun(1, "scripts/train.py", f"--config.resume_from={copy / 'checkpoints' / 'checkpoint_1'}",
                      "--config.num_epochs=1")
    output = result.stderr + result.stdout
    assert "written by 2 processes, re-sharded onto 1" in output and "nothing to do" in output


# ---- benchmarks/gpu_check.py's FSDP2 row, its code path at tiny size on the CPU -------------------------------------


def test_gpu_check_fsdp2_row_runs_on_the_cpu(tmp_path):
    output = tmp_path / "gpu_check.json"
    command = [PYTHON, "benchmarks/gpu_check.py", "--device", "cpu", "--arch", "tiny-sd3", "--dtypes", "bf16",
               "--variants", "none", "--fsdp2", "1", "--steps", "2", "--sample-steps", "2", "--sample-batch", "4",
               "--batches", "1", "--train-batch", "2", "--repeats", "1", "--sample-repeats", "1", "--epochs", "1",
               "--output", str(output)]
    result = launch(command, {"CUDA_VISIBLE_DEVICES": ""})
    (row,) = json.loads(output.read_text())["archs"]["tiny-sd3"]["dtypes"]["bf16"]["fsdp2"]
    assert row["processes"] == 1 and row["epochs"] == 1 and row["peak_memory"] == "peak_rss_mb"
    assert row["peak_mb_per_process"] > 0 and row["s_per_epoch"] > 0
    assert row["approx_kl"] == 0.0 and row["clipfrac"] == 0.0 and row["skipped_steps"] == 0
    assert "| tiny-sd3 | bf16 | 1 |" in result.stdout and "result: PASS" in result.stdout
