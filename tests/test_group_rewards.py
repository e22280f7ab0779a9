"""Group-wise rewards (rewards/base.py): whole prompt groups in one call, the same values whatever the batching and
the number of processes; pickscore_rank (Flow-Factory's PickScore_Rank); PickScore on Flow-GRPO's scale; hpsv3's
readiness and adapter through a stand-in inferencer (the real package pins transformers 4.45.2 and needs the 7B
model: not installable or loadable here)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ddpo_group.diffusion.policy import policy_for
from ddpo_group.diffusion.tiny import build_tiny_pipeline, build_tiny_tokenizer
from ddpo_group.evaluation.evaluator import evaluate
from ddpo_group.data.prompts import load_prompts
from ddpo_group.rewards import CombinedReward, RewardError, RewardNotReadyError, build_reward_fn, get_reward
from ddpo_group.rewards.optional import group_ranks
from ddpo_group.training.trainer import train
from helpers import (PYTHON, ROOT, free_port, make_config, read_dump, read_json, read_metrics, subprocess_env,
                     tiny_clip_model)

PLUGIN = os.path.join(ROOT, "tests", "group_reward_plugin.py")
BRIGHTNESS, RANK = f"{PLUGIN}:brightness", f"{PLUGIN}:brightness_rank"


def expected_ranks(values):
    """rank / G with 0 for the lowest, ties by position: a plain double loop."""
    n = len(values)
    return np.array([sum(values[k] < values[i] or (values[k] == values[i] and k < i) for k in range(n)) / n
                     for i in range(n)])


def test_group_ranks_average_and_ordinal_ties_from_written_values():
    scores = [0.3, 0.1, 0.3, 0.9]
    assert group_ranks(scores).tolist() == [1.5, 0.0, 1.5, 3.0]  # 0.3 and 0.3 span ranks 1 and 2
    assert group_ranks(scores, ties="ordinal").tolist() == [1.0, 0.0, 2.0, 3.0]
    assert group_ranks([2.0]).tolist() == [0.0]
    with pytest.raises(ValueError, match="ties"):
        group_ranks(scores, ties="dense")


def _images(values):
    """(B, 3, 4, 4) images of constant brightness values[b]."""
    return torch.tensor(values, dtype=torch.float64).view(-1, 1, 1, 1).expand(-1, 3, 4, 4).clone()


@pytest.mark.parametrize("batch_size, workers", [(None, 1), (1, 1), (2, 3)])
def test_a_group_wise_component_sees_each_group_whole_whatever_the_batch_size(batch_size, workers):
    prompts = ["a", "b", "a", "c", "b", "a"]
    brightness = [0.5, 0.2, 0.1, 0.7, 0.4, 0.9]
    reward = build_reward_fn(None, {BRIGHTNESS: 1.0, RANK: 2.0}, reward_workers=workers,
                             reward_batch_size=batch_size)
    assert reward.group_wise_names == ["brightness_rank"]
    total, parts, _ = reward(_images(brightness), prompts)
    # group a = samples 0, 2, 5 (0.5, 0.1, 0.9): ranks 1, 0, 2 of 3; b = 1, 4 (0.2, 0.4); c = 3 alone
    rank = [1 / 3, 0 / 2, 0 / 3, 0 / 1, 1 / 2, 2 / 3]
    np.testing.assert_allclose(parts["brightness_rank"], rank, rtol=0, atol=1e-15)
    np.testing.assert_allclose(parts["brightness"], brightness, rtol=0, atol=1e-15)
    np.testing.assert_allclose(total, np.array(brightness) + 2.0 * np.array(rank), rtol=0, atol=1e-12)
    # group keys other than the prompt (the rollout's prompt ids), and one kind alone
    _, by_key, _ = reward(_images(brightness), ["z"] * 6, groups=[0, 0, 0, 1, 1, 1], only="group_wise")
    assert list(by_key) == ["brightness_rank"]
    # group 0 = (0.5, 0.2, 0.1): ranks 2, 1, 0; group 1 = (0.7, 0.4, 0.9): ranks 1, 0, 2
    np.testing.assert_allclose(by_key["brightness_rank"], [2 / 3, 1 / 3, 0, 1 / 3, 0, 2 / 3], atol=1e-15)


def test_a_failing_group_wise_reward_names_the_group_not_a_sample():
    def broken(images, prompts, metadata):
        if prompts[0] == "b":
            raise ZeroDivisionError("no")
        return torch.zeros(len(prompts)), {}

    broken.group_wise = True
    with pytest.raises(RewardError, match=r"on the prompt group of samples 1, 3 \(prompts 'b', 'b'\)"):
        CombinedReward({"broken": broken})(_images([0.1, 0.2, 0.3, 0.4]), ["a", "b", "a", "b"])


def test_a_served_group_wise_reward_makes_its_client_group_wise():
    from ddpo_group.rewards.server import make_server
    from group_reward_plugin import brightness_rank

    values = [0.2, 0.6, 0.4, 0.8]  # multiples of 1/255 would survive the PNG's 8 bits; these keep their order
    with make_server(brightness_rank, name="brightness_rank") as url:
        reward = build_reward_fn(None, {url: 1.0, BRIGHTNESS: 1.0})
        assert reward.group_wise_names == ["brightness_rank"]
        _, parts, _ = reward(_images(values).float(), ["a", "b", "a", "b"])
    # the server refuses a call with several prompts (the plugin raises): each POST held one group
    np.testing.assert_allclose(parts["brightness_rank"], [0, 0, 1 / 2, 1 / 2], atol=1e-12)


RECORDS = load_prompts("shapes")[:4]


def _evaluate(batch_size, spec=None):
    reward = build_reward_fn(None, spec or {BRIGHTNESS: 1.0, RANK: 0.5})
    return evaluate(policy_for(build_tiny_pipeline(seed=0)), None, RECORDS, reward, images_per_prompt=3,
                    num_steps=2, guidance_scale=3.0, eta=1.0, seed=7, batch_size=batch_size)


def test_an_evaluation_gives_each_prompts_images_to_one_group_wise_call_whatever_the_batch_size():
    small, large = _evaluate(2), _evaluate(12)  # batches sample the same images up to float rounding
    np.testing.assert_allclose(small["rewards"], large["rewards"], rtol=0, atol=1e-6)
    brightness = _evaluate(5, {BRIGHTNESS: 1.0})["rewards"]  # the per-image component alone, same images
    ranks = np.stack([expected_ranks(row) for row in brightness])
    np.testing.assert_allclose(small["rewards"], brightness + 0.5 * ranks, rtol=0, atol=1e-6)
    assert small["components"]["brightness_rank"] == pytest.approx(np.mean(ranks))
    # a group-wise gold reward (config.eval_rewards) is scored on whole groups too
    gold = evaluate(policy_for(build_tiny_pipeline(seed=0)), None, RECORDS, build_reward_fn(BRIGHTNESS), 3, 2, 3.0,
                    1.0, seed=7, batch_size=2, gold_fn=build_reward_fn(None, {RANK: 1.0}))["gold"]["brightness_rank"]
    np.testing.assert_allclose(gold, ranks, atol=1e-12)


def test_the_rollouts_collector_scores_each_owned_group_once_complete_and_stops_on_a_failure():
    """One process (the two-process run is below): groups of prompt ids completed over two batches."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddpo_group.rewards import AsyncRewardRunner
    from ddpo_group.training.rollout import GroupCollector
    from group_reward_plugin import brightness_rank

    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    batches = [np.array([1, 0, 1, 2]), np.array([0, 2, 0, 1])]  # prompt 0: samples 1, 4, 6; 1: 0, 2, 7; 2: 3, 5
    values = [0.9, 0.5, 0.1, 0.3, 0.2, 0.6, 0.8, 0.4]
    runner = AsyncRewardRunner(CombinedReward({"rank": brightness_rank}))
    collector = GroupCollector(batches, RECORDS, runner, acc)
    collector.add(0, _images(values[:4]).float())
    assert collector.futures == []  # no group is complete after the first batch
    collector.add(1, _images(values[4:]).float())
    parts, _ = collector.results(list(range(8)), timeout=None)
    # prompt 0: (0.5, 0.2, 0.8) -> 1, 0, 2; prompt 1: (0.9, 0.1, 0.4) -> 2, 0, 1; prompt 2: (0.3, 0.6) -> 0, 1
    expected = [2 / 3, 1 / 3, 0, 0, 0, 1 / 2, 2 / 3, 1 / 3]
    np.testing.assert_allclose(parts["rank"], expected, atol=1e-6)

    def broken(images, prompts, metadata):
        raise KeyError("no model")

    broken.group_wise = True
    broken_runner = AsyncRewardRunner(CombinedReward({"broken": broken}))
    failing = GroupCollector(batches[:1], RECORDS, broken_runner, acc)
    failing.add(0, _images(values[:4]).float())
    with pytest.raises(RewardError, match="reward 'broken' raised KeyError"):
        failing.results(list(range(4)), timeout=None)
    runner.shutdown()
    broken_runner.shutdown()


