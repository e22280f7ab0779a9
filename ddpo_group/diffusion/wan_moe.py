"""Wan 2.2 A14B: two experts, the high-noise ``transformer`` and the low-noise ``transformer_2`` (``WanPipeline``
with ``boundary_ratio``), as a Flow-GRPO policy.

The pipeline (diffusers' ``WanPipeline.__call__``) runs ``transformer`` at the timesteps t >= boundary =
``boundary_ratio * num_train_timesteps`` with ``guidance_scale`` and ``transformer_2`` after it with
``guidance_scale_2`` (config.sample.guidance_scale_2; 0: the same scale, the pipeline's default). Here:

- the trainable module is ``WanExperts``, one ``nn.Module`` holding both experts; a call names its expert
  (``expert=0`` high-noise, ``1`` low-noise), so DDP, FSDP2 and the reference policy (``reference.py``) see one module;
- a trajectory records which expert made each step: ``Trajectories.extra_cond["experts"]`` (B, T) int64, 0 / 1;
  re-scoring checks that the expert the timestep selects is the recorded one (a changed boundary is an error,
  not a silently different policy), so re-scoring is bit-exact as for one model;
- re-scored rows at steps of both experts in one call are split by expert, each group one model call;
- ``config.train.experts``: "both" (LoRA, or the full fine-tune, on both experts, as Flow-Factory's Wan 2.2 T2V
  recipe, examples/grpo/lora/wan22/t2v.yaml: target_components ['transformer', 'transformer_2']), "high" (the
  high-noise expert only, as its Wan 2.2 I2V recipe: target_modules "transformer.default") or "low"; the other
  expert is frozen in the inference dtype and the optimizer never sees it;
- FSDP2 shards both experts (``shard_blocks``: each expert's blocks, then the root); in a run of several processes
  every model call also runs the expert without rows on one row, its output times 0 added to the result, so every
  process makes the same collective calls (FSDP2's all-gathers and reduce-scatters, DDP's gradient buckets:
  every trained parameter gets a gradient, zero for the idle expert);
- LoRA in diffusers' format: ``lora/`` the high-noise expert's (``pipe.load_lora_weights(dir)``), ``lora_2/`` the
  low-noise expert's (``pipe.load_lora_weights(dir, load_into_transformer_2=True)``); a full fine-tune
  ``transformer/`` and ``transformer_2/`` (``WanTransformer3DModel.from_pretrained``).

``WanExpertsPolicy`` is the base of this family and of Wan image-to-video (``wan_i2v.py``, whose Wan 2.2 A14B
I2V has two experts too): with one transformer it is ``WanPolicy``'s single model.
"""

import os

import torch
import torch.distributed as dist
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

from ddpo_group.diffusion.base import model_dtype, register_family
from ddpo_group.diffusion.flow_policy import LORA_TARGET_MODULES, load_pretrained
from ddpo_group.diffusion.lora import add_lora, has_lora
from ddpo_group.diffusion.tiny import IMAGE_SIZE, TOKENIZER_WORDS, build_tiny_t5_tokenizer, created_in, seeded
from ddpo_group.diffusion.wan import (
    TINY_NUM_FRAMES,
    WanPolicy,
    _umt5_encoder,
    build_tiny_wan_pipeline,
    keep_fp32_modules,
    to_flow_euler,
)

EXPERTS = {"both": (0, 1), "high": (0,), "low": (1,)}
EXPERT_DIRS = ("transformer", "transformer_2")
LORA_DIRS = ("lora", "lora_2")

# Wan-AI/Wan2.2-T2V-A14B-Diffusers: model_index.json boundary_ratio 0.875; each expert's transformer/config.json
# (the published numbers): 40 blocks of 40 heads x 128, FFN 13824, text width 4096, 16 latent channels; 14B each.
WAN22_A14B_BOUNDARY_RATIO = 0.875
WAN22_A14B_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)
TINY_BOUNDARY_RATIO = 0.7  # 4 steps at shift 3 (t = 1000, 858, 602, 9): two steps of each expert


