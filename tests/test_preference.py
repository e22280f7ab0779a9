"""The preference objectives, train.objective dgpo / dpo (docs/forward.md; ddpo_group/algos/preference.py).

The losses against the papers' formulas written out here on fixed tensors; at policy = reference DPO's loss is log 2
and its gradient the equal-weight denoising one; DGPO's partition-free group loss; a training step of each objective
on each tiny family; the variants; the offline preference file (generated PNGs) and its one-line errors.
"""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.algos.preference import dgpo_clip_mask, dgpo_loss, diffusion_dpo_loss
from ddpo_group.config.check import ConfigError, check_config
from ddpo_group.training.preference_training import best_worst_pairs, group_units, load_preference_pairs
from ddpo_group.training.trainer import train
from tests.helpers import make_config, read_metrics


def _mse(a, b):
    """||a - b||^2 averaged over the non-batch dims, written out."""
    return ((a.double() - b.double()) ** 2).reshape(a.shape[0], -1).mean(dim=1)


def _fixed(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- Diffusion-DPO


def test_dpo_loss_is_the_papers_formula_on_fixed_tensors():
    pw, rw, tw, pl, rl, tl = (_fixed(i, 3, 2, 4, 4) for i in range(6))
    beta = 7.0
    # Wallace et al. eq. 14 with beta T as one constant and the released code's 1/2:
    # -log sigmoid(-beta/2 * ((||tw - pw||^2 - ||tw - rw||^2) - (||tl - pl||^2 - ||tl - rl||^2)))
    inner = (_mse(tw, pw) - _mse(tw, rw)) - (_mse(tl, pl) - _mse(tl, rl))
    expected = -torch.log(torch.sigmoid(-beta / 2 * inner))
    got = diffusion_dpo_loss(pw, rw, tw, pl, rl, tl, beta)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_dpo_loss_is_log_2_and_its_gradient_equal_weight_denoising_where_the_policy_is_the_reference():
    rw, tw, rl, tl = (_fixed(10 + i, 2, 3, 4) for i in range(4))
    pw, pl = rw.clone().requires_grad_(True), rl.clone().requires_grad_(True)
    beta, dims = 100.0, 12
    loss = diffusion_dpo_loss(pw, rw, tw, pl, rl, tl, beta)
    torch.testing.assert_close(loss, torch.full((2,), math.log(2.0)))
    loss.sum().backward()
    # at D = 0 the sigmoid is 1/2: dL/dp_w = beta/4 * d||t_w - p_w||^2/dp_w = beta/4 * 2 (p_w - t_w) / dims, the
    # loser's with the opposite sign: the winner denoised better, the loser worse, equally
    torch.testing.assert_close(pw.grad, beta / 4 * 2 * (rw - tw) / dims)
    torch.testing.assert_close(pl.grad, -beta / 4 * 2 * (rl - tl) / dims)


def test_dpo_loss_falls_when_the_policy_denoises_the_winner_better_than_the_reference():
    rw, tw, rl, tl = (_fixed(20 + i, 1, 8) for i in range(4))
    better = tw + 0.5 * (rw - tw)  # the winner's error shrinks, the loser's prediction stays the reference's
    assert float(diffusion_dpo_loss(better, rw, tw, rl, rl, tl, 10.0)) < math.log(2.0)
    worse = tw + 2.0 * (rw - tw)
    assert float(diffusion_dpo_loss(worse, rw, tw, rl, rl, tl, 10.0)) > math.log(2.0)


# ---- DGPO


def test_dgpo_loss_is_the_group_preference_formula_on_fixed_tensors():
    prediction, reference, target = (_fixed(30 + i, 5, 2, 3) for i in range(3))
    advantages = torch.tensor([1.0, -0.5, -0.5, 2.0, -2.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    beta = 3.0
    d = _mse(prediction, target) - _mse(reference, target)
    # per group: -log sigmoid(-beta / |G| sum_i A_i D_i) / beta
    expected = torch.stack([
        -torch.log(torch.sigmoid(-beta / 3 * (advantages[:3].double() * d[:3]).sum())) / beta,
        -torch.log(torch.sigmoid(-beta / 2 * (advantages[3:].double() * d[3:]).sum())) / beta,
    ])
    got = dgpo_loss(prediction, reference, target, advantages, groups, beta)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)


def test_dgpo_is_the_positive_over_negative_group_preference_with_the_partition_term_cancelled():
    # the group-level Bradley-Terry loss -log sigmoid(R(G+) - R(G-)) / beta with R(G) = sum_{x in G} |A(x)| / |G| r(x)
    # and DPO's implicit reward r(x) = beta log pi / pi_ref = -beta D(x) + c, where c (beta log Z(prompt)) is the same
    # for every sample of the prompt: it cancels because the advantages sum to 0 (sum |A| is equal on both sides)
    prediction, reference, target = (_fixed(40 + i, 4, 6) for i in range(3))
    advantages = torch.tensor([1.5, -1.0, 0.5, -1.0])  # sums to 0, as GRPO's do
    beta, c = 2.0, 0.3
    r = -beta * (_mse(prediction, target) - _mse(reference, target)) + c
    w = advantages.abs().double() / 4
    positive, negative = (w * r)[advantages > 0].sum(), (w * r)[advantages < 0].sum()
    expected = -torch.log(torch.sigmoid(positive - negative)) / beta
    got = dgpo_loss(prediction, reference, target, advantages, torch.zeros(4, dtype=torch.int64), beta)
    torch.testing.assert_close(got.double(), expected.reshape(1), rtol=1e-5, atol=1e-7)


def test_dgpo_at_the_reference_is_log2_over_beta_and_half_the_advantage_weighted_matching_gradient():
    reference, target = _fixed(50, 4, 5), _fixed(51, 4, 5)
    prediction = reference.clone().requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0, 2.0, -2.0])
    groups = torch.tensor([0, 0, 1, 1])
    beta = 50.0
    loss = dgpo_loss(prediction, reference, target, advantages, groups, beta)
    torch.testing.assert_close(loss, torch.full((2,), math.log(2.0) / beta))
    loss.sum().backward()
    # sigmoid(0) / |G| * A_i * d||p_i - t_i||^2 / dp_i, |G| = 2, 5 dims
    expected = 0.5 / 2 * advantages[:, None] * 2 * (reference - target) / 5
    torch.testing.assert_close(prediction.grad, expected)


