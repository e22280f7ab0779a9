"""LTX-2 text-to-video with audio (``LTX2Pipeline``, family "ltx2") as a flow-matching video family, and its offline
tiny pipeline.

What follows diffusers' ``pipelines/ltx2/pipeline_ltx2.py`` (0.42):

- two denoised streams: the packed video latents (B, S_v, C_v) (``pipe.prepare_latents``) and the packed audio
  latents (B, S_a, C_a) (``pipe.prepare_audio_latents``, S_a from the video's duration ``num_frames / frame_rate``),
  drawn in that order from the generator. The pipeline steps each with its own copy of the scheduler, set to the same
  sigmas and shift, so both streams share one sigma grid. Here a trajectory's state is ONE flat latent per step,
  (B, S_v C_v + S_a C_a) float32: the video tokens then the audio tokens (``pack_streams`` / ``split_streams``). Every
  SDE / CPS / Dance step and its Gaussian log-density is element-wise, so the base's step covers both streams
  unchanged; a step's log-prob is the joint (video and audio) Gaussian log-density per dimension as for every family
  (the sum of the two streams' log-densities over their total number of dimensions), float32;
- grid: ``np.linspace(1, 1 / T, T)`` with the scheduler's resolution-dependent shift ``mu`` of the video's token
  count (``calculate_shift`` with base / max sequence 1024 / 4096 and shifts 0.95 / 2.05 where the scheduler's
  config has none), as ``__call__`` sets it;
- text: Gemma-3's hidden states of every layer (left-padded, ``max_sequence_length`` tokens, the pipeline's
  ``encode_prompt``) through LTX-2's text connectors, which give the video and the audio stream their own embeddings
  and a shared mask; these (not Gemma's states) ride in the trajectories: prompt_embeds the video's,
  ``extra_cond`` the audio's and the mask (and the negative prompt's, "" by default);
- guidance: plain classifier-free guidance with ``w = sample.guidance_scale`` on both streams, one transformer call on
  [negative; prompt] rows, combined in x0-space as ``__call__`` does (x0 = x - sigma v, x0_c + (w - 1)(x0_c - x0_u),
  back to a velocity). The pipeline's other guidance terms are off: the policy equals
  ``pipe(..., guidance_scale=w, audio_guidance_scale=None (= w), stg_scale=0.0, audio_stg_scale=0.0,
  modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)``
  (``LTX2Policy.pipeline_kwargs``; each audio setting left at its default would switch its term back on), i.e. no
  spatio-temporal guidance (its default 1.0 would add a call with blocks skipped),
  no modality-isolation guidance (default 3.0: a call with the audio <-> video cross-attention cut), no x0 rescale
  (default 0.7), and the audio stream's CFG scale is the video's (default 7.0 against 3.0). Those defaults make up to
  four transformer calls a step; plain CFG keeps the policy's one batched call and a log-density of one velocity;
- decode: the video latents unpacked, de-normalised with the VAE's latents_mean / std, ``vae.decode`` (timestep 0
  where the VAE is timestep-conditioned: ``decode_timestep=0.0``), videos (B, F, 3, H, W) in [0, 1]; the audio
  latents de-normalised, unpacked, ``audio_vae.decode`` to a mel spectrogram and the vocoder to waveforms
  (B, channels, samples) at ``vocoder.config.output_sampling_rate`` (24 kHz for LTX-2). The waveforms ride in
  ``Trajectories.audio`` and reach rewards as ``metadata["audio"]`` / ``metadata["audio_sample_rate"]``
  (rewards/base.py).

Everything video (``resolution``, ``num_frames``, the rewards' frames) is as the other video families'; the video's
frame rate is the pipeline's default 24 (``frame_rate`` on the policy).
"""

import numpy as np
import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps
from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

from ddpo_group.diffusion.base import model_dtype, register_family, video_frames
from ddpo_group.diffusion.flow_policy import FlowMatchingPolicy, load_pretrained
from ddpo_group.diffusion.tiny import IMAGE_SIZE, created_in, seeded
from ddpo_group.diffusion.tiny_chat import MAX_POSITIONS, build_tiny_chat_tokenizer

DEFAULT_NUM_FRAMES = 121  # LTX2Pipeline.__call__'s fixed default for checkpoints without a duration head
DEFAULT_FRAME_RATE = 24.0  # __call__'s frame_rate
TINY_NUM_FRAMES = 5