class WanExperts(torch.nn.Module):
    """Wan 2.2 A14B's two experts as one module: ``forward(..., expert=0)`` runs ``transformer`` (high noise),
    ``expert=1`` ``transformer_2`` (low noise), with WanTransformer3DModel's arguments. Delegates to the experts
    what the trainer asks of a diffusers model: adapters on / off (the LoRA reference policy), gradient
    checkpointing."""

    _supports_gradient_checkpointing = True

    def __init__(self, transformer, transformer_2):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2

    @property
    def experts(self):
        return (self.transformer, self.transformer_2)

    @property
    def blocks(self):
        """Both experts' blocks, the high-noise expert's first: the FSDP2 units (``shard_blocks``)."""
        return torch.nn.ModuleList([*self.transformer.blocks, *self.transformer_2.blocks])

    def forward(self, *args, expert=0, **kwargs):
        return self.experts[int(expert)](*args, **kwargs)

    @property
    def _hf_peft_config_loaded(self):
        return any(has_lora(expert) for expert in self.experts)

    def disable_adapters(self):
        for expert in self.experts:
            if has_lora(expert):
                expert.disable_adapters()

    def enable_adapters(self):
        for expert in self.experts:
            if has_lora(expert):
                expert.enable_adapters()

    def enable_gradient_checkpointing(self):
        for expert in self.experts:
            expert.enable_gradient_checkpointing()


