"""The models of a training run, built from its config: the policy and its trainable module, the optimizer,
the critic, the reference policy and the policy loss (docs/architecture.md).

The model family (SD, SD3, FLUX, ...) is behind the policy (``ddpo_group.diffusion.policy.load_policy``):
nothing here names a UNet, a VAE or a scheduler. The frozen parts run in the mixed-precision dtype;
LoRA adapters (or a fully trained model) keep float32 master weights (docs/design.md §10).

With ``train.sharding="fsdp2"`` the trainable module and its frozen copies (reference, old model) are sharded
by ``ddpo_group.training.sharding`` instead of being wrapped in DDP by ``accelerator.prepare`` (docs/sharding.md).
"""

import dataclasses
import os

import torch

from ddpo_group.training import sharding as sharding_lib
from ddpo_group.algos import advantages as adv_lib
from ddpo_group.algos import drift_losses  # noqa: F401  (registers the policy losses dppo, grpo_guard)
from ddpo_group.algos.losses import get_policy_loss
from ddpo_group.config.registry import ConfigError, check_positive, register_config_check
from ddpo_group.training.critic import ValueNetwork
from ddpo_group.training.critic_designs import check_critic_config
from ddpo_group.diffusion.base import configure_from_sample
from ddpo_group.diffusion.policy import family_for_model, load_policy
from ddpo_group.training.reference import ReferencePolicy
from ddpo_group.training.rollout import check_group_noise
from ddpo_group.training.speed import compile_denoiser, set_attention_backend


@dataclasses.dataclass
class TrainingModels:
    """policy: the DiffusionPolicy; trainable_module: the module being trained (unwrapped) and model its
    accelerator-prepared view; trainable_params; optimizer; critic_module / critic / critic_optimizer (None
    without a critic); reference: the ReferencePolicy (None without train.use_reference_model); policy_loss:
    the registered loss (its couples_steps says whether one step's loss reads the others)."""

    policy: object
    trainable_module: torch.nn.Module
    model: torch.nn.Module
    trainable_params: list
    optimizer: torch.optim.Optimizer
    critic_module: torch.nn.Module | None
    critic: torch.nn.Module | None
    critic_optimizer: torch.optim.Optimizer | None
    reference: ReferencePolicy | None
    policy_loss: object
    # train.sharding="fsdp2": the sharded frozen copies {"reference" / "old_model": module}, the Stateful of the
    # sharded checkpoint (None unsharded); clip_grad_norm(params, max_norm) -> the global norm before clipping
    sharded_copies: dict = dataclasses.field(default_factory=dict)
    sharded_state: object = None
    clip_grad_norm: object = None


