"""LoRA on the UNet's attention projections through peft, and the base model as reference.

A LoRA layer computes W x + (alpha / r) * B A x with A (r, d_in) drawn Gaussian and
B (d_out, r) = 0 at creation (diffusers' training examples use ``init_lora_weights="gaussian"``),
so a freshly added adapter leaves the UNet's output unchanged. With adapters disabled the
UNet is the base model: the reference policy of docs/design.md §6 at no extra memory.
"""

import math
from contextlib import contextmanager

from peft import LoraConfig

DEFAULT_TARGET_MODULES = ("to_k", "to_q", "to_v", "to_out.0")


def _unwrap(model):
    """The module itself, or the one inside a DDP / compiled wrapper."""
    while hasattr(model, "module") and not hasattr(model, "peft_config"):
        model = model.module
    return getattr(model, "_orig_mod", model)


def add_lora(unet, rank, alpha=None, target_modules=DEFAULT_TARGET_MODULES, adapter_name="default"):
    """Freeze ``unet`` and add a trainable LoRA adapter of rank ``rank`` on ``target_modules``.

    alpha: LoRA alpha (scale alpha / rank); None means alpha = rank (scale 1).
    Returns the list of trainable LoRA parameters.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    unet = _unwrap(unet)
    bound = max_useful_rank(unet, target_modules)
    if bound and rank > bound:  # (no layer matched: peft names the missing targets)
        raise ValueError(
            f"config.lora_rank={rank} is above what the adapted layers can use: B A of a layer d_in -> d_out has rank "
            f"at most min(d_in, d_out), at most {bound} for this model's {', '.join(target_modules)}; a larger rank "
            f"adds memory, checkpoint size and time but nothing the update can express: set config.lora_rank <= {bound}"
        )
    unet.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=rank if alpha is None else alpha,
        init_lora_weights="gaussian",
        target_modules=list(target_modules),
    )
    unet.add_adapter(config, adapter_name=adapter_name)
    return lora_parameters(unet)


def max_useful_rank(model, target_modules=DEFAULT_TARGET_MODULES):
    """max over the layers LoRA adapts (names equal to, or ending in ".<target>", as peft matches them) of
    min(d_in, d_out): the rank of B A (d_out x r times r x d_in) cannot exceed it. 0 when no layer matches."""
    bound = 0
    for name, module in model.named_modules():
        if not any(name == target or name.endswith("." + target) for target in target_modules):
            continue
        if hasattr(module, "in_features"):  # nn.Linear
            bound = max(bound, min(module.in_features, module.out_features))
        elif hasattr(module, "in_channels") and hasattr(module, "kernel_size"):  # a convolution: A is a conv too
            fan_in = module.in_channels // module.groups * math.prod(module.kernel_size)
            bound = max(bound, min(fan_in, module.out_channels))
    return bound


def lora_parameters(unet):
    """The LoRA parameters of ``unet`` (names containing "lora_"), in module order."""
    return [param for name, param in _unwrap(unet).named_parameters() if "lora_" in name]


def has_lora(unet):
    """True when ``unet`` carries at least one peft adapter."""
    return bool(getattr(_unwrap(unet), "_hf_peft_config_loaded", False))


@contextmanager
def disabled_adapters(unet):
    """Run the base model: adapters off inside the block, back on after (requires_grad flags restored).

    A UNet without adapters is left as it is (it already is the base model).
    """
    unet = _unwrap(unet)
    if not has_lora(unet):
        yield unet
        return
    requires_grad = {name: param.requires_grad for name, param in unet.named_parameters()}
    unet.disable_adapters()
    try:
        yield unet
    finally:
        unet.enable_adapters()
        for name, param in unet.named_parameters():
            param.requires_grad_(requires_grad[name])
