"""Precision and devices (docs/design.md §10): float32 step math under half-precision models,
bf16 autocast on the CPU, an on-policy ratio of exactly 1, and no numpy on device tensors."""

import ast
import math
import pathlib

import pytest
import torch
from diffusers import DDIMScheduler

from ddpo_group.diffusion.ddim import ddim_step_with_logprob
from ddpo_group.diffusion.sampling import sample_trajectories, trajectory_log_probs
from ddpo_group.diffusion.tiny import build_tiny_pipeline
from ddpo_group.training.trainer import Trainer, train
from helpers import ROOT, make_config, read_metrics


def sd_scheduler(num_inference_steps):
    scheduler = DDIMScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        clip_sample=False, set_alpha_to_one=False, steps_offset=1,
    )
    scheduler.set_timesteps(num_inference_steps)
    return scheduler


def log_prob_float64_by_hand(scheduler, t, sample, eps, prev_sample, eta):
    """DDIM eq. 12 / 16 in float64 from alphas_cumprod: (mean log-density, sigma, mean, sigma)."""
    a = scheduler.alphas_cumprod.double()
    t_prev = t - 1000 // scheduler.num_inference_steps
    a_t = a[t]
    a_prev = a[t_prev] if t_prev >= 0 else torch.tensor(float(scheduler.final_alpha_cumprod), dtype=torch.float64)
    sigma = eta * torch.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
    x0 = (sample - torch.sqrt(1 - a_t) * eps) / torch.sqrt(a_t)
    mean = torch.sqrt(a_prev) * x0 + torch.sqrt(1 - a_prev - sigma**2) * eps
    density = -((prev_sample - mean) ** 2) / (2 * sigma**2) - torch.log(sigma) - 0.5 * math.log(2 * math.pi)
    return density.mean(dim=(1, 2, 3)), sigma, mean, sigma


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_float32_log_probs_of_float64_accuracy(dtype):
    scheduler = sd_scheduler(20)
    generator = torch.Generator().manual_seed(0)
    for t in scheduler.timesteps.tolist():
        # half-precision inputs, as a fp16 / bf16 UNet and half latents would give them
        sample = torch.randn(3, 4, 8, 8, generator=generator).to(dtype)
        eps = torch.randn(3, 4, 8, 8, generator=generator).to(dtype)
        # a next sample drawn from the step itself (mean + sigma z, in float64), then rounded to half
        zero = torch.zeros(3, 4, 8, 8, dtype=torch.float64)
        mean64, sigma = log_prob_float64_by_hand(scheduler, t, sample.double(), eps.double(), zero, 1.0)[2:]
        z = torch.randn(3, 4, 8, 8, generator=generator, dtype=torch.float64)
        prev_sample = (mean64 + sigma * z).to(dtype)
        _, log_prob, mean, std = ddim_step_with_logprob(scheduler, eps, t, sample, eta=1.0, prev_sample=prev_sample)
        expected, sigma = log_prob_float64_by_hand(scheduler, t, sample.double(), eps.double(), prev_sample.double(), 1.0)[:2]
        assert log_prob.dtype == torch.float32 and mean.dtype == torch.float32 and std.dtype == torch.float32
        assert (std > 0).all(), f"step at t={t} lost its density"
        assert (log_prob.double() - expected).abs().max() < 1e-4
        assert float(std.flatten()[0]) == pytest.approx(float(sigma), rel=1e-5)


def test_float64_inputs_keep_float64():
    scheduler = sd_scheduler(10)
    sample = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    out = ddim_step_with_logprob(scheduler, torch.randn_like(sample), scheduler.timesteps[3], sample, eta=1.0)
    assert all(x.dtype == torch.float64 for x in out)


@pytest.mark.parametrize("mode", ["autocast", "bf16_weights"])
def test_bf16_sampling_keeps_every_step_and_rescoring_is_exact(mode):
    pipeline = build_tiny_pipeline(seed=0)
    if mode == "bf16_weights":  # the LoRA path: frozen weights stored in bf16, no autocast
        pipeline.to(dtype=torch.bfloat16)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else torch.no_grad()
    with context:
        trajectories = sample_trajectories(
            pipeline, ["a red circle", "a blue square"], num_inference_steps=20, guidance_scale=3.0, eta=1.0,
            generator=torch.Generator().manual_seed(0),
        )
        rescored = trajectory_log_probs(pipeline, trajectories, guidance_scale=3.0, eta=1.0)
    assert torch.equal(trajectories.mask, torch.ones(2, 20))
    assert trajectories.log_probs.dtype == torch.float32 and trajectories.latents.dtype == torch.float32
    assert torch.isfinite(trajectories.log_probs).all()
    assert torch.equal(rescored, trajectories.log_probs)
    assert trajectories.images.dtype == torch.float32


