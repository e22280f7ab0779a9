"""Flow-matching families (SD3, FLUX) end to end on the tiny pipelines: re-scoring reads the trajectory's own grid,
every algorithm trains, ODE/SDE windows, bad input. (Noise 0 reproducing the pipeline, exact re-scoring and the LoRA
export: tests/test_family_contract.py, as for every family.)"""

import math

import pytest
import torch

from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.diffusion.policy import policy_for
from ddpo_group.diffusion.base import window_noise_levels
from ddpo_group.diffusion.tiny import build_tiny_flux_pipeline, build_tiny_sd3_pipeline
from ddpo_group.diffusion.tiny import build_tiny_pipeline as build_tiny_pipeline_sd
from ddpo_group.training.trainer import Trainer, train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a red circle", "a big blue square"]
BUILDERS = {"sd3": (build_tiny_sd3_pipeline, 4.5), "flux": (build_tiny_flux_pipeline, 3.5)}


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_rescoring_uses_the_trajectories_grid_when_the_scheduler_has_another(family):
    # a user's evaluation or a second pipeline call between sampling and training resets the scheduler's grid;
    # the first timestep (1000) is on every grid, so a lookup on the scheduler would silently score it wrongly
    build, guidance = BUILDERS[family]
    pipeline = build(seed=0)
    policy = policy_for(pipeline)
    trajectories = policy.sample(PROMPTS, 4, guidance, 0.7, generator=torch.Generator().manual_seed(1))
    sampled_grid = pipeline.scheduler.sigmas.clone()  # the grid the scheduler held while sampling
    assert torch.equal(trajectories.sigmas, sampled_grid.float().expand(2, 5)) and sampled_grid[-1] == 0
    # another grid: after sigma = 1 its next sigma differs (FLUX's scheduler shifts by the image size, mu)
    pipeline.scheduler.set_timesteps(7, **({"mu": 0.5} if pipeline.scheduler.config.use_dynamic_shifting else {}))
    assert pipeline.scheduler.sigmas[1] != sampled_grid[1]
    rows = torch.arange(2)
    for k in range(4):
        log_prob, _, _ = policy.step_log_prob(policy.trainable_module, trajectories, rows, torch.full((2,), k), guidance, 0.7)
        assert torch.equal(log_prob, trajectories.log_probs[:, k])


@pytest.mark.parametrize("variant", ["tiny_sd3", "tiny_flux"])
@pytest.mark.parametrize("estimator", ["grpo", "group_ppo"])
def test_two_epochs_of_each_tiny_flow_variant_train(tmp_path, variant, estimator):
    overrides = dict(num_epochs=2, log_images_every=1, algorithm__adv_estimator=estimator)
    if estimator == "group_ppo":
        overrides.update(train__timestep_selection="endpoints", train__use_kl_loss=False, train__use_reference_model=False,
                         group_ppo__max_group_size=2)
    run_dir = train(make_config(tmp_path, variant=variant, **overrides))
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [0, 1]
    assert rows[-1]["train/global_step"] == 4 and rows[-1]["train/skipped_steps"] == 0
    assert rows[0]["approx_kl"] == 0.0 or rows[0]["train/global_step"] > 1
    if estimator == "grpo":
        assert rows[-1]["kl"] >= 0
    else:
        assert rows[-1]["train/unet_calls"] == 2 * 2  # K = 2 endpoints of 4 steps, 2 micro-batches


@pytest.mark.parametrize(
    "overrides",
    [
        dict(algorithm__adv_estimator="ddpo", per_prompt_stat_tracking__min_count=2),
        dict(algorithm__adv_estimator="rloo"),
        dict(algorithm__adv_estimator="gae"),
        dict(algorithm__adv_estimator="grpo", algorithm__norm_adv_by_std=False),
        dict(train__policy_loss="gspo", train__use_reference_model=True, train__use_kl_loss=True, train__kl_type="k3",
             train__beta=0.01),
        dict(train__policy_loss="geo_mean", train__loss_agg_mode="seq-mean-token-mean"),
        dict(sample__sde_type="cps", sample__eta=0.5),
        dict(sample__sde_type="dance", sample__eta=0.3, train__timestep_selection="fraction", train__timestep_fraction=0.5),
    ],
)
def test_every_algorithm_runs_on_a_flow_model(tmp_path, overrides):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_sd3", **cheap(**overrides))))[0]
    assert row["train/skipped_steps"] == 0 and row["train/global_step"] == 2


def test_bf16_autocast_run_of_tiny_sd3_on_the_cpu(tmp_path):
    run_dir = train(make_config(tmp_path, variant="tiny_sd3", mixed_precision="bf16", num_epochs=1,
                                train__gradient_accumulation_steps=2))
    row = read_metrics(run_dir)[0]
    assert row["approx_kl"] == 0.0 and row["train/skipped_steps"] == 0


def test_an_sde_window_trains_only_its_steps(tmp_path):
    run_dir = train(make_config(
        tmp_path, variant="tiny_sd3", debug_dump=True,
        **cheap(sample__num_steps=4, sample__sde_window_size=2, sample__sde_window_start=1),
    ))
    row = read_metrics(run_dir)[0]
    assert row["sample/sde_window_start"] == 1
    assert row["train/unet_calls"] == 2 * 2  # the 2 window steps of each of 2 micro-batches
    from helpers import read_dump

    assert read_dump(run_dir)["mask"] == [[0.0, 1.0, 1.0, 0.0]] * 4  # 4 trajectories