def _several_processes():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class WanExpertsPolicy(WanPolicy):
    """A Wan policy whose pipeline may hold two experts (module docstring); one transformer: ``WanPolicy``'s.

    Subclasses give the model's input (``_model_input``: the latents, or image-to-video's latents with the image's
    channels) and extra keyword arguments (``_model_kwargs``)."""

    shard_blocks = ("blocks",)  # each expert's blocks (WanExperts.blocks: both experts'), then the root

    def __init__(self, pipeline):
        super().__init__(pipeline)
        self.guidance_scale_2 = 0.0
        self.trained = EXPERTS["both"]
        self.experts = None
        if self.two_experts:
            self.experts = WanExperts(pipeline.transformer, pipeline.transformer_2)

    @property
    def two_experts(self):
        return getattr(self.pipeline, "transformer_2", None) is not None

    @property
    def boundary(self):
        """The boundary timestep: the high-noise expert at t >= boundary, the low-noise one below."""
        ratio = self.pipeline.config.get("boundary_ratio")
        return float(ratio) * self.pipeline.scheduler.config.num_train_timesteps

    def expert_of(self, timesteps):
        """The expert of each timestep (any shape): 0 (high noise) at t >= boundary, else 1; int64."""
        return (torch.as_tensor(timesteps) < self.boundary).to(torch.int64)

    def configure(self, sde_type="", max_sequence_length=0, resolution=0, **flow_options):
        pipe = self.pipeline
        if self.two_experts and pipe.config.get("boundary_ratio") is None:
            raise ValueError("config.pretrained.model: this Wan pipeline has a transformer_2 but no boundary_ratio "
                             "(its model_index.json): the pipeline would never run transformer_2; set boundary_ratio")
        super().configure(sde_type=sde_type, max_sequence_length=max_sequence_length, resolution=resolution,
                          **flow_options)

    def configure_experts(self, guidance_scale_2=0.0, experts="both"):
        if not self.two_experts:
            return super().configure_experts(guidance_scale_2, experts)
        if experts not in EXPERTS:
            raise ValueError(f"config.train.experts={experts!r} is not one of {list(EXPERTS)}")
        if not guidance_scale_2 >= 0:
            raise ValueError(f"config.sample.guidance_scale_2={guidance_scale_2} must be >= 0 (0: sample.guidance_scale)")
        self.guidance_scale_2, self.trained = float(guidance_scale_2), EXPERTS[experts]

    @property
    def trainable_module(self):
        return self.experts if self.two_experts else self.pipeline.transformer

    @trainable_module.setter
    def trainable_module(self, module):
        if self.two_experts:
            self.experts = module
        else:
            self.pipeline.transformer = module

    def _freeze(self, device, dtype):
        """The frozen parts (VAE, text encoder, an image encoder) in `dtype` on `device`."""
        for name in ("vae", "text_encoder", "image_encoder"):
            part = getattr(self.pipeline, name, None)
            if part is not None:
                part.requires_grad_(False).to(device, dtype=dtype)

    def prepare(self, device, dtype, use_lora, lora_rank=4, lora_alpha=None):
        """Text encoder and VAE frozen in `dtype`; each trained expert with LoRA on its attention projections
        (adapters float32) or trained whole in float32; an expert not trained frozen in `dtype`. Returns the
        trainable module (``WanExperts``, or the one transformer)."""
        if not self.two_experts:
            module = super().prepare(device, dtype, use_lora, lora_rank, lora_alpha)
            self._freeze(device, dtype)  # beyond the flow base's: the image encoder of Wan 2.1 I2V
            return module
        self._freeze(device, dtype)
        for index, expert in enumerate(self.experts.experts):
            if index not in self.trained:
                expert.requires_grad_(False).to(device, dtype=dtype)
            elif use_lora:
                expert.to(device, dtype=dtype)
                for param in add_lora(expert, lora_rank, alpha=lora_alpha, target_modules=LORA_TARGET_MODULES):
                    param.data = param.data.float()
            else:
                expert.requires_grad_(True).to(device, dtype=torch.float32)
            keep_fp32_modules(expert)
        return self.experts

    # --- sampling and re-scoring ----------------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, prompts, num_steps, guidance_scale, eta, *args, **kwargs):
        """The flow base's trajectories; with two experts also the expert of each step, extra_cond["experts"]
        (B, T) int64 (0: the high-noise expert, 1: the low-noise one), the one ``_velocity`` ran. A step of an
        expert that is not trained (config.train.experts) has mask 0: its log-prob has no gradient, the trainer
        skips it as it skips an ODE step."""
        trajectories = super().sample(prompts, num_steps, guidance_scale, eta, *args, **kwargs)
        if self.two_experts:
            experts = self.expert_of(trajectories.timesteps.cpu()).to(trajectories.timesteps.device)
            trajectories.extra_cond = {**(trajectories.extra_cond or {}), "experts": experts}
            if len(self.trained) < 2 and trajectories.mask.shape == experts.shape:
                trained = (experts == self.trained[0]).to(trajectories.mask.device, trajectories.mask.dtype)
                trajectories.mask = trajectories.mask * trained
        return trajectories

    def step_log_prob(self, model, batch, rows, step_index, guidance_scale, eta):
        """The flow base's, after checking that each row's step is re-scored by the expert that sampled it."""
        if self.two_experts:
            recorded = (batch.extra_cond or {}).get("experts")
            if recorded is None:
                raise ValueError("these trajectories do not record their experts (extra_cond['experts']): they "
                                 "were not sampled by this Wan 2.2 model with two experts")
            ar = torch.arange(len(rows), device=batch.timesteps.device)
            step_index = torch.as_tensor(step_index, device=batch.timesteps.device)
            now = self.expert_of(batch.timesteps[rows][ar, step_index].cpu())
            if not torch.equal(now, recorded[rows][ar, step_index].cpu()):
                raise ValueError(f"the boundary timestep {self.boundary:g} (the pipeline's boundary_ratio) now "
                                 "assigns a step to another expert than the one that sampled it")
        return super().step_log_prob(model, batch, rows, step_index, guidance_scale, eta)

    def predict(self, model, x_t, timesteps, batch, rows, guidance_scale):
        """The flow base's; with one expert trained, a prediction with gradient must be that expert's (the forward
        objectives draw their own timesteps: one of the frozen expert has no gradient)."""
        if self.two_experts and len(self.trained) < 2 and torch.is_grad_enabled():
            if (self.expert_of(torch.as_tensor(timesteps).cpu()) != self.trained[0]).any():
                raise ValueError(
                    f"config.train.experts={['high', 'low'][self.trained[0]]!r} trains one expert, but the forward "
                    "objective drew timesteps of the other (frozen) one: set train.experts='both' with "
                    "train.objective='nft' / 'awm'")
        return super().predict(model, x_t, timesteps, batch, rows, guidance_scale)

    def _model_input(self, latents, cond):
        """What the transformer reads for latents (B, C, f, h, w): the latents (image-to-video adds channels)."""
        return latents

    def _model_kwargs(self, cond, dtype):
        return {}

    def _expert_dtype(self, model, expert):
        if not self.two_experts:
            return model_dtype(model)
        return model_dtype(self.pipeline.transformer if expert == 0 else self.pipeline.transformer_2)

    def _velocity(self, model, latents, timesteps, cond, guidance_scale):
        """The velocity (B, C, f, h, w) float32: each row through the expert of its timestep with that expert's
        guidance scale, CFG as ``uncond + w (cond - uncond)`` in the model dtype (the pipeline's)."""
        batch = latents.shape[0]
        timesteps = torch.as_tensor(timesteps, device=latents.device).reshape(-1).expand(batch)
        if not self.two_experts:
            return self._expert_velocity(model, None, latents, timesteps, cond, guidance_scale)
        experts = self.expert_of(timesteps.cpu())
        scales = (guidance_scale, self.guidance_scale_2 or guidance_scale)
        velocity, idle = None, []
        for expert in (0, 1):
            rows = (experts == expert).nonzero().flatten()
            if len(rows) == 0:
                idle.append(expert)
                continue
            if len(rows) == batch:  # every row: the model call of sampling, the same batch composition
                velocity = self._expert_velocity(model, expert, latents, timesteps, cond, scales[expert])
                continue
            part = self._expert_velocity(model, expert, latents[rows], timesteps[rows], _rows(cond, rows, batch),
                                         scales[expert])
            if velocity is None:
                velocity = torch.empty((batch, *part.shape[1:]), dtype=part.dtype, device=part.device)
            velocity = velocity.index_copy(0, rows.to(part.device), part)
        if idle and _several_processes():  # the same collective calls on every process (module docstring)
            expert = idle[0]
            first = torch.zeros(1, dtype=torch.int64, device=latents.device)
            touched = self._expert_velocity(model, expert, latents[:1], timesteps[:1], _rows(cond, first, batch),
                                            scales[expert])
            velocity = velocity + torch.nan_to_num(touched).sum() * 0.0
        return velocity

    def _expert_velocity(self, model, expert, latents, timesteps, cond, guidance_scale):
        dtype = self._expert_dtype(model, expert)
        hidden = self._model_input(latents, cond).to(dtype)
        timestep = timesteps
        if self.pipeline.config.get("expand_timesteps"):
            _, _, f, h, w = latents.shape
            timestep = timestep[:, None].expand(-1, f * (h // 2) * (w // 2))
        extra = self._model_kwargs(cond, dtype)
        if expert is not None:
            extra["expert"] = expert

        def call(embeds):
            return model(hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds.to(dtype),
                         return_dict=False, **extra)[0]

        velocity = call(cond["prompt_embeds"])
        if guidance_scale > 1.0 and cond.get("negative_prompt_embeds") is not None:
            uncond = call(cond["negative_prompt_embeds"])
            velocity = uncond + guidance_scale * (velocity - uncond)  # in the model dtype, as the pipeline does
        return velocity.float()

    # --- checkpoints -------------------------------------------------------------------------------------------

    def save_trainable(self, module, output_dir, use_lora, state_dict=None):
        """Each trained expert in diffusers' format: LoRA into lora/ (high noise) and lora_2/ (low noise), a full
        fine-tune into transformer/ and transformer_2/."""
        if not self.two_experts:
            return super().save_trainable(module, output_dir, use_lora, state_dict)
        from peft import get_peft_model_state_dict

        for index in self.trained:
            expert = module.experts[index]
            part = None if state_dict is None else _sub_state(state_dict, EXPERT_DIRS[index])
            if use_lora:
                type(self.pipeline).save_lora_weights(
                    os.path.join(output_dir, LORA_DIRS[index]),
                    transformer_lora_layers=get_peft_model_state_dict(expert, state_dict=part), safe_serialization=True,
                )
            elif part is not None:  # a sharded full fine-tune's gathered weights
                _save_expert(expert, part, os.path.join(output_dir, EXPERT_DIRS[index]))
            else:
                expert.save_pretrained(os.path.join(output_dir, EXPERT_DIRS[index]), safe_serialization=True)

    def load_trainable(self, module, input_dir, use_lora):
        if not self.two_experts:
            return super().load_trainable(module, input_dir, use_lora)
        for index in self.trained:
            expert = module.experts[index]
            if use_lora:
                from peft import set_peft_model_state_dict

                state = type(self.pipeline).lora_state_dict(os.path.join(input_dir, LORA_DIRS[index]))
                state = state[0] if isinstance(state, tuple) else state
                state = {k.removeprefix("transformer."): v for k, v in state.items() if k.startswith("transformer.")}
                result = set_peft_model_state_dict(expert, state, adapter_name="default")
                if getattr(result, "unexpected_keys", None):
                    raise ValueError(f"LoRA weights in {input_dir} do not fit the model: {result.unexpected_keys[:3]}")
            else:
                from safetensors.torch import load_file

                path = os.path.join(input_dir, EXPERT_DIRS[index], "diffusion_pytorch_model.safetensors")
                expert.load_state_dict(load_file(path))


def _rows(cond, rows, batch):
    """The conditioning of `rows`: every per-row tensor (B, ...) indexed, anything else as it is."""
    return {name: value[rows.to(value.device)] if torch.is_tensor(value) and value.shape[:1] == (batch,) else value
            for name, value in cond.items()}


def _save_expert(expert, state_dict, directory):
    """save_pretrained's layout from a full state dict: config.json (WanTransformer3DModel's, whatever class FSDP2
    made of the expert) and diffusion_pytorch_model.safetensors."""
    import json

    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    config = dict(json.loads(expert.to_json_string()), _class_name=WanTransformer3DModel.__name__)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file({name: value.contiguous() for name, value in state_dict.items()},
              os.path.join(directory, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})


def _sub_state(state_dict, prefix):
    return {key[len(prefix) + 1:]: value for key, value in state_dict.items() if key.startswith(prefix + ".")}


@register_family("wan_moe")
class WanMoEPolicy(WanExpertsPolicy):
    """Wan 2.2 A14B text-to-video (``WanPipeline`` with ``transformer_2`` and ``boundary_ratio``): two experts
    split at the boundary timestep (module docstring); everything else is ``WanPolicy``'s."""

    pipeline_class = WanPipeline
    pipeline_class_names = ()  # a hub or local WanPipeline loads through WanPolicy; load_policy picks this family
    offline_models = ("tiny-wan22-moe", "random-wan22-a14b")

    @classmethod
    def supports(cls, pipeline):
        return isinstance(pipeline, WanPipeline) and getattr(pipeline, "transformer_2", None) is not None

    @classmethod
    def load(cls, model, revision=None, torch_dtype=torch.float32):
        builders = {"tiny-wan22-moe": build_tiny_wan22_moe_pipeline, "random-wan22-a14b": build_random_wan22_a14b_pipeline}
        pipeline = to_flow_euler(load_pretrained(WanPipeline, model, revision, torch_dtype, builders))
        for expert in (pipeline.transformer, pipeline.transformer_2):
            keep_fp32_modules(expert)
        return pipeline


# ---------------------------------------------------------------------------------------------------
# Offline pipelines: the tiny twin (tests, the tiny_wan22_moe variant) and Wan 2.2 A14B's architecture (GPU check)


def tiny_expert(seed, in_channels=4, **overrides):
    """A tiny WanTransformer3DModel (``wan.build_tiny_wan_pipeline``'s sizes) with weights drawn from `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=in_channels, out_channels=4,
            text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            eps=1e-6, rope_max_seq_len=32, **overrides,
        ).eval()


def build_tiny_wan22_moe_pipeline(seed=0):
    """``wan.build_tiny_wan_pipeline``'s WanPipeline (its text encoder, VAE and high-noise transformer) with a
    second tiny transformer of other random weights (seed + 1) as the low-noise expert ``transformer_2`` and
    ``boundary_ratio`` 0.7 (Wan 2.2 A14B T2V's is 0.875): at 4 steps of shift 3 the timesteps 1000, 858 run the
    first expert, 602, 9 the second. CPU, float32, built offline; the global RNG state is left unchanged."""
    base = build_tiny_wan_pipeline(seed)
    pipeline = WanPipeline(
        tokenizer=base.tokenizer, text_encoder=base.text_encoder, transformer=base.transformer, vae=base.vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer_2=tiny_expert(seed + 1),
        boundary_ratio=TINY_BOUNDARY_RATIO,
    )
    pipeline.default_height = pipeline.default_width = IMAGE_SIZE
    pipeline.default_num_frames = TINY_NUM_FRAMES
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def build_random_wan22_a14b_pipeline(seed=0, torch_dtype=torch.float32):
    """Wan 2.2 A14B T2V's architecture with random weights: two ``WAN22_A14B_TRANSFORMER`` experts (14B each)
    created in `torch_dtype`, boundary_ratio 0.875, the Wan VAE's config (AutoencoderKLWan's defaults: Wan 2.1's,
    which A14B uses), a 1-layer UMT5 of the real width 4096. For benchmarks/gpu_check.py: the cost, not videos."""
    from diffusers import AutoencoderKLWan

    tokenizer = build_tiny_t5_tokenizer(TOKENIZER_WORDS)
    with seeded(seed), created_in(torch_dtype):
        transformer = WanTransformer3DModel(**WAN22_A14B_TRANSFORMER)
        transformer_2 = WanTransformer3DModel(**WAN22_A14B_TRANSFORMER)
        vae = AutoencoderKLWan()
        text_encoder = _umt5_encoder(len(tokenizer), d_model=4096, d_ff=256, num_layers=1, num_heads=64, d_kv=64)
    pipeline = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder.eval(), transformer=transformer.eval(), vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer_2=transformer_2.eval(),
        boundary_ratio=WAN22_A14B_BOUNDARY_RATIO,
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