def pack_streams(video, audio):
    """One flat state (B, S_v C_v + S_a C_a) of the packed video (B, S_v, C_v) and audio (B, S_a, C_a) latents."""
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


def split_streams(latents, video_shape, audio_shape):
    """The packed video (B, S_v, C_v) and audio (B, S_a, C_a) latents of a flat state (``pack_streams``)."""
    n_video = video_shape[0] * video_shape[1]
    b = latents.shape[0]
    return latents[:, :n_video].reshape(b, *video_shape), latents[:, n_video:].reshape(b, *audio_shape)


@register_family("ltx2")
class LTX2Policy(FlowMatchingPolicy):
    """LTX-2 (``LTX2Pipeline``): video and audio denoised together, one flat state per step, Gemma-3 text through
    LTX-2's connectors, plain CFG in x0-space, Euler / SDE steps on the pipeline's shifted grid (module docstring)."""

    pipeline_class = LTX2Pipeline
    pipeline_class_names = ("LTX2Pipeline",)
    offline_models = ("tiny-ltx2", "random-ltx2")
    default_max_sequence_length = 1024  # __call__'s max_sequence_length
    patch_multiple = 1
    video = True
    has_audio = True
    shard_blocks = ("transformer_blocks",)

    def __init__(self, pipeline):
        super(FlowMatchingPolicy, self).__init__(pipeline)
        self.sde_type = "sde"
        self.cps_log_prob = "normalized"
        self.flow_grid, self.flow_grid_shift = "pipeline", 3.0
        self.max_sequence_length = getattr(pipeline, "default_max_sequence_length", self.default_max_sequence_length)
        self.height = getattr(pipeline, "default_height", 512)  # __call__'s 512 x 768
        self.width = getattr(pipeline, "default_width", 768)
        self.num_frames = getattr(pipeline, "default_num_frames", DEFAULT_NUM_FRAMES)
        self.frame_rate = DEFAULT_FRAME_RATE

    @property
    def resolution(self):
        """The frame side for a square video (config.sample.resolution); the height for another shape."""
        return self.height

    @resolution.setter
    def resolution(self, side):
        self.height = self.width = side

    @property
    def audio_sample_rate(self):
        """The waveforms' sample rate (Hz): the vocoder's output rate."""
        return int(self.pipeline.vocoder.config.output_sampling_rate)

    def configure_frames(self, num_frames):
        """config.sample.num_frames F (0: the model's default): F - 1 a multiple of the VAE's temporal factor."""
        if not num_frames:
            return
        self.num_frames = video_frames(num_frames, self.pipeline.vae_temporal_compression_ratio, "LTX-2")

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        pipeline = load_pretrained(LTX2Pipeline, model, revision, torch_dtype, {
            "tiny-ltx2": build_tiny_ltx2_pipeline, "random-ltx2": build_random_ltx2_pipeline})
        if not isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(f"model {model!r}: an LTX2Pipeline with a {type(pipeline.scheduler).__name__}; "
                             "the family samples with FlowMatchEulerDiscreteScheduler (the published one)")
        return pipeline

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, **flow_options):
        multiple = self.pipeline.vae_spatial_compression_ratio * self.pipeline.transformer_spatial_patch_size
        if resolution and resolution % multiple:
            raise ValueError(f"config.sample.resolution={resolution} must be a multiple of {multiple} for this model")
        FlowMatchingPolicy.configure(self, sde_type=sde_type, max_sequence_length=max_sequence_length, **flow_options)
        self.max_sequence_length = max_sequence_length or getattr(self.pipeline, "default_max_sequence_length",
                                                                  self.default_max_sequence_length)
        if resolution:
            self.resolution = resolution

    def prepare(self, device, dtype, use_lora, lora_rank=4, lora_alpha=None):
        """As the base (frozen text encoder and VAE, LoRA or the transformer), and the frozen connectors, audio VAE
        and vocoder in `dtype`."""
        for name in ("connectors", "audio_vae", "vocoder"):
            getattr(self.pipeline, name).requires_grad_(False).to(device, dtype=dtype)
        return super().prepare(device, dtype, use_lora, lora_rank, lora_alpha)

    @property
    def latent_channels(self):
        return self.pipeline.transformer.config.in_channels

    def critic_sizes(self):
        raise ValueError("the ltx2 family has no critic (its state is one flat video + audio latent): "
                         "use an objective without a value model")

    # -- shapes ---------------------------------------------------------------------------------------------------
    def _latent_dims(self):
        """(latent frames, latent height, latent width), audio latent frames, latent mel bins."""
        pipe = self.pipeline
        f = (self.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
        h = self.height // pipe.vae_spatial_compression_ratio
        w = self.width // pipe.vae_spatial_compression_ratio
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        audio_frames = round(self.num_frames / self.frame_rate * per_second)
        mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        return (f, h, w), audio_frames, mel_bins

    def _stream_shapes(self):
        """The packed video (S_v, C_v) and audio (S_a, C_a) token shapes."""
        pipe = self.pipeline
        (f, h, w), audio_frames, mel_bins = self._latent_dims()
        p, pt = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        video = ((f // pt) * (h // p) * (w // p), self.latent_channels * pt * p * p)
        audio = (audio_frames, pipe.audio_vae.config.latent_channels * mel_bins)
        return video, audio

    def _initial_latents(self, batch_size, device, generator):
        pipe = self.pipeline
        _, audio_frames, _ = self._latent_dims()
        video = pipe.prepare_latents(batch_size, self.latent_channels, self.height, self.width, self.num_frames, 0.0,
                                     torch.float32, device, generator)
        audio = pipe.prepare_audio_latents(batch_size, pipe.audio_vae.config.latent_channels, audio_frames,
                                           pipe.audio_vae.config.mel_bins, 0.0, torch.float32, device, generator)
        return pack_streams(video, audio)

    # -- conditioning ----------------------------------------------------------------------------------------------
    def _connect(self, embeds, mask):
        video, audio, connector_mask = self.pipeline.connectors(
            embeds, mask, padding_side=getattr(self.pipeline.tokenizer, "padding_side", "left"))
        return video, audio, connector_mask

    def _encode(self, prompts, negative_prompt, guidance_scale, device):
        pipe = self.pipeline
        cfg = guidance_scale > 1.0
        embeds, mask, negative, negative_mask = pipe.encode_prompt(
            prompt=list(prompts), negative_prompt=negative_prompt or "", do_classifier_free_guidance=cfg,
            max_sequence_length=self.max_sequence_length, device=device,
        )
        rows = torch.cat([negative, embeds]) if cfg else embeds  # the connectors see the rows __call__ gives them
        video, audio, connector_mask = self._connect(rows, torch.cat([negative_mask, mask]) if cfg else mask)
        if not cfg:
            return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_mask": connector_mask}
        b = len(prompts)
        return {"prompt_embeds": video[b:], "audio_prompt_embeds": audio[b:], "prompt_mask": connector_mask[b:],
                "negative_prompt_embeds": video[:b], "negative_audio_prompt_embeds": audio[:b],
                "negative_prompt_mask": connector_mask[:b]}

    def _timesteps(self, num_steps, device):
        config = self.pipeline.scheduler.config
        (video_tokens, _), _ = self._stream_shapes()
        mu = calculate_shift(video_tokens, config.get("base_image_seq_len", 1024),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                             config.get("max_shift", 2.05))
        retrieve_timesteps(self.pipeline.scheduler, num_steps, device,
                           sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    # -- the model -------------------------------------------------------------------------------------------------
    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        pipe = self.pipeline
        dtype = model_dtype(model)
        b = latents.shape[0]
        video_shape, audio_shape = self._stream_shapes()
        (f, h, w), audio_frames, _ = self._latent_dims()
        video, audio = split_streams(latents, video_shape, audio_shape)
        cfg = guidance_scale > 1.0 and cond.get("negative_prompt_embeds") is not None
        rows = 2 * b if cfg else b

        def both(name):
            return torch.cat([cond[f"negative_{name}"], cond[name]]) if cfg else cond[name]

        fps = conditioning_frame_rate(self.frame_rate, 1.0)
        # the positions from the pipeline's transformer: `model` may be a wrapper (the reference policy); no weights
        video_coords = pipe.transformer.rope.prepare_video_coords(rows, f, h, w, latents.device, fps=fps)
        audio_coords = pipe.transformer.audio_rope.prepare_audio_coords(rows, audio_frames, latents.device)
        timestep = timesteps.reshape(-1).expand(b)
        timestep = (torch.cat([timestep, timestep]) if cfg else timestep).to(dtype)
        mask = both("prompt_mask")
        v_video, v_audio = model(
            hidden_states=(torch.cat([video, video]) if cfg else video).to(dtype),
            audio_hidden_states=(torch.cat([audio, audio]) if cfg else audio).to(dtype),
            encoder_hidden_states=both("prompt_embeds").to(dtype),
            audio_encoder_hidden_states=both("audio_prompt_embeds").to(dtype),
            timestep=timestep, sigma=timestep, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=f, height=h, width=w, fps=fps, audio_num_frames=audio_frames, video_coords=video_coords,
            audio_coords=audio_coords, isolate_modalities=False, spatio_temporal_guidance_blocks=None,
            perturbation_mask=None, use_cross_timestep=True, return_dict=False,
        )
        sigma = (timesteps.reshape(-1).expand(b).float() / pipe.scheduler.config.num_train_timesteps).reshape(b, 1, 1)
        out = []
        for x, v in ((video, v_video.float()), (audio, v_audio.float())):
            if cfg:  # __call__'s delta form in x0-space
                uncond, v = v.chunk(2)
                x0 = x - v * sigma
                x0 = x0 + (guidance_scale - 1) * (x0 - (x - uncond * sigma))
            else:
                x0 = x - v * sigma
            out.append((x - x0) / sigma)
        return pack_streams(*out)

    @torch.no_grad()
    def sample(self, *args, **kwargs):
        """As the base's (``FlowMatchingPolicy.sample``), with the audio stream's waveforms (``decode_audio`` of the
        clean latents) in ``Trajectories.audio``: rewards get them as metadata["audio"] (rewards/base.py)."""
        batch = super().sample(*args, **kwargs)
        batch.audio = self.decode_audio(batch.latents[:, -1])
        return batch

    # -- decoding --------------------------------------------------------------------------------------------------
    def _decode(self, latents):
        pipe = self.pipeline
        video_shape, audio_shape = self._stream_shapes()
        (f, h, w), _, _ = self._latent_dims()
        video, _ = split_streams(latents.float(), video_shape, audio_shape)
        video = pipe._unpack_latents(video, f, h, w, pipe.transformer_spatial_patch_size,
                                     pipe.transformer_temporal_patch_size)
        vae = pipe.vae
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        timestep = video.new_zeros(video.shape[0]) if vae.config.timestep_conditioning else None
        frames = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]
        return (frames.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)

    def decode_audio(self, latents):
        """Waveforms (B, channels, samples) float32 of clean flat latents' audio stream, at ``audio_sample_rate``."""
        pipe = self.pipeline
        video_shape, audio_shape = self._stream_shapes()
        _, audio_frames, mel_bins = self._latent_dims()
        _, audio = split_streams(latents.float(), video_shape, audio_shape)
        audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, audio_frames, num_mel_bins=mel_bins)
        mel = pipe.audio_vae.decode(audio.to(pipe.audio_vae.dtype), return_dict=False)[0]
        return pipe.vocoder(mel.to(pipe.vocoder.dtype)).float()

    def pipeline_kwargs(self, guidance_scale):
        """The ``pipe(...)`` settings the policy samples as (module docstring: plain CFG, the other terms off)."""
        return dict(height=self.height, width=self.width, num_frames=self.num_frames, frame_rate=self.frame_rate,
                    guidance_scale=guidance_scale, audio_guidance_scale=None, stg_scale=0.0, audio_stg_scale=0.0,
                    modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
                    max_sequence_length=self.max_sequence_length)


# ---------------------------------------------------------------------------------------------------
# The offline tiny pipeline


def build_tiny_ltx2_pipeline(seed=0):
    """An LTX2Pipeline with random weights drawn from ``seed`` (CPU, float32), built offline.

    transformer  LTX2VideoTransformer3DModel: 4-channel video latents (2 heads x 8, cross-attention 16) and 4-channel
                 audio tokens (2 heads x 4, cross-attention 8), patch 1, 2 blocks, caption width 16
    text         Gemma-3's text model (Gemma3ForCausalLM: 2 layers of width 16) with the tiny byte-level tokenizer
                 (``tiny_chat``; the pipeline pads it on the left); LTX2TextConnectors with one block of 2 x 8 per
                 stream reading the 3 hidden states
    vae          AutoencoderKLLTX2Video: one block of 8 channels, spatial factor 2, temporal factor 2
                 (5 frames of 32 x 32 <-> 4 x 3 x 16 x 16 latents), no timestep conditioning
    audio        AutoencoderKLLTX2Audio (2 latent channels, 8 mel bins, 16 kHz, hop 160) and LTX2Vocoder
                 (2 channels out, 16 kHz)
    scheduler    FlowMatchEulerDiscreteScheduler with LTX-2's dynamic shift (base / max shift 0.95 / 2.05 over
                 1024 / 4096 tokens)
    Default video: 5 frames of 32 x 32 at 24 fps, 16 text tokens. The global torch RNG state is left unchanged;
    same seed -> same weights.
    """
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = build_tiny_chat_tokenizer("", ())
    width, layers = 16, 2
    with seeded(seed):
        text_encoder = Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=32, num_hidden_layers=layers,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=MAX_POSITIONS,
            pad_token_id=0, sliding_window=64,
        ))
        transformer = LTX2VideoTransformer3DModel(
            in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
            audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
            caption_channels=width, rope_double_precision=False, rope_type="split",
        )
        connectors = LTX2TextConnectors(
            caption_channels=width, text_proj_in_factor=layers + 1, video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=8, video_connector_num_layers=1,
            video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
            audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
            rope_double_precision=False, causal_temporal_positioning=False, rope_type="split",
        )
        vae = AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
            layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
            upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1,
            patch_size_t=1, encoder_causal=True, decoder_causal=False,
        )
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
            resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
            mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
        )
        vocoder = LTX2Vocoder(
            in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
            leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
        )
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096)
    pipeline = LTX2Pipeline(
        scheduler=scheduler, vae=vae.eval(), audio_vae=audio_vae.eval(), text_encoder=text_encoder.eval(),
        tokenizer=tokenizer, connectors=connectors.eval(), transformer=transformer.eval(), vocoder=vocoder.eval(),
    )
    pipeline.default_height = pipeline.default_width = IMAGE_SIZE
    pipeline.default_num_frames = TINY_NUM_FRAMES
    pipeline.default_max_sequence_length = 16
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def build_random_ltx2_pipeline(seed=0, torch_dtype=torch.float32, num_layers=48):
    """LTX-2's architecture with random weights: the transformer, video VAE, audio VAE and vocoder of diffusers'
    LTX2VideoTransformer3DModel / AutoencoderKLLTX2Video / AutoencoderKLLTX2Audio / LTX2Vocoder default configs
    (48 blocks of 32 x 128 video and 32 x 64 audio attention, caption width 3840; 18.88B parameters), created in
    `torch_dtype`; Gemma-3 12B's text model at its real width 3840 (16 heads x 256, 8 KV heads) but 1 layer with a
    256-wide MLP, so LTX2TextConnectors (their default config otherwise) read its 2 hidden states, not 49; the tiny
    byte-level tokenizer and the tiny pipeline's scheduler. `num_layers` fewer transformer blocks: a reduced model,
    for a CPU check of the code path only. For benchmarks/gpu_check.py: its numbers are LTX-2's cost, its videos
    mean nothing."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = build_tiny_chat_tokenizer("", ())
    with seeded(seed), created_in(torch_dtype):
        text_encoder = Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=len(tokenizer), hidden_size=3840, intermediate_size=256, num_hidden_layers=1,
            num_attention_heads=16, num_key_value_heads=8, head_dim=256, max_position_embeddings=MAX_POSITIONS,
            pad_token_id=0, sliding_window=1024,
        ))
        transformer = LTX2VideoTransformer3DModel(num_layers=num_layers)
        connectors = LTX2TextConnectors(text_proj_in_factor=2)
        # LTX-2's 32 x 32 x 8 compression (the transformer's vae_scale_factors (8, 32, 32)), which the class does not
        # derive from its default blocks
        vae = AutoencoderKLLTX2Video(spatial_compression_ratio=32, temporal_compression_ratio=8)
        audio_vae = AutoencoderKLLTX2Audio()
        vocoder = LTX2Vocoder()
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096)
    pipeline = LTX2Pipeline(
        scheduler=scheduler, vae=vae.eval(), audio_vae=audio_vae.eval(), text_encoder=text_encoder.eval(),
        tokenizer=tokenizer, connectors=connectors.eval(), transformer=transformer.eval(), vocoder=vocoder.eval(),
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