def test_window_noise_levels():
    assert window_noise_levels(0.7, 5) == [0.7] * 5
    assert window_noise_levels(0.7, 5, window_size=2, mode="fixed", start=3) == [0, 0, 0, 0.7, 0.7]
    # sliding: one step later every 2 epochs, wrapping over the 4 possible starts
    starts = [window_noise_levels(1.0, 5, 2, "sliding", 0, 2, epoch).index(1.0) for epoch in range(10)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    random_starts = [window_noise_levels(1.0, 6, 3, "random", epoch=e, seed=7).index(1.0) for e in range(20)]
    assert set(random_starts) <= {0, 1, 2, 3} and len(set(random_starts)) > 1
    assert random_starts == [window_noise_levels(1.0, 6, 3, "random", epoch=e, seed=7).index(1.0) for e in range(20)]


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(sample__sde_type="sdee"), "sample.sde_type"),
        (dict(sample__sde_type="cps", sample__eta=1.5), "sample.eta"),
        (dict(sample__sde_window_size=9), "sample.sde_window_size"),
        (dict(sample__sde_window_size=2, sample__sde_window_start=3), "sample.sde_window_start"),
        (dict(sample__sde_window="moving"), "sample.sde_window"),
        (dict(train__kl_type="flow-grpo"), "train.kl_type"),
        (dict(train__skip_last_steps=4), "train.skip_last_steps"),
        (dict(train__skip_last_steps=-1), "train.skip_last_steps"),
    ],
)
def test_bad_flow_settings_are_named_before_a_model_loads(tmp_path, overrides, field):
    with pytest.raises(ConfigError) as info:
        check_config(make_config(tmp_path, variant="tiny_sd3", **overrides))
    assert field in str(info.value)


def test_an_sde_type_on_a_ddim_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="sample.sde_type"):  # an offline DDIM model: before it loads
        check_config(make_config(tmp_path, sample__sde_type="sde"))
    with pytest.raises(ConfigError, match="sample.sde_type"):  # any other: when its family is known
        Trainer(make_config(tmp_path, sample__sde_type="sde", pretrained__model=str(_saved_tiny(tmp_path))))


def _saved_tiny(tmp_path):
    path = tmp_path / "tiny_sd"
    build_tiny_pipeline_sd(seed=0).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("sde_type", ["sde", "dance", "cps"])
def test_flow_grpo_kl_is_flow_grpos_formula(sde_type):
    # Flow-GRPO (scripts/train_sd3.py): kl = mean_dims (mu - mu_ref)^2 / (2 std_dev_t^2), std_dev_t the noise level
    # g before its sqrt(-dt) factor: sde g = a sqrt(sigma / (1 - sigma)) (sigma = 1: sigmas[1] below), dance g = a;
    # cps (FlowCPS's train_sd3.py): mean_dims (mu - mu_ref)^2, no divisor
    from ddpo_group.algos.losses import gaussian_kl

    a = 0.7 if sde_type != "cps" else 0.5
    pipeline = build_tiny_sd3_pipeline(seed=0)
    policy = policy_for(pipeline)
    policy.configure(sde_type=sde_type)
    trajectories = policy.sample(PROMPTS, 4, 4.5, a, generator=torch.Generator().manual_seed(2))
    reference = build_tiny_sd3_pipeline(seed=1).transformer  # another model: the means differ
    rows = torch.arange(2)
    grid = trajectories.sigmas[0].double()
    for k in range(3):
        steps = torch.full((2,), k)
        _, mean, std = policy.step_log_prob(policy.trainable_module, trajectories, rows, steps, 4.5, a)
        _, ref_mean, _ = policy.step_log_prob(reference, trajectories, rows, steps, 4.5, a)
        ours = gaussian_kl(mean, ref_mean, policy.flow_grpo_kl_std(trajectories, rows, steps, std))
        sigma, sigma_next = float(grid[k]), float(grid[k + 1])
        if sde_type == "sde":
            g = a * math.sqrt(sigma / (1 - (float(grid[1]) if sigma == 1 else sigma)))
        elif sde_type == "dance":
            g = a
        else:
            g = math.sqrt(0.5)
        expected = ((mean.double() - ref_mean.double()) ** 2).flatten(1).mean(1) / (2 * g * g)
        torch.testing.assert_close(ours.double(), expected, rtol=1e-4, atol=0)
        if sde_type != "cps":  # the exact Gaussian KL is 1/|dt| times larger
            exact = gaussian_kl(mean, ref_mean, std).double()
            torch.testing.assert_close(exact * (sigma - sigma_next), expected, rtol=1e-4, atol=0)


def test_flow_grpo_kl_on_a_ddim_model_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="train.kl_type"):
        check_config(make_config(tmp_path, variant="test", train__kl_type="flow_grpo"))


def test_the_flow_presets_use_flow_grpos_kl_scale_and_never_train_the_last_step(tmp_path):
    from ddpo_group.config import grpo

    for name in ("sd35", "flux"):
        config = grpo.get_config(name)
        assert config.train.kl_type == "flow_grpo" and config.train.skip_last_steps == 1
    run_dir = train(make_config(tmp_path, variant="tiny_sd3", **cheap(
        sample__num_steps=4, train__kl_type="flow_grpo", train__skip_last_steps=1, train__use_reference_model=True,
        train__use_kl_loss=True, train__beta=0.04)))
    row = read_metrics(run_dir)[0]
    assert row["steps/trained"] == [1, 1, 1, 0]
    assert row["steps/approx_kl"][-1] is None and math.isfinite(row["kl"])


def test_a_negative_prompt_for_flux_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="sample.negative_prompt"):
        Trainer(make_config(tmp_path, variant="tiny_flux", **cheap(sample__negative_prompt="blurry")))
    assert not (tmp_path / "r").exists()