def test_groups_and_online_pairs_come_from_the_prompt_ids():
    prompt_ids = torch.tensor([7, 3, 7, 3, 9, 9])
    assert [u.tolist() for u in group_units(prompt_ids)] == [[0, 2], [1, 3], [4, 5]]
    scores = torch.tensor([0.1, 2.0, 0.5, -1.0, 0.3, 0.3])
    # best then worst of each group; the group of equal scores (9) gives no pair
    assert [p.tolist() for p in best_worst_pairs(prompt_ids, scores)] == [[2, 0], [1, 3]]


# ---- training on each family's tiny twin


def _preference_config(tmp_path, variant, objective, **overrides):
    values = dict(num_epochs=1, log_images_every=0, train__objective=objective, train__use_reference_model=True,
                  train__use_kl_loss=False, train__beta=0.0, forward__num_timesteps=2, train__learning_rate=1e-3,
                  forward__old_decay_rate=0.0, forward__old_decay_max=0.0)
    values.update(overrides)
    return make_config(tmp_path, variant=variant, **values)


@pytest.mark.parametrize("variant", ["test", "tiny_sd3", "tiny_flux"])
@pytest.mark.parametrize("objective", ["dgpo", "dpo"])
def test_a_preference_objective_trains_a_step_on_each_tiny_family(tmp_path, variant, objective):
    row = read_metrics(train(_preference_config(tmp_path, variant, objective, sample__eta=0.0)))[0]
    # the test twins sample 4 images in groups of 2 (one group of 4 where both draw the same prompt); a micro-batch of
    # 2 images holds one group or one pair, one optimizer step each
    units = row[f"preference/{'groups' if objective == 'dgpo' else 'pairs'}"]
    assert units in (1, 2) and row["train/global_step"] == units and row["train/skipped_steps"] == 0
    assert math.isfinite(row["loss"]) and row["grad_norm"] > 0


