"""Wan 2.1 / 2.2 text-to-video (``WanPipeline``) as a flow-matching family, and its offline tiny pipeline.

What follows diffusers' ``pipelines/wan/pipeline_wan.py`` (0.42) exactly:

- text: each prompt cleaned (``prompt_clean``), tokenized to exactly ``max_sequence_length`` tokens, the
  UMT5 encoder's last hidden state with the attention mask, the padded positions set to 0
  (``pipe.encode_prompt``): the embeddings have a fixed length, so batches concatenate;
- latents: (B, C, f, h, w) noise from the generator as ``pipe.prepare_latents`` draws it, with
  f = (F - 1) / vae_scale_factor_temporal + 1 latent frames for F video frames and h, w = H, W /
  vae_scale_factor_spatial; the transformer takes them as they are (it patchifies (1, 2, 2) itself) with
  the timestep t (the scheduler's, float, not cast), per token for Wan 2.2's ``expand_timesteps``;
- grid: the pipeline's ``scheduler.set_timesteps(T)``: FlowMatchEulerDiscreteScheduler with a fixed
  ``shift`` (Wan's ``flow_shift``: 3.0 for 480p, 5.0 for 720p); no resolution-dependent shift;
- guidance: CFG as two transformer calls, ``uncond + w (cond - uncond)`` for ``guidance_scale > 1``, the
  negative prompt ``""`` by default (the pipeline's);
- decode: ``z / (1 / std) + mean`` per channel with the VAE config's ``latents_mean`` / ``latents_std``,
  the 3-D VAE's video (B, 3, F, H, W) in [-1, 1], mapped to [0, 1] frame by frame.

The time axis: trajectories store latents (B, T+1, C, f, h, w) float32 and videos (B, F, 3, H, W) in
``Trajectories.images``; the step of ``flow.py`` and its log-density (a mean over every non-batch dim)
take the extra axis as they are. Rewards receive the videos (docs/wan.md): image rewards score a few
evenly spaced frames and average them (``config.reward_frames``), a video reward the whole clip.

Loaded from the hub or a directory, the pipeline's UniPC multistep scheduler is replaced by the
flow-matching Euler scheduler with the same ``flow_shift``: the SDE steps of Flow-GRPO are Euler steps on
that grid (as Flow-GRPO's Wan trainer samples). Wan 2.2 TI2V-5B (``expand_timesteps``) is followed; Wan 2.2
A14B's two experts (``transformer_2``) and image-to-video are the families of ``wan_moe.py`` / ``wan_i2v.py``.
"""

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

from ddpo_group.diffusion.base import model_dtype, register_family, video_frames
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.tiny import IMAGE_SIZE, TOKENIZER_WORDS, build_tiny_t5_tokenizer, created_in, seeded

# WanPipeline.__call__'s defaults: 81 frames of 480 x 832, 512 text tokens
DEFAULT_NUM_FRAMES = 81
DEFAULT_HEIGHT, DEFAULT_WIDTH = 480, 832
TINY_NUM_FRAMES = 5

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (the published numbers): 30 blocks of 12 heads x 128,
# FFN 8960, UMT5-XXL text width 4096, 16 latent channels; 1.42B parameters.
WAN21_1_3B_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)


def to_flow_euler(pipeline):
    """Give `pipeline` the flow-matching Euler scheduler on its own grid: a UniPC scheduler's ``flow_shift``
    becomes the Euler scheduler's ``shift`` (Wan's published scheduler is UniPC with use_flow_sigmas)."""
    scheduler = pipeline.scheduler
    if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        shift = float(scheduler.config.get("flow_shift", 3.0) or 3.0)
        pipeline.scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=scheduler.config.get("num_train_timesteps", 1000), shift=shift
        )
    return pipeline


def keep_fp32_modules(transformer):
    """Put the modules the model class keeps in float32 (``_keep_in_fp32_modules``: Wan's rope, time embedder,
    modulation table and norms) back in float32 after a cast of the whole model, as ``from_pretrained(...,
    torch_dtype=...)`` loads them; diffusers' Wan blocks compute those parts in float32. Returns `transformer`."""
    names = getattr(transformer, "_keep_in_fp32_modules", None) or ()
    for prefix, module in transformer.named_modules():
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for key, tensor in tensors:
            if tensor.is_floating_point() and any(part in names for part in f"{prefix}.{key}".split(".")):
                tensor.data = tensor.data.float()
    return transformer