def _check_training_groups(run_dir, ranks, group_size):
    """Each prompt group's group-wise component, gathered over the ranks' dumps, is the rank of its per-image one."""
    dumps = [read_dump(run_dir, rank=rank) for rank in range(ranks)]
    ids = sum((d["prompt_ids"] for d in dumps), [])
    bright = np.concatenate([d["components"]["brightness"] for d in dumps])
    rank = np.concatenate([d["components"]["brightness_rank"] for d in dumps])
    rewards = np.concatenate([d["rewards"] for d in dumps])
    for pid in set(ids):
        members = [n for n, p in enumerate(ids) if p == pid]
        assert len(members) % group_size == 0
        np.testing.assert_allclose(rank[members], expected_ranks(bright[members]), atol=1e-6)
    np.testing.assert_allclose(rewards, bright + 0.5 * rank, atol=1e-5)
    return [set(d["prompt_ids"]) for d in dumps]


RUN = dict(num_epochs=1, eval_freq=1, eval_images_per_prompt=3,
           log_images_every=0, save_freq=0, debug_dump=True, sample__num_steps=2, train__use_reference_model=False,
           train__use_kl_loss=False, train__beta=0.0, reward_fn="")


@pytest.mark.slow
def test_group_wise_rewards_on_one_and_two_processes(tmp_path):
    """One run in this process (8 samples per batch, evaluation batches of 5) and one on two processes (4 per
    process, evaluation batches of 64): every group is scored whole in training, across the ranks too, and the
    initial weights' evaluation gives the same (prompt, image) rewards."""
    import ml_collections

    weights = {BRIGHTNESS: 1.0, RANK: 0.5}
    eval_prompts = tmp_path / "eval.txt"
    eval_prompts.write_text("a red square\na blue circle\na green square\n")
    run = dict(RUN, eval_prompt_fn=str(eval_prompts))

    one = train(make_config(tmp_path, run_name="one", sample__batch_size=8, eval_batch_size=5,
                            reward_weights=ml_collections.ConfigDict(weights, allow_dotted_keys=True), **run))
    _check_training_groups(one, 1, group_size=2)
    args = ["scripts/train.py", "--config", "config/grpo.py:test", f"--config.logdir={tmp_path}",
            "--config.run_name=two", "--config.eval_batch_size=64", "--config.reward_fn=",
            f"--config.reward_weights={json.dumps(weights)}"]
    args += [f"--config.{key.replace('__', '.')}={value}" for key, value in run.items() if key != "reward_fn"]
    launcher = [os.path.join(os.path.dirname(PYTHON), "torchrun"), "--nproc_per_node", "2",
                "--master_port", str(free_port())]
    done = subprocess.run(launcher + args, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    two = str(tmp_path / "two")
    on_ranks = _check_training_groups(two, 2, group_size=2)
    assert on_ranks[0] & on_ranks[1]  # a group split over the ranks was scored whole
    first = [read_json(os.path.join(run, "samples", "eval_0000.json"))["rewards"] for run in (one, two)]
    np.testing.assert_allclose(first[1], first[0], rtol=0, atol=1e-6)


# ---- PickScore: Flow-GRPO's value, and pickscore_rank on it ----

def tiny_clip(seed=0, logit_scale=2.5):
    return tiny_clip_model(seed, logit_scale_init_value=logit_scale)


def tiny_image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


PROMPTS = ["a red square", "a blue circle", "a red square"]


def _pil_images(seed=3, size=48):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(3, size, size, 3), dtype=np.uint8)
    return [Image.fromarray(p) for p in pixels], torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255


