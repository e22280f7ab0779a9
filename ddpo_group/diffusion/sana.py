"""SANA (``SanaPipeline``, family "sana") as a flow-matching family, and its offline tiny pipeline.

What follows diffusers' ``pipelines/sana/pipeline_sana.py`` (0.42):

- text: a Gemma-2 decoder's last hidden state (``pipe.encode_prompt``) of the prompt with the pipeline's default
  "complex human instruction" (its ``__call__``'s default, read from its signature) prepended, padded to
  ``max_sequence_length`` tokens after the instruction; the first token and the last ``max_sequence_length - 1``
  kept (SANA's paper, 3.1), with the 0/1 attention mask (``Trajectories.extra_cond["prompt_attention_mask"]``).
  The negative prompt ("" by default, as SANA's) is encoded without the instruction, ``max_sequence_length``
  tokens. Both are fixed-length, so batches of different prompts concatenate;
- latents: (B, C, H/32, W/32) noise (DC-AE, 32x compression, patch 1) drawn as ``pipe.prepare_latents`` does;
- the transformer's timestep is the grid's t times ``transformer.config.timestep_scale``; CFG is the pipeline's:
  one call on [negative; prompt] rows, ``neg + w (cond - neg)`` (guidance_scale > 1; SANA's default 4.5);
- decode: ``vae.decode(latents / scaling_factor)`` at the sampled size (``use_resolution_binning=False``: the
  pipeline's aspect-ratio bins would resize a non-bin size).

The sampler: SANA ships a flow-matching DPM-Solver++ (``DPMSolverMultistepScheduler``, ``prediction_type
"flow_prediction"``, ``flow_shift``); the SDE / CPS / Dance steps of the RL recipes are Euler steps, so the policy
replaces the pipeline's scheduler with ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` (the same model
sigmas t / 1000, the same shift) and ``pipeline(...)`` then samples the same Euler ODE: noise 0 reproduces it.
"""

import inspect

import torch
from diffusers import (
    AutoencoderDC,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    SanaPipeline,
    SanaTransformer2DModel,
)
from diffusers.pipelines.sana.pipeline_sana import retrieve_timesteps

from ddpo_group.diffusion.base import model_dtype, register_family
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.tiny import IMAGE_SIZE, TOKENIZER_WORDS, created_in, seeded

# SanaPipeline.__call__'s default complex human instruction (read, not copied: diffusers owns its text)
COMPLEX_HUMAN_INSTRUCTION = tuple(
    inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
)
DEFAULT_FLOW_SHIFT = 3.0  # SANA 1024 px's scheduler flow_shift


def euler_scheduler(scheduler):
    """A FlowMatchEulerDiscreteScheduler on `scheduler`'s flow grid: itself when it is one, else (SANA's flow
    DPM-Solver) shift = its flow_shift, its num_train_timesteps."""
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler
    config = scheduler.config
    if isinstance(scheduler, DPMSolverMultistepScheduler) and config.get("prediction_type") != "flow_prediction":
        raise ValueError(f"a SanaPipeline with a {type(scheduler).__name__} of prediction_type "
                         f"{config.get('prediction_type')!r} is not a flow model; SANA's is 'flow_prediction'")
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.get("num_train_timesteps", 1000),
                                           shift=float(config.get("flow_shift", DEFAULT_FLOW_SHIFT)))