def inference_dtype(config):
    """The dtype of the frozen parts: float16 / bfloat16 under mixed precision, else float32."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.mixed_precision, torch.float32)


def _optimizer_class(train):
    if not train.use_8bit_adam:
        return torch.optim.AdamW
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise ImportError(
            "config.train.use_8bit_adam=True needs bitsandbytes: `pip install bitsandbytes` (GPU only), "
            "or set --config.train.use_8bit_adam=False"
        ) from err
    return bnb.optim.AdamW8bit


@register_config_check("model")
def check_lora_rank(config, machine):
    """config.lora_rank > 0 (the LoRA the policy is prepared with)."""
    check_positive(config.lora_rank, "lora_rank")


def build_models(config, accelerator):
    """Load the policy, configure and prepare it, build the optimizer (and critic), wrap them with the
    accelerator, then the reference (after prepare: DDP has broadcast rank 0's weights, so every rank holds
    the same pi_ref). ConfigError naming the field for a setting the model's family cannot honour."""
    acc, t, s = accelerator, config.train, config.sample
    dtype = inference_dtype(config)
    sharded = t.get("sharding", "none") == "fsdp2"
    sharding_lib.check_sharding_config(config, family_for_model(config.pretrained.model).shard_blocks if sharded else ())
    estimator = adv_lib.get_adv_estimator(config.algorithm.adv_estimator)
    needs_values, needs_step_rewards = estimator.needs_values, estimator.needs_step_rewards
    check_critic_config(config, needs_values)  # before the model loads; the family's part after it
    check_group_noise(config)
    policy = load_policy(config.pretrained.model, revision=config.pretrained.revision or None, torch_dtype=dtype)
    try:
        configure_from_sample(policy, s)
        policy.configure_experts(s.get("guidance_scale_2", 0.0), t.get("experts", "both"))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    try:
        module = policy.prepare(acc.device, dtype, config.use_lora, config.lora_rank, config.lora_alpha or None)
    except ValueError as err:
        if "config." not in str(err):  # a setting this model cannot honour names its field (lora_rank's bound)
            raise
        raise ConfigError(str(err)) from err
    if s.negative_prompt and policy.family in ("flux", "flux2"):
        raise ConfigError(
            f"config.sample.negative_prompt={s.negative_prompt!r}: FLUX.1 / FLUX.2 [dev] has no classifier-free "
            "guidance, so a negative prompt would be ignored; set sample.negative_prompt=''"
        )
    if t.kl_type == "flow_grpo" and not policy.supports_flow_grpo_kl:
        raise ConfigError(
            f"config.train.kl_type='flow_grpo' is Flow-GRPO's KL of a flow-matching step; "
            f"config.pretrained.model={config.pretrained.model!r} is a {policy.family} model: "
            "use train.kl_type='gaussian'"
        )
    if t.gradient_checkpointing:
        if not getattr(module, "_supports_gradient_checkpointing", False):
            raise ConfigError(
                f"config.train.gradient_checkpointing=True: the {type(module).__name__} of "
                f"config.pretrained.model={config.pretrained.model!r} has no gradient checkpointing; "
                "set train.gradient_checkpointing=False"
            )
        module.enable_gradient_checkpointing()  # only under autograd: sampling and no_grad passes are unchanged
    set_attention_backend(module, config.get("attention_backend", ""), config.pretrained.model)
    if config.get("compile", False):  # in place, before DDP and the reference: every caller runs the compiled forward
        compile_denoiser(module)
    copies = _shard(config, policy, module, acc.device) if sharded else {}
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = _optimizer_class(t)(
        params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay,
        eps=t.adam_epsilon,
    )
    check_critic_config(config, needs_values, policy.family, needs_step_rewards)
    critic_module = critic = critic_optimizer = None
    # FSDP2 takes DDP's place: the sharded module and its optimizer are not prepared (the critic, small, is)
    prepared = [] if sharded else [module, optimizer]
    if needs_values and config.critic.get("kind", "network") != "anchor":  # the anchor learns nothing (critic_designs.py)
        critic_module = ValueNetwork(**policy.critic_sizes(), hidden=config.critic.hidden).to(acc.device)
        critic_optimizer = torch.optim.AdamW(critic_module.parameters(), lr=config.critic.learning_rate)
        *prepared, critic, critic_optimizer = acc.prepare(*prepared, critic_module, critic_optimizer)
    elif prepared:
        prepared = acc.prepare(*prepared)
    model, optimizer = prepared if not sharded else (module, optimizer)
    policy.trainable_module = module  # sampling runs the unwrapped module
    reference = None
    if t.use_reference_model:
        reference = ReferencePolicy(module, config.use_lora, t.reference_model_mixup_alpha, t.reference_update_freq,
                                    sharded_copy=copies.get("reference"))
    return TrainingModels(
        policy=policy, trainable_module=module, model=model, trainable_params=params, optimizer=optimizer,
        critic_module=critic_module, critic=critic, critic_optimizer=critic_optimizer, reference=reference,
        policy_loss=get_policy_loss(t.policy_loss), sharded_copies=copies,
        sharded_state=_sharded_state(config, policy, module, optimizer, copies) if sharded else None,
        clip_grad_norm=sharding_lib.clip_grad_norm if sharded else acc.clip_grad_norm_,
    )


def _shard(config, policy, module, device):
    """train.sharding="fsdp2": frozen unsharded copies first (the reference unless it is the adapter-free base,
    the forward objectives' old model), then each of them and the module sharded block by block
    (ddpo_group/training/sharding.py). Returns the copies {name: sharded module}."""
    t = config.train
    copies = {}
    if t.use_reference_model and not (config.use_lora and t.reference_update_freq == 0):
        copies["reference"] = sharding_lib.frozen_copy(module)
    if t.objective != "stepwise":
        copies["old_model"] = sharding_lib.frozen_copy(module)
    for target in [*copies.values(), module]:
        sharding_lib.shard_module(target, policy.shard_blocks, device, sharding_lib.compute_dtype(config),
                                  t.sharding_cpu_offload)
    return copies


def _sharded_state(config, policy, module, optimizer, copies):
    """The sharded checkpoint's Stateful. Its final checkpoint also exports the trained weights in the unsharded
    checkpoint's layout: a full fine-tune into the pipeline's subfolder of the trainable module (unet/ or
    transformer/, ``from_pretrained`` loads it), LoRA adapters into lora/ (``policy.save_trainable``)."""
    subfolder = next((name for name, part in policy.pipeline.components.items() if part is module), "model")

    def exporter(state_dict, directory):
        if config.use_lora:
            policy.save_trainable(module, directory, True, state_dict=state_dict)
        else:
            sharding_lib.save_full_weights(module, state_dict, os.path.join(directory, subfolder))

    return sharding_lib.ShardedState(module, optimizer, copies, exporter=exporter)