def flow_grpo_pickscore(clip, tokenizer, processor, prompts, pil_images):
    """Flow-GRPO's formula (flow_grpo/pickscore_scorer.py), written here: the processor on PIL images, the prompts
    padded to the longest, unit embeddings, logit_scale.exp() x the diagonal of text @ image.T, then / 26."""
    with torch.no_grad():
        pixel_values = processor(images=pil_images, return_tensors="pt")["pixel_values"]
        image = clip.visual_projection(clip.vision_model(pixel_values=pixel_values).pooler_output)
        tokens = tokenizer(prompts, padding=True, truncation=True, max_length=16, return_tensors="pt")
        text = clip.text_projection(clip.text_model(**tokens).pooler_output)
        image = image / image.norm(p=2, dim=-1, keepdim=True)
        text = text / text.norm(p=2, dim=-1, keepdim=True)
        return (clip.logit_scale.exp() * (text @ image.T)).diag().numpy() / 26


def test_pickscore_with_divisor_26_and_the_processor_equals_flow_grpos_value():
    clip, tokenizer, processor = tiny_clip(seed=4), build_tiny_tokenizer(), tiny_image_processor()
    pil_images, images = _pil_images()
    expected = flow_grpo_pickscore(clip, tokenizer, processor, PROMPTS, pil_images)
    reward = get_reward("pickscore", model=clip, tokenizer=tokenizer, image_processor=processor, divisor=26,
                        preprocess="processor")
    np.testing.assert_allclose(reward(images, PROMPTS, [{}] * 3)[0].numpy(), expected, rtol=1e-5, atol=1e-6)
    # the default: PickScore's own scale (26x), torch preprocessing (resize differs at rounding level only)
    default = get_reward("pickscore", model=clip, tokenizer=tokenizer)(images, PROMPTS, [{}] * 3)[0].numpy()
    np.testing.assert_allclose(default / 26, expected, rtol=0, atol=0.02 * np.exp(2.5) / 26)
    with pytest.raises(ValueError, match="reward_kwargs.pickscore.divisor"):
        get_reward("pickscore", divisor=0)