def _one_epoch(tmp_path, name, **overrides):
    """Sample and compute advantages of one epoch of the test variant; returns (trainer, samples)."""
    config = make_config(tmp_path, run_name=name, num_epochs=1, log_images_every=0, **overrides)
    trainer = Trainer(config)
    metrics = {}
    samples = trainer.sample_epoch(0, metrics)
    return trainer, samples


# The stored log-probs shifted by DELTA stand in for the layout noise of a GPU (other batch, other
# kernels): recomputing pi_old in the training layout must not see it, the "sampled" mode must.
DELTA = 0.05


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_one_optimizer_step_epoch_is_exactly_on_policy(tmp_path, mixed_precision, policy_loss):
    # 4 trajectories, micro-batches of 2, both in one accumulation window: one optimizer step
    trainer, samples = _one_epoch(
        tmp_path, "r", mixed_precision=mixed_precision, train__gradient_accumulation_steps=2,
        train__policy_loss=policy_loss, train__clip_range=1e-4,
    )
    samples.log_probs = samples.log_probs + DELTA * samples.mask
    metrics = {}
    trainer.compute_advantages(samples, metrics)
    trainer.train_epoch(samples, 0, metrics)
    assert metrics["train/global_step"] == 1
    assert metrics["approx_kl"] == 0.0
    assert metrics["clipfrac"] == 0.0
    assert metrics["train/on_policy_max_abs_log_ratio"] == 0.0
    assert metrics["train/skipped_steps"] == 0


def test_sampled_log_probs_mode_sees_the_stored_values(tmp_path):
    trainer, samples = _one_epoch(
        tmp_path, "r", train__gradient_accumulation_steps=2, train__old_log_probs="sampled", train__clip_range=1e-4
    )
    samples.log_probs = samples.log_probs + DELTA * samples.mask
    metrics = {}
    trainer.compute_advantages(samples, metrics)
    trainer.train_epoch(samples, 0, metrics)
    # log ratio = -DELTA on every step, far outside the clip range: the tokens with A > 0 are clipped
    assert metrics["train/on_policy_max_abs_log_ratio"] == pytest.approx(DELTA, abs=1e-3)
    assert metrics["approx_kl"] > 0 and metrics["clipfrac"] > 0


def test_later_micro_batches_use_pi_old_recomputed_before_the_first_step(tmp_path):
    # two micro-batches, one optimizer step each: the second is trained after an update, so its
    # pi_old comes from the pass before the first step, not from the (shifted) stored values
    trainer, samples = _one_epoch(tmp_path, "r", train__gradient_accumulation_steps=1, train__learning_rate=1e-9)
    samples.log_probs = samples.log_probs + DELTA * samples.mask
    metrics = {}
    trainer.compute_advantages(samples, metrics)
    trainer.train_epoch(samples, 0, metrics)
    assert metrics["train/global_step"] == 2
    assert metrics["train/layout_noise_max_abs_log_ratio"] == pytest.approx(DELTA, abs=1e-3)
    # with a learning rate of 1e-9 the second micro-batch is still on-policy to ~1e-6, not DELTA
    assert metrics["approx_kl"] < 1e-8


def test_bf16_run_on_cpu_trains_without_skipped_steps(tmp_path):
    run_dir = train(make_config(tmp_path, mixed_precision="bf16", num_epochs=2, log_images_every=1))
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [0, 1]
    assert rows[-1]["train/skipped_steps"] == 0
    assert rows[-1]["train/global_step"] == 4
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["kl"]) for row in rows)