@register_family("wan")
class WanPolicy(FlowMatchingPolicy):
    """Wan 2.1 / 2.2 text-to-video (``WanPipeline``): a UMT5 text encoder with fixed-length zero-padded
    embeddings, latents with a time axis (B, C, f, h, w), CFG with two transformer calls, a 3-D VAE with
    per-channel mean / std. Samples are videos (B, F, 3, H, W) in [0, 1]. The step, the sampling loop,
    LoRA and checkpoints are the flow-matching base's (``flow_policy.py``)."""

    pipeline_class = WanPipeline
    pipeline_class_names = ("WanPipeline",)
    offline_models = ("tiny-wan", "random-wan21-1.3b")
    default_max_sequence_length = 512  # WanPipeline.__call__'s default
    patch_multiple = 2
    video = True
    shard_blocks = ("blocks",)  # the transformer's blocks (train.sharding="fsdp2")

    @classmethod
    def supports(cls, pipeline):
        """A WanPipeline with one transformer; Wan 2.2 A14B's two experts are wan_moe.py's family."""
        return isinstance(pipeline, cls.pipeline_class) and getattr(pipeline, "transformer_2", None) is None

    def __init__(self, pipeline):
        # FlowMatchingPolicy.__init__ reads an image pipeline's default_sample_size; Wan's is a (H, W) video
        super(FlowMatchingPolicy, self).__init__(pipeline)
        self.sde_type = "sde"
        self.cps_log_prob = "normalized"
        self.flow_grid, self.flow_grid_shift = "pipeline", 3.0
        self.max_sequence_length = self.default_max_sequence_length
        self.height = getattr(pipeline, "default_height", DEFAULT_HEIGHT)
        self.width = getattr(pipeline, "default_width", DEFAULT_WIDTH)
        self.num_frames = getattr(pipeline, "default_num_frames", DEFAULT_NUM_FRAMES)

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        builders = {"tiny-wan": build_tiny_wan_pipeline, "random-wan21-1.3b": build_random_wan21_pipeline}
        pipeline = to_flow_euler(load_pretrained(WanPipeline, model, revision, torch_dtype, builders))
        keep_fp32_modules(pipeline.transformer)
        return pipeline

    def prepare(self, device, dtype, use_lora, lora_rank=4, lora_alpha=None):
        """The base's (frozen parts in `dtype`, LoRA or the whole transformer in float32), then the transformer's
        float32 modules back in float32 (WanTransformer3DModel's rope, time embedder, norms), as from_pretrained
        with a torch_dtype leaves them."""
        return keep_fp32_modules(super().prepare(device, dtype, use_lora, lora_rank, lora_alpha))

    @property
    def resolution(self):
        """The frame side for a square video (config.sample.resolution); the height for another shape."""
        return self.height

    @resolution.setter
    def resolution(self, side):
        self.height = self.width = side

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, **flow_options):
        pipe = self.pipeline
        if pipe.config.get("boundary_ratio") is not None and getattr(pipe, "transformer_2", None) is None:
            raise ValueError(
                f"config.pretrained.model: a Wan pipeline with boundary_ratio={pipe.config.get('boundary_ratio')} but "
                "no transformer_2 (Wan 2.2 A14B's low-noise expert) has no model below the boundary; give it both"
            )
        if resolution and resolution % (pipe.vae_scale_factor_spatial * self.patch_multiple):
            multiple = pipe.vae_scale_factor_spatial * self.patch_multiple
            raise ValueError(f"config.sample.resolution={resolution} must be a multiple of {multiple} for this model")
        super().configure(sde_type=sde_type, max_sequence_length=max_sequence_length, **flow_options)
        if resolution:
            self.resolution = resolution

    def configure_frames(self, num_frames):
        """config.sample.num_frames F (0: the model's default): F - 1 must be a multiple of the VAE's temporal factor."""
        if not num_frames:
            return
        self.num_frames = video_frames(num_frames, self.pipeline.vae_scale_factor_temporal, "Wan")

    @property
    def latent_channels(self):
        return self.pipeline.transformer.config.in_channels

    def critic_sizes(self):
        """The critic (GAE, Group-PPO) reads a video's latents (B, C, f, h, w) with the f latent frames stacked on
        the channels: latent_channels C f; prompt_dim the text width."""
        frames = (self.num_frames - 1) // self.pipeline.vae_scale_factor_temporal + 1
        return {"latent_channels": self.latent_channels * frames, "prompt_dim": self.pipeline.transformer.config.text_dim}

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        """prompt_embeds (B, max_sequence_length, D), zero past each prompt's tokens; with guidance > 1 the
        negative prompt's, repeated per row (the pipeline's encode_prompt)."""
        embeds, negative = self.pipeline.encode_prompt(
            prompt=list(prompts), negative_prompt=negative_prompt or "", do_classifier_free_guidance=guidance_scale > 1.0,
            max_sequence_length=self.max_sequence_length, device=device,
        )
        cond = {"prompt_embeds": embeds}
        if negative is not None:
            cond["negative_prompt_embeds"] = negative
        return cond

    def _initial_latents(self, batch_size, device, generator):
        return self.pipeline.prepare_latents(
            batch_size, self.latent_channels, self.height, self.width, self.num_frames, torch.float32, device, generator
        )

    def _timesteps(self, num_steps, device):
        self.pipeline.scheduler.set_timesteps(num_steps, device=device)

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        dtype = model_dtype(model)
        hidden = latents.to(dtype)
        timestep = timesteps.reshape(-1).expand(latents.shape[0])
        if self.pipeline.config.get("expand_timesteps"):
            # Wan 2.2 TI2V: one timestep per latent token, (B, f * h/2 * w/2), all t for text-to-video
            _, _, f, h, w = latents.shape
            timestep = timestep[:, None].expand(-1, f * (h // 2) * (w // 2))

        def call(embeds):
            return model(hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds.to(dtype),
                         return_dict=False)[0]

        velocity = call(cond["prompt_embeds"])
        if guidance_scale > 1.0 and cond.get("negative_prompt_embeds") is not None:
            uncond = call(cond["negative_prompt_embeds"])
            velocity = uncond + guidance_scale * (velocity - uncond)  # in the model dtype, as the pipeline does
        return velocity.float()

    def _decode(self, latents):
        """(B, C, f, h, w) latents -> videos (B, F, 3, H, W) in [0, 1]."""
        vae = self.pipeline.vae
        z_dim = vae.config.z_dim
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)


# ---------------------------------------------------------------------------------------------------
# Offline pipelines: the tiny one (tests, the tiny_wan variant) and Wan 2.1 1.3B's architecture (GPU check)


def _umt5_encoder(vocab_size, d_model, d_ff, num_layers, num_heads, d_kv):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=num_layers, num_heads=num_heads,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))