@register_family("sana")
class SanaPolicy(FlowMatchingPolicy):
    """SANA (``SanaPipeline``): Gemma-2 text with SANA's instruction and mask, a linear-attention DiT on 32x DC-AE
    latents, CFG in one batched call, Euler / SDE steps on the shifted flow grid (module docstring)."""

    pipeline_class = SanaPipeline
    pipeline_class_names = ("SanaPipeline",)
    offline_models = ("tiny-sana", "random-sana-1600m")
    default_max_sequence_length = 300  # SanaPipeline.__call__'s default
    patch_multiple = 1
    shard_blocks = ("transformer_blocks",)

    def __init__(self, pipeline):
        if isinstance(pipeline, SanaPipeline):
            pipeline.scheduler = euler_scheduler(pipeline.scheduler)
            if not hasattr(pipeline, "default_sample_size"):  # the base reads it: the transformer's trained size
                pipeline.default_sample_size = pipeline.transformer.config.sample_size
        super().__init__(pipeline)

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        builders = {"tiny-sana": build_tiny_sana_pipeline, "random-sana-1600m": build_random_sana_pipeline}
        return load_pretrained(SanaPipeline, model, revision, torch_dtype, builders)

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, **flow_options):
        if max_sequence_length == 1:  # 0: the pipeline's 300
            raise ValueError(f"config.sample.max_sequence_length={max_sequence_length}: SANA keeps the first token "
                             "and the last max_sequence_length - 1; give at least 2")
        super().configure(sde_type=sde_type, max_sequence_length=max_sequence_length, resolution=resolution,
                          **flow_options)

    @property
    def latent_channels(self):
        return self.pipeline.transformer.config.in_channels

    def critic_sizes(self):
        return {"latent_channels": self.latent_channels, "prompt_dim": self.pipeline.transformer.config.caption_channels}

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        embeds, mask, negative, negative_mask = self.pipeline.encode_prompt(
            list(prompts), do_classifier_free_guidance=guidance_scale > 1.0, negative_prompt=negative_prompt or "",
            device=device, max_sequence_length=self.max_sequence_length,
            complex_human_instruction=list(COMPLEX_HUMAN_INSTRUCTION),
        )
        cond = {"prompt_embeds": embeds, "prompt_attention_mask": mask.long()}
        if guidance_scale > 1.0:
            cond.update(negative_prompt_embeds=negative, negative_prompt_attention_mask=negative_mask.long())
        return cond

    def _initial_latents(self, batch_size, device, generator):
        side = self.resolution
        return self.pipeline.prepare_latents(batch_size, self.latent_channels, side, side, torch.float32, device,
                                             generator)

    def _timesteps(self, num_steps, device):
        retrieve_timesteps(self.pipeline.scheduler, num_steps, device)

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        dtype = model_dtype(model)
        scale = self.pipeline.transformer.config.timestep_scale
        guided = guidance_scale > 1.0 and cond.get("negative_prompt_embeds") is not None
        x, embeds, mask = latents, cond["prompt_embeds"], cond["prompt_attention_mask"]
        if guided:  # the pipeline's one call on [negative rows; prompt rows]
            x = torch.cat([latents, latents])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            mask = torch.cat([cond["negative_prompt_attention_mask"], mask])
        t = timesteps.expand(latents.shape[0]) if timesteps.dim() == 0 else timesteps
        t = torch.cat([t, t]) if guided else t
        out = model(x.to(dtype), encoder_hidden_states=embeds.to(dtype), encoder_attention_mask=mask,
                    timestep=t * scale, return_dict=False)[0].float()
        if guided:
            negative, positive = out.chunk(2)
            out = negative + guidance_scale * (positive - negative)
        if self.pipeline.transformer.config.out_channels // 2 == self.latent_channels:  # a learned sigma
            out = out.chunk(2, dim=1)[0]
        return out

    def _decode(self, latents):
        vae = self.pipeline.vae
        images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


# ---------------------------------------------------------------------------------------------------
# The offline tiny pipeline

GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")


