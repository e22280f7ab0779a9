"""Wan 2.2 A14B's two experts (ddpo_group/diffusion/wan_moe.py) on the offline tiny twin tiny-wan22-moe.

Checked: the family is found by name and by pipeline (WanPolicy keeps the one-transformer Wan); noise 0 gives
WanPipeline's videos with guidance_scale_2 honoured; each step records its expert (t >= boundary: the high-noise
one) and re-scoring is bit-exact, also after cat / index, and refuses a boundary that moved; train.experts picks
the LoRA / full-fine-tune parameters the optimizer sees; two epochs train with approx_kl exactly 0 at the first and
the untrained expert unchanged; LoRA exports in diffusers' format (lora/ into transformer, lora_2/ with
load_into_transformer_2) and the run resumes; the other algorithms run; bad settings are one line naming the field.
"""

import math
import os

import pytest
import torch

from ddpo_group.config.check import ConfigError
from ddpo_group.diffusion.base import Trajectories
from ddpo_group.diffusion.policy import family_for_model, load_policy, policy_for
from ddpo_group.diffusion.wan import WanPolicy, build_tiny_wan_pipeline
from ddpo_group.diffusion.wan_moe import WanExperts, WanMoEPolicy, build_tiny_wan22_moe_pipeline
from ddpo_group.training.trainer import Trainer, train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a red circle", "a big blue square on a white background"]
LENGTH = 16


@pytest.fixture(scope="module")
def pipeline():
    return build_tiny_wan22_moe_pipeline(seed=0)


def _policy(pipeline, guidance_scale_2=0.0, experts="both", **options):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=LENGTH, **options)
    policy.configure_experts(guidance_scale_2, experts)
    return policy


def test_the_family_is_found_by_name_and_by_pipeline(pipeline):
    assert family_for_model("tiny-wan22-moe") is WanMoEPolicy
    assert type(policy_for(pipeline)) is WanMoEPolicy and isinstance(policy_for(pipeline).trainable_module, WanExperts)
    assert type(policy_for(build_tiny_wan_pipeline())) is WanPolicy  # one transformer: the Wan family
    assert not WanPolicy.supports(pipeline)
    assert type(load_policy("tiny-wan22-moe")) is WanMoEPolicy


@pytest.mark.parametrize("guidance_scale_2", [0.0, 2.0])
def test_noise_level_zero_reproduces_the_pipeline_with_its_second_guidance_scale(pipeline, guidance_scale_2):
    policy = _policy(pipeline, guidance_scale_2)
    ours = policy.sample(PROMPTS, 4, 4.0, 0.0, generator=torch.Generator().manual_seed(3))
    theirs = pipeline(prompt=PROMPTS, height=32, width=32, num_frames=5, num_inference_steps=4, guidance_scale=4.0,
                      guidance_scale_2=guidance_scale_2 or None, generator=torch.Generator().manual_seed(3),
                      output_type="pt", max_sequence_length=LENGTH).frames
    assert ours.images.shape == theirs.shape == (2, 5, 3, 32, 32)
    assert (ours.images - theirs).abs().max() < 1e-5
    if guidance_scale_2:  # the low-noise expert's scale changes the video
        same = _policy(pipeline).sample(PROMPTS, 4, 4.0, 0.0, generator=torch.Generator().manual_seed(3)).images
        assert (same - ours.images).abs().max() > 1e-4


def test_each_step_records_its_expert_and_the_experts_differ(pipeline):
    policy = _policy(pipeline)
    batch = policy.sample(PROMPTS, 4, 4.0, 0.7, generator=torch.Generator().manual_seed(0))
    boundary = 0.7 * 1000  # the tiny twin's boundary_ratio * num_train_timesteps
    assert torch.equal(batch.extra_cond["experts"], (batch.timesteps < boundary).long())
    assert batch.extra_cond["experts"][0].tolist() == [0, 0, 1, 1]
    x, t = batch.latents[:, 2], batch.timesteps[:, 2]
    cond = {"prompt_embeds": batch.prompt_embeds}
    high = policy._expert_velocity(policy.trainable_module, 0, x, t, cond, 1.0)
    low = policy._expert_velocity(policy.trainable_module, 1, x, t, cond, 1.0)
    assert torch.equal(policy._velocity(policy.trainable_module, x, t, cond, 1.0), low)
    assert (high - low).abs().max() > 1e-3


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance"])
def test_rescoring_with_unchanged_weights_is_exact_at_every_step(pipeline, sde_type):
    policy = _policy(pipeline, 3.0, sde_type=sde_type)
    batch = policy.sample(PROMPTS, 4, 4.0, 0.5, generator=torch.Generator().manual_seed(0))
    for k in range(4):
        log_prob, _, _ = policy.step_log_prob(policy.trainable_module, batch, torch.arange(2), torch.full((2,), k), 4.0, 0.5)
        assert torch.equal(log_prob, batch.log_probs[:, k])
    # rows at steps of both experts in one call: each expert on its rows (a smaller batch: float rounding only)
    log_prob, _, _ = policy.step_log_prob(policy.trainable_module, batch, torch.arange(2), torch.tensor([0, 3]), 4.0, 0.5)
    assert (log_prob - torch.stack([batch.log_probs[0, 0], batch.log_probs[1, 3]])).abs().max() < 1e-4


