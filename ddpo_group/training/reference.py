"""The reference policy pi_ref of the KL term, refreshed by "mixup" (docs/design.md §6).

    theta_ref <- alpha * theta + (1 - alpha) * theta_ref     every `update_freq` optimizer steps

alpha = 1 is a hard sync, update_freq = 0 never updates (pi_ref stays the initial policy).
The reference starts equal to the initial policy. With LoRA and no mixup it is the base
model with the adapters disabled, which costs no memory; otherwise it is a frozen copy of
the trainable parameters only, swapped in with `torch.func.functional_call` (the frozen
weights are shared with the policy). With LoRA the mixup acts on the adapter factors A and
B; the low-rank update B A of the reference is then not exactly the mix of the two updates
(it is bilinear in the factors), as in every LoRA-based mixup.

The same class holds the lagged sampling ("old") model of the forward-process objectives
(docs/forward.md): always a copy of the trainable parameters (``copy=True``; with LoRA the
adapter weights only), moved towards the policy by ``mixup(alpha)`` with the method's schedule.

Under ``train.sharding="fsdp2"`` the copy is a frozen module of its own (``sharded_copy``), sharded exactly as
the policy (ddpo_group/training/sharding.py): its parameters and the policy's are DTensors with the same placements,
so the mixup runs shard by shard on each process with no communication, and the copy is written with the
sharded checkpoint, not as a safetensors file.
"""

import torch

from ddpo_group.config.registry import ConfigError, check_positive, register_config_check
from ddpo_group.diffusion.lora import disabled_adapters


class ReferencePolicy:
    """Callable like the UNet: `ref(sample, t, encoder_hidden_states=...)` runs pi_ref without gradients."""

    def __init__(self, unet, use_lora, mixup_alpha=1.0, update_freq=0, copy=False, sharded_copy=None):
        if not 0.0 < mixup_alpha <= 1.0:
            raise ValueError(f"train.reference_model_mixup_alpha must be in (0, 1], got {mixup_alpha}")
        if update_freq < 0:
            raise ValueError(f"train.reference_update_freq must be >= 0 (0: never), got {update_freq}")
        self.unet = unet
        self.mixup_alpha = float(mixup_alpha)
        self.update_freq = int(update_freq)
        self.uses_disabled_adapters = bool(use_lora) and self.update_freq == 0 and not copy and sharded_copy is None
        self.params = {}
        self.sharded_copy = sharded_copy
        if sharded_copy is not None:  # the copy's parameters of the trainable names (its DTensor shards)
            trainable = {name for name, param in unet.named_parameters() if param.requires_grad}
            self.params = {name: param for name, param in sharded_copy.named_parameters() if name in trainable}
        elif not self.uses_disabled_adapters:
            self.params = {
                name: param.detach().clone() for name, param in unet.named_parameters() if param.requires_grad
            }
        self.num_syncs = 0
        self.steps_since_sync = 0

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        if self.uses_disabled_adapters:
            with disabled_adapters(self.unet):
                return self.unet(*args, **kwargs)
        if self.sharded_copy is not None:
            return self.sharded_copy(*args, **kwargs)
        return torch.func.functional_call(self.unet, self.params, args, kwargs, strict=False)

    @torch.no_grad()
    def mixup(self, alpha=None):
        """theta_ref <- alpha * theta + (1 - alpha) * theta_ref on the trainable parameters (alpha: default mixup_alpha)."""
        if self.uses_disabled_adapters:
            return
        alpha = self.mixup_alpha if alpha is None else float(alpha)
        current = dict(self.unet.named_parameters())
        for name, ref_param in self.params.items():
            ref_param.mul_(1.0 - alpha).add_(current[name].detach().to(ref_param.dtype), alpha=alpha)
        self.num_syncs += 1
        self.steps_since_sync = 0

    def on_optimizer_step(self):
        """Count an optimizer step; mix up when `update_freq` steps have passed. Returns True on a sync."""
        self.steps_since_sync += 1
        if self.update_freq > 0 and self.steps_since_sync >= self.update_freq:
            self.mixup()
            return True
        return False

    def metrics(self):
        return {"ref/num_syncs": self.num_syncs, "ref/steps_since_sync": self.steps_since_sync}

    def state_dict(self):
        """Counters and the reference parameters (empty when the reference is the adapter-free base, or
        sharded: the sharded checkpoint holds it)."""
        params = {} if self.sharded_copy is not None else self.params
        return {
            "num_syncs": self.num_syncs,
            "steps_since_sync": self.steps_since_sync,
            "params": {name: p.detach().cpu().contiguous() for name, p in params.items()},
        }

    def load_state_dict(self, state):
        self.num_syncs = int(state["num_syncs"])
        self.steps_since_sync = int(state["steps_since_sync"])
        params = state.get("params", {})
        if self.sharded_copy is not None:
            if params:
                raise ValueError(
                    "the checkpoint's reference model was written unsharded (train.sharding='none'); this run "
                    "shards it: resume with train.sharding='none'"
                )
            return
        if bool(params) != bool(self.params):
            raise ValueError(
                "the checkpoint's reference model does not match the config: it was written with "
                f"{'a copied' if params else 'an adapter-free'} reference, this run uses "
                f"{'a copied' if self.params else 'an adapter-free'} one; resume with the same use_lora and "
                "train.reference_update_freq (0 with LoRA: adapters disabled; > 0: a copy)"
            )
        if set(params) != set(self.params):
            missing = sorted(set(self.params) - set(params))[:3]
            raise ValueError(
                f"reference checkpoint does not match the model: missing parameters such as {missing}; "
                "was it written with other use_lora / lora_rank settings?"
            )
        for name, value in params.items():
            self.params[name].copy_(value)


@register_config_check("training")
def check_reference(config, machine):
    """The KL loss has its reference model; beta, the mixup alpha and the update frequency hold."""
    train = config.train
    if train.use_kl_loss and not train.use_reference_model:
        raise ConfigError("config.train.use_kl_loss=True needs config.train.use_reference_model=True")
    if train.use_kl_loss and train.beta < 0:
        raise ConfigError(f"config.train.beta={train.beta} must be >= 0")
    if not 0.0 < train.reference_model_mixup_alpha <= 1.0:
        raise ConfigError(
            f"config.train.reference_model_mixup_alpha={train.reference_model_mixup_alpha} must be in (0, 1]"
        )
    check_positive(train.reference_update_freq, "train.reference_update_freq", allow_zero=True)