def test_pickscore_rank_is_the_rank_of_pickscore_within_the_group():
    clip, tokenizer = tiny_clip(seed=5), build_tiny_tokenizer()
    _, images = _pil_images(seed=6)
    images = torch.cat([images, images[:1]])  # sample 3 repeats sample 0: a tie in group "a red square"
    prompts = PROMPTS + ["a red square"]
    scores = get_reward("pickscore", model=clip, tokenizer=tokenizer)(images, prompts, [{}] * 4)[0].numpy()
    kwargs = {"pickscore_rank": {"model": clip, "tokenizer": tokenizer}}
    reward = build_reward_fn("pickscore_rank", reward_kwargs=kwargs)
    assert reward.group_wise_names == ["pickscore_rank"]
    _, parts, info = reward(images, prompts)
    group = [0, 2, 3]  # scores[0] == scores[3]: they share ranks (r, r + 1) -> r + 0.5
    # (rank of sample 2, first rank of the tied pair): below the pair, or above it
    low, tied = (0, 1) if scores[2] < scores[0] else (2, 0)
    expected = np.zeros(4)
    expected[[0, 3]] = (tied + 0.5) / 3
    expected[2] = low / 3
    expected[1] = 0.0  # "a blue circle" alone: rank 0 of 1
    np.testing.assert_allclose(parts["pickscore_rank"], expected, atol=1e-12)
    assert scores[group[0]] == pytest.approx(scores[group[2]], abs=1e-6)
    assert np.ravel(info["pickscore_rank/pickscore"]).size == 4


# ---- HPSv3 ----