def build_tiny_wan_pipeline(seed=0):
    """A WanPipeline with random weights drawn from ``seed`` (CPU, float32), built offline.

    transformer WanTransformer3DModel: 4-channel latents patchified (1, 2, 2), 2 blocks of 2 heads x 8 (rope
                axes t 4, h 2, w 2), FFN 32, text_dim 32 (the UMT5 width), freq_dim 16
    text        UMT5EncoderModel (d_model 32, 1 layer, 4 heads) with the in-memory T5-style word tokenizer
                (``tiny.build_tiny_t5_tokenizer``: pad 0, eos 1)
    vae         AutoencoderKLWan: base_dim 8, z_dim 4, dim_mult (1, 2, 2), one res block, temporal downsampling
                in the second stage only: spatial factor 4, temporal factor 2; 5 frames of 32x32 <-> 4 x 3 x 8 x 8
                latents; made-up per-channel latents_mean / latents_std (not 0 / 1: the de-normalisation runs)
    scheduler   FlowMatchEulerDiscreteScheduler, shift 3.0 (Wan's 480p flow_shift)
    Default video: 5 frames of 32x32. The global torch RNG state is left unchanged. Same seed -> same weights.
    """
    tokenizer = build_tiny_t5_tokenizer(TOKENIZER_WORDS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            eps=1e-6, rope_max_seq_len=32,
        )
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0], scale_factor_temporal=2,
            scale_factor_spatial=4,
        )
        text_encoder = _umt5_encoder(len(tokenizer), d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8)
    pipeline = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder.eval(), transformer=transformer.eval(), vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipeline.default_height = pipeline.default_width = IMAGE_SIZE
    pipeline.default_num_frames = TINY_NUM_FRAMES
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def build_random_wan21_pipeline(seed=0, torch_dtype=torch.float32):
    """Wan 2.1 T2V 1.3B's architecture with random weights (``WAN21_1_3B_TRANSFORMER``, the published VAE
    config: AutoencoderKLWan's defaults), created in `torch_dtype`; a 1-layer UMT5 of the real width 4096
    (UMT5-XXL has 24 layers) with the tiny word tokenizer: the transformer sees text of the real shape.
    For benchmarks/gpu_check.py: its numbers are Wan 2.1 1.3B's cost, its videos mean nothing."""
    tokenizer = build_tiny_t5_tokenizer(TOKENIZER_WORDS)
    with seeded(seed), created_in(torch_dtype):
        transformer = WanTransformer3DModel(**WAN21_1_3B_TRANSFORMER)
        vae = AutoencoderKLWan()
        text_encoder = _umt5_encoder(len(tokenizer), d_model=4096, d_ff=256, num_layers=1, num_heads=64, d_kv=64)
    pipeline = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder.eval(), transformer=transformer.eval(), vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