def build_tiny_gemma_tokenizer(words=TOKENIZER_WORDS):
    """A GemmaTokenizer (BPE with byte fallback, "▁" for spaces, <bos> first) built in memory: the 5 special tokens,
    the 256 byte-fallback tokens, every printable ASCII character and "▁", and each of `words` and of SANA's instruction
    after a space ("▁red": one token, built by merges from its left end)."""
    import re

    from transformers import GemmaTokenizer

    vocab = {token: i for i, token in enumerate(GEMMA_SPECIALS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in ["▁"] + [chr(c) for c in range(33, 127)]:
        vocab.setdefault(char, len(vocab))
    merges, seen = [], set()
    instruction_words = re.findall(r"[A-Za-z]+", " ".join(COMPLEX_HUMAN_INSTRUCTION))
    for word in sorted(set(words) | set(instruction_words)):
        piece = "▁"
        for char in word:
            if (piece, char) not in seen:
                seen.add((piece, char))
                merges.append((piece, char))
            piece += char
            vocab.setdefault(piece, len(vocab))
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)  # Gemma's: <bos> first
    tokenizer.model_max_length = 4096
    return tokenizer


def build_tiny_sana_pipeline(seed=0):
    """A SanaPipeline with random weights drawn from ``seed`` (CPU, float32), built offline.

    transformer SanaTransformer2DModel: 4 x 8 x 8 latents (patch 1: 64 tokens), 2 blocks of 2 linear-attention heads
                x 8 and 2 cross-attention heads x 8, caption_channels 32 (the text width), sample_size 8
    text        Gemma2Model: 2 layers of width 32 (2 heads of 16, 1 KV head); tokenizer ``build_tiny_gemma_tokenizer``
    vae         AutoencoderDC: 3 ResBlock stages (8, 16, 32), 4 latent channels: scale factor 4, 32 x 32 images <->
                4 x 8 x 8 latents, scaling_factor 0.41407 (SANA's DC-AE f32c32's)
    scheduler   FlowMatchEulerDiscreteScheduler(shift=3.0): SANA 1024 px's flow_shift (the policy's Euler grid)
    Default image 32 x 32. The global torch RNG state is left unchanged; same seed -> same weights.
    """
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = build_tiny_gemma_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SanaTransformer2DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
            num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=32,
            mlp_ratio=2.5, sample_size=IMAGE_SIZE // 4, patch_size=1,
        )
        vae = AutoencoderDC(
            in_channels=3, latent_channels=4, attention_head_dim=8, encoder_block_types="ResBlock",
            decoder_block_types="ResBlock", encoder_block_out_channels=(8, 16, 32),
            decoder_block_out_channels=(8, 16, 32), encoder_layers_per_block=(1, 1, 1),
            decoder_layers_per_block=(1, 1, 1), encoder_qkv_multiscales=((), (), ()),
            decoder_qkv_multiscales=((), (), ()), decoder_norm_types="rms_norm", decoder_act_fns="silu",
            scaling_factor=0.41407,
        )
        text_encoder = Gemma2Model(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
            pad_token_id=0, eos_token_id=1, bos_token_id=2, sliding_window=4096,
        ))
    pipeline = SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                            transformer=transformer.eval(),
                            scheduler=FlowMatchEulerDiscreteScheduler(shift=DEFAULT_FLOW_SHIFT))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# SANA 1600M 1024 px (NVlabs/Sana's Sana_1600M_P1_D20: depth 20, hidden 2240; the diffusers transformer config's 70
# heads x 32, cross-attention 20 x 112, Gemma-2-2B's caption width 2304, sample_size 32 latents of 32 px)
SANA_1600M_TRANSFORMER = dict(
    in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
    num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240, caption_channels=2304,
    mlp_ratio=2.5, sample_size=32, patch_size=1,
)
# DC-AE f32c32 (SANA 1.0's VAE): diffusers' scripts/convert_dcae_to_diffusers.py, "dc-ae-f32c32-sana-1.0"
SANA_DC_AE = dict(
    latent_channels=32, encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
    decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
    encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
    decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
    encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)), decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
    encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
    downsample_block_type="conv", upsample_block_type="interpolate", decoder_norm_types="rms_norm",
    decoder_act_fns="silu", scaling_factor=0.41407,
)


def build_random_sana_pipeline(seed=0, torch_dtype=torch.float32):
    """SANA 1600M's architecture with random weights (``SANA_1600M_TRANSFORMER``, the DC-AE ``SANA_DC_AE``), created in
    `torch_dtype`; a 1-layer Gemma-2 of the real width 2304 (Gemma-2-2B has 26 layers) with the tiny tokenizer: the
    transformer sees text of the real shape. Default 1024 px. For benchmarks/gpu_check.py: its numbers are SANA
    1600M's cost, its images mean nothing."""
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = build_tiny_gemma_tokenizer()
    with seeded(seed), created_in(torch_dtype):
        transformer = SanaTransformer2DModel(**SANA_1600M_TRANSFORMER)
        vae = AutoencoderDC(**SANA_DC_AE)
        text_encoder = Gemma2Model(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=2304, intermediate_size=256, num_hidden_layers=1,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=4096,
            pad_token_id=0, eos_token_id=1, bos_token_id=2, sliding_window=4096,
        ))
    pipeline = SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                            transformer=transformer.eval(),
                            scheduler=FlowMatchEulerDiscreteScheduler(shift=DEFAULT_FLOW_SHIFT))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
