"""The scenes world's RL training prompts (ddpo_group.data.scenes:scene_training_prompts, docs/scenes.md "The mix"):
tags in GenEval's proportions, one training prompt alone, and the strict verdict the training reward logs beside
its partial score (issue 53, items 3 and 4)."""

from collections import Counter

import numpy as np
import pytest

from ddpo_group.config import grpo
from ddpo_group.config.registry import ConfigError
from ddpo_group.data import scenes
from ddpo_group.data.prompts import load_config_prompts
from ddpo_group.rewards.combine import CombinedReward, info_metrics
from ddpo_group.rewards.geneval.metadata import record_identity
from ddpo_group.rewards.registry import get_reward
from ddpo_group.training.rollout import draw_prompt_indices

# GenEval's evaluation_metadata.jsonl, counted per tag (553 prompts); single_object has no scenes training record
GENEVAL = {"two_object": 99, "counting": 80, "colors": 94, "position": 100, "color_attr": 100}


def test_the_geneval_mix_gives_each_tag_geneval_s_count_of_places_and_none_to_single_object():
    mixed = scenes.scene_training_prompts(mix="geneval")
    assert dict(Counter(r["tag"] for r in mixed)) == GENEVAL
    assert len(mixed) == 473  # 553 - single_object's 80


def test_the_geneval_mix_cycles_a_tag_s_distinct_records_evenly():
    distinct = scenes.scene_training_prompts(mix="records")
    mixed = scenes.scene_training_prompts(mix="geneval")
    for tag, places in GENEVAL.items():
        own = {record_identity(r) for r in distinct if r["tag"] == tag}
        times = Counter(record_identity(r) for r in mixed if r["tag"] == tag)
        assert set(times) == own, tag  # every distinct record, nothing else
        k = len(own)
        assert set(times.values()) <= {places // k, -(-places // k)}, tag  # k or k + 1 times each


def test_groups_drawn_from_the_mix_follow_geneval_s_shares():
    mixed = scenes.scene_training_prompts(mix="geneval")
    tags = np.array([r["tag"] for r in mixed])
    drawn = Counter()
    for epoch in range(1500):  # 8 groups of 8 an epoch, as the scenes variants draw them
        ids = draw_prompt_indices(len(mixed), 64, 8, 0, epoch, 0)[::8]
        drawn.update(tags[ids].tolist())
    total = sum(drawn.values())
    for tag, count in GENEVAL.items():
        # 12,000 groups: a share's standard error is below 0.004
        assert drawn[tag] / total == pytest.approx(count / 473, abs=0.015), tag


def test_the_geneval_mix_of_chosen_tags_weighs_them_by_geneval_s_counts():
    mixed = scenes.scene_training_prompts(mix="geneval", tags="counting,colors")
    assert dict(Counter(r["tag"] for r in mixed)) == {"counting": 80, "colors": 94}


def test_the_scenes_variants_train_on_the_geneval_mix():
    for variant in ("tiny_scenes", "tiny_scenes_sd", "tiny_scenes_flow"):
        assert grpo.get_config(variant).prompt_fn_kwargs["mix"] == "geneval"


def test_one_training_prompt_alone_is_its_world_record():
    records = scenes.scene_training_prompts(prompt="a photo of three circles")
    assert records == [{"tag": "counting", "include": [{"class": "circle", "count": 3}],
                        "exclude": [{"class": "circle", "count": 4}], "prompt": "a photo of three circles"}]


@pytest.mark.parametrize("prompt,why", [("a photo of a circle", "is in the held-out set"),
                                        ("a photo of three circle", "did you mean 'a photo of three circles'"),
                                        ("a photo of a dog", "is not a prompt of the scenes world")])
def test_a_held_out_or_unknown_prompt_is_refused_in_one_line_naming_the_field(prompt, why):
    config = grpo.get_config("tiny_scenes")
    config.prompt_fn_kwargs = {"prompt": prompt}
    with pytest.raises(ConfigError) as err:
        load_config_prompts(config, "prompt_fn")
    assert "\n" not in str(err.value) and "prompt_fn_kwargs.prompt" in str(err.value) and why in str(err.value)


def test_an_unknown_mix_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="prompt_fn_kwargs.mix"):
        scenes.scene_training_prompts(mix="uniform")


def test_the_training_reward_logs_the_strict_verdict_beside_the_partial_score():
    three = scenes.scene_training_prompts(prompt="a photo of three circles")[0]
    four = next(r for r in scenes.world_records()["counting"] if r["prompt"] == "a photo of four circles")
    rng = np.random.default_rng(0)
    # three rendered scenes of the record and one of four circles (rendered scenes are detected exactly)
    pixels = np.stack([scenes.render_record(three, rng) for _ in range(3)] + [scenes.render_record(four, rng)])
    import torch

    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255
    meta = {k: v for k, v in three.items() if k != "prompt"}
    _, _, info = CombinedReward({"geneval": get_reward("geneval", detector="shapes")})(
        images, [three["prompt"]] * 4, [meta] * 4)
    logged = info_metrics([info])
    # strict: 1, 1, 1, 0 (four for three); partial: Flow-GRPO's 1 - |4 - 3| / 3 for the fourth
    assert logged["reward_info/geneval/strict_correct"] == pytest.approx(3 / 4)
    assert logged["reward_info/geneval/partial_score"] == pytest.approx((3 + 2 / 3) / 4)