def test_dgpo_with_its_clip_trains_and_logs_the_clipped_share(tmp_path):
    row = read_metrics(train(_preference_config(tmp_path, "tiny_sd3", "dgpo", forward__dgpo_clip_range=1e-3)))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"]) and 0.0 <= row["clipfrac"] <= 1.0


@pytest.mark.parametrize("variant", ["tiny_sd3_dgpo", "tiny_sd3_dpo"])
def test_the_tiny_sd3_twins_train_an_epoch(tmp_path, variant):
    row = read_metrics(train(make_config(tmp_path, variant=variant, num_epochs=1, log_images_every=0)))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])


@pytest.mark.parametrize("variant", ["tiny_dgpo", "tiny_dpo"])
def test_the_main_job_twins_train_an_epoch(tmp_path, variant):
    # the main job's model and prompts, one sampling batch of 16 in groups of 8 (to stay seconds)
    run = train(make_config(tmp_path, variant=variant, num_epochs=1, log_images_every=0, eval_freq=0, save_freq=0,
                            sample__batch_size=16, sample__num_batches_per_epoch=1))
    row = read_metrics(run)[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"]) and row["train/global_step"] >= 1


# ---- config checks


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(train__use_reference_model=False), "train.use_reference_model"),
        (dict(forward__dgpo_beta=0.0), "forward.dgpo_beta"),
        (dict(forward__dgpo_clip_range=-1e-3), "forward.dgpo_clip_range"),
        (dict(train__objective="dpo", forward__dpo_beta=-1.0), "forward.dpo_beta"),
        (dict(train__objective="dpo", forward__dpo_pairs="both"), "forward.dpo_pairs"),
        (dict(train__objective="dpo", forward__dpo_pairs="offline"), "forward.preference_file"),
        (dict(train__objective="dpo", forward__preference_file="x.jsonl"), "forward.preference_file"),
        (dict(sample__group_size=1, sample__batch_size=4), "sample.group_size"),
    ],
)
def test_bad_preference_settings_are_named(tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as err:
        check_config(_preference_config(tmp_path, "test", "dgpo", **overrides))
    assert "\n" not in str(err.value)


def test_the_preference_objectives_run_on_one_process(tmp_path):
    with pytest.raises(ConfigError, match="one process"):
        check_config(_preference_config(tmp_path, "test", "dgpo"), num_processes=2)


# ---- offline pairs


def _png(path, color):
    Image.fromarray(np.full((16, 16, 3), color, dtype=np.uint8)).save(path)


def _preference_file(tmp_path, lines):
    for name, color in (("a.png", (200, 30, 30)), ("b.png", (30, 30, 200))):
        _png(tmp_path / name, color)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_an_offline_preference_file_is_read_with_paths_relative_to_it(tmp_path):
    path = _preference_file(tmp_path, [json.dumps({"prompt": "a red square", "chosen": "a.png", "rejected": "b.png"}),
                                       ""])
    pairs = load_preference_pairs(path)
    assert pairs == [{"prompt": "a red square", "chosen": str(tmp_path / "a.png"), "rejected": str(tmp_path / "b.png")}]


@pytest.mark.parametrize("line,says", [
    ("{not json", "invalid JSON"),
    (json.dumps({"prompt": "p", "chosen": "a.png"}), "'rejected'"),
    (json.dumps({"prompt": "p", "chosen": "a.png", "rejected": "missing.png"}), "missing.png"),
])
def test_a_bad_preference_line_is_named_by_file_and_line(tmp_path, line, says):
    good = json.dumps({"prompt": "p", "chosen": "a.png", "rejected": "b.png"})
    path = _preference_file(tmp_path, [good, line])
    with pytest.raises(ValueError, match=f"pairs.jsonl, line 2: .*{says}"):
        load_preference_pairs(path)
    with pytest.raises(ConfigError, match="forward.preference_file") as err:
        check_config(_preference_config(tmp_path, "test", "dpo", forward__dpo_pairs="offline",
                                        forward__preference_file=path))
    assert "pairs.jsonl, line 2" in str(err.value) and "\n" not in str(err.value)


def test_a_preference_file_that_is_not_utf8_names_its_line_and_byte(tmp_path):
    # it was a UnicodeDecodeError traceback (the fifth audit's class: every data file is one line naming the byte)
    good = json.dumps({"prompt": "p", "chosen": "a.png", "rejected": "b.png"})
    path = _preference_file(tmp_path, [good])
    with open(path, "ab") as handle:
        handle.write(b'{"prompt": "caf\xe9", "chosen": "a.png", "rejected": "b.png"}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl, line 2: byte 0xe9 .* not UTF-8"):
        load_preference_pairs(path)


@pytest.mark.parametrize("variant", ["test", "tiny_sd3"])
def test_offline_pairs_of_generated_pngs_train(tmp_path, variant):
    record = {"prompt": "a red square", "chosen": "a.png", "rejected": "b.png"}
    path = _preference_file(tmp_path, [json.dumps(record), json.dumps({**record, "prompt": "a blue circle"})])
    row = read_metrics(train(_preference_config(tmp_path, variant, "dpo", forward__dpo_pairs="offline",
                                                forward__preference_file=path, train__batch_size=2)))[0]
    # two pairs, one pair (two images) a micro-batch: two optimizer steps
    assert row["preference/pairs"] == 2 and row["train/global_step"] == 2
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"]) and row["grad_norm"] > 0


def test_dgpos_clip_never_acts_at_the_sampling_model_and_stops_a_sample_that_moved_far_enough():
    old, reference, target = (_fixed(60 + i, 4, 6) for i in range(3))
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    groups = torch.zeros(4, dtype=torch.int64)
    # at prediction = old every ratio is exactly 1: nothing is clipped, the loss is the unclipped one
    assert not dgpo_clip_mask(old, old, target, advantages, 1e-3).any()
    # sample 0 (A > 0) denoised much better than the sampling model: ratio exp(e_old - e) > 1 + c, clipped;
    # sample 1 (A < 0) moved the same way (against its advantage) is not
    prediction = old.clone()
    prediction[:2] = target[:2] + 0.1 * (old[:2] - target[:2])
    e_old, e_new = _mse(old, target), _mse(prediction, target)
    ratio = torch.exp(e_old - e_new)
    assert ratio[0] > 1.01 and ratio[1] > 1.01
    clipped = dgpo_clip_mask(prediction, old, target, advantages, 1e-2)
    assert clipped.tolist() == [True, False, False, False]
    prediction.requires_grad_(True)
    loss = dgpo_loss(prediction, reference, target, advantages, groups, 5.0, clipped)
    torch.testing.assert_close(loss, dgpo_loss(prediction.detach(), reference, target, advantages, groups, 5.0))
    loss.sum().backward()
    assert prediction.grad[0].abs().max() == 0 and prediction.grad[1].abs().max() > 0


@pytest.mark.parametrize("objective", ["dgpo", "dpo"])
def test_a_preference_run_resumes_to_the_weights_of_a_run_that_never_stopped(tmp_path, objective):
    import os

    from safetensors.torch import load_file

    def weights(run):
        return load_file(os.path.join(run, "checkpoints", "checkpoint_2", "transformer", "diffusion_pytorch_model.safetensors"))

    straight = train(_preference_config(tmp_path, "tiny_sd3", objective, num_epochs=2, save_freq=1, run_name="straight"))
    stopped = train(_preference_config(tmp_path, "tiny_sd3", objective, num_epochs=1, save_freq=1, run_name="stopped"))
    resumed = train(_preference_config(tmp_path, "tiny_sd3", objective, num_epochs=2, save_freq=1, run_name="stopped",
                                       resume_from=stopped))
    end, again = weights(straight), weights(resumed)
    assert set(end) == set(again) and all(torch.equal(end[k], again[k]) for k in end)
    assert read_metrics(resumed)[1]["loss"] == read_metrics(straight)[1]["loss"]
