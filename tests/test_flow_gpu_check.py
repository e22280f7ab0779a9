"""benchmarks/gpu_check.py's flow-family code path on the CPU (tiny SD3 and FLUX in bf16), and its exactness check:
at lr 1e-30 with 4 optimizer steps per epoch approx_kl and clipfrac are exactly 0 in every epoch; at a real
learning rate they are not, and the check fails."""

import json
import subprocess

import pytest
from helpers import PYTHON, ROOT, load_script, subprocess_env

SMALL = ["--device", "cpu", "--dtypes", "bf16", "--steps", "3", "--sample-steps", "3", "--sample-batch", "4",
         "--batches", "2", "--train-batch", "2", "--repeats", "1", "--sample-repeats", "1", "--epochs", "2"]


def run_check(tmp_path, *extra):
    output = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [PYTHON, "benchmarks/gpu_check.py", *SMALL, "--output", str(output), *extra],
        cwd=ROOT, env=subprocess_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=600,
    )
    return result, (json.loads(output.read_text()) if output.exists() else None)


def test_the_flow_archs_pass_every_check_on_the_cpu(tmp_path):
    result, results = run_check(tmp_path, "--arch", "tiny-sd3,tiny-flux", "--variants", "grpo,group_ppo_alg2,nft")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "result: PASS" in result.stdout
    for arch in ("tiny-sd3", "tiny-flux"):
        entry = results["archs"][arch]["dtypes"]["bf16"]
        assert entry["sampling_mask_all_ones"] is True and entry["pipeline_s"] > 0
        assert entry["ode_vs_pipeline_max_abs_image_diff"] >= 0 and entry["model_fwd_bwd_s"] > 0
        for name in ("grpo", "group_ppo_alg2", "nft"):
            row = entry["variants"][name]
            assert row["epochs"] == 2 and row["optimizer_steps_per_epoch"] == 4  # 4 micro-batches, 1 each
            assert row["approx_kl_by_epoch"] == [0.0, 0.0] and row["clipfrac_by_epoch"] == [0.0, 0.0]
            assert row["on_policy_max_abs_log_ratio"] == 0.0 and row["skipped_steps"] == 0
        assert entry["variants"]["grpo"]["layout_noise_max_abs_log_ratio"] == 0.0  # the recompute pass ran
    assert "| tiny-flux | bf16 | nft | 2 x 4 |" in result.stdout
    assert results["targets"] == [] and "checked on a GPU only" in result.stdout
    assert results["archs"]["tiny-sd3"]["dtypes"]["bf16"]["grpo_one_optimizer_step"]["optimizer_steps_per_epoch"] == 1


def test_the_wan_arch_samples_videos_against_the_pipeline_and_trains_exactly(tmp_path):
    # tiny-wan: the code path of the `wan` arch (Wan 2.1 1.3B) at tiny size; the pipeline's output is .frames
    result, results = run_check(tmp_path, "--arch", "tiny-wan", "--variants", "grpo,group_ppo")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    entry = results["archs"]["tiny-wan"]["dtypes"]["bf16"]
    assert entry["num_frames"] == 5 and entry["sampling_mask_all_ones"] is True and entry["pipeline_s"] > 0
    assert entry["ode_vs_pipeline_max_abs_image_diff"] >= 0 and entry["model_fwd_bwd_s"] > 0
    for name in ("grpo", "group_ppo"):
        row = entry["variants"][name]
        assert row["approx_kl_by_epoch"] == [0.0, 0.0] and row["clipfrac_by_epoch"] == [0.0, 0.0]
        assert row["on_policy_max_abs_log_ratio"] == 0.0 and row["skipped_steps"] == 0


def test_the_wan_arch_is_wan_2_1_1_3b():
    gpu_check = _gpu_check_module()
    spec = gpu_check.arch_settings("wan", gpu_check.parse_args(["--arch", "wan"]))
    assert spec["model"] == "random-wan21-1.3b" and spec["video"] and spec["resolution"] == 256
    settings = gpu_check.flow_sample_settings(spec)
    assert settings["num_frames"] == 33 and settings["guidance_scale"] == 4.5  # Flow-GRPO's Wan settings


def test_runs_with_gradient_checkpointing_stay_exact(tmp_path):
    result, results = run_check(tmp_path, "--arch", "tiny-sd3", "--variants", "grpo,nft", "--gradient-checkpointing")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert results["settings"]["gradient_checkpointing"] is True
    for name in ("grpo", "nft"):
        row = results["archs"]["tiny-sd3"]["dtypes"]["bf16"]["variants"][name]
        assert row["approx_kl_by_epoch"] == [0.0, 0.0] and row["clipfrac_by_epoch"] == [0.0, 0.0]
        assert row["on_policy_max_abs_log_ratio"] == 0.0 and row["skipped_steps"] == 0


@pytest.mark.parametrize("arch", ["tiny-sd3"])
def test_the_exactness_check_fails_when_the_weights_move(tmp_path, arch):
    result, results = run_check(tmp_path, "--arch", arch, "--variants", "grpo", "--lr", "1e-3")
    assert result.returncode == 1 and "result: FAIL" in result.stdout
    row = results["archs"][arch]["dtypes"]["bf16"]["variants"]["grpo"]
    assert row["on_policy_max_abs_log_ratio"] == 0.0  # before the first step it is still exact
    assert row["approx_kl"] > 0 and "approx_kl / clipfrac not exactly 0" in results["verdict"]