def test_rescoring_is_exact_after_cat_and_index_and_a_moved_boundary_is_refused(pipeline):
    policy = _policy(pipeline)
    first = policy.sample(["a cat", "a dog"], 4, 4.0, 0.7, generator=torch.Generator().manual_seed(5))
    second = policy.sample(PROMPTS, 4, 4.0, 0.7, generator=torch.Generator().manual_seed(6))
    both = Trajectories.cat([first, second]).index([2, 3, 0, 1])
    assert both.extra_cond["experts"].shape == (4, 4)
    for k in range(4):
        log_prob, _, _ = policy.step_log_prob(policy.trainable_module, both, torch.arange(2), torch.full((2,), k), 4.0, 0.7)
        assert torch.equal(log_prob, second.log_probs[:, k])
    pipeline.register_to_config(boundary_ratio=0.95)
    try:
        with pytest.raises(ValueError, match="boundary timestep 950 .* another expert"):
            policy.step_log_prob(policy.trainable_module, both, torch.arange(2), torch.full((2,), 1), 4.0, 0.7)
    finally:
        pipeline.register_to_config(boundary_ratio=0.7)


@pytest.mark.parametrize("experts,use_lora", [("both", True), ("high", True), ("low", False)])
def test_train_experts_chooses_what_lora_and_the_optimizer_cover(experts, use_lora):
    policy = _policy(build_tiny_wan22_moe_pipeline(), experts=experts)
    module = policy.prepare("cpu", torch.float32, use_lora=use_lora, lora_rank=2)
    trained = {name.split(".")[0] for name, p in module.named_parameters() if p.requires_grad}
    assert trained == {"both": {"transformer", "transformer_2"}, "high": {"transformer"},
                       "low": {"transformer_2"}}[experts]
    if experts == "high":  # the frozen expert's steps carry no gradient: mask 0, skipped like ODE steps
        batch = policy.sample(PROMPTS, 4, 4.0, 0.7, generator=torch.Generator().manual_seed(0))
        assert batch.mask[0].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_a_setting_only_two_experts_have_is_one_line_naming_the_field(tmp_path):
    for overrides, field in ((dict(sample__guidance_scale_2=2.0), "config.sample.guidance_scale_2"),
                             (dict(train__experts="high"), "config.train.experts")):
        with pytest.raises(ConfigError, match=field) as info:
            train(make_config(tmp_path, variant="tiny_wan", **overrides))
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="config.train.experts='middle' is not one of"):
        train(make_config(tmp_path, variant="tiny_wan22_moe", train__experts="middle"))
    with pytest.raises(ValueError, match="config.train.experts='high' trains one expert, but the forward objective"):
        train(make_config(tmp_path, variant="tiny_wan22_moe", **cheap(train__experts="high", train__objective="nft",
                                                                       forward__num_timesteps=2)))


def test_two_epochs_train_exactly_on_policy_and_an_untrained_expert_stays_as_it_was(tmp_path):
    trainer = Trainer(make_config(tmp_path, variant="tiny_wan22_moe", train__experts="low", use_lora=False,
                                  sample__batch_size=2, sample__num_batches_per_epoch=2,
                                  train__gradient_accumulation_steps=2, train__learning_rate=1e-3))
    run_dir = trainer.run()
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [0, 1] and rows[-1]["train/skipped_steps"] == 0
    assert rows[0]["approx_kl"] == 0.0 and rows[0]["train/on_policy_max_abs_log_ratio"] == 0.0
    fresh = build_tiny_wan22_moe_pipeline()
    experts = trainer.policy.trainable_module
    assert all(torch.equal(a, b) for a, b in zip(experts.transformer.state_dict().values(),
                                                   fresh.transformer.state_dict().values()))
    assert any(not torch.equal(a, b) for a, b in zip(experts.transformer_2.state_dict().values(),
                                                     fresh.transformer_2.state_dict().values()))
    final = os.path.join(run_dir, "checkpoints", "checkpoint_2")
    assert os.path.isdir(os.path.join(final, "transformer_2")) and not os.path.isdir(os.path.join(final, "transformer"))