class StandInInferencer:
    """HPSv3RewardInferencer's interface: .reward(pil_images, prompts) -> (B, 2) of (mu, sigma)."""

    def __init__(self):
        self.calls = []

    def reward(self, images, prompts):
        self.calls.append((len(images), list(prompts)))
        mu = [float(np.asarray(image).mean()) / 255 + len(prompt) for image, prompt in zip(images, prompts)]
        return torch.tensor([[m, 0.25] for m in mu])


def test_hpsv3_takes_mu_of_the_inferencer_on_pil_images():
    inferencer = StandInInferencer()
    reward = build_reward_fn("hpsv3", reward_kwargs={"hpsv3": {"inferencer": inferencer}})
    reward.check_ready()
    images = _images([0.2, 0.6]).float()
    total, _, info = reward(images, ["ab", "abcd"])
    np.testing.assert_allclose(total, [2 + 51 / 255, 4 + 153 / 255], rtol=1e-6)  # uint8: round(255 x) / 255
    assert inferencer.calls == [(2, ["ab", "abcd"])]
    assert np.ravel(info["hpsv3/sigma"]).tolist() == [0.25, 0.25]


def test_hpsv3_missing_package_or_checkpoint_is_one_line_before_any_model_loads(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "hpsv3", None)
    with pytest.raises(RewardNotReadyError, match="pip install hpsv3") as error:
        build_reward_fn("hpsv3").check_ready()
    assert "\n" not in str(error.value)

    class Package:  # an importable stand-in: constructing the inferencer would load the 7B model
        def HPSv3RewardInferencer(self, **kwargs):  # noqa: N802
            raise AssertionError("no model may load before the files are checked")

    monkeypatch.setitem(sys.modules, "hpsv3", Package())
    missing = str(tmp_path / "HPSv3.safetensors")
    with pytest.raises(RewardNotReadyError, match=r"checkpoint_path=.* is not a file.*huggingface-cli download "
                                                  r"MizzenAI/HPSv3 HPSv3.safetensors"):
        build_reward_fn("hpsv3", reward_kwargs={"hpsv3": {"checkpoint_path": missing}}).check_ready()


def test_the_sd35_pickscore_recipe_runs_two_epochs_on_tiny_sd3_with_the_real_pickscore_path(tmp_path):
    """The preset's task, reward and algorithm fields as they are; its model and sizes swapped for tiny-sd3 and a
    random tiny CLIP with its tokenizer and image processor saved as PickScore's checkpoint directories are."""
    from ddpo_group.config import grpo

    clip_dir, processor_dir = str(tmp_path / "clip"), str(tmp_path / "processor")
    tiny_clip(seed=2).save_pretrained(clip_dir)
    build_tiny_tokenizer().save_pretrained(processor_dir)
    tiny_image_processor().save_pretrained(processor_dir)
    prompts = tmp_path / "train.txt"
    prompts.write_text("a red square\na blue circle\na green square\n")
    config = grpo.get_config("sd35_pickscore")
    assert dict(config.reward_kwargs.pickscore) == {"divisor": 26.0, "preprocess": "processor"}
    config.reward_kwargs.pickscore.update(model=clip_dir, tokenizer=processor_dir)
    config.pretrained.model, config.mixed_precision, config.use_lora = "tiny-sd3", "no", False
    config.logdir, config.run_name, config.num_epochs, config.save_freq, config.log_images_every = (
        str(tmp_path), "r", 2, 0, 0)
    config.prompt_fn = config.eval_prompt_fn = str(prompts)
    config.eval_freq = 1
    for key, value in dict(batch_size=4, group_size=2, num_batches_per_epoch=1, num_steps=3, resolution=0,
                           max_sequence_length=16).items():
        config.sample[key] = value
    config.train.batch_size, config.train.gradient_accumulation_steps = 2, 1
    rows = read_metrics(train(config))
    trained = [row for row in rows if "reward_mean" in row]
    assert [row["epoch"] for row in trained] == [0, 1]
    # PickScore / 26 of a random CLIP with logit scale e^2.5: |r| <= e^2.5 / 26 < 0.47
    assert all(abs(row["reward_mean"]) < np.exp(2.5) / 26 for row in trained)
    assert all("eval/reward_mean" in row for row in rows if row.get("eval_only"))