def _numpy_calls_without_cpu(path):
    """Lines of `path` where .numpy() is called on an expression that has no .cpu() / .to("cpu")."""
    tree = ast.parse(pathlib.Path(path).read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy":
            receiver = ast.unparse(node.func.value)
            if ".cpu()" not in receiver and "'cpu'" not in receiver and '"cpu"' not in receiver:
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_no_numpy_on_a_tensor_that_was_not_moved_to_the_cpu():
    package = pathlib.Path(ROOT) / "ddpo_group"
    bad = [line for path in sorted(package.rglob("*.py")) for line in _numpy_calls_without_cpu(path)]
    assert not bad, "a CUDA tensor fails here; move it with .cpu() first:\n" + "\n".join(bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shapes_rewards_take_cuda_images():
    from ddpo_group.rewards.shapes import shapes_alignment
    from ddpo_group.data.shapes import parse_prompt, render

    prompts = ["a big red circle on a white background", "a small blue square on a black background"]
    images = torch.stack([torch.as_tensor(render(parse_prompt(p))).permute(2, 0, 1).float() / 255 for p in prompts])
    cpu_rewards, _ = shapes_alignment(images, prompts, [{}, {}])
    cuda_rewards, _ = shapes_alignment(images.cuda().to(torch.bfloat16).float(), prompts, [{}, {}])
    assert cuda_rewards.tolist() == pytest.approx(cpu_rewards.tolist(), abs=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_test_variant_trains_on_cuda_in_bf16(tmp_path):
    run_dir = train(make_config(tmp_path, mixed_precision="bf16", num_epochs=1, train__gradient_accumulation_steps=2))
    row = read_metrics(run_dir)[0]
    assert row["approx_kl"] == 0.0 and row["train/skipped_steps"] == 0


def test_gpu_check_runs_its_code_path_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.py with the tiny architecture in bf16 on the CPU: the table, the JSON, exit 0."""
    import json
    import subprocess

    from helpers import PYTHON, subprocess_env

    output = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [PYTHON, "benchmarks/gpu_check.py", "--device", "cpu", "--arch", "tiny", "--dtypes", "bf16",
         "--variants", "sd15,group_ppo", "--steps", "3", "--sample-steps", "3", "--sample-batch", "4",
         "--batches", "1", "--train-batch", "2", "--repeats", "1", "--output", str(output)],
        cwd=ROOT, env=subprocess_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "result: PASS" in result.stdout
    results = json.loads(output.read_text())
    for variant in ("sd15", "group_ppo"):
        row = results["dtypes"]["bf16"]["variants"][variant]
        assert row["on_policy_max_abs_log_ratio"] == 0.0 and row["approx_kl"] == 0.0
        assert row["skipped_steps"] == 0
    assert results["dtypes"]["bf16"]["sampling_mask_all_ones"] is True


def test_fp16_loss_scaler_calibration_is_counted_apart_from_non_finite_steps():
    """fp16's GradScaler starts at 2**16 and halves its scale after a step whose scaled gradients overflow, skipping
    it: such a step (finite loss, scale above 1) is counted in scaler_skipped_steps, not as a failure; a non-finite
    loss, or an overflow at a scale of 1, is a skipped step. A real GradScaler behind accelerate's optimizer wrapper
    (accelerate makes no scaler on a CPU, so this one is given to it)."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = acc.prepare(torch.optim.SGD([weight], lr=0.1))
    trainer = SimpleNamespace(
        accelerator=acc, optimizer=optimizer, trainable_params=[weight], clip_grad_norm=acc.clip_grad_norm_,
        config=SimpleNamespace(train=SimpleNamespace(max_grad_norm=1e9)), reference=None,
        skipped_steps=0, scaler_skipped_steps=0, global_step=0,
    )

    def step(grad, bad=False):
        acc.scaler.scale((weight * grad).sum()).backward()  # the scaled loss's backward: gradient grad * scale
        return Trainer._optimizer_step(trainer, bad)

    assert step(1e38)["skipped"]  # a finite loss (3e38) whose scaled gradient (1e38 * 2**16) overflows
    assert (trainer.scaler_skipped_steps, trainer.skipped_steps, trainer.global_step) == (1, 0, 0)
    assert acc.scaler.get_scale() == 2.0**15
    out = step(0.5)  # a finite step: taken, the weights move by lr * 0.5
    assert not out["skipped"] and trainer.global_step == 1
    assert torch.allclose(weight.detach(), torch.full((3,), 1.0 - 0.1 * 0.5))
    assert step(0.5, bad=True)["skipped"]  # a non-finite loss: a failure, whatever the scale
    assert (trainer.scaler_skipped_steps, trainer.skipped_steps) == (1, 1)
    acc.scaler.update(1.0)  # at a scale of 1 an overflow is no longer the scaler finding its scale
    assert step(math.inf)["skipped"] and acc.scaler.get_scale() == 0.5
    assert (trainer.scaler_skipped_steps, trainer.skipped_steps, trainer.global_step) == (1, 2, 1)

    # a critic's optimizer on the same scaler: its overflowing step (a value loss on large rewards) is skipped, and
    # accelerate's optimizer_step_was_skipped then reads true for every optimizer; the policy's next, finite step
    # is taken and counted as taken
    acc.scaler.update(2.0**10)
    value = torch.nn.Parameter(torch.zeros(2))
    critic_optimizer = acc.prepare(torch.optim.SGD([value], lr=0.1))
    acc.scaler.scale((value * 1e38).sum()).backward()
    critic_optimizer.step()
    critic_optimizer.zero_grad()
    assert critic_optimizer.step_was_skipped and acc.optimizer_step_was_skipped
    before = weight.detach().clone()
    assert not step(0.5)["skipped"]
    assert trainer.global_step == 2 and (trainer.scaler_skipped_steps, trainer.skipped_steps) == (1, 2)
    assert torch.allclose(weight.detach(), before - 0.1 * 0.5)
