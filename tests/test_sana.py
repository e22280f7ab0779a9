"""The SANA family (ddpo_group.diffusion.sana) on its offline tiny pipeline.

Checked: the family is found by name, by pipeline and by model_index.json; a pipeline with SANA's flow DPM-Solver
samples on the Euler grid of its flow_shift; the text conditioning is the pipeline's (instruction, first token and
last L - 1, mask; the negative "" without instruction); CFG is neg + w (cond - neg); every objective trains. Noise 0
(SanaPipeline's images), exact re-scoring after cat / index, the on-policy first epoch and the LoRA round trip:
tests/test_family_contract.py (its resume: FlowMatchingPolicy's, the contract's wan row).
"""

import math

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

from ddpo_group.diffusion.policy import family_for_model, load_policy, policy_for
from ddpo_group.diffusion.sana import COMPLEX_HUMAN_INSTRUCTION, SanaPolicy, build_tiny_sana_pipeline
from ddpo_group.training.trainer import train
from helpers import cheap, make_config, read_metrics

PROMPTS = ["a big blue circle", "a red square on a white background"]


@pytest.fixture(scope="module")
def pipe():
    return build_tiny_sana_pipeline(seed=0)


def _policy(pipeline):
    policy = policy_for(pipeline)
    policy.configure(max_sequence_length=16)
    return policy


def test_the_family_its_sizes_and_its_euler_grid(pipe, tmp_path):
    assert family_for_model("tiny-sana") is SanaPolicy
    policy = _policy(pipe)
    assert policy.family == "sana" and policy.resolution == 32 and policy.latent_channels == 4
    assert policy.critic_sizes() == {"latent_channels": 4, "prompt_dim": 32}
    with pytest.raises(ValueError, match="max_sequence_length=1: SANA keeps the first token"):
        policy.configure(max_sequence_length=1)
    # SANA's published scheduler: flow DPM-Solver++ with flow_shift; the policy samples its Euler grid instead
    other = build_tiny_sana_pipeline(seed=0)
    other.scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                  flow_shift=3.0)
    swapped = policy_for(other)
    assert isinstance(other.scheduler, FlowMatchEulerDiscreteScheduler) and other.scheduler.config.shift == 3.0
    swapped.configure(max_sequence_length=16)
    a, b = (p.sample(PROMPTS, 3, 4.5, 0.0, generator=torch.Generator().manual_seed(1)).images for p in (policy, swapped))
    assert torch.equal(a, b)
    other.scheduler = DPMSolverMultistepScheduler(prediction_type="epsilon")
    with pytest.raises(ValueError, match="is not a flow model"):
        policy_for(other)
    pipe.save_pretrained(str(tmp_path / "sana"))
    assert family_for_model(str(tmp_path / "sana")) is SanaPolicy
    loaded = load_policy(str(tmp_path / "sana"), torch_dtype=torch.float32)
    loaded.configure(max_sequence_length=16)
    assert torch.equal(loaded.sample(PROMPTS, 3, 4.5, 0.0, generator=torch.Generator().manual_seed(1)).images, a)


def test_the_text_condition_and_the_guidance(pipe):
    policy = _policy(pipe)
    batch = policy.sample(PROMPTS, 2, 4.5, 0.7, generator=torch.Generator().manual_seed(0))
    tokenizer = pipe.tokenizer
    instruction = "\n".join(COMPLEX_HUMAN_INSTRUCTION)
    chi = len(tokenizer.encode(instruction))
    for row, prompt in enumerate(PROMPTS):
        ids = tokenizer(instruction + prompt, padding="max_length", max_length=chi + 16 - 2).input_ids
        kept = [ids[0]] + ids[-15:]  # SANA keeps the first token and the last L - 1
        with torch.no_grad():
            hidden = pipe.text_encoder(torch.tensor([ids]), attention_mask=torch.tensor(
                [[int(i != tokenizer.pad_token_id) for i in ids]]))[0][0]
        index = [0] + list(range(len(ids) - 15, len(ids)))
        torch.testing.assert_close(batch.prompt_embeds[row], hidden[index], rtol=0, atol=1e-5)
        assert batch.extra_cond["prompt_attention_mask"][row].tolist() == [int(i != tokenizer.pad_token_id)
                                                                          for i in kept]
    assert tokenizer.convert_ids_to_tokens(tokenizer("a big red circle").input_ids) == ["<bos>", "a", "▁big", "▁red",
                                                                                      "▁circle"]
    negative_ids = tokenizer([""], padding="max_length", max_length=16).input_ids[0]
    assert batch.extra_cond["negative_prompt_attention_mask"][0].tolist() == [int(i != 0) for i in negative_ids]
    # CFG: the negative rows' and the prompt rows' velocities, combined as the pipeline does
    x, t = batch.latents[:, 1], batch.timesteps[:, 1]
    with torch.no_grad():
        v = policy.predict(pipe.transformer, x, t, batch, torch.arange(2), 4.5)

        def alone(embeds, mask):
            return pipe.transformer(x, encoder_hidden_states=embeds, encoder_attention_mask=mask, timestep=t,
                                    return_dict=False)[0]

        cond = alone(batch.prompt_embeds, batch.extra_cond["prompt_attention_mask"])
        neg = alone(batch.negative_prompt_embeds, batch.extra_cond["negative_prompt_attention_mask"])
    torch.testing.assert_close(v, neg + 4.5 * (cond - neg), rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", [
    dict(train__objective="nft", forward__num_timesteps=2), dict(train__objective="awm", forward__num_timesteps=2),
    dict(algorithm__adv_estimator="gae"), dict(sample__flow_grid="dance", sample__sde_type="dance"),
    dict(train__use_reference_model=True, train__use_kl_loss=True, train__beta=0.01, train__kl_type="flow_grpo"),
    dict(train__objective="dgpo", train__use_reference_model=True, forward__num_timesteps=2),
    dict(train__objective="dpo", train__use_reference_model=True, forward__num_timesteps=2),
])
def test_every_objective_trains_sana(tmp_path, overrides):
    row = read_metrics(train(make_config(tmp_path, variant="tiny_sana", **cheap(**overrides))))[0]
    assert row["train/skipped_steps"] == 0 and math.isfinite(row["loss"])


def test_the_sana_presets(tmp_path):
    from ddpo_group.config import grpo

    config = grpo.get_config("sana_nft")
    assert config.pretrained.model == "Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers"
    assert (config.sample.resolution, config.sample.max_sequence_length) == (1024, 300)
    assert config.train.objective == grpo.sd35_nft().train.objective and config.sample.guidance_scale == 1.0
    assert family_for_model(grpo.get_config("tiny_sana").pretrained.model) is SanaPolicy