def test_a_reduced_flux_is_said_so():
    gpu_check = _gpu_check_module()
    arch_settings, parse_args = gpu_check.arch_settings, gpu_check.parse_args
    spec = arch_settings("flux", parse_args(["--arch", "flux", "--flux-depth", "2,4"]))
    assert spec["model"] == "random-flux-2x4"
    assert "reduced to 2 double + 4 single blocks" in spec["notes"][0] and "19 + 38" in spec["notes"][0]
    assert arch_settings("flux", parse_args(["--arch", "flux"]))["notes"] == []


def _gpu_check_module():
    return load_script("benchmarks/gpu_check.py")


def test_the_gpu_targets_are_read_from_the_results():
    gpu_check = _gpu_check_module()

    def variant(peak):
        return {"peak_gpu_mb": peak}

    results = {"machine": {"device": "cuda"}, "archs": {
        "sd15": {"dtypes": {"fp16": {"sampling_vs_pipeline": 0.97, "variants": {
            "grpo": variant(9000.0), "ddpo": variant(10240.0), "group_ppo": variant(10241.0), "nft": variant(99999.0)},
            "grpo_one_optimizer_step": variant(8000.0)}}},
        "sd35": {"dtypes": {"bf16": {"sampling_vs_pipeline": 1.35, "variants": {"grpo": variant(50.3)},
                                     "grpo_one_optimizer_step": variant(29.2)}}},
    }}
    rows = {(t["arch"], t["target"]): t for t in gpu_check.targets(results)}
    assert rows[("sd15", "sampling s / pipeline(...) s")]["met"] is True
    assert rows[("sd35", "sampling s / pipeline(...) s")]["met"] is False
    # 10 GiB = 10240 MiB: at the limit is met, one MiB over is not; NFT has no memory target
    assert rows[("sd15", "grpo peak GPU MB")]["met"] and rows[("sd15", "ddpo peak GPU MB")]["met"]
    assert rows[("sd15", "group_ppo peak GPU MB")]["met"] is False
    assert not any(arch == "sd15" and target.startswith("nft") for arch, target in rows)
    recompute = "grpo peak with the recompute pass / with one optimizer step"
    assert rows[("sd15", recompute)]["value"] == 9000.0 / 8000.0 and rows[("sd15", recompute)]["met"] is False
    assert rows[("sd35", recompute)]["value"] == 50.3 / 29.2 and rows[("sd35", recompute)]["met"] is False
    assert len(rows) == 7
    assert gpu_check.targets(dict(results, machine={"device": "cpu"})) == []


def test_the_one_prompt_per_call_and_ltx2_archs_pass_on_the_cpu(tmp_path):
    # Qwen-Image-Edit-2509 (two sources per prompt) and HunyuanVideo 1.5: pipeline(...) once per prompt; LTX-2: with
    # the settings LTX2Policy.pipeline_kwargs gives
    archs = ("tiny-qwen-image-edit-plus", "tiny-hunyuan-video15", "tiny-ltx2")
    result, results = run_check(tmp_path, "--arch", ",".join(archs), "--variants", "grpo")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for arch in archs:
        entry = results["archs"][arch]["dtypes"]["bf16"]
        assert entry["sampling_mask_all_ones"] is True and entry["pipeline_s"] > 0
        assert 0 <= entry["ode_vs_pipeline_max_abs_image_diff"] < 0.1  # bf16 vs the pipeline's bf16 latents
        row = entry["variants"]["grpo"]
        assert row["approx_kl_by_epoch"] == [0.0, 0.0] and row["clipfrac_by_epoch"] == [0.0, 0.0]
        assert row["on_policy_max_abs_log_ratio"] == 0.0 and row["skipped_steps"] == 0
    assert results["archs"]["tiny-hunyuan-video15"]["dtypes"]["bf16"]["num_frames"] == 5


def test_the_hunyuan_video15_arch_is_the_published_480p_model_called_once_per_prompt():
    gpu_check = _gpu_check_module()
    spec = gpu_check.arch_settings("hunyuan-video15", gpu_check.parse_args(["--arch", "hunyuan-video15"]))
    assert spec["model"] == "random-hunyuan-video15-480p" and spec["resolution"] == 480 and spec["one_prompt_per_call"]
    assert gpu_check.flow_sample_settings(spec)["num_frames"] == 33
    assert gpu_check.PIPELINE_CALLS[spec["pipeline"]] is gpu_check.call_hunyuan_video15


def test_the_qwen_edit_plus_and_ltx2_archs_are_the_published_transformers():
    import torch

    from ddpo_group.diffusion.ltx2 import build_random_ltx2_pipeline
    from ddpo_group.diffusion.qwen_image import build_random_qwen_image_edit_plus_pipeline

    gpu_check = _gpu_check_module()
    for arch, build, billions in (("qwen-image-edit-plus", build_random_qwen_image_edit_plus_pipeline, 20.43),
                                  ("ltx2", build_random_ltx2_pipeline, 18.88)):
        assert gpu_check.ARCHS[arch]["model"] == f"random-{arch}"
        with torch.device("meta"):  # the parameter count without the memory
            pipeline = build(torch_dtype=torch.bfloat16)
        count = sum(p.numel() for p in pipeline.transformer.parameters()) / 1e9
        assert round(count, 2) == billions, (arch, count)