def test_lora_of_both_experts_loads_into_a_fresh_pipeline_and_the_run_resumes(tmp_path):
    common = dict(use_lora=True, lora_rank=2, save_freq=1, log_images_every=0, train__learning_rate=3e-2)
    trainer = Trainer(make_config(tmp_path, variant="tiny_wan22_moe", num_epochs=1, **common))
    run_dir = trainer.run()
    checkpoint = os.path.join(run_dir, "checkpoints", "checkpoint_1")

    def videos(policy):
        policy.configure(max_sequence_length=LENGTH)
        policy.configure_experts(3.0, "both")
        return policy.sample(PROMPTS, 4, 4.5, 0.0, generator=torch.Generator().manual_seed(5)).images

    fresh = build_tiny_wan22_moe_pipeline()
    fresh.load_lora_weights(os.path.join(checkpoint, "lora"))  # diffusers' own loaders
    fresh.load_lora_weights(os.path.join(checkpoint, "lora_2"), load_into_transformer_2=True)
    trained = videos(trainer.policy)
    assert (trained - videos(policy_for(build_tiny_wan22_moe_pipeline()))).abs().max() > 1e-4
    assert (videos(policy_for(fresh)) - trained).abs().max() < 1e-5
    again = policy_for(build_tiny_wan22_moe_pipeline())
    module = again.prepare("cpu", torch.float32, use_lora=True, lora_rank=2)
    again.load_trainable(module, checkpoint, use_lora=True)
    assert (videos(again) - trained).abs().max() < 1e-5
    import json

    from ddpo_group.cli import evaluate  # the evaluation's loader: both adapters, guidance_scale_2
    with open(os.path.join(run_dir, "config.json")) as f:
        run_config = json.load(f)
    evaluated = evaluate.load_checkpoint_policy(checkpoint, run_config)
    assert evaluated.guidance_scale_2 == 3.0
    assert (videos(evaluated) - trained).abs().max() < 1e-5
    config = make_config(tmp_path, variant="tiny_wan22_moe", num_epochs=2, resume_from=run_dir, **common)
    resumed = Trainer(config, overrides={"resume_from", "num_epochs"})
    assert (videos(resumed.policy) - trained).abs().max() < 1e-5
    resumed.run()
    assert [row["epoch"] for row in read_metrics(run_dir)] == [0, 1]


@pytest.mark.parametrize("overrides", [dict(train__objective="nft", forward__num_timesteps=2),
                                       dict(algorithm__adv_estimator="gae"),
                                       dict(train__use_reference_model=True, train__use_kl_loss=True, train__beta=0.01)])
def test_other_algorithms_train_both_experts(tmp_path, overrides):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_wan22_moe", **cheap(**overrides))))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])


@pytest.mark.slow
def test_fsdp2_shards_both_experts_and_equals_one_process(tmp_path):
    """tests/fsdp2_worker.py (two CPU processes on gloo) on the tiny twin with LoRA on both experts: its 2 steps are
    one of each expert, so every step runs the idle expert on one row (the same collectives on both processes)."""
    import json
    import subprocess

    from helpers import PYTHON, ROOT, free_port, subprocess_env

    out = tmp_path / "result"
    command = [os.path.join(os.path.dirname(PYTHON), "torchrun"), "--nproc_per_node", "2", "--master_port",
               str(free_port()), "tests/fsdp2_worker.py", str(out), "tiny-wan22-moe:lora"]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads(open(f"{out}.{rank}.json").read())[0] for rank in (0, 1)]
    first = ranks[0]
    assert first["max_abs_weight_change"] > 1e-3 and first["max_abs_weight_diff"] <= 2e-5  # measured 1.9e-7
    assert first["export_max_abs_diff"] == 0.0  # lora/ and lora_2/ of the gathered weights load back exactly
    for kind in ("params", "grads", "optimizer"):  # both experts sharded: each process holds about half
        per_rank = [rank["bytes"][kind] for rank in ranks]
        assert sum(per_rank) == first["full_bytes"][kind] and max(per_rank) <= 0.55 * first["full_bytes"][kind]
    for sharded, full in zip(first["norms"], first["full_norms"]):
        assert sharded == pytest.approx(full, rel=1e-5)


@pytest.mark.slow
def test_the_gpu_check_rows_of_the_two_experts(tmp_path):
    """benchmarks/gpu_check.py: wan22-a14b is Wan 2.2 A14B's architecture sampled as the wan22_a14b_t2v preset;
    its tiny code path (tiny-wan22-moe) passes every check on the CPU."""
    from test_flow_gpu_check import _gpu_check_module, run_check

    gpu_check = _gpu_check_module()
    spec = gpu_check.arch_settings("wan22-a14b", gpu_check.parse_args(["--arch", "wan22-a14b"]))
    assert spec["model"] == "random-wan22-a14b" and spec["video"] and spec["resolution"] == 480
    assert gpu_check.flow_sample_settings(spec)["guidance_scale"] == 4.0
    result, results = run_check(tmp_path, "--arch", "tiny-wan22-moe", "--variants", "grpo")
    assert result.returncode == 0 and "result: PASS" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    row = results["archs"]["tiny-wan22-moe"]["dtypes"]["bf16"]["variants"]["grpo"]
    assert row["approx_kl_by_epoch"] == [0.0, 0.0] and row["on_policy_max_abs_log_ratio"] == 0.0
